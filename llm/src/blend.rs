//! CacheBlend's fusor on the runner (paper §4.2): continue on reused chunk caches that were not
//! computed after one another, recomputing the K/V of a few of their tokens layer by layer.
//!
//! The reused cache holds the chunks already placed (each shifted to its position, see
//! [`codec_core::shift_cache`]). Per layer, the candidate tokens' Q/K/V are recomputed from
//! their hidden states; the tokens kept (all candidates, or the most deviating ones under HKVD
//! selection) write their fresh K/V into the layer's cache, and only they and the suffix go on
//! through attention (over the whole mixed cache) and the MLP. Every other token keeps its
//! reused K/V from there on. The suffix (the question) is always computed. Under selection the
//! first layer is recomputed for every token and the checks start at the second (a token's
//! first-layer K/V do not depend on the other chunks).

use std::time::Instant;

use candle_core::Tensor;
use codec_core::blend::{deviations, less_coding_error, Filter, Norm, SelectParams, Tensors};
use codec_core::{CodingError, KvCache};

use crate::error::{bad_input, LlmError};
use crate::model::{Model, State};
use crate::ops::Attention;
use crate::weights::Block;

/// Which reused tokens are recomputed.
#[derive(Clone, Debug, PartialEq)]
pub enum Recompute {
    /// HKVD selection: the first layer checks every reused token, later layers narrow the set
    /// ([`SelectParams`]; a single check layer is `first_ratio == ratio`, `narrow_layers` 0).
    Select(SelectParams),
    /// These reused tokens (indices, ascending) at every layer: all of them is full recompute,
    /// none full reuse, the tokens after the first chunk prefix caching.
    Fixed(Vec<u32>),
}

/// What [`Model::blend`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Blended {
    /// Logits after each suffix token, `[suffix, vocab]` row-major.
    pub logits: Vec<f32>,
    /// Per layer, the reused tokens whose K/V were recomputed and written, ascending.
    pub recomputed: Vec<Vec<u32>>,
    /// Floating-point operations of the layers' products (projections, attention, MLP).
    pub flops: f64,
    /// Seconds spent on the logits of every suffix token: scoring needs them all, a prefill
    /// only the last token's, so a prefill's time is the call's less this.
    pub scoring_s: f64,
}

/// The tokens one layer works on: reused candidates first (ascending), then the suffix.
struct Rows {
    /// Token indices in the whole sequence (reused tokens, then the suffix).
    index: Vec<u32>,
    /// How many of them are reused tokens.
    reused: usize,
}

impl Model {
    /// Runs `suffix` after the reused cache `reused` (whose tokens are `tokens`, at positions
    /// `reused.meta.first_position..`), recomputing reused tokens as `how` says. `error` is the
    /// error the reused cache's coding is expected to carry, if it was stored through a kvc
    /// stream ([`codec_core::Stream::decode_with_error`]): HKVD selection with the L2 norm
    /// takes it out of the deviations it measures ([`codec_core::blend::less_coding_error`]).
    pub fn blend(
        &self,
        reused: &KvCache,
        error: Option<&CodingError>,
        tokens: &[u32],
        suffix: &[u32],
        how: &Recompute,
    ) -> Result<Blended, LlmError> {
        let n = tokens.len();
        if reused.shape.tokens as usize != n {
            bad_input!("{n} tokens for a cache of {}", reused.shape.tokens);
        }
        if let Some(e) = error {
            self.check_error(e, n)?;
        }
        let p0 = reused.meta.first_position;
        self.check_tokens(tokens, p0)?;
        self.check_tokens(suffix, p0 + n as u64)?;
        let (filter, first) = first_candidates(how, n)?;
        let total = n + suffix.len();
        let rows = Rows::new(first, n, total);
        let all: Vec<u32> = tokens.iter().chain(suffix).copied().collect();
        let ids: Vec<u32> = rows.index.iter().map(|&i| all[i as usize]).collect();
        let mut x = self
            .weights()
            .embed
            .index_select(&Tensor::new(ids, self.device())?, 0)?;
        let mut walk = Walk {
            state: self.state_of(reused)?,
            rows,
            filter,
            error,
            p0,
            total,
            out: Blended {
                logits: Vec::new(),
                recomputed: Vec::with_capacity(self.config().layers),
                flops: 0.0,
                scoring_s: 0.0,
            },
        };
        for (l, block) in self.weights().blocks.iter().enumerate() {
            x = self.blend_layer(&mut walk, l, block, &x)?;
        }
        let t0 = Instant::now();
        let s = suffix.len();
        let last = x.narrow(0, x.dim(0)? - s, s)?;
        let eps = self.config().rms_eps;
        let last = candle_nn::ops::rms_norm(&last, &self.weights().norm, eps)?;
        walk.out.logits = self.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        walk.out.scoring_s = t0.elapsed().as_secs_f64();
        Ok(walk.out)
    }

