//! Decoder targets: whole streams, streams with a separate profile, profiles, single chunks.

use super::input::Input;
use super::LIMITS;
use crate::block::ChunkContext;
use crate::bytes::crc32c;
use crate::consts::{HEADER_FIXED_LEN, INDEX_ENTRY_LEN, PROFILE_VERSION};
use crate::container::Stream;
use crate::error::Kv;
use crate::kv::{Dtype, KvCache, KvShape, Rope, Tensor};
use crate::limits::Limits;
use crate::profile::Profile;
use crate::quant::ChannelParams;
use alloc::borrow::Cow;
use alloc::vec::Vec;
use sha2::{Digest, Sha256};

/// Any bytes as a whole stream, with no separate profile (`fuzz_targets/decode_stream.rs`).
///
/// Input: the stream. Asserts nothing beyond "no panic" unless the stream opens: opened again
/// with the profile it resolved, it decodes the same. If it decodes,
/// [`Stream::decode_with_error`] gives the same cache and an error per (token, KV head), a
/// token range chosen from the input length decodes ([`Stream::decode_tokens`]) to exactly the
/// same bits as those tokens of the full decode, and decoding into buffers of another dtype
/// ([`Stream::decode_into`]) gives the same values once rounded to the narrower dtype.
pub fn decode_stream(data: &[u8]) {
    if let Ok(stream) = Stream::open(data, None, &LIMITS) {
        check_stream(&stream, data.len());
        check_reopened(&stream, data);
    }
}

/// Opened again with the profile it resolved, the stream takes that profile as it is;
/// detached and attached again to its bytes and that profile (as the bindings' stream handles
/// do for each decode), it decodes exactly as before, or fails the same way.
fn check_reopened(stream: &Stream<'_>, data: &[u8]) {
    let again = Stream::open(data, Some(stream.profile()), &LIMITS)
        .expect("a stream that opens opens again with the profile it resolved");
    assert!(core::ptr::eq(again.profile(), stream.profile()));
    assert_eq!(again.header(), stream.header());
    let opened = again.detach();
    let attached = opened
        .attach(data, stream.profile())
        .expect("a detached stream attaches to its bytes and profile");
    assert_eq!(attached.decode(), stream.decode());
}

/// Flag bit of [`decode_stream_profile`]: set the stream's profile hash to the SHA-256 of the
/// profile it uses (the embedded one, else the input's), then recompute the header CRC.
pub const STREAM_PROFILE_FIX_HASH: u8 = 1;
/// Flag bit of [`decode_stream_profile`]: recompute every chunk CRC (as located by the chunk
/// index) and the header CRC, so that mutated chunk bodies reach the block parser.
pub const STREAM_PROFILE_FIX_CRCS: u8 = 2;

/// A profile and a stream (`fuzz_targets/decode_stream_profile.rs`).
///
/// Input: as [`StreamProfileCase::read`] reads it. The stream is opened with the profile (or
/// with none if it does not parse) and checked as in [`decode_stream`].
pub fn decode_stream_profile(data: &[u8]) {
    let case = StreamProfileCase::read(data);
    if let Ok(s) = Stream::open(&case.stream, case.profile.as_ref(), &LIMITS) {
        check_stream(&s, data.len());
        check_reopened(&s, &case.stream);
    }
}

/// A [`decode_stream_profile`] input, read: also the input of the GPU chain's target
/// (`codec_cuda::fuzzing`), which gives meaning to the flag bits this one leaves alone.
#[derive(Debug)]
pub struct StreamProfileCase<'a> {
    /// The flag byte: [`STREAM_PROFILE_FIX_HASH`], [`STREAM_PROFILE_FIX_CRCS`], other bits as the
    /// caller reads them.
    pub flags: u8,
    /// The stream, fixed up as the flags say.
    pub stream: Cow<'a, [u8]>,
    /// The profile, if its bytes parse (under [`LIMITS`]).
    pub profile: Option<Profile>,
    /// The profile's bytes as the input gives them.
    pub profile_bytes: &'a [u8],
}

