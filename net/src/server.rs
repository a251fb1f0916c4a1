//! The server (`kvc serve`, `spec/STREAM.md` §4.4): every store under a root directory, to many
//! clients at once, each connection a tokio task.
//!
//! Hostile clients cost bounded resources: a cap on connections (the one over it gets `Error`
//! `Busy`), a cap on client frames (checked from the head, before the payload is read), a time
//! limit on each client frame from when the server starts waiting for it (a client that
//! stalls or trickles bytes is dropped), on each write (a client that stops reading is
//! dropped) and on the whole session (a client that keeps its slot with slow but timely
//! requests, or reads just fast enough, is let go at the limit). A bad frame, a message out
//! of order or an unknown context gets an `Error` frame and the connection closes (after
//! reading what the client still sends, within [`LINGER`], so the `Error` is not lost to a
//! reset); the others go on. [`Server::run_until`] stops accepting when told to and lets the
//! sessions in progress end within a grace period.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use codec_core::adapt::Choice;
use kvc_io::store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{OnceCell, Semaphore};

use crate::frame::{self, ErrorCode, FrameError, Info, Limits, Message, HEAD_LEN};
use crate::io::{read_frame, ReadError};
use crate::rate::Limiter;

/// Bytes written at a time: the rate limiter's and the write timeout's unit.
pub const WRITE_PIECE: usize = 64 << 10;

/// How long a context that failed to open is refused from memory before it is opened again:
/// opening reads the whole store, which clients asking for a broken one in a loop would
/// otherwise make the server do (and log) on every `Open`.
pub const REOPEN_AFTER: Duration = Duration::from_secs(5);

/// How long the server keeps reading (and discarding) a client's input after its `Error`, at
/// most [`LINGER_BYTES`] of it: a socket closed with unread input is reset, and a reset can
/// discard the `Error` still on its way to a client that had pipelined more requests.
pub const LINGER: Duration = Duration::from_secs(1);
/// The most bytes read after an `Error` (see [`LINGER`]).
pub const LINGER_BYTES: usize = 1 << 20;

/// How a server behaves; [`ServerConfig::new`] gives the defaults of `spec/STREAM.md` §4.5.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The directory whose subdirectories holding a `store.json` are the contexts.
    pub root: PathBuf,
    /// Connections served at once; one more is answered `Busy` and closed.
    pub max_connections: usize,
    /// Time a client has to send a whole frame, from when the server starts waiting for it.
    pub read_timeout: Duration,
    /// Time one write of up to [`WRITE_PIECE`] bytes may take (after the rate limiter's wait).
    pub write_timeout: Duration,
    /// Time a connection may hold its slot, from its accept: past it the next request is
    /// answered `Error Timeout`, and a reply still being written is cut off.
    pub max_session: Duration,
    /// What the server accepts from clients ([`Limits::CLIENT_FRAMES`]).
    pub limits: Limits,
    /// Print a line per connection on stderr when it ends (bytes, time, throughput).
    pub report: bool,
}

impl ServerConfig {
    /// The defaults: 64 connections, 10 s per client frame and per write, 600 s per session,
    /// client frames of at most 4 KiB, no report.
    pub fn new(root: PathBuf) -> ServerConfig {
        ServerConfig {
            root,
            max_connections: 64,
            read_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            max_session: Duration::from_secs(600),
            limits: Limits::CLIENT_FRAMES,
            report: false,
        }
    }
}

/// Counts since the server started.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections accepted and served.
    pub connections: AtomicU64,
    /// Connections refused at the cap.
    pub busy: AtomicU64,
    /// Sessions that ended cleanly: the client's `Bye`, or its close between frames.
    pub completed: AtomicU64,
    /// Sessions the server ended: an `Error` sent, a timeout, a failed write.
    pub refused: AtomicU64,
    /// Bytes sent, all connections.
    pub bytes_sent: AtomicU64,
    /// Attempts to open a context that failed (at most one per context per [`REOPEN_AFTER`]).
    pub open_failures: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
    /// A counter's value now.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A context ready to serve: its store and its `Info` frame.
#[derive(Debug)]
struct Ready {
    store: Store,
    info: Vec<u8>,
}

