//! The cargo-fuzz target `load_dump`: its committed inputs replayed through its body
//! `kvc_io::fuzzing::load_dump`, and its seeds (small dumps, and one file per defect the dump
//! reader refuses) checked against their generator; `write_seeds` (ignored) rewrites them:
//! `cargo test -p kvc-io --test fuzz_seeds -- --ignored write_seeds`.

#[path = "../../fuzz/replay.rs"]
mod replay;

use std::path::Path;

use half::{bf16, f16};
use kvc_io::fuzzing::load_dump;
use replay::{fuzz_dir, inputs, replay};
use safetensors::Dtype;
use serde_json::{json, Map, Value};

const TARGET: &str = "load_dump";

/// One tensor of a seed: name, dtype, shape, little-endian bytes.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

const LAYERS: usize = 2;
const TOKENS: usize = 5;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 4;
const N_Q: usize = 3;
const Q_HEADS: usize = 4;

/// `n` varied values, some not exact in f16 or bf16.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 29) as f32 * 0.25 - 3.0 + (i % 3) as f32 * 1e-3)
        .collect()
}

/// `v` as the bytes of a tensor of `dtype`.
fn bytes(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        Dtype::F32 => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        other => panic!("no values of {other:?}"),
    }
}

/// A tensor of `dtype` and `shape` holding varied values.
fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: usize) -> Entry {
    let v = values(shape.iter().product(), seed);
    (name.into(), dtype, shape.to_vec(), bytes(dtype, &v))
}

/// The K and V tensors of every layer, and with `q` queries of that dtype.
fn cache(kv: Dtype, q: Option<Dtype>) -> Vec<Entry> {
    let mut t = Vec::new();
    for i in 0..LAYERS {
        let shape = [TOKENS, KV_HEADS, HEAD_DIM];
        t.push(tensor(&format!("k.{i}"), kv, &shape, 2 * i));
        t.push(tensor(&format!("v.{i}"), kv, &shape, 2 * i + 1));
        if let Some(q) = q {
            t.push(tensor(
                &format!("q.{i}"),
                q,
                &[N_Q, Q_HEADS, HEAD_DIM],
                9 + i,
            ));
        }
    }
    t
}

fn token_ids(dtype: Dtype, n: usize) -> Entry {
    let ids: Vec<u8> = (0..n as u32).flat_map(|i| (i * 31).to_le_bytes()).collect();
    ("tokens".into(), dtype, vec![n], ids)
}

/// The safetensors file of `tensors` (their bytes in this order) and `metadata` (none if
/// empty), its header's keys sorted (`safetensors::serialize` writes the metadata in a
/// `HashMap`'s order, which changes from run to run).
fn file(tensors: &[Entry], metadata: &[(&str, &str)]) -> Vec<u8> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        let md = metadata.iter().map(|(k, v)| (k.to_string(), json!(v)));
        header.insert("__metadata__".into(), Value::Object(md.collect()));
    }
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let at = [data.len(), data.len() + bytes.len()];
        let entry = json!({"dtype": dtype.to_string(), "shape": shape, "data_offsets": at});
        header.insert(name.clone(), entry);
        data.extend_from_slice(bytes);
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).expect("a header serializes");
    // The data starts 8-byte aligned, as `safetensors` writes it.
    text.resize(text.len().next_multiple_of(8), b' ');
    [&(text.len() as u64).to_le_bytes()[..], &text, &data].concat()
}

/// With `name` replaced by `entry` (or removed).
fn edited(mut tensors: Vec<Entry>, name: &str, entry: Option<Entry>) -> Vec<Entry> {
    tensors.retain(|t| t.0 != name);
    tensors.extend(entry);
    tensors
}

