//! `kvc._native`: the Rust half of the `kvc` Python package. The Python half (`kvc/*.py`)
//! turns whatever the caller passes (numpy arrays, per-layer lists, stacked arrays, DLPack
//! tensors) into contiguous per-layer numpy arrays; this module reads their memory through
//! `__array_interface__` (module `raw`, the only unsafe code), runs the codec with the GIL
//! released, and raises `kvc.KvcError` subclasses, one per [`ErrorKind`].
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod raw;

use codec_core::{
    DetachedStream, Dtype, EncodeParams, Header, KvMeta, KvShape, KvView, Profile, Queries, Rope,
    RopeStyle, Sample, TensorRef,
};
use kvc_bind::{self as api, Error, ErrorKind, ProfileSource};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use raw::{Array, ElemType};

/// The Python exception for `e`: `kvc._errors.<Kind>Error(message)` with `check` (the spec
/// check, e.g. `"H5"`, or `None`) and `spec_class` attributes.
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = py
            .import("kvc._errors")?
            .getattr(format!("{}Error", e.kind.name()))?;
        let inst = cls.call1((e.message.clone(),))?;
        inst.setattr("check", e.check)?;
        inst.setattr("spec_class", e.class)?;
        Ok(PyErr::from_value(inst))
    };
    build().unwrap_or_else(|err| err)
}

/// Runs `f` with the GIL released. A panic inside is caught here and raised as
/// `kvc.InternalError` (pyo3 would raise its `PanicException`, which is no `KvcError`).
fn released<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> Result<T, Error> + Send,
    T: Send,
{
    py.detach(|| api::catching_panics(f))
        .map_err(|e| to_py(py, e))
}

/// `(layers, tokens, kv_heads, head_dim)` as the Python half passes it.
type Shape4 = (u32, u32, u32, u32);

fn kv_shape((layers, tokens, kv_heads, head_dim): Shape4) -> KvShape {
    KvShape {
        layers,
        kv_heads,
        head_dim,
        tokens,
    }
}

/// Per-layer K and V arrays as a cache view (the arrays outlive the view: the caller holds
/// them for the call, raw's A1).
fn view<'a>(
    k: &[Bound<'_, PyAny>],
    v: &[Bound<'_, PyAny>],
    shape: Shape4,
    meta: KvMeta,
) -> Result<KvView<'a>, Error> {
    let shape = kv_shape(shape);
    let len = shape
        .checked_tensor_len()
        .ok_or_else(|| Error::argument("[tokens, kv_heads, head_dim] overflows"))?;
    let tensors = |arrays: &[Bound<'_, PyAny>], what: &str| {
        arrays
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let a = Array::of(a, &format!("{what}[{i}]"), true)?;
                if a.len != len {
                    return Err(Error::argument(format!(
                        "{what}[{i}] holds {} values, [tokens, kv_heads, head_dim] is {len}",
                        a.len
                    )));
                }
                Ok(a.tensor())
            })
            .collect::<Result<Vec<TensorRef<'a>>, Error>>()
    };
    Ok(KvView {
        shape,
        k: tensors(k, "keys")?,
        v: tensors(v, "values")?,
        meta,
    })
}

/// Per-layer f32 query arrays `[n_q, q_heads, head_dim]`.
fn queries<'a>(
    q: Option<&[Bound<'_, PyAny>]>,
    q_heads: usize,
    q_start: u64,
) -> Result<Option<Queries<'a>>, Error> {
    let Some(q) = q else { return Ok(None) };
    let q = q
        .iter()
        .enumerate()
        .map(|(i, a)| Array::of(a, &format!("queries[{i}]"), false)?.f32s("queries"))
        .collect::<Result<Vec<&'a [f32]>, Error>>()?;
    Ok(Some(Queries {
        q,
        q_heads,
        q_start,
    }))
}

/// A rotary style by name (`"none"`, `"neox"`, `"gptj"`).
fn rope_style_code(name: &str) -> Result<RopeStyle, Error> {
    match name {
        "none" => Ok(RopeStyle::None),
        "neox" => Ok(RopeStyle::NeoX),
        "gptj" => Ok(RopeStyle::GptJ),
        _ => Err(Error::argument(format!(
            "rope_style must be none, neox or gptj, got {name:?}"
        ))),
    }
}

