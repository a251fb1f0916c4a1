//! The fetch client (`kvc fetch`, `spec/STREAM.md` §4.4): one context, chunk by chunk, each
//! chunk's level (or text) chosen by `codec_core::adapt` from the throughput measured on the
//! chunk before it; chunk `i` is decoded (or recomputed) on a blocking thread while chunk
//! `i + 1` is fetched.

mod assemble;

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use codec_core::adapt::{AdaptError, AdaptParams, Adapter, Choice, Sizes};
use codec_core::{DecodeError, Header, KvCache, Limits as CodecLimits, Profile};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::frame::{ErrorCode, FrameError, Info, Limits, Message, PLACEHOLDER_CHUNK_LEN};
use crate::io::{read_frame, ReadError};
use assemble::{Assembler, Part};

/// What recomputes a chunk sent as text: a model runner.
pub trait Recompute: Send + Sync {
    /// The K/V of `tokens` on top of `prefix` (the chunks before it, in the stream's dtype and
    /// conventions): `tokens.len()` tokens at positions `prefix.meta.first_position +
    /// prefix.shape.tokens ..`, in the prefix's conventions (any dtype).
    fn extend(&self, prefix: &KvCache, tokens: &[u32]) -> Result<KvCache, String>;
    /// Seconds it takes per token (the adapter's cost of text).
    fn seconds_per_token(&self) -> f64;
}

/// How to fetch.
#[derive(Clone)]
pub struct FetchOptions {
    /// Time from the start of the fetch by which every chunk should have arrived.
    pub deadline: Duration,
    /// Send every chunk as this (a level on offer, or text) instead of adapting.
    pub force: Option<Choice>,
    /// Recomputes text chunks; without it text is not asked for.
    pub recompute: Option<Arc<dyn Recompute>>,
    /// Throughput assumed for the first chunk, bytes per second (`None`: the middle level).
    pub prior_bytes_per_s: Option<f64>,
    /// Time allowed to connect, and to receive each reply.
    pub io_timeout: Duration,
    /// Time allowed for the whole fetch, decoding included: a server answering every request
    /// within `io_timeout`, but slowly, cannot hold the client past it.
    pub max_time: Duration,
    /// What the client accepts from the server.
    pub limits: Limits,
    /// What the client accepts of the context: its header and profile are checked against
    /// these before the cache is allocated (at most `max_elements` values, in the stream's
    /// dtype), so a server's few bytes cannot make the client allocate more.
    pub codec_limits: CodecLimits,
}

impl FetchOptions {
    /// Adaptive, no text, 10 s per reply, 600 s in all, the default limits.
    pub fn new(deadline: Duration) -> FetchOptions {
        FetchOptions {
            deadline,
            force: None,
            recompute: None,
            prior_bytes_per_s: None,
            io_timeout: Duration::from_secs(10),
            max_time: Duration::from_secs(600),
            limits: Limits::DEFAULT,
            codec_limits: CodecLimits::DEFAULT,
        }
    }
}

impl fmt::Debug for FetchOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FetchOptions")
            .field("deadline", &self.deadline)
            .field("force", &self.force)
            .field("recompute", &self.recompute.is_some())
            .field("prior_bytes_per_s", &self.prior_bytes_per_s)
            .field("io_timeout", &self.io_timeout)
            .field("max_time", &self.max_time)
            .field("limits", &self.limits)
            .field("codec_limits", &self.codec_limits)
            .finish()
    }
}

/// One chunk's transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChunkRow {
    /// How it was sent.
    pub choice: Choice,
    /// Bytes of its reply frame.
    pub bytes: u64,
    /// Seconds from sending `Get` to having the whole reply.
    pub seconds: f64,
}

impl ChunkRow {
    /// Bytes per second.
    pub fn throughput(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9)
    }
}

/// A fetched context.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The cache, in the stream's dtype.
    pub cache: KvCache,
    /// The levels the server offered.
    pub levels: Vec<u8>,
    /// Per chunk, its transfer.
    pub rows: Vec<ChunkRow>,
    /// Seconds from the start until the last chunk arrived.
    pub transfer_s: f64,
    /// Seconds from the start until the cache was whole (the last chunk decoded).
    pub total_s: f64,
}

