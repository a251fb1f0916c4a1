//! The body of the cargo-fuzz target `load_dump` (feature `fuzzing`), shared with the replay of
//! its committed inputs in `tests/fuzz_seeds.rs`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use codec_core::{KvCache, Tensor};

use crate::dump::{load_dump as load_file, parse_dump, write_full_dump, Dump, DumpError};
use crate::output::Output;

/// Any bytes as a KV dump (a safetensors file): `Ok` or a typed error, never a panic, and the
/// same from the bytes in memory ([`parse_dump`]) as from a file holding them
/// ([`load_dump`](crate::load_dump)). A dump that loads is consistent (every tensor the size
/// its shape says, the queries within the tokens) and comes back from
/// [`write_full_dump`] the same: its cache bit for bit with the cache's metadata (model,
/// rotary settings, first position), its token ids, its query heads and first query, and its
/// queries as rounded to the cache's dtype. Returns whether the bytes loaded.
pub fn load_dump(data: &[u8]) -> bool {
    let dir = Scratch::new();
    let input = dir.0.join("in.safetensors");
    std::fs::write(&input, data).expect("scratch file written");
    let from_bytes = parse_dump(&input, data);
    let from_file = load_file(&input);
    let dump = match (from_bytes, from_file) {
        (Ok(a), Ok(b)) => {
            assert!(same(&a, &b), "the file and its bytes load differently");
            a
        }
        (Err(a), Err(b)) => {
            // The `safetensors` parser names one of several bad tensors, in a hash map's
            // order: the same file can name another the next time.
            let unordered = |e: &DumpError| matches!(e, DumpError::NotSafetensors { .. });
            assert!(a.to_string() == b.to_string() || unordered(&a) && unordered(&b));
            return false;
        }
        (a, b) => panic!("from bytes {:?}, from the file {:?}", a.err(), b.err()),
    };
    check_consistent(&dump);
    let output = dir.0.join("out.safetensors");
    write_full_dump(&Output::replacing(&output), &dump).expect("a loaded dump writes");
    let again = load_file(&output).expect("a written dump loads");
    let mut expected = dump;
    // Queries are written in the cache's dtype.
    let dtype = expected.kv.dtype();
    for q in expected.q.iter_mut().flatten() {
        *q = Tensor::from_f32(dtype, q).to_f32_vec();
    }
    assert!(same(&again, &expected), "a written dump loads differently");
    true
}

/// What loading promises of a dump's sizes.
fn check_consistent(d: &Dump) {
    let s = d.kv.shape;
    let layers = s.layers as usize;
    assert!(layers > 0 && s.tokens > 0 && s.kv_heads > 0 && s.head_dim > 0);
    assert_eq!((d.kv.k.len(), d.kv.v.len()), (layers, layers));
    let tensors = d.kv.k.iter().chain(&d.kv.v);
    assert!(tensors.clone().all(|t| t.len() == s.tensor_len()));
    assert!(tensors.clone().all(|t| t.dtype() == d.kv.dtype()));
    if let Some(t) = &d.tokens {
        assert_eq!(t.len(), s.tokens as usize);
    }
    if let Some(q) = &d.q {
        let n_q = d.n_q();
        assert!(n_q > 0 && d.q_heads.is_multiple_of(s.kv_heads as usize));
        assert_eq!(q.len(), layers);
        let row = d.q_heads * s.head_dim as usize;
        assert!(q.iter().all(|l| l.len() == n_q * row));
        assert!(d.q_start + n_q as u64 <= u64::from(s.tokens));
    }
}

/// Equal dumps, their floats compared by their bits (a dump may hold NaNs).
fn same(a: &Dump, b: &Dump) -> bool {
    let q_bits = |d: &Dump| -> Option<Vec<Vec<u32>>> {
        let bits = |l: &Vec<f32>| l.iter().map(|x| x.to_bits()).collect();
        d.q.as_ref().map(|q| q.iter().map(bits).collect())
    };
    kv_bits(&a.kv) == kv_bits(&b.kv)
        && (a.kv.shape, &a.kv.meta) == (b.kv.shape, &b.kv.meta)
        && (a.q_heads, a.q_start, &a.tokens) == (b.q_heads, b.q_start, &b.tokens)
        && q_bits(a) == q_bits(b)
}

/// Every K and V element's bits, in order.
fn kv_bits(kv: &KvCache) -> Vec<Vec<u32>> {
    let bits = |t: &Tensor| -> Vec<u32> {
        match t {
            Tensor::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            Tensor::Bf16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            Tensor::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        }
    };
    kv.k.iter().chain(&kv.v).map(bits).collect()
}

/// A directory of its own for one call (calls may run on several threads, fuzzers in several
/// processes), removed with what it holds when the call ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, Ordering::Relaxed);
        let name = format!("kvc-fuzz-load-dump-{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir).expect("scratch directory created");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