/// Small dumps for the fuzzer to start from, each dtype with and without queries and token ids,
/// and one file per defect the reader refuses.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let f16_q = || {
        let mut t = cache(Dtype::F16, Some(Dtype::F32));
        t.push(token_ids(Dtype::U32, TOKENS));
        t
    };
    let full_md = [
        ("model", "seed"),
        ("rope_theta", "10000"),
        ("rope_style", "rotate_half"),
        ("q_start", "2"),
    ];
    let valid = file(&f16_q(), &full_md);
    let mut specials = cache(Dtype::F16, Some(Dtype::F16));
    let odd: [u16; 6] = [0x7e01, 0xfc00, 0x7c00, 0x8000, 0x0001, 0xfe7f];
    for (i, b) in odd.iter().enumerate() {
        specials[0].3[2 * i..2 * i + 2].copy_from_slice(&b.to_le_bytes());
        specials[2].3[2 * i..2 * i + 2].copy_from_slice(&b.to_le_bytes());
    }
    let zero = (0..2).flat_map(|i| {
        ["k", "v"].map(|kv| (format!("{kv}.{i}"), Dtype::F16, vec![0, 2, 4], Vec::new()))
    });
    let q_heads_3 = (0..LAYERS).fold(f16_q(), |t, i| {
        let name = format!("q.{i}");
        let q = tensor(&name, Dtype::F32, &[N_Q, 3, HEAD_DIM], 0);
        edited(t, &name, Some(q))
    });
    let refuse = |name, entry| file(&edited(f16_q(), name, entry), &full_md);
    let md = |extra: &[(&'static str, &'static str)]| {
        let mut m = full_md.to_vec();
        m.retain(|(k, _)| extra.iter().all(|(e, _)| e != k));
        file(&f16_q(), &[m, extra.to_vec()].concat())
    };
    vec![
        ("f16-q-f32-tokens", valid.clone()),
        (
            "bf16-plain",
            file(
                &cache(Dtype::BF16, None),
                &[
                    ("rope_style", "interleaved"),
                    ("first_position", "7"),
                    ("pre_rope", "1"),
                    ("layers", "2"),
                ],
            ),
        ),
        (
            "f32-q-bf16",
            file(&cache(Dtype::F32, Some(Dtype::BF16)), &[]),
        ),
        ("specials", file(&specials, &[("rope_scaling", " 2.5 ")])),
        (
            "query-metadata-only",
            file(
                &cache(Dtype::F16, None),
                &[("q_heads", "9"), ("q_start", "18446744073709551615")],
            ),
        ),
        ("truncated", valid[..valid.len() - 1].to_vec()),
        (
            "header-huge",
            [u64::MAX.to_le_bytes().as_slice(), b"{}"].concat(),
        ),
        (
            "not-json",
            [4u64.to_le_bytes().as_slice(), b"{\"a\""].concat(),
        ),
        ("missing-v1", refuse("v.1", None)),
        (
            "stray-k3",
            refuse("k.3", Some(tensor("k.3", Dtype::F16, &[1], 0))),
        ),
        (
            "k0-u8",
            refuse("k.0", Some(("k.0".into(), Dtype::U8, vec![4], vec![1; 4]))),
        ),
        (
            "k0-2d",
            refuse("k.0", Some(tensor("k.0", Dtype::F16, &[5, 8], 0))),
        ),
        ("zero-tokens", file(&zero.collect::<Vec<_>>(), &[])),
        (
            "q1-shape",
            refuse(
                "q.1",
                Some(tensor("q.1", Dtype::F32, &[N_Q, 3, HEAD_DIM], 0)),
            ),
        ),
        ("q-heads-3", file(&q_heads_3, &[])),
        (
            "tokens-i32",
            refuse("tokens", Some(token_ids(Dtype::I32, TOKENS))),
        ),
        (
            "tokens-short",
            refuse("tokens", Some(token_ids(Dtype::U32, 4))),
        ),
        ("q-start-past", md(&[("q_start", "3")])),
        ("layers-3", md(&[("layers", "3")])),
        ("theta-nan", md(&[("rope_theta", "NaN")])),
    ]
}

/// The seeds the reader refuses, and words of each one's error.
const REFUSED: [(&str, &str); 15] = [
    ("truncated", "not fully covered"),
    ("header-huge", "header too large"),
    ("not-json", "invalid JSON"),
    ("missing-v1", "missing tensor `v.1`"),
    ("stray-k3", "missing tensor `k.2`"),
    ("k0-u8", "has dtype U8"),
    ("k0-2d", "has shape [5, 8]"),
    ("zero-tokens", "zero tokens"),
    ("q1-shape", "`q.1` has shape [3, 3, 4]"),
    ("q-heads-3", "`q.0` has shape [3, 3, 4], expected [3, 4, 4]"),
    ("tokens-i32", "has dtype I32, expected U32"),
    ("tokens-short", "has shape [4], expected [5]"),
    ("q-start-past", "run past the 5 tokens"),
    ("layers-3", "missing tensor `k.2`"),
    ("theta-nan", "positive finite"),
];

/// `regressions/load_dump/`: `tied-offsets-name-either-tensor.safetensors`, two tensors
/// starting at the same bad offset, which the `safetensors` parser names in a hash map's order
/// (the harness asserted equal messages from the file and from its bytes, and failed when they
/// named different tensors).
const REGRESSIONS: usize = 1;

#[test]
fn fuzz_inputs_replay_clean() {
    for (corpus, at_least) in [("regressions", REGRESSIONS), ("seeds", seeds().len())] {
        let (ran, failures) = replay(corpus, TARGET, |d| {
            load_dump(d);
        });
        assert!(
            failures.is_empty(),
            "{corpus} fail:\n{}",
            failures.join("\n")
        );
        assert!(
            ran >= at_least,
            "only {ran} inputs in fuzz/{corpus}/{TARGET}"
        );
    }
}

#[test]
fn the_valid_seeds_load_and_the_others_are_refused_for_their_defect() {
    let seeds = seeds();
    for (name, bytes) in &seeds {
        let refusal = REFUSED.iter().find(|r| r.0 == *name).map(|r| r.1);
        match (kvc_io::parse_dump(Path::new(name), bytes), refusal) {
            (Ok(_), None) => assert!(load_dump(bytes), "{name}"),
            (Err(e), Some(word)) => {
                assert!(e.to_string().contains(word), "{name}: {e}");
                assert!(!load_dump(bytes), "{name}");
            }
            (got, _) => panic!("{name}: {:?}", got.err()),
        }
    }
    assert!(REFUSED.iter().all(|r| seeds.iter().any(|s| s.0 == r.0)));
}

#[test]
fn the_seeds_are_current_and_registered() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    assert!(manifest.contains(&format!(
        "name = \"{TARGET}\"\npath = \"fuzz_targets/{TARGET}.rs\""
    )));
    let dir = fuzz_dir().join("seeds").join(TARGET);
    let generated = seeds();
    for (name, bytes) in &generated {
        let path = dir.join(format!("gen-{name}.safetensors"));
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            &committed == bytes,
            "{} is stale: run write_seeds",
            path.display()
        );
    }
    assert_eq!(
        inputs(&dir).len(),
        generated.len(),
        "a seed is not generated"
    );
}

#[test]
#[ignore = "rewrites fuzz/seeds/load_dump"]
fn write_seeds() {
    let dir = fuzz_dir().join("seeds").join(TARGET);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(dir.join(format!("gen-{name}.safetensors")), bytes).unwrap();
    }
}
