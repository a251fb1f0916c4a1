//! KV dumps: safetensors files in and out, and atomic file output.
//!
//! A dump holds, per layer `i`, `k.{i}` and `v.{i}` shaped `[tokens, kv_heads, head_dim]` in one
//! float dtype (F16, BF16 or F32), optionally `q.{i}` shaped `[n_q, q_heads, head_dim]` (any of
//! those float dtypes), and string metadata (`layers`, `kv_heads`, `q_heads`, `head_dim`,
//! `tokens`, `q_start`, `rope_theta`, `rope_style`, `pre_rope`, `model`, ...).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use codec_core::attention::Heads;
use codec_core::{
    Dtype, KvCache, KvMeta, KvShape, Queries, Rope, RopeStyle, Sample, Tensor, TensorMut,
};
#[cfg(test)]
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;

use crate::output::{Output, OutputError};
use crate::tensorfile::{FileBuffer, Planned};
use crate::tensorread::{Entry, TensorFile};

/// A KV dump loaded from a safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct Dump {
    /// The K/V tensors in the file's dtype, with metadata derived from the file's metadata.
    pub kv: KvCache,
    /// Per layer, the queries `[n_q, q_heads, head_dim]` widened to f32 (`None` if the file has
    /// no `q.{i}` tensors).
    pub q: Option<Vec<Vec<f32>>>,
    /// Query heads (the `q` tensors' second dimension; without queries, the `q_heads` metadata,
    /// else `kv_heads`).
    pub q_heads: usize,
    /// Token position (index into the cache) of the first query.
    pub q_start: u64,
    /// The token ids the cache was computed from (the `tokens` tensor, `[tokens]` U32, written
    /// by `kvc dump`; `None` if the file has none): a multi-level store keeps them so that a
    /// consumer can recompute a chunk from its text.
    pub tokens: Option<Vec<u32>>,
    /// All of the file's metadata, unchanged.
    pub metadata: BTreeMap<String, String>,
}

impl Dump {
    /// Keeps the first `layers` layers of the cache and of the queries (all of them if the
    /// dump has no more), e.g. for a quicker test on a real dump.
    ///
    /// ```
    /// let mut dump = kvc_io::load_dump(&kvc_io::fixtures::sample())?;
    /// dump.keep_layers(2);
    /// assert_eq!((dump.kv.shape.layers, dump.kv.k.len()), (2, 2));
    /// assert_eq!(dump.q.as_ref().map(Vec::len), Some(2));
    /// # Ok::<(), kvc_io::DumpError>(())
    /// ```
    pub fn keep_layers(&mut self, layers: usize) {
        let layers = layers.min(self.kv.shape.layers as usize);
        self.kv.shape.layers = layers as u32;
        self.kv.k.truncate(layers);
        self.kv.v.truncate(layers);
        if let Some(q) = self.q.as_mut() {
            q.truncate(layers);
        }
    }

    /// Number of queries per layer (0 without queries).
    pub fn n_q(&self) -> usize {
        match &self.q {
            Some(q) if !q.is_empty() => {
                let row = self.q_heads * self.kv.shape.head_dim as usize;
                q[0].len().checked_div(row).unwrap_or(0)
            }
            _ => 0,
        }
    }

    /// The heads of the dump's attention (query heads, KV heads, head dimension).
    pub fn heads(&self) -> Heads {
        Heads {
            q_heads: self.q_heads,
            kv_heads: self.kv.shape.kv_heads as usize,
            head_dim: self.kv.shape.head_dim as usize,
        }
    }

    /// The dump as a profile-learning sample: the cache, with its queries when it has them.
    pub fn sample(&self) -> Sample<'_> {
        Sample {
            kv: self.kv.view(),
            queries: self.q.as_ref().map(|q| Queries {
                q: q.iter().map(|l| l.as_slice()).collect(),
                q_heads: self.q_heads,
                q_start: self.q_start,
            }),
        }
    }
}

