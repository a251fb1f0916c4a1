//! Decoding any input allocates no more than the caller's limits allow.
//!
//! A counting global allocator records the peak number of live heap bytes while `decode` runs on
//! every golden vector (valid and invalid), on thousands of seeded mutations of them, and on
//! headers that claim huge shapes. The peak must stay under
//!
//! ```text
//! bound(limits, n) = 3 * 4 * max_elements      output + the block being reconstructed (f32)
//!                  + 8 * n                     copies of the input (profile bytes, lane words)
//!                  + 24 MiB                    decode tables: at most 16 levels * 256 tables
//!                                              * 5 KiB, plus per-profile indices
//! ```
//!
//! for an input of `n` bytes, whatever those bytes are. Headers that claim more elements than
//! `max_elements` must be rejected before anything of that size is allocated (peak under 1 MiB).
//!
//! The encoder and the profile learner allocate in proportion to their input: caches that claim
//! huge shapes over empty tensors (no tokens, or a `tokens * channels` that overflows) are
//! refused with an error, not an allocation of the claimed size (peak under 1 MiB).

mod common;

use common::crc32c;

use codec_core::{
    decode, encode, learn_profile, EncodeError, EncodeParams, KvMeta, KvShape, KvView, LearnParams,
    Limits, Profile, ProfileMode, Queries, Sample, TensorRef,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's layout unchanged; the counters
// only observe sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                let now = LIVE.fetch_add(new - l.size(), Ordering::Relaxed) + new - l.size();
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak live bytes above the level at the start, while `f` runs.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = f();
    (r, PEAK.load(Ordering::Relaxed) - base)
}

fn bound(l: &Limits, n: usize) -> usize {
    3 * 4 * l.max_elements as usize + 8 * n + (24 << 20)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Everything in one test: the counters are global to the process.
#[test]
fn allocations_stay_within_bounds() {
    decoding_allocates_within_the_limits();
    encoding_hostile_shapes_allocates_nothing_of_their_size();
    a_block_of_many_rows_and_heads_decodes_in_little_more_than_its_output();
}

fn decoding_allocates_within_the_limits() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors");
    let limits = Limits {
        max_layers: 64,
        max_channels: 4096,
        max_tokens: 1 << 16,
        max_chunks: 1 << 12,
        max_elements: 1 << 20,
        max_profile_bytes: 1 << 22,
    };
    let mut inputs: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvc"))
        .collect();
    names.sort();
    assert!(names.len() >= 28, "vectors present");
    for p in &names {
        let stream = std::fs::read(p).unwrap();
        let prof = std::fs::read(p.with_extension("kvcp")).ok();
        inputs.push((stream, prof));
    }
    let mut worst = 0f64;
    let mut rng = Rng(0x5EED);
    let mut checked = 0usize;
    for (stream, prof) in &inputs {
        let profile = prof
            .as_ref()
            .and_then(|b| Profile::from_bytes(b, &limits).ok());
        let mut run = |bytes: &[u8]| {
            let (_, peak) = peak_of(|| decode(bytes, profile.as_ref(), &limits).map(|_| ()));
            let b = bound(&limits, bytes.len() + prof.as_ref().map_or(0, |p| p.len()));
            assert!(peak <= b, "peak {peak} > bound {b}");
            worst = worst.max(peak as f64 / b as f64);
            checked += 1;
        };
        run(stream);
        // Seeded mutations: byte flips, small and large values in random places, truncations.
        for _ in 0..200 {
            let mut m = stream.clone();
            let k = 1 + rng.next() as usize % 4;
            for _ in 0..k {
                if m.is_empty() {
                    break;
                }
                let at = rng.next() as usize % m.len();
                m[at] = match rng.next() % 3 {
                    0 => m[at] ^ (1 << (rng.next() % 8)),
                    1 => 0xFF,
                    _ => rng.next() as u8,
                };
            }
            if rng.next().is_multiple_of(4) {
                let keep = rng.next() as usize % (m.len() + 1);
                m.truncate(keep);
            }
            run(&m);
        }
    }
    // Headers claiming huge shapes are rejected before anything that large is allocated.
    let (stream, _) = &inputs[0];
    for (off, v) in [
        (16usize, 1_000_000u32), // layers
        (20, 1 << 20),           // kv_heads
        (24, 1 << 20),           // head_dim
        (28, u32::MAX),          // tokens
        (96, u32::MAX),          // n_chunks
    ] {
        let mut m = stream.clone();
        m[off..off + 4].copy_from_slice(&v.to_le_bytes());
        let hl = u32::from_le_bytes(m[8..12].try_into().unwrap()) as usize;
        if hl <= m.len() && hl >= 4 {
            let crc = crc32c(&m[..hl - 4]);
            m[hl - 4..hl].copy_from_slice(&crc.to_le_bytes());
        }
        let (r, peak) = peak_of(|| decode(&m, None, &limits).map(|_| ()));
        assert!(r.is_err(), "huge claim at offset {off} accepted");
        assert!(peak < 1 << 20, "huge claim at offset {off}: peak {peak}");
    }
    println!(
        "{checked} decodes; worst peak / bound = {worst:.3} (bound for 1 MiB elements: {} bytes)",
        bound(&limits, 0)
    );
}

