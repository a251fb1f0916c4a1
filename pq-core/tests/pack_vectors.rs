//! Golden vectors of the PQ code packing (`spec/vectors/pq/`, layout in `spec/PQ.md` §3): every
//! valid vector packs to exactly its stored bytes and unpacks to exactly its stored codes, and
//! every invalid one is rejected by `unpack` with the error kind the manifest names.
//!
//! `golden_pack_vectors` only reads the folder; a change to `pack` or `unpack` that changes any
//! byte fails it. The vectors were written by `write_pack_vectors` below
//! (`cargo test --release -p kvc-pq-core --test pack_vectors -- --ignored write_pack_vectors`),
//! which computes the packed bytes with a bit-by-bit writer transcribed from `spec/PQ.md` §2
//! (not with `pack`) and checks `pack` against it; rerun it only when the format changes.

use pq_core::{pack, packed_len, unpack, PqError};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

mod common;
use common::Rng;

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors/pq")
}

/// The manifest's name for an error: the `PqError` variant.
fn error_kind(e: &PqError) -> &'static str {
    match e {
        PqError::BitsOutOfRange { .. } => "BitsOutOfRange",
        PqError::LengthMismatch { .. } => "LengthMismatch",
        PqError::NonZeroPadding => "NonZeroPadding",
        PqError::TooLarge => "TooLarge",
        _ => "Other",
    }
}