/// Why a dump could not be read or written.
#[derive(Debug)]
pub enum DumpError {
    /// An I/O operation on `path` failed.
    Io {
        /// The file (or directory) concerned.
        path: PathBuf,
        /// What was being done ("read", "create temporary file", ...).
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The file is not a valid safetensors file.
    NotSafetensors {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        reason: String,
    },
    /// A required tensor is absent.
    MissingTensor {
        /// Name of the tensor.
        name: String,
    },
    /// A tensor has an unsupported element type, or a different one from its siblings.
    WrongDtype {
        /// Name of the tensor.
        name: String,
        /// Its dtype (safetensors spelling).
        dtype: String,
        /// What was expected ("F16, BF16 or F32", or the dtype of `k.0`).
        expected: String,
    },
    /// A tensor has the wrong shape.
    WrongShape {
        /// Name of the tensor.
        name: String,
        /// Its shape.
        got: Vec<usize>,
        /// The expected shape (`0` where any value would be accepted).
        expected: Vec<usize>,
    },
    /// A metadata value is malformed or disagrees with the tensors.
    InconsistentMetadata {
        /// The metadata key.
        key: String,
        /// Its value in the file.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The dump has no `k.0` tensor.
    NoLayers,
    /// The tensors have zero tokens (or zero heads or head dimension).
    Empty {
        /// Which dimension is zero ("tokens", "kv_heads", "head_dim").
        dim: &'static str,
    },
    /// A dimension does not fit the codec's 32-bit limits.
    TooLarge {
        /// Which dimension.
        dim: &'static str,
        /// Its value.
        value: usize,
    },
    /// A cache handed to [`write_dump`] is internally inconsistent.
    InvalidCache {
        /// What is wrong.
        reason: String,
    },
    /// The safetensors serializer failed.
    Serialize {
        /// The serializer's complaint.
        reason: String,
    },
    /// The output file was refused or could not be written.
    Output(OutputError),
}

impl fmt::Display for DumpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DumpError::Io { path, op, source } => {
                write!(f, "{}: {op} failed: {source}", path.display())
            }
            DumpError::NotSafetensors { path, reason } => {
                write!(
                    f,
                    "{}: not a valid safetensors file: {reason}",
                    path.display()
                )
            }
            DumpError::MissingTensor { name } => write!(
                f,
                "missing tensor `{name}` (a KV dump holds k.{{i}} and v.{{i}}, [tokens, \
                 kv_heads, head_dim], for every layer i)"
            ),
            DumpError::WrongDtype {
                name,
                dtype,
                expected,
            } => write!(f, "tensor `{name}` has dtype {dtype}, expected {expected}"),
            DumpError::WrongShape {
                name,
                got,
                expected,
            } => write!(
                f,
                "tensor `{name}` has shape {got:?}, expected {expected:?} (0 = any)"
            ),
            DumpError::InconsistentMetadata { key, value, reason } => {
                write!(f, "metadata `{key}` = {value:?}: {reason}")
            }
            DumpError::NoLayers => write!(
                f,
                "no layers: tensor `k.0` not found (a KV dump holds k.{{i}} and v.{{i}}, \
                 [tokens, kv_heads, head_dim], for every layer i)"
            ),
            DumpError::Empty { dim } => write!(f, "the dump has zero {dim}"),
            DumpError::TooLarge { dim, value } => {
                write!(
                    f,
                    "{dim} = {value} exceeds the supported maximum {}",
                    u32::MAX
                )
            }
            DumpError::InvalidCache { reason } => write!(f, "invalid KV cache: {reason}"),
            DumpError::Serialize { reason } => {
                write!(f, "safetensors serialization failed: {reason}")
            }
            DumpError::Output(e) => e.fmt(f),
        }
    }
}

impl From<OutputError> for DumpError {
    fn from(e: OutputError) -> Self {
        DumpError::Output(e)
    }
}

impl std::error::Error for DumpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DumpError::Io { source, .. } => Some(source),
            // Transparent: its message is this one.
            DumpError::Output(e) => e.source(),
            _ => None,
        }
    }
}

pub(crate) fn io_err(path: &Path, op: &'static str, source: io::Error) -> DumpError {
    DumpError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// The tensor `name` and its dtype, which must be one the codec takes
/// ([`DumpError::WrongDtype`] otherwise).
fn float_tensor<'a>(
    entries: &'a HashMap<String, Entry>,
    name: &str,
) -> Result<(&'a Entry, Dtype), DumpError> {
    let t = tensor(entries, name)?;
    let dtype = codec_dtype(t.dtype()).ok_or_else(|| DumpError::WrongDtype {
        name: name.into(),
        dtype: t.dtype().to_string(),
        expected: FLOAT_DTYPES.into(),
    })?;
    Ok((t, dtype))
}

/// The dtypes a tensor of K, V or queries may have, as errors name them.
const FLOAT_DTYPES: &str = "F16, BF16 or F32";

fn codec_dtype(d: StDtype) -> Option<Dtype> {
    match d {
        StDtype::F16 => Some(Dtype::F16),
        StDtype::BF16 => Some(Dtype::Bf16),
        StDtype::F32 => Some(Dtype::F32),
        _ => None,
    }
}

fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::F16 => StDtype::F16,
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F32 => StDtype::F32,
    }
}

/// Parses metadata `key` as a `T`, if present.
fn parse_meta<T: std::str::FromStr>(
    md: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<T>, DumpError> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<T>()
            .map(Some)
            .map_err(|_| DumpError::InconsistentMetadata {
                key: key.to_string(),
                value: v.clone(),
                reason: format!("not a valid {}", std::any::type_name::<T>()),
            }),
    }
}

/// Checks that metadata `key`, if present, equals `actual`.
fn check_meta_usize(
    md: &BTreeMap<String, String>,
    key: &str,
    actual: usize,
    what: &str,
) -> Result<(), DumpError> {
    if let Some(v) = parse_meta::<usize>(md, key)? {
        if v != actual {
            return Err(DumpError::InconsistentMetadata {
                key: key.to_string(),
                value: md[key].clone(),
                reason: format!("the tensors have {actual} {what}"),
            });
        }
    }
    Ok(())
}

