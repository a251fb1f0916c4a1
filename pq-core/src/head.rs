//! One (layer, KV head) during decoding: a codebook, the codes of the tokens that have left the
//! local window, and the keys of the tokens still in it.
//!
//! PQCache codes the prefill's keys once; during decoding each new token first sits in the local
//! window (always attended to, kept exactly), and gets its code from the nearest codewords once
//! `n_local` newer tokens have arrived. [`HeadIndex`] does that bookkeeping, so the codes of a
//! token never depend on when it was pushed: pushing keys one by one gives the same codes as
//! [`Codebook::encode`] of all of them at once.
use alloc::vec::Vec;

use crate::codebook::Codebook;
use crate::error::PqError;
use crate::search::{score_table, scores, select};

/// Codes and window of one (layer, KV head); see the module docs.
#[derive(Debug, Clone)]
pub struct HeadIndex {
    codebook: Codebook,
    /// Codes of tokens `0 .. coded`, `[coded, m]`.
    codes: Vec<u16>,
    /// Keys of tokens `coded .. tokens`, `[tokens - coded, D]`, oldest first.
    window: Vec<f32>,
    n_local: usize,
}

impl HeadIndex {
    /// An index over `keys` (flat `[T, D]`, e.g. the prefill's): all but the last `n_local` are
    /// coded now, those stay in the window.
    pub fn new(codebook: Codebook, keys: &[f32], n_local: usize) -> Result<Self, PqError> {
        let d = codebook.dim();
        if !keys.len().is_multiple_of(d) {
            return Err(PqError::LengthNotMultiple {
                len: keys.len(),
                dim: d,
            });
        }
        let t = keys.len() / d;
        let cut = t.saturating_sub(n_local) * d;
        let codes = codebook.encode(&keys[..cut])?;
        let window = keys[cut..].to_vec();
        if let Some(index) = window.iter().position(|v| !v.is_finite()) {
            return Err(PqError::NonFinite { index: cut + index });
        }
        Ok(Self {
            codebook,
            codes,
            window,
            n_local,
        })
    }

    /// Appends one token's key (`D` values); the oldest window token is coded once the window
    /// holds more than `n_local`.
    pub fn push(&mut self, key: &[f32]) -> Result<(), PqError> {
        let d = self.codebook.dim();
        if key.len() != d {
            return Err(PqError::LengthMismatch {
                got: key.len(),
                expected: d,
            });
        }
        if let Some(index) = key.iter().position(|v| !v.is_finite()) {
            return Err(PqError::NonFinite { index });
        }
        self.window.extend_from_slice(key);
        while self.window.len() / d > self.n_local {
            let c = self.codebook.encode(&self.window[..d])?;
            self.codes.extend_from_slice(&c);
            self.window.drain(..d);
        }
        Ok(())
    }

    /// The codebook.
    pub fn codebook(&self) -> &Codebook {
        &self.codebook
    }
    /// All tokens pushed so far (coded and in the window).
    pub fn tokens(&self) -> usize {
        self.coded() + self.window.len() / self.codebook.dim()
    }
    /// Tokens with codes (`0 .. coded()`); the rest are in the window.
    pub fn coded(&self) -> usize {
        self.codes.len() / self.codebook.m()
    }
    /// Codes of the coded tokens, `[coded(), m]`.
    pub fn codes(&self) -> &[u16] {
        &self.codes
    }

    /// The tokens one query head attends to: every window token, the first `n_init` tokens, and
    /// the `k` best coded tokens by PQ score ([`select`] over the coded tokens with their last
    /// `n_local - window` kept too, so that the last `n_local` tokens are always in), ascending.
    pub fn select(&self, query: &[f32], k: usize, n_init: usize) -> Result<Vec<u32>, PqError> {
        let coded = self.coded();
        let in_window = self.tokens() - coded;
        let s = scores(&self.codes, &score_table(query, &self.codebook)?)?;
        let mut out = select(&s, k, n_init, self.n_local.saturating_sub(in_window))?;
        out.extend(coded as u32..self.tokens() as u32);
        Ok(out)
    }
}
