//! How codec-core decodes each of a directory's fuzz inputs, for the reference decoder to
//! compare (`spec/reference/against_rust.py`, which runs this):
//!
//! ```sh
//! cargo run --release -p kvc-codec-core --example decode_outcomes -- \
//!     (--stream | --case) DIR OUT [FLIPS]
//! ```
//!
//! With `--stream` each file of `DIR` is a stream (the input of the fuzz target
//! `decode_stream`); with `--case`, a profile and a stream as the targets
//! `decode_stream_profile` and `decode_chain` read them (`flags | profile_len | profile |
//! stream`, the stream's profile hash and CRCs fixed up as the flags say). For each input this
//! writes `OUT/NAME.kvc` (the stream decoded) and, for a case, `OUT/NAME.kvcp` (the profile's
//! bytes), and prints a line `NAME<TAB>PROFILE<TAB>STREAM`: `PROFILE` is `-` (no profile),
//! `ok`, or the spec's error class of `Profile::from_bytes`; `STREAM` is `ok:` and the SHA-256
//! of the decoded K then V of each layer (little-endian, as the reference's `output_bytes` lays
//! them out), or the spec's error class of `codec_core::decode`, given the profile when it
//! parsed. Limits are the spec's defaults. With `FLIPS`, each input also gives that many
//! damaged copies, `NAME~1` and on: one bit of the stream flipped (where a seeded generator
//! says), then its chunk and header CRCs recomputed, so that most damage reaches the checks
//! after the CRCs.

use std::path::{Path, PathBuf};

use codec_core::fuzzing::{fix_stream_crcs, StreamProfileCase};
use codec_core::{decode, KvCache, Limits, Profile, Tensor};
use sha2::{Digest, Sha256};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (case, dir, out, flips) = match args.as_slice() {
        [mode, dir, out, rest @ ..]
            if (mode == "--stream" || mode == "--case") && rest.len() < 2 =>
        {
            let flips = rest.first().map_or(Some(0), |f| f.parse::<u64>().ok());
            let flips = flips.unwrap_or_else(|| usage());
            (mode == "--case", Path::new(dir), PathBuf::from(out), flips)
        }
        _ => usage(),
    };
    std::fs::create_dir_all(&out).unwrap_or_else(|e| fail(&out, e));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| fail(dir, e))
        .map(|e| e.unwrap_or_else(|e| fail(dir, e)).path())
        .filter(|p| p.is_file() && !name(p).starts_with('.'))
        .collect();
    files.sort();
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| fail(file, e));
        let (stream, profile) = if case {
            let c = StreamProfileCase::read(&data);
            (c.stream.into_owned(), Some(c.profile_bytes.to_vec()))
        } else {
            (data, None)
        };
        let name = name(file);
        outcome(&out, &name, &stream, profile.as_deref());
        let mut rng = name.bytes().fold(0xcbf2_9ce4_8422_2325, |h: u64, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        for k in (1..=flips).take_while(|_| !stream.is_empty()) {
            let mut damaged = stream.clone();
            let r = splitmix(&mut rng);
            damaged[(r % stream.len() as u64) as usize] ^= 1 << (r >> 61);
            fix_stream_crcs(&mut damaged);
            outcome(&out, &format!("{name}~{k}"), &damaged, profile.as_deref());
        }
    }
}

/// Writes `OUT/NAME.kvc` (and `.kvcp`) and prints the input's line.
fn outcome(out: &Path, name: &str, stream: &[u8], profile: Option<&[u8]>) {
    let write = |ext: &str, bytes: &[u8]| {
        let path = out.join(format!("{name}.{ext}"));
        std::fs::write(&path, bytes).unwrap_or_else(|e| fail(&path, e));
    };
    write("kvc", stream);
    let parsed = profile.map(|p| {
        write("kvcp", p);
        Profile::from_bytes(p, &Limits::DEFAULT)
    });
    let profile_outcome = match &parsed {
        None => "-",
        Some(Ok(_)) => "ok",
        Some(Err(e)) => e.kind(),
    };
    let used = parsed.as_ref().and_then(|p| p.as_ref().ok());
    let stream_outcome = match decode(stream, used, &Limits::DEFAULT) {
        Ok(kv) => format!("ok:{}", sha256_hex(&kv)),
        Err(e) => e.kind().to_string(),
    };
    println!("{name}\t{profile_outcome}\t{stream_outcome}");
}

/// SplitMix64's next value.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn usage() -> ! {
    eprintln!("usage: decode_outcomes (--stream | --case) DIR OUT [FLIPS]");
    std::process::exit(2)
}

fn name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The SHA-256 of K then V of each layer, each element little-endian.
fn sha256_hex(kv: &KvCache) -> String {
    let mut h = Sha256::new();
    for (k, v) in kv.k.iter().zip(&kv.v) {
        for t in [k, v] {
            match t {
                Tensor::F16(x) => x.iter().for_each(|e| h.update(e.to_le_bytes())),
                Tensor::Bf16(x) => x.iter().for_each(|e| h.update(e.to_le_bytes())),
                Tensor::F32(x) => x.iter().for_each(|e| h.update(e.to_le_bytes())),
            }
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn fail(path: &Path, e: std::io::Error) -> ! {
    eprintln!("decode_outcomes: {}: {e}", path.display());
    std::process::exit(1)
}