/// The rotary style named by a `rope_style` metadata value.
fn parse_rope_style(s: &str) -> RopeStyle {
    let s = s.trim().to_ascii_lowercase();
    if s.starts_with("rotate_half") || s.contains("neox") {
        RopeStyle::NeoX
    } else if s.contains("interleave") || s.contains("gptj") || s.contains("gpt-j") {
        RopeStyle::GptJ
    } else {
        RopeStyle::None
    }
}

fn rope_style_name(s: RopeStyle) -> &'static str {
    match s {
        RopeStyle::NeoX => "rotate_half",
        RopeStyle::GptJ => "interleaved",
        RopeStyle::None => "none",
    }
}

/// Derives the stream metadata from the file's metadata.
fn kv_meta(md: &BTreeMap<String, String>) -> Result<KvMeta, DumpError> {
    let theta = parse_meta::<f32>(md, "rope_theta")?.unwrap_or(10000.0);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(DumpError::InconsistentMetadata {
            key: "rope_theta".into(),
            value: md["rope_theta"].clone(),
            reason: "must be a positive finite number".into(),
        });
    }
    let scaling = parse_meta::<f32>(md, "rope_scaling")?.unwrap_or(1.0);
    if !(scaling.is_finite() && scaling > 0.0) {
        return Err(DumpError::InconsistentMetadata {
            key: "rope_scaling".into(),
            value: md["rope_scaling"].clone(),
            reason: "must be a positive finite number".into(),
        });
    }
    let style = md
        .get("rope_style")
        .map(|s| parse_rope_style(s))
        .unwrap_or(RopeStyle::None);
    let k_pre_rope = md.get("pre_rope").is_some_and(|s| s.trim() == "1");
    let first_position = parse_meta::<u64>(md, "first_position")?.unwrap_or(0);
    Ok(KvMeta {
        model_id: md.get("model").cloned().unwrap_or_default(),
        rope: Rope {
            theta,
            style,
            scaling,
            k_pre_rope,
        },
        first_position,
    })
}

fn to_u32(dim: &'static str, value: usize) -> Result<u32, DumpError> {
    u32::try_from(value).map_err(|_| DumpError::TooLarge { dim, value })
}

/// Reads a KV dump from a safetensors file (see the module documentation for the layout): the
/// header first, then each tensor from the file straight into its own vector.
///
/// Every malformed input is a [`DumpError`]; nothing in the file can make it panic.
pub fn load_dump(path: &Path) -> Result<Dump, DumpError> {
    let file = fs::File::open(path).map_err(|e| io_err(path, "open", e))?;
    parse(TensorFile::open(path, &file)?)
}

/// Parses a KV dump from the bytes of a safetensors file (`path` is used in errors only).
pub fn parse_dump(path: &Path, bytes: &[u8]) -> Result<Dump, DumpError> {
    parse(TensorFile::from_bytes(path, bytes)?)
}

fn parse(tf: TensorFile<'_>) -> Result<Dump, DumpError> {
    let layers = count_layers(&tf.entries, &tf.metadata)?;
    let (kv_shape, k, v) = read_kv(&tf, layers)?;
    let (q, q_heads, q_start) = read_queries(&tf, kv_shape)?;
    let tokens = read_tokens(&tf, kv_shape.tokens as usize)?;
    let meta = kv_meta(&tf.metadata)?;
    Ok(Dump {
        kv: KvCache {
            shape: kv_shape,
            k,
            v,
            meta,
        },
        q,
        q_heads,
        q_start,
        tokens,
        metadata: tf.metadata,
    })
}

/// Reads `entry`, of the codec's `dtype`, as a tensor.
fn read_tensor(tf: &TensorFile<'_>, dtype: Dtype, entry: &Entry) -> Result<Tensor, DumpError> {
    Ok(match dtype {
        Dtype::F16 => Tensor::F16(tf.read(entry)?),
        Dtype::Bf16 => Tensor::Bf16(tf.read(entry)?),
        Dtype::F32 => Tensor::F32(tf.read(entry)?),
    })
}

/// The `tokens` tensor: `[tokens]` U32 ids, one per cached token (absent: `None`).
fn read_tokens(tf: &TensorFile<'_>, tokens: usize) -> Result<Option<Vec<u32>>, DumpError> {
    let Some(t) = tf.entries.get(TOKENS) else {
        return Ok(None);
    };
    if t.dtype() != StDtype::U32 {
        return Err(DumpError::WrongDtype {
            name: TOKENS.into(),
            dtype: t.dtype().to_string(),
            expected: "U32".into(),
        });
    }
    if t.shape() != [tokens] {
        return Err(DumpError::WrongShape {
            name: TOKENS.into(),
            got: t.shape().to_vec(),
            expected: vec![tokens],
        });
    }
    tf.read(t).map(Some)
}

/// Name of the token-id tensor.
const TOKENS: &str = "tokens";

/// The tensor `name`, or [`DumpError::MissingTensor`].
fn tensor<'a>(entries: &'a HashMap<String, Entry>, name: &str) -> Result<&'a Entry, DumpError> {
    entries.get(name).ok_or_else(|| DumpError::MissingTensor {
        name: name.to_string(),
    })
}

