//! Loading hostile GGUF files: a tiny valid llama model written here, then one defect at a time.
//! Each defect must be an error naming it, never a panic, an abort or an unbounded allocation.
//! These tests need no fetched model. Also replays the committed inputs of the cargo-fuzz target
//! `load_gguf` through its body `kvc_llm::fuzzing::load_gguf`; `write_seeds` (ignored) rewrites
//! its seeds: `cargo test -p kvc-llm --test gguf -- --ignored write_seeds`.

#[path = "../../fuzz/replay.rs"]
mod replay;

use kvc_llm::fuzzing::load_gguf;
use kvc_llm::{LlmError, Model};
use replay::{fuzz_dir, replay};

/// A GGUF metadata value.
#[derive(Clone)]
enum Val {
    U8(u8),
    U32(u32),
    I32(i32),
    F32(f32),
    F64(f64),
    Str(String),
    /// An array of values of type code `.0`.
    Array(u32, Vec<Val>),
}

impl Val {
    fn code(&self) -> u32 {
        match self {
            Val::U8(_) => 0,
            Val::U32(_) => 4,
            Val::I32(_) => 5,
            Val::F32(_) => 6,
            Val::Str(_) => 8,
            Val::Array(..) => 9,
            Val::F64(_) => 12,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Val::U8(x) => out.push(*x),
            Val::U32(x) => out.extend(x.to_le_bytes()),
            Val::I32(x) => out.extend(x.to_le_bytes()),
            Val::F32(x) => out.extend(x.to_le_bytes()),
            Val::F64(x) => out.extend(x.to_le_bytes()),
            Val::Str(s) => write_str(out, s),
            Val::Array(code, items) => {
                out.extend(code.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                items.iter().for_each(|v| v.write(out));
            }
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn strs(items: &[&str]) -> Val {
    Val::Array(8, items.iter().map(|s| Val::Str(s.to_string())).collect())
}

/// One tensor of f32 values: its GGUF dimensions (fastest first) and its offset in the data.
struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    offset: u64,
}

/// A GGUF file under construction.
struct File {
    meta: Vec<(String, Val)>,
    tensors: Vec<TensorSpec>,
    alignment: u64,
}

const H: u64 = 4;
const FFN: u64 = 8;
const TOKENS: [&str; 4] = ["a", "b", "ab", "<|endoftext|>"];

impl File {
    /// A valid llama model: 4 tokens, 4 channels, 2 query heads and 1 KV head of 2 channels,
    /// one block, f32 weights, tied LM head.
    fn valid() -> File {
        let v = TOKENS.len() as u64;
        let meta = [
            ("general.architecture", Val::Str("llama".into())),
            ("general.name", Val::Str("tiny".into())),
            ("tokenizer.ggml.model", Val::Str("gpt2".into())),
            ("tokenizer.ggml.tokens", strs(&TOKENS)),
            ("tokenizer.ggml.merges", strs(&["a b"])),
            (
                "tokenizer.ggml.token_type",
                Val::Array(5, [1, 1, 1, 3].map(Val::I32).to_vec()),
            ),
            ("llama.block_count", Val::U32(1)),
            ("llama.context_length", Val::U32(64)),
            ("llama.embedding_length", Val::U32(H as u32)),
            ("llama.feed_forward_length", Val::U32(FFN as u32)),
            ("llama.attention.head_count", Val::U32(2)),
            ("llama.attention.head_count_kv", Val::U32(1)),
            ("llama.rope.freq_base", Val::F32(10000.0)),
            ("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5)),
            // Skipped over by the loader's header walk: arrays of arrays of strings.
            (
                "test.nested",
                Val::Array(9, vec![Val::Array(8, vec![Val::Str("x".into())]); 2]),
            ),
        ];
        let shapes: [(&str, Vec<u64>); 11] = [
            ("token_embd", vec![H, v]),
            ("blk.0.attn_norm", vec![H]),
            ("blk.0.attn_q", vec![H, 4]),
            ("blk.0.attn_k", vec![H, 2]),
            ("blk.0.attn_v", vec![H, 2]),
            ("blk.0.attn_output", vec![4, H]),
            ("blk.0.ffn_norm", vec![H]),
            ("blk.0.ffn_gate", vec![H, FFN]),
            ("blk.0.ffn_up", vec![H, FFN]),
            ("blk.0.ffn_down", vec![FFN, H]),
            ("output_norm", vec![H]),
        ];
        let mut f = File {
            meta: meta.map(|(k, v)| (k.to_string(), v)).to_vec(),
            tensors: Vec::new(),
            alignment: 32,
        };
        for (name, dims) in shapes {
            f.add_tensor(&format!("{name}.weight"), dims);
        }
        f
    }

    /// Appends a tensor after the others, aligned.
    fn add_tensor(&mut self, name: &str, dims: Vec<u64>) {
        let offset = self.tensors.last().map_or(0, |t| {
            (t.offset + 4 * t.dims.iter().product::<u64>()).next_multiple_of(self.alignment)
        });
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims,
            offset,
        });
    }

    fn set(&mut self, key: &str, v: Val) -> &mut Self {
        match self.meta.iter_mut().find(|(k, _)| k == key) {
            Some(kv) => kv.1 = v,
            None => self.meta.push((key.to_string(), v)),
        }
        self
    }

    fn tensor(&mut self, name: &str) -> &mut TensorSpec {
        let name = format!("{name}.weight");
        self.tensors.iter_mut().find(|t| t.name == name).unwrap()
    }

    /// The file's bytes: header, tensor infos, then each tensor's data at its offset (element `i`
    /// is 0.01 * (i % 7) - 0.03, wherever the tensor is placed).
    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            write_str(&mut out, k);
            out.extend(v.code().to_le_bytes());
            v.write(&mut out);
        }
        for t in &self.tensors {
            write_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(0u32.to_le_bytes()); // f32
            out.extend(t.offset.to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(self.alignment as usize), 0);
        let data_start = out.len();
        // Data for the tensors that a small file can hold (not those placed far past it).
        let small = |t: &&TensorSpec| {
            let elements = t.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d));
            (t.offset < 1 << 20 && elements < 1 << 20).then_some((t.offset as usize, elements))
        };
        for (offset, elements) in self.tensors.iter().filter_map(|t| small(&t)) {
            let at = data_start + offset;
            out.resize(out.len().max(at + 4 * elements as usize), 0);
            for i in 0..elements as usize {
                let x = 0.01 * (i % 7) as f32 - 0.03;
                out[at + 4 * i..at + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
            }
        }
        out
    }

