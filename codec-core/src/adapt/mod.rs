//! The streaming adapter (CacheGen §5.3, `spec/STREAM.md` §3): chunk by chunk, the finest way
//! to send a chunk whose expected time still fits the deadline: a level of a multi-level store,
//! or the chunk's text for the consumer to recompute. Pure logic: the caller measures time and
//! moves bytes.
//!
//! The throughput is estimated from the last chunk sent (bytes over seconds, as CacheGen does)
//! and assumed to hold for the rest of the context. An option fits if sending every remaining
//! chunk that way would end by the deadline; of those that fit, the one with the least loss is
//! taken (text, then the levels from finest to coarsest); if none fits, the fastest. With no
//! measurement yet, a prior throughput is used if the caller has one, else the middle level.
//! Requests batched together share the link: each option's transfer time is multiplied by the
//! number of requests sending that chunk.
//!
//! ```
//! use codec_core::adapt::{Adapter, AdaptParams, Choice, Sizes};
//!
//! // Three chunks of 1000 tokens at levels 1, 7 and 11 (bytes per chunk).
//! let sizes = Sizes::new(vec![1, 7, 11], [4_000_000, 2_000_000, 500_000].repeat(3), 3)?;
//! let params = AdaptParams { deadline_s: 1.0, text_s_per_token: None, prior_bytes_per_s: None, concurrent: 1 };
//! let mut a = Adapter::new(sizes, vec![1000; 3], params)?;
//! assert_eq!(a.choose(0, 0.0), Choice::Level(7)); // nothing measured: the middle level
//! a.observe(2_000_000, 0.1);                      // 20 MB/s
//! // 2 chunks left, 0.9 s: level 1 needs 0.4 s, so it fits.
//! assert_eq!(a.choose(1, 0.1), Choice::Level(1));
//! a.observe(4_000_000, 0.8);                      // the link dropped to 5 MB/s
//! // 1 chunk left, 0.1 s: level 1 needs 0.8 s, level 7 0.4 s, level 11 0.1 s.
//! assert_eq!(a.choose(2, 0.9), Choice::Level(11));
//! # Ok::<(), codec_core::adapt::AdaptError>(())
//! ```

use alloc::vec::Vec;
use core::fmt;

/// How a chunk is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Its bytes at this level.
    Level(u8),
    /// Its token ids; the consumer recomputes its K/V.
    Text,
}

/// The sizes of a context's chunks at each level on offer.
#[derive(Clone, Debug, PartialEq)]
pub struct Sizes {
    levels: Vec<u8>,
    /// `bytes[i * levels.len() + j]`: chunk `i` at `levels[j]`.
    bytes: Vec<u64>,
    chunks: usize,
}

impl Sizes {
    /// `levels` ascending (finest first); `bytes` row-major, one row of `levels.len()` sizes per
    /// chunk.
    pub fn new(levels: Vec<u8>, bytes: Vec<u64>, chunks: usize) -> Result<Sizes, AdaptError> {
        if levels.is_empty() || !levels.windows(2).all(|w| w[0] < w[1]) {
            return Err(AdaptError::Levels);
        }
        if Some(bytes.len()) != levels.len().checked_mul(chunks) {
            return Err(AdaptError::Sizes {
                got: bytes.len(),
                chunks,
                levels: levels.len(),
            });
        }
        Ok(Sizes {
            levels,
            bytes,
            chunks,
        })
    }

    /// The levels on offer, finest first.
    pub fn levels(&self) -> &[u8] {
        &self.levels
    }

    /// Chunks of the context.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Bytes of chunk `i` at the `j`-th level on offer.
    fn at(&self, i: usize, j: usize) -> u64 {
        self.bytes[i * self.levels.len() + j]
    }

    /// Bytes of chunk `i` at `level` (`None` if either is not on offer).
    pub fn bytes(&self, i: usize, level: u8) -> Option<u64> {
        let j = self.levels.iter().position(|&l| l == level)?;
        (i < self.chunks).then(|| self.at(i, j))
    }
}

/// What the adapter is told of the request and the consumer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptParams {
    /// Seconds from the request's start by which the whole context must have arrived (the SLO).
    pub deadline_s: f64,
    /// Seconds the consumer takes to recompute one token from text (`None`: text is not on
    /// offer, e.g. no token ids or no model).
    pub text_s_per_token: Option<f64>,
    /// Throughput assumed before any chunk is measured, bytes per second (`None`: start at the
    /// middle level).
    pub prior_bytes_per_s: Option<f64>,
    /// Requests sharing the link (batched, each sending its chunk `i` at the same time).
    pub concurrent: u32,
}

/// Why an adapter could not be made.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum AdaptError {
    /// The levels are empty or not strictly ascending.
    Levels,
    /// There are not `chunks * levels` sizes.
    Sizes {
        /// Sizes given.
        got: usize,
        /// Chunks.
        chunks: usize,
        /// Levels.
        levels: usize,
    },
    /// There is not one token count per chunk.
    Tokens {
        /// Counts given.
        got: usize,
        /// Chunks.
        chunks: usize,
    },
    /// A parameter is not finite, negative, or zero where it must not be.
    Param {
        /// Which.
        what: &'static str,
    },
}

