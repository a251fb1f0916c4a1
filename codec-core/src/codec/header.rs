//! The stream header and chunk index (`spec/FORMAT.md`, "Header").
//!
//! ```text
//! offset size field
//!  0     4    magic "KVCS"
//!  4     2    version (1)
//!  6     2    flags (must be 0)
//!  8     4    header_len: bytes from offset 0 through the header CRC
//! 12     1    dtype (0 f16, 1 bf16, 2 f32)
//! 13     1    rope style (0 none, 1 NeoX, 2 GPT-J)
//! 14     1    k_pre_rope (0 or 1)
//! 15     1    reserved (0)
//! 16     4    layers
//! 20     4    kv_heads
//! 24     4    head_dim
//! 28     4    tokens
//! 32     4    rope theta (f32)
//! 36     4    rope scaling (f32)
//! 40     8    first_position
//! 48     4    chunk_tokens
//! 52     2    group
//! 54     2    n_sink
//! 56    32    profile hash (SHA-256)
//! 88     8    profile_len (0: referenced; else bytes of the embedded profile after the header)
//! 96     4    n_chunks
//! 100    2    model_id_len
//! 102    m    model id (UTF-8)
//! 102+m  24*n chunk index: offset u64, len_bytes u32, token_start u32, tokens u32, level u8, 3 x 0
//! ...    4    CRC-32C of all preceding header bytes
//! ```

use crate::bytes::{crc32c, PutLe, Reader};
use crate::error::DecodeError;
use crate::kv::{Dtype, KvMeta, KvShape, Rope, RopeStyle};
use crate::limits::{Limits, MAX_GROUP, MAX_MODEL_ID_BYTES};
use alloc::string::String;
use alloc::vec::Vec;

/// Magic bytes of a stream.
pub const STREAM_MAGIC: [u8; 4] = *b"KVCS";
/// Stream format version.
pub const STREAM_VERSION: u16 = 2;
/// Bytes of the header before the model id.
pub const HEADER_FIXED_LEN: usize = 102;
/// Bytes of one chunk index entry.
pub const INDEX_ENTRY_LEN: usize = 24;

/// One chunk index entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkEntry {
    /// Byte offset of the chunk from the start of the stream.
    pub offset: u64,
    /// Bytes of the chunk, CRC included.
    pub len_bytes: u32,
    /// Index of the chunk's first token in the stream.
    pub token_start: u32,
    /// Tokens in the chunk.
    pub tokens: u32,
    /// Level the chunk is coded at.
    pub level: u8,
}

/// A parsed stream header.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// Format version.
    pub version: u16,
    /// Shape of the cache.
    pub shape: KvShape,
    /// Dtype of the source and of the decoded output.
    pub dtype: Dtype,
    /// Metadata.
    pub meta: KvMeta,
    /// Chunk size the encoder used (every chunk has at most this many tokens).
    pub chunk_tokens: u32,
    /// Token-group size.
    pub group: u16,
    /// Sink count.
    pub n_sink: u16,
    /// Hash of the profile.
    pub profile_hash: [u8; 32],
    /// Bytes of the embedded profile (0: not embedded).
    pub profile_len: u64,
    /// The chunk index.
    pub chunks: Vec<ChunkEntry>,
}

impl Header {
    /// Bytes of the serialized header.
    pub fn header_len(&self) -> usize {
        HEADER_FIXED_LEN + self.meta.model_id.len() + INDEX_ENTRY_LEN * self.chunks.len() + 4
    }

    /// Serializes the header, filling in chunk offsets from their lengths.
    pub fn to_bytes(&self) -> Vec<u8> {
        let hl = self.header_len();
        let mut b = Vec::with_capacity(hl);
        b.extend_from_slice(&STREAM_MAGIC);
        b.put_u16(self.version);
        b.put_u16(0);
        b.put_u32(hl as u32);
        b.put_u8(self.dtype.code());
        b.put_u8(self.meta.rope.style as u8);
        b.put_u8(self.meta.rope.k_pre_rope as u8);
        b.put_u8(0);
        b.put_u32(self.shape.layers);
        b.put_u32(self.shape.kv_heads);
        b.put_u32(self.shape.head_dim);
        b.put_u32(self.shape.tokens);
        b.put_f32(self.meta.rope.theta);
        b.put_f32(self.meta.rope.scaling);
        b.put_u64(self.meta.first_position);
        b.put_u32(self.chunk_tokens);
        b.put_u16(self.group);
        b.put_u16(self.n_sink);
        b.extend_from_slice(&self.profile_hash);
        b.put_u64(self.profile_len);
        b.put_u32(self.chunks.len() as u32);
        b.put_u16(self.meta.model_id.len() as u16);
        b.extend_from_slice(self.meta.model_id.as_bytes());
        let mut offset = hl as u64 + self.profile_len;
        for e in &self.chunks {
            b.put_u64(offset);
            b.put_u32(e.len_bytes);
            b.put_u32(e.token_start);
            b.put_u32(e.tokens);
            b.put_u8(e.level);
            b.extend_from_slice(&[0, 0, 0]);
            offset += e.len_bytes as u64;
        }
        let crc = crc32c(&b);
        b.put_u32(crc);
        b
    }

