//! What `kvc eval` measures: every level of a profile on a dump (size, K/V and attention-output
//! errors, encode and decode speed), next to the minmax baselines.

use std::time::Instant;

use codec_core::{EncodeParams, KvCache, Limits, ProfileMode, Stream, Tensor, TensorMut};

use crate::dump::Dump;
use crate::error::Error;
use crate::metrics::{self, rel_error, rel_error_f64};
use crate::policy::{self, ProfileUse};
use crate::progress::Progress;

/// The minmax baselines `kvc eval` lists after the levels (bits per code).
pub const BASELINE_BITS: [u32; 3] = [8, 4, 3];

/// One method's figures on a dump.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Method, e.g. `kvc level 2 (x0.145)` or `minmax int4`.
    pub name: String,
    /// Stream bytes (every byte, an embedded profile included) times 8 over the elements.
    pub bits_per_element: f64,
    /// K relative error, mean over layers.
    pub k_rel: f64,
    /// V relative error, mean over layers.
    pub v_rel: f64,
    /// Attention-output relative error, mean over layers (NaN without queries).
    pub attn: f64,
    /// K relative error per layer (levels only).
    pub k_rel_layers: Vec<f64>,
    /// V relative error per layer (levels only).
    pub v_rel_layers: Vec<f64>,
    /// Attention-output error per layer (levels of a dump with queries only).
    pub attn_layers: Vec<f64>,
    /// Encode speed in MB/s of f16 (levels only).
    pub encode_mb_s: Option<f64>,
    /// Decode speed in MB/s of f16 (levels only).
    pub decode_mb_s: Option<f64>,
    /// Decode speed of the second decoder ([`SecondDecoder`]) in MB/s of f16 (levels of
    /// [`evaluate_with`] given one only).
    pub second_decode_mb_s: Option<f64>,
    /// Stream size in bytes (levels only).
    pub bytes: Option<usize>,
}

fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        f64::NAN
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

/// K, V and attention errors of a reconstruction `rec` of `d`, per layer; `orig_attn` holds the
/// attention output of the original cache per layer (`None` without queries).
fn errors(d: &Dump, orig_attn: &[Option<Vec<f64>>], rec: &KvCache, name: String, bpe: f64) -> Row {
    let (mut kl, mut vl, mut al) = (Vec::new(), Vec::new(), Vec::new());
    for (l, orig) in orig_attn.iter().enumerate() {
        let (k, v) = (d.kv.k[l].to_f32_vec(), d.kv.v[l].to_f32_vec());
        let (k2, v2) = (rec.k[l].to_f32_vec(), rec.v[l].to_f32_vec());
        kl.push(rel_error(&k, &k2));
        vl.push(rel_error(&v, &v2));
        if let (Some(a), Some(b)) = (orig, metrics::dump_attention_output(d, l, &k2, &v2)) {
            al.push(rel_error_f64(a, &b));
        }
    }
    Row {
        name,
        bits_per_element: bpe,
        k_rel: mean(&kl),
        v_rel: mean(&vl),
        attn: mean(&al),
        k_rel_layers: kl,
        v_rel_layers: vl,
        attn_layers: al,
        encode_mb_s: None,
        decode_mb_s: None,
        second_decode_mb_s: None,
        bytes: None,
    }
}

/// A stream decoded on `threads` threads into a new cache.
fn decode_threads(s: &Stream<'_>, threads: usize) -> Result<KvCache, Error> {
    let h = s.header();
    let mut cache = KvCache::zeros(h.shape, h.dtype, h.meta.clone());
    let (k, v) = (&mut cache.k, &mut cache.v);
    let mut k: Vec<TensorMut<'_>> = k.iter_mut().map(Tensor::as_mut).collect();
    let mut v: Vec<TensorMut<'_>> = v.iter_mut().map(Tensor::as_mut).collect();
    s.decode_range_into_threads(0..h.shape.tokens, &mut k, &mut v, threads)?;
    drop((k, v));
    Ok(cache)
}

/// A second decoder that [`evaluate_with`] runs on every level's stream beside codec-core's
/// (`kvc eval --gpu`: codec-cuda's kernels on a GPU).
pub trait SecondDecoder {
    /// Decodes `stream` and checks that its output is `cpu` (codec-core's decode of the same
    /// stream) bit for bit; the seconds the decode took, or why it failed or differed.
    fn decode_and_compare(
        &mut self,
        stream: &Stream<'_>,
        cpu: &KvCache,
    ) -> Result<f64, Box<dyn std::error::Error + Send + Sync>>;
}