/// What the connections share.
#[derive(Debug)]
struct Shared {
    config: ServerConfig,
    limiter: Limiter,
    /// Contexts opened so far (a failed open is not kept: it is tried again after
    /// [`REOPEN_AFTER`]).
    contexts: Mutex<HashMap<String, Arc<OnceCell<Arc<Ready>>>>>,
    /// When each context that failed to open last failed.
    failed: Mutex<HashMap<String, Instant>>,
    stats: Arc<Stats>,
    slots: Arc<Semaphore>,
}

/// A bound server, ready to [`run`](Server::run).
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port: see [`local_addr`](Server::local_addr)).
    pub async fn bind(
        addr: impl ToSocketAddrs,
        config: ServerConfig,
        limiter: Limiter,
    ) -> io::Result<Server> {
        let listener = TcpListener::bind(addr).await?;
        let slots = Arc::new(Semaphore::new(config.max_connections));
        let shared = Arc::new(Shared {
            config,
            limiter,
            contexts: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashMap::new()),
            stats: Arc::new(Stats::default()),
            slots,
        });
        Ok(Server { listener, shared })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The server's counters (they keep counting while it runs).
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// Opens the context `name` now, so that clients find it ready (a server opens every store
    /// it serves at start, reporting any that is broken before a client asks for it).
    pub async fn preload(&self, name: &str) -> Result<(), String> {
        context(&self.shared, name)
            .await
            .map(|_| ())
            .map_err(|(_, why)| why)
    }

    /// Accepts and serves connections until the task is dropped.
    pub async fn run(self) -> io::Result<()> {
        self.accept().await
    }

    /// Accepts and serves connections until `shutdown` completes; then stops accepting and
    /// gives the sessions in progress up to `grace` to end. Returns how many were still going
    /// at the end of it (they end when the runtime does).
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()>,
        grace: Duration,
    ) -> io::Result<usize> {
        tokio::select! {
            r = self.accept() => r?,
            () = shutdown => {}
        }
        let Server { listener, shared } = self;
        drop(listener);
        // Every slot free is every session ended.
        let all = shared.config.max_connections;
        let drained = shared
            .slots
            .acquire_many(u32::try_from(all).unwrap_or(u32::MAX));
        let going = match tokio::time::timeout(grace, drained).await {
            Ok(_) => 0,
            Err(_) => all.saturating_sub(shared.slots.available_permits()),
        };
        Ok(going)
    }

    async fn accept(&self) -> io::Result<()> {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(c) => c,
                // Out of file descriptors or a connection reset before accept: the listener
                // is fine, try again shortly.
                Err(e) => {
                    log(format_args!("kvc serve: accept failed: {e}"));
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let shared = self.shared.clone();
            match shared.slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(async move {
                        Connection::new(shared, stream, peer).serve().await;
                        drop(permit);
                    });
                }
                Err(_) => {
                    tokio::spawn(refuse_busy(shared, stream));
                }
            }
        }
    }
}

/// Answers a connection over the cap with `Busy` (within the write timeout) and closes it.
async fn refuse_busy(shared: Arc<Shared>, mut stream: TcpStream) {
    Stats::add(&shared.stats.busy, 1);
    let max = shared.config.max_connections;
    let msg = Message::Error {
        code: ErrorCode::Busy,
        message: format!("the server is at its cap of {max} connections; try again later"),
    };
    let t = shared.config.write_timeout;
    if let Ok(Ok(())) = tokio::time::timeout(t, stream.write_all(&msg.encode())).await {
        linger(&mut stream).await;
    }
}

/// Ends the server's side after an `Error` (a FIN after it), then reads what the client still
/// sends until it closes, within [`LINGER`], so that the close is not a reset.
async fn linger(stream: &mut TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut scratch = [0u8; 4096];
        let mut read = 0;
        while read < LINGER_BYTES {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

/// How a session ended.
#[derive(Debug)]
enum End {
    /// The client said `Bye`.
    Bye,
    /// The client closed the connection between frames.
    Closed,
    /// The server sent `Error` and closed.
    Refused(ErrorCode, String),
    /// The connection failed or a client stalled: closed without a word.
    Dropped(String),
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Bye => f.write_str("done"),
            End::Closed => f.write_str("closed by the client"),
            End::Refused(code, why) => write!(f, "refused ({code:?}: {why})"),
            End::Dropped(why) => write!(f, "dropped ({why})"),
        }
    }
}

