//! A safetensors file's header, and its tensors read straight into their own buffers: from a
//! file, only the header is read first (checked as `safetensors` checks a whole file: offsets
//! contiguous, sizes matching shapes, the data ending where the file ends), then each tensor is
//! read from the file into its final vector, with no copy of the whole file in between; from
//! bytes already in memory, each tensor is one copy of its bytes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;

use bytemuck::Pod;
use safetensors::tensor::{Metadata, SafeTensorError};
use safetensors::Dtype as StDtype;

use crate::dump::{io_err, DumpError};

/// Largest header read, in bytes: 8 MiB, far above what a dump needs (the fixtures' are 7-16
/// KB; a tensor's entry takes about 100 bytes) and far below the `safetensors` crate's 100 MB,
/// since parsing a header takes several times its size in memory.
const MAX_HEADER: u64 = 8 << 20;

/// One tensor of the file: its dtype, shape and bytes (offsets from the file's start).
pub(crate) struct Entry {
    dtype: StDtype,
    shape: Vec<usize>,
    at: Range<usize>,
}

impl Entry {
    pub fn dtype(&self) -> StDtype {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// Where the tensors' bytes are.
enum Src<'a> {
    Bytes(&'a [u8]),
    File(&'a File),
}

/// A safetensors file whose header has been read and checked.
pub(crate) struct TensorFile<'a> {
    /// The tensors, by name.
    pub entries: HashMap<String, Entry>,
    /// The header's metadata.
    pub metadata: BTreeMap<String, String>,
    src: Src<'a>,
    path: &'a Path,
}

impl<'a> TensorFile<'a> {
    /// The header of the safetensors file held in `bytes` (`path` labels errors).
    pub fn from_bytes(path: &'a Path, bytes: &'a [u8]) -> Result<Self, DumpError> {
        let len: [u8; 8] = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| not_st(path, SafeTensorError::HeaderTooSmall))?;
        let n = header_len(path, len, bytes.len() as u64)?;
        let header = parse_header(path, &bytes[8..8 + n], bytes.len() as u64)?;
        Ok(Self::new(path, Src::Bytes(bytes), 8 + n, &header))
    }

    /// The header of the safetensors file `file` (at `path`), read from the file alone.
    pub fn open(path: &'a Path, file: &'a File) -> Result<Self, DumpError> {
        let io = |op| move |e| io_err(path, op, e);
        let file_len = file.metadata().map_err(io("read metadata of"))?.len();
        let mut r = file;
        let mut len = [0u8; 8];
        if file_len < 8 {
            return Err(not_st(path, SafeTensorError::HeaderTooSmall));
        }
        r.read_exact(&mut len).map_err(io("read"))?;
        let n = header_len(path, len, file_len)?;
        let mut text = vec![0u8; n];
        r.read_exact(&mut text).map_err(io("read"))?;
        let header = parse_header(path, &text, file_len)?;
        Ok(Self::new(path, Src::File(file), 8 + n, &header))
    }

    fn new(path: &'a Path, src: Src<'a>, data_start: usize, header: &Metadata) -> Self {
        let entries = header
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (s, e) = info.data_offsets;
                let entry = Entry {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    at: data_start + s..data_start + e,
                };
                (name, entry)
            })
            .collect();
        let metadata = header
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        TensorFile {
            entries,
            metadata,
            src,
            path,
        }
    }

    /// The elements of `entry`, read straight into the vector returned; `T` must be the size of
    /// the entry's dtype (the callers match them), so that the header's check of the byte length
    /// against the shape is the check of the element count.
    pub fn read<T: Pod>(&self, entry: &Entry) -> Result<Vec<T>, DumpError> {
        let size = std::mem::size_of::<T>();
        let mut out = vec![T::zeroed(); entry.at.len() / size];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        let at = entry.at.start..entry.at.start + bytes.len();
        match self.src {
            Src::Bytes(b) => bytes.copy_from_slice(&b[at]),
            Src::File(f) => {
                let io = |e| io_err(self.path, "read", e);
                let mut r = f;
                r.seek(SeekFrom::Start(at.start as u64)).map_err(io)?;
                r.read_exact(bytes).map_err(io)?;
            }
        }
        // The file is little-endian.
        if cfg!(target_endian = "big") {
            bytes.chunks_exact_mut(size).for_each(<[u8]>::reverse);
        }
        Ok(out)
    }
}

/// The header's length from the file's first 8 bytes, checked against [`MAX_HEADER`] and the
/// file's length (`file_len`, at least 8).
fn header_len(path: &Path, len: [u8; 8], file_len: u64) -> Result<usize, DumpError> {
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(not_st(path, SafeTensorError::HeaderTooLarge));
    }
    if n > file_len - 8 {
        return Err(not_st(path, SafeTensorError::InvalidHeaderLength));
    }
    Ok(n as usize)
}

/// The header `text` (the `n` bytes after the length), checked as the `safetensors` crate
/// checks a file (offsets contiguous, sizes matching shapes), and its data ending where the
/// file (`file_len` bytes) ends, with no sum that can overflow.
fn parse_header(path: &Path, text: &[u8], file_len: u64) -> Result<Metadata, DumpError> {
    let text =
        std::str::from_utf8(text).map_err(|e| not_st(path, SafeTensorError::InvalidHeader(e)))?;
    let header: Metadata = serde_json::from_str(text)
        .map_err(|e| not_st(path, SafeTensorError::InvalidHeaderDeserialization(e)))?;
    let end = (8 + text.len() as u64).checked_add(header.data_len() as u64);
    if end != Some(file_len) {
        return Err(not_st(path, SafeTensorError::MetadataIncompleteBuffer));
    }
    Ok(header)
}

fn not_st(path: &Path, e: SafeTensorError) -> DumpError {
    DumpError::NotSafetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}