/// The number of layers: the run `k.0`, `k.1`, ... without a gap, agreeing with the `layers`
/// metadata when present.
fn count_layers(
    views: &HashMap<String, Entry>,
    metadata: &BTreeMap<String, String>,
) -> Result<usize, DumpError> {
    let mut layers = 0usize;
    while views.contains_key(&format!("k.{layers}")) {
        layers += 1;
    }
    // A stray k.N beyond the run means k.{layers} is missing.
    let stray = views.keys().any(|n| {
        n.strip_prefix("k.")
            .and_then(|s| s.parse::<usize>().ok())
            .is_some_and(|i| i >= layers)
    });
    if let Some(md_layers) = parse_meta::<usize>(metadata, "layers")? {
        if md_layers > layers {
            return Err(DumpError::MissingTensor {
                name: format!("k.{layers}"),
            });
        }
        if md_layers < layers {
            return Err(DumpError::InconsistentMetadata {
                key: "layers".into(),
                value: metadata["layers"].clone(),
                reason: format!("the file has {layers} layers (k.0..k.{})", layers - 1),
            });
        }
    }
    if stray {
        return Err(DumpError::MissingTensor {
            name: format!("k.{layers}"),
        });
    }
    if layers == 0 {
        return Err(DumpError::NoLayers);
    }
    Ok(layers)
}

/// The K and V tensors of every layer: one float dtype and one `[tokens, kv_heads, head_dim]`
/// shape (that of `k.0`), agreeing with the dimension metadata when present.
fn read_kv(
    tf: &TensorFile<'_>,
    layers: usize,
) -> Result<(KvShape, Vec<Tensor>, Vec<Tensor>), DumpError> {
    let (views, metadata) = (&tf.entries, &tf.metadata);
    let (k0, _) = float_tensor(views, "k.0")?;
    let shape = k0.shape().to_vec();
    if shape.len() != 3 {
        return Err(DumpError::WrongShape {
            name: "k.0".into(),
            got: shape,
            expected: vec![0, 0, 0],
        });
    }
    let (tokens, kv_heads, head_dim) = (shape[0], shape[1], shape[2]);
    for (dim, v) in [
        ("tokens", tokens),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
    ] {
        if v == 0 {
            return Err(DumpError::Empty { dim });
        }
    }
    check_meta_usize(metadata, "tokens", tokens, "tokens")?;
    check_meta_usize(metadata, "kv_heads", kv_heads, "KV heads")?;
    check_meta_usize(metadata, "head_dim", head_dim, "as head dimension")?;
    let kv_shape = KvShape {
        layers: to_u32("layers", layers)?,
        kv_heads: to_u32("kv_heads", kv_heads)?,
        head_dim: to_u32("head_dim", head_dim)?,
        tokens: to_u32("tokens", tokens)?,
    };

    let mut k = Vec::with_capacity(layers);
    let mut v = Vec::with_capacity(layers);
    for i in 0..layers {
        for (kind, out) in [("k", &mut k), ("v", &mut v)] {
            out.push(read_like_k0(tf, &format!("{kind}.{i}"), k0)?);
        }
    }
    Ok((kv_shape, k, v))
}

/// Reads the K or V tensor `name`, which must have `k0`'s dtype and shape.
fn read_like_k0(tf: &TensorFile<'_>, name: &str, k0: &Entry) -> Result<Tensor, DumpError> {
    let (t, dtype) = float_tensor(&tf.entries, name)?;
    if t.dtype() != k0.dtype() {
        return Err(DumpError::WrongDtype {
            name: name.into(),
            dtype: t.dtype().to_string(),
            expected: format!("{} (the dtype of k.0)", k0.dtype()),
        });
    }
    if t.shape() != k0.shape() {
        return Err(DumpError::WrongShape {
            name: name.into(),
            got: t.shape().to_vec(),
            expected: k0.shape().to_vec(),
        });
    }
    read_tensor(tf, dtype, t)
}

/// The queries (all layers or none) widened to f32, the query heads and the first query's
/// position.
#[allow(clippy::type_complexity)]
fn read_queries(
    tf: &TensorFile<'_>,
    kv_shape: KvShape,
) -> Result<(Option<Vec<Vec<f32>>>, usize, u64), DumpError> {
    let (views, metadata) = (&tf.entries, &tf.metadata);
    let (layers, kv_heads, head_dim, tokens) = (
        kv_shape.layers as usize,
        kv_shape.kv_heads as usize,
        kv_shape.head_dim as usize,
        kv_shape.tokens as usize,
    );
    let md_q_heads = parse_meta::<usize>(metadata, "q_heads")?;
    let md_q_start = parse_meta::<u64>(metadata, "q_start")?;
    let any_q = views.keys().any(|n| {
        n.strip_prefix("q.")
            .is_some_and(|s| s.parse::<usize>().is_ok())
    });
    if !any_q {
        let q_heads = md_q_heads.unwrap_or(kv_heads);
        return Ok((None, q_heads, md_q_start.unwrap_or(0)));
    }
    let (qs, q_shape) = read_query_layers(tf, layers, head_dim)?;
    let (n_q, q_heads) = (q_shape[0], q_shape[1]);
    check_meta_usize(metadata, "q_heads", q_heads, "query heads in q.0")?;
    if q_heads % kv_heads != 0 {
        return Err(DumpError::WrongShape {
            name: "q.0".into(),
            got: q_shape.clone(),
            expected: vec![n_q, kv_heads * q_heads.div_ceil(kv_heads), head_dim],
        });
    }
    let q_start = md_q_start.unwrap_or((tokens - n_q.min(tokens)) as u64);
    // Saturating: a q_start near u64::MAX must fail here, not wrap around.
    if q_start.saturating_add(n_q as u64) > tokens as u64 {
        return Err(DumpError::InconsistentMetadata {
            key: "q_start".into(),
            value: metadata
                .get("q_start")
                .cloned()
                .unwrap_or_else(|| "(absent)".into()),
            reason: format!("{n_q} queries from position {q_start} run past the {tokens} tokens"),
        });
    }
    Ok((Some(qs), q_heads, q_start))
}

