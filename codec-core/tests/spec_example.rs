//! spec/FORMAT.md Appendix B, written from the spec by hand, must decode with codec-core to the
//! values the spec gives: the spec and the code agree byte for byte.

use codec_core::codec::{ChunkEntry, Header, STREAM_VERSION};
use codec_core::profile::{hex, ChannelParams, LevelTables, SymbolTable};
use codec_core::rans::FreqTable;
use codec_core::{decode, KvMeta, KvShape, Limits, Profile, Rope, RopeStyle, Tensor};

fn le32(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[test]
fn appendix_b_profile_and_stream() {
    let cp = |mean: f32, d: f32, a: f32, w: u8| ChannelParams {
        mean,
        delta_step: d,
        anchor_step: a,
        weight: w,
    };
    let params = vec![
        cp(0.0, 0.25, 0.125, 8),
        cp(-1.0, 0.5, 0.25, 16),
        cp(0.5, 0.125, 0.0625, 0),
        cp(1.0, 1.0, 0.5, 4),
    ];
    let tables = vec![
        SymbolTable {
            radius: 1,
            freqs: FreqTable::new(&[512, 3072, 511, 1]).unwrap(),
        },
        SymbolTable {
            radius: 0,
            freqs: FreqTable::new(&[4000, 96]).unwrap(),
        },
    ];
    let map = vec![0, 0, 0, 0, 1, 0, 1, 1];
    let profile = Profile::from_parts(
        1,
        1,
        2,
        vec![0.5],
        params,
        None,
        vec![LevelTables {
            tables,
            down: vec![0, 0],
            map,
        }],
    );
    assert_eq!(profile.as_bytes().len(), 108);
    assert_eq!(&profile.as_bytes()[104..], &[0x6d, 0x1c, 0xeb, 0x75]);
    assert_eq!(
        hex(&profile.hash()),
        "0d5b447a7cb17fb97de32724d8c1eef834e9dbdcefd896a9620693156cc5be36"
    );

    let mut chunk = Vec::new();
    chunk.extend(le32(&[2]));
    let mut lanes = [0u32; 32];
    lanes[..4].copy_from_slice(&[1, 1, 1, 1]);
    chunk.extend(le32(&lanes));
    chunk.extend([0x00, 0x38, 0x00, 0xbc]);
    chunk.extend((-3i32).to_le_bytes());
    chunk.extend(2i32.to_le_bytes());
    chunk.extend(le32(&[0xE00, 0xFFF, 0xFFF, 0x200]));
    chunk.extend(le32(&[2]));
    let mut lanes = [0u32; 32];
    lanes[2] = 1;
    lanes[3] = 1;
    chunk.extend(le32(&lanes));
    chunk.extend([0x00, 0x34, 0x00, 0x40]);
    chunk.extend((-1i32).to_le_bytes());
    chunk.extend(5i32.to_le_bytes());
    chunk.extend(le32(&[0xFA0, 0xFFF]));
    chunk.extend([0xd8, 0xcf, 0x01, 0x25]);
    assert_eq!(chunk.len(), 316);

    let header = Header {
        version: STREAM_VERSION,
        shape: KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            tokens: 3,
        },
        dtype: codec_core::Dtype::F16,
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
        profile_hash: profile.hash(),
        profile_len: 0,
        chunks: vec![ChunkEntry {
            offset: 0,
            len_bytes: 316,
            token_start: 0,
            tokens: 3,
            level: 0,
        }],
    };
    let mut stream = header.to_bytes();
    assert_eq!(stream.len(), 133);
    assert_eq!(&stream[129..133], &[0x34, 0x8c, 0x55, 0x30]);
    stream.extend(&chunk);
    let cache = decode(&stream, Some(&profile), &Limits::DEFAULT).unwrap();
    let bits = |t: &Tensor| match t {
        Tensor::F16(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>(),
        _ => panic!("f16 expected"),
    };
    assert_eq!(
        bits(&cache.k[0]),
        [0x3800, 0xbc00, 0x3600, 0xbf00, 0x3000, 0xbc00]
    );
    assert_eq!(
        bits(&cache.v[0]),
        [0x3400, 0x4000, 0x3800, 0x3d00, 0x3780, 0x4080]
    );
}
