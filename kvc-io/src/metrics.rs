//! Error metrics (relative error, attention-output error) and the minmax quantization baselines.
//!
//! Attention outputs come from the one attention oracle, [`codec_core::attention`] (`f32`
//! scores, `f64` softmax and weighted sum), the arithmetic profiles are calibrated with.

use codec_core::attention::{self, Heads, Query};
use half::f16;

use crate::dump::Dump;

/// Relative L2 error `||orig - recon|| / ||orig||`, differences taken in `f32` and squares
/// summed in `f64`.
///
/// Returns 0 when both are all-zero and infinity when only `orig` is. Panics if the lengths
/// differ.
pub fn rel_error(orig: &[f32], recon: &[f32]) -> f64 {
    assert_eq!(orig.len(), recon.len(), "rel_error: length mismatch");
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&a, &b) in orig.iter().zip(recon) {
        let d = (a - b) as f64;
        num += d * d;
        den += (a as f64) * (a as f64);
    }
    ratio(num, den)
}

/// [`rel_error`] of `f64` values (attention outputs), all in `f64`.
pub fn rel_error_f64(orig: &[f64], recon: &[f64]) -> f64 {
    assert_eq!(orig.len(), recon.len(), "rel_error_f64: length mismatch");
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&a, &b) in orig.iter().zip(recon) {
        num += (a - b) * (a - b);
        den += a * a;
    }
    ratio(num, den)
}

