//! Writing a stream: the encoding parameters and [`encode`], which lays out the header, the
//! embedded profile and the chunks (§3.1).

use super::header::{ChunkEntry, Header};
use crate::block::{ChunkContext, ChunkEncoder};
use crate::bytes::PutLe;
use crate::consts::{MAX_GROUP, MAX_MODEL_ID_BYTES, STREAM_VERSION};
use crate::error::EncodeError;
use crate::kv::KvView;
use crate::profile::Profile;
use alloc::vec;
use alloc::vec::Vec;

/// How the stream refers to its profile.
#[derive(Clone, Copy, Debug)]
pub enum ProfileMode<'a> {
    /// The stream carries only the profile's hash; decoding needs the same profile.
    Referenced(&'a Profile),
    /// The stream embeds the profile and decodes alone (self-contained). What is embedded is
    /// the profile without its importance hints ([`Profile::without_importance`]), which
    /// decoding never reads; the stream's profile hash is that profile's.
    Embedded(&'a Profile),
}

impl<'a> ProfileMode<'a> {
    fn profile(&self) -> &'a Profile {
        match self {
            ProfileMode::Referenced(p) | ProfileMode::Embedded(p) => p,
        }
    }
}

/// Encoding parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodeParams {
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Tokens per group (anchor + deltas).
    pub group: u32,
    /// Tokens at absolute positions below this are stored exactly.
    pub n_sink: u16,
    /// Level of each chunk; a single entry applies to all chunks.
    pub levels: Vec<u8>,
    /// Give tokens that future queries will barely read coarser steps (`spec/FORMAT.md` §9.2),
    /// when the profile carries the hints for it.
    pub token_importance: bool,
}

impl EncodeParams {
    /// Default chunk size in tokens (CacheGen's ~1.5K).
    pub const DEFAULT_CHUNK_TOKENS: u32 = 1536;
    /// Default token-group size.
    pub const DEFAULT_GROUP: u32 = 10;
    /// Largest token-group size (groups are `1..=MAX_GROUP` tokens).
    pub const MAX_GROUP: u32 = MAX_GROUP;
    /// Default number of sink tokens stored exactly.
    pub const DEFAULT_SINK: u16 = 1;
    /// Default level: the coarsest of the default ladder's levels whose attention error stays
    /// near 0.1 (see the README's results).
    pub const DEFAULT_LEVEL: u8 = 7;
}

impl Default for EncodeParams {
    fn default() -> Self {
        EncodeParams {
            chunk_tokens: Self::DEFAULT_CHUNK_TOKENS,
            group: Self::DEFAULT_GROUP,
            n_sink: Self::DEFAULT_SINK,
            levels: vec![Self::DEFAULT_LEVEL],
            token_importance: true,
        }
    }
}

/// Encodes a cache into a stream.
///
/// The encoder keeps to the format's own bounds, not to a decoder's
/// [`Limits`](crate::Limits): a stream past [`Limits::DEFAULT`](crate::Limits::DEFAULT) (more
/// than 2^32 elements, say) is written, and decodes under limits raised to hold it. The
/// bindings, whose decoders keep to the defaults, refuse such a cache before encoding it.
pub fn encode(
    view: &KvView<'_>,
    profile: ProfileMode<'_>,
    params: &EncodeParams,
) -> Result<Vec<u8>, EncodeError> {
    encode_threads(view, profile, params, 1)
}

/// [`encode`] on `threads` threads (0: every core the process may use; without `std`, one): the
/// layers of every chunk are coded on their own, and the stream is the same, byte for byte, for
/// every thread count.
///
/// ```
/// # use codec_core::*;
/// # let shape = KvShape { layers: 3, tokens: 40, kv_heads: 1, head_dim: 8 };
/// # let t = |s: usize| Tensor::F32((0..shape.tensor_len()).map(|i| ((i * 7 + s) % 23) as f32 / 9.0).collect());
/// # let cache = KvCache { shape, k: vec![t(0), t(1), t(2)], v: vec![t(3), t(4), t(5)], meta: KvMeta::default() };
/// let profile = learn_profile(&[Sample { kv: cache.view(), queries: None }], &LearnParams::default())?;
/// let params = EncodeParams { chunk_tokens: 16, ..EncodeParams::default() };
/// let mode = ProfileMode::Referenced(&profile);
/// let one = encode(&cache.view(), mode, &params)?;
/// assert_eq!(encode_threads(&cache.view(), mode, &params, 3)?, one);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn encode_threads(
    view: &KvView<'_>,
    profile: ProfileMode<'_>,
    params: &EncodeParams,
    threads: usize,
) -> Result<Vec<u8>, EncodeError> {
    let StreamFrame {
        mut header,
        profile: embedded,
        context: ctx,
    } = stream_frame(view, profile, params)?;
    let mut out = header.to_bytes();
    let header_len = out.len();
    out.extend_from_slice(&embedded);
    append_chunks(&ctx, view, &mut header.chunks, threads, &mut out)?;
    let bytes = header.to_bytes();
    debug_assert_eq!(bytes.len(), header_len);
    out[..header_len].copy_from_slice(&bytes);
    Ok(out)
}