impl<'a> StreamProfileCase<'a> {
    /// Reads `flags: u8 | profile_len: u32 LE | profile (profile_len bytes, fewer if the input
    /// ends) | stream (the rest)`. With [`STREAM_PROFILE_FIX_HASH`] the stream's profile hash
    /// is set to the profile it will be decoded with, with [`STREAM_PROFILE_FIX_CRCS`] every
    /// chunk CRC is recomputed (else only the header CRC, if the hash was set): without them a
    /// mutated profile would never match the stream's SHA-256, and a mutated chunk never its
    /// CRC. The profile is parsed with [`Profile::from_bytes`].
    pub fn read(data: &'a [u8]) -> Self {
        let mut input = Input::new(data);
        let flags = input.u8();
        let profile_len = input.u32() as usize;
        let profile_bytes = input.bytes(profile_len);
        let stream_bytes = input.take_rest();
        let stream = if flags & (STREAM_PROFILE_FIX_HASH | STREAM_PROFILE_FIX_CRCS) != 0 {
            let mut fixed = stream_bytes.to_vec();
            if flags & STREAM_PROFILE_FIX_HASH != 0 {
                fix_profile_hash(&mut fixed, profile_bytes);
            }
            if flags & STREAM_PROFILE_FIX_CRCS != 0 {
                fix_stream_crcs(&mut fixed);
            } else {
                fix_header_crc(&mut fixed);
            }
            Cow::Owned(fixed)
        } else {
            Cow::Borrowed(stream_bytes)
        };
        StreamProfileCase {
            flags,
            stream,
            profile: Profile::from_bytes(profile_bytes, &LIMITS).ok(),
            profile_bytes,
        }
    }
}

/// The input of [`decode_stream_profile`] for `flags`, `profile` and `stream`.
pub fn stream_profile_input(flags: u8, profile: &[u8], stream: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + profile.len() + stream.len());
    v.push(flags);
    v.extend_from_slice(&(profile.len() as u32).to_le_bytes());
    v.extend_from_slice(profile);
    v.extend_from_slice(stream);
    v
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Sets a stream's `profile_hash` to the SHA-256 of the profile it will be decoded with: its
/// embedded profile if `profile_len > 0` and those bytes are present, else `profile`. Leaves
/// streams too short to hold the field alone.
fn fix_profile_hash(stream: &mut [u8], profile: &[u8]) {
    let (Some(header_len), Some(profile_len)) = (read_u32(stream, 8), read_u64(stream, 88)) else {
        return;
    };
    let embedded = usize::try_from(profile_len)
        .ok()
        .filter(|&n| n > 0)
        .and_then(|n| stream.get(header_len as usize..(header_len as usize).checked_add(n)?));
    let hash: [u8; 32] = Sha256::digest(embedded.unwrap_or(profile)).into();
    stream[56..88].copy_from_slice(&hash);
}