/// The `layers` query tensors widened to f32, and their one shape `[n_q, q_heads, head_dim]`
/// (`q.0`'s: no dimension zero).
fn read_query_layers(
    tf: &TensorFile<'_>,
    layers: usize,
    head_dim: usize,
) -> Result<(Vec<Vec<f32>>, Vec<usize>), DumpError> {
    let mut qs = Vec::with_capacity(layers);
    let mut q_shape: Vec<usize> = Vec::new();
    for i in 0..layers {
        let name = format!("q.{i}");
        let (t, dtype) = float_tensor(&tf.entries, &name)?;
        let s = t.shape();
        if i == 0 {
            if s.len() != 3 || s[2] != head_dim || s[0] == 0 || s[1] == 0 {
                return Err(DumpError::WrongShape {
                    name,
                    got: s.to_vec(),
                    expected: vec![0, 0, head_dim],
                });
            }
            q_shape = s.to_vec();
        } else if s != q_shape.as_slice() {
            return Err(DumpError::WrongShape {
                name,
                got: s.to_vec(),
                expected: q_shape,
            });
        }
        qs.push(read_tensor(tf, dtype, t)?.to_f32_vec());
    }
    Ok((qs, q_shape))
}

/// Validates a cache before writing it.
fn check_cache(kv: &KvCache) -> Result<(), DumpError> {
    let s = kv.shape;
    let bad = |reason: String| Err(DumpError::InvalidCache { reason });
    if s.layers == 0 {
        return Err(DumpError::NoLayers);
    }
    if s.tokens == 0 {
        return Err(DumpError::Empty { dim: "tokens" });
    }
    if s.kv_heads == 0 {
        return Err(DumpError::Empty { dim: "kv_heads" });
    }
    if s.head_dim == 0 {
        return Err(DumpError::Empty { dim: "head_dim" });
    }
    if kv.k.len() != s.layers as usize || kv.v.len() != s.layers as usize {
        return bad(format!(
            "shape says {} layers but there are {} K and {} V tensors",
            s.layers,
            kv.k.len(),
            kv.v.len()
        ));
    }
    let dtype = kv.dtype();
    let n = s.tensor_len();
    for (kind, ts) in [("k", &kv.k), ("v", &kv.v)] {
        for (i, t) in ts.iter().enumerate() {
            if t.dtype() != dtype {
                return bad(format!(
                    "{kind}.{i} is {} but k.0 is {}",
                    t.dtype().name(),
                    dtype.name()
                ));
            }
            if t.len() != n {
                return bad(format!(
                    "{kind}.{i} has {} elements, the shape needs {n}",
                    t.len()
                ));
            }
        }
    }
    Ok(())
}

/// The metadata [`write_dump`] stores: `metadata`, with the dimensions set from `kv`, and the
/// keys [`load_dump`] derives `kv.meta` from overwritten where they would not reproduce it.
fn output_metadata(
    s: KvShape,
    meta: &KvMeta,
    metadata: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut md = metadata.clone();
    md.insert("layers".into(), s.layers.to_string());
    md.insert("kv_heads".into(), s.kv_heads.to_string());
    md.insert("head_dim".into(), s.head_dim.to_string());
    md.insert("tokens".into(), s.tokens.to_string());

    let current = kv_meta(&md).ok();
    let cur = current.as_ref();
    if cur.map(|m| &m.model_id) != Some(&meta.model_id) {
        if meta.model_id.is_empty() {
            md.remove("model");
        } else {
            md.insert("model".into(), meta.model_id.clone());
        }
    }
    if cur.map(|m| m.rope.theta) != Some(meta.rope.theta) {
        md.insert("rope_theta".into(), format!("{:?}", meta.rope.theta));
    }
    if cur.map(|m| m.rope.scaling) != Some(meta.rope.scaling) {
        md.insert("rope_scaling".into(), format!("{:?}", meta.rope.scaling));
    }
    if cur.map(|m| m.rope.style) != Some(meta.rope.style) {
        md.insert(
            "rope_style".into(),
            rope_style_name(meta.rope.style).to_string(),
        );
    }
    if cur.map(|m| m.rope.k_pre_rope) != Some(meta.rope.k_pre_rope) {
        md.insert(
            "pre_rope".into(),
            if meta.rope.k_pre_rope { "1" } else { "0" }.into(),
        );
    }
    if cur.map(|m| m.first_position) != Some(meta.first_position) {
        md.insert("first_position".into(), meta.first_position.to_string());
    }
    md
}