/// A profile: the per-model tables a stream is coded with (`kvc.Profile`).
#[pyclass(frozen, name = "Profile", module = "kvc")]
struct PyProfile {
    inner: Profile,
}

/// One sample for `Profile.learn`: keys, values, shape, queries, query heads, first query.
type SampleArgs<'py> = (
    Vec<Bound<'py, PyAny>>,
    Vec<Bound<'py, PyAny>>,
    Shape4,
    Option<Vec<Bound<'py, PyAny>>>,
    usize,
    u64,
);

#[pymethods]
impl PyProfile {
    /// Reads a profile from its bytes (a `.kvcp` file, or `save()`'s output).
    #[staticmethod]
    fn load(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let inner = released(py, || api::load_profile(data))?;
        Ok(PyProfile { inner })
    }

    /// Learns a profile from sample caches of one model, as `kvc profile` does.
    ///
    /// Each sample is `(keys, values)` or `(keys, values, queries, q_start)` (or a
    /// `kvc.Sample`): keys and values per-layer `[T, H, D]` arrays or stacked `[L, T, H, D]`,
    /// queries per-layer float32 `[n_q, q_heads, D]` recorded at tokens `q_start..`, which
    /// calibrate the steps against attention error and enable token importance.
    ///
    /// The rotary settings describe the samples' keys (learning rotates the mean query to where
    /// later queries will read): pass those `kvc.encode` gets.
    #[staticmethod]
    #[pyo3(signature = (samples, *, rope_style="none", rope_theta=10000.0, rope_scaling=1.0,
        k_pre_rope=false, first_position=0))]
    fn learn(
        py: Python<'_>,
        samples: Bound<'_, PyAny>,
        rope_style: &str,
        rope_theta: f32,
        rope_scaling: f32,
        k_pre_rope: bool,
        first_position: u64,
    ) -> PyResult<Self> {
        let style = rope_style_code(rope_style).map_err(|e| to_py(py, e))?;
        let meta = KvMeta {
            model_id: String::new(),
            rope: Rope {
                theta: rope_theta,
                style,
                scaling: rope_scaling,
                k_pre_rope,
            },
            first_position,
        };
        let args: Vec<SampleArgs<'_>> = py
            .import("kvc._arrays")?
            .call_method1("sample_args", (samples,))?
            .extract()?;
        let list = args
            .iter()
            .map(|(k, v, shape, q, q_heads, q_start)| {
                Ok(Sample {
                    kv: view(k, v, *shape, meta.clone())?,
                    queries: queries(q.as_deref(), *q_heads, *q_start)?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()
            .map_err(|e| to_py(py, e))?;
        let inner = released(py, || api::learn(&list))?;
        Ok(PyProfile { inner })
    }

    /// The profile's bytes (what a `.kvcp` file holds).
    fn save<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_bytes())
    }

    /// The profile's SHA-256, the hash a stream references it by.
    fn hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.hash())
    }

    /// The hash in hex.
    fn hash_hex(&self) -> String {
        self.inner.hash_hex()
    }

    /// Levels (0 = finest).
    #[getter]
    fn levels(&self) -> u8 {
        self.inner.levels()
    }

    /// Layers of the model it was learned for.
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers()
    }

    /// KV heads per layer.
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads()
    }

    /// Dimensions per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyProfile>()
            .is_ok_and(|o| o.get().inner.as_bytes() == self.inner.as_bytes())
    }

    fn __hash__(&self) -> u64 {
        let h = self.inner.hash();
        u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "kvc.Profile({} layers x {} KV heads x {} dims, {} levels, hash {})",
            p.layers(),
            p.kv_heads(),
            p.head_dim(),
            p.levels(),
            &p.hash_hex()[..16]
        )
    }

    /// Pickles as its bytes.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        let load = py.get_type::<PyProfile>().getattr("load")?;
        Ok((load, (slf.get().save(py),)))
    }
}

