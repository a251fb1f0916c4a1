//! Encoding and decoding on several threads: the same bytes, the same decoded bits and the same
//! verdict on damaged streams as on one thread, on the real sample.

mod common;

use codec_core::{
    encode, encode_threads, Dtype, EncodeParams, KvCache, Limits, Profile, ProfileMode, Stream,
    Tensor, TensorMut,
};
use proptest::prelude::*;
use std::sync::OnceLock;

/// The sample's first 6 layers, a profile learned with its queries (so blocks carry step
/// exponents), and a stream of 4 chunks at mixed levels, the last one shorter.
struct Fixture {
    cache: KvCache,
    profile: Profile,
    params: EncodeParams,
    stream: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let (cache, q, q_heads, q_start) = common::load(common::SAMPLE, 6);
        let profile = common::learn_with_queries(&cache, &q, q_heads, q_start);
        let params = EncodeParams {
            chunk_tokens: 150,
            levels: vec![0, 7, 3, 11],
            ..EncodeParams::default()
        };
        let stream = encode(&cache.view(), ProfileMode::Referenced(&profile), &params).unwrap();
        Fixture {
            cache,
            profile,
            params,
            stream,
        }
    })
}

/// Tokens `range` decoded on `threads` threads into fresh `dtype` buffers: the buffers, or the
/// error's kind and text.
fn decode_on(
    bytes: &[u8],
    range: std::ops::Range<u32>,
    dtype: Dtype,
    threads: usize,
) -> Result<Vec<Tensor>, String> {
    let f = fixture();
    let s = Stream::open(bytes, Some(&f.profile), &Limits::DEFAULT).map_err(|e| e.to_string())?;
    let n = (range.end - range.start) as usize * s.header().shape.channels();
    let layers = s.header().shape.layers as usize;
    let mut k: Vec<Tensor> = (0..layers).map(|_| Tensor::zeros(dtype, n)).collect();
    let mut v = k.clone();
    let mut km: Vec<TensorMut<'_>> = k.iter_mut().map(Tensor::as_mut).collect();
    let mut vm: Vec<TensorMut<'_>> = v.iter_mut().map(Tensor::as_mut).collect();
    s.decode_range_into_threads(range, &mut km, &mut vm, threads)
        .map_err(|e| format!("{}: {e}", e.kind()))?;
    k.extend(v);
    Ok(k)
}

#[test]
fn encoding_is_the_same_on_every_thread_count() {
    let f = fixture();
    let mode = ProfileMode::Referenced(&f.profile);
    for threads in [0, 1, 2, 3, 7, 64] {
        let bytes = encode_threads(&f.cache.view(), mode, &f.params, threads).unwrap();
        assert!(bytes == f.stream, "{threads} threads");
    }
    // An error is the same too: a level the profile lacks, in the third chunk.
    let bad = EncodeParams {
        levels: vec![0, 7, 200, 11],
        ..f.params.clone()
    };
    let one = encode(&f.cache.view(), mode, &bad).unwrap_err().to_string();
    let four = encode_threads(&f.cache.view(), mode, &bad, 4).unwrap_err();
    assert_eq!(four.to_string(), one);
}

#[test]
fn whole_stream_decodes_to_the_same_bits_on_every_thread_count() {
    let f = fixture();
    let tokens = f.cache.shape.tokens;
    let owned = Stream::open(&f.stream, Some(&f.profile), &Limits::DEFAULT)
        .unwrap()
        .decode()
        .unwrap();
    let mut want: Vec<Tensor> = owned.k.clone();
    want.extend(owned.v.clone());
    for threads in [0, 1, 2, 3, 5, 64] {
        let got = decode_on(&f.stream, 0..tokens, Dtype::F16, threads).unwrap();
        assert!(got == want, "{threads} threads");
    }
}