/// Recomputes the header CRC of a stream if its `header_len` field lies within the stream.
fn fix_header_crc(stream: &mut [u8]) {
    let Some(header_len) = read_u32(stream, 8) else {
        return;
    };
    let hl = header_len as usize;
    if hl >= HEADER_FIXED_LEN + 4 && hl <= stream.len() {
        let crc = crc32c(&stream[..hl - 4]);
        stream[hl - 4..hl].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Recomputes the CRC of every chunk the chunk index locates within the stream, then the
/// header CRC, without validating anything else: a stream whose only damage is stale checksums
/// becomes one whose checksums hold.
pub fn fix_stream_crcs(stream: &mut [u8]) {
    let (Some(n_chunks), Some(m)) = (read_u32(stream, 96), stream.get(100..102)) else {
        return;
    };
    let model_id_len = u16::from_le_bytes([m[0], m[1]]) as usize;
    let index = HEADER_FIXED_LEN + model_id_len;
    for i in 0..n_chunks as usize {
        let at = index + i * INDEX_ENTRY_LEN;
        let (Some(offset), Some(len)) = (read_u64(stream, at), read_u32(stream, at + 8)) else {
            break;
        };
        let (Ok(offset), len) = (usize::try_from(offset), len as usize) else {
            continue;
        };
        match offset.checked_add(len) {
            Some(end) if len >= 4 && end <= stream.len() => {
                let crc = crc32c(&stream[offset..end - 4]);
                stream[end - 4..end].copy_from_slice(&crc.to_le_bytes());
            }
            _ => {}
        }
    }
    fix_header_crc(stream);
}

/// Bit patterns of a tensor's elements (NaNs compare by their bits).
fn bits(t: &Tensor) -> Vec<u32> {
    match t {
        Tensor::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        Tensor::Bf16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        Tensor::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
    }
}

/// `true` if `bits` are a NaN of `t`'s dtype.
fn is_nan(t: &Tensor, bits: u32) -> bool {
    match t {
        Tensor::F16(_) => half::f16::from_bits(bits as u16).is_nan(),
        Tensor::Bf16(_) => half::bf16::from_bits(bits as u16).is_nan(),
        Tensor::F32(_) => f32::from_bits(bits).is_nan(),
    }
}

/// Asserts that `part` holds exactly tokens `start..` of `full`: the same bits, except that any
/// NaN equals any NaN (which NaN a decoder outputs is unspecified, FORMAT.md §7.4); and the
/// same metadata.
pub(super) fn assert_part_of(part: &KvCache, full: &KvCache, start: u32) {
    let c = full.shape.channels();
    let n = part.shape.tokens as usize * c;
    let from = start as usize * c;
    assert_eq!(part.shape.layers, full.shape.layers);
    assert_eq!(
        part.meta.first_position,
        full.meta.first_position.saturating_add(u64::from(start))
    );
    for (p, f) in part.k.iter().zip(&full.k).chain(part.v.iter().zip(&full.v)) {
        assert_eq!(p.dtype(), f.dtype());
        let (pb, fb) = (bits(p), bits(f));
        for (i, (&x, &y)) in pb.iter().zip(&fb[from..from + n]).enumerate() {
            assert!(
                x == y || (is_nan(p, x) && is_nan(p, y)),
                "element {i} differs: {x:#x} vs {y:#x}"
            );
        }
        assert_eq!(pb.len(), n);
    }
}

/// Decodes a stream that opened; if it decodes whole, checks a partial decode against it.
fn check_stream(stream: &Stream<'_>, salt: usize) {
    let Ok(full) = stream.decode() else {
        return;
    };
    let h = stream.header();
    assert_eq!(full.shape, h.shape);
    assert_eq!(full.dtype(), h.dtype);
    check_other_dtype(stream, &full);
    let (same, error) = stream
        .decode_with_error()
        .expect("a stream that decodes decodes with its expected error");
    assert_eq!(same, full);
    let per_layer = h.shape.tokens as usize * h.shape.kv_heads as usize;
    for e in error.k.iter().chain(&error.v) {
        assert_eq!(e.len(), per_layer);
        assert!(e.iter().all(|x| *x >= 0.0 || x.is_nan()));
    }
    let t = h.shape.tokens;
    if t == 0 {
        return;
    }
    let salt = salt as u32;
    let start = salt % t;
    let end = start + 1 + (salt / 7) % (t - start);
    let part = stream
        .decode_tokens(start..end)
        .expect("a token range of a stream that decodes whole decodes");
    assert_eq!(part.shape.tokens, end - start);
    assert_part_of(&part, &full, start);
}

/// `t` rounded to `dtype` (exact if `t` is no wider).
fn rounded(t: &Tensor, dtype: Dtype) -> Tensor {
    let mut out = Tensor::zeros(dtype, t.len());
    out.as_mut().write_f32(0, &t.to_f32_vec());
    out
}

/// Decodes the whole stream into buffers of another dtype ([`Stream::decode_into`]: f32 for
/// f16/bf16 streams, f16 for f32 streams) and asserts that, rounded to the narrower of the two,
/// they hold the same values as the stream-dtype decode `full`.
fn check_other_dtype(stream: &Stream<'_>, full: &KvCache) {
    let dtype = full.dtype();
    let other = if dtype == Dtype::F32 {
        Dtype::F16
    } else {
        Dtype::F32
    };
    let narrow = if dtype == Dtype::F32 { other } else { dtype };
    let n = full.shape.tensor_len();
    let mut k: Vec<Tensor> = (0..full.shape.layers)
        .map(|_| Tensor::zeros(other, n))
        .collect();
    let mut v = k.clone();
    {
        let mut km: Vec<_> = k.iter_mut().map(Tensor::as_mut).collect();
        let mut vm: Vec<_> = v.iter_mut().map(Tensor::as_mut).collect();
        stream
            .decode_into(&mut km, &mut vm)
            .expect("a stream that decodes decodes into buffers of another dtype");
    }
    let as_narrow =
        |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| rounded(t, narrow)).collect() };
    let a = KvCache {
        k: as_narrow(&full.k),
        v: as_narrow(&full.v),
        ..full.clone()
    };
    let b = KvCache {
        k: as_narrow(&k),
        v: as_narrow(&v),
        ..full.clone()
    };
    assert_part_of(&b, &a, 0);
}

/// Flag bit of [`decode_profile`]: recompute the CRC trailer before parsing.
pub const PROFILE_FIX_CRC: u8 = 1;

