//! Reading a stream: [`Stream::open`] parses and validates the header and resolves the profile
//! once (§3.7); decoding then checks only the chunks it reads (§5.5).

use super::error::{DecodeError, OpenError};
use super::header::Header;
use super::work::PieceWriter;
use crate::block::{ChunkAt, ChunkContext, RowSink};
use crate::consts::CRC_LEN;
use crate::error::Kv;
use crate::kv::{CodingError, Dtype, KvCache, TensorMut};
use crate::limits::Limits;
use crate::profile::Profile;
use alloc::borrow::Cow;
use alloc::vec::Vec;
use core::ops::Range;

/// A parsed stream: header validated, profile resolved; chunks are checked as they are decoded.
///
/// ```
/// use codec_core::{decode, encode, learn_profile, BlockError, DecodeError, EncodeParams};
/// use codec_core::{KvCache, KvMeta, KvShape, LearnParams, Limits, ProfileMode, Sample, Stream};
/// # use codec_core::Tensor;
/// # let shape = KvShape { layers: 1, kv_heads: 1, head_dim: 8, tokens: 40 };
/// # let t = |s: usize| Tensor::F32((0..320).map(|i| ((i * 29 + s) % 97) as f32 / 40.0).collect());
/// # let cache = KvCache { shape, k: vec![t(0)], v: vec![t(5)], meta: KvMeta::default() };
/// // A 40-token cache in chunks of 16 tokens: chunks 0..16, 16..32, 32..40.
/// let profile = learn_profile(&[Sample { kv: cache.view(), queries: None }], &LearnParams::default())?;
/// let params = EncodeParams { chunk_tokens: 16, ..EncodeParams::default() };
/// let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params)?;
///
/// let stream = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT)?;
/// assert_eq!(stream.header().chunks.len(), 3);
/// // Tokens 20..36 read chunks 1 and 2 only.
/// let part = stream.decode_tokens(20..36)?;
/// assert_eq!(part.shape.tokens, 16);
/// assert_eq!(part.meta.first_position, 20);
///
/// // A flipped bit in the last chunk is reported by the block stage, with its spec check.
/// let mut bad = bytes.clone();
/// *bad.last_mut().unwrap() ^= 1;
/// let err = decode(&bad, Some(&profile), &Limits::DEFAULT).unwrap_err();
/// assert!(matches!(err, DecodeError::Block(BlockError::Crc { chunk: 2, .. })));
/// assert_eq!((err.kind(), err.check()), ("ChunkCrc", Some("C1")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Stream<'a> {
    bytes: &'a [u8],
    header: Cow<'a, Header>,
    profile: Cow<'a, Profile>,
}

/// What [`Stream::open`] found, kept apart from the stream's bytes and profile
/// ([`Stream::detach`]): a caller that holds the bytes and decodes from them many times (a
/// binding's handle, decoding chunk by chunk) attaches it again for each decode in constant
/// time, where opening again would parse and check the whole chunk index.
///
/// ```
/// # use codec_core::*;
/// # let shape = KvShape { layers: 1, tokens: 40, kv_heads: 1, head_dim: 8 };
/// # let t = |s: usize| Tensor::F32((0..320).map(|i| ((i * 29 + s) % 97) as f32 / 40.0).collect());
/// # let cache = KvCache { shape, k: vec![t(0)], v: vec![t(5)], meta: KvMeta::default() };
/// # let profile = learn_profile(&[Sample { kv: cache.view(), queries: None }], &LearnParams::default())?;
/// # let params = EncodeParams { chunk_tokens: 16, ..EncodeParams::default() };
/// let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &params)?;
/// let opened = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT)?.detach();
/// for chunk in &opened.header().chunks {
///     let range = chunk.token_start..chunk.token_start + chunk.tokens;
///     let part = opened.attach(&bytes, &profile)?.decode_tokens(range)?;
///     assert_eq!(part.shape.tokens, chunk.tokens);
/// }
/// // Other bytes are refused, not decoded with this index.
/// assert!(opened.attach(&bytes[1..], &profile).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct DetachedStream {
    header: Header,
    /// The length of the bytes it was opened from.
    len: usize,
    /// Their header CRC (the last [`CRC_LEN`] bytes of the header).
    header_crc: [u8; CRC_LEN],
}

