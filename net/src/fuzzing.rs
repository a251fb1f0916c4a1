//! The body of the `frame_decode` fuzz target (`fuzz/fuzz_targets/frame_decode.rs`), shared with
//! the test that replays `fuzz/seeds/frame_decode/` (`net/tests/fuzz_seeds.rs`).

use crate::frame::{decode, FrameError, Head, Limits, CRC_LEN};

/// Limits small enough to be reached by short inputs, so that the fuzzer exercises the
/// refusals as well as the accepting paths.
pub const SMALL: Limits = Limits {
    max_payload: 1 << 16,
    max_name: 16,
    max_chunks: 64,
    max_message: 32,
};

/// Input: `flags u8 | frames`. Decodes the frames as a sequence, under the default and the
/// [`SMALL`] limits, until the bytes run out or a frame is refused: every result is a frame or
/// a typed error (never a panic); a decoded frame re-encodes to exactly its bytes and without
/// its last byte is truncated (F1). Flag bit 0 first rewrites each frame's CRC to match, so
/// that mutated payloads get past F6 to the payload checks. Returns the frames decoded under
/// the default limits.
pub fn frame_decode(data: &[u8]) -> usize {
    let Some((&flags, data)) = data.split_first() else {
        return 0;
    };
    let mut data = data.to_vec();
    if flags & 1 != 0 {
        fix_crcs(&mut data);
    }
    let frames = frames(&data, &Limits::DEFAULT);
    frames_under(&data, &SMALL);
    frames
}

/// Rewrites the CRC of every whole frame whose head parses, front to back.
fn fix_crcs(data: &mut [u8]) {
    let mut at = 0;
    while let Ok(head) = Head::parse(&data[at..], &Limits::DEFAULT) {
        let n = head.frame_len();
        let Some(frame) = data.get_mut(at..at + n) else {
            return;
        };
        let (body, crc) = frame.split_at_mut(n - CRC_LEN);
        crc.copy_from_slice(&crc32c::crc32c(body).to_le_bytes());
        at += n;
    }
}

fn frames(data: &[u8], limits: &Limits) -> usize {
    let mut rest = data;
    let mut n = 0;
    while !rest.is_empty() {
        match decode(rest, limits) {
            Ok((msg, used)) => {
                assert_eq!(msg.encode(), rest[..used], "{msg:?} re-encodes differently");
                let cut = decode(&rest[..used - 1], limits);
                assert!(
                    matches!(cut, Err(FrameError::Truncated { .. })),
                    "a frame without its last byte: {cut:?}"
                );
                rest = &rest[used..];
                n += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty() && e.check().starts_with('F'));
                break;
            }
        }
    }
    n
}

/// A frame accepted under tighter limits is accepted under the defaults, identically.
fn frames_under(data: &[u8], limits: &Limits) {
    if let Ok((msg, used)) = decode(data, limits) {
        assert_eq!(decode(data, &Limits::DEFAULT), Ok((msg, used)));
    }
}