/// Encodes per-layer K and V arrays (see `kvc.encode`).
#[pyfunction]
#[pyo3(signature = (k, v, shape, *, profile, embed, queries, q_heads, q_start, levels,
    chunk_tokens, group, sink, uniform_steps, model_id, rope_style, rope_theta, rope_scaling,
    k_pre_rope, first_position))]
#[allow(clippy::too_many_arguments)]
fn encode<'py>(
    py: Python<'py>,
    k: Vec<Bound<'py, PyAny>>,
    v: Vec<Bound<'py, PyAny>>,
    shape: Shape4,
    profile: Option<Py<PyProfile>>,
    embed: bool,
    queries: Option<Vec<Bound<'py, PyAny>>>,
    q_heads: usize,
    q_start: u64,
    levels: Vec<u8>,
    chunk_tokens: u32,
    group: u32,
    sink: u16,
    uniform_steps: bool,
    model_id: String,
    rope_style: u8,
    rope_theta: f32,
    rope_scaling: f32,
    k_pre_rope: bool,
    first_position: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let e = |e| to_py(py, e);
    let style = RopeStyle::from_code(rope_style)
        .ok_or_else(|| e(Error::argument(format!("unknown rope style {rope_style}"))))?;
    let meta = KvMeta {
        model_id,
        rope: Rope {
            theta: rope_theta,
            style,
            scaling: rope_scaling,
            k_pre_rope,
        },
        first_position,
    };
    let kv = view(&k, &v, shape, meta).map_err(e)?;
    let q = self::queries(queries.as_deref(), q_heads, q_start).map_err(e)?;
    let params = EncodeParams {
        chunk_tokens,
        group,
        n_sink: sink,
        levels,
        token_importance: !uniform_steps,
    };
    let prof = profile.as_ref().map(|p| &p.get().inner);
    let source = match prof {
        None => ProfileSource::Learn(q),
        Some(p) if embed => ProfileSource::Embedded(p),
        Some(p) => ProfileSource::Referenced(p),
    };
    let bytes = released(py, || api::encode(&kv, source, &params))?;
    Ok(PyBytes::new(py, &bytes))
}

/// A parsed stream over the caller's `bytes` (`kvc.Stream` wraps it).
#[pyclass(frozen, name = "_Stream", module = "kvc")]
struct PyStream {
    data: Py<PyBytes>,
    /// The given or the embedded profile: decoding attaches it again, neither parsing it
    /// again nor rebuilding its decode tables.
    profile: Py<PyProfile>,
    /// What opening found: each decode attaches `data` and `profile` to it in constant time.
    opened: DetachedStream,
}

impl PyStream {
    fn header(&self) -> &Header {
        self.opened.header()
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F16 => "float16",
        Dtype::Bf16 => "bfloat16",
        Dtype::F32 => "float32",
    }
}

