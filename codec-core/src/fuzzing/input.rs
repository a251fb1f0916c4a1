//! A cursor that turns fuzz bytes into values, never failing.

/// Reads little-endian values from the front of a byte string; reads past the end give zero
/// bytes, so every input, however short, describes some case. After the bytes run out,
/// [`Input::rng`] continues with a deterministic pseudo-random stream seeded from all the bytes,
/// so short inputs can still describe large caches.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    data: &'a [u8],
    seed: u64,
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        // FNV-1a of the whole input: the pseudo-random stream depends on every byte.
        let mut seed = 0xCBF2_9CE4_8422_2325u64;
        for &b in data {
            seed = (seed ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
        }
        Input { data, seed }
    }

    /// `true` once every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.data
    }

    /// Takes up to `n` bytes (fewer if the input ends).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.data.split_at(n.min(self.data.len()));
        self.data = b;
        a
    }

    /// Takes every remaining byte.
    pub fn take_rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        let b = self.bytes(N);
        a[..b.len()].copy_from_slice(b);
        a
    }

    /// One byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    /// A little-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    /// A little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    /// A little-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// The next value of the pseudo-random stream (xorshift64*), independent of the cursor.
    pub fn rng(&mut self) -> u64 {
        let mut x = self.seed | 1;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.seed = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A byte from the input while it lasts, then from [`Input::rng`].
    pub fn u8_or_rng(&mut self) -> u8 {
        if self.data.is_empty() {
            (self.rng() >> 56) as u8
        } else {
            self.u8()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_zero_past_the_end_and_rng_is_deterministic() {
        let mut i = Input::new(&[1, 2, 3]);
        assert_eq!(i.u16(), 0x0201);
        assert_eq!(i.u32(), 3);
        assert!(i.is_empty());
        assert_eq!(i.u64(), 0);
        let a = (i.rng(), i.rng());
        let mut j = Input::new(&[1, 2, 3]);
        j.take_rest();
        assert_eq!(a, (j.rng(), j.rng()));
        assert_ne!(a.0, a.1);
    }
}
