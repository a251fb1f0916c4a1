//! `serve` and `fetch` end to end on loopback: the fetched cache is, bit for bit, the local
//! decode of the levels chosen; text chunks are recomputed on the model; refusals are clear.

mod common;

use std::sync::Arc;
use std::time::Duration;

use codec_core::adapt::Choice;
use codec_core::KvCache;
use kvc_io::sim::Trace;
use kvc_net::client::{fetch, FetchError, FetchOptions, Recompute};
use kvc_net::frame::ErrorCode;
use kvc_net::rate::Limiter;
use kvc_net::server::{Server, ServerConfig, Stats};

fn levels_of(f: &kvc_net::client::Fetched) -> Vec<u8> {
    f.rows
        .iter()
        .map(|r| match r.choice {
            Choice::Level(l) => l,
            Choice::Text => panic!("a text chunk"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetched_caches_equal_the_local_decode_of_the_levels_chosen() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", common::fake_tokens());
    let config = ServerConfig::new(dir.path().to_path_buf());
    let (addr, stats) = common::start(config, Limiter::unlimited()).await;
    let addr = addr.to_string();
    for force in [Some(1), Some(7), Some(11), None] {
        let mut opts = FetchOptions::new(Duration::from_secs(5));
        opts.force = force.map(Choice::Level);
        let f = fetch(&addr, "sample", &opts).await.unwrap();
        let levels = levels_of(&f);
        assert_eq!(levels.len(), 4);
        if let Some(l) = force {
            assert_eq!(levels, [l; 4]);
        }
        assert_eq!(f.levels, [1, 7, 11]);
        assert!(
            f.cache == common::local_decode(&store, &levels),
            "{levels:?}"
        );
        assert_eq!(f.cache.dtype(), codec_core::Dtype::F16);
        let chunk_bytes: u64 = (0..4)
            .map(|i| store.chunk_bytes(i, levels[i]).unwrap() as u64)
            .sum();
        // Each reply frame is its chunk and 19 bytes of framing.
        assert_eq!(
            f.rows.iter().map(|r| r.bytes).sum::<u64>(),
            chunk_bytes + 4 * 19
        );
        assert!(f.total_s >= f.transfer_s);
    }
    // Adaptive with no measurement starts at the middle level; with a generous deadline on an
    // unlimited link the rest go at the finest.
    let f = fetch(&addr, "sample", &FetchOptions::new(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(levels_of(&f), [7, 1, 1, 1]);
    assert_eq!(Stats::get(&stats.completed), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_link_makes_the_adapter_pick_coarser_levels() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", None);
    let total = |l: u8| -> f64 {
        (0..4)
            .map(|i| store.chunk_bytes(i, l).unwrap() as f64)
            .sum()
    };
    // A link carrying the level-11 context in 0.5 s, and a deadline of 1 s: the finest level
    // cannot fit, the coarsest does.
    let rate = total(11) / 0.5;
    assert!(total(1) / rate > 1.0);
    let config = ServerConfig::new(dir.path().to_path_buf());
    let (addr, _) = common::start(config, Limiter::new(Trace::constant(rate * 8e-9))).await;
    let f = fetch(
        &addr.to_string(),
        "sample",
        &FetchOptions::new(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let levels = levels_of(&f);
    assert_eq!(levels[0], 7, "the first chunk goes at the middle level");
    assert!(levels[1..].iter().all(|&l| l > 1), "{levels:?}");
    assert!(f.cache == common::local_decode(&store, &levels));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    common::write_store(dir.path(), "sample", None);
    std::fs::create_dir(dir.path().join("empty")).unwrap();
    let config = ServerConfig::new(dir.path().to_path_buf());
    let (addr, _) = common::start(config, Limiter::unlimited()).await;
    let addr = addr.to_string();
    let opts = FetchOptions::new(Duration::from_secs(5));
    for name in ["nosuch", "empty"] {
        match fetch(&addr, name, &opts).await.unwrap_err() {
            FetchError::Server { code, message } => {
                assert_eq!(code, ErrorCode::UnknownContext);
                assert!(message.contains(&format!("\"{name}\"")), "{message}");
            }
            e => panic!("{e}"),
        }
    }
    // A name that could leave the root is refused by the frame checks.
    let e = fetch(&addr, "../sample", &opts).await.unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::Server {
                code: ErrorCode::Malformed,
                ..
            }
        ),
        "{e}"
    );
    let mut forced = opts.clone();
    forced.force = Some(Choice::Level(4));
    let e = fetch(&addr, "sample", &forced).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("level 4 is not on offer (levels [1, 7, 11])"),
        "{e}"
    );
    forced.force = Some(Choice::Text);
    let e = fetch(&addr, "sample", &forced).await.unwrap_err();
    assert!(e.to_string().contains("text needs a model"), "{e}");
    // Nobody listening.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = fetch(&free.to_string(), "sample", &opts).await.unwrap_err();
    assert!(matches!(e, FetchError::Connect { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with(&format!("cannot connect to {free}")),
        "{e}"
    );
}

/// The reference runner as the fetch's text fallback.
struct Runner(&'static llm::Model);

impl Recompute for Runner {
    fn extend(&self, prefix: &KvCache, tokens: &[u32]) -> Result<KvCache, String> {
        self.0.extend(prefix, tokens).map_err(|e| e.to_string())
    }
    fn seconds_per_token(&self) -> f64 {
        0.002
    }
}

/// `max |a - b| / max |b|`.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    d / b.iter().map(|y| y.abs()).fold(0f32, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_chunks_are_recomputed_on_the_chunks_before_them() {
    let Some(m) = llm::shared_test_model(&common::root()) else {
        return;
    };
    let text = llm::test_text(&common::root(), "GPL-3");
    let tokens = m.tokenizer().encode(&text).unwrap()[..512].to_vec();
    let dir = tempfile::tempdir().unwrap();
    common::write_store(dir.path(), "gpl3", Some(tokens.clone()));
    let config = ServerConfig::new(dir.path().to_path_buf());
    let (addr, _) = common::start(config, Limiter::unlimited()).await;
    let mut opts = FetchOptions::new(Duration::from_secs(60));
    opts.recompute = Some(Arc::new(Runner(m)));
    opts.force = Some(Choice::Text);
    let f = fetch(&addr.to_string(), "gpl3", &opts).await.unwrap();
    assert!(f.rows.iter().all(|r| r.choice == Choice::Text));
    // Each row's frame: 4 bytes per token and 18 of framing.
    assert_eq!(f.rows[0].bytes, 4 * 128 + 18);
    // Every chunk recomputed on the (f16) chunks before it: the model's own prefill of the
    // context, in the stream's NeoX pairing and dtype, up to f16 rounding carried along.
    let (dump, _) = common::sample();
    assert_eq!(f.cache.meta, dump.kv.meta);
    let want = m.extend(&empty_like(&dump.kv), &tokens).unwrap();
    for (a, b) in f
        .cache
        .k
        .iter()
        .zip(&want.k)
        .chain(f.cache.v.iter().zip(&want.v))
    {
        let r = rel(&a.to_f32_vec(), &b.to_f32_vec());
        assert!(r < 1e-2, "{r}");
    }
    // And it is the model's cache, not the stored one's rounding: close to the dump too.
    for (a, b) in f.cache.v.iter().zip(&dump.kv.v) {
        let r = rel(&a.to_f32_vec(), &b.to_f32_vec());
        assert!(r < 5e-2, "{r}");
    }
    // Adaptive with text on offer and time to spare: text, the least loss, for every chunk.
    opts.force = None;
    let f = fetch(&addr.to_string(), "gpl3", &opts).await.unwrap();
    assert!(
        f.rows[1..].iter().all(|r| r.choice == Choice::Text),
        "{:?}",
        f.rows
    );
}

/// A cache of no tokens with `like`'s shape and conventions.
fn empty_like(like: &KvCache) -> KvCache {
    let mut shape = like.shape;
    shape.tokens = 0;
    KvCache::zeros(shape, codec_core::Dtype::F32, like.meta.clone())
}

/// A server told to stop (`Server::run_until`) stops accepting at once and lets a fetch in
/// progress finish: the fetch gets the whole context and no session is left going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_finishes_the_fetches_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", None);
    // Each level-1 chunk takes 0.25 s on this link: the fetch takes about 1 s.
    let rate = store.chunk_bytes(0, 1).unwrap() as f64 / 0.25;
    let config = ServerConfig::new(dir.path().to_path_buf());
    let server = Server::bind(
        "127.0.0.1:0",
        config,
        Limiter::new(Trace::constant(rate * 8e-9)),
    )
    .await
    .unwrap();
    let addr = server.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_secs(20);
    let run = tokio::spawn(server.run_until(async { stopped.await.unwrap() }, grace));
    let mut opts = FetchOptions::new(Duration::from_secs(30));
    opts.force = Some(Choice::Level(1));
    let fetching = tokio::spawn({
        let addr = addr.clone();
        async move { fetch(&addr, "sample", &opts).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refused = tokio::net::TcpStream::connect(&addr).await;
    assert!(refused.is_err(), "no longer accepting");
    let f = fetching.await.unwrap().unwrap();
    assert!(f.cache == common::local_decode(&store, &[1; 4]));
    assert_eq!(run.await.unwrap().unwrap(), 0, "no session left going");
}

/// Past its grace period a stopping server reports the sessions still going (here an idle
/// client that said `Hello` and nothing more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_reports_the_sessions_past_its_grace() {
    let dir = tempfile::tempdir().unwrap();
    common::write_store(dir.path(), "sample", None);
    let config = ServerConfig::new(dir.path().to_path_buf());
    let server = Server::bind("127.0.0.1:0", config, Limiter::unlimited())
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_millis(300);
    let run = tokio::spawn(server.run_until(async { stopped.await.unwrap() }, grace));
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = kvc_net::frame::Message::Hello {
        max_payload: 1 << 20,
    };
    tokio::io::AsyncWriteExt::write_all(&mut idle, &hello.encode())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = std::time::Instant::now();
    stop.send(()).unwrap();
    assert_eq!(run.await.unwrap().unwrap(), 1);
    assert!(t0.elapsed() >= grace);
}
