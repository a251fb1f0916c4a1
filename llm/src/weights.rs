//! Loading a GGUF's weights, dequantized to f32, laid out for the layer loop.

use crate::config::Config;
use crate::error::{candle_reason, LlmError};
use candle_core::quantized::gguf_file::Content;
use candle_core::{Device, Tensor};
use std::io::{Read, Seek};
use std::path::Path;

/// One transformer block's weights. Matrices are stored transposed (`[in, out]`) so that a
/// projection is `x.matmul(w)`; Q, K and V are one matrix.
#[derive(Debug)]
pub(crate) struct Block {
    pub attn_norm: Tensor,
    /// `[hidden, (heads + 2 kv_heads) * head_dim]`: Q, then K, then V.
    pub wqkv: Tensor,
    /// `[heads * head_dim, hidden]`.
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    /// `[hidden, ffn]` each (two products, so that each is contiguous for the fused SwiGLU).
    pub gate: Tensor,
    pub up: Tensor,
    /// `[ffn, hidden]`.
    pub down: Tensor,
}

/// All weights of the model.
#[derive(Debug)]
pub(crate) struct Weights {
    /// `[vocab, hidden]`.
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: Tensor,
    /// `[hidden, vocab]` (the embedding, transposed, when the GGUF has no `output.weight`).
    pub lm_head: Tensor,
}

/// Reads tensors of one open GGUF.
struct Reader<'a, R> {
    content: &'a Content,
    file: &'a mut R,
    path: &'a Path,
    device: &'a Device,
}

impl<R: Read + Seek> Reader<'_, R> {
    /// Tensor `name` dequantized to f32, checked to have shape `dims` (candle's order: the GGUF's
    /// dimensions reversed, so a matrix is `[out, in]`) before it is read.
    fn get(&mut self, name: &str, dims: &[usize]) -> Result<Tensor, LlmError> {
        let reason = match self.content.tensor_infos.get(name) {
            None => format!("tensor {name} is missing"),
            Some(t) if t.shape.dims() != dims => {
                format!("tensor {name} has shape {:?}, expected {dims:?}", t.shape)
            }
            Some(_) => {
                let q = self.content.tensor(self.file, name, self.device);
                match q.and_then(|q| q.dequantize(self.device)) {
                    Ok(t) => return Ok(t),
                    Err(e) => format!("tensor {name}: {}", candle_reason(e)),
                }
            }
        };
        Err(LlmError::Gguf {
            path: self.path.to_path_buf(),
            reason,
        })
    }

    /// Matrices `names` (each `[out_i, in]`) stacked along `out` and transposed: `[in, sum out]`.
    fn stacked_t(&mut self, names: &[(String, usize)], inputs: usize) -> Result<Tensor, LlmError> {
        let parts = names
            .iter()
            .map(|(n, out)| self.get(n, &[*out, inputs]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&parts, 0)?.t()?.contiguous()?)
    }
}

impl Weights {
    pub(crate) fn load<R: Read + Seek>(
        content: &Content,
        file: &mut R,
        path: &Path,
        c: &Config,
        device: &Device,
    ) -> Result<Self, LlmError> {
        let mut r = Reader {
            content,
            file,
            path,
            device,
        };
        let (h, d) = (c.hidden, c.head_dim);
        let embed = r.get("token_embd.weight", &[c.vocab, h])?;
        // Not presized: `layers` is the file's word until its tensors are found.
        let mut blocks = Vec::new();
        for i in 0..c.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let qkv = [
                (n("attn_q"), c.heads * d),
                (n("attn_k"), c.kv_heads * d),
                (n("attn_v"), c.kv_heads * d),
            ];
            blocks.push(Block {
                attn_norm: r.get(&n("attn_norm"), &[h])?,
                wqkv: r.stacked_t(&qkv, h)?,
                wo: r.stacked_t(&[(n("attn_output"), h)], c.heads * d)?,
                ffn_norm: r.get(&n("ffn_norm"), &[h])?,
                gate: r.stacked_t(&[(n("ffn_gate"), c.ffn)], h)?,
                up: r.stacked_t(&[(n("ffn_up"), c.ffn)], h)?,
                down: r.stacked_t(&[(n("ffn_down"), h)], c.ffn)?,
            });
        }
        let norm = r.get("output_norm.weight", &[h])?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            r.stacked_t(&[("output.weight".to_string(), c.vocab)], h)?
        } else {
            embed.t()?.contiguous()?
        };
        Ok(Weights {
            embed,
            blocks,
            norm,
            lm_head,
        })
    }
}
