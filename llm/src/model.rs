//! The layer loop: embeddings, `layers` pre-norm blocks (grouped-query attention with rotary
//! positions, SwiGLU MLP), final norm and LM head, over a growing per-layer KV state.

use crate::config::Config;
use crate::error::{bad_input, LlmError};
use crate::gguf::{self, Gguf};
use crate::ops::{Attention, SwiGlu};
use crate::rope::Rotary;
use crate::tokenizer::Tokenizer;
use crate::weights::{Block, Weights};
use candle_core::{Device, Tensor};
use std::io::{Read, Seek};
use std::path::Path;

/// Tokens per forward step of a long input: attention is computed block by block against the
/// cache so far, which skips most of the causal mask's upper triangle and bounds the score
/// matrix at `heads * STEP * tokens` values. (256 prefilled 2048 tokens faster than 128, 512 or
/// 1024 on the 2-core development machine.)
pub(crate) const STEP: usize = 256;

/// A loaded model: weights in f32, its tokenizer and hyper-parameters.
#[derive(Debug)]
pub struct Model {
    config: Config,
    tokenizer: Tokenizer,
    weights: Weights,
    rotary: Rotary,
    model_id: String,
    device: Device,
}

/// The per-layer attention state of a sequence: post-rotary K and V, `[kv_heads, tokens, d]`.
#[derive(Clone, Debug)]
pub(crate) struct State {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Absolute position of the state's token 0.
    pub first_position: u64,
    pub tokens: usize,
}

/// What a forward step keeps besides the state.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Keep {
    /// Keep the post-rotary queries of this step's tokens from this index on.
    pub queries_from: Option<usize>,
    /// Keep K before the rotary embedding.
    pub pre_rope_k: bool,
}

/// What a forward step returns.
#[derive(Debug)]
pub(crate) struct StepOut {
    /// The last block's output after the final norm, `[tokens, hidden]`.
    pub hidden: Tensor,
    /// Per layer, the kept queries `[n, heads, d]`.
    pub queries: Vec<Tensor>,
    /// Per layer, K before rotation `[kv_heads, tokens, d]`.
    pub pre_rope_k: Vec<Tensor>,
}

impl Model {
    /// Loads a llama-architecture GGUF (weights dequantized to f32) and its tokenizer.
    ///
    /// Fails with [`LlmError::ModelMissing`] (whose message names `tools/fetch-model`) if the
    /// file does not exist.
    pub fn load(path: &Path) -> Result<Self, LlmError> {
        Self::from_gguf(gguf::open(path)?, path)
    }