/// Encodes `d` at every level of `profile` (referenced, or self-contained: each stream embeds
/// the profile cut down to its one level), decodes it, and measures; then the minmax baselines
/// at [`BASELINE_BITS`]. The levels are reported to `progress`, one step each.
pub fn evaluate(
    d: &Dump,
    profile: ProfileUse<'_>,
    threads: usize,
    progress: &mut dyn Progress,
) -> Result<Vec<Row>, Error> {
    evaluate_with(d, profile, threads, progress, None)
}

/// [`evaluate`], and with `second` also that decoder on every level's stream: its output
/// must be codec-core's bit for bit (else [`Error::Companion`]), its speed goes into
/// [`Row::second_decode_mb_s`].
pub fn evaluate_with(
    d: &Dump,
    profile: ProfileUse<'_>,
    threads: usize,
    progress: &mut dyn Progress,
    mut second: Option<&mut dyn SecondDecoder>,
) -> Result<Vec<Row>, Error> {
    let orig_attn: Vec<Option<Vec<f64>>> = (0..d.kv.shape.layers as usize)
        .map(|l| {
            metrics::dump_attention_output(d, l, &d.kv.k[l].to_f32_vec(), &d.kv.v[l].to_f32_vec())
        })
        .collect();
    let levels = match profile {
        ProfileUse::Referenced(p) | ProfileUse::SelfContained(p) => p.levels(),
    };
    let mut rows = Vec::new();
    progress.start("levels", levels as u64);
    let run = LevelRun {
        d,
        profile,
        threads,
        orig_attn: &orig_attn,
    };
    for level in 0..levels {
        rows.push(run.row(level, second.as_deref_mut())?);
        progress.step();
    }
    progress.finish();
    rows.extend(
        metrics::baselines_against(d, &BASELINE_BITS, &orig_attn)
            .into_iter()
            .map(|b| Row {
                name: b.name,
                bits_per_element: b.bits_per_element,
                k_rel: b.k_rel,
                v_rel: b.v_rel,
                attn: b.attn,
                k_rel_layers: vec![],
                v_rel_layers: vec![],
                attn_layers: vec![],
                encode_mb_s: None,
                decode_mb_s: None,
                second_decode_mb_s: None,
                bytes: None,
            }),
    );
    Ok(rows)
}

/// What [`evaluate_with`] measures every level against.
struct LevelRun<'a> {
    d: &'a Dump,
    profile: ProfileUse<'a>,
    threads: usize,
    /// The original cache's attention output per layer (`None` without queries).
    orig_attn: &'a [Option<Vec<f64>>],
}

impl LevelRun<'_> {
    /// One level's row: encoded, decoded (and by `second`), timed and measured.
    fn row<'s>(
        &self,
        level: u8,
        second: Option<&mut (dyn SecondDecoder + 's)>,
    ) -> Result<Row, Error> {
        let (d, profile, threads) = (self.d, self.profile, self.threads);
        let full = match profile {
            ProfileUse::Referenced(p) | ProfileUse::SelfContained(p) => p,
        };
        let elements = d.kv.shape.total_elements();
        let f16_mb = elements as f64 * 2.0 / 1e6;
        // The embedded profile is cut before the clock starts: the speed is the codec's.
        let embedded = match profile {
            ProfileUse::SelfContained(p) => Some(policy::self_contained(p, &[level])?),
            ProfileUse::Referenced(_) => None,
        };
        let (mode, reader, levels) = match &embedded {
            Some((p, levels)) => (ProfileMode::Embedded(p), p, levels.clone()),
            None => (ProfileMode::Referenced(full), full, vec![level]),
        };
        let params = EncodeParams {
            levels,
            ..EncodeParams::default()
        };
        let view = d.kv.view();
        let t0 = Instant::now();
        let bytes = codec_core::encode_threads(&view, mode, &params, threads)?;
        let enc_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let stream = Stream::open(&bytes, Some(reader), &Limits::DEFAULT)?;
        let rec = decode_threads(&stream, threads)?;
        let dec_s = t1.elapsed().as_secs_f64();
        let second_s =
            match second {
                Some(dec) => Some(dec.decode_and_compare(&stream, &rec).map_err(|source| {
                    Error::Companion {
                        at: format!("level {level}"),
                        source,
                    }
                })?),
                None => None,
            };
        let bpe = bytes.len() as f64 * 8.0 / elements as f64;
        let name = format!(
            "kvc level {level} (x{})",
            full.level_multipliers()[level as usize]
        );
        let mut row = errors(d, self.orig_attn, &rec, name, bpe);
        row.encode_mb_s = Some(f16_mb / enc_s);
        row.decode_mb_s = Some(f16_mb / dec_s);
        row.second_decode_mb_s = second_s.map(|s| f16_mb / s);
        row.bytes = Some(bytes.len());
        Ok(row)
    }
}