fn encoding_hostile_shapes_allocates_nothing_of_their_size() {
    let empty: &[f32] = &[];
    let view = |shape: KvShape| KvView {
        shape,
        k: vec![TensorRef::F32(empty); shape.layers as usize],
        v: vec![TensorRef::F32(empty); shape.layers as usize],
        meta: KvMeta::default(),
    };
    // A profile learned from no tokens would hold 2 * 2^40 channels' parameters.
    let no_tokens = view(KvShape {
        layers: 1,
        tokens: 0,
        kv_heads: 1 << 20,
        head_dim: 1 << 20,
    });
    // 2^16 * 2^24 * 2^24 = 2^64 elements a tensor: 0 after wrapping, as many as given.
    let overflowing = view(KvShape {
        layers: 1,
        tokens: 1 << 16,
        kv_heads: 1 << 24,
        head_dim: 1 << 24,
    });
    let learn = |kv: &KvView<'_>| {
        let samples = [Sample {
            kv: kv.clone(),
            queries: None,
        }];
        peak_of(|| learn_profile(&samples, &LearnParams::default()).map(|_| ()))
    };
    let (r, peak) = learn(&no_tokens);
    assert_eq!(r, Err(EncodeError::NoSamples));
    assert!(peak < 1 << 20, "learning from no tokens: peak {peak}");
    let (r, peak) = learn(&overflowing);
    let overflow = EncodeError::ShapeMismatch {
        what: "tokens * kv_heads * head_dim overflows",
    };
    assert_eq!(r, Err(overflow.clone()));
    assert!(
        peak < 1 << 20,
        "learning from an overflowing shape: peak {peak}"
    );
    // The encoder checks the view before it reads the profile, whichever profile it is given.
    let small = KvShape {
        layers: 1,
        tokens: 4,
        kv_heads: 1,
        head_dim: 2,
    };
    let values = [0.5f32, -0.25, 1.0, 0.0, 0.75, -1.0, 0.125, 0.5];
    let mut small_view = view(small);
    small_view.k = vec![TensorRef::F32(&values)];
    small_view.v = vec![TensorRef::F32(&values)];
    let samples = [Sample {
        kv: small_view,
        queries: None,
    }];
    let profile = learn_profile(&samples, &LearnParams::default()).unwrap();
    let params = EncodeParams::default();
    let (r, peak) =
        peak_of(|| encode(&overflowing, ProfileMode::Referenced(&profile), &params).map(|_| ()));
    assert_eq!(r, Err(overflow));
    assert!(peak < 1 << 20, "encoding an overflowing shape: peak {peak}");
}

/// A block's step exponents (one a row and head) are decoded with one table: the decoder held a
/// reference to it for each, 8 bytes an exponent, 16 GiB for a crafted stream of a few KB
/// claiming 2^24 rows of 128 heads.
fn a_block_of_many_rows_and_heads_decodes_in_little_more_than_its_output() {
    let shape = KvShape {
        layers: 1,
        tokens: 4096,
        kv_heads: 512,
        head_dim: 1,
    };
    let n = shape.tokens as usize * 512;
    let mut rng = Rng(3);
    let mut values = || -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next() >> 40) as f32 / 16_777_216.0)
            .collect()
    };
    let (k, v) = (values(), values());
    let kv = KvView {
        shape,
        k: vec![TensorRef::F32(&k)],
        v: vec![TensorRef::F32(&v)],
        meta: KvMeta::default(),
    };
    // Queries give the profile importance hints, and its streams step exponents.
    let q: Vec<f32> = (0..4 * 512).map(|i| (i % 7) as f32 - 3.0).collect();
    let samples = [Sample {
        kv: kv.clone(),
        queries: Some(Queries {
            q: vec![&q],
            q_heads: 512,
            q_start: 4092,
        }),
    }];
    let profile = learn_profile(&samples, &LearnParams::default()).unwrap();
    assert!(profile.importance().is_some());
    let params = EncodeParams {
        chunk_tokens: 4096,
        ..EncodeParams::default()
    };
    let bytes = encode(&kv, ProfileMode::Embedded(&profile), &params).unwrap();
    let (r, peak) = peak_of(|| decode(&bytes, None, &Limits::DEFAULT).map(|_| ()));
    r.unwrap();
    let output = 2 * n * 4;
    println!(
        "decode of {} bytes to {output} bytes of f32: peak {peak}",
        bytes.len()
    );
    // Measured: 36.0 MB with a reference an exponent (2^21 of them), 19.3 MB without.
    assert!(
        peak < output + output / 4,
        "peak {peak} for {output} bytes of output"
    );
}
