//! The bytes of one block (`spec/FORMAT.md` §5.2), read and written here only.
//!
//! ```text
//! size           field
//! 4              n_escapes (u32, <= n_sym)
//! 4 * 32         lane_len: words in lane 0 .. lane 31 (u32 each)
//! 1              n_exp: 0 (no exponent section) or 2..=16
//! 2 * n_exp      exp_freqs: the exponent table (u16 each, >= 1, sum 4096), if n_exp > 0
//! S * C * dsize  sink rows, row-major, in the stream dtype
//! 4 * n_escapes  escape values (i32), in increasing symbol index
//! 4 * sum(lane_len)  lane words (u32): lane 0's, then lane 1's, ...
//! ```

use super::error::BlockError;
use crate::bytes::{PutLe, Reader};
use crate::consts::{LANES, MAX_EXP};
use crate::kv::TensorRef;
use crate::rans::FreqTable;
use alloc::vec::Vec;
use core::ops::Range;

/// One block's sections as they lie in its chunk, after checks B1-B5.
#[derive(Debug)]
pub(crate) struct BlockParts<'a> {
    /// Words per lane.
    pub lane_len: [usize; LANES],
    /// The exponent table, if the block has an exponent section (`n_exp > 0`).
    pub exp_table: Option<FreqTable>,
    /// The sink rows' stored bytes.
    pub raw_sink: &'a [u8],
    /// The escape values' bytes (`4 * n_escapes`).
    pub escapes: &'a [u8],
    /// The lane words' bytes.
    pub words: &'a [u8],
}

impl BlockParts<'_> {
    /// The escape values, in stored order.
    pub fn escape_values(&self) -> impl Iterator<Item = i32> + '_ {
        self.escapes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Reads the next block of a chunk with `n_sym` value symbols and `sink_bytes` bytes of sink
/// rows: checks B1-B5.
pub(crate) fn read_block<'a>(
    r: &mut Reader<'a>,
    n_sym: usize,
    sink_bytes: usize,
) -> Result<BlockParts<'a>, BlockError> {
    let n_escapes = r.u32()?;
    if n_escapes as usize > n_sym {
        return Err(BlockError::EscapeCount {
            got: u64::from(n_escapes),
            max: n_sym as u64,
        });
    }
    let mut lane_len = [0usize; LANES];
    let mut total_words = 0u64;
    for l in lane_len.iter_mut() {
        *l = r.u32()? as usize;
        total_words += *l as u64;
    }
    let n_exp = r.u8()?;
    if n_exp == 1 || n_exp > MAX_EXP + 1 {
        return Err(BlockError::ExpAlphabet { got: n_exp });
    }
    let exp_table = if n_exp > 0 {
        let mut f = [0u16; 16];
        for x in f.iter_mut().take(n_exp.into()) {
            *x = r.u16()?;
        }
        Some(FreqTable::new(&f[..n_exp.into()]).map_err(BlockError::ExpTable)?)
    } else {
        None
    };
    let raw_sink = r.take(sink_bytes)?;
    let escapes = r.take(n_escapes as usize * 4)?;
    let needed = total_words * 4;
    if r.need(needed).is_err() {
        let available = r.remaining() as u64;
        return Err(BlockError::LaneWords { needed, available });
    }
    let words = r.take(needed as usize)?;
    Ok(BlockParts {
        lane_len,
        exp_table,
        raw_sink,
        escapes,
        words,
    })
}

/// What an encoded block holds besides its sink rows.
pub(crate) struct BlockOut<'a> {
    /// Each lane's words.
    pub lanes: &'a [Vec<u32>; LANES],
    /// The exponent table, if the block has exponents.
    pub exp_table: Option<&'a FreqTable>,
    /// The escape values.
    pub escapes: &'a [i32],
}

/// Appends a block to `out`: its fields, the sink rows `sink` of `tensor` (element range) and
/// the sections of `block`.
pub(crate) fn write_block(
    out: &mut Vec<u8>,
    block: &BlockOut<'_>,
    tensor: TensorRef<'_>,
    sink: Range<usize>,
) {
    out.put_u32(block.escapes.len() as u32);
    for l in block.lanes {
        out.put_u32(l.len() as u32);
    }
    match block.exp_table {
        Some(t) => {
            out.put_u8(t.len() as u8);
            t.freqs().iter().for_each(|f| out.put_u16(*f));
        }
        None => out.put_u8(0),
    }
    match tensor {
        TensorRef::F16(s) => s[sink].iter().for_each(|x| out.put_u16(x.to_bits())),
        TensorRef::Bf16(s) => s[sink].iter().for_each(|x| out.put_u16(x.to_bits())),
        TensorRef::F32(s) => s[sink].iter().for_each(|x| out.put_f32(*x)),
    }
    let words: usize = block.lanes.iter().map(Vec::len).sum();
    out.reserve(4 * (block.escapes.len() + words));
    for e in block.escapes {
        out.put_u32(*e as u32);
    }
    for lane in block.lanes {
        for w in lane {
            out.put_u32(*w);
        }
    }
}
