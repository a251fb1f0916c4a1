//! The runner's API over whole sequences: prefill a text into a [`KvCache`] (with rotary
//! metadata and the last positions' queries) and continue on top of any cache.

use crate::error::{bad_input, LlmError};
use crate::model::{steps, Keep, Model, State};
use candle_core::Tensor;
use codec_core::{KvCache, KvMeta, KvShape, Rope, RopeStyle, Tensor as KvTensor};

/// What [`Model::prefill`] returns.
#[derive(Clone, Debug)]
pub struct Prefill {
    /// Next-token logits after the last token (`vocab` values).
    pub logits: Vec<f32>,
    /// The cache, f32, `[tokens, kv_heads, head_dim]` per layer, K after the rotary embedding
    /// (before it with [`PrefillOptions::pre_rope_k`]) in the GGUF's interleaved (GPT-J)
    /// pairing; token 0 at position 0.
    pub cache: KvCache,
    /// Per layer, the post-rotary queries of the last `queries` positions, `[n, heads,
    /// head_dim]` row-major (empty vectors if none were asked for).
    pub queries: Vec<Vec<f32>>,
}

/// Options of [`Model::prefill_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillOptions {
    /// Keep the queries of this many last positions (at most the token count).
    pub queries: usize,
    /// Store K before the rotary embedding (`meta.rope.k_pre_rope`).
    pub pre_rope_k: bool,
    /// Position of the first token (0 for a text on its own; a chunk placed after others
    /// starts later).
    pub first_position: u64,
}

impl Model {
    /// Runs `tokens` from position 0: next-token logits, the KV cache and no queries (see
    /// [`PrefillOptions`] for more).
    pub fn prefill(&self, tokens: &[u32]) -> Result<Prefill, LlmError> {
        self.prefill_with(tokens, PrefillOptions::default())
    }