impl Fetched {
    /// Seconds from the start until the context was there as the adapter counts it (the time
    /// the deadline is for): the last chunk's arrival, or, when a chunk came as text, the
    /// cache whole (its recompute is part of its time; this counts the decode of coded chunks
    /// after it too, so it errs late).
    pub fn ready_s(&self) -> f64 {
        match self.rows.iter().any(|r| r.choice == Choice::Text) {
            true => self.total_s,
            false => self.transfer_s,
        }
    }
}

/// Why a fetch failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum FetchError {
    /// The server could not be reached.
    Connect {
        /// The address.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// The connection failed.
    Io(io::Error),
    /// The server sent nothing whole in time.
    Timeout {
        /// What was awaited.
        waiting_for: &'static str,
        /// The time allowed.
        after: Duration,
    },
    /// The server closed the connection.
    Closed {
        /// What was awaited.
        waiting_for: &'static str,
    },
    /// The server sent a malformed frame.
    Frame(FrameError),
    /// The server refused the request.
    Server {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The server's reply does not answer the request.
    Protocol(String),
    /// The context's header, profile or a chunk does not decode.
    Stream(String),
    /// The options do not fit the context (a forced level not on offer, text without a model).
    Request(String),
    /// The sizes the server gave cannot drive the adapter.
    Adapt(AdaptError),
    /// Recomputing a text chunk failed.
    Recompute {
        /// The chunk.
        chunk: usize,
        /// Why.
        why: String,
    },
}

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchError::Connect { addr, source } => write!(f, "cannot connect to {addr}: {source}"),
            FetchError::Io(e) => write!(f, "connection failed: {e}"),
            FetchError::Timeout { waiting_for, after } => write!(
                f,
                "no {waiting_for} from the server within {} ms",
                after.as_millis()
            ),
            FetchError::Closed { waiting_for } => {
                write!(
                    f,
                    "the server closed the connection (waiting for {waiting_for})"
                )
            }
            FetchError::Frame(e) => write!(f, "the server sent a bad frame: {e}"),
            FetchError::Server { code, message } => {
                write!(f, "the server refused: {message} ({code:?})")
            }
            FetchError::Protocol(why) => write!(f, "protocol error: {why}"),
            FetchError::Stream(why) => write!(f, "the context does not decode: {why}"),
            FetchError::Request(why) => f.write_str(why),
            FetchError::Adapt(e) => write!(f, "the server's chunk sizes: {e}"),
            FetchError::Recompute { chunk, why } => {
                write!(f, "recomputing chunk {chunk} from its text: {why}")
            }
        }
    }
}

impl std::error::Error for FetchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FetchError::Connect { source, .. } => Some(source),
            FetchError::Io(e) => Some(e),
            FetchError::Frame(e) => Some(e),
            FetchError::Adapt(e) => Some(e),
            _ => None,
        }
    }
}

/// The context as the `Info` describes it, checked.
struct Context {
    info: Info,
    header: Header,
    profile: Profile,
}

/// Fetches `context` from the server at `addr`, within `opts.max_time`.
pub async fn fetch(addr: &str, context: &str, opts: &FetchOptions) -> Result<Fetched, FetchError> {
    match tokio::time::timeout(opts.max_time, fetch_all(addr, context, opts)).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::Timeout {
            waiting_for: "complete context",
            after: opts.max_time,
        }),
    }
}