/// Writes `kv` as a dump (`k.{i}`, `v.{i}` in the cache's dtype) with `metadata` (normally the
/// original file's), atomically: the file appears complete or not at all.
///
/// `layers`, `kv_heads`, `head_dim` and `tokens` are set from the cache. The keys `model`,
/// `rope_theta`, `rope_scaling`, `rope_style`, `pre_rope` and `first_position` are kept as given
/// when they already describe `kv.meta`, and overwritten otherwise, so that [`load_dump`] of the
/// written file returns a cache equal to `kv`. Queries are not written.
pub fn write_dump(
    out: &Output,
    kv: &KvCache,
    metadata: &BTreeMap<String, String>,
) -> Result<(), DumpError> {
    write_tensors(out, kv, Extra::default(), metadata)
}

/// Writes a whole dump: its cache as [`write_dump`] does, and its queries `q.{i}` `[n_q,
/// q_heads, head_dim]` in the cache's dtype with `q_heads` and `q_start` in the metadata, so
/// that [`load_dump`] reads it back.
pub fn write_full_dump(out: &Output, dump: &Dump) -> Result<(), DumpError> {
    let q = dump.q.as_ref().map(|q| (q.as_slice(), dump.q_heads));
    let mut md = dump.metadata.clone();
    if q.is_some() {
        md.insert("q_heads".into(), dump.q_heads.to_string());
        md.insert("q_start".into(), dump.q_start.to_string());
    }
    let extra = Extra {
        queries: q,
        tokens: dump.tokens.as_deref(),
    };
    write_tensors(out, &dump.kv, extra, &md)
}

/// What a dump may hold besides its cache.
#[derive(Default)]
struct Extra<'a> {
    /// Queries per layer (f32, `[n_q, q_heads, head_dim]` row-major) and the query heads.
    queries: Option<(&'a [Vec<f32>], usize)>,
    /// The token ids, one per cached token.
    tokens: Option<&'a [u32]>,
}

fn write_tensors(
    out: &Output,
    kv: &KvCache,
    extra: Extra<'_>,
    metadata: &BTreeMap<String, String>,
) -> Result<(), DumpError> {
    check_cache(kv)?;
    let s = kv.shape;
    let (d, dtype) = (s.head_dim as usize, kv.dtype());
    let mut plan = kv_plan(s, dtype);
    let mut queries = Vec::new();
    if let Some((q, q_heads)) = extra.queries {
        if q.len() != s.layers as usize || q_heads == 0 {
            return Err(DumpError::InvalidCache {
                reason: format!("{} query layers of {q_heads} heads", q.len()),
            });
        }
        for (i, ql) in q.iter().enumerate() {
            let n_q = ql.len() / (q_heads * d);
            if n_q * q_heads * d != ql.len() {
                return Err(DumpError::InvalidCache {
                    reason: format!("layer {i}: {} query values", ql.len()),
                });
            }
            plan.push(Planned {
                name: format!("q.{i}"),
                dtype: st_dtype(dtype),
                shape: vec![n_q, q_heads, d],
            });
            queries.push(Tensor::from_f32(dtype, ql));
        }
    }
    match extra.tokens {
        Some(t) if t.len() != s.tokens as usize => {
            return Err(DumpError::InvalidCache {
                reason: format!("{} token ids for {} tokens", t.len(), s.tokens),
            })
        }
        Some(_) => plan.push(Planned {
            name: TOKENS.to_string(),
            dtype: StDtype::U32,
            shape: vec![s.tokens as usize],
        }),
        None => {}
    }
    let mut file = DumpFile::planned(&plan, s, dtype, output_metadata(s, &kv.meta, metadata))?;
    let mut places = file.buf.tensors_mut().into_iter();
    let kvs = kv.k.iter().zip(&kv.v).flat_map(|(k, v)| [k, v]);
    for (t, place) in kvs.chain(&queries).zip(places.by_ref()) {
        copy_tensor(t, place)?;
    }
    if let (Some(ids), Some(place)) = (extra.tokens, places.next()) {
        let to: &mut [u32] = bytemuck::try_cast_slice_mut(place).map_err(misplaced)?;
        to.copy_from_slice(ids);
    }
    file.write(out)
}

/// The tensors of a cache's dump, in the order [`DumpFile`] hands them out: per layer `k.{i}`
/// then `v.{i}`.
fn kv_plan(s: KvShape, dtype: Dtype) -> Vec<Planned> {
    let shape = vec![s.tokens as usize, s.kv_heads as usize, s.head_dim as usize];
    (0..s.layers)
        .flat_map(|i| [format!("k.{i}"), format!("v.{i}")])
        .map(|name| Planned {
            name,
            dtype: st_dtype(dtype),
            shape: shape.clone(),
        })
        .collect()
}

fn misplaced(e: bytemuck::PodCastError) -> DumpError {
    DumpError::Serialize {
        reason: format!("a tensor's place in the file: {e:?}"),
    }
}