    /// Layer `l` (`block`) of a blend on the hidden states `x` of `walk`'s rows: their Q/K/V
    /// recomputed, the rows kept (all, or under selection the most deviating reused ones and
    /// the suffix) written into the layer's cache and carried through attention and the MLP.
    /// Returns the kept rows' hidden states.
    fn blend_layer(
        &self,
        walk: &mut Walk<'_>,
        l: usize,
        block: &Block,
        x: &Tensor,
    ) -> Result<Tensor, LlmError> {
        let eps = self.config().rms_eps;
        let h = candle_nn::ops::rms_norm(x, &block.attn_norm, eps)?;
        let rows = &walk.rows;
        let positions: Vec<u64> = rows.index.iter().map(|&i| walk.p0 + u64::from(i)).collect();
        let (q, k, v) = self.qkv(block, &h, &positions)?;
        walk.out.flops += self.projection_flops(rows.index.len());
        let kept = self.kept_rows(walk, l, &k, &v)?;
        let pick = |t: &Tensor, dim| -> Result<Tensor, LlmError> {
            let at: Vec<u32> = kept.iter().map(|&r| r as u32).collect();
            Ok(t.index_select(&Tensor::new(at, self.device())?, dim)?
                .contiguous()?)
        };
        let (q, k, v, xs) = (pick(&q, 1)?, pick(&k, 1)?, pick(&v, 1)?, pick(x, 0)?);
        let rows = &mut walk.rows;
        rows.retain(&kept);
        walk.out.recomputed.push(rows.index[..rows.reused].to_vec());
        let ck = self.write_rows(&walk.state.k[l], &k, &rows.index, walk.total)?;
        let cv = self.write_rows(&walk.state.v[l], &v, &rows.index, walk.total)?;
        let d = self.config().head_dim;
        let op = Attention {
            scale: 1.0 / (d as f32).sqrt(),
            seen: rows.index.iter().map(|&i| i as usize + 1).collect(),
        };
        walk.out.flops += self.layer_flops(&op.seen);
        let o = q.apply_op3_no_bwd(&ck, &cv, &op)?;
        let m = rows.index.len();
        let o = o.transpose(0, 1)?.reshape((m, self.config().heads * d))?;
        let xa = (xs + o.matmul(&block.wo)?)?;
        let h = candle_nn::ops::rms_norm(&xa, &block.ffn_norm, eps)?;
        Ok((&xa + self.mlp(block, &h)?)?)
    }