impl<'a> Stream<'a> {
    /// Parses a stream's header and index and resolves its profile: the embedded one, or
    /// `profile`, which must then have the hash the stream names.
    ///
    /// A `profile` given for a stream that embeds one is used only if its bytes are the
    /// embedded bytes: it is then what parsing them would give, and is used as it is, so that
    /// a caller opening the same stream again (a binding's handle, decoding chunk by chunk)
    /// neither parses the profile again nor rebuilds its decode tables.
    pub fn open(
        bytes: &'a [u8],
        profile: Option<&'a Profile>,
        limits: &Limits,
    ) -> Result<Self, DecodeError> {
        let header = Header::parse(bytes, limits)?;
        let profile = if header.profile_len > 0 {
            let start = header.header_len();
            let embedded = &bytes[start..start + header.profile_len as usize];
            match profile {
                Some(p) if p.as_bytes() == embedded => Cow::Borrowed(p),
                _ => Cow::Owned(Profile::from_bytes(embedded, limits)?),
            }
        } else {
            let hash = header.profile_hash;
            Cow::Borrowed(profile.ok_or(OpenError::ProfileRequired { hash })?)
        };
        check_profile(&header, &profile)?;
        Ok(Stream {
            bytes,
            header: Cow::Owned(header),
            profile,
        })
    }

