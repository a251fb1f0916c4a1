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
use safetensors::tensor::{Metadata, SafeTensorError, SafeTensors};
use safetensors::Dtype as StDtype;

use crate::dump::{io_err, DumpError};

/// Largest header read from a file, as the `safetensors` crate allows.
const MAX_HEADER: u64 = 100_000_000;

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
        let (n, header) = SafeTensors::read_metadata(bytes).map_err(|e| not_st(path, e))?;
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
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER {
            return Err(not_st(path, SafeTensorError::HeaderTooLarge));
        }
        if n > file_len - 8 {
            return Err(not_st(path, SafeTensorError::InvalidHeaderLength));
        }
        let mut text = vec![0u8; n as usize];
        r.read_exact(&mut text).map_err(io("read"))?;
        let text = std::str::from_utf8(&text)
            .map_err(|e| not_st(path, SafeTensorError::InvalidHeader(e)))?;
        let header: Metadata = serde_json::from_str(text)
            .map_err(|e| not_st(path, SafeTensorError::InvalidHeaderDeserialization(e)))?;
        if (8 + n).checked_add(header.data_len() as u64) != Some(file_len) {
            return Err(not_st(path, SafeTensorError::MetadataIncompleteBuffer));
        }
        Ok(Self::new(path, Src::File(file), 8 + n as usize, &header))
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

fn not_st(path: &Path, e: SafeTensorError) -> DumpError {
    DumpError::NotSafetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}