    /// Seconds this runner takes to prefill `tokens` tokens from position 0 (ids counted up
    /// from 1000, wrapping within the vocabulary: a prefill's time does not depend on which
    /// tokens it reads). For the controllers that weigh recompute against loading.
    pub fn time_prefill(&self, tokens: usize) -> Result<f64, LlmError> {
        // Checked before the ids are made: `tokens` may be any count.
        let context = self.config().context;
        if tokens == 0 || tokens > context {
            bad_input!("{tokens} tokens is not in 1..={context}, the model's context");
        }
        let vocab = self.config().vocab.max(1) as u64;
        let ids: Vec<u32> = (0..tokens as u64)
            .map(|i| ((1000 + i) % vocab) as u32)
            .collect();
        let t0 = std::time::Instant::now();
        self.prefill(&ids)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// [`prefill`](Self::prefill) with options.
    pub fn prefill_with(&self, tokens: &[u32], opt: PrefillOptions) -> Result<Prefill, LlmError> {
        self.prefill_progress(tokens, opt, &mut |_| {})
    }

    /// [`prefill_with`](Self::prefill_with), calling `progress(tokens done)` after each step.
    pub fn prefill_progress(
        &self,
        tokens: &[u32],
        opt: PrefillOptions,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Prefill, LlmError> {
        self.check_tokens(tokens, opt.first_position)?;
        if opt.queries > tokens.len() {
            bad_input!("{} queries asked of {} tokens", opt.queries, tokens.len());
        }
        let n = tokens.len();
        let mut state = self.empty_state(opt.first_position)?;
        let layers = self.config().layers;
        let mut queries: Vec<Vec<Tensor>> = vec![Vec::new(); layers];
        let mut pre: Vec<Vec<Tensor>> = vec![Vec::new(); layers];
        let mut last = None;
        for r in steps(n) {
            let first_q = n - opt.queries;
            let keep = Keep {
                queries_from: (opt.queries > 0 && r.end > first_q)
                    .then(|| first_q.saturating_sub(r.start)),
                pre_rope_k: opt.pre_rope_k,
            };
            let out = self.step(&mut state, &tokens[r.clone()], keep)?;
            for (acc, q) in queries.iter_mut().zip(out.queries) {
                acc.push(q);
            }
            for (acc, k) in pre.iter_mut().zip(out.pre_rope_k) {
                acc.push(k);
            }
            let rows = r.end - r.start;
            last = Some(out.hidden.narrow(0, rows - 1, 1)?);
            progress(r.end);
        }
        let last = last.expect("tokens is not empty");
        let logits = self.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        let queries = queries
            .into_iter()
            .map(|q| flat(&q, 0))
            .collect::<Result<Vec<_>, _>>()?;
        if opt.pre_rope_k {
            for (k, parts) in state.k.iter_mut().zip(pre) {
                *k = Tensor::cat(&parts, 1)?;
            }
        }
        let cache = self.to_cache(&state, opt.pre_rope_k)?;
        Ok(Prefill {
            logits,
            cache,
            queries,
        })
    }

    /// Feeds `tokens` on top of `cache` (any cache of this model's shape: the runner's own, a
    /// decoded stream, a dump in NeoX pairing, before or after the rotary embedding) and returns
    /// the logits after each of them, `[tokens.len(), vocab]` row-major. The cache's token 0 is
    /// at `cache.meta.first_position`; the new tokens follow its last.
    pub fn forward_with_cache(
        &self,
        cache: &KvCache,
        tokens: &[u32],
    ) -> Result<Vec<f32>, LlmError> {
        let state = self.state_of(cache)?;
        self.continue_state(state, tokens)
    }

    /// The K/V of `tokens` computed on top of `cache`: a cache of `tokens.len()` tokens at
    /// positions `cache.meta.first_position + cache.shape.tokens ..`, f32, in the conventions of
    /// `cache` (its rotary pairing, K before or after the rotary embedding), so that it can be
    /// appended to it. This is how a consumer recomputes a chunk sent as text
    /// (`spec/STREAM.md` §3) on the chunks before it; `cache` may be empty.
    pub fn extend(&self, cache: &KvCache, tokens: &[u32]) -> Result<KvCache, LlmError> {
        let mut state = self.state_of(cache)?;
        let (past, first) = (state.tokens, state.first_position);
        let after = first.saturating_add(past as u64);
        self.check_tokens(tokens, after)?;
        let pre_rope = cache.meta.rope.k_pre_rope;
        let keep = Keep {
            queries_from: None,
            pre_rope_k: pre_rope,
        };
        let mut pre: Vec<Vec<Tensor>> = vec![Vec::new(); self.config().layers];
        for r in steps(tokens.len()) {
            let out = self.step(&mut state, &tokens[r], keep)?;
            for (acc, k) in pre.iter_mut().zip(out.pre_rope_k) {
                acc.push(k);
            }
        }
        let n = tokens.len();
        let tail = |t: &Tensor| t.narrow(1, past, n);
        let mut new = State {
            k: state.k.iter().map(tail).collect::<Result<_, _>>()?,
            v: state.v.iter().map(tail).collect::<Result<_, _>>()?,
            first_position: after,
            tokens: n,
        };
        if pre_rope {
            for (k, parts) in new.k.iter_mut().zip(pre) {
                *k = Tensor::cat(&parts, 1)?;
            }
        }
        let mut out = self.to_cache(&new, pre_rope)?;
        if cache.meta.rope.style == RopeStyle::NeoX {
            for k in &mut out.k {
                if let KvTensor::F32(v) = k {
                    gptj_to_neox(v, self.config().head_dim);
                }
            }
            out.meta.rope.style = RopeStyle::NeoX;
        }
        Ok(out)
    }

    /// Logits after each of `tokens` run from position 0 without a cache, `[n, vocab]`
    /// (the reference that prefill + continuation must reproduce).
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, LlmError> {
        self.continue_state(self.empty_state(0)?, tokens)
    }

    /// Feeds `tokens` on top of `state`: the logits after each, `[n, vocab]`.
    fn continue_state(&self, mut state: State, tokens: &[u32]) -> Result<Vec<f32>, LlmError> {
        let after = state.first_position.saturating_add(state.tokens as u64);
        self.check_tokens(tokens, after)?;
        let mut logits = Vec::with_capacity(tokens.len() * self.config().vocab);
        for r in steps(tokens.len()) {
            let out = self.step(&mut state, &tokens[r], Keep::default())?;
            logits.extend(self.logits(&out.hidden)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(logits)
    }

    /// The rotary metadata of this runner's caches.
    pub fn rope(&self, k_pre_rope: bool) -> Rope {
        Rope {
            theta: self.config().rope_theta,
            style: RopeStyle::GptJ,
            scaling: 1.0,
            k_pre_rope,
        }
    }

    /// The state as a codec cache (K `[kv_heads, T, d]` -> `[T, kv_heads, d]`).
    fn to_cache(&self, state: &State, pre_rope: bool) -> Result<KvCache, LlmError> {
        let c = self.config();
        let rows = |t: &Tensor| -> Result<KvTensor, LlmError> {
            Ok(KvTensor::F32(
                t.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>()?,
            ))
        };
        Ok(KvCache {
            shape: KvShape {
                layers: c.layers as u32,
                kv_heads: c.kv_heads as u32,
                head_dim: c.head_dim as u32,
                tokens: state.tokens as u32,
            },
            k: state.k.iter().map(rows).collect::<Result<_, _>>()?,
            v: state.v.iter().map(rows).collect::<Result<_, _>>()?,
            meta: KvMeta {
                model_id: self.model_id().to_string(),
                rope: self.rope(pre_rope),
                first_position: state.first_position,
            },
        })
    }

    /// `cache` fits this model: its shape, rotary settings, tensors and positions.
    fn check_cache(&self, cache: &KvCache) -> Result<(), LlmError> {
        let c = self.config();
        let s = cache.shape;
        if (s.layers as usize, s.kv_heads as usize, s.head_dim as usize)
            != (c.layers, c.kv_heads, c.head_dim)
        {
            bad_input!(
                "cache of {} layers x {} KV heads x {} is not this model's {} x {} x {}",
                s.layers,
                s.kv_heads,
                s.head_dim,
                c.layers,
                c.kv_heads,
                c.head_dim
            );
        }
        let r = cache.meta.rope;
        if r.theta != c.rope_theta || r.scaling != 1.0 || r.style == RopeStyle::None {
            bad_input!(
                "cache rotary settings (theta {}, scaling {}, {:?}) are not this model's (theta {}, \
                 scaling 1, GPT-J or NeoX pairing)",
                r.theta, r.scaling, r.style, c.rope_theta
            );
        }
        if cache.k.len() != c.layers || cache.v.len() != c.layers {
            bad_input!(
                "cache has {} K and {} V tensors for {} layers",
                cache.k.len(),
                cache.v.len(),
                c.layers
            );
        }
        let end = cache
            .meta
            .first_position
            .saturating_add(u64::from(s.tokens));
        if end > c.context as u64 {
            bad_input!(
                "cache positions up to {end} exceed the model's context of {}",
                c.context
            );
        }
        Ok(())
    }

    /// A codec cache as the runner's state: checked against the model, K permuted from NeoX
    /// pairing and rotated if stored before the rotary embedding.
    pub(crate) fn state_of(&self, cache: &KvCache) -> Result<State, LlmError> {
        self.check_cache(cache)?;
        let c = self.config();
        let r = cache.meta.rope;
        let t = cache.shape.tokens as usize;
        let dev = self.device();
        let load = |x: &KvTensor, is_k: bool| -> Result<Tensor, LlmError> {
            let mut v = x.to_f32_vec();
            if v.len() != t * c.kv_channels() {
                bad_input!(
                    "cache tensor of {} values, expected {}",
                    v.len(),
                    t * c.kv_channels()
                );
            }
            if is_k && r.style == RopeStyle::NeoX {
                neox_to_gptj(&mut v, c.head_dim);
            }
            let x = Tensor::from_vec(v, (t, c.kv_heads, c.head_dim), dev)?
                .transpose(0, 1)?
                .contiguous()?;
            if is_k && r.k_pre_rope {
                return Ok(self.rotary().apply(&x, cache.meta.first_position)?);
            }
            Ok(x)
        };
        Ok(State {
            k: cache
                .k
                .iter()
                .map(|x| load(x, true))
                .collect::<Result<_, _>>()?,
            v: cache
                .v
                .iter()
                .map(|x| load(x, false))
                .collect::<Result<_, _>>()?,
            first_position: cache.meta.first_position,
            tokens: t,
        })
    }
}

/// Concatenates per-step tensors along `dim` into one flat row-major vector.
fn flat(parts: &[Tensor], dim: usize) -> Result<Vec<f32>, LlmError> {
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    Ok(Tensor::cat(parts, dim)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Reorders each head's channels from GPT-J pairing back to NeoX pairing (the inverse of
/// [`neox_to_gptj`]).
fn gptj_to_neox(v: &mut [f32], d: usize) {
    let half = d / 2;
    let mut tmp = vec![0f32; d];
    for head in v.chunks_exact_mut(d) {
        for j in 0..half {
            tmp[j] = head[2 * j];
            tmp[j + half] = head[2 * j + 1];
        }
        head.copy_from_slice(&tmp);
    }
}

/// Reorders each head's channels from NeoX pairing (`j` with `j + d/2`) to GPT-J pairing (`2j`
/// with `2j + 1`): GPT-J channel `2j` is NeoX `j`, `2j + 1` is NeoX `j + d/2`.
fn neox_to_gptj(v: &mut [f32], d: usize) {
    let half = d / 2;
    let mut tmp = vec![0f32; d];
    for head in v.chunks_exact_mut(d) {
        for j in 0..half {
            tmp[2 * j] = head[j];
            tmp[2 * j + 1] = head[j + half];
        }
        head.copy_from_slice(&tmp);
    }
}