/// What [`encode`] writes around a stream's chunks, and what they are coded against: for
/// encoders that code the chunks elsewhere (codec-cuda's device chain) and then [`assemble`]
/// the stream.
#[derive(Debug)]
pub struct StreamFrame<'p> {
    /// The header, every chunk's entry filled but its length (0 until [`assemble`]).
    pub header: Header,
    /// The profile bytes the stream embeds (empty if it references its profile).
    pub profile: Vec<u8>,
    /// The context every chunk is coded against (`ChunkContext::encode_chunk`).
    pub context: ChunkContext<'p>,
}

/// The frame of the stream [`encode`] writes for `view` with `profile` and `params`: its
/// header, embedded profile and chunk context, after the same checks.
///
/// ```
/// # use codec_core::*;
/// # let shape = KvShape { layers: 2, tokens: 40, kv_heads: 1, head_dim: 8 };
/// # let t = |s: usize| Tensor::F32((0..shape.tensor_len()).map(|i| ((i * 7 + s) % 23) as f32 / 9.0).collect());
/// # let cache = KvCache { shape, k: vec![t(0), t(1)], v: vec![t(3), t(4)], meta: KvMeta::default() };
/// let profile = learn_profile(&[Sample { kv: cache.view(), queries: None }], &LearnParams::default())?;
/// let params = EncodeParams { chunk_tokens: 16, ..EncodeParams::default() };
/// let mode = ProfileMode::Embedded(&profile);
/// let frame = stream_frame(&cache.view(), mode, &params)?;
/// let chunks: Vec<(u8, Vec<u8>)> = frame.header.chunks.iter().map(|e| {
///     let tokens = e.token_start..e.token_start + e.tokens;
///     (e.level, frame.context.encode_chunk(&cache.view(), tokens, e.level).unwrap())
/// }).collect();
/// let parts: Vec<(u8, &[u8])> = chunks.iter().map(|(l, b)| (*l, b.as_slice())).collect();
/// let stream = assemble(&frame.header, &parts, &frame.profile)?;
/// assert_eq!(stream, encode(&cache.view(), mode, &params)?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stream_frame<'p>(
    view: &KvView<'_>,
    profile: ProfileMode<'p>,
    params: &EncodeParams,
) -> Result<StreamFrame<'p>, EncodeError> {
    let n_chunks = check_frame(view, params)?;
    let p = profile.profile();
    let meta = &view.meta;
    let context = ChunkContext::new(
        view.shape,
        view.k[0].dtype(),
        meta.first_position,
        params.group,
        params.n_sink,
        p,
        meta.rope,
    )?
    .with_query_position(
        params
            .token_importance
            .then(|| meta.first_position.saturating_add(u64::from(view.shape.tokens))),
    );
    // A self-contained stream embeds the profile without its importance hints: decoding never
    // reads them (FORMAT.md §4.3), and they cost ~4 bytes per (layer, channel).
    let embedded = match profile {
        ProfileMode::Embedded(p) => Some(p.without_importance()),
        ProfileMode::Referenced(_) => None,
    };
    let header = Header {
        version: STREAM_VERSION,
        shape: view.shape,
        dtype: context.dtype(),
        meta: meta.clone(),
        chunk_tokens: params.chunk_tokens,
        group: params.group as u16,
        n_sink: params.n_sink,
        profile_hash: embedded.as_ref().unwrap_or(p).hash(),
        profile_len: embedded.as_ref().map_or(0, |e| e.as_bytes().len() as u64),
        chunks: chunk_entries(view.shape.tokens, params, n_chunks),
    };
    let profile = embedded.map_or_else(Vec::new, |e| e.as_bytes().to_vec());
    Ok(StreamFrame {
        header,
        profile,
        context,
    })
}

/// `encode`'s checks of `view` and `params` before anything is coded; the number of chunks.
fn check_frame(view: &KvView<'_>, params: &EncodeParams) -> Result<u32, EncodeError> {
    view.check()?;
    if params.chunk_tokens == 0 {
        return Err(EncodeError::InvalidParam {
            what: "chunk_tokens",
            got: 0,
        });
    }
    if view.meta.model_id.len() > MAX_MODEL_ID_BYTES {
        return Err(EncodeError::InvalidParam {
            what: "model id length",
            got: view.meta.model_id.len() as u64,
        });
    }
    // The header stores them and decoders reject non-finite ones (spec/FORMAT.md §3.7, H16).
    for x in [view.meta.rope.theta, view.meta.rope.scaling] {
        if !x.is_finite() {
            return Err(EncodeError::InvalidParam {
                what: "rope theta/scaling (not finite)",
                got: u64::from(x.to_bits()),
            });
        }
    }
    let tokens = view.shape.tokens;
    let n_chunks = tokens.div_ceil(params.chunk_tokens);
    if params.levels.is_empty()
        || (params.levels.len() != 1 && params.levels.len() != n_chunks as usize)
    {
        return Err(EncodeError::ChunkLevels {
            given: params.levels.len(),
            tokens,
            chunk_tokens: params.chunk_tokens,
        });
    }
    Ok(n_chunks)
}

