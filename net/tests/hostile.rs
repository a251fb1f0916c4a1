//! A server under 32 concurrent fetches and hostile clients at the same time (garbage, a
//! slowloris, an oversized length, a frame cut short, a wrong version): every well-formed fetch
//! gets the whole context, bit for bit; every hostile client gets its `Error` frame (or is
//! dropped) and the server counts it as refused. And a client facing a hostile or broken server
//! (garbage, an oversized length, a dropped connection, a stall, a context over the client's
//! limits, a server too slow for the client's time limit) reports it as a typed error. Every
//! `Error` is followed by an orderly close, also when the client pipelined more requests. A client that asks and never reads is dropped at the
//! write timeout, one that keeps asking is ended at the session's limit, each slot freed; a
//! broken store asked for again and again is opened once.

mod common;

use std::sync::Arc;
use std::time::Duration;

use codec_core::adapt::Choice;
use kvc_io::sim::Trace;
use kvc_io::store::Store;
use kvc_net::client::{fetch, FetchOptions};
use kvc_net::frame::{self, ErrorCode, Limits, Message};
use kvc_net::rate::Limiter;
use kvc_net::server::{ServerConfig, Stats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `bytes` (then keeps the connection open without a word) and returns the frame the
/// server answers with, or `None` if it closed without one.
async fn answer_to(addr: &str, bytes: &[u8]) -> Option<Message> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    // The server ends its side after its Error frame, without a reset (it lingers).
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
        .await
        .expect("the server closes a hostile connection");
    assert!(read.is_ok(), "{read:?} after {} bytes", got.len());
    frame::decode(&got, &Limits::DEFAULT).ok().map(|(m, _)| m)
}

fn code(m: Option<Message>) -> ErrorCode {
    match m {
        Some(Message::Error { code, .. }) => code,
        other => panic!("expected an Error frame, got {other:?}"),
    }
}

/// The sample written as the store "sample" of a fresh root, served with the defaults that
/// `configure` changes: the root (removed when dropped), the store, the address, the counters.
async fn serve_sample(
    configure: impl FnOnce(&mut ServerConfig),
) -> (tempfile::TempDir, Store, String, Arc<Stats>) {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", None);
    let mut config = ServerConfig::new(dir.path().to_path_buf());
    configure(&mut config);
    let (addr, stats) = common::start(config, Limiter::unlimited()).await;
    (dir, store, addr.to_string(), stats)
}

/// A client's `Hello` (announcing `max_payload`) and `Open` of the sample, as sent.
fn hello_open(max_payload: u32) -> Vec<u8> {
    let hello = Message::Hello { max_payload };
    let open = Message::Open {
        context: "sample".into(),
    };
    [hello.encode(), open.encode()].concat()
}