#[pymethods]
impl PyStream {
    #[new]
    #[pyo3(signature = (data, profile=None))]
    fn new(
        py: Python<'_>,
        data: Bound<'_, PyBytes>,
        profile: Option<Py<PyProfile>>,
    ) -> PyResult<Self> {
        let bytes = data.as_bytes();
        let given = profile.as_ref().map(|p| &p.get().inner);
        let (opened, embedded) = released(py, || {
            let s = api::open(bytes, given)?;
            let embedded = (s.header().profile_len > 0).then(|| s.profile().clone());
            Ok((s.detach(), embedded))
        })?;
        // A stream that references its profile opened only with one given.
        let profile = match embedded {
            Some(inner) => Py::new(py, PyProfile { inner })?,
            None => profile.ok_or_else(|| to_py(py, Error::argument("no profile")))?,
        };
        Ok(PyStream {
            data: data.unbind(),
            profile,
            opened,
        })
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.header().shape.layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.header().shape.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.header().shape.head_dim
    }
    #[getter]
    fn tokens(&self) -> u32 {
        self.header().shape.tokens
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.header().dtype)
    }
    #[getter]
    fn chunk_tokens(&self) -> u32 {
        self.header().chunk_tokens
    }
    #[getter]
    fn group(&self) -> u16 {
        self.header().group
    }
    #[getter]
    fn n_sink(&self) -> u16 {
        self.header().n_sink
    }
    #[getter]
    fn levels(&self) -> u8 {
        self.profile.get().inner.levels()
    }
    #[getter]
    fn first_position(&self) -> u64 {
        self.header().meta.first_position
    }
    #[getter]
    fn model_id(&self) -> &str {
        &self.header().meta.model_id
    }
    #[getter]
    fn rope(&self) -> (&'static str, f32, f32, bool) {
        let r = self.header().meta.rope;
        let style = match r.style {
            RopeStyle::None => "none",
            RopeStyle::NeoX => "neox",
            RopeStyle::GptJ => "gptj",
        };
        (style, r.theta, r.scaling, r.k_pre_rope)
    }
    #[getter]
    fn profile_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.header().profile_hash)
    }
    #[getter]
    fn profile_embedded(&self) -> bool {
        self.header().profile_len > 0
    }
    /// `(token_start, tokens, level, len_bytes)` per chunk.
    #[getter]
    fn chunks(&self) -> Vec<(u32, u32, u8, u32)> {
        let c = &self.header().chunks;
        c.iter()
            .map(|e| (e.token_start, e.tokens, e.level, e.len_bytes))
            .collect()
    }
    #[getter]
    fn nbytes(&self, py: Python<'_>) -> usize {
        self.data.bind(py).as_bytes().len()
    }

    /// Decodes tokens `start..end` into output arrays (writable, contiguous, float16, float32
    /// or uint16 = bf16): for keys and for values, a list of per-layer arrays of `(end - start)
    /// * kv_heads * head_dim` elements each, or one stacked array of all layers' (read once,
    /// where a list costs a read per layer).
    fn decode_into(
        &self,
        py: Python<'_>,
        start: u32,
        end: u32,
        k: Bound<'_, PyAny>,
        v: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let e = |e| to_py(py, e);
        let layers = self.header().shape.layers as usize;
        let mut all = out_arrays(&k, "out keys", layers).map_err(e)?;
        let n_k = all.len();
        all.extend(out_arrays(&v, "out values", layers).map_err(e)?);
        if all.iter().any(|a| matches!(a.dtype, ElemType::U16)) {
            return Err(e(Error::argument(
                "outputs must be float16, float32 or uint16 (bf16)",
            )));
        }
        let mut outs = raw::tensors_mut(&all).map_err(e)?;
        let vs = outs.split_off(n_k);
        let mut ks = outs;
        let mut vs = vs;
        let bytes = self.data.bind(py).as_bytes();
        let profile = &self.profile.get().inner;
        released(py, || {
            let s = self.opened.attach(bytes, profile)?;
            api::decode_into(&s, start..end, &mut ks, &mut vs)
        })
    }
}

/// A decode's output arrays for keys or values: each array of a list or tuple, or a stacked
/// array's `layers` equal parts.
fn out_arrays(obj: &Bound<'_, PyAny>, what: &str, layers: usize) -> Result<Vec<Array>, Error> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items: Vec<Bound<'_, PyAny>> = obj
            .extract()
            .map_err(|_| Error::argument(format!("{what}: not a list of arrays")))?;
        let one = |(i, a): (usize, &Bound<'_, PyAny>)| Array::of(a, &format!("{what}[{i}]"), true);
        return items.iter().enumerate().map(one).collect();
    }
    let stacked = Array::of(obj, what, true)?;
    stacked.split(layers).ok_or_else(|| {
        let n = stacked.len;
        Error::new(
            ErrorKind::Output,
            format!("{what}: {n} elements do not split into the stream's {layers} layers"),
        )
    })
}

/// The error kinds: `(code, name)` in code order (the Python half checks its classes against
/// them).
#[pyfunction]
fn error_kinds() -> Vec<(i32, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (k.code(), k.name()))
        .collect()
}

/// Raises the error of `kind` (for the package's tests of every error class).
#[pyfunction]
fn _raise(py: Python<'_>, kind: i32, message: String) -> PyResult<()> {
    let k = ErrorKind::ALL
        .into_iter()
        .find(|k| k.code() == kind)
        .unwrap_or(ErrorKind::Internal);
    Err(to_py(py, Error::new(k, message)))
}

