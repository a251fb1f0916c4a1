//! Loading and writing KV dumps: round trips on the shipped sample and every error path.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use codec_core::{Dtype, RopeStyle, Tensor};
use kvc_io::{load_dump, parse_dump, Dump, DumpError, Output, OutputError};
use safetensors::tensor::{SafeTensors, TensorView};
use safetensors::Dtype as StDtype;

fn sample() -> PathBuf {
    kvc_io::fixtures::sample()
}

/// The sample's tensors and metadata, for building modified files.
struct Raw {
    tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)>,
    metadata: HashMap<String, String>,
}

impl Raw {
    fn sample() -> Raw {
        let bytes = fs::read(sample()).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect();
        Raw {
            tensors,
            metadata: header.metadata().clone().unwrap(),
        }
    }
    fn remove(&mut self, name: &str) {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.0 != name);
        assert_eq!(self.tensors.len() + 1, before, "no tensor {name}");
    }
    fn set(&mut self, name: &str, dtype: StDtype, shape: Vec<usize>, data: Vec<u8>) {
        self.tensors.retain(|t| t.0 != name);
        self.tensors.push((name.to_string(), dtype, shape, data));
    }
    fn write(&self, path: &Path) {
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, Some(self.metadata.clone())).unwrap();
        fs::write(path, bytes).unwrap();
    }
    fn load(&self) -> Result<Dump, DumpError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        self.write(&p);
        load_dump(&p)
    }
}

#[test]
fn loads_sample() {
    let d = load_dump(&sample()).unwrap();
    let s = d.kv.shape;
    assert_eq!(
        (s.layers, s.kv_heads, s.head_dim, s.tokens),
        (30, 3, 64, 512)
    );
    assert_eq!(d.kv.dtype(), Dtype::F16);
    assert_eq!(d.kv.k.len(), 30);
    assert!(d
        .kv
        .k
        .iter()
        .chain(&d.kv.v)
        .all(|t| t.len() == 512 * 3 * 64));
    assert_eq!(d.q_heads, 9);
    assert_eq!(d.q_start, 448);
    assert_eq!(d.n_q(), 64);
    let q = d.q.as_ref().unwrap();
    assert_eq!(q.len(), 30);
    assert!(q.iter().all(|l| l.len() == 64 * 9 * 64));
    assert_eq!(d.kv.meta.rope.theta, 100000.0);
    assert_eq!(d.kv.meta.rope.style, RopeStyle::NeoX);
    assert_eq!(d.kv.meta.rope.scaling, 1.0);
    assert!(!d.kv.meta.rope.k_pre_rope);
    assert_eq!(d.kv.meta.first_position, 0);
    assert!(d.kv.meta.model_id.starts_with("SmolLM2-135M-Instruct"));
    assert_eq!(d.metadata["text"], "/usr/share/common-licenses/GPL-3");

    // Values agree with the raw little-endian bytes (spot checks), and are finite.
    let raw = Raw::sample();
    let (_, _, _, v7) = raw.tensors.iter().find(|t| t.0 == "v.7").unwrap();
    let Tensor::F16(v) = &d.kv.v[7] else {
        panic!("not f16")
    };
    for i in [0usize, 1, 1000, v.len() - 1] {
        let want = half::f16::from_bits(u16::from_le_bytes([v7[2 * i], v7[2 * i + 1]]));
        assert_eq!(v[i].to_bits(), want.to_bits(), "v.7[{i}]");
    }
    assert!(d.kv.k[0].to_f32_vec().iter().all(|x| x.is_finite()));
    assert!(d.kv.k[0].to_f32_vec().iter().any(|x| *x != 0.0));
}

/// `kvc_io::write_dump` to a path it may replace.
fn write_dump(
    path: &Path,
    kv: &codec_core::KvCache,
    md: &BTreeMap<String, String>,
) -> Result<(), DumpError> {
    kvc_io::write_dump(&Output::replacing(path), kv, md)
}

