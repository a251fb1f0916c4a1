//! Opening a GGUF file: candle's parser, behind the checks it leaves to its caller.
//!
//! candle bounds every string and array of the header by the file's length, but it divides by
//! `general.alignment` unchecked (a zero panics), and it trusts tensor shapes and offsets: a zero
//! or overflowing dimension, bytes past the end of the file, or tensors sharing bytes (a small
//! file whose every tensor starts at offset 0 would dequantize to terabytes). [`read`] refuses
//! all of these before a tensor is read, so that what the weights take in memory is a small
//! multiple of the file's length (f32 from 2.6-bit Q2_K data: about 12 bytes per file byte).

use crate::error::{candle_reason, LlmError};
use candle_core::quantized::gguf_file::{Content, TensorInfo};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

/// GGUF's magic, `"GGUF"` read as a little-endian u32.
const MAGIC: u32 = u32::from_le_bytes(*b"GGUF");
/// The metadata key whose value places the tensor data.
const ALIGNMENT: &[u8] = b"general.alignment";
/// GGUF's value type codes of a u32, a string and an array.
const U32: u32 = 4;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
/// Arrays nested deeper than this are refused (candle allows 64; no model file nests at all).
const MAX_DEPTH: usize = 8;

/// An open GGUF: its reader and its parsed header.
pub(crate) struct Gguf<R> {
    pub reader: R,
    pub content: Content,
}

