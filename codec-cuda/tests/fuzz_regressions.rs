//! Replays the committed inputs of the cargo-fuzz target `decode_chain` through its harness
//! (`codec_cuda::fuzzing::decode_chain`, the function the target calls): `fuzz/regressions/
//! decode_chain/*` (inputs that once crashed, kept fixed) and `fuzz/seeds/decode_chain/*` (a link
//! to `decode_stream_profile`'s seeds, whose input layout it reads), each seed also with every
//! output the flag bits choose (f16 or bf16, dense or paged with 1, 3 or 16 tokens per page).

#[path = "../../fuzz/replay.rs"]
mod replay;

use codec_cuda::fuzzing::{decode_chain, CHAIN_BF16, CHAIN_PAGED};

#[test]
fn regressions_replay_clean() {
    let (_, failures) = replay::replay("regressions", "decode_chain", |data| {
        decode_chain(data);
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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