#[test]
fn roundtrip_preserves_cache_and_metadata() {
    let d = load_dump(&sample()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rt.safetensors");
    write_dump(&out, &d.kv, &d.metadata).unwrap();
    let e = load_dump(&out).unwrap();
    assert_eq!(e.kv, d.kv);
    assert_eq!(e.metadata, d.metadata);
    assert!(e.q.is_none(), "queries are not written");
    assert_eq!(e.q_heads, 9);
    // Only the output file is in the directory (no temporary left over).
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn roundtrip_other_dtypes_and_changed_meta() {
    let d = load_dump(&sample()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let mut kv = d.kv.clone();
        for t in kv.k.iter_mut().chain(kv.v.iter_mut()) {
            let f = t.to_f32_vec();
            let mut n = Tensor::zeros(dtype, f.len());
            n.as_mut().write_f32(0, &f);
            *t = n;
        }
        kv.meta.first_position = 1000;
        kv.meta.rope.style = RopeStyle::GptJ;
        kv.meta.rope.theta = 5e5;
        kv.meta.rope.k_pre_rope = true;
        kv.meta.model_id = "other".into();
        let out = dir.path().join(format!("{dtype:?}.safetensors"));
        // Empty metadata: write_dump adds what is needed to reproduce the cache.
        write_dump(&out, &kv, &BTreeMap::new()).unwrap();
        let e = load_dump(&out).unwrap();
        assert_eq!(e.kv.dtype(), dtype);
        assert_eq!(e.kv, kv);
        assert_eq!(e.metadata["tokens"], "512");
        assert_eq!(e.metadata["layers"], "30");
        // With the original metadata, stale keys are overwritten.
        write_dump(&out, &kv, &d.metadata).unwrap();
        let e = load_dump(&out).unwrap();
        assert_eq!(e.kv, kv);
        assert_eq!(e.metadata["text"], d.metadata["text"]);
    }
}

#[test]
fn missing_file_is_io_error_with_path() {
    let p = Path::new("/nonexistent/dir/none.safetensors");
    match load_dump(p) {
        Err(DumpError::Io { path, .. }) => assert_eq!(path, p),
        other => panic!("expected Io, got {other:?}"),
    }
    let msg = load_dump(p).unwrap_err().to_string();
    assert!(msg.contains("none.safetensors"), "{msg}");
}

#[test]
fn truncated_or_garbage_is_not_safetensors() {
    let bytes = fs::read(sample()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("trunc.safetensors");
    for cut in [bytes.len() - 1, bytes.len() / 2, 100, 4, 0] {
        fs::write(&p, &bytes[..cut]).unwrap();
        match load_dump(&p) {
            Err(DumpError::NotSafetensors { path, .. }) => assert_eq!(path, p),
            other => panic!("cut {cut}: expected NotSafetensors, got {other:?}"),
        }
    }
    fs::write(&p, b"this is plainly not a safetensors file at all").unwrap();
    assert!(matches!(
        load_dump(&p),
        Err(DumpError::NotSafetensors { .. })
    ));
}

#[test]
fn missing_v3_is_missing_tensor() {
    let mut raw = Raw::sample();
    raw.remove("v.3");
    match raw.load() {
        Err(DumpError::MissingTensor { name }) => assert_eq!(name, "v.3"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn missing_last_k_or_query_is_missing_tensor() {
    // Metadata says 30 layers, k.29 absent.
    let mut raw = Raw::sample();
    raw.remove("k.29");
    match raw.load() {
        Err(DumpError::MissingTensor { name }) => assert_eq!(name, "k.29"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    // A gap in the k run without layer metadata.
    let mut raw = Raw::sample();
    raw.metadata.remove("layers");
    raw.remove("k.4");
    match raw.load() {
        Err(DumpError::MissingTensor { name }) => assert_eq!(name, "k.4"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    // Queries present for some layers only.
    let mut raw = Raw::sample();
    raw.remove("q.12");
    match raw.load() {
        Err(DumpError::MissingTensor { name }) => assert_eq!(name, "q.12"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn no_queries_is_fine() {
    let mut raw = Raw::sample();
    for i in 0..30 {
        raw.remove(&format!("q.{i}"));
    }
    let d = raw.load().unwrap();
    assert!(d.q.is_none());
    assert_eq!(d.n_q(), 0);
    assert_eq!(d.q_heads, 9);
}

#[test]
fn wrong_dtype() {
    // An integer K tensor; a float dtype differing from k.0.
    let cases = [
        ("k.2", StDtype::I16, 2, "I16", "F16, BF16 or F32"),
        ("v.5", StDtype::F32, 4, "F32", "F16 (the dtype of k.0)"),
    ];
    for (tensor, st, width, want_dtype, want_expected) in cases {
        let mut raw = Raw::sample();
        raw.set(tensor, st, vec![512, 3, 64], vec![0; 512 * 3 * 64 * width]);
        match raw.load() {
            Err(DumpError::WrongDtype {
                name,
                dtype,
                expected,
            }) => {
                assert_eq!(name, tensor);
                assert_eq!(dtype, want_dtype);
                assert_eq!(expected, want_expected);
            }
            other => panic!("expected WrongDtype, got {other:?}"),
        }
    }
    // F64 everywhere: rejected at k.0.
    let mut raw = Raw::sample();
    raw.set(
        "k.0",
        StDtype::F64,
        vec![512, 3, 64],
        vec![0; 512 * 3 * 64 * 8],
    );
    assert!(matches!(raw.load(), Err(DumpError::WrongDtype { name, .. }) if name == "k.0"));
    // Queries of an integer type.
    let mut raw = Raw::sample();
    raw.set("q.0", StDtype::U8, vec![64, 9, 64], vec![0; 64 * 9 * 64]);
    assert!(matches!(raw.load(), Err(DumpError::WrongDtype { name, .. }) if name == "q.0"));
}

#[test]
fn wrong_shape() {
    let mut raw = Raw::sample();
    raw.set(
        "v.1",
        StDtype::F16,
        vec![512, 3, 63],
        vec![0; 512 * 3 * 63 * 2],
    );
    match raw.load() {
        Err(DumpError::WrongShape {
            name,
            got,
            expected,
        }) => {
            assert_eq!(name, "v.1");
            assert_eq!(got, vec![512, 3, 63]);
            assert_eq!(expected, vec![512, 3, 64]);
        }
        other => panic!("expected WrongShape, got {other:?}"),
    }
    // Two-dimensional k.0.
    let mut raw = Raw::sample();
    raw.set("k.0", StDtype::F16, vec![512, 192], vec![0; 512 * 192 * 2]);
    assert!(matches!(raw.load(), Err(DumpError::WrongShape { name, .. }) if name == "k.0"));
    // Queries with the wrong head dimension.
    let mut raw = Raw::sample();
    raw.set(
        "q.3",
        StDtype::F16,
        vec![64, 9, 32],
        vec![0; 64 * 9 * 32 * 2],
    );
    assert!(matches!(raw.load(), Err(DumpError::WrongShape { name, .. }) if name == "q.3"));
}

#[test]
fn inconsistent_metadata() {
    for (key, value) in [
        ("tokens", "511"),
        ("kv_heads", "4"),
        ("head_dim", "128"),
        ("q_heads", "12"),
        ("layers", "29"),
        ("tokens", "many"),
        ("rope_theta", "-1"),
        ("q_start", "460"),
    ] {
        let mut raw = Raw::sample();
        raw.metadata.insert(key.into(), value.into());
        match raw.load() {
            Err(DumpError::InconsistentMetadata {
                key: k, value: v, ..
            }) => {
                assert_eq!((k.as_str(), v.as_str()), (key, value));
            }
            other => panic!("{key}={value}: expected InconsistentMetadata, got {other:?}"),
        }
    }
}

#[test]
fn zero_layers_or_tokens() {
    // Only queries, no metadata: no layers.
    let mut raw = Raw::sample();
    raw.tensors.retain(|t| t.0.starts_with("q."));
    raw.metadata.clear();
    assert!(matches!(raw.load(), Err(DumpError::NoLayers)));
    // Zero tokens.
    let raw = Raw {
        tensors: vec![
            ("k.0".into(), StDtype::F16, vec![0, 3, 64], vec![]),
            ("v.0".into(), StDtype::F16, vec![0, 3, 64], vec![]),
        ],
        metadata: HashMap::new(),
    };
    assert!(matches!(
        raw.load(),
        Err(DumpError::Empty { dim: "tokens" })
    ));
}

#[test]
fn failed_write_leaves_nothing() {
    let d = load_dump(&sample()).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // The target is an existing (non-empty) directory: the final rename fails.
    let target = dir.path().join("out.safetensors");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("keep"), b"x").unwrap();
    let err = write_dump(&target, &d.kv, &d.metadata).unwrap_err();
    assert!(
        matches!(err, DumpError::Output(OutputError::IsDirectory { .. })),
        "{err:?}"
    );
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("out.safetensors")]);
    assert!(target.is_dir());
    let err = Output::replacing(&target).write(b"bytes").unwrap_err();
    assert!(matches!(err, OutputError::IsDirectory { .. }), "{err:?}");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    // The directory does not exist.
    let missing = dir.path().join("no/such/dir/out.safetensors");
    assert!(matches!(
        write_dump(&missing, &d.kv, &d.metadata),
        Err(DumpError::Output(OutputError::Io { .. }))
    ));
    assert!(!dir.path().join("no").exists());

    // An inconsistent cache is refused before anything is created.
    let mut kv = d.kv.clone();
    kv.v.pop();
    let out = dir.path().join("bad.safetensors");
    assert!(matches!(
        write_dump(&out, &kv, &d.metadata),
        Err(DumpError::InvalidCache { .. })
    ));
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    // An existing file survives a failed replacement untouched.
    let keep = dir.path().join("keep.bin");
    fs::write(&keep, b"original").unwrap();
    assert!(write_dump(&keep, &kv, &d.metadata).is_err());
    assert_eq!(fs::read(&keep).unwrap(), b"original");
}

#[test]
fn error_messages_name_the_problem() {
    let e = DumpError::WrongShape {
        name: "v.1".into(),
        got: vec![1, 2, 3],
        expected: vec![1, 2, 4],
    };
    let s = e.to_string();
    assert!(
        s.contains("v.1") && s.contains("[1, 2, 3]") && s.contains("[1, 2, 4]"),
        "{s}"
    );
    let s = DumpError::MissingTensor { name: "v.3".into() }.to_string();
    assert!(s.contains("v.3"), "{s}");
    let s = DumpError::WrongDtype {
        name: "k.2".into(),
        dtype: "I16".into(),
        expected: "F16".into(),
    }
    .to_string();
    assert!(s.contains("k.2") && s.contains("I16"), "{s}");
}

#[test]
fn parse_dump_reads_bytes_like_load_dump() {
    let bytes = fs::read(sample()).unwrap();
    let parsed = parse_dump(Path::new("in-memory"), &bytes).unwrap();
    assert_eq!(parsed, load_dump(&sample()).unwrap());
    // The path only names the input in errors.
    match parse_dump(Path::new("in-memory"), &bytes[..10]) {
        Err(DumpError::NotSafetensors { path, .. }) => assert_eq!(path, Path::new("in-memory")),
        other => panic!("expected NotSafetensors, got {other:?}"),
    }
}

#[test]
fn huge_q_start_is_inconsistent_not_a_wrap_around() {
    // q_start + n_q overflows u64: refused, not wrapped to a small position.
    let mut raw = Raw::sample();
    raw.metadata.insert("q_start".into(), u64::MAX.to_string());
    match raw.load() {
        Err(DumpError::InconsistentMetadata { key, .. }) => assert_eq!(key, "q_start"),
        other => panic!("expected InconsistentMetadata, got {other:?}"),
    }
}

#[test]
fn token_ids_round_trip_and_are_checked() {
    let mut dump = load_dump(&sample()).unwrap();
    assert_eq!(dump.tokens, None, "the sample has no token ids");
    let ids: Vec<u32> = (0..512u32).map(|i| i * 97 % 49152).collect();
    dump.tokens = Some(ids.clone());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.safetensors");
    kvc_io::write_full_dump(&Output::checked(&p, &[], false).unwrap(), &dump).unwrap();
    let back = load_dump(&p).unwrap();
    assert_eq!(back.tokens.as_deref(), Some(&ids[..]));
    assert_eq!(back.kv, dump.kv);
    // Not one id per token, or not U32: refused, on writing and on reading.
    dump.tokens = Some(ids[..511].to_vec());
    let q = dir.path().join("u.safetensors");
    let e = kvc_io::write_full_dump(&Output::checked(&q, &[], false).unwrap(), &dump);
    assert!(matches!(e, Err(DumpError::InvalidCache { .. })), "{e:?}");
    let mut raw = Raw::sample();
    raw.set("tokens", StDtype::U32, vec![511], vec![0; 511 * 4]);
    assert!(matches!(raw.load(), Err(DumpError::WrongShape { name, .. }) if name == "tokens"));
    raw.set("tokens", StDtype::I64, vec![512], vec![0; 512 * 8]);
    assert!(matches!(raw.load(), Err(DumpError::WrongDtype { name, .. }) if name == "tokens"));
}

/// The bytes of a small dump with every kind of tensor (K/V in `dtype`, queries, token ids) and
/// metadata, written by `write_full_dump`.
fn small_dump_bytes(dtype: Dtype) -> Vec<u8> {
    let shape = codec_core::KvShape {
        layers: 2,
        kv_heads: 1,
        head_dim: 4,
        tokens: 3,
    };
    let mut kv = codec_core::KvCache::zeros(shape, dtype, Default::default());
    for (i, t) in kv.k.iter_mut().chain(kv.v.iter_mut()).enumerate() {
        let vals: Vec<f32> = (0..12).map(|j| (i * 12 + j) as f32 * 0.25 - 3.0).collect();
        *t = Tensor::from_f32(dtype, &vals);
    }
    let dump = Dump {
        kv,
        q: Some(vec![vec![0.5; 2 * 4], vec![-1.5; 2 * 4]]),
        q_heads: 2,
        q_start: 1,
        tokens: Some(vec![7, 8, 9]),
        metadata: BTreeMap::new(),
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("small.safetensors");
    kvc_io::write_full_dump(&Output::checked(&p, &[], false).unwrap(), &dump).unwrap();
    let back = load_dump(&p).unwrap();
    assert_eq!(
        (back.kv, back.q, back.tokens),
        (dump.kv, dump.q, dump.tokens)
    );
    fs::read(&p).unwrap()
}

/// `load_dump` reads a file's header first and each tensor straight from the file; parsing the
/// whole file's bytes with the `safetensors` crate (`parse_dump`) is the reference. Cut, flipped,
/// overwritten and extended files get the same dump or the same kind of error from both.
#[test]
fn reading_from_the_file_agrees_with_parsing_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n.max(1)
    };
    let (mut oks, mut errs) = (0, 0);
    for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
        let good = small_dump_bytes(dtype);
        let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        for case in 0..300 {
            let mut b = good.clone();
            match case % 5 {
                0 => b.truncate(next(b.len())),
                // A byte of the header (its length, its JSON) or just after it.
                1 => b[next(header_end + 8)] ^= 1 << next(8),
                2 => {
                    let at = next(header_end);
                    b[at] = b"0123456789,:[]{}\" "[next(18)];
                }
                3 => b.extend(std::iter::repeat_n(0u8, 1 + next(9))),
                _ => {
                    // A header length too large, or one that points inside the data.
                    let n = [u64::MAX, 1 << 40, next(b.len()) as u64][next(3)];
                    b[..8].copy_from_slice(&n.to_le_bytes());
                }
            }
            fs::write(&p, &b).unwrap();
            let from_file = load_dump(&p);
            let from_bytes = parse_dump(&p, &b);
            match (&from_file, &from_bytes) {
                (Ok(a), Ok(r)) => {
                    assert_eq!(a, r, "case {case}");
                    oks += 1;
                }
                (Err(a), Err(r)) => {
                    let same = std::mem::discriminant(a) == std::mem::discriminant(r);
                    assert!(same, "case {case}: from the file {a}, from the bytes {r}");
                    errs += 1;
                }
                _ => panic!(
                    "case {case}: from the file {from_file:?}, from the bytes {from_bytes:?}"
                ),
            }
        }
    }
    // Both outcomes were exercised.
    assert!(oks > 20 && errs > 300, "{oks} read, {errs} refused");
}

/// A header whose tensors' data would end near 2^64 bytes (each tensor valid, their sum
/// overflowing a sum of the header's length with it) is refused from bytes as from a file,
/// not added up into an overflow.
#[test]
fn a_header_whose_data_ends_near_u64_max_is_refused() {
    let s: u64 = (1 << 61) - 1;
    let tensors: Vec<String> = (0..8)
        .map(|k| {
            let (a, b) = (k * s, (k + 1) * s);
            format!("\"t{k}\":{{\"dtype\":\"U8\",\"shape\":[{s}],\"data_offsets\":[{a},{b}]}}")
        })
        .collect();
    let header = format!("{{{}}}", tensors.join(","));
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge.safetensors");
    fs::write(&p, &b).unwrap();
    assert!(matches!(
        parse_dump(&p, &b),
        Err(DumpError::NotSafetensors { .. })
    ));
    assert!(matches!(
        load_dump(&p),
        Err(DumpError::NotSafetensors { .. })
    ));
}

/// A header over 8 MiB is refused from its length, before it is read or parsed.
#[test]
fn a_header_over_eight_mib_is_refused_from_its_length() {
    let n: u64 = (8 << 20) + 1;
    let mut b = n.to_le_bytes().to_vec();
    b.resize(8 + n as usize, b' ');
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("big-header.safetensors");
    fs::write(&p, &b).unwrap();
    for got in [load_dump(&p), parse_dump(&p, &b)] {
        let e = got.unwrap_err();
        assert!(matches!(e, DumpError::NotSafetensors { .. }), "{e}");
        assert!(
            e.to_string().to_lowercase().contains("header too large"),
            "{e}"
        );
    }
}