impl fmt::Display for AdaptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdaptError::Levels => f.write_str("the levels on offer must be strictly ascending"),
            AdaptError::Sizes {
                got,
                chunks,
                levels,
            } => write!(
                f,
                "{got} chunk sizes given for {chunks} chunks at {levels} levels"
            ),
            AdaptError::Tokens { got, chunks } => {
                write!(f, "{got} token counts given for {chunks} chunks")
            }
            AdaptError::Param { what } => write!(f, "adapter parameter {what} is out of range"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AdaptError {}

/// Chooses how each chunk is sent (see the module docs).
#[derive(Clone, Debug)]
pub struct Adapter {
    sizes: Sizes,
    tokens: Vec<u32>,
    params: AdaptParams,
    /// The link's throughput as last measured, bytes per second.
    measured: Option<f64>,
}

impl Adapter {
    /// An adapter for a context of `sizes`, whose chunk `i` holds `tokens[i]` tokens.
    pub fn new(sizes: Sizes, tokens: Vec<u32>, params: AdaptParams) -> Result<Adapter, AdaptError> {
        if tokens.len() != sizes.chunks {
            return Err(AdaptError::Tokens {
                got: tokens.len(),
                chunks: sizes.chunks,
            });
        }
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        let bad = |what| Err(AdaptError::Param { what });
        if !ok(params.deadline_s) {
            return bad("deadline_s");
        }
        if params.text_s_per_token.is_some_and(|x| !ok(x)) {
            return bad("text_s_per_token");
        }
        if params.prior_bytes_per_s.is_some_and(|x| !ok(x) || x == 0.0) {
            return bad("prior_bytes_per_s");
        }
        if params.concurrent == 0 {
            return bad("concurrent");
        }
        Ok(Adapter {
            sizes,
            tokens,
            params,
            measured: None,
        })
    }

    /// The sizes the adapter chooses among.
    pub fn sizes(&self) -> &Sizes {
        &self.sizes
    }

    /// Records a transfer: `bytes` moved over the link in `seconds` (all the batched requests'
    /// bytes, if several shared it). Transfers too short to time (0 seconds or 0 bytes) are
    /// ignored.
    pub fn observe(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds.is_finite() && seconds > 0.0 {
            self.measured = Some(bytes as f64 / seconds);
        }
    }

    /// The throughput the next choice assumes, bytes per second.
    pub fn throughput(&self) -> Option<f64> {
        self.measured.or(self.params.prior_bytes_per_s)
    }

    /// How to send chunk `i`, `elapsed_s` seconds after the request started.
    pub fn choose(&self, i: usize, elapsed_s: f64) -> Choice {
        let middle = Choice::Level(self.sizes.levels[(self.sizes.levels.len() - 1) / 2]);
        let Some(bw) = self.throughput() else {
            return middle;
        };
        let left = self.params.deadline_s - elapsed_s;
        let mut fastest = (f64::INFINITY, middle);
        for c in self.options() {
            let t = self.remaining_s(i, c, bw);
            if t <= left {
                return c;
            }
            if t < fastest.0 {
                fastest = (t, c);
            }
        }
        fastest.1
    }

    /// The options from the least loss to the most: text (if on offer), then the levels from
    /// finest to coarsest.
    fn options(&self) -> impl Iterator<Item = Choice> + '_ {
        let text = self.params.text_s_per_token.map(|_| Choice::Text);
        text.into_iter()
            .chain(self.sizes.levels.iter().map(|&l| Choice::Level(l)))
    }

    /// Expected seconds to send chunks `i..` all as `c` at `bw` bytes per second.
    pub fn remaining_s(&self, i: usize, c: Choice, bw: f64) -> f64 {
        (i..self.sizes.chunks).map(|k| self.chunk_s(k, c, bw)).sum()
    }

    /// Expected seconds to send chunk `k` as `c` at `bw` bytes per second: one request's time
    /// times the requests batched (they share the link, and the consumer recomputes their
    /// texts together).
    pub fn chunk_s(&self, k: usize, c: Choice, bw: f64) -> f64 {
        let one = match c {
            Choice::Level(l) => match self.sizes.bytes(k, l) {
                Some(b) => b as f64 / bw,
                None => f64::INFINITY,
            },
            Choice::Text => {
                let tokens = f64::from(self.tokens[k]);
                let per_token = self.params.text_s_per_token.unwrap_or(f64::INFINITY);
                TEXT_BYTES_PER_TOKEN * tokens / bw + per_token * tokens
            }
        };
        f64::from(self.params.concurrent) * one
    }
}

/// Bytes a token id takes on the wire (`spec/STREAM.md` §4).
pub const TEXT_BYTES_PER_TOKEN: f64 = 4.0;

#[cfg(test)]
mod tests;