/// The place of a tensor of `dtype` in a [`DumpFile`], as elements.
fn place_as(dtype: Dtype, place: &mut [u8]) -> Result<TensorMut<'_>, DumpError> {
    Ok(match dtype {
        Dtype::F16 => TensorMut::F16(bytemuck::try_cast_slice_mut(place).map_err(misplaced)?),
        Dtype::Bf16 => TensorMut::Bf16(bytemuck::try_cast_slice_mut(place).map_err(misplaced)?),
        Dtype::F32 => TensorMut::F32(bytemuck::try_cast_slice_mut(place).map_err(misplaced)?),
    })
}

/// Copies `t` into its place in a [`DumpFile`] (in the machine's byte order, made
/// little-endian when the file is written).
fn copy_tensor(t: &Tensor, place: &mut [u8]) -> Result<(), DumpError> {
    match (place_as(t.dtype(), place)?, t) {
        (TensorMut::F16(to), Tensor::F16(from)) => to.copy_from_slice(from),
        (TensorMut::Bf16(to), Tensor::Bf16(from)) => to.copy_from_slice(from),
        (TensorMut::F32(to), Tensor::F32(from)) => to.copy_from_slice(from),
        _ => unreachable!("place_as gives the tensor's dtype"),
    }
    Ok(())
}

/// A dump's file built in place, in one buffer: what [`write_dump`] writes for a cache of a
/// given shape, dtype and metadata, with its K and V tensors left for the caller to fill (a
/// decoder writes into them directly), then written once.
///
/// ```
/// use codec_core::{Dtype, KvMeta, KvShape, TensorMut};
/// use kvc_io::dump::DumpFile;
/// # let dir = tempfile::tempdir()?;
/// let shape = KvShape { layers: 2, tokens: 3, kv_heads: 1, head_dim: 4 };
/// let mut file = DumpFile::new(shape, Dtype::F32, &KvMeta::default(), &Default::default())?;
/// let (mut k, _v) = file.kv_mut()?;
/// if let TensorMut::F32(k1) = &mut k[1] {
///     k1[5] = 2.5;
/// }
/// let path = dir.path().join("x.safetensors");
/// file.write(&kvc_io::Output::replacing(&path))?;
/// let back = kvc_io::load_dump(&path)?;
/// assert_eq!(back.kv.k[1].to_f32_vec()[5], 2.5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DumpFile {
    buf: FileBuffer,
    shape: KvShape,
    dtype: Dtype,
}

impl fmt::Debug for DumpFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DumpFile")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("bytes", &self.buf.len())
            .finish()
    }
}

