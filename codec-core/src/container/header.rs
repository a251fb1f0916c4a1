//! The stream header and chunk index (`spec/FORMAT.md`, "Header").
//!
//! ```text
//! offset size field
//!  0     4    magic "KVCS"
//!  4     2    version (2)
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

use super::error::HeaderError;
use crate::bytes::{crc32c, split_crc, PutLe, Reader};
use crate::consts::{
    group_is_valid, CRC_LEN, HEADER_FIXED_LEN, INDEX_ENTRY_LEN, MAX_MODEL_ID_BYTES, STREAM_MAGIC,
    STREAM_VERSION,
};
use crate::kv::{check_dims, Dtype, KvMeta, KvShape, Rope, RopeStyle};
use crate::limits::Limits;
use alloc::string::String;
use alloc::vec::Vec;

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
        HEADER_FIXED_LEN + self.meta.model_id.len() + INDEX_ENTRY_LEN * self.chunks.len() + CRC_LEN
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

    /// Parses and validates a header against the whole stream `bytes` and `limits`: checks
    /// H1-H32 of `spec/FORMAT.md` §3.7, in order.
    pub fn parse(bytes: &[u8], limits: &Limits) -> Result<Self, HeaderError> {
        let (body, flags) = check_preamble(bytes)?;
        if flags != 0 {
            return Err(HeaderError::Flags { got: flags });
        }
        let mut r = Reader::new(body);
        r.take(12)?;
        let (dtype, rope) = read_codes(&mut r)?;
        let shape = read_shape(&mut r, limits)?;
        let (theta, scaling) = (r.f32()?, r.f32()?);
        if !theta.is_finite() || !scaling.is_finite() {
            return Err(HeaderError::Rope {
                theta_bits: theta.to_bits(),
                scaling_bits: scaling.to_bits(),
            });
        }
        let first_position = r.u64()?;
        let chunk_tokens = r.u32()?;
        let group = r.u16()?;
        let n_sink = r.u16()?;
        if chunk_tokens == 0 {
            return Err(HeaderError::ChunkTokensZero);
        }
        if !group_is_valid(u32::from(group)) {
            return Err(HeaderError::Group { got: group });
        }
        let profile_hash = r.bytes32()?;
        let profile_len = r.u64()?;
        if profile_len > limits.max_profile_bytes {
            let max = limits.max_profile_bytes;
            return Err(HeaderError::ProfileLen {
                got: profile_len,
                max,
            });
        }
        let (n_chunks, model_id) = read_model_id(&mut r, limits, body.len())?;
        let header_len = body.len() + CRC_LEN;
        if (header_len as u64).saturating_add(profile_len) > bytes.len() as u64 {
            return Err(HeaderError::ProfileTruncated {
                needed: profile_len,
                available: (bytes.len() - header_len) as u64,
            });
        }
        let tiling = Tiling {
            first_offset: header_len as u64 + profile_len,
            stream_len: bytes.len() as u64,
            chunk_tokens,
            tokens: shape.tokens,
        };
        let chunks = read_index(&mut r, n_chunks, &tiling)?;
        Ok(Header {
            version: STREAM_VERSION,
            shape,
            dtype,
            meta: KvMeta {
                model_id,
                rope: Rope {
                    theta,
                    scaling,
                    ..rope
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

/// H1-H5: magic, version, `header_len` (at least an empty header's, at most the stream) and the
/// header CRC. Returns the header bytes the CRC covers and the flags.
fn check_preamble(bytes: &[u8]) -> Result<(&[u8], u16), HeaderError> {
    let mut r = Reader::new(bytes);
    let magic = r.bytes_n::<4>()?;
    if magic != STREAM_MAGIC {
        return Err(HeaderError::BadMagic { got: magic });
    }
    let version = r.u16()?;
    if version != STREAM_VERSION {
        return Err(HeaderError::UnsupportedVersion { got: version });
    }
    let flags = r.u16()?;
    let header_len = r.u32()?;
    const MIN: usize = HEADER_FIXED_LEN + CRC_LEN;
    if (header_len as usize) < MIN {
        return Err(HeaderError::HeaderLen {
            got: header_len,
            min: MIN as u32,
        });
    }
    let header = bytes
        .get(..header_len as usize)
        .ok_or(HeaderError::Truncated {
            needed: u64::from(header_len),
            available: bytes.len() as u64,
        })?;
    // `header_len >= 106`, so the split always succeeds; mapped rather than unwrapped.
    let (body, stored) = split_crc(header).ok_or(HeaderError::HeaderLen {
        got: header_len,
        min: MIN as u32,
    })?;
    let computed = crc32c(body);
    if stored != computed {
        return Err(HeaderError::Crc { stored, computed });
    }
    Ok((body, flags))
}

/// H7-H10: dtype, rope style, `k_pre_rope` and the reserved byte. The rotary theta and scaling
/// come later and are left at their defaults.
fn read_codes(r: &mut Reader<'_>) -> Result<(Dtype, Rope), HeaderError> {
    let code = r.u8()?;
    let dtype = Dtype::from_code(code).ok_or(HeaderError::Dtype { got: code })?;
    let code = r.u8()?;
    let style = RopeStyle::from_code(code).ok_or(HeaderError::RopeStyle { got: code })?;
    let pre = r.u8()?;
    if pre > 1 {
        return Err(HeaderError::KPreRope { got: pre });
    }
    let reserved = r.u8()?;
    if reserved != 0 {
        return Err(HeaderError::Reserved { got: reserved });
    }
    let rope = Rope {
        style,
        k_pre_rope: pre == 1,
        ..Rope::default()
    };
    Ok((dtype, rope))
}

/// H11-H15: the shape, against `limits` and this platform's address space.
fn read_shape(r: &mut Reader<'_>, limits: &Limits) -> Result<KvShape, HeaderError> {
    let (layers, kv_heads, head_dim, tokens) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    check_dims(layers, kv_heads, head_dim, limits).map_err(HeaderError::Shape)?;
    if tokens > limits.max_tokens {
        let max = limits.max_tokens;
        return Err(HeaderError::Tokens { got: tokens, max });
    }
    let shape = KvShape {
        layers,
        kv_heads,
        head_dim,
        tokens,
    };
    let elements = shape.total_elements();
    if elements > limits.max_elements {
        return Err(HeaderError::Elements {
            got: elements,
            max: limits.max_elements,
            platform: false,
        });
    }
    // Sizes are computed in usize from here on: one tensor must fit on this platform.
    let tensor = u64::from(tokens) * u64::from(kv_heads) * u64::from(head_dim);
    let max = (usize::MAX / 8) as u64;
    if tensor > max {
        return Err(HeaderError::Elements {
            got: tensor,
            max,
            platform: true,
        });
    }
    Ok(shape)
}

/// H20-H23: the chunk count, the model id's length against the format's cap and `header_len`
/// (`body_len` bytes before the CRC), and the model id itself.
fn read_model_id(
    r: &mut Reader<'_>,
    limits: &Limits,
    body_len: usize,
) -> Result<(u32, String), HeaderError> {
    let n_chunks = r.u32()?;
    if n_chunks > limits.max_chunks {
        let max = limits.max_chunks;
        return Err(HeaderError::Chunks { got: n_chunks, max });
    }
    let id_len = r.u16()?;
    if usize::from(id_len) > MAX_MODEL_ID_BYTES {
        return Err(HeaderError::ModelIdLen {
            got: id_len,
            max: MAX_MODEL_ID_BYTES as u16,
        });
    }
    let expected = (HEADER_FIXED_LEN + usize::from(id_len) + CRC_LEN) as u64
        + INDEX_ENTRY_LEN as u64 * u64::from(n_chunks);
    let got = (body_len + CRC_LEN) as u64;
    if expected != got {
        return Err(HeaderError::HeaderLenMismatch { got, expected });
    }
    let id = core::str::from_utf8(r.take(id_len.into())?)
        .map_err(|_| HeaderError::ModelIdUtf8 { len: id_len })?;
    Ok((n_chunks, String::from(id)))
}

/// Where the chunks must lie: what the index entries are checked against.
struct Tiling {
    /// Offset of chunk 0: `header_len + profile_len`.
    first_offset: u64,
    stream_len: u64,
    chunk_tokens: u32,
    /// The header's token count, which the chunks must add up to.
    tokens: u32,
}

/// H25-H32: the `n_chunks` index entries tile the stream's bytes and tokens.
fn read_index(
    r: &mut Reader<'_>,
    n_chunks: u32,
    tiling: &Tiling,
) -> Result<Vec<ChunkEntry>, HeaderError> {
    let mut chunks = Vec::with_capacity(n_chunks as usize);
    let (mut offset, mut next_token) = (tiling.first_offset, 0u32);
    for chunk in 0..n_chunks {
        let e = ChunkEntry {
            offset: r.u64()?,
            len_bytes: r.u32()?,
            token_start: r.u32()?,
            tokens: r.u32()?,
            level: r.u8()?,
        };
        if r.take(3)? != [0, 0, 0] {
            return Err(HeaderError::IndexReserved { chunk });
        }
        if e.offset != offset {
            let expected = offset;
            return Err(HeaderError::ChunkOffset {
                chunk,
                got: e.offset,
                expected,
            });
        }
        if (e.len_bytes as usize) < CRC_LEN {
            return Err(HeaderError::ChunkLen {
                chunk,
                got: e.len_bytes,
            });
        }
        // Chunks need not all have `chunk_tokens` tokens (§3.3).
        if e.token_start != next_token || e.tokens == 0 || e.tokens > tiling.chunk_tokens {
            return Err(HeaderError::ChunkTokens { chunk });
        }
        offset += u64::from(e.len_bytes);
        if offset > tiling.stream_len {
            return Err(HeaderError::ChunkTruncated {
                chunk,
                needed: offset,
                available: tiling.stream_len,
            });
        }
        next_token = next_token
            .checked_add(e.tokens)
            .ok_or(HeaderError::TokenOverflow { chunk })?;
        chunks.push(e);
    }
    if next_token != tiling.tokens {
        return Err(HeaderError::TokenSum {
            got: next_token,
            expected: tiling.tokens,
        });
    }
    if offset != tiling.stream_len {
        return Err(HeaderError::TrailingBytes {
            end: offset,
            len: tiling.stream_len,
        });
    }
    Ok(chunks)
}
