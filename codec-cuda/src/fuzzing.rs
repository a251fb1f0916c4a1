//! Fuzz harnesses (feature `fuzzing`): the bodies of the cargo-fuzz targets `decode_chain` and
//! `encode_chain` in `fuzz/`, and the oracle they share with the crate's tests (codec-core's
//! decode as f16/bf16 bits, and the scatter of dense rows into pages).
//!
//! [`decode_chain`] runs the decode kernels compiled for the host on any stream, as a device
//! would run them: the decode chain ([`DecodePlan::decode_chain_host`]; fused,
//! [`DecodePlan::decode_chain_host_fused`]; with the lane words gathered from the stream's
//! bytes, [`DecodePlan::decode_chain_host_from`]; with compact tables,
//! [`DecodePlan::decode_chain_host_compact`]) and the stepwise
//! path ([`DecodePlan::decode_host`]) must accept exactly the streams codec-core decodes and write
//! what it writes, bit for bit, and fail every other one with a typed error, never a panic.
//! [`encode_chain`] encodes a small cache derived from the input with the encode kernels
//! compiled for the host ([`EncodePlan::encode_host`]) into codec-core's stream, byte for byte.
//! `tests/fuzz_regressions.rs` replays `fuzz/seeds/<target>/` and `fuzz/regressions/<target>/`
//! through them under plain `cargo test`.

use codec_core::fuzzing::{Input, RoundtripCase, StreamProfileCase, LIMITS};
use codec_core::{DecodeError, Stream, TensorMut};
use half::{bf16, f16};

use crate::decode::DecodePlan;
use crate::encode_plan::{EncodePlan, Source};
use crate::quant::{OutDtype, OutLayout, Output};
use crate::stream::Destination;
use crate::CudaError;

/// Flag bit of [`decode_chain`]'s input (the bits of codec-core's [`StreamProfileCase`] above
/// it): bf16 output (else f16).
pub const CHAIN_BF16: u8 = 4;
/// Flag bit of [`decode_chain`]'s input: paged output, `1 + (flags >> 4)` tokens per page, the
/// pages in reverse order, one spare page (else dense `[T, H, D]` tensors).
pub const CHAIN_PAGED: u8 = 8;

/// A way to run a [`DecodePlan`] (the host-run chain, the stepwise path, a device): its name and
/// the call, given the plan and the bytes its stream lies in.
pub type DecodePath<'a> = (
    &'a str,
    &'a dyn Fn(&DecodePlan<'_>, &[u8]) -> Result<Vec<u16>, CudaError>,
);

/// A stream through the host-run kernels against codec-core (`fuzz_targets/decode_chain.rs`).
///
/// Input: codec-core's `decode_stream_profile` input ([`StreamProfileCase::read`]: `flags u8 |
/// profile_len u32 | profile | stream`), whose flag bits 2 ([`CHAIN_BF16`]) and 3 ([`CHAIN_PAGED`])
/// and high nibble choose the output. A stream that opens is decoded by codec-core
/// ([`codec_core_bits`]) and by the host-run paths of a [`DecodePlan`] of all its chunks
/// ([`decode_chain_on`]), its chunks' CRCs checked when added and, in a second plan, at decode
/// ([`DecodePlan::set_crc_at_decode`]). Returns whether the stream decoded (so that a replay can
/// tell that its inputs reach the kernels).
pub fn decode_chain(data: &[u8]) -> bool {
    decode_chain_on(
        data,
        &[
            ("chain", &|p: &DecodePlan<'_>, _: &[u8]| {
                p.decode_chain_host()
            }),
            ("chain, fused", &|p, _| p.decode_chain_host_fused()),
            (
                "chain, words gathered from the stream's bytes",
                &|p, raw| p.decode_chain_host_from(raw),
            ),
            (
                "chain, words gathered from the stream's bytes copied apart",
                &|p, raw| p.decode_chain_host_from_apart(raw),
            ),
            ("chain, compact tables", &|p, _| {
                p.decode_chain_host_compact()
            }),
            ("stepwise", &|p, _| p.decode_host()),
        ],
    )
}