    /// What opening found, without the bytes and the profile: attach them again with
    /// [`DetachedStream::attach`]. For a stream that embeds its profile, keep that profile
    /// first (`stream.profile().clone()`): it is the one to attach.
    pub fn detach(self) -> DetachedStream {
        let header = self.header.into_owned();
        let end = header.header_len();
        // Open checked that the header lies within the bytes (H3).
        let mut header_crc = [0; CRC_LEN];
        header_crc.copy_from_slice(&self.bytes[end - CRC_LEN..end]);
        DetachedStream {
            header,
            len: self.bytes.len(),
            header_crc,
        }
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// The profile in use.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }
    /// The chunk context: what [`ChunkContext::decode_chunk`] needs to decode one of the
    /// stream's chunks on its own.
    pub fn context(&self) -> ChunkContext<'_> {
        let h = &self.header;
        ChunkContext::new(
            h.shape,
            h.dtype,
            h.meta.first_position,
            u32::from(h.group),
            h.n_sink,
            &self.profile,
            h.meta.rope,
        )
        .expect("Stream::open checked the group (H18) and the profile's shape (O3)")
    }
    /// The raw bytes of chunk `i` (with its CRC).
    pub fn chunk_bytes(&self, i: usize) -> Result<&'a [u8], DecodeError> {
        let e = self
            .header
            .chunks
            .get(i)
            .ok_or(DecodeError::OutOfRange { what: "chunk" })?;
        Ok(&self.bytes[e.offset as usize..e.offset as usize + e.len_bytes as usize])
    }

    /// Decodes the whole stream into an owned cache in the stream's dtype.
    pub fn decode(&self) -> Result<KvCache, DecodeError> {
        self.decode_tokens(0..self.header.shape.tokens)
    }

    /// Decodes tokens `range` into an owned cache (reads only the chunks that overlap it).
    pub fn decode_tokens(&self, range: Range<u32>) -> Result<KvCache, DecodeError> {
        if range.start > range.end || range.end > self.header.shape.tokens {
            return Err(DecodeError::OutOfRange {
                what: "token range",
            });
        }
        let mut shape = self.header.shape;
        shape.tokens = range.end - range.start;
        let mut meta = self.header.meta.clone();
        meta.first_position = meta.first_position.saturating_add(range.start as u64);
        let mut cache = KvCache::zeros(shape, self.header.dtype, meta);
        {
            let (k, v) = (&mut cache.k, &mut cache.v);
            let mut ks: Vec<TensorMut<'_>> = k.iter_mut().map(|t| t.as_mut()).collect();
            let mut vs: Vec<TensorMut<'_>> = v.iter_mut().map(|t| t.as_mut()).collect();
            self.decode_range_into(range, &mut ks, &mut vs)?;
        }
        Ok(cache)
    }

    /// Decodes the whole stream into an owned cache, with the error its coding is expected to
    /// have left in each (token, KV head) ([`CodingError`]).
    ///
    /// ```
    /// # use codec_core::*;
    /// # let shape = KvShape { layers: 1, tokens: 24, kv_heads: 2, head_dim: 4 };
    /// # let k: Vec<f32> = (0..shape.tensor_len()).map(|i| (i % 7) as f32 * 0.3).collect();
    /// # let v: Vec<f32> = (0..shape.tensor_len()).map(|i| (i % 5) as f32 * 0.2).collect();
    /// # let kv = KvView { shape, k: vec![TensorRef::F32(&k)], v: vec![TensorRef::F32(&v)],
    /// #     meta: KvMeta::default() };
    /// # let profile = learn_profile(&[Sample { kv: kv.clone(), queries: None }], &LearnParams::default())?;
    /// # let bytes = encode(&kv, ProfileMode::Referenced(&profile), &EncodeParams::default())?;
    /// let stream = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT)?;
    /// let (cache, error) = stream.decode_with_error()?;
    /// assert_eq!(cache, stream.decode()?);
    /// assert_eq!(error.k[0].len(), 24 * 2); // per (token, KV head)
    /// assert_eq!(error.k[0][0], 0.0);       // the first token is an attention sink, stored exactly
    /// assert!(error.v[0][2 * 2] > 0.0);     // later tokens were rounded
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_with_error(&self) -> Result<(KvCache, CodingError), DecodeError> {
        let shape = self.header.shape;
        let mut cache = KvCache::zeros(shape, self.header.dtype, self.header.meta.clone());
        let mut error = CodingError::zeros(shape);
        let c = shape.channels();
        let heads = shape.kv_heads as usize;
        let ctx = self.context();
        let (k, v) = (&mut cache.k, &mut cache.v);
        let mut ks: Vec<TensorMut<'_>> = k.iter_mut().map(|t| t.as_mut()).collect();
        let mut vs: Vec<TensorMut<'_>> = v.iter_mut().map(|t| t.as_mut()).collect();
        for (i, e) in self.header.chunks.iter().enumerate() {
            let mut sink = WithErrors {
                writer: RangeWriter {
                    k: &mut ks,
                    v: &mut vs,
                    lo: 0,
                    hi: e.tokens as usize,
                    dst: e.token_start as usize * c,
                    channels: c,
                    dtype: self.header.dtype,
                },
                error: &mut error,
                at: e.token_start as usize * heads,
            };
            let at = ChunkAt {
                chunk: i as u32,
                token_start: e.token_start,
                rows: e.tokens,
                level: e.level,
            };
            ctx.decode_chunk_rows(self.chunk_bytes(i)?, &at, &mut sink)?;
        }
        drop((ks, vs));
        Ok((cache, error))
    }

    /// Decodes the whole stream into the caller's buffers: per layer a K and a V tensor of
    /// `tokens * channels` elements each, of any dtype (values are rounded into it).
    pub fn decode_into<'o>(
        &self,
        k: &mut [TensorMut<'o>],
        v: &mut [TensorMut<'o>],
    ) -> Result<(), DecodeError> {
        self.decode_range_into(0..self.header.shape.tokens, k, v)
    }

    /// Decodes tokens `range` into the caller's buffers (each `range.len() * channels` elements).
    pub fn decode_range_into<'o>(
        &self,
        range: Range<u32>,
        k: &mut [TensorMut<'o>],
        v: &mut [TensorMut<'o>],
    ) -> Result<(), DecodeError> {
        self.decode_range_into_threads(range, k, v, 1)
    }

    /// [`decode_range_into`](Self::decode_range_into) on `threads` threads (0: every core the
    /// process may use; without `std`, one). Each block of a chunk is decoded on its own, so a
    /// single chunk spreads over threads too; the output and the error (the first in stream
    /// order) are the same for every thread count.
    ///
    /// ```
    /// # use codec_core::*;
    /// # let shape = KvShape { layers: 2, tokens: 50, kv_heads: 2, head_dim: 4 };
    /// # let t = |s: usize| Tensor::F16((0..shape.tensor_len()).map(|i| half::f16::from_f32(((i * 13 + s) % 17) as f32 / 8.0)).collect());
    /// # let cache = KvCache { shape, k: vec![t(0), t(1)], v: vec![t(2), t(3)], meta: KvMeta::default() };
    /// # let profile = learn_profile(&[Sample { kv: cache.view(), queries: None }], &LearnParams::default())?;
    /// # let bytes = encode(&cache.view(), ProfileMode::Referenced(&profile), &EncodeParams::default())?;
    /// let stream = Stream::open(&bytes, Some(&profile), &Limits::DEFAULT)?;
    /// let mut out = KvCache::zeros(shape, Dtype::F16, KvMeta::default());
    /// let mut k: Vec<TensorMut<'_>> = out.k.iter_mut().map(Tensor::as_mut).collect();
    /// let mut v: Vec<TensorMut<'_>> = out.v.iter_mut().map(Tensor::as_mut).collect();
    /// stream.decode_range_into_threads(0..50, &mut k, &mut v, 4)?;
    /// drop((k, v));
    /// assert_eq!(out, stream.decode()?); // the same bits as on one thread
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_range_into_threads<'o>(
        &self,
        range: Range<u32>,
        k: &mut [TensorMut<'o>],
        v: &mut [TensorMut<'o>],
        threads: usize,
    ) -> Result<(), DecodeError> {
        let shape = self.header.shape;
        if range.start > range.end || range.end > shape.tokens {
            return Err(DecodeError::OutOfRange {
                what: "token range",
            });
        }
        let c = shape.channels();
        let want = (range.end - range.start) as usize * c;
        if k.len() != shape.layers as usize || v.len() != shape.layers as usize {
            return Err(DecodeError::OutputMismatch {
                what: "number of layers",
            });
        }
        if k.iter().chain(v.iter()).any(|t| t.len() != want) {
            return Err(DecodeError::OutputMismatch {
                what: "tensor length",
            });
        }
        super::work::decode_range(self, range, k, v, threads)
    }
}

impl DetachedStream {
    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The stream again, over `bytes` (those it was opened from) with `profile` (the one it
    /// was opened with, or the one it embeds), in constant time.
    ///
    /// Bytes of another length or another header CRC are refused
    /// ([`DecodeError::OtherBytes`]); so is another profile (check O2).
    /// Other bytes that pass both (the same header over other chunk bytes) decode as those
    /// chunks, each checked as it is read.
    pub fn attach<'a>(
        &'a self,
        bytes: &'a [u8],
        profile: &'a Profile,
    ) -> Result<Stream<'a>, DecodeError> {
        let end = self.header.header_len();
        let crc = bytes.get(end - CRC_LEN..end);
        if bytes.len() != self.len || crc != Some(&self.header_crc[..]) {
            return Err(DecodeError::OtherBytes {
                opened: self.len,
                given: bytes.len(),
            });
        }
        // The hash names the profile's bytes: the one that passed O4 at open, or its equal.
        check_profile_fits(&self.header, profile)?;
        Ok(Stream {
            bytes,
            header: Cow::Borrowed(&self.header),
            profile: Cow::Borrowed(profile),
        })
    }
}

/// O2-O4: the profile is the one the header names and fits it.
fn check_profile(header: &Header, profile: &Profile) -> Result<(), OpenError> {
    check_profile_fits(header, profile)?;
    let levels = profile.levels();
    for (chunk, e) in header.chunks.iter().enumerate() {
        if e.level >= levels {
            let (chunk, level) = (chunk as u32, e.level);
            return Err(OpenError::UnknownLevel {
                chunk,
                level,
                levels,
            });
        }
    }
    Ok(())
}

/// O2-O3: the profile is the one the header names and has its shape.
fn check_profile_fits(header: &Header, profile: &Profile) -> Result<(), OpenError> {
    if profile.hash() != header.profile_hash {
        return Err(OpenError::ProfileMismatch {
            expected: header.profile_hash,
            got: profile.hash(),
        });
    }
    let s = header.shape;
    let ours = [s.layers, s.kv_heads, s.head_dim];
    let theirs = [profile.layers(), profile.kv_heads(), profile.head_dim()];
    if ours != theirs {
        return Err(OpenError::ProfileShape {
            stream: ours,
            profile: theirs,
        });
    }
    Ok(())
}

/// Writes the rows of chunk-local rows `lo..hi` of each block into the caller's tensors, row
/// `lo` going to element `dst` (for [`Stream::decode_range_into`]).
struct RangeWriter<'w, 'o> {
    k: &'w mut [TensorMut<'o>],
    v: &'w mut [TensorMut<'o>],
    lo: usize,
    hi: usize,
    dst: usize,
    channels: usize,
    dtype: Dtype,
}