/// Opens the GGUF at `path` ([`read`]).
pub(crate) fn open(path: &Path) -> Result<Gguf<File>, LlmError> {
    match File::open(path) {
        Ok(f) => read(f, path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(LlmError::ModelMissing {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(io_err(path, e)),
    }
}

/// Parses the header of the GGUF `r` (named `path` in errors), refusing what candle would panic
/// on or would read past the file's bytes (see the module's description).
pub(crate) fn read<R: Read + Seek>(mut r: R, path: &Path) -> Result<Gguf<R>, LlmError> {
    let gguf_err = |reason: String| LlmError::Gguf {
        path: path.to_path_buf(),
        reason,
    };
    let len = r.seek(SeekFrom::End(0)).map_err(|e| io_err(path, e))?;
    r.rewind().map_err(|e| io_err(path, e))?;
    check_alignment(BufReader::new(&mut r), len).map_err(|e| match e {
        Walk::Io(e) if e.kind() != std::io::ErrorKind::UnexpectedEof => io_err(path, e),
        Walk::Io(_) => gguf_err(format!(
            "the header runs past the end of the file ({len} bytes)"
        )),
        Walk::Bad(reason) => gguf_err(reason),
    })?;
    r.rewind().map_err(|e| io_err(path, e))?;
    let content = Content::read(&mut r).map_err(|e| gguf_err(candle_reason(e)))?;
    check_tensors(&content, len).map_err(gguf_err)?;
    Ok(Gguf { reader: r, content })
}

fn io_err(path: &Path, source: std::io::Error) -> LlmError {
    LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Why the header walk stopped.
enum Walk {
    Io(std::io::Error),
    Bad(String),
}

impl From<std::io::Error> for Walk {
    fn from(e: std::io::Error) -> Self {
        Walk::Io(e)
    }
}

/// A forward cursor over the header that never moves past the file's `len` bytes.
struct Cursor<R> {
    r: BufReader<R>,
    pos: u64,
    len: u64,
    /// Lengths and counts are u64 (GGUF v2 and v3), not u32 (v1).
    wide: bool,
}

impl<R: Read + Seek> Cursor<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], Walk> {
        let mut b = [0; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, Walk> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn length(&mut self) -> Result<u64, Walk> {
        Ok(match self.wide {
            true => u64::from_le_bytes(self.bytes()?),
            false => u64::from(self.u32()?),
        })
    }

    fn skip(&mut self, n: u64) -> Result<(), Walk> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.len => {
                // `n <= len < 2^63`: a file's length is an `i64` to the OS.
                self.r.seek_relative(n as i64)?;
                self.pos = end;
                Ok(())
            }
            _ => Err(Walk::Bad(format!(
                "a header entry of {n} bytes at offset {} runs past the end of the file ({} bytes)",
                self.pos, self.len
            ))),
        }
    }

    /// Skips one value of GGUF type `ty`.
    fn skip_value(&mut self, ty: u32, depth: usize) -> Result<(), Walk> {
        if let Some(size) = fixed_size(ty) {
            return self.skip(size);
        }
        match ty {
            STRING => {
                let n = self.length()?;
                self.skip(n)
            }
            ARRAY if depth < MAX_DEPTH => {
                let (elem, n) = (self.u32()?, self.length()?);
                match fixed_size(elem) {
                    Some(size) => self.skip(n.saturating_mul(size)),
                    // Each element takes at least 4 bytes, so this ends within the file.
                    None => (0..n).try_for_each(|_| self.skip_value(elem, depth + 1)),
                }
            }
            ARRAY => Err(Walk::Bad(format!("arrays nest deeper than {MAX_DEPTH}"))),
            _ => Err(Walk::Bad(format!("unknown metadata value type {ty}"))),
        }
    }
}

/// Bytes of a GGUF value of fixed size, `None` for strings, arrays and unknown types.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// Walks the header's metadata without keeping it and checks every `general.alignment`: a u32
/// power of two, as the GGUF specification and llama.cpp require (candle divides by it).
fn check_alignment<R: Read + Seek>(r: BufReader<R>, len: u64) -> Result<(), Walk> {
    let mut c = Cursor {
        r,
        pos: 0,
        len,
        wide: true,
    };
    let magic = c.u32()?;
    if magic != MAGIC {
        return Err(Walk::Bad(format!("not a GGUF file (magic {magic:#010x})")));
    }
    c.wide = match c.u32()? {
        1 => false,
        2 | 3 => true,
        v => return Err(Walk::Bad(format!("GGUF version {v} is not 1, 2 or 3"))),
    };
    let _tensors = c.length()?;
    let entries = c.length()?;
    // Each entry takes at least 12 bytes, so this ends within the file.
    for _ in 0..entries {
        let key_len = c.length()?;
        let is_alignment = if key_len == ALIGNMENT.len() as u64 {
            c.bytes::<{ ALIGNMENT.len() }>()? == ALIGNMENT
        } else {
            c.skip(key_len)?;
            false
        };
        let ty = c.u32()?;
        if !is_alignment {
            c.skip_value(ty, 0)?;
            continue;
        }
        let a = if ty == U32 { c.u32()? } else { 0 };
        if !a.is_power_of_two() {
            return Err(Walk::Bad(format!(
                "general.alignment must be a u32 power of two (type {ty}, value {a})"
            )));
        }
    }
    Ok(())
}

/// Checks that every tensor has positive dimensions, a whole number of its type's blocks, and
/// bytes within the file that no other tensor uses.
fn check_tensors(content: &Content, len: u64) -> Result<(), String> {
    let mut extents = content
        .tensor_infos
        .iter()
        .map(|(name, t)| {
            let (start, end) = extent(name, t, content.tensor_data_offset, len)?;
            Ok((start, end, name))
        })
        .collect::<Result<Vec<_>, String>>()?;
    extents.sort_unstable();
    match extents.windows(2).find(|w| w[1].0 < w[0].1) {
        Some(w) => Err(format!("tensors {} and {} share bytes", w[0].2, w[1].2)),
        None => Ok(()),
    }
}

/// The file bytes of tensor `name`: its first and one past its last.
fn extent(name: &str, t: &TensorInfo, data_offset: u64, len: u64) -> Result<(u64, u64), String> {
    let dims = t.shape.dims();
    if dims.contains(&0) {
        return Err(format!("tensor {name} has a zero dimension: {dims:?}"));
    }
    let elements = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .ok_or_else(|| format!("tensor {name} has more than 2^64 elements: {dims:?}"))?;
    let block = t.ggml_dtype.block_size() as u64;
    if elements % block != 0 {
        return Err(format!(
            "tensor {name}: {elements} elements are not whole {:?} blocks of {block}",
            t.ggml_dtype
        ));
    }
    let start = data_offset.checked_add(t.offset);
    let end = (elements / block)
        .checked_mul(t.ggml_dtype.type_size() as u64)
        .zip(start)
        .and_then(|(bytes, start)| start.checked_add(bytes));
    match (start, end) {
        (Some(start), Some(end)) if end <= len => Ok((start, end)),
        _ => Err(format!(
            "tensor {name} ({dims:?} {:?} at offset {}) runs past the end of the file ({len} bytes)",
            t.ggml_dtype, t.offset
        )),
    }
}