/// [`decode_chain`] with the plan run by each of `paths` (a device test passes the GPU's).
/// Asserts: every path succeeds exactly when codec-core does, with codec-core's bits
/// (scattered into pages by [`scatter`] for paged output), and fails with a
/// [`CudaError::Stream`] or `Input` otherwise; none panics.
pub fn decode_chain_on(data: &[u8], paths: &[DecodePath<'_>]) -> bool {
    let case = StreamProfileCase::read(data);
    let Ok(stream) = Stream::open(&case.stream, case.profile.as_ref(), &LIMITS) else {
        return false;
    };
    let dtype = if case.flags & CHAIN_BF16 != 0 {
        OutDtype::Bf16
    } else {
        OutDtype::F16
    };
    let paging = (case.flags & CHAIN_PAGED != 0)
        .then(|| Paging::of(&stream, 1 + usize::from(case.flags >> 4)));
    let want = codec_core_bits(&stream, dtype).map(|tensors| match &paging {
        None => tensors.concat(),
        Some(p) => p.cache(&tensors),
    });
    for crc_at_decode in [false, true] {
        let plan = match &paging {
            None => DecodePlan::for_stream_with(&stream, dtype, crc_at_decode),
            Some(p) => p.plan(&stream, dtype, crc_at_decode),
        };
        for (path, run) in paths {
            let got = plan
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|p| run(p, &case.stream));
            let path = format!("{path} (CRCs at decode: {crc_at_decode})");
            match (&want, got) {
                (Ok(w), Ok(g)) => assert!(*w == g, "{path}: the bits differ from codec-core's"),
                (Ok(_), Err(e)) => panic!("{path} fails a stream codec-core decodes: {e}"),
                (Err(e), Ok(_)) => panic!("{path} decodes a stream codec-core rejects: {e}"),
                (Err(_), Err(e)) => assert!(
                    matches!(e, CudaError::Stream { .. } | CudaError::Input { .. }),
                    "{path}: {e:?}"
                ),
            }
        }
    }
    want.is_ok()
}

/// The output choices of [`decode_chain`]'s flag bits 2-7 that the replays take: f16 and bf16
/// dense, paged with 1 token per page, bf16 with 3, f16 with 16.
pub const CHAIN_OUTPUTS: [u8; 5] = [
    0,
    CHAIN_BF16,
    CHAIN_PAGED,
    CHAIN_PAGED | CHAIN_BF16 | (2 << 4),
    CHAIN_PAGED | (15 << 4),
];

/// Variants of a `decode_chain` seed for replays (host and device): `seed` with each of
/// [`CHAIN_OUTPUTS`], and, with the f16 dense output, `damaged` copies whose stream has one byte
/// flipped (at spread positions) and every CRC fixed up, so that the damage reaches the chunks'
/// parsers and kernels rather than the checksums.
pub fn chain_seed_variants(seed: &[u8], damaged: usize) -> Vec<Vec<u8>> {
    let Some((&flags, rest)) = seed.split_first() else {
        return Vec::new();
    };
    let with_flags = |f: u8| [&[f][..], rest].concat();
    let mut out: Vec<Vec<u8>> = CHAIN_OUTPUTS
        .iter()
        .map(|&o| with_flags((flags & 3) | o))
        .collect();
    // Bytes before the stream: flags, profile length, profile.
    let profile_len = rest
        .get(..4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let stream_at = (5 + profile_len).min(seed.len());
    let stream_len = seed.len() - stream_at;
    for i in 0..damaged.min(stream_len) {
        let mut v = with_flags(flags | codec_core::fuzzing::STREAM_PROFILE_FIX_CRCS);
        let at = stream_at + (i * 7919 + 13) % stream_len;
        v[at] ^= 1 << (i % 8);
        out.push(v);
    }
    out
}

/// A small cache through the host-run encode chain against codec-core
/// (`fuzz_targets/encode_chain.rs`).
///
/// Input: codec-core's `roundtrip_codec` input ([`RoundtripCase::read`]: a cache of up to 3
/// layers, 3 KV heads of 16 channels and 80 tokens in any dtype, outliers and, for f32, raw
/// bits; chunking, levels, group, sink rows, positions, rotary settings, queries and the
/// importance policy; a profile learned from it). Its chunks are encoded as `kvc encode
/// --gpu` does: the frame of [`codec_core::stream_frame`], every chunk by an [`EncodePlan`]
/// over the cache's tensors, the stream assembled by [`codec_core::assemble`]. Asserts: that
/// stream is the one [`codec_core::encode`] writes, byte for byte, each chunk's chain run
/// alone (as `Gpu::encode` in pieces runs them) codes the same chunks, and codec-core refuses
/// no case the chain codes. Returns whether the case was encoded.
pub fn encode_chain(data: &[u8]) -> bool {
    let case = RoundtripCase::read(&mut Input::new(data));
    let want = case.encode();
    let view = case.cache.view();
    let Ok(frame) = codec_core::stream_frame(&view, case.mode(), &case.params) else {
        assert!(want.is_none(), "stream_frame refuses a case encode codes");
        return false;
    };
    let (src, source) = Source::of_view(&view);
    let mut plan = EncodePlan::new(&frame.context, source).expect("the frame's dtype and shape");
    for e in &frame.header.chunks {
        plan.add_chunk(e.token_start..e.token_start + e.tokens, e.level)
            .expect("the frame's chunks");
    }
    let chunks = match plan.encode_host(&src) {
        Ok(c) => c,
        Err(e) => panic!("the encode chain fails a case codec-core codes: {e}"),
    };
    let one_a_piece = plan.encode_host_in_pieces(&src, 1);
    assert!(
        one_a_piece.as_ref() == Ok(&chunks),
        "each chunk's chain alone differs from the whole plan's"
    );
    let parts: Vec<(u8, &[u8])> = (frame.header.chunks.iter().zip(&chunks))
        .map(|(e, c)| (e.level, c.as_slice()))
        .collect();
    let got = codec_core::assemble(&frame.header, &parts, &frame.profile).ok();
    assert!(got == want, "the chain's stream differs from codec-core's");
    got.is_some()
}

/// codec-core's decode of `stream` into `dtype` buffers ([`Stream::decode_into`]): per layer K
/// then V, each `[T, H, D]`, as bits.
pub fn codec_core_bits(stream: &Stream<'_>, dtype: OutDtype) -> Result<Vec<Vec<u16>>, DecodeError> {
    match dtype {
        OutDtype::F16 => decode_bits(stream, f16::ZERO, |t| TensorMut::F16(t), f16::to_bits),
        OutDtype::Bf16 => decode_bits(stream, bf16::ZERO, |t| TensorMut::Bf16(t), bf16::to_bits),
    }
}

/// [`codec_core_bits`] for one element type: `wrap` makes a tensor of it, `bits` its bits.
fn decode_bits<T: Copy>(
    stream: &Stream<'_>,
    zero: T,
    wrap: for<'a> fn(&'a mut [T]) -> TensorMut<'a>,
    bits: fn(T) -> u16,
) -> Result<Vec<Vec<u16>>, DecodeError> {
    let shape = stream.header().shape;
    let mut tensors = vec![vec![zero; shape.tensor_len()]; 2 * shape.layers as usize];
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for (i, t) in tensors.iter_mut().enumerate() {
        if i % 2 == 0 {
            k.push(wrap(t))
        } else {
            v.push(wrap(t))
        }
    }
    stream.decode_into(&mut k, &mut v)?;
    Ok(tensors
        .iter()
        .map(|t| t.iter().map(|&x| bits(x)).collect())
        .collect())
}