/// One client's session (`spec/STREAM.md` §4.4).
struct Connection {
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    started: Instant,
    sent: u64,
    frames: u64,
    /// The client's `max_payload` (from `Hello`).
    max_reply: u32,
    context: Option<(String, Arc<Ready>)>,
}

impl Connection {
    fn new(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr) -> Connection {
        Stats::add(&shared.stats.connections, 1);
        // Small frames (Error) go out at once.
        let _ = stream.set_nodelay(true);
        Connection {
            shared,
            stream,
            peer,
            started: Instant::now(),
            sent: 0,
            frames: 0,
            max_reply: frame::MIN_MAX_PAYLOAD,
            context: None,
        }
    }

    /// Runs the session to its end, then reports it.
    async fn serve(mut self) {
        let end = match self.session().await {
            Ok(end) | Err(end) => end,
        };
        let counter = match end {
            End::Bye | End::Closed => &self.shared.stats.completed,
            End::Refused(..) | End::Dropped(_) => &self.shared.stats.refused,
        };
        Stats::add(counter, 1);
        if self.shared.config.report {
            self.report(&end);
        }
    }

    fn report(&self, end: &End) {
        let secs = self.started.elapsed().as_secs_f64();
        let name = self.context.as_ref().map_or("-", |(n, _)| n.as_str());
        log(format_args!(
            "kvc serve: {} {name}: {end}; {} frames, {} bytes in {secs:.3} s ({:.1} MB/s); \
             {} bytes sent in all",
            self.peer,
            self.frames,
            self.sent,
            self.sent as f64 / secs.max(1e-9) / 1e6,
            Stats::get(&self.shared.stats.bytes_sent),
        ));
    }

    /// `Hello`, then requests until `Bye`. `Err` ends the session early.
    async fn session(&mut self) -> Result<End, End> {
        match self.request().await? {
            None => return Ok(End::Closed),
            Some(Message::Hello { max_payload }) => self.max_reply = max_payload,
            Some(m) => return Err(self.unexpected(&m, "Hello").await),
        }
        loop {
            match self.request().await? {
                None => return Ok(End::Closed),
                Some(Message::Bye) => return Ok(End::Bye),
                Some(Message::Open { context }) => self.open(context).await?,
                Some(Message::Get { chunk, choice }) => self.get(chunk, choice).await?,
                Some(m) => return Err(self.unexpected(&m, "Open, Get or Bye").await),
            }
        }
    }

    /// The time left to the session's limit.
    fn session_left(&self) -> Duration {
        let limit = self.shared.config.max_session;
        limit.saturating_sub(self.started.elapsed())
    }

    /// Why the session ends at its limit.
    fn session_over(&self) -> String {
        let limit = self.shared.config.max_session;
        format!("the session's limit of {} ms passed", limit.as_millis())
    }

    /// The client's next frame, within the read timeout and the session's limit (`None`:
    /// closed between frames).
    async fn request(&mut self) -> Result<Option<Message>, End> {
        let (read_timeout, limits) = (self.shared.config.read_timeout, self.shared.config.limits);
        let left = self.session_left();
        if left.is_zero() {
            return Err(self.refuse(ErrorCode::Timeout, self.session_over()).await);
        }
        let t = read_timeout.min(left);
        match tokio::time::timeout(t, read_frame(&mut self.stream, &limits)).await {
            Ok(Ok(m)) => Ok(m.map(|(msg, _)| msg)),
            Ok(Err(ReadError::Frame(e))) => {
                let code = match e {
                    FrameError::Version { .. } => ErrorCode::Version,
                    _ => ErrorCode::Malformed,
                };
                Err(self.refuse(code, e.to_string()).await)
            }
            Ok(Err(e)) => Err(End::Dropped(e.to_string())),
            Err(_) if t < read_timeout => {
                Err(self.refuse(ErrorCode::Timeout, self.session_over()).await)
            }
            Err(_) => {
                let why = format!("no whole frame within {} ms", t.as_millis());
                Err(self.refuse(ErrorCode::Timeout, why).await)
            }
        }
    }