impl DumpFile {
    /// The file of a dump of a `shape` cache of `dtype` with rotary and model metadata `meta`
    /// and the other `metadata` (as [`write_dump`] stores them), every element 0.
    pub fn new(
        shape: KvShape,
        dtype: Dtype,
        meta: &KvMeta,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self, DumpError> {
        let plan = kv_plan(shape, dtype);
        Self::planned(&plan, shape, dtype, output_metadata(shape, meta, metadata))
    }

    fn planned(
        plan: &[Planned],
        shape: KvShape,
        dtype: Dtype,
        metadata: BTreeMap<String, String>,
    ) -> Result<Self, DumpError> {
        let md: HashMap<String, String> = metadata.into_iter().collect();
        let buf = FileBuffer::new(plan, md).map_err(|reason| DumpError::Serialize { reason })?;
        Ok(DumpFile { buf, shape, dtype })
    }

    /// Per layer, the K and V tensors to fill (`[tokens, kv_heads, head_dim]` each).
    pub fn kv_mut(&mut self) -> Result<(Vec<TensorMut<'_>>, Vec<TensorMut<'_>>), DumpError> {
        let layers = self.shape.layers as usize;
        let (mut k, mut v) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
        let dtype = self.dtype;
        for (i, place) in self
            .buf
            .tensors_mut()
            .into_iter()
            .take(2 * layers)
            .enumerate()
        {
            let t = place_as(dtype, place)?;
            if i % 2 == 0 {
                k.push(t)
            } else {
                v.push(t)
            }
        }
        Ok((k, v))
    }

    /// Writes the file to `out` (whole or not at all, see [`Output::write`]).
    pub fn write(self, out: &Output) -> Result<(), DumpError> {
        Ok(self.buf.write(out)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_style_names() {
        assert_eq!(parse_rope_style("rotate_half: j pairs"), RopeStyle::NeoX);
        assert_eq!(parse_rope_style("GPT-NeoX"), RopeStyle::NeoX);
        assert_eq!(parse_rope_style("interleaved"), RopeStyle::GptJ);
        assert_eq!(parse_rope_style("gptj"), RopeStyle::GptJ);
        assert_eq!(parse_rope_style("whatever"), RopeStyle::None);
        for s in [RopeStyle::NeoX, RopeStyle::GptJ, RopeStyle::None] {
            assert_eq!(parse_rope_style(rope_style_name(s)), s);
        }
    }

    /// `safetensors::serialize` of the same tensors, with the header's keys sorted: the file
    /// the writer must produce (an oracle independent of [`FileBuffer`]'s layout).
    /// The file is little-endian whatever the machine (this test also runs on s390x): values
    /// written as little-endian bytes by hand read back as those values, from a file and from
    /// bytes, in every dtype and for the token ids.
    #[test]
    fn reads_little_endian_values_on_every_machine() {
        let vals = [1.5f32, -2.0, 0.25, -0.75];
        let cases: [(StDtype, Dtype, Vec<u8>); 3] = [
            (
                StDtype::F16,
                Dtype::F16,
                vec![0x00, 0x3E, 0x00, 0xC0, 0x00, 0x34, 0x00, 0xBA],
            ),
            (
                StDtype::BF16,
                Dtype::Bf16,
                vec![0xC0, 0x3F, 0x00, 0xC0, 0x80, 0x3E, 0x40, 0xBF],
            ),
            (
                StDtype::F32,
                Dtype::F32,
                vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        ];
        let ids: Vec<u8> = [0x0102_0304u32, 7]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        for (st, dtype, bytes) in cases {
            let shape = vec![2, 1, 2];
            let views = ["k.0", "v.0"]
                .map(|n| {
                    (
                        n.to_string(),
                        TensorView::new(st, shape.clone(), &bytes).unwrap(),
                    )
                })
                .into_iter()
                .chain([(
                    TOKENS.to_string(),
                    TensorView::new(StDtype::U32, vec![2], &ids).unwrap(),
                )])
                .collect();
            let file = serialized(views, BTreeMap::new());
            let dir = std::env::temp_dir().join(format!("kvc-le-{}-{dtype:?}", std::process::id()));
            fs::write(&dir, &file).unwrap();
            for d in [load_dump(&dir).unwrap(), parse_dump(&dir, &file).unwrap()] {
                assert_eq!(d.kv.k[0].dtype(), dtype);
                assert_eq!(d.kv.k[0].to_f32_vec(), vals, "{dtype:?}");
                assert_eq!(d.kv.v[0].to_f32_vec(), vals, "{dtype:?}");
                assert_eq!(d.tokens.as_deref(), Some(&[0x0102_0304, 7][..]));
            }
            fs::remove_file(&dir).unwrap();
        }
    }

    fn serialized(views: Vec<(String, TensorView<'_>)>, md: BTreeMap<String, String>) -> Vec<u8> {
        let raw = safetensors::serialize(views, Some(md.into_iter().collect())).unwrap();
        let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&raw[8..8 + n]).unwrap();
        let mut h = serde_json::to_vec(&header).unwrap();
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(&raw[8 + n..]);
        out
    }

    fn le_bytes(t: &Tensor) -> Vec<u8> {
        match t {
            Tensor::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    #[test]
    fn written_dumps_are_safetensors_own_bytes_in_every_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = load_dump(&crate::fixtures::sample()).unwrap();
        d.keep_layers(2);
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let mut dump = d.clone();
            let convert = |t: &Tensor| Tensor::from_f32(dtype, &t.to_f32_vec()[..]);
            dump.kv.k = dump.kv.k.iter().map(convert).collect();
            dump.kv.v = dump.kv.v.iter().map(convert).collect();
            dump.tokens = Some((0..dump.kv.shape.tokens).map(|i| i * 7 + 1).collect());
            let path = dir.path().join(format!("{dtype:?}.safetensors"));
            write_full_dump(&Output::replacing(&path), &dump).unwrap();
            let got = fs::read(&path).unwrap();

            let s = dump.kv.shape;
            let shape = vec![s.tokens as usize, s.kv_heads as usize, s.head_dim as usize];
            let mut data: Vec<(String, Vec<usize>, StDtype, Vec<u8>)> = Vec::new();
            for i in 0..2 {
                let st = st_dtype(dtype);
                data.push((format!("k.{i}"), shape.clone(), st, le_bytes(&dump.kv.k[i])));
                data.push((format!("v.{i}"), shape.clone(), st, le_bytes(&dump.kv.v[i])));
                let q = &dump.q.as_ref().unwrap()[i];
                let n_q = q.len() / (dump.q_heads * shape[2]);
                let qt = le_bytes(&Tensor::from_f32(dtype, q));
                data.push((format!("q.{i}"), vec![n_q, dump.q_heads, shape[2]], st, qt));
            }
            let ids = dump.tokens.as_ref().unwrap();
            let ids = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
            data.push((TOKENS.into(), vec![s.tokens as usize], StDtype::U32, ids));
            let views = data
                .iter()
                .map(|(n, sh, st, b)| (n.clone(), TensorView::new(*st, sh.clone(), b).unwrap()))
                .collect();
            let mut md = dump.metadata.clone();
            md.insert("q_heads".into(), dump.q_heads.to_string());
            md.insert("q_start".into(), dump.q_start.to_string());
            let want = serialized(views, output_metadata(s, &dump.kv.meta, &md));
            assert!(
                got == want,
                "{dtype:?}: {} vs {} bytes",
                got.len(),
                want.len()
            );
            assert_eq!(load_dump(&path).unwrap().kv, dump.kv);
        }
    }
}