fn ratio(num: f64, den: f64) -> f64 {
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Causal attention output of a layer's queries (the oracle, `f64`).
///
/// `q` is `[n_q, q_heads, head_dim]`; `k` and `v` are `[tokens, kv_heads, head_dim]`. Query `i`
/// sits at token position `p = q_start + i` and its head `h` reads KV head
/// `h / (q_heads / kv_heads)`; its output is `softmax(q . k[0..=p] / sqrt(head_dim)) . v[0..=p]`.
/// Returns `[n_q, q_heads, head_dim]`.
///
/// Panics if the slice lengths do not match the heads, if `q_heads` is not a multiple of
/// `kv_heads`, or if a query's position is not below `tokens` (a [`Dump`] from the loader
/// always fits).
pub fn attention_output(q: &[f32], heads: Heads, q_start: u64, k: &[f32], v: &[f32]) -> Vec<f64> {
    let row = heads.q_heads * heads.head_dim;
    assert!(row > 0, "attention_output: empty heads {heads:?}");
    let n_q = q.len() / row;
    let queries: Vec<Query> = (0..n_q)
        .map(|i| Query {
            row: i,
            len: usize::try_from(q_start)
                .ok()
                .and_then(|s| s.checked_add(i + 1))
                .unwrap_or(usize::MAX),
        })
        .collect();
    attention::outputs(q, heads, &queries, k, v)
}

/// Relative error of the attention output computed with reconstructed K/V against the original,
/// pooled over all queries and heads of the layer: `||out' - out|| / ||out||`. Arguments as in
/// [`attention_output`]; `orig` and `rec` are `(k, v)`.
pub fn attention_error(
    q: &[f32],
    heads: Heads,
    q_start: u64,
    orig: (&[f32], &[f32]),
    rec: (&[f32], &[f32]),
) -> f64 {
    let a = attention_output(q, heads, q_start, orig.0, orig.1);
    let b = attention_output(q, heads, q_start, rec.0, rec.1);
    rel_error_f64(&a, &b)
}

/// Attention output of `dump`'s queries at `layer` over the given K/V (`[tokens, kv_heads,
/// head_dim]` f32, e.g. a reconstruction). `None` if the dump has no queries.
pub fn dump_attention_output(dump: &Dump, layer: usize, k: &[f32], v: &[f32]) -> Option<Vec<f64>> {
    let q = dump.q.as_ref()?.get(layer)?;
    Some(attention_output(q, dump.heads(), dump.q_start, k, v))
}

/// Minmax quantization round trip: each run of `group` consecutive values (the last one may be
/// shorter) is stored as `bits`-bit codes with a minimum and a scale, both rounded to f16 as a
/// real format would store them: `q = clamp(round((x - min) / scale), 0, 2^bits - 1)`,
/// `x' = min + q * scale`. Costs `bits + 32 / group` bits per element.
///
/// Panics unless `group > 0` and `1 <= bits <= 16`.
pub fn minmax_quantize(x: &[f32], group: usize, bits: u32) -> Vec<f32> {
    assert!(group > 0, "minmax_quantize: group must be positive");
    assert!(
        (1..=16).contains(&bits),
        "minmax_quantize: bits must be 1..=16"
    );
    let levels = ((1u32 << bits) - 1) as f32;
    let mut out = Vec::with_capacity(x.len());
    for chunk in x.chunks(group) {
        let mut lo = f32::INFINITY;
        let mut hi = f32::NEG_INFINITY;
        for &v in chunk {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        let mn = f16::from_f32(lo).to_f32();
        let scale = f16::from_f32((hi - mn) / levels).to_f32();
        if !(scale > 0.0 && scale.is_finite()) {
            out.extend(std::iter::repeat_n(mn, chunk.len()));
            continue;
        }
        for &v in chunk {
            // Clamp, then round half to even by adding and removing 1.5 * 2^23 (exact for
            // values below 2^22, which the clamp guarantees).
            let c = ((v - mn) / scale).clamp(0.0, levels);
            let q = (c + ROUND_MAGIC) - ROUND_MAGIC;
            out.push(mn + q * scale);
        }
    }
    out
}

const ROUND_MAGIC: f32 = 12_582_912.0;

/// One line of the baseline table.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineRow {
    /// Method name, e.g. `minmax int8`.
    pub name: String,
    /// Storage cost in bits per element.
    pub bits_per_element: f64,
    /// K relative error, mean over layers.
    pub k_rel: f64,
    /// V relative error, mean over layers.
    pub v_rel: f64,
    /// Attention-output relative error, mean over layers (NaN if the dump has no queries).
    pub attn: f64,
}

/// Per-token-head minmax baselines (one f16 min and scale per `head_dim` values) at each of
/// `bits`, over the whole dump: K, V and attention errors averaged over layers.
pub fn minmax_baselines(dump: &Dump, bits: &[u32]) -> Vec<BaselineRow> {
    let reference: Vec<Option<Vec<f64>>> = (0..dump.kv.shape.layers as usize)
        .map(|l| {
            let (k, v) = (dump.kv.k[l].to_f32_vec(), dump.kv.v[l].to_f32_vec());
            dump_attention_output(dump, l, &k, &v)
        })
        .collect();
    baselines_against(dump, bits, &reference)
}

/// [`minmax_baselines`] with the attention output of the original cache per layer already
/// computed (`None` without queries).
pub(crate) fn baselines_against(
    dump: &Dump,
    bits: &[u32],
    reference: &[Option<Vec<f64>>],
) -> Vec<BaselineRow> {
    let s = dump.kv.shape;
    let group = s.head_dim as usize;
    let layers = s.layers as usize;
    let mut sums = vec![(0.0f64, 0.0f64, 0.0f64); bits.len()];
    for (l, reference) in reference.iter().enumerate().take(layers) {
        let k = dump.kv.k[l].to_f32_vec();
        let v = dump.kv.v[l].to_f32_vec();
        for (b, sum) in bits.iter().zip(sums.iter_mut()) {
            let kq = minmax_quantize(&k, group, *b);
            let vq = minmax_quantize(&v, group, *b);
            sum.0 += rel_error(&k, &kq);
            sum.1 += rel_error(&v, &vq);
            if let Some(r) = reference {
                let out = dump_attention_output(dump, l, &kq, &vq).unwrap_or_default();
                sum.2 += rel_error_f64(r, &out);
            }
        }
    }
    let n = layers.max(1) as f64;
    let has_queries = dump.n_q() > 0;
    bits.iter()
        .zip(sums)
        .map(|(&b, (ks, vs, at))| BaselineRow {
            name: format!("minmax int{b}"),
            bits_per_element: b as f64 + 32.0 / group as f64,
            k_rel: ks / n,
            v_rel: vs / n,
            attn: if has_queries { at / n } else { f64::NAN },
        })
        .collect()
}