impl<'o> RangeWriter<'_, 'o> {
    fn tensor(&mut self, layer: u32, kv: Kv) -> &mut TensorMut<'o> {
        match kv {
            Kv::K => &mut self.k[layer as usize],
            Kv::V => &mut self.v[layer as usize],
        }
    }
}

impl RangeWriter<'_, '_> {
    /// The writer of block `(layer, kv)`'s rows into its tensor.
    fn piece(&mut self, layer: u32, kv: Kv) -> PieceWriter<'_> {
        let (c, dtype, dst) = (self.channels, self.dtype, self.dst);
        let (lo, hi) = (self.lo, self.hi);
        let (_, piece) = self.tensor(layer, kv).reborrow().split_at(dst);
        PieceWriter::new(piece, lo..hi, c, dtype)
    }
}

impl RowSink for RangeWriter<'_, '_> {
    fn rows(&mut self, layer: u32, kv: Kv, first: usize, values: &[f32]) {
        self.piece(layer, kv).rows(layer, kv, first, values);
    }
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]) {
        self.piece(layer, kv).block_done(layer, kv, raw_sink);
    }
}

/// A [`RangeWriter`] over a whole chunk that also records the expected coding error of its rows
/// (for [`Stream::decode_with_error`]).
struct WithErrors<'w, 'o> {
    writer: RangeWriter<'w, 'o>,
    error: &'w mut CodingError,
    /// Index in each layer's error vector of the chunk's first (token, head).
    at: usize,
}

impl RowSink for WithErrors<'_, '_> {
    const ERRORS: bool = true;
    fn rows(&mut self, layer: u32, kv: Kv, first: usize, values: &[f32]) {
        self.writer.rows(layer, kv, first, values);
    }
    fn block_done(&mut self, layer: u32, kv: Kv, raw_sink: &[u8]) {
        self.writer.block_done(layer, kv, raw_sink);
    }
    fn errors(&mut self, layer: u32, kv: Kv, first: usize, errors: &[f32]) {
        let heads = self.error.kv_heads as usize;
        let per_layer = match kv {
            Kv::K => &mut self.error.k,
            Kv::V => &mut self.error.v,
        };
        if let Some(dst) = per_layer
            .get_mut(layer as usize)
            .and_then(|l| l.get_mut(self.at + first * heads..))
        {
            dst.iter_mut().zip(errors).for_each(|(d, &e)| *d = e);
        }
    }
}

/// Decodes a whole stream (convenience for [`Stream::open`] + [`Stream::decode`]).
pub fn decode(
    bytes: &[u8],
    profile: Option<&Profile>,
    limits: &Limits,
) -> Result<KvCache, DecodeError> {
    Stream::open(bytes, profile, limits)?.decode()
}