    /// Positions (in `walk.rows`) of the rows layer `l` goes on with, from its fresh `k`, `v`:
    /// all of them, or under selection (from the second layer) the reused tokens the filter
    /// keeps by their deviations and the suffix.
    ///
    /// The first layer's K/V depend on each token alone (its embedding and position), so
    /// reused and fresh ones agree there: the first layer is recomputed in full, which gives
    /// every token the cross-chunk attention its later K/V deviate by, and the first check is
    /// the second layer's.
    fn kept_rows(
        &self,
        walk: &mut Walk<'_>,
        l: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<usize>, LlmError> {
        let rows = &walk.rows;
        let Some(f) = walk.filter.as_mut().filter(|_| l > 0) else {
            return Ok((0..rows.index.len()).collect());
        };
        let (rk, rv) = (&walk.state.k[l], &walk.state.v[l]);
        let mut dev = self.deviations(rk, rv, k, v, rows, f)?;
        if let (Some(e), Norm::L2) = (walk.error, f.params().norm) {
            let noise = coding_error(e, l, f.params().tensors, f.candidates());
            less_coding_error(&mut dev, &noise).map_err(blend_err)?;
        }
        f.narrow(&dev).map_err(blend_err)?;
        Ok(rows.keep(f.candidates()))
    }

    /// Refuses a coding error that does not describe `n` tokens of this model's cache.
    fn check_error(&self, e: &CodingError, n: usize) -> Result<(), LlmError> {
        let c = self.config();
        let per_layer = n * c.kv_heads;
        let fits = |v: &[Vec<f32>]| v.len() == c.layers && v.iter().all(|l| l.len() == per_layer);
        if e.tokens as usize != n || e.kv_heads as usize != c.kv_heads || !fits(&e.k) || !fits(&e.v)
        {
            bad_input!(
                "the coding error describes {} tokens x {} KV heads over {} layers; the cache is \
                 {n} tokens x {} x {}",
                e.tokens,
                e.kv_heads,
                e.k.len(),
                c.kv_heads,
                c.layers
            );
        }
        Ok(())
    }

    /// Normed hidden states `h` (`[m, hidden]`) of tokens at `positions` to their rotated Q
    /// `[heads, m, d]`, rotated K and V `[kv_heads, m, d]`.
    fn qkv(
        &self,
        block: &Block,
        h: &Tensor,
        positions: &[u64],
    ) -> Result<(Tensor, Tensor, Tensor), LlmError> {
        let c = self.config();
        let (m, d) = (h.dim(0)?, c.head_dim);
        let qkv = h.matmul(&block.wqkv)?;
        let split = |from: usize, heads: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, from * d, heads * d)?
                .reshape((m, heads, d))?
                .transpose(0, 1)?
                .contiguous()
        };
        let q = self.rotary().apply_at(&split(0, c.heads)?, positions)?;
        let k = self
            .rotary()
            .apply_at(&split(c.heads, c.kv_heads)?, positions)?;
        let v = split(c.heads + c.kv_heads, c.kv_heads)?;
        Ok((q, k, v))
    }

    /// The deviation of each reused candidate's fresh K/V (`k`, `v` `[kv_heads, m, d]`, its
    /// rows first) from the reused layer cache (`[kv_heads, n, d]`).
    fn deviations(
        &self,
        reused_k: &Tensor,
        reused_v: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rows: &Rows,
        filter: &Filter,
    ) -> Result<Vec<f32>, LlmError> {
        let c = rows.reused;
        let at: Vec<u32> = rows.index[..c].to_vec();
        let token_rows = |t: &Tensor| -> Result<Vec<f32>, LlmError> {
            // [kv, c, d] -> [c, kv, d]: one row of kv_heads * d values per token.
            Ok(t.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let gather = |t: &Tensor| -> Result<Vec<f32>, LlmError> {
            token_rows(&t.index_select(&Tensor::new(at.clone(), self.device())?, 1)?)
        };
        let fresh = |t: &Tensor| -> Result<Vec<f32>, LlmError> { token_rows(&t.narrow(1, 0, c)?) };
        let (rk, rv, fk, fv) = (gather(reused_k)?, gather(reused_v)?, fresh(k)?, fresh(v)?);
        let p = filter.params();
        let row = self.config().kv_channels();
        deviations(p.tensors, p.norm, row, (&rk, &fk), (&rv, &fv)).map_err(blend_err)
    }

    /// The layer cache `[kv_heads, total, d]`: the reused rows, then zeros for the suffix, with
    /// the rows at `index` replaced by `fresh` (`[kv_heads, index.len(), d]`).
    fn write_rows(
        &self,
        reused: &Tensor,
        fresh: &Tensor,
        index: &[u32],
        total: usize,
    ) -> Result<Tensor, LlmError> {
        let c = self.config();
        let (kv, d) = (c.kv_heads, c.head_dim);
        let n = reused.dim(1)?;
        let mut out = vec![0.0f32; kv * total * d];
        crate::ops::with_f32s(reused, |old| {
            for (h, o) in out.chunks_exact_mut(total * d).enumerate() {
                o[..n * d].copy_from_slice(&old[h * n * d..][..n * d]);
            }
        })?;
        crate::ops::with_f32s(fresh, |new| {
            for (h, o) in out.chunks_exact_mut(total * d).enumerate() {
                for (r, &t) in index.iter().enumerate() {
                    let src = &new[(h * index.len() + r) * d..][..d];
                    o[t as usize * d..][..d].copy_from_slice(src);
                }
            }
        })?;
        Ok(Tensor::from_vec(out, (kv, total, d), self.device())?)
    }

    /// The operations [`blend`](Self::blend) counts when it recomputes every one of `tokens`
    /// tokens (reused and suffix) at every layer: a full prefill's.
    pub fn full_flops(&self, tokens: usize) -> f64 {
        let seen: Vec<usize> = (1..=tokens).collect();
        let per_layer = self.projection_flops(tokens) + self.layer_flops(&seen);
        per_layer * self.config().layers as f64
    }

    /// Operations of the Q/K/V projections of `m` tokens.
    fn projection_flops(&self, m: usize) -> f64 {
        let c = self.config();
        2.0 * (m * c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim) as f64
    }

    /// Operations of attention (over `seen` keys per row), output projection and MLP.
    fn layer_flops(&self, seen: &[usize]) -> f64 {
        let c = self.config();
        let m = seen.len() as f64;
        let keys: f64 = seen.iter().map(|&s| s as f64).sum();
        let attention = 4.0 * (c.heads * c.head_dim) as f64 * keys;
        let dense = 2.0 * m * (c.heads * c.head_dim * c.hidden + 3 * c.hidden * c.ffn) as f64;
        attention + dense
    }
}

/// Per candidate token (in `at`), the expected squared coding error of its layer-`l` rows of
/// the tensors `tensors` compares, summed over the KV heads.
fn coding_error(e: &CodingError, l: usize, tensors: Tensors, at: &[u32]) -> Vec<f32> {
    let heads = e.kv_heads as usize;
    let (k, v) = (&e.k[l], &e.v[l]);
    let sum = |m: &[f32], t: usize| m[t * heads..][..heads].iter().sum::<f32>();
    at.iter()
        .map(|&t| {
            let t = t as usize;
            match tensors {
                Tensors::K => sum(k, t),
                Tensors::V => sum(v, t),
                Tensors::KV => sum(k, t) + sum(v, t),
            }
        })
        .collect()
}

/// The chunks' caches placed one after another from position 0 (each shifted to where the
/// chunks before it end) as one f32 cache: the reused cache [`Model::blend`] takes. The chunks
/// must share shape and rotary settings.
pub fn place_chunks(chunks: &[KvCache]) -> Result<KvCache, LlmError> {
    let Some(first) = chunks.first() else {
        bad_input!("no chunks to place");
    };
    let s = first.shape;
    let mut out = KvCache {
        shape: codec_core::KvShape { tokens: 0, ..s },
        k: vec![codec_core::Tensor::F32(Vec::new()); s.layers as usize],
        v: vec![codec_core::Tensor::F32(Vec::new()); s.layers as usize],
        meta: codec_core::KvMeta {
            first_position: 0,
            ..first.meta.clone()
        },
    };
    for (i, c) in chunks.iter().enumerate() {
        let same = codec_core::KvShape {
            tokens: 0,
            ..c.shape
        } == codec_core::KvShape { tokens: 0, ..s }
            && c.meta.rope == first.meta.rope
            && c.k.len() == s.layers as usize
            && c.v.len() == s.layers as usize;
        if !same {
            bad_input!("chunk {i}'s shape or rotary settings differ from chunk 0's");
        }
        let mut c = c.clone();
        let at = u64::from(out.shape.tokens);
        codec_core::shift_cache(&mut c, at).map_err(|e| LlmError::Input {
            reason: format!("chunk {i}: {e}"),
        })?;
        for (dst, src) in out.k.iter_mut().zip(&c.k).chain(out.v.iter_mut().zip(&c.v)) {
            if let codec_core::Tensor::F32(d) = dst {
                d.extend(src.to_f32_vec());
            }
        }
        out.shape.tokens += c.shape.tokens;
    }
    Ok(out)
}

impl Rows {
    /// `reused` candidates (ascending) and the suffix `n..total`.
    fn new(reused: Vec<u32>, n: usize, total: usize) -> Rows {
        let c = reused.len();
        let mut index = reused;
        index.extend(n as u32..total as u32);
        Rows { index, reused: c }
    }

    /// Positions (in `index`) of the kept reused tokens `kept` (a subset of the candidates,
    /// ascending), then of the suffix.
    fn keep(&self, kept: &[u32]) -> Vec<usize> {
        let mut at = Vec::with_capacity(kept.len() + self.index.len() - self.reused);
        let mut i = 0;
        for &t in kept {
            while self.index[i] != t {
                i += 1;
            }
            at.push(i);
        }
        at.extend(self.reused..self.index.len());
        at
    }

    /// Keeps the rows at positions `at` (from [`keep`](Self::keep)).
    fn retain(&mut self, at: &[usize]) {
        let reused = at.iter().filter(|&&i| i < self.reused).count();
        self.index = at.iter().map(|&i| self.index[i]).collect();
        self.reused = reused;
    }
}

/// A blend's walk through the layers ([`Model::blend`]).
struct Walk<'a> {
    /// The reused cache, per layer.
    state: State,
    /// The rows still computed.
    rows: Rows,
    /// The selection, under HKVD selection.
    filter: Option<Filter>,
    /// The coding error the reused cache is expected to carry.
    error: Option<&'a CodingError>,
    /// The reused cache's first position.
    p0: u64,
    /// Tokens, reused and suffix.
    total: usize,
    out: Blended,
}

/// `how`'s selection (HKVD) and the reused tokens the first layer recomputes, of `n`.
fn first_candidates(how: &Recompute, n: usize) -> Result<(Option<Filter>, Vec<u32>), LlmError> {
    match how {
        Recompute::Select(p) => {
            let f = Filter::new(*p, n as u32).map_err(blend_err)?;
            let first = f.candidates().to_vec();
            Ok((Some(f), first))
        }
        Recompute::Fixed(set) => {
            if !set.windows(2).all(|w| w[0] < w[1]) || set.last().is_some_and(|&t| t as usize >= n)
            {
                bad_input!("recomputed tokens must ascend and stay below {n}");
            }
            Ok((None, set.clone()))
        }
    }
}

fn blend_err(e: codec_core::blend::BlendError) -> LlmError {
    LlmError::Input {
        reason: e.to_string(),
    }
}
