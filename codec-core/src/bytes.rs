//! Bounds-checked little-endian reading and writing. Every read returns
//! [`DecodeError::Truncated`] instead of panicking when the input is short.

use crate::error::DecodeError;
use alloc::vec::Vec;

/// A cursor over untrusted bytes.
#[derive(Clone, Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return Err(DecodeError::Truncated {
                what: self.what,
                needed: n as u64,
                available: self.remaining() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn bytes_n<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        self.array()
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(crate) fn f32(&mut self) -> Result<f32, DecodeError> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    pub(crate) fn bytes32(&mut self) -> Result<[u8; 32], DecodeError> {
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
