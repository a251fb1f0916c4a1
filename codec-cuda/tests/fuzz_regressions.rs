//! Replays the committed inputs of the cargo-fuzz targets `decode_chain` and `encode_chain`
//! through their harnesses (`codec_cuda::fuzzing`, the functions the targets call):
//! `fuzz/regressions/<target>/*` (inputs that once crashed, kept fixed) and
//! `fuzz/seeds/<target>/*` (links to the seeds of `decode_stream_profile` and `roundtrip_codec`,
//! whose input layouts they read); each `decode_chain` seed also with every output the replays
//! take (f16 or bf16, dense or paged with 1, 3 or 16 tokens per page) and damaged.

#[path = "../../fuzz/replay.rs"]
mod replay;

use codec_cuda::fuzzing::{chain_seed_variants, decode_chain, encode_chain, CHAIN_OUTPUTS};

#[test]
fn regressions_replay_clean() {
    let (_, mut failures) = replay::replay("regressions", "decode_chain", |data| {
        decode_chain(data);
    });
    failures.extend(
        replay::replay("regressions", "encode_chain", |data| {
            encode_chain(data);
        })
        .1,
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Damaged copies of each seed (one flipped byte each, CRCs fixed up).
const DAMAGED: usize = 16;

#[test]
fn seeds_replay_clean_for_every_output_and_damaged() {
    let seeds = replay::inputs(&replay::fuzz_dir().join("seeds/decode_chain"));
    assert!(seeds.len() >= 10, "{} seeds", seeds.len());
    let (mut ran, mut decoded) = (0, 0);
    let mut failures = Vec::new();
    for seed in &seeds {
        let data = std::fs::read(seed).unwrap();
        for (i, v) in chain_seed_variants(&data, DAMAGED).iter().enumerate() {
            ran += 1;
            match std::panic::catch_unwind(|| decode_chain(v)) {
                Ok(ok) => decoded += usize::from(ok),
                Err(_) => failures.push(format!("{} variant {i}", seed.display())),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every seed is a valid stream, so each of its outputs decodes; damaged copies may or may
    // not, and some must not.
    assert!(
        decoded >= seeds.len() * CHAIN_OUTPUTS.len(),
        "{decoded} of {ran} decoded"
    );
    assert!(decoded < ran, "no damaged copy was rejected ({ran} runs)");
    println!("{decoded} of {ran} decoded");
}

#[test]
fn encode_seeds_replay_clean() {
    let encoded = std::cell::Cell::new(0);
    let (ran, failures) = replay::replay("seeds", "encode_chain", |data| {
        encoded.set(encoded.get() + usize::from(encode_chain(data)));
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(ran >= 3, "{ran} seeds");
    // Every seed codes a cache but `gen-raw-rope.bin`, whose rotary theta and scaling are raw
    // bits that are not finite: both coders refuse it.
    assert_eq!(encoded.get(), ran - 1, "seeds that encoded");
}