    async fn unexpected(&mut self, m: &Message, expected: &str) -> End {
        let why = format!("{:?} where {expected} was expected", m.kind());
        self.refuse(ErrorCode::Unexpected, why).await
    }

    /// `Open`: the context's `Info`, or `UnknownContext`.
    async fn open(&mut self, name: String) -> Result<(), End> {
        match context(&self.shared, &name).await {
            Ok(ready) => {
                let info = ready.info.clone();
                self.context = Some((name, ready));
                self.send_bounded(&info).await
            }
            Err((code, why)) => Err(self.refuse(code, why).await),
        }
    }

    /// `Get`: the chunk at the level asked, or its text.
    async fn get(&mut self, chunk: u32, choice: Choice) -> Result<(), End> {
        let Some((_, ready)) = &self.context else {
            let why = "Get before Open".to_string();
            return Err(self.refuse(ErrorCode::Unexpected, why).await);
        };
        let ready = ready.clone();
        match reply(&ready.store, chunk, choice, self.max_reply) {
            Ok(frame) => self.send_bounded(&frame).await,
            Err((code, why)) => Err(self.refuse(code, why).await),
        }
    }

    /// Sends `Error` (best effort) and ends the session.
    async fn refuse(&mut self, code: ErrorCode, why: String) -> End {
        let mut message = why.clone();
        truncate_utf8(&mut message, Limits::DEFAULT.max_message);
        let frame = Message::Error { code, message }.encode();
        match self.send(&frame).await {
            Ok(()) => {
                linger(&mut self.stream).await;
                End::Refused(code, why)
            }
            Err(end) => end,
        }
    }

    /// [`send`](Self::send), cut off (the connection dropped) if the session's limit passes
    /// while it writes.
    async fn send_bounded(&mut self, frame: &[u8]) -> Result<(), End> {
        let left = self.session_left();
        match tokio::time::timeout(left, self.send(frame)).await {
            Ok(r) => r,
            Err(_) => Err(End::Dropped(format!("{} mid-reply", self.session_over()))),
        }
    }

    /// Writes a frame in pieces, each after the rate limiter's wait and within the write
    /// timeout. A frame over the client's `max_payload` is replaced by `TooLarge`.
    async fn send(&mut self, frame: &[u8]) -> Result<(), End> {
        let payload = frame.len().saturating_sub(HEAD_LEN + frame::CRC_LEN);
        if let Err((code, why)) = within(payload, self.max_reply) {
            return Err(Box::pin(self.refuse(code, why)).await);
        }
        let t = self.shared.config.write_timeout;
        for piece in frame.chunks(WRITE_PIECE) {
            let wait = self.shared.limiter.delay(piece.len() as u64);
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            match tokio::time::timeout(t, self.stream.write_all(piece)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(End::Dropped(e.to_string())),
                Err(_) => {
                    let why = format!("a write took over {} ms", t.as_millis());
                    return Err(End::Dropped(why));
                }
            }
            self.sent += piece.len() as u64;
            Stats::add(&self.shared.stats.bytes_sent, piece.len() as u64);
        }
        self.frames += 1;
        Ok(())
    }
}

/// `TooLarge` if a reply's payload of `payload` bytes is over the client's `max_payload`.
fn within(payload: usize, max_payload: u32) -> Result<(), (ErrorCode, String)> {
    if payload <= max_payload as usize {
        return Ok(());
    }
    let why = format!(
        "the reply's payload of {payload} bytes is over the client's max_payload of {max_payload}"
    );
    Err((ErrorCode::TooLarge, why))
}