/// The hostile clients, each with the code its answer must carry.
async fn hostile(addr: String) -> Vec<(&'static str, ErrorCode)> {
    let hello = Message::Hello {
        max_payload: 1 << 20,
    }
    .encode();
    let mut oversized = hello[..frame::HEAD_LEN].to_vec();
    oversized[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut version = hello.clone();
    version[4] = 9;
    let mut cut = hello.clone();
    cut.truncate(hello.len() - 1);
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let cases: Vec<(&'static str, Vec<u8>, ErrorCode)> = vec![
        ("garbage", garbage, ErrorCode::Malformed),
        ("oversized length", oversized, ErrorCode::Malformed),
        ("wrong version", version, ErrorCode::Version),
        // A head and most of a frame, then silence: the read timeout.
        ("frame cut short", cut, ErrorCode::Timeout),
        // Three bytes, then nothing: the read timeout, whatever the trickle.
        ("slowloris", b"KVC".to_vec(), ErrorCode::Timeout),
        // A well-formed Get before any Hello.
        (
            "out of order",
            Message::Get {
                chunk: 0,
                choice: Choice::Level(1),
            }
            .encode(),
            ErrorCode::Unexpected,
        ),
    ];
    let tasks: Vec<_> = cases
        .into_iter()
        .map(|(name, bytes, want)| {
            let addr = addr.clone();
            tokio::spawn(async move { (name, want, code(answer_to(&addr, &bytes).await)) })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let (name, want, got) = t.await.unwrap();
        assert_eq!(got, want, "{name}");
        out.push((name, got));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_fetches_and_hostile_clients_at_once() {
    let (_dir, store, addr, stats) =
        serve_sample(|c| c.read_timeout = Duration::from_secs(2)).await;
    let bad = tokio::spawn(hostile(addr.clone()));
    let levels = [1u8, 7, 11];
    let fetches: Vec<_> = (0..32)
        .map(|k| {
            let addr = addr.clone();
            let mut opts = FetchOptions::new(Duration::from_secs(30));
            opts.force = Some(Choice::Level(levels[k % 3]));
            tokio::spawn(async move { fetch(&addr, "sample", &opts).await })
        })
        .collect();
    for (k, f) in fetches.into_iter().enumerate() {
        let f = f
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("fetch {k}: {e}"));
        let want = common::local_decode(&store, &[levels[k % 3]; 4]);
        assert!(f.cache == want, "fetch {k}");
    }
    let refused = bad.await.unwrap();
    assert_eq!(refused.len(), 6);
    // The server ends its side after the client's Bye or Error; give it a moment to count.
    for _ in 0..100 {
        if Stats::get(&stats.completed) + Stats::get(&stats.refused) == 38 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(Stats::get(&stats.completed), 32);
    assert_eq!(Stats::get(&stats.refused), 6);
    assert_eq!(Stats::get(&stats.busy), 0);
    // After all that, the server still serves.
    let opts = FetchOptions::new(Duration::from_secs(30));
    assert!(fetch(&addr, "sample", &opts).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_told_busy() {
    let (_dir, _, addr, stats) = serve_sample(|c| c.max_connections = 2).await;
    // Two idle connections hold both slots (the server waits for their Hello).
    let _a = TcpStream::connect(&addr).await.unwrap();
    let _b = TcpStream::connect(&addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let hello = Message::Hello {
        max_payload: 1 << 20,
    }
    .encode();
    assert_eq!(code(answer_to(&addr, &hello).await), ErrorCode::Busy);
    assert_eq!(Stats::get(&stats.busy), 1);
    // A slot freed is a slot to serve.
    drop(_a);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let opts = FetchOptions::new(Duration::from_secs(30));
    assert!(fetch(&addr, "sample", &opts).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_dropped_and_its_slot_freed() {
    let (_dir, _, addr, stats) = serve_sample(|c| {
        c.max_connections = 1;
        c.write_timeout = Duration::from_millis(500);
    })
    .await;
    // Hello, Open, then 200 Gets of a 1 MB chunk (far more than the sockets' buffers hold),
    // and never a read: the server's writes stall.
    let mut frames = hello_open(1 << 24);
    let get = Message::Get {
        chunk: 0,
        choice: Choice::Level(1),
    }
    .encode();
    for _ in 0..200 {
        frames.extend_from_slice(&get);
    }
    let mut idle = TcpStream::connect(&addr).await.unwrap();
    idle.write_all(&frames).await.unwrap();
    for _ in 0..250 {
        if Stats::get(&stats.refused) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        Stats::get(&stats.refused),
        1,
        "dropped at the write timeout"
    );
    assert!(
        Stats::get(&stats.bytes_sent) < 200 << 20,
        "not every reply went out"
    );
    // The one slot is free again, while the idle client still holds its socket.
    let opts = FetchOptions::new(Duration::from_secs(30));
    assert!(fetch(&addr, "sample", &opts).await.is_ok());
    assert_eq!(Stats::get(&stats.busy), 0);
    drop(idle);
}

/// The next whole frame from `s`.
async fn next_frame(s: &mut TcpStream) -> Message {
    let mut head = [0u8; frame::HEAD_LEN];
    s.read_exact(&mut head).await.unwrap();
    let len = frame::Head::parse(&head, &Limits::DEFAULT).unwrap().len as usize;
    let mut whole = head.to_vec();
    whole.resize(frame::HEAD_LEN + len + frame::CRC_LEN, 0);
    s.read_exact(&mut whole[frame::HEAD_LEN..]).await.unwrap();
    frame::decode(&whole, &Limits::DEFAULT).unwrap().0
}

/// A client that keeps its slot with timely requests (a `Get` every 200 ms, each within the
/// read timeout) is answered until the session's limit, then sent `Error Timeout` and closed;
/// its slot serves the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_past_its_limit_is_ended_and_its_slot_freed() {
    let (_dir, _, addr, stats) = serve_sample(|c| {
        c.max_connections = 1;
        c.max_session = Duration::from_millis(1500);
    })
    .await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let ask = hello_open(Limits::DEFAULT.max_payload);
    s.write_all(&ask).await.unwrap();
    assert!(matches!(next_frame(&mut s).await, Message::Info(_)));
    let get = Message::Get {
        chunk: 0,
        choice: Choice::Level(11),
    }
    .encode();
    let start = std::time::Instant::now();
    let mut answered = 0;
    let end = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(&get).await.unwrap();
        match next_frame(&mut s).await {
            Message::Chunk { .. } => answered += 1,
            other => break other,
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never ended");
    };
    let Message::Error { code, message } = end else {
        panic!("expected Error, got {end:?}")
    };
    assert_eq!(code, ErrorCode::Timeout);
    assert!(message.contains("session's limit of 1500 ms"), "{message}");
    assert!(answered >= 2, "{answered} answered before the limit");
    for _ in 0..100 {
        if Stats::get(&stats.refused) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(Stats::get(&stats.refused), 1);
    let opts = FetchOptions::new(Duration::from_secs(30));
    assert!(fetch(&addr, "sample", &opts).await.is_ok());
    assert_eq!(Stats::get(&stats.busy), 0);
}

/// A store that does not open is refused (`Error Internal`) to every client, and opened (read
/// and logged) once, not once per `Open`: clients asking for it in a loop cost no disk reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_store_is_opened_once_for_many_requests() {
    let (dir, _, addr, stats) = serve_sample(|_| {}).await;
    // Broken before its first Open (the server opens a context when it is first asked for).
    std::fs::write(dir.path().join("sample/store.json"), "{}").unwrap();
    let ask = hello_open(Limits::DEFAULT.max_payload);
    for _ in 0..20 {
        let Some(Message::Error { code, message }) = answer_to(&addr, &ask).await else {
            panic!("expected an Error frame");
        };
        assert_eq!(code, ErrorCode::Internal);
        assert!(message.contains("cannot be opened"), "{message}");
    }
    assert_eq!(Stats::get(&stats.open_failures), 1);
}

/// A context larger than the client accepts (`FetchOptions::codec_limits`) is refused from the
/// server's `Info`, before the cache its header sizes is allocated; within the limits it is
/// fetched whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_over_the_clients_limits_is_refused_from_its_info() {
    let (_dir, store, addr, _) = serve_sample(|_| {}).await;
    let elements = store.header().shape.total_elements();
    let mut opts = FetchOptions::new(Duration::from_secs(30));
    opts.codec_limits.max_elements = elements - 1;
    let e = fetch(&addr, "sample", &opts).await.unwrap_err();
    assert!(matches!(e, kvc_net::client::FetchError::Stream(_)), "{e}");
    assert!(e.to_string().contains("the server's Info"), "{e}");
    assert!(e.to_string().contains(&elements.to_string()), "{e}");
    opts.codec_limits.max_elements = elements;
    let f = fetch(&addr, "sample", &opts).await.unwrap();
    assert!(f.cache.shape.total_elements() == elements);
}

/// A fake server that reads the client's first frames and answers `reply` (then holds the
/// connection open for `hold`, or closes it at once).
async fn fake_server(reply: Vec<u8>, hold: Duration) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf).await;
        let _ = s.write_all(&reply).await;
        tokio::time::sleep(hold).await;
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reports_a_hostile_or_broken_server() {
    use kvc_net::client::FetchError;
    let mut opts = FetchOptions::new(Duration::from_secs(5));
    opts.io_timeout = Duration::from_millis(500);
    // Garbage instead of a frame.
    let addr = fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(), Duration::ZERO).await;
    let e = fetch(&addr, "x", &opts).await.unwrap_err();
    assert!(matches!(e, FetchError::Frame(_)), "{e}");
    assert!(e.to_string().contains("not a kvc frame"), "{e}");
    let source = std::error::Error::source(&e).map(ToString::to_string);
    assert!(
        source.is_some_and(|s| s.contains("not a kvc frame")),
        "{e:?}"
    );
    // A head announcing more than the client accepts: refused from the head alone.
    let mut head = Message::Bye.encode()[..frame::HEAD_LEN].to_vec();
    head[5] = 0x81;
    head[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
    let addr = fake_server(head, Duration::from_secs(5)).await;
    let e = fetch(&addr, "x", &opts).await.unwrap_err();
    assert!(e.to_string().contains("over the limit"), "{e}");
    // The connection dropped before any reply.
    let addr = fake_server(Vec::new(), Duration::ZERO).await;
    let e = fetch(&addr, "x", &opts).await.unwrap_err();
    assert!(
        matches!(e, FetchError::Closed { .. } | FetchError::Io(_)),
        "{e}"
    );
    // A stall: half a frame, then nothing.
    let info = Message::Error {
        code: ErrorCode::Busy,
        message: "never finished".into(),
    }
    .encode();
    let addr = fake_server(info[..12].to_vec(), Duration::from_secs(5)).await;
    let e = fetch(&addr, "x", &opts).await.unwrap_err();
    assert!(matches!(e, FetchError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("within 500 ms"), "{e}");
}

/// A client that pipelines requests behind one the server refuses still reads the `Error`:
/// the server drains what it will not answer before closing, so that its close is not a reset
/// that discards the `Error` in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_reaches_a_client_that_pipelined_more() {
    let (_dir, _, addr, _) = serve_sample(|_| {}).await;
    let get = Message::Get {
        chunk: 0,
        choice: Choice::Level(1),
    }
    .encode();
    // Hello, then Gets before any Open: the first is refused, 2000 more wait unread.
    let mut frames = Message::Hello {
        max_payload: 1 << 20,
    }
    .encode();
    for _ in 0..2001 {
        frames.extend_from_slice(&get);
    }
    for round in 0..20 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&frames).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got));
        let read = read.await.expect("the server closes");
        assert!(
            read.is_ok(),
            "round {round}: {read:?} after {} bytes",
            got.len()
        );
        let (m, _) = frame::decode(&got, &Limits::DEFAULT).unwrap();
        assert!(
            matches!(
                m,
                Message::Error {
                    code: ErrorCode::Unexpected,
                    ..
                }
            ),
            "{m:?}"
        );
    }
}

/// A reply over the `max_payload` the client announced is not sent: the client gets
/// `Error TooLarge` instead, which names both sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_over_the_clients_max_payload_is_refused_as_too_large() {
    let (_dir, store, addr, stats) = serve_sample(|_| {}).await;
    let info = Message::Info(kvc_net::server::info(&store).unwrap()).encode();
    let info_payload = info.len() - frame::HEAD_LEN - frame::CRC_LEN;
    let chunk_payload = frame::CHUNK_PREFIX + store.chunk_bytes(0, 1).unwrap();
    assert!(
        chunk_payload > info_payload,
        "the premise: level 1 is larger than the Info"
    );
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&hello_open(info_payload as u32)).await.unwrap();
    assert!(matches!(next_frame(&mut s).await, Message::Info(_)));
    let get = Message::Get {
        chunk: 0,
        choice: Choice::Level(1),
    };
    s.write_all(&get.encode()).await.unwrap();
    let Message::Error { code, message } = next_frame(&mut s).await else {
        panic!("expected Error");
    };
    assert_eq!(code, ErrorCode::TooLarge);
    let want = format!(
        "payload of {chunk_payload} bytes is over the client's max_payload of {info_payload}"
    );
    assert!(message.contains(&want), "{message}");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "nothing after the Error");
    assert!(Stats::get(&stats.bytes_sent) < (info.len() + chunk_payload) as u64);
}

