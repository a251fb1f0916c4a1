//! Bounds-checked little-endian reading and writing, and the CRC-32C every section ends with
//! (`spec/FORMAT.md` §3.4). A short read returns [`Truncated`], which each stage turns into its
//! own error, instead of panicking.

use alloc::vec::Vec;

/// A read ran past the end of its input: `needed` bytes were asked for, `available` were left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncated {
    /// Bytes the read needed.
    pub needed: u64,
    /// Bytes that were left.
    pub available: u64,
}

/// Writes the message of a [`Truncated`] read of `what`, the same for every stage.
pub(crate) fn fmt_truncated(
    f: &mut core::fmt::Formatter<'_>,
    what: &str,
    needed: u64,
    available: u64,
) -> core::fmt::Result {
    write!(
        f,
        "truncated input: {what} needs {needed} bytes, only {available} left"
    )
}

/// A cursor over untrusted bytes.
#[derive(Clone, Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Checks that `n` more bytes are present without reading them.
    pub(crate) fn need(&self, n: u64) -> Result<(), Truncated> {
        if n > self.remaining() as u64 {
            return Err(Truncated {
                needed: n,
                available: self.remaining() as u64,
            });
        }
        Ok(())
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], Truncated> {
        self.need(n as u64)?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn bytes_n<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        self.array()
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, Truncated> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, Truncated> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, Truncated> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, Truncated> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(crate) fn f32(&mut self) -> Result<f32, Truncated> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    pub(crate) fn bytes32(&mut self) -> Result<[u8; 32], Truncated> {
        self.array()
    }
}

/// Little-endian appends to a byte vector.
pub(crate) trait PutLe {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    fn put_f32(&mut self, v: f32);
}

impl PutLe for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_f32(&mut self, v: f32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
}

/// Splits a section that ends with its CRC-32C into the covered bytes and the stored CRC;
/// `None` if it is shorter than the CRC.
pub(crate) fn split_crc(section: &[u8]) -> Option<(&[u8], u32)> {
    let body_len = section.len().checked_sub(4)?;
    let (body, crc) = section.split_at(body_len);
    Some((body, u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]])))
}

/// CRC-32C (Castagnoli, reflected, init and xorout 0xFFFF_FFFF), as in iSCSI.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    #[cfg(feature = "std")]
    {
        crc32c::crc32c(bytes)
    }
    #[cfg(not(feature = "std"))]
    {
        crc32c_table(bytes)
    }
}

/// [`crc32c`] from a table (the `no_std` build's implementation; a test compares the two).
#[cfg_attr(all(feature = "std", not(test)), allow(dead_code))]
pub(crate) fn crc32c_table(bytes: &[u8]) -> u32 {
    const CRC: crc::Crc<u32, crc::Table<16>> =
        crc::Crc::<u32, crc::Table<16>>::new(&crc::CRC_32_ISCSI);
    CRC.checksum(bytes)
}

#[cfg(test)]
mod tests {
    use super::{crc32c, crc32c_table};
    use alloc::vec::Vec;

    #[test]
    fn crc32c_check_value_and_implementations_agree() {
        // The catalogue check value of CRC-32/ISCSI.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c_table(b"123456789"), 0xE306_9283);
        // Every length and alignment the hardware path splits differently.
        let data: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for start in 0..9 {
            for len in (0..600).chain([1023, 1024, 1025, 4096, 4990]) {
                let s = &data[start..(start + len).min(data.len())];
                assert_eq!(crc32c(s), crc32c_table(s), "start {start} len {len}");
            }
        }
    }
}
