//! What the test files share (not every file uses every helper).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use codec_core::adapt::Choice;
use codec_core::{EncodeParams, Profile};
use kvc_io::store::Store;
use kvc_net::frame::{ErrorCode, Info, Message};
use kvc_net::rate::Limiter;
use kvc_net::server::{Server, ServerConfig, Stats};

/// One message of each type (two `Get`s: a level and text).
pub fn sample_messages() -> Vec<Message> {
    vec![
        Message::Hello {
            max_payload: 1 << 20,
        },
        Message::Open {
            context: "gpl3".into(),
        },
        Message::Get {
            chunk: 0,
            choice: Choice::Level(7),
        },
        Message::Get {
            chunk: 3,
            choice: Choice::Text,
        },
        Message::Bye,
        Message::Info(Info {
            text: true,
            levels: vec![1, 7, 11],
            sizes: vec![900, 500, 200, 800, 400, 100],
            header: vec![1, 2, 3],
            profile: vec![9; 10],
        }),
        Message::Chunk {
            chunk: 1,
            level: 7,
            bytes: (0..50).collect(),
        },
        Message::Text {
            chunk: 2,
            tokens: vec![1, 2, 70000],
        },
        Message::Error {
            code: ErrorCode::UnknownContext,
            message: "no context \"x\" on this server".into(),
        },
    ]
}

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The 512-token sample dump and a profile learned from it, once per test binary.
pub fn sample() -> &'static (kvc_io::Dump, Profile) {
    static S: OnceLock<(kvc_io::Dump, Profile)> = OnceLock::new();
    S.get_or_init(|| {
        let dump = kvc_io::load_dump(&kvc_io::fixtures::sample()).unwrap();
        let profile = kvc_io::policy::learn(&[&dump], &mut kvc_io::Silent).unwrap();
        (dump, profile)
    })
}

/// Writes the sample as store `dir/name` (chunks of 128 tokens at levels 1, 7 and 11) with
/// `tokens` as its token ids, and opens it.
pub fn write_store(dir: &Path, name: &str, tokens: Option<Vec<u32>>) -> Store {
    let (dump, profile) = sample();
    let mut dump = dump.clone();
    dump.tokens = tokens;
    let params = EncodeParams {
        chunk_tokens: 128,
        ..EncodeParams::default()
    };
    let ctx = dir.join(name);
    Store::write(&ctx, &dump, profile, &params, &[1, 7, 11], false, 0).unwrap();
    Store::open(&ctx).unwrap()
}

/// Synthetic token ids for the sample (no model needed).
pub fn fake_tokens() -> Option<Vec<u32>> {
    Some((0..512).map(|i| 1000 + i).collect())
}

/// Starts a server on an ephemeral loopback port; it runs until the runtime ends.
pub async fn start(config: ServerConfig, limiter: Limiter) -> (SocketAddr, Arc<Stats>) {
    let server = Server::bind("127.0.0.1:0", config, limiter).await.unwrap();
    let addr = server.local_addr().unwrap();
    let stats = server.stats();
    tokio::spawn(server.run());
    (addr, stats)
}

/// The cache a local decode of `store` at `levels` gives.
pub fn local_decode(store: &Store, levels: &[u8]) -> codec_core::KvCache {
    let bytes = store.assemble(levels).unwrap();
    codec_core::decode(&bytes, Some(store.profile()), &codec_core::Limits::DEFAULT).unwrap()
}