    /// Parses and validates a header against the whole stream `bytes` and `limits`.
    pub fn parse(bytes: &[u8], limits: &Limits) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "stream header");
        let magic: [u8; 4] = r.bytes_n::<4>()?;
        if magic != STREAM_MAGIC {
            return Err(DecodeError::BadMagic {
                what: "stream",
                got: magic,
            });
        }
        let version = r.u16()?;
        if version != STREAM_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                what: "stream",
                got: version,
            });
        }
        let flags = r.u16()?;
        let header_len = r.u32()? as usize;
        if header_len < HEADER_FIXED_LEN + 4 {
            return Err(DecodeError::InvalidField {
                what: "header_len",
                got: header_len as u64,
            });
        }
        if header_len > bytes.len() {
            return Err(DecodeError::Truncated {
                what: "stream header",
                needed: header_len as u64,
                available: bytes.len() as u64,
            });
        }
        let body = &bytes[..header_len - 4];
        let stored = u32::from_le_bytes([
            bytes[header_len - 4],
            bytes[header_len - 3],
            bytes[header_len - 2],
            bytes[header_len - 1],
        ]);
        let computed = crc32c(body);
        if stored != computed {
            return Err(DecodeError::HeaderCrc { stored, computed });
        }
        if flags != 0 {
            return Err(DecodeError::InvalidField {
                what: "flags",
                got: flags as u64,
            });
        }
        let mut r = Reader::new(body, "stream header");
        r.take(12)?;
        let dtype_code = r.u8()?;
        let dtype = Dtype::from_code(dtype_code).ok_or(DecodeError::InvalidField {
            what: "dtype",
            got: dtype_code as u64,
        })?;
        let style_code = r.u8()?;
        let style = RopeStyle::from_code(style_code).ok_or(DecodeError::InvalidField {
            what: "rope style",
            got: style_code as u64,
        })?;
        let pre = r.u8()?;
        if pre > 1 {
            return Err(DecodeError::InvalidField {
                what: "k_pre_rope",
                got: pre as u64,
            });
        }
        let reserved = r.u8()?;
        if reserved != 0 {
            return Err(DecodeError::InvalidField {
                what: "reserved byte",
                got: reserved as u64,
            });
        }
        let layers = r.u32()?;
        let kv_heads = r.u32()?;
        let head_dim = r.u32()?;
        let tokens = r.u32()?;
        crate::profile::check_shape(layers, kv_heads, head_dim, limits)?;
        if tokens > limits.max_tokens {
            return Err(DecodeError::LimitExceeded {
                what: "tokens",
                got: tokens as u64,
                max: limits.max_tokens as u64,
            });
        }
        let shape = KvShape {
            layers,
            kv_heads,
            head_dim,
            tokens,
        };
        let elements = shape.total_elements();
        if elements > limits.max_elements {
            return Err(DecodeError::LimitExceeded {
                what: "decoded elements",
                got: elements,
                max: limits.max_elements,
            });
        }
        // Sizes below are computed in usize: make sure one tensor fits on this platform.
        let tensor_elems = tokens as u64 * kv_heads as u64 * head_dim as u64;
        if tensor_elems > (usize::MAX / 8) as u64 {
            return Err(DecodeError::LimitExceeded {
                what: "tensor elements on this platform",
                got: tensor_elems,
                max: (usize::MAX / 8) as u64,
            });
        }
        let theta = r.f32()?;
        let scaling = r.f32()?;
        if !theta.is_finite() || !scaling.is_finite() {
            return Err(DecodeError::InvalidField {
                what: "rope theta/scaling",
                got: theta.to_bits() as u64,
            });
        }
        let first_position = r.u64()?;
        let chunk_tokens = r.u32()?;
        let group = r.u16()?;
        let n_sink = r.u16()?;
        if chunk_tokens == 0 {
            return Err(DecodeError::InvalidField {
                what: "chunk_tokens",
                got: 0,
            });
        }
        if group == 0 || group as u32 > MAX_GROUP {
            return Err(DecodeError::InvalidField {
                what: "group",
                got: group as u64,
            });
        }
        let profile_hash = r.bytes32()?;
        let profile_len = r.u64()?;
        if profile_len > limits.max_profile_bytes {
            return Err(DecodeError::LimitExceeded {
                what: "embedded profile size",
                got: profile_len,
                max: limits.max_profile_bytes,
            });
        }
        let n_chunks = r.u32()?;
        if n_chunks > limits.max_chunks {
            return Err(DecodeError::LimitExceeded {
                what: "chunks",
                got: n_chunks as u64,
                max: limits.max_chunks as u64,
            });
        }
        let id_len = r.u16()? as usize;
        if id_len > MAX_MODEL_ID_BYTES {
            return Err(DecodeError::LimitExceeded {
                what: "model id length",
                got: id_len as u64,
                max: MAX_MODEL_ID_BYTES as u64,
            });
        }
        let expected_len =
            HEADER_FIXED_LEN as u64 + id_len as u64 + INDEX_ENTRY_LEN as u64 * n_chunks as u64 + 4;
        if expected_len != header_len as u64 {
            return Err(DecodeError::Inconsistent {
                what: "header_len does not match model id and chunk count",
            });
        }
        let model_id =
            core::str::from_utf8(r.take(id_len)?).map_err(|_| DecodeError::InvalidField {
                what: "model id (not UTF-8)",
                got: id_len as u64,
            })?;
        let model_id = String::from(model_id);
        let mut offset = header_len as u64 + profile_len;
        if offset > bytes.len() as u64 {
            return Err(DecodeError::Truncated {
                what: "embedded profile",
                needed: profile_len,
                available: (bytes.len() - header_len) as u64,
            });
        }
        let mut chunks = Vec::with_capacity(n_chunks as usize);
        let mut next_token = 0u32;
        for _ in 0..n_chunks {
            let e = ChunkEntry {
                offset: r.u64()?,
                len_bytes: r.u32()?,
                token_start: r.u32()?,
                tokens: r.u32()?,
                level: r.u8()?,
            };
            if r.take(3)? != [0, 0, 0] {
                return Err(DecodeError::InvalidField {
                    what: "chunk index reserved bytes",
                    got: 1,
                });
            }
            if e.offset != offset {
                return Err(DecodeError::Inconsistent {
                    what: "chunk offsets are not contiguous",
                });
            }
            if e.len_bytes < 4 {
                return Err(DecodeError::InvalidField {
                    what: "chunk len_bytes",
                    got: e.len_bytes as u64,
                });
            }
            let is_last = chunks.len() + 1 == n_chunks as usize;
            if e.token_start != next_token
                || e.tokens == 0
                || e.tokens > chunk_tokens
                || (!is_last && e.tokens != chunk_tokens)
            {
                return Err(DecodeError::Inconsistent {
                    what: "chunk token ranges do not tile the stream",
                });
            }
            offset += e.len_bytes as u64;
            if offset > bytes.len() as u64 {
                return Err(DecodeError::Truncated {
                    what: "chunk",
                    needed: offset,
                    available: bytes.len() as u64,
                });
            }
            next_token = next_token
                .checked_add(e.tokens)
                .ok_or(DecodeError::Inconsistent {
                    what: "chunk token ranges overflow",
                })?;
            chunks.push(e);
        }
        if next_token != tokens {
            return Err(DecodeError::Inconsistent {
                what: "chunk token ranges do not add up to tokens",
            });
        }
        if offset != bytes.len() as u64 {
            return Err(DecodeError::Inconsistent {
                what: "trailing bytes after the last chunk",
            });
        }
        Ok(Header {
            version,
            shape,
            dtype,
            meta: KvMeta {
                model_id,
                rope: Rope {
                    theta,
                    style,
                    scaling,
                    k_pre_rope: pre == 1,
                },
                first_position,
            },
            chunk_tokens,
            group,
            n_sink,
            profile_hash,
            profile_len,
            chunks,
        })
    }
}