/// The frame answering `Get { chunk, choice }`: `BadRequest` if it is not on offer,
/// `TooLarge` (before the frame is built) if it is over the client's `max_payload`.
fn reply(
    store: &Store,
    chunk: u32,
    choice: Choice,
    max_payload: u32,
) -> Result<Vec<u8>, (ErrorCode, String)> {
    let bad = |why: String| (ErrorCode::BadRequest, why);
    let i = chunk as usize;
    if i >= store.chunks() {
        let n = store.chunks();
        return Err(bad(format!("no chunk {chunk} (the context has {n})")));
    }
    match choice {
        Choice::Level(level) => {
            let bytes = store.chunk(i, level).map_err(|_| {
                let levels = store.levels();
                bad(format!("level {level} is not on offer (levels {levels:?})"))
            })?;
            within(frame::CHUNK_PREFIX + bytes.len(), max_payload)?;
            Ok(frame::encode_chunk(chunk, level, bytes))
        }
        Choice::Text => {
            let tokens = store.chunk_token_ids(i).ok_or_else(|| {
                bad("the context has no token ids (no text fallback)".to_string())
            })?;
            within(frame::TEXT_PREFIX + 4 * tokens.len(), max_payload)?;
            let tokens = tokens.to_vec();
            Ok(Message::Text { chunk, tokens }.encode())
        }
    }
}

/// The context `name`, opened once and kept: `UnknownContext` if the root has no store of
/// that name, `Internal` if it does not open (the reason goes to the server's stderr only).
async fn context(shared: &Shared, name: &str) -> Result<Arc<Ready>, (ErrorCode, String)> {
    let dir = shared.config.root.join(name);
    // Checked before anything is kept for the name, so that unknown names cost nothing.
    if !dir.join("store.json").is_file() {
        let why = format!("no context \"{name}\" on this server");
        return Err((ErrorCode::UnknownContext, why));
    }
    let refused = || {
        let why = format!("context \"{name}\" cannot be opened (see the server's log)");
        (ErrorCode::Internal, why)
    };
    let failed_lately = lock(&shared.failed)
        .get(name)
        .is_some_and(|at| at.elapsed() < REOPEN_AFTER);
    if failed_lately {
        return Err(refused());
    }
    let cell = lock(&shared.contexts)
        .entry(name.to_string())
        .or_default()
        .clone();
    let open = || async move {
        tokio::task::spawn_blocking(move || open_ready(dir))
            .await
            .map_err(|e| e.to_string())?
    };
    let ready = cell.get_or_try_init(open).await.cloned();
    if let Err(e) = &ready {
        log(format_args!("kvc serve: context \"{name}\": {e}"));
        Stats::add(&shared.stats.open_failures, 1);
        lock(&shared.failed).insert(name.to_string(), Instant::now());
    }
    ready.map_err(|_| refused())
}

/// Writes one line to stderr, dropping it if stderr cannot take it: a server does not stop
/// for its log (`eprintln!` panics there).
fn log(args: fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(io::stderr().lock(), "{args}");
}

/// The map behind `m`, also after a panic elsewhere poisoned it (its data stays consistent:
/// every holder only inserts or reads).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_ready(dir: PathBuf) -> Result<Arc<Ready>, String> {
    let store = Store::open(&dir).map_err(|e| e.to_string())?;
    let info = Message::Info(info(&store)?).encode();
    Ok(Arc::new(Ready { store, info }))
}

/// The `Info` of a store: its levels, its chunk sizes at each, the header template and the
/// profile.
pub fn info(store: &Store) -> Result<Info, String> {
    let levels = store.levels().to_vec();
    let mut sizes = Vec::with_capacity(store.chunks() * levels.len());
    for i in 0..store.chunks() {
        for &l in &levels {
            let n = store.chunk_bytes(i, l).map_err(|e| e.to_string())?;
            sizes.push(u32::try_from(n).map_err(|_| format!("chunk {i} is over 4 GiB"))?);
        }
    }
    let mut template = store.header().clone();
    template.profile_len = 0;
    for e in &mut template.chunks {
        (e.len_bytes, e.level) = (frame::PLACEHOLDER_CHUNK_LEN, levels[0]);
    }
    let text = (0..store.chunks()).all(|i| store.chunk_token_ids(i).is_some());
    Ok(Info {
        text: text && store.chunks() > 0,
        levels,
        sizes,
        header: template.to_bytes(),
        profile: store.profile().as_bytes().to_vec(),
    })
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
}