fn codes_from_le(bytes: &[u8]) -> Vec<u16> {
    assert!(
        bytes.len().is_multiple_of(2),
        "a .codes file has an odd length"
    );
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn codes_to_le(codes: &[u16]) -> Vec<u8> {
    codes.iter().flat_map(|c| c.to_le_bytes()).collect()
}

#[test]
fn golden_pack_vectors() {
    let dir = vectors_dir();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest"))
            .expect("manifest is JSON");
    let read = |v: &Value, key: &str| {
        let name = v[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key} names a file"));
        std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let num = |v: &Value, key: &str| v[key].as_u64().unwrap_or_else(|| panic!("{key}"));
    let valid = manifest["valid"].as_array().unwrap();
    let invalid = manifest["invalid"].as_array().unwrap();
    let mut referenced = BTreeSet::new();
    let mut bits_seen = BTreeSet::new();
    let (mut empty_seen, mut partial_byte_seen) = (false, false);
    for v in valid {
        let name = v["name"].as_str().unwrap();
        let b = u8::try_from(num(v, "b")).unwrap();
        let n = usize::try_from(num(v, "n")).unwrap();
        let codes = codes_from_le(&read(v, "codes"));
        let packed = read(v, "packed");
        assert_eq!(codes.len(), n, "{name}: codes file holds n codes");
        assert_eq!(packed.len(), (n * usize::from(b)).div_ceil(8), "{name}");
        assert_eq!(packed.len() as u64, num(v, "packed_len"), "{name}");
        assert_eq!(packed_len(n, b), Ok(packed.len()), "{name}");
        assert_eq!(pack(&codes, b).as_deref(), Ok(&packed[..]), "{name}: pack");
        assert_eq!(unpack(&packed, b, n), Ok(codes), "{name}: unpack");
        referenced.insert(v["codes"].as_str().unwrap().to_string());
        referenced.insert(v["packed"].as_str().unwrap().to_string());
        bits_seen.insert(b);
        empty_seen |= n == 0;
        partial_byte_seen |= (n * usize::from(b)) % 8 != 0;
    }
    let mut kinds_seen = BTreeSet::new();
    for v in invalid {
        let name = v["name"].as_str().unwrap();
        let b = u8::try_from(num(v, "b")).unwrap();
        let n = usize::try_from(num(v, "n")).unwrap();
        let packed = read(v, "packed");
        let want = v["error"].as_str().unwrap();
        match unpack(&packed, b, n) {
            Ok(codes) => panic!("invalid vector {name} unpacked to {codes:?}"),
            Err(e) => assert_eq!(error_kind(&e), want, "{name}: {e}"),
        }
        referenced.insert(v["packed"].as_str().unwrap().to_string());
        kinds_seen.insert(want.to_string());
    }
    // What the brief of the vectors promises: these widths, an empty vector, a partly filled
    // last byte, and each rejection spec/PQ.md §2 requires.
    for b in [1, 3, 6, 7, 8, 12, 16] {
        assert!(bits_seen.contains(&b), "no valid vector with b = {b}");
    }
    assert!(empty_seen && partial_byte_seen);
    for kind in ["BitsOutOfRange", "LengthMismatch", "NonZeroPadding"] {
        assert!(kinds_seen.contains(kind), "no invalid vector for {kind}");
    }
    // Every file of the folder is the manifest or named by it.
    let mut files: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.remove("manifest.json");
    assert_eq!(
        files, referenced,
        "files in spec/vectors/pq vs the manifest"
    );
}

// ----------------------------------------------------------------------------------------------
// Generation.

/// `spec/PQ.md` §2 read literally: `ceil(n * b / 8)` zero bytes, then bit `q` of code `i` set
/// as stream bit `p = i * b + q`, i.e. bit `p % 8` of byte `p / 8`.
fn reference_pack(codes: &[u16], b: u8) -> Vec<u8> {
    let b = usize::from(b);
    let mut out = vec![0u8; (codes.len() * b).div_ceil(8)];
    for (i, &code) in codes.iter().enumerate() {
        assert!(u32::from(code) < 1 << b);
        for q in 0..b {
            if code >> q & 1 == 1 {
                let p = i * b + q;
                out[p / 8] |= 1 << (p % 8);
            }
        }
    }
    out
}

struct Valid {
    name: String,
    description: String,
    b: u8,
    codes: Vec<u16>,
}

struct Invalid {
    name: &'static str,
    description: &'static str,
    b: u8,
    n: usize,
    packed: Vec<u8>,
}

fn valid_vectors() -> Vec<Valid> {
    let mut out = Vec::new();
    // The examples of spec/PQ.md §2 (the empty one is among the generated vectors).
    let examples: &[(u8, &[u16])] = &[
        (6, &[1, 2, 3, 63]),
        (6, &[0x2A]),
        (6, &[0x3F, 0x3F]),
        (1, &[1, 0, 1, 1, 0, 0, 0, 0, 1]),
        (4, &[0xA, 0x5, 0xF]),
        (8, &[0x12, 0xFF]),
        (12, &[0xABC, 0x123]),
        (16, &[0xBEEF]),
    ];
    for (i, &(b, codes)) in examples.iter().enumerate() {
        out.push(Valid {
            name: format!("example-{}-b{b}-n{}", i + 1, codes.len()),
            description: format!("spec/PQ.md section 2 example {}", i + 1),
            b,
            codes: codes.to_vec(),
        });
    }
    // For every width: no codes; one code (the largest, so its top bit meets the padding);
    // 8 codes (8 * b bits: always whole bytes); 37 codes (37 * b bits: a partly filled last byte
    // unless b is 8 or 16), pseudo-random with the largest code first and last and a 0 second.
    for b in [1u8, 3, 6, 7, 8, 12, 13, 16] {
        let max = ((1u32 << b) - 1) as u16;
        for n in [0usize, 1, 8, 37] {
            let mut rng = Rng(0x5EED_0000 + u64::from(b) * 1000 + n as u64);
            let mut codes: Vec<u16> = (0..n)
                .map(|_| (rng.next_u64() & u64::from(max)) as u16)
                .collect();
            if n > 0 {
                codes[0] = max;
                codes[n - 1] = max;
            }
            if n > 2 {
                codes[1] = 0;
            }
            let bits = n * usize::from(b);
            let fill = match (n, bits % 8) {
                (0, _) => "no codes, no bytes".to_string(),
                (_, 0) => format!("{bits} bits fill {} bytes", bits / 8),
                (_, r) => format!("{bits} bits: the last byte has {} padding bits", 8 - r),
            };
            out.push(Valid {
                name: format!("b{b}-n{n}"),
                description: format!("{n} codes of {b} bits; {fill}"),
                b,
                codes,
            });
        }
    }
    // A realistic size: 512 tokens x m = 2 sub-spaces at the default b = 6.
    let mut rng = Rng(0x5EED_0006);
    out.push(Valid {
        name: "b6-n1024".to_string(),
        description: "512 tokens x 2 sub-spaces at b = 6 (the defaults), pseudo-random codes"
            .to_string(),
        b: 6,
        codes: (0..1024).map(|_| (rng.next_u64() & 63) as u16).collect(),
    });
    out
}

fn invalid_vectors() -> Vec<Invalid> {
    let inv = |name, description, b, n, packed: &[u8]| Invalid {
        name,
        description,
        b,
        n,
        packed: packed.to_vec(),
    };
    vec![
        inv("b0-n1", "b = 0 (below 1)", 0, 1, &[0x00]),
        inv(
            "b0-n0",
            "b = 0 with no codes and no bytes: b is checked first",
            0,
            0,
            &[],
        ),
        inv("b17-n1", "b = 17 (above 16)", 17, 1, &[0x00, 0x00, 0x00]),
        inv("b255-n0", "b = 255, no codes", 255, 0, &[]),
        inv(
            "b6-n4-short",
            "4 codes of 6 bits need 3 bytes; 2 given",
            6,
            4,
            &[0x81, 0x30],
        ),
        inv(
            "b6-n4-long",
            "4 codes of 6 bits need 3 bytes; 4 given (the extra byte is zero)",
            6,
            4,
            &[0x81, 0x30, 0xFC, 0x00],
        ),
        inv(
            "b1-n1-empty",
            "1 code of 1 bit needs 1 byte; none given",
            1,
            1,
            &[],
        ),
        inv(
            "b3-n0-one-byte",
            "no codes need no bytes; 1 zero byte given",
            3,
            0,
            &[0x00],
        ),
        inv(
            "b12-n1-short",
            "1 code of 12 bits needs 2 bytes; 1 given",
            12,
            1,
            &[0xBC],
        ),
        inv(
            "b1-n8-long",
            "8 codes of 1 bit need 1 byte; 2 given (the extra byte is zero)",
            1,
            8,
            &[0xFF, 0x00],
        ),
        inv(
            "b6-n1-padding",
            "1 code of 6 bits: padding bit 6 set (code 0x2A)",
            6,
            1,
            &[0x6A],
        ),
        inv(
            "b1-n9-padding",
            "9 codes of 1 bit: the last padding bit (stream bit 15) set",
            1,
            9,
            &[0x0D, 0x81],
        ),
        inv(
            "b3-n5-padding",
            "5 codes of 3 bits: the one padding bit (stream bit 15) set",
            3,
            5,
            &[0x00, 0x80],
        ),
        inv(
            "b7-n1-padding",
            "1 code of 7 bits: padding bit 7 set, code bits zero",
            7,
            1,
            &[0x80],
        ),
        inv(
            "b12-n1-padding",
            "1 code of 12 bits (0xABC): padding bit 12 set",
            12,
            1,
            &[0xBC, 0x1A],
        ),
    ]
}

/// Writes `spec/vectors/pq/`. Run by hand; see the module docs.
#[test]
#[ignore]
fn write_pack_vectors() {
    let dir = vectors_dir();
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    let mut vj = Vec::new();
    for (i, v) in valid_vectors().iter().enumerate() {
        let stem = format!("v{:02}-{}", i + 1, v.name);
        let packed = reference_pack(&v.codes, v.b);
        assert_eq!(pack(&v.codes, v.b).unwrap(), packed, "{stem}: pack vs spec");
        assert_eq!(unpack(&packed, v.b, v.codes.len()).unwrap(), v.codes);
        std::fs::write(dir.join(format!("{stem}.codes")), codes_to_le(&v.codes)).unwrap();
        std::fs::write(dir.join(format!("{stem}.packed")), &packed).unwrap();
        vj.push(json!({
            "name": v.name,
            "description": v.description,
            "b": v.b,
            "n": v.codes.len(),
            "codes": format!("{stem}.codes"),
            "packed": format!("{stem}.packed"),
            "packed_len": packed.len(),
        }));
    }
    let mut ij = Vec::new();
    for (i, v) in invalid_vectors().iter().enumerate() {
        let stem = format!("x{:02}-{}", i + 1, v.name);
        let Err(err) = unpack(&v.packed, v.b, v.n) else {
            panic!("invalid vector {stem} unpacks")
        };
        std::fs::write(dir.join(format!("{stem}.packed")), &v.packed).unwrap();
        ij.push(json!({
            "name": v.name,
            "description": v.description,
            "b": v.b,
            "n": v.n,
            "packed": format!("{stem}.packed"),
            "error": error_kind(&err),
            "message": err.to_string(),
        }));
    }
    let m = json!({
        "format": "kvc PQ code packing (spec/PQ.md section 2)",
        "codes_layout": "n codes, each a little-endian u16 (2 * n bytes)",
        "valid": vj,
        "invalid": ij,
    });
    let mut text = serde_json::to_string_pretty(&m).unwrap();
    text.push('\n');
    std::fs::write(dir.join("manifest.json"), text).unwrap();
}