/// Panics inside the native module, where the codec runs: the panic is caught and raised as
/// `kvc.InternalError` (the package's tests check that, and that the interpreter goes on).
#[pyfunction]
fn _panic(py: Python<'_>) -> PyResult<()> {
    released(py, || -> Result<(), Error> {
        panic!("deliberate panic for the tests")
    })
}

/// PQ token selection: a trained codebook (`kvc.pq.Codebook`).
#[pyclass(frozen, name = "Codebook", module = "kvc.pq")]
struct PyCodebook {
    inner: pq_core::Codebook,
}

fn pq_err(e: pq_core::PqError) -> Error {
    Error::argument(e.to_string())
}

#[pymethods]
impl PyCodebook {
    /// Trains on keys `[n, dim]` float32 (`method` "rq": residual, kvc's default; "pq":
    /// PQCache's product quantization).
    #[staticmethod]
    #[pyo3(signature = (keys, dim, method="rq", m=2, bits=6, max_iters=None, seed=0))]
    #[allow(clippy::too_many_arguments)]
    fn train(
        py: Python<'_>,
        keys: Bound<'_, PyAny>,
        dim: usize,
        method: &str,
        m: usize,
        bits: u8,
        max_iters: Option<u32>,
        seed: u64,
    ) -> PyResult<Self> {
        let mut params = match method {
            "rq" => pq_core::PqParams::default(),
            "pq" => pq_core::PqParams::paper(),
            _ => {
                let msg = format!("unknown PQ method {method:?} (rq or pq)");
                return Err(to_py(py, Error::argument(msg)));
            }
        };
        params.m = m;
        params.b = bits;
        params.seed = seed;
        if let Some(it) = max_iters {
            params.max_iters = it;
        }
        let keys = Array::of(&keys, "keys", false)
            .and_then(|a| a.f32s("keys"))
            .map_err(|e| to_py(py, e))?;
        let inner = released(py, || {
            pq_core::Codebook::train(keys, dim, &params).map_err(pq_err)
        })?;
        Ok(PyCodebook { inner })
    }

    /// Codes of keys `[n, dim]` float32: `n * m` little-endian u16 values, as bytes.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let keys = Array::of(&keys, "keys", false)
            .and_then(|a| a.f32s("keys"))
            .map_err(|e| to_py(py, e))?;
        let codes = released(py, || self.inner.encode(keys).map_err(pq_err))?;
        let bytes: Vec<u8> = codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }

    /// The indices of the tokens to attend to for `query` (`[dim]` float32): the first
    /// `n_init`, the last `n_local`, and the `k` best-scoring others by their codes (uint16
    /// `[n, m]`).
    #[pyo3(signature = (codes, query, k, n_init=4, n_local=64))]
    fn select(
        &self,
        py: Python<'_>,
        codes: Bound<'_, PyAny>,
        query: Bound<'_, PyAny>,
        k: usize,
        n_init: usize,
        n_local: usize,
    ) -> PyResult<Vec<u32>> {
        let codes = Array::of(&codes, "codes", false)
            .and_then(|a| a.u16s("codes"))
            .map_err(|e| to_py(py, e))?;
        let query = Array::of(&query, "query", false)
            .and_then(|a| a.f32s("query"))
            .map_err(|e| to_py(py, e))?;
        released(py, || {
            let table = pq_core::score_table(query, &self.inner).map_err(pq_err)?;
            pq_core::search(codes, &table, k, n_init, n_local).map_err(pq_err)
        })
    }

    /// Key dimension.
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }
    /// Codes per key.
    #[getter]
    fn m(&self) -> usize {
        self.inner.m()
    }
    /// Bits per code.
    #[getter]
    fn bits(&self) -> u8 {
        self.inner.bits()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyProfile>()?;
    m.add_class::<PyStream>()?;
    m.add_class::<PyCodebook>()?;
    m.add_function(wrap_pyfunction!(encode, m)?)?;
    m.add_function(wrap_pyfunction!(error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(_raise, m)?)?;
    m.add_function(wrap_pyfunction!(_panic, m)?)?;
    Ok(())
}
