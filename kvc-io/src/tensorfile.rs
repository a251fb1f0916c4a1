//! A safetensors file laid out in one buffer before any tensor is written: the header exactly as
//! `safetensors::serialize` writes it for the same tensors (the header's keys then sorted, so
//! that the same input gives the same bytes: the crate writes the metadata map in its hash
//! order), and each tensor's place after it. Writers fill the tensors in place, with no
//! per-tensor byte vector and no second copy of the file, and write the buffer once.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use safetensors::tensor::View;
use safetensors::Dtype as StDtype;

use crate::output::{Output, OutputError};

/// A tensor to lay out: its name, dtype and shape.
pub(crate) struct Planned {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
}

impl Planned {
    fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// A tensor without data, for laying out the header: `safetensors` places tensors by their
/// `data_len` and copies `data`, which is empty here.
struct Blank<'a>(&'a Planned);

impl View for Blank<'_> {
    fn dtype(&self) -> StDtype {
        self.0.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.0.byte_len()
    }
}

/// A whole safetensors file in memory, 8-byte aligned, its header written and its tensors
/// zero until filled.
pub(crate) struct FileBuffer {
    /// The file's bytes (`len` of them), in 8-byte words so that every tensor's place is
    /// aligned for its element type (the header is padded to a multiple of 8 and tensors
    /// start at multiples of their element size after it).
    words: Vec<u64>,
    len: usize,
    /// The byte range of each planned tensor in the file, in plan order.
    ranges: Vec<Range<usize>>,
    /// Each planned tensor's element size in bytes.
    #[cfg_attr(target_endian = "little", allow(dead_code))]
    sizes: Vec<usize>,
}

impl FileBuffer {
    /// Lays out `plan` with `metadata` and allocates the file.
    pub(crate) fn new(plan: &[Planned], metadata: HashMap<String, String>) -> Result<Self, String> {
        let blanks = plan.iter().map(|p| (p.name.as_str(), Blank(p)));
        let raw = safetensors::serialize(blanks, Some(metadata)).map_err(|e| e.to_string())?;
        let n = raw
            .first_chunk::<8>()
            .map(|b| u64::from_le_bytes(*b) as usize)
            .filter(|&n| n <= raw.len() - 8)
            .ok_or("safetensors::serialize wrote no header")?;
        // serde_json's maps are sorted by key (its `preserve_order` feature is off).
        let header: serde_json::Value =
            serde_json::from_slice(&raw[8..8 + n]).map_err(|e| e.to_string())?;
        let mut h = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
        h.resize(h.len().next_multiple_of(8), b' ');
        let data_start = 8 + h.len();
        let mut ranges = Vec::with_capacity(plan.len());
        let mut data_len = 0;
        for p in plan {
            let r = data_offsets(&header, &p.name)
                .ok_or_else(|| format!("safetensors placed no tensor {}", p.name))?;
            data_len = data_len.max(r.end);
            ranges.push(data_start + r.start..data_start + r.end);
        }
        let len = data_start + data_len;
        let mut buf = FileBuffer {
            words: vec![0u64; len.div_ceil(8)],
            len,
            ranges,
            sizes: plan.iter().map(|p| p.dtype.bitsize() / 8).collect(),
        };
        let bytes = buf.bytes_mut();
        bytes[..8].copy_from_slice(&(h.len() as u64).to_le_bytes());
        bytes[8..data_start].copy_from_slice(&h);
        Ok(buf)
    }

    /// Writes the file to `out` (whole or not at all), its tensors filled in the machine's byte
    /// order and turned little-endian first.
    pub(crate) fn write(#[allow(unused_mut)] mut self, out: &Output) -> Result<(), OutputError> {
        #[cfg(target_endian = "big")]
        {
            let sizes = self.sizes.clone();
            for (place, size) in self.tensors_mut().into_iter().zip(sizes) {
                place.chunks_exact_mut(size).for_each(|e| e.reverse());
            }
        }
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        out.write(&bytes[..self.len])
    }

    /// The file's size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Every planned tensor's bytes, in plan order.
    pub(crate) fn tensors_mut(&mut self) -> Vec<&mut [u8]> {
        let mut order: Vec<usize> = (0..self.ranges.len()).collect();
        order.sort_by_key(|&i| self.ranges[i].start);
        let ranges = self.ranges.clone();
        let mut slots: Vec<Option<&mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
        let mut rest = self.bytes_mut();
        let mut at = 0;
        for i in order {
            let r = &ranges[i];
            let (_, tail) = rest.split_at_mut(r.start - at);
            let (this, tail) = tail.split_at_mut(r.len());
            slots[i] = Some(this);
            (rest, at) = (tail, r.end);
        }
        slots.into_iter().flatten().collect()
    }
}

/// The `data_offsets` of tensor `name` in a parsed header.
fn data_offsets(header: &serde_json::Value, name: &str) -> Option<Range<usize>> {
    let o = header.get(name)?.get("data_offsets")?.as_array()?;
    let (a, b) = (o.first()?.as_u64()?, o.get(1)?.as_u64()?);
    (a <= b).then_some(a as usize..b as usize)
}
