//! spec/FORMAT.md Appendix B, written from the spec by hand, must decode with codec-core to the
//! values the spec gives: the spec and the code agree byte for byte. Also checks the step
//! multipliers of §7.1, the rounding examples of §7.5, and that the decoder rejects the v2 forms
//! §4.6 and §5.5 reject.

mod common;

use common::crc32c;

use codec_core::consts::{EXP_MULT, STREAM_VERSION};
use codec_core::container::{ChunkEntry, Header};
use codec_core::importance::ImportanceParams;
use codec_core::profile::{hex, Importance, LevelTables, SymbolTable};
use codec_core::quant::{dequantize_block, BlockConsts, ChannelParams, Exps};
use codec_core::rans::{FreqTable, TableError};
use codec_core::{
    decode, BlockError, DecodeError, Dtype, HeaderError, KvMeta, KvShape, Limits, Profile,
    ProfileError, Rope, RopeStyle, Tensor,
};

/// Bytes of a row of the spec's tables: hex pairs, separated by spaces and backticks.
fn hx(s: &str) -> Vec<u8> {
    s.split([' ', '`'])
        .filter(|t| !t.is_empty())
        .map(|t| u8::from_str_radix(t, 16).unwrap())
        .collect()
}

fn le32(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Concatenates `(offset, bytes)` rows, checking each row starts at its stated offset.
fn rows(rows: &[(usize, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (off, b) in rows {
        assert_eq!(out.len(), *off, "row at offset {off}");
        out.extend(b);
    }
    out
}

/// Rewrites the trailing CRC-32C of a profile or chunk.
fn fix_crc(b: &mut [u8]) {
    let n = b.len() - 4;
    let c = crc32c(&b[..n]);
    b[n..].copy_from_slice(&c.to_le_bytes());
}

fn f16_bits(t: &Tensor) -> Vec<u16> {
    match t {
        Tensor::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        _ => panic!("f16 expected"),
    }
}

/// Appendix B profile, row by row.
fn profile_bytes() -> Vec<u8> {
    rows(&[
        (0, hx("4b 56 43 50")),
        (4, hx("02 00 00 00")),
        (8, hx("01 00 00 00 02 00 00 00 02 00 00 00")),
        (20, hx("01 01 00 00")),
        (24, hx("00 00 00 3f")),
        (28, hx("00 00 00 00 00 00 80 3e 00 00 00 3e 08")),
        (41, hx("00 00 80 bf 00 00 00 3f 00 00 80 3e 10")),
        (54, hx("00 00 80 3e 00 00 40 3f 00 00 c0 3e 0c")),
        (67, hx("00 00 00 00 00 00 80 3f 00 00 00 3f 00")),
        (80, hx("00 00 00 3f 00 00 00 3e 00 00 80 3d 00")),
        (93, hx("00 00 80 3f 00 00 80 3f 00 00 00 3f 04")),
        (106, hx("00 00 00 00 00 00 00 3f 00 00 80 3e 10")),
        (119, hx("00 00 00 bf 00 00 80 3e 00 00 00 3e 08")),
        (132, hx("00 00 80 3f 33 33 73 3f 06 00 00 00")),
        (144, hx("00 00 00 3f 00 00 80 be 00 00 80 3f 00 00 00 00")),
        (160, hx("00 00 40 3f 00 00 00 bf")),
        (168, hx("03 00")),
        (170, hx("01 00 02 00 0c ff 01 01 00")),
        (179, hx("00 a0 0f 60 00")),
        (184, hx("02 00 01 00 03 00 08 00 03 ff 00 01 00")),
        (197, hx("01 01 00")),
        (200, hx("02 00 02 00 00 00 02 00 01 00 02 02 01 01 00 02")),
        (216, hx("85 1f 06 a0")),
    ])
}

/// Appendix B.1: the same profile in version 3 (7-byte channel records), row by row.
fn profile_bytes_v3() -> Vec<u8> {
    let v2 = profile_bytes();
    rows(&[
        (0, hx("4b 56 43 50")),
        (4, hx("03 00 00 00")),
        (8, v2[8..28].to_vec()),
        (28, hx("00 00 80 3e 00 3e 08")),
        (35, hx("80 bf 00 3f 80 3e 10")),
        (42, hx("80 3e 40 3f c0 3e 0c")),
        (49, hx("00 00 80 3f 00 3f 00")),
        (56, hx("00 3f 00 3e 80 3d 00")),
        (63, hx("80 3f 80 3f 00 3f 04")),
        (70, hx("00 00 00 3f 80 3e 10")),
        (77, hx("00 bf 80 3e 00 3e 08")),
        (84, v2[132..216].to_vec()),
        (168, hx("d2 5a 92 11")),
    ])
}

/// Appendix B stream header, row by row.
fn header_bytes() -> Vec<u8> {
    let hash =
        hx("ea 27 98 7e 26 f5 6b fb 42 25 59 53 8b 15 0b 07 c3 7f d8 b0 26 52 8a b3 e0 90 af 1e 0f f6 59 22");
    rows(&[
        (0, hx("4b 56 43 53 02 00 00 00 85 00 00 00")),
        (12, hx("00 01 00 00")),
        (16, hx("01 00 00 00 02 00 00 00 02 00 00 00 03 00 00 00")),
        (32, hx("00 40 1c 46 00 00 80 3f")),
        (40, hx("00 00 00 00 00 00 00 00")),
        (48, hx("00 06 00 00 02 00 01 00")),
        (56, hash),
        (88, hx("00 00 00 00 00 00 00 00")),
        (96, hx("01 00 00 00 03 00 74 6f 79")),
        (
            105,
            hx("85 00 00 00 00 00 00 00 68 01 00 00 00 00 00 00 03 00 00 00 00 00 00 00"),
        ),
        (129, hx("cc 15 2b 79")),
    ])
}

/// Appendix B chunk, row by row.
fn chunk_bytes() -> Vec<u8> {
    let mut k_lanes = [0u32; 32];
    k_lanes[..11].copy_from_slice(&[1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1]);
    let mut v_lanes = [0u32; 32];
    v_lanes[..8].copy_from_slice(&[0, 1, 0, 0, 1, 1, 1, 1]);
    rows(&[
        (0, hx("02 00 00 00")),
        (4, le32(&k_lanes)),
        (132, hx("03")),
        (133, hx("00 04 00 08 00 04")),
        (139, hx("00 38 00 bc 00 34 00 40")),
        (147, hx("ff ff ff ff 02 00 00 00")),
        (
            155,
            le32(&[0x400, 0xC00, 0x400, 0xFA0, 0xF00, 0xFA0, 0xE00]),
        ),
        (183, hx("03 00 00 00")),
        (187, le32(&v_lanes)),
        (315, hx("00")),
        (316, hx("00 34 00 40 00 b8 00 3c")),
        (324, hx("01 00 00 00 ff ff ff ff 03 00 00 00")),
        (336, le32(&[0xFA0, 0xFA0, 0xE00, 0x400, 0xFFF])),
        (356, hx("b9 cb f7 33")),
    ])
}

/// The Appendix B profile built through the library's writer.
fn profile_from_parts() -> Profile {
    let cp = |mean: f32, d: f32, a: f32, w: u8| ChannelParams {
        mean,
        delta_step: d,
        anchor_step: a,
        weight: w,
    };
    let params = vec![
        cp(0.0, 0.25, 0.125, 8),
        cp(-1.0, 0.5, 0.25, 16),
        cp(0.25, 0.75, 0.375, 12),
        cp(0.0, 1.0, 0.5, 0),
        cp(0.5, 0.125, 0.0625, 0),
        cp(1.0, 1.0, 0.5, 4),
        cp(0.0, 0.5, 0.25, 16),
        cp(-0.5, 0.25, 0.125, 8),
    ];
    let table = |radius: u8, f: &[u16]| SymbolTable {
        radius,
        freqs: FreqTable::new(f).unwrap(),
    };
    let tables = vec![
        table(1, &[512, 3072, 511, 1]),
        table(0, &[4000, 96]),
        table(2, &[256, 768, 2048, 768, 255, 1]),
    ];
    let importance = Importance {
        params: ImportanceParams {
            slope: 1.0,
            quantile: 0.95,
            max_exp: 6,
        },
        query_mean: vec![0.5, -0.25, 1.0, 0.0],
        tau: vec![0.75, -0.5],
    };
    Profile::from_parts(
        1,
        2,
        2,
        vec![0.5],
        params,
        Some(importance),
        vec![LevelTables {
            tables,
            down: vec![1, 1, 0],
            map: vec![2, 0, 2, 0, 0, 0, 2, 0, 1, 0, 2, 2, 1, 1, 0, 2],
        }],
    )
}

#[test]
fn exp_mult_is_section_7_1() {
    let bits: [u32; 16] = [
        0x3F800000, 0x3FB504F3, 0x40000000, 0x403504F3, 0x40800000, 0x40B504F3, 0x41000000,
        0x413504F3, 0x41800000, 0x41B504F3, 0x42000000, 0x423504F3, 0x42800000, 0x42B504F3,
        0x43000000, 0x433504F3,
    ];
    assert_eq!(EXP_MULT.map(f32::to_bits), bits);
    // Odd entries are sqrt(2) rounded to f32, times a power of two (exactly).
    assert_eq!(f32::from_bits(0x3FB504F3), core::f32::consts::SQRT_2);
    for e in (1..16).step_by(2) {
        assert_eq!(EXP_MULT[e], EXP_MULT[1] * EXP_MULT[e - 1]);
    }
}

#[test]
fn rounding_examples_of_section_7_5() {
    let p = [ChannelParams {
        mean: 0.25,
        delta_step: 0.1,
        anchor_step: 0.05,
        weight: 12,
    }];
    let consts = BlockConsts::new(&p, 0.5);
    let (m, a, dq, w) = (0.25f32, 0.05f32 * 0.5, 0.1f32 * 0.5, 0.75f32);
    assert_eq!((a.to_bits(), dq.to_bits()), (0x3CCCCCCD, 0x3D4CCCCD));
    // Anchor row 0 (q = 3) and delta row 1 (q = -2), one channel, G = 2, no sink rows.
    let decode_rows = |exps: &[u8]| {
        let mut rec = [0f32; 2];
        let ex = Exps { exps, head_dim: 1 };
        dequantize_block(&[3, -2], &consts, 2, 0, ex, &mut rec);
        rec.map(f32::to_bits)
    };
    let narrow = |x: [u32; 2]| {
        let mut t = Tensor::zeros(Dtype::F16, 2);
        t.as_mut().write_f32(0, &x.map(f32::from_bits));
        let bf = x.map(|u| (u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        (f16_bits(&t), bf)
    };

    // Without exponents.
    assert_eq!((3.0 * a).to_bits(), 0x3D99999A);
    let xa = m + 3.0 * a;
    assert_eq!(xa.to_bits(), 0x3EA66666);
    assert_eq!((xa - m).to_bits(), 0x3D999998);
    assert_eq!((w * (xa - m)).to_bits(), 0x3D666664);
    let pred = m + w * (xa - m);
    assert_eq!(pred.to_bits(), 0x3E9CCCCC);
    assert_eq!((-2.0 * dq).to_bits(), 0xBDCCCCCD);
    let x = pred + -2.0 * dq;
    assert_eq!([xa.to_bits(), x.to_bits()], [0x3EA66666, 0x3E533332]);
    assert_eq!(decode_rows(&[]), [0x3EA66666, 0x3E533332]);
    assert_eq!(decode_rows(&[0, 0]), [0x3EA66666, 0x3E533332]);
    assert_eq!(
        narrow([0x3EA66666, 0x3E533332]),
        (vec![0x3533, 0x329A], [0x3EA6, 0x3E53])
    );

    // Anchor row at e = 3, delta row at e = 1.
    let sa = a * EXP_MULT[3];
    assert_eq!(sa.to_bits(), 0x3D90D0C3);
    assert_eq!((3.0 * sa).to_bits(), 0x3E593924);
    let xa = m + 3.0 * sa;
    assert_eq!(xa.to_bits(), 0x3EEC9C92);
    assert_eq!((xa - m).to_bits(), 0x3E593924);
    assert_eq!((w * (xa - m)).to_bits(), 0x3E22EADB);
    let pred = m + w * (xa - m);
    assert_eq!(pred.to_bits(), 0x3ED1756E);
    let sd = dq * EXP_MULT[1];
    assert_eq!(sd.to_bits(), 0x3D90D0C3);
    assert_eq!((-2.0 * sd).to_bits(), 0xBE10D0C3);
    let x = pred + -2.0 * sd;
    assert_eq!([xa.to_bits(), x.to_bits()], [0x3EEC9C92, 0x3E890D0C]);
    assert_eq!(decode_rows(&[3, 1]), [0x3EEC9C92, 0x3E890D0C]);
    assert_eq!(
        narrow([0x3EEC9C92, 0x3E890D0C]),
        (vec![0x3765, 0x3448], [0x3EED, 0x3E89])
    );
}

#[test]
fn appendix_b_profile() {
    // Profile: the bytes of the table, its CRC and hash, and the library's writer agree.
    let pbytes = profile_bytes();
    assert_eq!(pbytes.len(), 220);
    assert_eq!(crc32c(b"123456789"), 0xE3069283);
    assert_eq!(crc32c(&pbytes[..216]), 0xA0061F85);
    let profile = Profile::from_bytes(&pbytes, &Limits::DEFAULT).unwrap();
    assert_eq!(profile.as_bytes(), &pbytes[..]);
    let all: Vec<u8> = (0..profile.levels()).collect();
    assert_eq!(profile.with_levels(&all).as_bytes(), &pbytes[..]);
    // B.1: the library writes version 3; the same parts give the appendix's version-3 bytes,
    // which parse to the same channel parameters as the version-2 bytes.
    let v3 = profile_from_parts();
    let v3_bytes = profile_bytes_v3();
    assert_eq!(v3.as_bytes(), &v3_bytes[..]);
    assert_eq!((v3.version(), profile.version()), (3, 2));
    assert_eq!(v3_bytes.len(), 172);
    assert_eq!(crc32c(&v3_bytes[..168]), 0x11925AD2);
    assert_eq!(
        hex(&v3.hash()),
        "7b04053031d4e086c6b28168109cb0d48250ffc8b14aa219606f855c11c855b8"
    );
    for kv in 0..2 {
        assert_eq!(v3.channel_params(0, kv), profile.channel_params(0, kv));
    }
    assert_eq!(v3.level_tables(0), profile.level_tables(0));
    assert_eq!(
        hex(&profile.hash()),
        "ea27987e26f56bfb422559538b150b07c37fd8b026528ab3e090af1e0ff65922"
    );
    let imp = profile.importance().expect("flags bit 0 is set");
    assert_eq!(imp.params.slope, 1.0);
    assert_eq!(imp.params.quantile.to_bits(), 0x3F733333);
    assert_eq!(imp.params.max_exp, 6);
    assert_eq!(imp.query_mean, [0.5, -0.25, 1.0, 0.0]);
    assert_eq!(imp.tau, [0.75, -0.5]);
    // The down^e table of the appendix.
    let down_e = [[0, 1, 1, 1], [1, 1, 1, 1], [2, 0, 1, 1]];
    for (t, row) in down_e.iter().enumerate() {
        for (e, &want) in row.iter().enumerate() {
            assert_eq!(profile.table_at(0, t as u8, e as u8), want, "t {t} e {e}");
        }
        assert_eq!(profile.table_at(0, t as u8, 15), row[3]);
    }
}

/// Appendix B's stream header, naming the profile `profile_hash`.
fn appendix_header(profile_hash: [u8; 32]) -> Header {
    Header {
        version: STREAM_VERSION,
        shape: KvShape {
            layers: 1,
            kv_heads: 2,
            head_dim: 2,
            tokens: 3,
        },
        dtype: Dtype::F16,
        meta: KvMeta {
            model_id: "toy".into(),
            rope: Rope {
                theta: 10000.0,
                style: RopeStyle::NeoX,
                scaling: 1.0,
                k_pre_rope: false,
            },
            first_position: 0,
        },
        chunk_tokens: 1536,
        group: 2,
        n_sink: 1,
        profile_hash,
        profile_len: 0,
        chunks: vec![ChunkEntry {
            offset: 133,
            len_bytes: 360,
            token_start: 0,
            tokens: 3,
            level: 0,
        }],
    }
}

#[test]
fn appendix_b_header() {
    // Stream header: the bytes of the table, and the library's writer agree.
    let pbytes = profile_bytes();
    let profile = Profile::from_bytes(&pbytes, &Limits::DEFAULT).unwrap();
    let chunk = chunk_bytes();
    assert_eq!(chunk.len(), 360);
    assert_eq!(crc32c(&chunk[..356]), 0x33F7CBB9);
    let hbytes = header_bytes();
    assert_eq!(hbytes.len(), 133);
    assert_eq!(crc32c(&hbytes[..129]), 0x792B15CC);
    assert_eq!(appendix_header(profile.hash()).to_bytes(), hbytes);
}

#[test]
fn appendix_b_stream_decodes_referenced_and_embedded() {
    let pbytes = profile_bytes();
    let profile = Profile::from_bytes(&pbytes, &Limits::DEFAULT).unwrap();
    let (v3, v3_bytes) = (profile_from_parts(), profile_bytes_v3());
    let chunk = chunk_bytes();
    let header = appendix_header(profile.hash());
    let hbytes = header.to_bytes();
    let mut stream = hbytes;
    stream.extend(&chunk);
    assert_eq!(stream.len(), 493);
    let cache = decode(&stream, Some(&profile), &Limits::DEFAULT).unwrap();
    assert_eq!(
        f16_bits(&cache.k[0]),
        [
            0x3800, 0xbc00, 0x3400, 0x4000, // token 0 (sink)
            0x3400, 0xbd6a, 0x3c00, 0xb800, // token 1
            0x3400, 0xbc00, 0x381f, 0x0000, // token 2
        ]
    );
    assert_eq!(
        f16_bits(&cache.v[0]),
        [
            0x3400, 0x4000, 0xb800, 0x3c00, // token 0 (sink)
            0x3800, 0x3f00, 0xba00, 0x0000, // token 1
            0x3780, 0x3d00, 0x0000, 0xb500, // token 2
        ]
    );
    // The decimal values the appendix gives.
    let k: Vec<f64> = cache.k[0].to_f32_vec().into_iter().map(f64::from).collect();
    assert_eq!(k[5], -1.353515625);
    assert_eq!(k[10], 0.51513671875);

    // Self-contained: the same stream with the profile embedded decodes the same.
    let mut embedded = header.clone();
    embedded.profile_len = pbytes.len() as u64;
    embedded.chunks[0].offset = 133 + pbytes.len() as u64;
    let mut s2 = embedded.to_bytes();
    s2.extend(&pbytes);
    s2.extend(&chunk);
    assert_eq!(decode(&s2, None, &Limits::DEFAULT).unwrap(), cache);
    // B.1: the same stream naming the version-3 profile decodes the same, referenced or
    // embedded.
    let mut h3 = header.clone();
    h3.profile_hash = v3.hash();
    let mut s3 = h3.to_bytes();
    s3.extend(&chunk);
    assert_eq!(decode(&s3, Some(&v3), &Limits::DEFAULT).unwrap(), cache);
    h3.profile_len = v3_bytes.len() as u64;
    h3.chunks[0].offset = 133 + v3_bytes.len() as u64;
    let mut s4 = h3.to_bytes();
    s4.extend(&v3_bytes);
    s4.extend(&chunk);
    assert_eq!(decode(&s4, None, &Limits::DEFAULT).unwrap(), cache);
}

#[test]
fn appendix_b_variants_that_must_be_rejected_or_accepted() {
    let pbytes = profile_bytes();
    let profile = Profile::from_bytes(&pbytes, &Limits::DEFAULT).unwrap();
    let bad_profile = |off: usize, bytes: &[u8]| {
        let mut p = pbytes.clone();
        p[off..off + bytes.len()].copy_from_slice(bytes);
        fix_crc(&mut p);
        DecodeError::from(Profile::from_bytes(&p, &Limits::DEFAULT).unwrap_err())
    };
    // The field an `InvalidField` error names: its message is "invalid {field}: {value}".
    let invalid = |e: DecodeError| -> String {
        assert_eq!(e.kind(), "InvalidField", "{e:?}");
        let m = e.to_string();
        m["invalid ".len()..m.rfind(": ").unwrap()].to_string()
    };
    // P3: version 1 profiles are not decoded.
    assert!(matches!(
        bad_profile(4, &[1]),
        DecodeError::Profile(ProfileError::UnsupportedVersion { got: 1 })
    ));
    // P8, P9: flags other than bit 0; reserved bytes 22..24.
    assert_eq!(invalid(bad_profile(21, &[3])), "profile flags");
    assert_eq!(invalid(bad_profile(21, &[0x80])), "profile flags");
    assert_eq!(invalid(bad_profile(22, &[1])), "profile reserved field");
    // P13, P14, P16: the importance hints.
    assert_eq!(invalid(bad_profile(141, &[1])), "profile reserved field");
    assert_eq!(invalid(bad_profile(140, &[16])), "importance parameters");
    let quantile_1_5 = 1.5f32.to_le_bytes();
    assert_eq!(
        invalid(bad_profile(136, &quantile_1_5)),
        "importance parameters"
    );
    let slope_neg = (-1.0f32).to_le_bytes();
    assert_eq!(
        invalid(bad_profile(132, &slope_neg)),
        "importance parameters"
    );
    let nan = f32::NAN.to_le_bytes();
    assert_eq!(
        invalid(bad_profile(148, &nan)),
        "query mean or score threshold"
    );
    assert_eq!(
        invalid(bad_profile(164, &nan)),
        "query mean or score threshold"
    );
    // P21: a down link >= n_tables.
    assert_eq!(invalid(bad_profile(199, &[3])), "table id in down links");
    // Accepted: max_exp 15, slope -0.0, quantile 0 and 1, a self-linked table.
    for (off, b) in [
        (140, vec![15]),
        (132, (-0.0f32).to_le_bytes().to_vec()),
        (136, 0f32.to_le_bytes().to_vec()),
        (136, 1f32.to_le_bytes().to_vec()),
        (199, vec![2]),
    ] {
        let mut p = pbytes.clone();
        p[off..off + b.len()].copy_from_slice(&b);
        fix_crc(&mut p);
        Profile::from_bytes(&p, &Limits::DEFAULT).unwrap();
    }
    // Without the hints (flags 0, the 36 bytes of hints removed) the stream decodes the same.
    let mut plain = pbytes[..132].to_vec();
    plain[21] = 0;
    plain.extend(&pbytes[168..]);
    fix_crc(&mut plain);
    let plain = Profile::from_bytes(&plain, &Limits::DEFAULT).unwrap();
    assert!(plain.importance().is_none());

    let chunk = chunk_bytes();
    let stream_with = |p: &Profile, chunk: &[u8]| {
        let mut s = header_bytes();
        // Point the header at the profile (`profile_hash`) and fix the header CRC.
        s[56..88].copy_from_slice(&p.hash());
        fix_crc(&mut s);
        s.extend(chunk);
        s
    };
    let reference = decode(
        &stream_with(&profile, &chunk),
        Some(&profile),
        &Limits::DEFAULT,
    );
    let reference = reference.unwrap();
    assert_eq!(
        decode(&stream_with(&plain, &chunk), Some(&plain), &Limits::DEFAULT).unwrap(),
        reference
    );

    let bad_chunk = |off: usize, bytes: &[u8]| {
        let mut c = chunk.clone();
        c[off..off + bytes.len()].copy_from_slice(bytes);
        fix_crc(&mut c);
        decode(&stream_with(&profile, &c), Some(&profile), &Limits::DEFAULT)
    };
    // B2: n_exp 1 or > 16.
    for n in [1u8, 17, 255] {
        let e = bad_chunk(132, &[n]).unwrap_err();
        assert_eq!(invalid(e), "step exponent alphabet size", "n_exp {n}");
    }
    // B3: exponent frequencies.
    assert!(matches!(
        bad_chunk(133, &[0, 0]).unwrap_err(),
        DecodeError::Block(BlockError::ExpTable(TableError::ZeroFrequency {
            symbol: 0
        }))
    ));
    assert!(matches!(
        bad_chunk(133, &[1, 4]).unwrap_err(),
        DecodeError::Block(BlockError::ExpTable(TableError::BadSum { .. }))
    ));
    // B7: the escape of g = 4 is checked against the radius of down^2(2) = table 1 (R = 0):
    // 2 is valid there, but 0 is not (it would be index 0).
    assert!(matches!(
        bad_chunk(151, &[0, 0, 0, 0]).unwrap_err(),
        DecodeError::Block(BlockError::BadEscape { .. })
    ));
    // B10: a non-finite sink value (f16 +infinity in V c0).
    let e = bad_chunk(316, &[0x00, 0x7c]).unwrap_err();
    assert_eq!(invalid(e), "sink value (not finite)");
    // Stream version 1 is not decoded.
    let mut s = stream_with(&profile, &chunk);
    s[4] = 1;
    assert!(matches!(
        decode(&s, Some(&profile), &Limits::DEFAULT).unwrap_err(),
        DecodeError::Header(HeaderError::UnsupportedVersion { got: 1 })
    ));
}