    fn load(&self, name: &str) -> Result<Model, LlmError> {
        load_bytes(name, &self.bytes())
    }
}

/// Writes `bytes` to a file of its own named after `name` and loads it.
fn load_bytes(name: &str, bytes: &[u8]) -> Result<Model, LlmError> {
    let path = std::env::temp_dir().join(format!("kvc-llm-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let model = Model::load(&path);
    std::fs::remove_file(&path).unwrap();
    model
}

/// Loading fails with an error of the given kind whose message contains `want`.
#[track_caller]
fn refused(r: Result<Model, LlmError>, kind: fn(&LlmError) -> bool, want: &str) {
    match r {
        Ok(_) => panic!("loaded; expected an error containing {want:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(kind(&e), "wrong kind of error: {msg}");
            assert!(msg.contains(want), "{msg:?} does not contain {want:?}");
        }
    }
}

fn gguf(e: &LlmError) -> bool {
    matches!(e, LlmError::Gguf { .. })
}
fn tokenizer(e: &LlmError) -> bool {
    matches!(e, LlmError::Tokenizer { .. })
}
fn metadata(e: &LlmError) -> bool {
    matches!(e, LlmError::Metadata { .. })
}

#[test]
fn the_tiny_model_loads_tokenizes_and_runs() {
    let mut f = File::valid();
    // A larger alignment than the default, so that the data's start is the file's word.
    f.alignment = 64;
    f.set("general.alignment", Val::U32(64));
    f.tensors.clear();
    let valid = File::valid();
    for t in valid.tensors {
        f.add_tensor(&t.name, t.dims);
    }
    let m = f.load("valid").unwrap();
    assert_eq!(m.config().vocab, TOKENS.len());
    assert_eq!(m.tokenizer().encode("ab<|endoftext|>").unwrap(), [2, 3]);
    let p = m.prefill(&[0, 1, 2]).unwrap();
    assert_eq!(p.logits.len(), TOKENS.len());
    assert!(p.logits.iter().all(|x| x.is_finite()));
    // The same model with the default alignment gives the same logits.
    let q = File::valid().load("valid32").unwrap().prefill(&[0, 1, 2]);
    assert_eq!(q.unwrap().logits, p.logits);
}

#[test]
fn an_alignment_of_zero_or_not_a_u32_power_of_two_is_refused() {
    for (name, v) in [
        ("align0", Val::U32(0)),
        ("align24", Val::U32(24)),
        ("align_u8", Val::U8(0)),
    ] {
        let r = File::valid().set("general.alignment", v).load(name);
        refused(r, gguf, "general.alignment must be a u32 power of two");
    }
}

#[test]
fn tensors_sharing_bytes_are_refused() {
    let mut f = File::valid();
    f.tensors.iter_mut().for_each(|t| t.offset = 0);
    refused(f.load("overlap"), gguf, "share bytes");
    let mut f = File::valid();
    f.tensor("blk.0.ffn_up").offset += 4;
    refused(f.load("overlap1"), gguf, "share bytes");
}

#[test]
fn a_tensor_past_the_end_of_the_file_is_refused() {
    let bytes = File::valid().bytes();
    let r = load_bytes("short", &bytes[..bytes.len() - 4]);
    refused(r, gguf, "tensor output_norm.weight ([4] F32 at offset");
    let mut f = File::valid();
    f.tensor("output_norm").offset = u64::MAX - 8;
    refused(f.load("far"), gguf, "runs past the end of the file");
}

#[test]
fn a_zero_or_overflowing_dimension_is_refused_even_in_an_unused_tensor() {
    let mut f = File::valid();
    f.add_tensor("unused.weight", vec![4, 0]);
    refused(
        f.load("zero"),
        gguf,
        "tensor unused.weight has a zero dimension",
    );
    let mut f = File::valid();
    f.add_tensor("unused.weight", vec![1 << 32, 1 << 32, 2]);
    refused(f.load("huge"), gguf, "more than 2^64 elements");
}

#[test]
fn a_tensor_of_another_shape_or_a_missing_block_is_refused() {
    let mut f = File::valid();
    f.tensor("blk.0.attn_k").dims = vec![H, 1];
    refused(
        f.load("shape"),
        gguf,
        "tensor blk.0.attn_k.weight has shape [1, 4], expected [2, 4]",
    );
    // 2^24 blocks promised, one present: refused at the second, nothing sized by the promise.
    let r = File::valid()
        .set("llama.block_count", Val::U32(1 << 24))
        .load("blocks");
    refused(r, gguf, "tensor blk.1.attn_norm.weight is missing");
}

#[test]
fn a_truncated_or_overlong_header_is_refused() {
    let bytes = File::valid().bytes();
    // 10: inside the counts; 100 and 200: inside the metadata.
    for cut in [10, 100, 200] {
        let r = load_bytes(&format!("cut{cut}"), &bytes[..cut]);
        refused(r, gguf, "past the end of the file");
    }
    // A key's length far past the end of the file.
    let mut bytes = bytes;
    let key = bytes
        .windows(20)
        .position(|w| w == b"general.architecture")
        .unwrap();
    bytes[key - 8..key].copy_from_slice(&u64::MAX.to_le_bytes());
    let r = load_bytes("keylen", &bytes);
    refused(
        r,
        gguf,
        "a header entry of 18446744073709551615 bytes at offset 32",
    );
}

#[test]
fn a_merge_into_no_token_is_refused() {
    // "<|endoftext|><|endoftext|>" is longer than every token: the tokenizers crate panics.
    for (name, m, bad) in [
        (
            "merge_long",
            "<|endoftext|> <|endoftext|>",
            "<|endoftext|><|endoftext|>",
        ),
        ("merge_ba", "b a", "ba"),
        ("merge_c", "a c", "c"),
    ] {
        let r = File::valid()
            .set("tokenizer.ggml.merges", strs(&["a b", m]))
            .load(name);
        refused(r, tokenizer, &format!("{bad:?} is not a token"));
    }
}

#[test]
fn an_empty_vocabulary_is_refused() {
    let r = File::valid()
        .set("tokenizer.ggml.tokens", strs(&[]))
        .set("tokenizer.ggml.merges", strs(&[]))
        .load("novocab");
    refused(r, tokenizer, "0 tokens is not in 1..=2^24");
}

#[test]
fn floats_out_of_f32_range_are_refused() {
    for (name, key, v) in [
        ("theta_big", "llama.rope.freq_base", 1e300),
        ("eps_tiny", "llama.attention.layer_norm_rms_epsilon", 1e-300),
        ("eps_neg", "llama.attention.layer_norm_rms_epsilon", -1e-5),
    ] {
        let r = File::valid().set(key, Val::F64(v)).load(name);
        refused(r, metadata, "is not a positive f32");
    }
    // In range as an f64, the value is taken.
    let r = File::valid()
        .set("llama.rope.freq_base", Val::F64(10000.0))
        .load("theta_f64");
    assert_eq!(r.unwrap().config().rope_theta, 10000.0);
}

const TARGET: &str = "load_gguf";

/// Small GGUF files for the fuzzer to start from: the valid model in both alignments, and each
/// defect the tests above refuse.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let valid = File::valid();
    let mut aligned = File::valid();
    aligned.alignment = 64;
    aligned.set("general.alignment", Val::U32(64));
    aligned.tensors.clear();
    for t in &valid.tensors {
        aligned.add_tensor(&t.name, t.dims.clone());
    }
    let mut overlap = File::valid();
    overlap.tensors.iter_mut().for_each(|t| t.offset = 0);
    let mut zero = File::valid();
    zero.add_tensor("unused.weight", vec![4, 0]);
    let mut shape = File::valid();
    shape.tensor("blk.0.attn_k").dims = vec![H, 1];
    let edit = |key: &str, v: Val| {
        let mut f = File::valid();
        f.set(key, v);
        f.bytes()
    };
    vec![
        ("valid", valid.bytes()),
        ("aligned64", aligned.bytes()),
        ("alignment0", edit("general.alignment", Val::U32(0))),
        ("overlap", overlap.bytes()),
        ("zero-dim", zero.bytes()),
        ("shape", shape.bytes()),
        (
            "merge-long",
            edit(
                "tokenizer.ggml.merges",
                strs(&["a b", "<|endoftext|> <|endoftext|>"]),
            ),
        ),
        ("no-vocab", edit("tokenizer.ggml.tokens", strs(&[]))),
        ("theta-f64", edit("llama.rope.freq_base", Val::F64(1e300))),
        ("blocks", edit("llama.block_count", Val::U32(1 << 24))),
    ]
}

/// Inputs that once panicked (`alignment0`, `merge-long`) or asked for terabytes (`overlap`).
const REGRESSIONS: [&str; 3] = ["alignment0", "merge-long", "overlap"];

#[test]
fn fuzz_inputs_replay_clean() {
    for (corpus, at_least) in [("regressions", REGRESSIONS.len()), ("seeds", 10)] {
        let (ran, failures) = replay(corpus, TARGET, load_gguf);
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
fn the_seeds_are_current_and_registered() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    assert!(manifest.contains(&format!(
        "name = \"{TARGET}\"\npath = \"fuzz_targets/{TARGET}.rs\""
    )));
    for (name, bytes) in seeds() {
        let path = fuzz_dir().join(format!("seeds/{TARGET}/gen-{name}.gguf"));
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == bytes,
            "{} is stale: run write_seeds",
            path.display()
        );
    }
}

#[test]
#[ignore = "rewrites fuzz/seeds/load_gguf and fuzz/regressions/load_gguf"]
fn write_seeds() {
    for corpus in ["seeds", "regressions"] {
        std::fs::create_dir_all(fuzz_dir().join(corpus).join(TARGET)).unwrap();
    }
    for (name, bytes) in seeds() {
        let seed = fuzz_dir().join(format!("seeds/{TARGET}/gen-{name}.gguf"));
        std::fs::write(seed, &bytes).unwrap();
        if REGRESSIONS.contains(&name) {
            let kept = fuzz_dir().join(format!("regressions/{TARGET}/{name}.gguf"));
            std::fs::write(kept, &bytes).unwrap();
        }
    }
}
