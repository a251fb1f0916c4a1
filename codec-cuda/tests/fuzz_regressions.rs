//! Replays the committed inputs of the cargo-fuzz targets `decode_chain` and `encode_chain`
//! through their harnesses (`codec_cuda::fuzzing`, the functions the targets call):
//! `fuzz/regressions/<target>/*` (inputs that once crashed, kept fixed) and
//! `fuzz/seeds/<target>/*` (links to the seeds of `decode_stream_profile` and `roundtrip_codec`,
//! whose input layouts they read); each `decode_chain` seed also with every output the flag
//! bits choose (f16 or bf16, dense or paged with 1, 3 or 16 tokens per page).

#[path = "../../fuzz/replay.rs"]
mod replay;

use codec_cuda::fuzzing::{decode_chain, encode_chain, CHAIN_BF16, CHAIN_PAGED};

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

/// The output choices of the flag byte's bits 2-7.
const OUTPUTS: [u8; 5] = [
    0,
    CHAIN_BF16,
    CHAIN_PAGED,
    CHAIN_PAGED | CHAIN_BF16 | (2 << 4),
    CHAIN_PAGED | (15 << 4),
];

#[test]
fn seeds_replay_clean_for_every_output() {
    for output in OUTPUTS {
        let decoded = std::cell::Cell::new(0);
        let (ran, failures) = replay::replay("seeds", "decode_chain", |data| {
            let mut input = data.to_vec();
            if let Some(flags) = input.first_mut() {
                *flags = (*flags & 3) | output;
            }
            decoded.set(decoded.get() + usize::from(decode_chain(&input)));
        });
        assert!(
            failures.is_empty(),
            "flags {output:#x}:\n{}",
            failures.join("\n")
        );
        // The seeds are valid streams: every one must reach the kernels and decode.
        assert_eq!(decoded.get(), ran, "flags {output:#x}: seeds that decoded");
        assert!(ran >= 10, "{ran} seeds");
    }
}
