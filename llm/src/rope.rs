//! The runner's rotary embedding: the GGUF's interleaved (GPT-J) pairing, channel `2i` with
//! `2i + 1` at angle `position * theta^(-2i / head_dim)`, as llama.cpp applies it to GGUF weights.

use candle_core::{Device, Tensor};

/// Rotary tables of one model.
#[derive(Clone, Debug)]
pub(crate) struct Rotary {
    /// `theta^(-2i / head_dim)` for `i < head_dim / 2`, rounded to f32 as an fp32 reference
    /// computes it.
    inv_freq: Vec<f32>,
}

impl Rotary {
    pub fn new(theta: f32, head_dim: usize) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| (f64::from(theta)).powf(-((2 * i) as f64) / head_dim as f64) as f32)
            .collect();
        Rotary { inv_freq }
    }

    /// `cos` and `sin` tables `[n, head_dim / 2]` of `positions`: the angle is the f32 product
    /// `position * inv_freq`, as in an fp32 reference.
    fn tables(
        &self,
        positions: impl ExactSizeIterator<Item = u64>,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (n, half) = (positions.len(), self.inv_freq.len());
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in positions {
            let pos = p as f32;
            for &f in &self.inv_freq {
                let a = f64::from(pos * f);
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), device)?,
            Tensor::from_vec(sin, (n, half), device)?,
        ))
    }

    /// Rotates `x` (`[heads, n, head_dim]`, contiguous) whose rows are positions
    /// `first..first + n`.
    pub fn apply(&self, x: &Tensor, first: u64) -> candle_core::Result<Tensor> {
        let n = x.dim(1)?;
        self.rotate(x, (0..n).map(|i| first + i as u64))
    }

    /// Rotates `x` (`[heads, n, head_dim]`, contiguous) whose rows are at `positions`.
    pub fn apply_at(&self, x: &Tensor, positions: &[u64]) -> candle_core::Result<Tensor> {
        self.rotate(x, positions.iter().copied())
    }

    fn rotate(
        &self,
        x: &Tensor,
        positions: impl ExactSizeIterator<Item = u64>,
    ) -> candle_core::Result<Tensor> {
        let (heads, n, d) = x.dims3()?;
        let (cos, sin) = self.tables(positions, x.device())?;
        let y = candle_nn::rotary_emb::rope_i(&x.reshape((1, heads, n, d))?, &cos, &sin)?;
        y.reshape((heads, n, d))
    }
}
