//! The model's own tokenizer, built from the GGUF's `tokenizer.ggml.*` metadata (GPT-2 byte-level
//! BPE) with the `tokenizers` crate.

use crate::error::{candle_reason, LlmError};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

/// GGUF token type of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const CONTROL: i32 = 3;

/// Text to token ids and back.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab: usize,
}

fn tok_err(e: impl ToString) -> LlmError {
    LlmError::Tokenizer {
        reason: e.to_string(),
    }
}

/// Most tokens a vocabulary may have (ids are u32; the runner's config allows 2^24).
const MAX_VOCAB: usize = 1 << 24;

/// The pair of merge rule `m` ("a b"), checked to join two tokens into a token (the `tokenizers`
/// crate panics on a merge whose result is longer than every token).
fn merge(m: &str, vocab: &Vocab) -> Result<(String, String), LlmError> {
    let Some((a, b)) = m.split_once(' ') else {
        return Err(tok_err(format!("merge {m:?} is not two tokens")));
    };
    let joined = format!("{a}{b}");
    if let Some(t) = [a, b, &joined].iter().find(|t| !vocab.contains_key(**t)) {
        return Err(tok_err(format!("merge {m:?}: {t:?} is not a token")));
    }
    Ok((a.to_string(), b.to_string()))
}

fn meta<'a>(c: &'a Content, key: &'static str) -> Result<&'a Vec<Value>, LlmError> {
    let v = c.metadata.get(key).ok_or(LlmError::Metadata {
        key,
        reason: "absent".into(),
    })?;
    v.to_vec().map_err(|e| LlmError::Metadata {
        key,
        reason: candle_reason(e),
    })
}

fn strings(c: &Content, key: &'static str) -> Result<Vec<String>, LlmError> {
    meta(c, key)?
        .iter()
        .map(|v| {
            v.to_string().cloned().map_err(|e| LlmError::Metadata {
                key,
                reason: candle_reason(e),
            })
        })
        .collect()
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF whose `tokenizer.ggml.model` is `gpt2`: its tokens, merges
    /// and control tokens; the pre-tokenizer splits digits one by one, then GPT-2's byte-level
    /// split (the SmolLM2 tokenizer's pipeline). No BOS token is added.
    pub(crate) fn from_gguf(c: &Content) -> Result<Self, LlmError> {
        const MODEL: &str = "tokenizer.ggml.model";
        let model = c.metadata.get(MODEL).and_then(|v| v.to_string().ok());
        if model.map(String::as_str) != Some("gpt2") {
            return Err(LlmError::Metadata {
                key: MODEL,
                reason: format!("{model:?}: only GPT-2 byte-level BPE (\"gpt2\") is supported"),
            });
        }
        let tokens = strings(c, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() || tokens.len() > MAX_VOCAB {
            return Err(tok_err(format!(
                "{} tokens is not in 1..=2^24",
                tokens.len()
            )));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        if vocab.len() != tokens.len() {
            return Err(tok_err("tokenizer.ggml.tokens has duplicate tokens"));
        }
        let merges = strings(c, "tokenizer.ggml.merges")?
            .iter()
            .map(|m| merge(m, &vocab))
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre: Vec<PreTokenizerWrapper> = vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let types = meta(c, "tokenizer.ggml.token_type")?;
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|(_, t)| t.to_i32().ok() == Some(CONTROL))
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        Ok(Tokenizer {
            inner,
            vocab: tokens.len(),
        })
    }

    /// The token ids of `text` (no BOS token; control-token strings become their ids).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LlmError> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, LlmError> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(tok_err(format!("token id {bad} is past the vocabulary")));
        }
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}