async fn fetch_all(addr: &str, context: &str, opts: &FetchOptions) -> Result<Fetched, FetchError> {
    let start = Instant::now();
    let mut conn = Conn::connect(addr, opts).await?;
    conn.send(&Message::Hello {
        max_payload: opts.limits.max_payload,
    })
    .await?;
    conn.send(&Message::Open {
        context: context.to_string(),
    })
    .await?;
    let ctx = match conn.receive("Info").await? {
        (Message::Info(info), _) => checked_context(info, &opts.codec_limits)?,
        (m, _) => return Err(unexpected(&m, "Info")),
    };
    let mut adapter = adapter(&ctx, opts)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let assembler = Assembler {
        header: ctx.header.clone(),
        profile: ctx.profile.clone(),
        recompute: opts.recompute.clone(),
    };
    let worker = tokio::task::spawn_blocking(move || assembler.run(rx));
    let mut rows = Vec::with_capacity(ctx.info.chunks());
    for i in 0..ctx.info.chunks() {
        let choice = opts
            .force
            .unwrap_or_else(|| adapter.choose(i, start.elapsed().as_secs_f64()));
        let (part, row) = match conn.get(&ctx, i, choice).await {
            Ok(got) => got,
            // A decoder that has already failed failed first (on a chunk before this one).
            Err(e) if worker.is_finished() => return Err(decoded(worker.await).err().unwrap_or(e)),
            Err(e) => return Err(e),
        };
        adapter.observe(row.bytes, row.seconds);
        rows.push(row);
        if tx.send(part).is_err() {
            break; // the decoder failed: its error is collected below
        }
    }
    let transfer_s = start.elapsed().as_secs_f64();
    // The session is over either way; the server closes on its side.
    let _ = conn.send(&Message::Bye).await;
    drop(tx);
    let cache = decoded(worker.await)?;
    Ok(Fetched {
        cache,
        levels: ctx.info.levels,
        rows,
        transfer_s,
        total_s: start.elapsed().as_secs_f64(),
    })
}

/// The cache the decoder thread assembled, or why it did not.
fn decoded(
    joined: Result<Result<KvCache, FetchError>, tokio::task::JoinError>,
) -> Result<KvCache, FetchError> {
    joined.map_err(|e| FetchError::Stream(format!("the decoder stopped: {e}")))?
}

/// The adapter for the context and options (text on offer only with a model and token ids),
/// after checking a forced choice is on offer.
fn adapter(ctx: &Context, opts: &FetchOptions) -> Result<Adapter, FetchError> {
    let info = &ctx.info;
    let text = opts.recompute.as_ref().filter(|_| info.text);
    match opts.force {
        Some(Choice::Level(l)) if !info.levels.contains(&l) => {
            let why = format!("level {l} is not on offer (levels {:?})", info.levels);
            return Err(FetchError::Request(why));
        }
        Some(Choice::Text) if text.is_none() => {
            let why = "text needs a model and a context with token ids".to_string();
            return Err(FetchError::Request(why));
        }
        _ => {}
    }
    let sizes = info.sizes.iter().map(|&s| u64::from(s)).collect();
    let sizes = Sizes::new(info.levels.clone(), sizes, info.chunks()).map_err(FetchError::Adapt)?;
    let tokens = ctx.header.chunks.iter().map(|e| e.tokens).collect();
    let params = AdaptParams {
        deadline_s: opts.deadline.as_secs_f64(),
        text_s_per_token: text.map(|r| r.seconds_per_token()),
        prior_bytes_per_s: opts.prior_bytes_per_s,
        concurrent: 1,
    };
    Adapter::new(sizes, tokens, params).map_err(FetchError::Adapt)
}

/// Checks the `Info` within `limits`: the header template is a valid header of a stream of
/// placeholder chunks, referencing the profile sent, with one chunk per row of sizes.
fn checked_context(info: Info, limits: &CodecLimits) -> Result<Context, FetchError> {
    let bad = |why: String| FetchError::Stream(format!("the server's Info: {why}"));
    let profile = Profile::from_bytes(&info.profile, limits).map_err(|e| bad(e.to_string()))?;
    // The template's chunk entries say PLACEHOLDER_CHUNK_LEN bytes each: the bytes it would
    // be the header of are that many per chunk after it (bounded: Info holds a size per chunk).
    let n = info.chunks();
    let mut stream = info.header.clone();
    stream.resize(info.header.len() + n * PLACEHOLDER_CHUNK_LEN as usize, 0);
    let header =
        Header::parse(&stream, limits).map_err(|e| bad(DecodeError::from(e).to_string()))?;
    if header.profile_len != 0 || header.profile_hash != profile.hash() {
        return Err(bad("the header does not reference the profile sent".into()));
    }
    if header.chunks.len() != n {
        let why = format!(
            "{} chunks in the header, {n} in the sizes",
            header.chunks.len()
        );
        return Err(bad(why));
    }
    if let Some(&l) = info.levels.iter().find(|&&l| l >= profile.levels()) {
        return Err(bad(format!("level {l} is not one of the profile's")));
    }
    Ok(Context {
        info,
        header,
        profile,
    })
}