    /// Loads the GGUF read by `r`, named `path` in errors.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn read<R: Read + Seek>(r: R, path: &Path) -> Result<Self, LlmError> {
        Self::from_gguf(gguf::read(r, path)?, path)
    }

    fn from_gguf<R: Read + Seek>(g: Gguf<R>, path: &Path) -> Result<Self, LlmError> {
        let Gguf {
            mut reader,
            content,
        } = g;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let config = Config::from_gguf(&content, tokenizer.vocab_size())?;
        let device = Device::Cpu;
        let weights = Weights::load(&content, &mut reader, path, &config, &device)?;
        let model_id = content
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_else(|| "llama".to_string());
        Ok(Model {
            rotary: Rotary::new(config.rope_theta, config.head_dim),
            config,
            tokenizer,
            weights,
            model_id,
            device,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// The GGUF's `general.name`.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }
    pub(crate) fn rotary(&self) -> &Rotary {
        &self.rotary
    }
    pub(crate) fn weights(&self) -> &Weights {
        &self.weights
    }

    /// An empty state whose first token will be at `first_position`.
    pub(crate) fn empty_state(&self, first_position: u64) -> Result<State, LlmError> {
        let c = &self.config;
        let empty = Tensor::zeros(
            (c.kv_heads, 0, c.head_dim),
            candle_core::DType::F32,
            &self.device,
        )?;
        Ok(State {
            k: vec![empty.clone(); c.layers],
            v: vec![empty; c.layers],
            first_position,
            tokens: 0,
        })
    }

    /// Checks that `tokens` is non-empty, in the vocabulary, and that positions up to
    /// `after + tokens.len()` stay within the model's context.
    pub(crate) fn check_tokens(&self, tokens: &[u32], after: u64) -> Result<(), LlmError> {
        if tokens.is_empty() {
            bad_input!("no tokens");
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.config.vocab) {
            bad_input!(
                "token id {t} is past the vocabulary ({})",
                self.config.vocab
            );
        }
        let end = after.saturating_add(tokens.len() as u64);
        if end > self.config.context as u64 {
            bad_input!(
                "positions up to {end} exceed the model's context of {}",
                self.config.context
            );
        }
        Ok(())
    }

    /// Runs `tokens` on top of `state` (appending their K and V to it).
    pub(crate) fn step(
        &self,
        state: &mut State,
        tokens: &[u32],
        keep: Keep,
    ) -> Result<StepOut, LlmError> {
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.weights.embed.index_select(&ids, 0)?;
        let mut out = StepOut {
            hidden: x.clone(),
            queries: Vec::new(),
            pre_rope_k: Vec::new(),
        };
        let first = state.first_position.saturating_add(state.tokens as u64);
        for (l, block) in self.weights.blocks.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &block.attn_norm, self.config.rms_eps)?;
            let attn = self.attention(block, &h, l, state, first, keep, &mut out)?;
            x = (x + attn)?;
            let h = candle_nn::ops::rms_norm(&x, &block.ffn_norm, self.config.rms_eps)?;
            x = (x + self.mlp(block, &h)?)?;
        }
        state.tokens += tokens.len();
        out.hidden = candle_nn::ops::rms_norm(&x, &self.weights.norm, self.config.rms_eps)?;
        Ok(out)
    }

    /// One layer's attention of `h` (`[t, hidden]`, normed) over the state and itself.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        block: &Block,
        h: &Tensor,
        layer: usize,
        state: &mut State,
        first: u64,
        keep: Keep,
        out: &mut StepOut,
    ) -> Result<Tensor, LlmError> {
        let c = &self.config;
        let (t, d) = (h.dim(0)?, c.head_dim);
        let qkv = h.matmul(&block.wqkv)?;
        // [t, heads, d] -> [heads, t, d]
        let split = |from: usize, heads: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, from * d, heads * d)?
                .reshape((t, heads, d))?
                .transpose(0, 1)?
                .contiguous()
        };
        let q = self.rotary.apply(&split(0, c.heads)?, first)?;
        let k_raw = split(c.heads, c.kv_heads)?;
        let k = self.rotary.apply(&k_raw, first)?;
        let v = split(c.heads + c.kv_heads, c.kv_heads)?;
        if let Some(from) = keep.queries_from {
            out.queries
                .push(q.narrow(1, from, t - from)?.transpose(0, 1)?.contiguous()?);
        }
        if keep.pre_rope_k {
            out.pre_rope_k.push(k_raw);
        }
        let k_all = Tensor::cat(&[&state.k[layer], &k], 1)?;
        let v_all = Tensor::cat(&[&state.v[layer], &v], 1)?;
        // Query head h reads KV head h / (heads / kv_heads).
        let past = k_all.dim(1)? - t;
        let op = Attention::step(past, t, 1.0 / (d as f32).sqrt());
        let o = q.apply_op3_no_bwd(&k_all, &v_all, &op)?;
        let o = o
            .reshape((c.heads, t, d))?
            .transpose(0, 1)?
            .reshape((t, c.heads * d))?;
        state.k[layer] = k_all;
        state.v[layer] = v_all;
        Ok(o.matmul(&block.wo)?)
    }

    /// The SwiGLU MLP: `down(silu(gate h) * up h)`.
    pub(crate) fn mlp(&self, block: &Block, h: &Tensor) -> Result<Tensor, LlmError> {
        let gate = h.matmul(&block.gate)?;
        gate.inplace_op2(&h.matmul(&block.up)?, &SwiGlu)?;
        Ok(gate.matmul(&block.down)?)
    }

    /// Logits `[n, vocab]` of the final-normed hidden states `hidden` (`[n, hidden]`).
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor, LlmError> {
        Ok(hidden.matmul(&self.weights.lm_head)?)
    }
}

/// Splits `[n, x]` rows into at most `STEP`-row pieces.
pub(crate) fn steps(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..n).step_by(STEP).map(move |s| s..(s + STEP).min(n))
}
