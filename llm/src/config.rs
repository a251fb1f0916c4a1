//! The model's hyper-parameters, read from the GGUF metadata (`llama.*` keys).

use crate::error::{candle_reason, LlmError};
use candle_core::quantized::gguf_file::{Content, Value};

/// Hyper-parameters of a llama-architecture model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP's hidden layer.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: query head `h` reads KV head
    /// `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Rotary base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Positions the model was trained for.
    pub context: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

fn get<'a>(c: &'a Content, key: &'static str) -> Result<&'a Value, LlmError> {
    c.metadata.get(key).ok_or(LlmError::Metadata {
        key,
        reason: "absent".into(),
    })
}

fn bad(key: &'static str, e: impl ToString) -> LlmError {
    LlmError::Metadata {
        key,
        reason: e.to_string(),
    }
}

/// A positive integer metadata value (GGUF writers use u32 or u64).
fn count(c: &Content, key: &'static str) -> Result<usize, LlmError> {
    let v = get(c, key)?;
    let n = match v {
        Value::U64(n) => *n,
        _ => u64::from(v.to_u32().map_err(|e| bad(key, candle_reason(e)))?),
    };
    match usize::try_from(n) {
        Ok(n) if n > 0 && n <= 1 << 24 => Ok(n),
        _ => Err(bad(key, format!("{n} is not in 1..=2^24"))),
    }
}

/// A positive float metadata value, as the f32 the runner computes with (checked after rounding,
/// so that an f64 out of f32's range is refused, not made infinite or zero).
fn float(c: &Content, key: &'static str) -> Result<f32, LlmError> {
    let v = get(c, key)?;
    let x = match v {
        Value::F64(x) => *x as f32,
        _ => v.to_f32().map_err(|e| bad(key, candle_reason(e)))?,
    };
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(bad(key, format!("{v:?} is not a positive f32")))
    }
}

impl Config {
    /// Reads the hyper-parameters of a `llama` GGUF; `vocab` is the tokenizer's token count.
    pub(crate) fn from_gguf(c: &Content, vocab: usize) -> Result<Self, LlmError> {
        const ARCH: &str = "general.architecture";
        let arch = get(c, ARCH)?
            .to_string()
            .map_err(|e| bad(ARCH, candle_reason(e)))?;
        if arch != "llama" {
            return Err(bad(ARCH, format!("{arch:?}: only \"llama\" is supported")));
        }
        let hidden = count(c, "llama.embedding_length")?;
        let heads = count(c, "llama.attention.head_count")?;
        let kv_heads = count(c, "llama.attention.head_count_kv")?;
        if hidden % heads != 0 || heads % kv_heads != 0 {
            return Err(bad(
                "llama.attention.head_count_kv",
                format!("{hidden} channels, {heads} heads and {kv_heads} KV heads do not divide"),
            ));
        }
        let head_dim = hidden / heads;
        if head_dim % 2 != 0 {
            return Err(bad("llama.embedding_length", "odd head dimension"));
        }
        Ok(Config {
            layers: count(c, "llama.block_count")?,
            hidden,
            ffn: count(c, "llama.feed_forward_length")?,
            heads,
            kv_heads,
            head_dim,
            rope_theta: float(c, "llama.rope.freq_base")?,
            rms_eps: float(c, "llama.attention.layer_norm_rms_epsilon")?,
            context: count(c, "llama.context_length")?,
            vocab,
        })
    }

    /// K or V channels per token and layer: `kv_heads * head_dim`.
    pub fn kv_channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