/// The profile bytes of a [`decode_profile`] input, their CRC recomputed if its flags say.
pub fn profile_input(data: &[u8]) -> Cow<'_, [u8]> {
    let (flags, rest) = data.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
    if flags & PROFILE_FIX_CRC == 0 {
        return Cow::Borrowed(rest);
    }
    let mut fixed = rest.to_vec();
    fix_profile_crc(&mut fixed);
    Cow::Owned(fixed)
}

/// Replaces the last 4 bytes of a profile of at least 8 by the CRC of the others.
pub fn fix_profile_crc(profile: &mut [u8]) {
    if let Some(body) = profile.len().checked_sub(4).filter(|&b| b >= 4) {
        let crc = crc32c(&profile[..body]);
        profile[body..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Any bytes as a profile (`fuzz_targets/decode_profile.rs`).
///
/// Input: `flags: u8 | profile`. With [`PROFILE_FIX_CRC`] in `flags` the last 4 bytes are
/// replaced by the CRC of the others first (so mutations reach the fields behind the CRC
/// check). If the profile parses, asserts: its [`Profile::as_bytes`] are the input, its hash is
/// their SHA-256, parsing them again gives the same hash, [`Profile::with_levels`] over every
/// level (and, for the current version, [`Profile::from_parts`] of its parts) writes the same
/// bytes, and [`Profile::table_at`] follows the down links.
pub fn decode_profile(data: &[u8]) {
    let bytes = &profile_input(data)[..];
    let Ok(p) = Profile::from_bytes(bytes, &LIMITS) else {
        return;
    };
    assert_eq!(p.as_bytes(), bytes, "a parsed profile keeps its bytes");
    let hash: [u8; 32] = Sha256::digest(bytes).into();
    assert_eq!(p.hash(), hash);
    let again = Profile::from_bytes(p.as_bytes(), &LIMITS).expect("a parsed profile re-parses");
    assert_eq!(again.hash(), p.hash());

    // Rebuilding from the parts gives the same bytes: `with_levels` over every level keeps the
    // version; `from_parts` writes the current one.
    let all: Vec<u8> = (0..p.levels()).collect();
    assert_eq!(
        p.with_levels(&all).as_bytes(),
        bytes,
        "with_levels(all) writes what from_bytes read"
    );
    let params: Vec<ChannelParams> = (0..p.layers())
        .flat_map(|l| [0, 1].map(|kv| p.channel_params(l, kv).to_vec()))
        .flatten()
        .collect();
    let levels = (0..p.levels()).map(|l| p.level_tables(l).clone()).collect();
    if p.version() == PROFILE_VERSION {
        let rebuilt = Profile::from_parts(
            p.layers(),
            p.kv_heads(),
            p.head_dim(),
            p.level_multipliers().to_vec(),
            params,
            p.importance().cloned(),
            levels,
        );
        assert_eq!(
            rebuilt.as_bytes(),
            bytes,
            "from_parts writes what from_bytes read"
        );
    }

    for level in 0..p.levels() {
        let lt = p.level_tables(level);
        for t in 0..lt.tables.len() {
            let mut cur = t as u8;
            for e in 0..16u8 {
                assert_eq!(p.table_at(level, t as u8, e), cur, "table_at = down^e");
                cur = lt.down[cur as usize];
            }
        }
    }
}

/// The fixed profile of [`decode_chunk`]: the profile-version-2 golden vector `v2/v17`'s `.kvcp` (2 layers, 2 KV heads,
/// head dimension 8, 12 levels, importance hints), the profile of vectors `v16` (with step
/// exponents) and `v17`, whose chunks seed the target.
pub const CHUNK_PROFILE_BYTES: &[u8] =
    include_bytes!("../../../spec/vectors/v2/v17-hints-uniform-steps.kvcp");

/// Parses [`CHUNK_PROFILE_BYTES`].
pub fn chunk_profile() -> Profile {
    Profile::from_bytes(CHUNK_PROFILE_BYTES, &Limits::DEFAULT).expect("vector profile parses")
}

/// The chunk parameters of a [`decode_chunk`] input (what a stream header would give).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkCase {
    /// Keep the chunk's CRC as given (else it is recomputed before decoding).
    pub keep_crc: bool,
    /// Level (may be past the profile's levels).
    pub level: u8,
    /// Rows (tokens) in the chunk, `0..=4096`.
    pub rows: u32,
    /// Stream index of the chunk's first token.
    pub token_start: u32,
    /// Dtype of sink rows and output.
    pub dtype: Dtype,
    /// Group size, `1..=1024`.
    pub group: u32,
    /// Sink count.
    pub n_sink: u16,
    /// Absolute position of the stream's first token.
    pub first_position: u64,
}

impl ChunkCase {
    /// The decoding context a stream with `profile`'s shape and this case's parameters would
    /// give (no rotary metadata, no importance: decoders use neither).
    pub fn context<'p>(&self, profile: &'p Profile) -> ChunkContext<'p> {
        let shape = KvShape {
            layers: profile.layers(),
            kv_heads: profile.kv_heads(),
            head_dim: profile.head_dim(),
            tokens: self.token_start.saturating_add(self.rows),
        };
        ChunkContext::new(
            shape,
            self.dtype,
            self.first_position,
            self.group,
            self.n_sink,
            profile,
            Rope::default(),
        )
        .expect("a chunk case's group is in 1..=1024 and its shape is the profile's")
    }
}

