//! How codec-core decodes each of a directory's fuzz inputs, for the reference decoder to
//! compare (`spec/reference/against_rust.py`, which runs this):
//!
//! ```sh
//! cargo run --release -p kvc-codec-core --example decode_outcomes -- \
//!     (--stream | --case | --profile) DIR OUT [FLIPS]
//! ```
//!
//! Each file of `DIR` is read as a fuzz target reads its input: with `--stream` it is a stream
//! (`decode_stream`); with `--case`, a profile and a stream (`decode_stream_profile`,
//! `decode_chain`: `flags | profile_len | profile | stream`, the stream's profile hash and CRCs
//! fixed up as the flags say); with `--profile`, a profile (`decode_profile`: `flags |
//! profile`, its CRC fixed up if the flags say). For each input this writes `OUT/NAME.kvc` (the
//! stream) and `OUT/NAME.kvcp` (the profile's bytes), those it has, and prints a line
//! `NAME<TAB>PROFILE<TAB>STREAM`: `PROFILE` is `-` (no profile), `ok`, or the spec's error
//! class of `Profile::from_bytes`; `STREAM` is `-` (no stream), `ok:` and the SHA-256 of the
//! decoded K then V of each layer (little-endian, as the reference's `output_bytes` lays them
//! out), or the spec's error class of `codec_core::decode`, given the profile when it parsed.
//! Limits are the spec's defaults. With `FLIPS`, each input also gives that many damaged
//! copies, `NAME~1` and on: one bit flipped (where a seeded generator says) in the stream,
//! whose chunk and header CRCs are then recomputed, or in a profile alone, whose CRC is, so
//! that most damage reaches the checks after the CRCs.

use std::path::{Path, PathBuf};

use codec_core::fuzzing::{fix_profile_crc, fix_stream_crcs, profile_input, StreamProfileCase};
use codec_core::{decode, KvCache, Limits, Profile, Tensor};
use sha2::{Digest, Sha256};

/// What each file of the directory holds.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Stream,
    Case,
    Profile,
}

/// One input: a stream, a profile, or both.
struct Input {
    stream: Option<Vec<u8>>,
    profile: Option<Vec<u8>>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, dir, out, flips) = match args.as_slice() {
        [mode, dir, out, rest @ ..] if rest.len() < 2 => {
            let mode = match mode.as_str() {
                "--stream" => Mode::Stream,
                "--case" => Mode::Case,
                "--profile" => Mode::Profile,
                _ => usage(),
            };
            let flips = rest.first().map_or(Some(0), |f| f.parse::<u64>().ok());
            let flips = flips.unwrap_or_else(|| usage());
            (mode, Path::new(dir), PathBuf::from(out), flips)
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
        let input = read(mode, &data);
        let name = name(file);
        outcome(&out, &name, &input);
        let mut rng = name.bytes().fold(0xcbf2_9ce4_8422_2325, |h: u64, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        for k in 1..=flips {
            let Some(damaged) = damage(mode, &input, splitmix(&mut rng)) else {
                break;
            };
            outcome(&out, &format!("{name}~{k}"), &damaged);
        }
    }
}

/// A file's input as the fuzz targets read it.
fn read(mode: Mode, data: &[u8]) -> Input {
    match mode {
        Mode::Stream => Input {
            stream: Some(data.to_vec()),
            profile: None,
        },
        Mode::Case => {
            let c = StreamProfileCase::read(data);
            Input {
                profile: Some(c.profile_bytes.to_vec()),
                stream: Some(c.stream.into_owned()),
            }
        }
        Mode::Profile => Input {
            stream: None,
            profile: Some(profile_input(data).into_owned()),
        },
    }
}

/// `input` with bit `r >> 61` of byte `r % len` flipped, of its stream (its chunk and header
/// CRCs then recomputed) or, in a profile alone, of the profile (its CRC recomputed); `None`
/// if that is empty.
fn damage(mode: Mode, input: &Input, r: u64) -> Option<Input> {
    let flip = |bytes: &[u8]| -> Option<Vec<u8>> {
        let mut b = bytes.to_vec();
        let at = r.checked_rem(b.len() as u64)? as usize;
        b[at] ^= 1 << (r >> 61);
        Some(b)
    };
    Some(match mode {
        Mode::Profile => {
            let mut profile = flip(input.profile.as_deref()?)?;
            fix_profile_crc(&mut profile);
            Input {
                stream: None,
                profile: Some(profile),
            }
        }
        _ => {
            let mut stream = flip(input.stream.as_deref()?)?;
            fix_stream_crcs(&mut stream);
            Input {
                stream: Some(stream),
                profile: input.profile.clone(),
            }
        }
    })
}

/// Writes `OUT/NAME.kvc` and `OUT/NAME.kvcp` (those the input has) and prints its line.
fn outcome(out: &Path, name: &str, input: &Input) {
    let write = |ext: &str, bytes: &[u8]| {
        let path = out.join(format!("{name}.{ext}"));
        std::fs::write(&path, bytes).unwrap_or_else(|e| fail(&path, e));
    };
    let parsed = input.profile.as_ref().map(|p| {
        write("kvcp", p);
        Profile::from_bytes(p, &Limits::DEFAULT)
    });
    let profile_outcome = match &parsed {
        None => "-",
        Some(Ok(_)) => "ok",
        Some(Err(e)) => e.kind(),
    };
    let used = parsed.as_ref().and_then(|p| p.as_ref().ok());
    let stream_outcome = match &input.stream {
        None => "-".to_string(),
        Some(stream) => {
            write("kvc", stream);
            match decode(stream, used, &Limits::DEFAULT) {
                Ok(kv) => format!("ok:{}", sha256_hex(&kv)),
                Err(e) => e.kind().to_string(),
            }
        }
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
    eprintln!("usage: decode_outcomes (--stream | --case | --profile) DIR OUT [FLIPS]");
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
