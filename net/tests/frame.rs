//! The frame codec: every message round-trips, and every malformed frame (truncated, oversized,
//! of another version or magic, with a bad CRC or a bad field) is a typed error.

mod common;

use codec_core::adapt::Choice;
use kvc_net::frame::{decode, ErrorCode, FrameError, Kind, Limits, Message, HEAD_LEN};

/// Re-frames `payload` as a `kind` frame with a valid CRC (to test payload checks alone).
fn reframe(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut b = b"KVCN\x01".to_vec();
    b.push(kind as u8);
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    let crc = crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// CRC-32C, bit by bit (independent of the crate's).
fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn payload_error(kind: Kind, payload: &[u8]) -> FrameError {
    decode(&reframe(kind, payload), &Limits::DEFAULT).unwrap_err()
}

#[test]
fn every_message_round_trips_and_every_prefix_is_truncated() {
    for m in common::sample_messages() {
        let bytes = m.encode();
        assert_eq!(&bytes[..5], b"KVCN\x01");
        assert_eq!(bytes[5], m.kind() as u8);
        assert_eq!(bytes, reframe(m.kind(), &bytes[HEAD_LEN..bytes.len() - 4]));
        assert_eq!(
            decode(&bytes, &Limits::DEFAULT),
            Ok((m.clone(), bytes.len()))
        );
        // Bytes after the frame are left alone.
        let mut two = bytes.clone();
        two.extend_from_slice(&bytes);
        assert_eq!(decode(&two, &Limits::DEFAULT), Ok((m.clone(), bytes.len())));
        for k in 0..bytes.len() {
            let e = decode(&bytes[..k], &Limits::DEFAULT).unwrap_err();
            assert!(
                matches!(e, FrameError::Truncated { .. }),
                "{m:?} cut at {k}: {e}"
            );
            assert_eq!(e.check(), "F1");
        }
    }
}

#[test]
fn oversized_lengths_are_refused_from_the_head_alone() {
    // A head announcing 4 GiB - 1 bytes: refused from its 10 bytes, before any payload.
    let mut head = b"KVCN\x01\x82".to_vec();
    head.extend_from_slice(&u32::MAX.to_le_bytes());
    let e = decode(&head, &Limits::DEFAULT).unwrap_err();
    assert_eq!(
        e,
        FrameError::TooLong {
            len: u32::MAX,
            max: 256 << 20
        }
    );
    assert!(e.to_string().contains("over the limit"), "{e}");
    // The server's limit on client frames.
    let open = Message::Open {
        context: "x".repeat(200),
    }
    .encode();
    assert!(decode(&open, &Limits::CLIENT_FRAMES).is_ok());
    let tight = Limits {
        max_payload: 199,
        ..Limits::DEFAULT
    };
    assert_eq!(
        decode(&open[..HEAD_LEN], &tight),
        Err(FrameError::TooLong { len: 200, max: 199 })
    );
    // Counts inside a payload are checked against the bytes there before anything is made
    // for them: an Info announcing 1M chunks in a few bytes.
    let mut info = vec![0, 1, 7];
    info.extend_from_slice(&(1u32 << 20).to_le_bytes());
    assert!(matches!(
        payload_error(Kind::Info, &info),
        FrameError::Payload { .. }
    ));
    info[3..7].copy_from_slice(&((1u32 << 20) + 1).to_le_bytes());
    assert!(matches!(
        payload_error(Kind::Info, &info),
        FrameError::Limit { what: "chunks", .. }
    ));
}

#[test]
fn wrong_magic_version_type_and_crc_are_refused() {
    let good = Message::Get {
        chunk: 3,
        choice: Choice::Level(7),
    }
    .encode();
    let with = |at: usize, b: u8| {
        let mut x = good.clone();
        x[at] = b;
        decode(&x, &Limits::DEFAULT).unwrap_err()
    };
    assert_eq!(with(0, b'X'), FrameError::Magic { got: *b"XVCN" });
    assert_eq!(
        with(4, 2),
        FrameError::Version {
            got: 2,
            supported: 1
        }
    );
    assert!(with(4, 2)
        .to_string()
        .contains("version 2 is not supported"));
    assert_eq!(with(5, 0x05), FrameError::Kind { got: 0x05 });
    assert!(matches!(with(12, 0xff), FrameError::Crc { .. }));
    let n = good.len();
    assert!(matches!(
        with(n - 1, good[n - 1] ^ 1),
        FrameError::Crc { .. }
    ));
    // A length field changed by one: the CRC no longer matches, or the frame is cut short.
    let mut longer = good.clone();
    longer[6] += 1;
    longer.push(0);
    assert!(matches!(
        decode(&longer, &Limits::DEFAULT),
        Err(FrameError::Crc { .. })
    ));
}

#[test]
fn payload_fields_are_checked() {
    let payload = |e: FrameError| match e {
        FrameError::Payload { why, .. } => why,
        e => panic!("not a payload error: {e}"),
    };
    // Get: choice byte, the level byte of text, trailing bytes, short.
    assert!(payload(payload_error(Kind::Get, &[0, 0, 0, 0, 2, 0])).contains("neither"));
    assert!(payload(payload_error(Kind::Get, &[0, 0, 0, 0, 1, 3])).contains("non-zero level"));
    assert!(payload(payload_error(Kind::Get, &[0, 0, 0, 0, 0, 3, 9])).contains("after the last"));
    assert!(payload(payload_error(Kind::Get, &[0, 0, 0, 0, 0])).contains("past the payload"));
    // Open: names that could leave the root, hide, or are empty or too long.
    for bad in ["", "..", ".hidden", "a/b", "../etc", "a b", "é"] {
        let e = payload_error(Kind::Open, bad.as_bytes());
        assert!(
            matches!(
                e,
                FrameError::Payload {
                    kind: Kind::Open,
                    ..
                }
            ),
            "{bad:?}: {e}"
        );
    }
    let long = payload_error(Kind::Open, "a".repeat(256).as_bytes());
    assert_eq!(
        long,
        FrameError::Limit {
            kind: Kind::Open,
            what: "context name bytes",
            got: 256,
            max: 255
        }
    );
    assert!(decode(&reframe(Kind::Open, b"gpl3_v2-a.b"), &Limits::DEFAULT).is_ok());
    // Hello: a max_payload too small for an Error frame.
    assert!(payload(payload_error(Kind::Hello, &4095u32.to_le_bytes())).contains("4096"));
    // Bye carries nothing.
    assert!(payload(payload_error(Kind::Bye, &[0])).contains("after the last"));
    // Text: whole u32s only.
    assert!(payload(payload_error(Kind::Text, &[0, 0, 0, 0, 1, 2])).contains("whole number"));
    // Error: known codes, UTF-8, bounded.
    assert!(payload(payload_error(Kind::Error, &[99, 0])).contains("unknown error code"));
    assert!(payload(payload_error(Kind::Error, &[4, 0, 0xff])).contains("UTF-8"));
    let mut long = vec![4, 0];
    long.extend(std::iter::repeat_n(b'x', 1025));
    assert!(matches!(
        payload_error(Kind::Error, &long),
        FrameError::Limit {
            what: "message bytes",
            ..
        }
    ));
    assert_eq!(ErrorCode::from_u16(4), Some(ErrorCode::UnknownContext));
    // Info: reserved flags, levels out of order, a size under 4 bytes.
    let info = |flags: u8, levels: &[u8], size: u32| {
        let mut b = vec![flags, levels.len() as u8];
        b.extend_from_slice(levels);
        b.extend_from_slice(&1u32.to_le_bytes());
        for _ in levels {
            b.extend_from_slice(&size.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    };
    assert!(decode(
        &reframe(Kind::Info, &info(1, &[1, 7], 10)),
        &Limits::DEFAULT
    )
    .is_ok());
    assert!(payload(payload_error(Kind::Info, &info(2, &[1, 7], 10))).contains("reserved"));
    assert!(payload(payload_error(Kind::Info, &info(0, &[7, 1], 10))).contains("ascending"));
    assert!(payload(payload_error(Kind::Info, &info(0, &[], 10))).contains("empty"));
    assert!(payload(payload_error(Kind::Info, &info(0, &[1, 7], 3))).contains("under 4"));
}