/// Bytes of the [`ChunkCase`] prefix of a [`decode_chunk`] input.
pub const CHUNK_CASE_LEN: usize = 21;

impl ChunkCase {
    fn read(input: &mut Input<'_>) -> Self {
        let flags = input.u8();
        ChunkCase {
            keep_crc: flags & 1 != 0,
            level: input.u8(),
            rows: u32::from(input.u16()) % 4097,
            token_start: input.u32(),
            dtype: Dtype::from_code(input.u8() % 3).unwrap_or(Dtype::F16),
            group: 1 + u32::from(input.u16()) % 1024,
            n_sink: input.u16(),
            first_position: input.u64(),
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.push(u8::from(self.keep_crc));
        out.push(self.level);
        out.extend_from_slice(&(self.rows as u16).to_le_bytes());
        out.extend_from_slice(&self.token_start.to_le_bytes());
        out.push(self.dtype.code());
        out.extend_from_slice(&((self.group - 1) as u16).to_le_bytes());
        out.extend_from_slice(&self.n_sink.to_le_bytes());
        out.extend_from_slice(&self.first_position.to_le_bytes());
    }
}

/// The input of [`decode_chunk`] for `case` and the chunk bytes (CRC included).
pub fn chunk_input(case: &ChunkCase, chunk: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(CHUNK_CASE_LEN + chunk.len());
    case.write(&mut v);
    debug_assert_eq!(v.len(), CHUNK_CASE_LEN);
    v.extend_from_slice(chunk);
    v
}

/// Any bytes as one chunk decoded with [`chunk_profile`] (`fuzz_targets/decode_chunk.rs`).
///
/// Input: a [`ChunkCase`] (21 bytes: `flags u8` (bit 0: keep the CRC), `level u8`, `rows u16`
/// (mod 4097), `token_start u32`, `dtype u8` (mod 3), `group - 1 u16` (mod 1024), `n_sink u16`,
/// `first_position u64`, all little-endian) and the chunk. Unless bit 0 is set the chunk's last
/// 4 bytes are replaced by the CRC of the others, so mutations reach the blocks. Decoding must
/// return `Ok` or a typed error; on the way each block's output must have `rows * C` values and
/// the sink rows' raw bytes, blocks coming in order.
pub fn decode_chunk(profile: &Profile, data: &[u8]) {
    let mut input = Input::new(data);
    let case = ChunkCase::read(&mut input);
    let raw = input.take_rest();
    let mut fixed;
    let chunk = if !case.keep_crc && raw.len() >= 4 {
        fixed = raw.to_vec();
        let body = fixed.len() - 4;
        let crc = crc32c(&fixed[..body]);
        fixed[body..].copy_from_slice(&crc.to_le_bytes());
        &fixed[..]
    } else {
        raw
    };
    let ctx = case.context(profile);
    let c = ctx.shape().channels();
    let pos = case
        .first_position
        .saturating_add(u64::from(case.token_start));
    let sink = (u64::from(case.n_sink).saturating_sub(pos)).min(u64::from(case.rows)) as usize;
    let mut blocks = 0u32;
    let result = ctx.decode_chunk(
        chunk,
        0,
        case.token_start,
        case.rows,
        case.level,
        |layer, kv, values, raw_sink| {
            assert_eq!(layer, blocks / 2, "blocks in order");
            assert_eq!(
                kv,
                if blocks.is_multiple_of(2) {
                    Kv::K
                } else {
                    Kv::V
                }
            );
            assert_eq!(values.len(), case.rows as usize * c);
            assert_eq!(raw_sink.len(), sink * c * case.dtype.size_bytes());
            blocks += 1;
        },
    );
    if result.is_ok() {
        assert_eq!(blocks, 2 * ctx.shape().layers, "every block is output");
    }
}