/// Damage in chunk 0 found only by decoding its blocks, and a failed CRC in chunk 2: every
/// thread count reports chunk 0's error, the first in stream order, although the job list
/// already ends at chunk 2's CRC.
#[test]
fn the_first_error_in_stream_order_is_reported() {
    let f = fixture();
    let s = Stream::open(&f.stream, Some(&f.profile), &Limits::DEFAULT).unwrap();
    let (c0, c2) = (&s.header().chunks[0], &s.header().chunks[2]);
    let tokens = f.cache.shape.tokens;
    // A byte of chunk 0 whose flip, CRCs fixed, fails a block check.
    let damaged = (0..c0.len_bytes as usize - 4)
        .rev()
        .step_by(101)
        .map(|i| {
            let mut bad = f.stream.clone();
            bad[c0.offset as usize + i] ^= 0x40;
            refresh_chunk_crcs(&mut bad, &s);
            bad
        })
        .find(|bad| decode_on(bad, 0..tokens, Dtype::F16, 1).is_err())
        .expect("some flip in chunk 0 fails");
    let chunk0 = decode_on(&damaged, 0..tokens, Dtype::F16, 1).unwrap_err();
    let mut both = damaged.clone();
    both[c2.offset as usize + 7] ^= 1;
    let crc2 = {
        let mut only2 = f.stream.clone();
        only2[c2.offset as usize + 7] ^= 1;
        decode_on(&only2, 0..tokens, Dtype::F16, 1).unwrap_err()
    };
    assert!(crc2.starts_with("ChunkCrc"), "{crc2}");
    assert!(!chunk0.starts_with("ChunkCrc"), "{chunk0}");
    for threads in [1, 2, 3, 8] {
        let got = decode_on(&both, 0..tokens, Dtype::F16, threads).unwrap_err();
        assert_eq!(got, chunk0, "{threads} threads");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any token range, in any output dtype: the same bits on 2-6 threads as on one.
    #[test]
    fn token_ranges_decode_alike(a in 0u32..512, b in 0u32..512, threads in 2usize..7,
                                 dtype in prop::sample::select(vec![Dtype::F16, Dtype::Bf16, Dtype::F32])) {
        let f = fixture();
        let (lo, hi) = (a.min(b) % f.cache.shape.tokens, a.max(b) % (f.cache.shape.tokens + 1));
        let range = lo..hi.max(lo);
        let one = decode_on(&f.stream, range.clone(), dtype, 1);
        prop_assert!(one.is_ok());
        prop_assert!(decode_on(&f.stream, range, dtype, threads) == one);
    }

    /// A damaged stream (1-3 flipped bytes in the chunks, CRCs fixed or not, or the stream
    /// cut short): the verdict on several threads is the one on one thread (the first error in
    /// stream order where there are several), and so are the bits when it decodes.
    #[test]
    fn damaged_streams_get_the_same_verdict(
        flips in prop::collection::vec((0.0f64..1.0, 0u8..8), 1..4),
        fix_crc: bool,
        cut: bool,
        threads in 2usize..7,
    ) {
        let f = fixture();
        let s = Stream::open(&f.stream, Some(&f.profile), &Limits::DEFAULT).unwrap();
        let first = s.header().chunks[0].offset as usize;
        let mut bad = f.stream.clone();
        let at = |x: f64| first + ((f.stream.len() - first - 1) as f64 * x) as usize;
        if cut {
            bad.truncate(at(flips[0].0));
        } else {
            flips.iter().for_each(|&(x, bit)| bad[at(x)] ^= 1 << bit);
            if fix_crc {
                refresh_chunk_crcs(&mut bad, &s);
            }
        }
        // The oracle: the chunk-by-chunk decoder behind `decode_with_error`.
        let one = Stream::open(&bad, Some(&f.profile), &Limits::DEFAULT)
            .map_err(|e| e.to_string())
            .and_then(|s| s.decode_with_error().map_err(|e| format!("{}: {e}", e.kind())))
            .map(|(c, _)| c.k.into_iter().chain(c.v).collect::<Vec<_>>());
        let tokens = f.cache.shape.tokens;
        for t in [1, threads] {
            let got = decode_on(&bad, 0..tokens, Dtype::F16, t);
            match (&one, &got) {
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                _ => prop_assert!(one == got, "{} threads; oracle: {:?}", t, one.as_ref().err()),
            }
        }
    }
}

/// Rewrites every chunk's CRC-32C so that damage inside a chunk reaches the block checks.
fn refresh_chunk_crcs(bytes: &mut [u8], s: &Stream<'_>) {
    for e in &s.header().chunks {
        let (o, n) = (e.offset as usize, e.len_bytes as usize);
        let crc = common::crc32c(&bytes[o..o + n - 4]);
        bytes[o + n - 4..o + n].copy_from_slice(&crc.to_le_bytes());
    }
}