fn unexpected(m: &Message, expected: &str) -> FetchError {
    FetchError::Protocol(format!("{:?} where {expected} was expected", m.kind()))
}

/// The connection to the server.
struct Conn {
    stream: TcpStream,
    timeout: Duration,
    limits: Limits,
}

impl Conn {
    async fn connect(addr: &str, opts: &FetchOptions) -> Result<Conn, FetchError> {
        let fail = |source| FetchError::Connect {
            addr: addr.to_string(),
            source,
        };
        let stream = match tokio::time::timeout(opts.io_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(fail(e)),
            Err(_) => return Err(fail(io::Error::from(io::ErrorKind::TimedOut))),
        };
        // Requests are small and each waits for its reply: send them at once.
        let _ = stream.set_nodelay(true);
        Ok(Conn {
            stream,
            timeout: opts.io_timeout,
            limits: opts.limits,
        })
    }

    async fn send(&mut self, m: &Message) -> Result<(), FetchError> {
        let frame = m.encode();
        let write = self.stream.write_all(&frame);
        match tokio::time::timeout(self.timeout, write).await {
            Ok(r) => r.map_err(FetchError::Io),
            Err(_) => Err(FetchError::Timeout {
                waiting_for: "room to send a request",
                after: self.timeout,
            }),
        }
    }

    /// The server's next frame and its length; an `Error` frame is returned as the error.
    async fn receive(&mut self, waiting_for: &'static str) -> Result<(Message, usize), FetchError> {
        let read = read_frame(&mut self.stream, &self.limits);
        let got = match tokio::time::timeout(self.timeout, read).await {
            Err(_) => {
                let after = self.timeout;
                return Err(FetchError::Timeout { waiting_for, after });
            }
            Ok(r) => r,
        };
        match got {
            Ok(Some((Message::Error { code, message }, _))) => {
                Err(FetchError::Server { code, message })
            }
            Ok(Some(m)) => Ok(m),
            Ok(None) | Err(ReadError::Closed) => Err(FetchError::Closed { waiting_for }),
            Err(ReadError::Io(e)) => Err(FetchError::Io(e)),
            Err(ReadError::Frame(e)) => Err(FetchError::Frame(e)),
        }
    }

    /// Chunk `i` as `choice`: what arrived, checked against the request and the `Info`, and
    /// its transfer.
    async fn get(
        &mut self,
        ctx: &Context,
        i: usize,
        choice: Choice,
    ) -> Result<(Part, ChunkRow), FetchError> {
        let t0 = Instant::now();
        let chunk = i as u32;
        self.send(&Message::Get { chunk, choice }).await?;
        let (m, len) = self.receive("a chunk").await?;
        let row = ChunkRow {
            choice,
            bytes: len as u64,
            seconds: t0.elapsed().as_secs_f64(),
        };
        let e = ctx.header.chunks[i];
        let part = match (m, choice) {
            (
                Message::Chunk {
                    chunk: c,
                    level,
                    bytes,
                },
                Choice::Level(l),
            ) if (c, level) == (chunk, l) => {
                let j = ctx.info.levels.iter().position(|&x| x == l).unwrap_or(0);
                let want = ctx.info.sizes[i * ctx.info.levels.len() + j];
                if bytes.len() != want as usize {
                    let why = format!(
                        "chunk {i} at level {l}: {} bytes, the Info said {want}",
                        bytes.len()
                    );
                    return Err(FetchError::Protocol(why));
                }
                Part::Coded {
                    chunk: i,
                    level,
                    bytes,
                }
            }
            (Message::Text { chunk: c, tokens }, Choice::Text) if c == chunk => {
                if tokens.len() != e.tokens as usize {
                    let why = format!(
                        "chunk {i}: {} token ids for {} tokens",
                        tokens.len(),
                        e.tokens
                    );
                    return Err(FetchError::Protocol(why));
                }
                Part::Text { chunk: i, tokens }
            }
            (m, _) => return Err(unexpected(&m, &format!("chunk {i} as {choice:?}"))),
        };
        Ok((part, row))
    }
}