/// A server answering every request within the client's reply timeout, but slowly, holds the
/// client no longer than its `max_time`: the fetch fails with a timeout that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_server_is_given_up_at_the_fetchs_time_limit() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", None);
    // Each level-1 chunk takes 0.5 s on this link; the four take 2 s.
    let rate = store.chunk_bytes(0, 1).unwrap() as f64 / 0.5;
    let config = ServerConfig::new(dir.path().to_path_buf());
    let (addr, _) = common::start(config, Limiter::new(Trace::constant(rate * 8e-9))).await;
    let mut opts = FetchOptions::new(Duration::from_secs(30));
    opts.force = Some(Choice::Level(1));
    opts.max_time = Duration::from_millis(1000);
    let start = std::time::Instant::now();
    let e = fetch(&addr.to_string(), "sample", &opts).await.unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(e, kvc_net::client::FetchError::Timeout { .. }),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "no complete context from the server within 1000 ms"
    );
    assert!(took < Duration::from_millis(1500), "{took:?}");
    // Within a time limit that fits, the same fetch is whole.
    opts.max_time = Duration::from_secs(20);
    let f = fetch(&addr.to_string(), "sample", &opts).await.unwrap();
    assert!(f.cache == common::local_decode(&store, &[1; 4]));
}

/// A server that sends a corrupted chunk, then drops the connection: the client reports the
/// chunk that does not decode (the first failure), not the close that followed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_reported_before_the_close_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::write_store(dir.path(), "sample", None);
    let info = Message::Info(kvc_net::server::info(&store).unwrap()).encode();
    let mut bytes = store.chunk(0, 7).unwrap().to_vec();
    bytes[40] ^= 0x10;
    let chunk = frame::encode_chunk(0, 7, &bytes);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        for _ in 0..2 {
            next_frame(&mut s).await; // Hello, Open
        }
        s.write_all(&info).await.unwrap();
        next_frame(&mut s).await; // Get 0
        s.write_all(&chunk).await.unwrap();
        next_frame(&mut s).await; // Get 1: the client's decoder has the bad chunk by now
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    let mut opts = FetchOptions::new(Duration::from_secs(5));
    opts.force = Some(Choice::Level(7));
    let e = fetch(&addr, "sample", &opts).await.unwrap_err();
    assert!(matches!(e, kvc_net::client::FetchError::Stream(_)), "{e}");
    assert!(e.to_string().contains("chunk 0"), "{e}");
}