/// The header's chunk entries for `tokens` in chunks of `params.chunk_tokens`, each at its
/// level (one for all, or one per chunk); offsets and lengths 0 until the chunks are coded.
fn chunk_entries(tokens: u32, params: &EncodeParams, n_chunks: u32) -> Vec<ChunkEntry> {
    (0..n_chunks)
        .map(|i| {
            let start = i * params.chunk_tokens;
            let end = start.saturating_add(params.chunk_tokens).min(tokens);
            let level = if params.levels.len() == 1 {
                params.levels[0]
            } else {
                params.levels[i as usize]
            };
            ChunkEntry {
                offset: 0,
                len_bytes: 0,
                token_start: start,
                tokens: end - start,
                level,
            }
        })
        .collect()
}

/// Appends every chunk of `chunks` to `out` and records its length, the layers of all chunks
/// coded as independent jobs on `threads` threads.
fn append_chunks(
    ctx: &ChunkContext<'_>,
    view: &KvView<'_>,
    chunks: &mut [ChunkEntry],
    threads: usize,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let layers = ctx.shape().layers;
    let jobs: Vec<(usize, u32)> = (0..chunks.len())
        .flat_map(|c| (0..layers).map(move |l| (c, l)))
        .collect();
    let entries: &[ChunkEntry] = chunks;
    let coded = crate::threads::run(
        jobs,
        threads,
        || (ChunkEncoder::new(ctx), usize::MAX),
        |(encoder, current), (c, layer)| {
            let e = &entries[c];
            if *current != c {
                *current = usize::MAX;
                let tokens = e.token_start..e.token_start + e.tokens;
                encoder.start_chunk(view, tokens, e.level)?;
                *current = c;
            }
            let mut bytes = Vec::new();
            encoder.append_layer(view, layer, &mut bytes);
            Ok(bytes)
        },
    );
    let mut coded = coded.into_iter();
    for entry in chunks.iter_mut() {
        let first = out.len();
        for layer in coded.by_ref().take(layers as usize) {
            out.extend_from_slice(&layer?);
        }
        let crc = crate::bytes::crc32c(&out[first..]);
        out.put_u32(crc);
        let len = out.len() - first;
        entry.len_bytes = u32::try_from(len).map_err(|_| EncodeError::InvalidParam {
            what: "chunk size in bytes (over 4 GiB: use fewer chunk tokens)",
            got: len as u64,
        })?;
    }
    Ok(())
}

/// A stream of chunks coded at any mix of levels: `template` is the header of a stream of the
/// same cache, profile and parameters (at any level), `chunks[i]` is chunk `i`'s level and bytes
/// (its CRC included), and `profile` the bytes to embed after the header (empty: the stream
/// references its profile, as `template`'s must then do).
///
/// A chunk's bytes depend on its tokens, its level and the stream's parameters, not on the
/// other chunks: chunks of streams encoded from one cache with one profile and one set of
/// parameters but different levels are interchangeable. This is how a multi-level store
/// (`spec/STREAM.md`) delivers a context at the levels its consumer chose; the result is the
/// stream `encode` writes with those levels, byte for byte.
pub fn assemble(
    template: &Header,
    chunks: &[(u8, &[u8])],
    profile: &[u8],
) -> Result<Vec<u8>, EncodeError> {
    if chunks.len() != template.chunks.len() {
        return Err(EncodeError::InvalidParam {
            what: "chunks to assemble (the template's chunk count differs)",
            got: chunks.len() as u64,
        });
    }
    let mut header = template.clone();
    header.profile_len = profile.len() as u64;
    for (entry, &(level, bytes)) in header.chunks.iter_mut().zip(chunks) {
        entry.level = level;
        entry.len_bytes = u32::try_from(bytes.len())
            .ok()
            .filter(|&n| n >= 4)
            .ok_or(EncodeError::InvalidParam {
                what: "chunk size in bytes (4 to 4 GiB with its CRC)",
                got: bytes.len() as u64,
            })?;
    }
    let mut out = header.to_bytes();
    out.extend_from_slice(profile);
    for (_, bytes) in chunks {
        out.extend_from_slice(bytes);
    }
    Ok(out)
}