/// The reference scatter: token `t` of tensor `i` (a dense `[T, C]` tensor of `tensors`) to
/// page `table[t / page_size]`, slot `t % page_size` of tensor `i` of a paged cache whose
/// tensors are `tensor_len` elements apart.
pub fn scatter(
    cache: &mut [u16],
    tensors: &[Vec<u16>],
    table: &[u32],
    page_size: usize,
    c: usize,
    tensor_len: usize,
) {
    for (i, tensor) in tensors.iter().enumerate() {
        for (t, row) in tensor.chunks_exact(c).enumerate() {
            let page = table[t / page_size] as usize;
            let at = i * tensor_len + (page * page_size + t % page_size) * c;
            cache[at..at + c].copy_from_slice(row);
        }
    }
}

/// [`decode_chain`]'s paged layout of a stream: `page_size` tokens per page, the stream's pages
/// in reverse order, one spare page at the end of each tensor.
struct Paging {
    page_size: usize,
    /// Channels per token row.
    channels: usize,
    table: Vec<u32>,
    /// Elements per tensor.
    tensor_len: usize,
}

impl Paging {
    fn of(stream: &Stream<'_>, page_size: usize) -> Self {
        let shape = stream.header().shape;
        let pages = (shape.tokens as usize).div_ceil(page_size);
        Paging {
            page_size,
            channels: shape.channels(),
            table: (0..pages as u32).rev().collect(),
            tensor_len: (pages + 1) * page_size * shape.channels(),
        }
    }

    /// The paged cache holding `tensors` (per layer K then V, `[T, H, D]`), zero elsewhere.
    fn cache(&self, tensors: &[Vec<u16>]) -> Vec<u16> {
        let mut cache = vec![0u16; tensors.len() * self.tensor_len];
        scatter(
            &mut cache,
            tensors,
            &self.table,
            self.page_size,
            self.channels,
            self.tensor_len,
        );
        cache
    }

    /// A plan of every chunk of `stream` into this layout, its CRCs checked at decode or not.
    fn plan<'s>(
        &self,
        stream: &'s Stream<'s>,
        dtype: OutDtype,
        crc_at_decode: bool,
    ) -> Result<DecodePlan<'s>, CudaError> {
        let shape = stream.header().shape;
        let output = Output {
            dtype,
            layout: OutLayout::Paged {
                page_size: self.page_size as u32,
            },
            len: 2 * shape.layers as usize * self.tensor_len,
        };
        let mut plan = DecodePlan::new(shape.kv_heads, shape.head_dim, output);
        plan.set_crc_at_decode(crc_at_decode);
        let page_start = plan.add_page_table(&self.table);
        let dest = Destination {
            base: 0,
            tensor_stride: self.tensor_len as u64,
            page_start,
        };
        plan.add_stream(stream, dest)?;
        Ok(plan)
    }
}
