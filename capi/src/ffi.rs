//! The C ABI: `extern "C"` functions over `kvc_bind`, the crate's only unsafe code.
//!
//! # Invariants
//!
//! The header (`include/kvc.h`) states the caller's side of the contract; the code relies on it
//! and on nothing else:
//!
//! - **I1** (inputs): a non-null pointer passed with a length (`data`/`len`, a tensor pointer of
//!   a [`kvc_cache`] with its shape and dtype) points to that many readable bytes, which nobody
//!   writes during the call.
//! - **I2** (outputs): a non-null output buffer passed with its capacity in bytes points to that
//!   many writable bytes, which nobody else reads or writes during the call. Overlap *between*
//!   the call's own output buffers is checked here (`check_disjoint`), not assumed.
//! - **I3** (handles): a `kvc_stream*` or `kvc_profile*` is null or was returned by this library
//!   and not yet freed; it is freed at most once, and not while another call uses it.
//! - **I4** (out-params): a non-null out-pointer (`kvc_stream**`, `kvc_stream_info*`, ...)
//!   points to writable storage of its type.
//!
//! Everything else is checked before a slice or reference is made: null pointers, alignment
//! (of elements, pointer arrays, input structs and out-pointers), `len * size` overflow,
//! capacities; out-pointers that receive a handle or bytes before the work, so that a bad one
//! leaks nothing. Each `SAFETY:` comment names the invariant it
//! relies on. No panic unwinds into C: every function runs inside `guard`, which turns a
//! panic into [`KVC_ERR_INTERNAL`] with its message.

use core::ffi::{c_char, c_void};
use std::cell::RefCell;
use std::ffi::{CStr, CString};

use codec_core::{
    DetachedStream, Dtype, EncodeParams, Header, KvMeta, KvShape, KvView, Profile, Queries, Rope,
    RopeStyle, Sample, TensorMut, TensorRef,
};
use half::{bf16, f16};

use kvc_bind::{self as api, Error, ErrorKind, ProfileSource};

/// Success.
pub const KVC_OK: i32 = 0;
/// A caller's argument is invalid (null pointer, unknown dtype, wrong size or alignment,
/// overlapping outputs, a string that is not UTF-8).
pub const KVC_ERR_ARGUMENT: i32 = 1;
/// The stream's header or chunk index is invalid (spec checks H1-H32).
pub const KVC_ERR_HEADER: i32 = 2;
/// A profile's bytes are invalid (spec checks P1-P23).
pub const KVC_ERR_PROFILE: i32 = 3;
/// The profile does not fit the stream (required, another hash or shape, a missing level).
pub const KVC_ERR_PROFILE_MISMATCH: i32 = 4;
/// A chunk is corrupt (spec checks C1-C2, B1-B10).
pub const KVC_ERR_CHUNK: i32 = 5;
/// The output buffers do not match the stream.
pub const KVC_ERR_OUTPUT: i32 = 6;
/// A chunk or token range outside the stream was requested.
pub const KVC_ERR_OUT_OF_RANGE: i32 = 7;
/// The cache or parameters cannot be encoded (or a profile learned from them).
pub const KVC_ERR_ENCODE: i32 = 8;
/// A bug: a panic caught at the boundary.
pub const KVC_ERR_INTERNAL: i32 = 9;

/// IEEE 754 binary16 elements.
pub const KVC_DTYPE_F16: u32 = 0;
/// bfloat16 elements.
pub const KVC_DTYPE_BF16: u32 = 1;
/// IEEE 754 binary32 elements.
pub const KVC_DTYPE_F32: u32 = 2;

/// Rotary pairing: none or unknown.
pub const KVC_ROPE_NONE: u32 = 0;
/// Rotary pairing: NeoX / Llama ("rotate_half").
pub const KVC_ROPE_NEOX: u32 = 1;
/// Rotary pairing: GPT-J (interleaved).
pub const KVC_ROPE_GPTJ: u32 = 2;

/// A parsed stream: the caller's bytes (copied at open), its header, and the profile it was
/// opened with. Opaque to C.
#[derive(Debug)]
pub struct kvc_stream {
    bytes: Vec<u8>,
    /// The given or the embedded profile.
    profile: Profile,
    /// What opening found: each decode attaches `bytes` and `profile` to it in constant time.
    opened: DetachedStream,
}

impl kvc_stream {
    fn header(&self) -> &Header {
        self.opened.header()
    }
}

/// A profile. Opaque to C.
#[derive(Debug)]
pub struct kvc_profile {
    profile: Profile,
}

/// Bytes the library allocated (an encoded stream, a saved profile); free with
/// `kvc_bytes_free`.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_bytes {
    /// The bytes (null when `len` is 0).
    pub data: *mut u8,
    /// Their number.
    pub len: usize,
}

/// What a stream's header says.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_stream_info {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Tokens.
    pub tokens: u32,
    /// The dtype the cache was encoded from (`KVC_DTYPE_*`).
    pub dtype: u32,
    /// Chunks.
    pub chunks: u32,
    /// Tokens per chunk the encoder used (the last chunk may hold fewer).
    pub chunk_tokens: u32,
    /// Levels of the stream's profile (chunk levels index these).
    pub levels: u32,
    /// Tokens per anchor/delta group.
    pub group: u32,
    /// Leading tokens stored exactly.
    pub n_sink: u32,
    /// Absolute position of the first token.
    pub first_position: u64,
    /// 1 if the stream embeds its profile, 0 if it references one.
    pub profile_embedded: u32,
    /// Rotary pairing (`KVC_ROPE_*`).
    pub rope_style: u32,
    /// Rotary base.
    pub rope_theta: f32,
    /// Rotary position scaling.
    pub rope_scaling: f32,
    /// 1 if K is stored before the rotary embedding.
    pub k_pre_rope: u32,
    /// SHA-256 of the profile the stream decodes with.
    pub profile_hash: [u8; 32],
}

/// One chunk of a stream.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_chunk_info {
    /// Index of its first token.
    pub token_start: u32,
    /// Its tokens.
    pub tokens: u32,
    /// Its level (an index into the stream's profile levels).
    pub level: u32,
    /// Its size in bytes, CRC included.
    pub len_bytes: u32,
}

/// A KV cache in the caller's memory: per layer, K and V `[tokens, kv_heads, head_dim]`,
/// contiguous, one dtype.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_cache {
    /// `KVC_DTYPE_*` of every tensor.
    pub dtype: u32,
    /// Layers: the length of `k` and `v`.
    pub layers: u32,
    /// Tokens.
    pub tokens: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// `layers` pointers to K tensors of `tokens * kv_heads * head_dim` elements.
    pub k: *const *const c_void,
    /// `layers` pointers to V tensors of the same size.
    pub v: *const *const c_void,
}

/// Queries recorded with a cache, which profile learning uses to calibrate steps and token
/// importance: per layer `[n_q, q_heads, head_dim]` f32, query `i` at token `q_start + i`.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_queries {
    /// `layers` pointers to f32 query tensors (null: no queries).
    pub q: *const *const f32,
    /// Queries per layer.
    pub n_q: u32,
    /// Query heads (a multiple of the cache's KV heads).
    pub q_heads: u32,
    /// Token index of the first query.
    pub q_start: u64,
}

/// Encoding parameters; `kvc_encode_params_default` fills in the defaults of `kvc encode`.
#[repr(C)]
#[derive(Debug)]
pub struct kvc_encode_params {
    /// Level of every chunk (0 = finest; default 7), when `levels` is null.
    pub level: u8,
    /// One level per chunk, or null.
    pub levels: *const u8,
    /// Entries of `levels`.
    pub n_levels: usize,
    /// Tokens per chunk (default 1536).
    pub chunk_tokens: u32,
    /// Tokens per anchor/delta group (default 10).
    pub group: u32,
    /// Leading tokens stored exactly (default 1).
    pub sink: u16,
    /// 1: the same steps for every token (`kvc encode --uniform-steps`).
    pub uniform_steps: u8,
    /// With a profile: 1 embeds it (cut to the levels used), 0 references it by hash.
    pub embed_profile: u8,
    /// Model identifier, NUL-terminated UTF-8, or null.
    pub model_id: *const c_char,
    /// Rotary pairing (`KVC_ROPE_*`, default none).
    pub rope_style: u32,
    /// Rotary base (default 10000).
    pub rope_theta: f32,
    /// Rotary position scaling (default 1).
    pub rope_scaling: f32,
    /// 1 if K is stored before the rotary embedding.
    pub k_pre_rope: u8,
    /// Absolute position of the first token.
    pub first_position: u64,
}

thread_local! {
    /// The last error of this thread: its message and spec check, NUL-terminated for C.
    static LAST_ERROR: RefCell<(CString, CString)> = RefCell::new(Default::default());
}

fn set_last_error(e: &Error) {
    let text = |s: &str| CString::new(s.replace('\0', " ")).unwrap_or_default();
    let check = e.check.unwrap_or("");
    // `try_with`: during the thread's teardown (a call from another thread-local's destructor)
    // the message is lost rather than panicking in C's frame.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = (text(&e.message), text(check)));
}

/// Runs `f`, records its error for `kvc_last_error_message`, and returns its status; a panic is
/// caught here and becomes `KVC_ERR_INTERNAL`.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> i32 {
    match api::catching_panics(f) {
        Ok(()) => {
            let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = Default::default());
            KVC_OK
        }
        Err(e) => {
            set_last_error(&e);
            e.kind.code()
        }
    }
}

fn dtype(code: u32) -> Result<Dtype, Error> {
    u8::try_from(code)
        .ok()
        .and_then(Dtype::from_code)
        .ok_or_else(|| Error::argument(format!("unknown dtype {code} (0 f16, 1 bf16, 2 f32)")))
}

fn null(what: &str) -> Error {
    Error::argument(format!("{what} is null"))
}

/// The caller's bytes `data[..len]` (null allowed when `len` is 0).
fn bytes_in<'a>(data: *const u8, len: usize, what: &str) -> Result<&'a [u8], Error> {
    if len == 0 {
        return Ok(&[]);
    }
    if data.is_null() {
        return Err(null(what));
    }
    // SAFETY: I1: `data` points to `len` readable bytes, unchanged during the call; `u8` has no
    // alignment requirement; `len` bytes exist, so `len <= isize::MAX`.
    Ok(unsafe { core::slice::from_raw_parts(data, len) })
}

/// `n` pointers from the caller's array `ptrs`.
fn pointers<'a, T>(ptrs: *const *const T, n: usize, what: &str) -> Result<&'a [*const T], Error> {
    if ptrs.is_null() {
        return Err(null(what));
    }
    check_aligned(ptrs as usize, align_of::<*const T>(), what)?;
    // SAFETY: I1: the array holds `n` pointers (the caller's `layers`), readable and unchanged
    // during the call; alignment checked above.
    Ok(unsafe { core::slice::from_raw_parts(ptrs, n) })
}

fn check_aligned(addr: usize, align: usize, what: &str) -> Result<(), Error> {
    if !addr.is_multiple_of(align) {
        return Err(Error::argument(format!(
            "{what} is not aligned to {align} bytes"
        )));
    }
    Ok(())
}

/// Bytes of `len` elements of `dtype`, if that fits a slice.
fn byte_len(dtype: Dtype, len: usize) -> Result<usize, Error> {
    len.checked_mul(dtype.size_bytes())
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| Error::argument("tensor size overflows"))
}

/// A tensor of `len` elements of `dtype` at `ptr`, read-only.
fn tensor_in<'a>(ptr: *const c_void, dtype: Dtype, len: usize) -> Result<TensorRef<'a>, Error> {
    if ptr.is_null() {
        return Err(null("a tensor pointer"));
    }
    byte_len(dtype, len)?;
    check_aligned(ptr as usize, dtype.size_bytes(), "a tensor pointer")?;
    // SAFETY: I1: `ptr` points to `len` readable elements of `dtype` (the cache's shape), not
    // written during the call; aligned (checked); `len * size <= isize::MAX` (checked). `f16`
    // and `bf16` are `repr(transparent)` over `u16`, so every bit pattern is a value.
    Ok(unsafe {
        match dtype {
            Dtype::F16 => TensorRef::F16(core::slice::from_raw_parts(ptr.cast::<f16>(), len)),
            Dtype::Bf16 => TensorRef::Bf16(core::slice::from_raw_parts(ptr.cast::<bf16>(), len)),
            Dtype::F32 => TensorRef::F32(core::slice::from_raw_parts(ptr.cast::<f32>(), len)),
        }
    })
}

/// Checks that no two of `ranges` (start address, bytes) overlap.
fn check_disjoint(ranges: &mut [(usize, usize)]) -> Result<(), Error> {
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(Error::argument("output buffers overlap"));
        }
    }
    Ok(())
}

/// The caller's output buffers: per layer K and V of `len` elements of `dtype` each, in
/// buffers of `capacity` bytes (at least `len` elements; the first `len` are written).
fn outputs<'a>(
    k: *const *mut c_void,
    v: *const *mut c_void,
    layers: usize,
    dtype: Dtype,
    len: usize,
    capacity: usize,
) -> Result<(Vec<TensorMut<'a>>, Vec<TensorMut<'a>>), Error> {
    let bytes = byte_len(dtype, len)?;
    if capacity < bytes {
        return Err(Error::new(
            ErrorKind::Output,
            format!("output buffers hold {capacity} bytes, the tokens need {bytes}"),
        ));
    }
    // Copied: no view of the caller's pointer arrays stays alive while the output slices exist.
    let ks = pointers(k.cast::<*const c_void>(), layers, "k")?.to_vec();
    let vs = pointers(v.cast::<*const c_void>(), layers, "v")?.to_vec();
    let mut ranges = Vec::with_capacity(2 * layers);
    for &p in ks.iter().chain(&vs) {
        if p.is_null() {
            return Err(null("an output buffer"));
        }
        check_aligned(p as usize, dtype.size_bytes(), "an output buffer")?;
        ranges.push((p as usize, bytes));
    }
    check_disjoint(&mut ranges)?;
    let make = |p: *const c_void| {
        let p = p.cast_mut();
        // SAFETY: I2: `p` points to `capacity >= len * size` writable bytes that nobody else
        // accesses during the call; the call's buffers do not overlap (checked above), so the
        // mutable slices are exclusive; aligned and `len * size <= isize::MAX` (checked).
        unsafe {
            match dtype {
                Dtype::F16 => TensorMut::F16(core::slice::from_raw_parts_mut(p.cast(), len)),
                Dtype::Bf16 => TensorMut::Bf16(core::slice::from_raw_parts_mut(p.cast(), len)),
                Dtype::F32 => TensorMut::F32(core::slice::from_raw_parts_mut(p.cast(), len)),
            }
        }
    };
    Ok((
        ks.iter().map(|&p| make(p)).collect(),
        vs.iter().map(|&p| make(p)).collect(),
    ))
}

/// Checks the caller's out-pointer (not null, aligned): owned results (handles, bytes) check it
/// before they are made, so that a bad one refuses the call instead of leaking them.
fn check_out<T>(out: *mut T, what: &str) -> Result<(), Error> {
    if out.is_null() {
        return Err(null(what));
    }
    check_aligned(out as usize, align_of::<T>(), what)
}

/// Writes `value` to the caller's out-pointer.
fn put<T>(out: *mut T, value: T, what: &str) -> Result<(), Error> {
    check_out(out, what)?;
    // SAFETY: I4: `out` points to writable storage of `T`; aligned (checked). `write` does not
    // drop the old contents, which may be uninitialised.
    unsafe { out.write(value) };
    Ok(())
}

/// The caller's struct at `p` (a cache, queries, parameters), if not null.
fn struct_in<'a, T>(p: *const T, what: &str) -> Result<Option<&'a T>, Error> {
    check_aligned(p as usize, align_of::<T>(), what)?;
    // SAFETY: I4 (read side): a non-null pointer to one of the library's input structs points
    // to a readable value of it; aligned (checked).
    Ok(unsafe { p.as_ref() })
}

/// The stream behind a handle.
fn stream_ref<'a>(s: *const kvc_stream) -> Result<&'a kvc_stream, Error> {
    // SAFETY: I3: `s` is null or a live handle from `kvc_stream_open`, not freed during the
    // call.
    unsafe { s.as_ref() }.ok_or_else(|| null("stream"))
}

/// The profile behind a handle, if not null.
fn profile_opt<'a>(p: *const kvc_profile) -> Option<&'a Profile> {
    // SAFETY: I3: `p` is null or a live handle from this library, not freed during the call.
    unsafe { p.as_ref() }.map(|p| &p.profile)
}

/// A `kvc_bytes` that owns `v` (boxed slice: its capacity is its length).
fn bytes_out(v: Vec<u8>) -> kvc_bytes {
    let len = v.len();
    if len == 0 {
        return kvc_bytes {
            data: core::ptr::null_mut(),
            len: 0,
        };
    }
    let data = Box::into_raw(v.into_boxed_slice()).cast::<u8>();
    kvc_bytes { data, len }
}

/// The caller's cache as a view.
fn cache_view<'a>(c: *const kvc_cache, meta: KvMeta) -> Result<KvView<'a>, Error> {
    let c = struct_in(c, "cache")?.ok_or_else(|| null("cache"))?;
    let dtype = dtype(c.dtype)?;
    let shape = KvShape {
        layers: c.layers,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        tokens: c.tokens,
    };
    let len = shape
        .checked_tensor_len()
        .ok_or_else(|| Error::argument("cache shape overflows"))?;
    let layers = shape.layers as usize;
    let tensors = |p, what| -> Result<Vec<TensorRef<'a>>, Error> {
        pointers(p, layers, what)?
            .iter()
            .map(|&t| tensor_in(t, dtype, len))
            .collect()
    };
    Ok(KvView {
        shape,
        k: tensors(c.k, "k")?,
        v: tensors(c.v, "v")?,
        meta,
    })
}

/// The caller's queries for a cache of `shape`, if any.
fn queries_in<'a>(q: *const kvc_queries, shape: KvShape) -> Result<Option<Queries<'a>>, Error> {
    let Some(q) = struct_in(q, "queries")? else {
        return Ok(None);
    };
    if q.q.is_null() {
        return Ok(None);
    }
    let len = (q.n_q as usize)
        .checked_mul(q.q_heads as usize)
        .and_then(|n| n.checked_mul(shape.head_dim as usize))
        .ok_or_else(|| Error::argument("query shape overflows"))?;
    let per_layer = pointers(q.q, shape.layers as usize, "queries")?
        .iter()
        .map(|&p| match tensor_in(p.cast(), Dtype::F32, len)? {
            TensorRef::F32(s) => Ok(s),
            _ => unreachable!("tensor_in returns the dtype asked for"),
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(Some(Queries {
        q: per_layer,
        q_heads: q.q_heads as usize,
        q_start: q.q_start,
    }))
}

fn encode_params(p: &kvc_encode_params) -> Result<(EncodeParams, KvMeta), Error> {
    let levels = if p.levels.is_null() {
        vec![p.level]
    } else {
        bytes_in(p.levels, p.n_levels, "levels")?.to_vec()
    };
    let model_id = if p.model_id.is_null() {
        String::new()
    } else {
        // SAFETY: I1: a non-null `model_id` is a NUL-terminated string, readable during the call.
        let s = unsafe { CStr::from_ptr(p.model_id) };
        s.to_str()
            .map_err(|_| Error::argument("model_id is not UTF-8"))?
            .to_owned()
    };
    let style = u8::try_from(p.rope_style)
        .ok()
        .and_then(RopeStyle::from_code)
        .ok_or_else(|| Error::argument(format!("unknown rope style {}", p.rope_style)))?;
    let params = EncodeParams {
        chunk_tokens: p.chunk_tokens,
        group: p.group,
        n_sink: p.sink,
        levels,
        token_importance: p.uniform_steps == 0,
    };
    let meta = KvMeta {
        model_id,
        rope: Rope {
            theta: p.rope_theta,
            style,
            scaling: p.rope_scaling,
            k_pre_rope: p.k_pre_rope != 0,
        },
        first_position: p.first_position,
    };
    Ok((params, meta))
}

/// The message of this thread's last failed call, NUL-terminated UTF-8 (empty after a success).
/// Valid until the thread's next `kvc_*` call.
#[no_mangle]
pub extern "C" fn kvc_last_error_message() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().0.as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// The spec check (`"H5"`, `"B7"`, ...) that rejected the input of this thread's last failed
/// call, or an empty string. Valid until the thread's next `kvc_*` call.
#[no_mangle]
pub extern "C" fn kvc_last_error_check() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().1.as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// The name of a status code (`"ok"`, `"Header"`, ...), a static string.
#[no_mangle]
pub extern "C" fn kvc_status_name(status: i32) -> *const c_char {
    let name: &'static CStr = match status {
        KVC_OK => c"ok",
        KVC_ERR_ARGUMENT => c"Argument",
        KVC_ERR_HEADER => c"Header",
        KVC_ERR_PROFILE => c"Profile",
        KVC_ERR_PROFILE_MISMATCH => c"ProfileMismatch",
        KVC_ERR_CHUNK => c"Chunk",
        KVC_ERR_OUTPUT => c"Output",
        KVC_ERR_OUT_OF_RANGE => c"OutOfRange",
        KVC_ERR_ENCODE => c"Encode",
        KVC_ERR_INTERNAL => c"Internal",
        _ => c"unknown",
    };
    name.as_ptr()
}

/// Opens a stream: copies `data[..len]`, checks its header and index and resolves its profile
/// (`profile` for a stream that references one, else null). On success `*out` is a handle to
/// free with `kvc_stream_free`.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_open(
    data: *const u8,
    len: usize,
    profile: *const kvc_profile,
    out: *mut *mut kvc_stream,
) -> i32 {
    guard(|| {
        check_out(out, "out")?;
        let bytes = bytes_in(data, len, "data")?.to_vec();
        // The profile in use (given or embedded) and what opening found, kept: each decode
        // attaches them to the bytes, parsing neither the index nor the profile again.
        let (opened, profile) = {
            let s = api::open(&bytes, profile_opt(profile))?;
            let profile = s.profile().clone();
            (s.detach(), profile)
        };
        let handle = Box::new(kvc_stream {
            bytes,
            profile,
            opened,
        });
        put(out, Box::into_raw(handle), "out")
    })
}

/// Frees a stream handle (null is ignored).
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_free(stream: *mut kvc_stream) {
    if !stream.is_null() {
        // SAFETY: I3: a live handle from `kvc_stream_open` (a `Box`), freed once.
        drop(unsafe { Box::from_raw(stream) });
    }
}

/// Fills `*out` with the stream's header fields.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_inspect(
    stream: *const kvc_stream,
    out: *mut kvc_stream_info,
) -> i32 {
    guard(|| {
        let s = stream_ref(stream)?;
        let h = s.header();
        let info = kvc_stream_info {
            layers: h.shape.layers,
            kv_heads: h.shape.kv_heads,
            head_dim: h.shape.head_dim,
            tokens: h.shape.tokens,
            dtype: u32::from(h.dtype.code()),
            chunks: h.chunks.len() as u32,
            chunk_tokens: h.chunk_tokens,
            levels: u32::from(s.profile.levels()),
            group: u32::from(h.group),
            n_sink: u32::from(h.n_sink),
            first_position: h.meta.first_position,
            profile_embedded: u32::from(h.profile_len > 0),
            rope_style: h.meta.rope.style as u32,
            rope_theta: h.meta.rope.theta,
            rope_scaling: h.meta.rope.scaling,
            k_pre_rope: u32::from(h.meta.rope.k_pre_rope),
            profile_hash: h.profile_hash,
        };
        put(out, info, "out")
    })
}

/// Fills `*out` with chunk `chunk`'s tokens, level and size.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_chunk(
    stream: *const kvc_stream,
    chunk: u32,
    out: *mut kvc_chunk_info,
) -> i32 {
    guard(|| {
        let s = stream_ref(stream)?;
        let e = api::chunk_entry(s.header(), chunk)?;
        let info = kvc_chunk_info {
            token_start: e.token_start,
            tokens: e.tokens,
            level: u32::from(e.level),
            len_bytes: e.len_bytes,
        };
        put(out, info, "out")
    })
}

fn decode_range(
    s: &kvc_stream,
    range: core::ops::Range<u32>,
    out_dtype: u32,
    k: *const *mut c_void,
    v: *const *mut c_void,
    capacity: usize,
) -> Result<(), Error> {
    let dtype = dtype(out_dtype)?;
    let stream = s.opened.attach(&s.bytes, &s.profile)?;
    let shape = s.header().shape;
    if range.start > range.end || range.end > shape.tokens {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!(
                "tokens {}..{} are outside the stream's 0..{}",
                range.start, range.end, shape.tokens
            ),
        ));
    }
    let len = (range.end - range.start) as usize * shape.channels();
    let (mut ks, mut vs) = outputs(k, v, shape.layers as usize, dtype, len, capacity)?;
    api::decode_into(&stream, range, &mut ks, &mut vs)
}

/// Decodes tokens `token_start..token_end` into the caller's buffers: `k` and `v` are arrays of
/// `layers` pointers, each to a buffer of `capacity` bytes holding at least
/// `(token_end - token_start) * kv_heads * head_dim` elements of `dtype` (`KVC_DTYPE_*`; any
/// dtype, values are rounded into it; the stream's own dtype gives its values exactly), laid
/// out `[tokens, kv_heads, head_dim]`. The buffers must not overlap.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_decode(
    stream: *const kvc_stream,
    token_start: u32,
    token_end: u32,
    dtype: u32,
    k: *const *mut c_void,
    v: *const *mut c_void,
    capacity: usize,
) -> i32 {
    guard(|| {
        let s = stream_ref(stream)?;
        decode_range(s, token_start..token_end, dtype, k, v, capacity)
    })
}

/// Decodes chunk `chunk` alone into the caller's buffers, as `kvc_stream_decode` does for the
/// chunk's tokens (`kvc_stream_chunk` gives them).
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_stream_decode_chunk(
    stream: *const kvc_stream,
    chunk: u32,
    dtype: u32,
    k: *const *mut c_void,
    v: *const *mut c_void,
    capacity: usize,
) -> i32 {
    guard(|| {
        let s = stream_ref(stream)?;
        let e = api::chunk_entry(s.header(), chunk)?;
        let range = e.token_start..e.token_start + e.tokens;
        decode_range(s, range, dtype, k, v, capacity)
    })
}

/// Fills `*out` with the defaults of `kvc encode`: level 7, 1536 tokens per chunk, groups of
/// 10, one sink token, token importance on, a given profile referenced, no rotary metadata.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_encode_params_default(out: *mut kvc_encode_params) -> i32 {
    guard(|| {
        let rope = Rope::default();
        let p = kvc_encode_params {
            level: EncodeParams::DEFAULT_LEVEL,
            levels: core::ptr::null(),
            n_levels: 0,
            chunk_tokens: EncodeParams::DEFAULT_CHUNK_TOKENS,
            group: EncodeParams::DEFAULT_GROUP,
            sink: EncodeParams::DEFAULT_SINK,
            uniform_steps: 0,
            embed_profile: 0,
            model_id: core::ptr::null(),
            rope_style: rope.style as u32,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            k_pre_rope: 0,
            first_position: 0,
        };
        put(out, p, "out")
    })
}

/// Encodes `cache` into a stream in `*out` (free it with `kvc_bytes_free`). With `profile`
/// null, a profile is learned from the cache (and `queries`, if not null) and embedded, as
/// `kvc encode` without `--profile` does; otherwise `profile` is referenced, or embedded if
/// `params->embed_profile`. `params` null means the defaults.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_encode(
    cache: *const kvc_cache,
    queries: *const kvc_queries,
    profile: *const kvc_profile,
    params: *const kvc_encode_params,
    out: *mut kvc_bytes,
) -> i32 {
    guard(|| {
        check_out(out, "out")?;
        let mut defaults = core::mem::MaybeUninit::uninit();
        // SAFETY: `defaults` is writable storage of a `kvc_encode_params` (I4).
        unsafe { kvc_encode_params_default(defaults.as_mut_ptr()) };
        let p = match struct_in(params, "params")? {
            Some(p) => p,
            // SAFETY: `kvc_encode_params_default` wrote every field just above.
            None => unsafe { defaults.assume_init_ref() },
        };
        let (params, meta) = encode_params(p)?;
        let view = cache_view(cache, meta)?;
        let source = match profile_opt(profile) {
            None => ProfileSource::Learn(queries_in(queries, view.shape)?),
            Some(prof) if p.embed_profile != 0 => ProfileSource::Embedded(prof),
            Some(prof) => ProfileSource::Referenced(prof),
        };
        let bytes = api::encode(&view, source, &params)?;
        put(out, bytes_out(bytes), "out")
    })
}

/// Frees bytes the library returned (`data` null is ignored); resets `*bytes` to empty.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_bytes_free(bytes: *mut kvc_bytes) {
    // SAFETY: I4: a non-null `bytes` points to a `kvc_bytes` this library filled in.
    let Some(b) = (unsafe { bytes.as_mut() }) else {
        return;
    };
    if !b.data.is_null() {
        let slice = core::ptr::slice_from_raw_parts_mut(b.data, b.len);
        // SAFETY: I3 for bytes: `data`/`len` came from `bytes_out` (a boxed slice of `len`
        // bytes) and are freed once: the fields are reset below.
        drop(unsafe { Box::from_raw(slice) });
    }
    b.data = core::ptr::null_mut();
    b.len = 0;
}

/// Learns a profile from `n` sample caches (one model's: the same layers, heads and head
/// dimension) with `kvc profile`'s parameters. `queries` is null or an array of `n` entries
/// (an entry with `q` null: that sample has none). `params` is null or gives the samples'
/// rotary settings and first position (its other fields are ignored); learning rotates the
/// mean query with them, so pass those the streams will be encoded with. Free `*out` with
/// `kvc_profile_free`.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_learn(
    samples: *const kvc_cache,
    queries: *const kvc_queries,
    n: usize,
    params: *const kvc_encode_params,
    out: *mut *mut kvc_profile,
) -> i32 {
    guard(|| {
        check_out(out, "out")?;
        let meta = match struct_in(params, "params")? {
            Some(p) => encode_params(p)?.1,
            None => KvMeta::default(),
        };
        if samples.is_null() && n > 0 {
            return Err(null("samples"));
        }
        // Grown as the samples are read, not reserved from the caller's count.
        let mut list = Vec::new();
        for i in 0..n {
            // SAFETY: I1: `samples` (and `queries`, if not null) hold `n` entries; `i < n`.
            let (c, q) = unsafe {
                let q = if queries.is_null() {
                    queries
                } else {
                    queries.add(i)
                };
                (samples.add(i), q)
            };
            let kv = cache_view(c, meta.clone())?;
            let queries = queries_in(q, kv.shape)?;
            list.push(Sample { kv, queries });
        }
        let profile = api::learn(&list)?;
        put(out, Box::into_raw(Box::new(kvc_profile { profile })), "out")
    })
}

/// Reads a profile from its bytes (a `.kvcp` file, or `kvc_profile_save`'s output).
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_load(
    data: *const u8,
    len: usize,
    out: *mut *mut kvc_profile,
) -> i32 {
    guard(|| {
        check_out(out, "out")?;
        let profile = api::load_profile(bytes_in(data, len, "data")?)?;
        put(out, Box::into_raw(Box::new(kvc_profile { profile })), "out")
    })
}

/// The profile's bytes (what a `.kvcp` file holds) in `*out`; free with `kvc_bytes_free`.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_save(profile: *const kvc_profile, out: *mut kvc_bytes) -> i32 {
    guard(|| {
        check_out(out, "out")?;
        let p = profile_opt(profile).ok_or_else(|| null("profile"))?;
        put(out, bytes_out(p.as_bytes().to_vec()), "out")
    })
}

/// The profile's SHA-256 (the hash streams reference it by) into `out[0..32]`.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_hash(profile: *const kvc_profile, out: *mut u8) -> i32 {
    guard(|| {
        let p = profile_opt(profile).ok_or_else(|| null("profile"))?;
        put(out.cast::<[u8; 32]>(), p.hash(), "out")
    })
}

/// The number of levels of the profile.
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_levels(profile: *const kvc_profile, out: *mut u32) -> i32 {
    guard(|| {
        let p = profile_opt(profile).ok_or_else(|| null("profile"))?;
        put(out, u32::from(p.levels()), "out")
    })
}

/// Frees a profile handle (null is ignored).
///
/// # Safety
///
/// The pointers follow the module's invariants I1-I4 (the header's contract).
#[no_mangle]
pub unsafe extern "C" fn kvc_profile_free(profile: *mut kvc_profile) {
    if !profile.is_null() {
        // SAFETY: I3: a live handle from this library (a `Box`), freed once.
        drop(unsafe { Box::from_raw(profile) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let status = guard(|| panic!("boom"));
        assert_eq!(status, KVC_ERR_INTERNAL);
        // SAFETY: the pointer is this thread's NUL-terminated message, read before the next call.
        let msg = unsafe { CStr::from_ptr(kvc_last_error_message()) };
        assert!(msg.to_str().unwrap().contains("boom"));
        assert_eq!(guard(|| Ok(())), KVC_OK);
        // SAFETY: as above.
        assert!(unsafe { CStr::from_ptr(kvc_last_error_message()) }.is_empty());
    }

    #[test]
    fn status_codes_are_the_error_kinds() {
        let codes = [
            KVC_ERR_ARGUMENT,
            KVC_ERR_HEADER,
            KVC_ERR_PROFILE,
            KVC_ERR_PROFILE_MISMATCH,
            KVC_ERR_CHUNK,
            KVC_ERR_OUTPUT,
            KVC_ERR_OUT_OF_RANGE,
            KVC_ERR_ENCODE,
            KVC_ERR_INTERNAL,
        ];
        for (code, kind) in codes.into_iter().zip(ErrorKind::ALL) {
            assert_eq!(code, kind.code());
            // SAFETY: a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(kvc_status_name(code)) };
            assert_eq!(name.to_str().unwrap(), kind.name());
        }
    }

    /// An f32 cache of (layers, tokens, KV heads, head dim), per layer K then V, element `i` of
    /// tensor `t` being `fill(i, t) / 10 - 1`, and the pointers a `kvc_cache` passes.
    struct TestCache {
        shape: (u32, u32, u32, u32),
        data: Vec<Vec<f32>>,
        ptrs: Vec<*const c_void>,
    }

    impl TestCache {
        fn new(shape: (u32, u32, u32, u32), fill: impl Fn(usize, usize) -> f32) -> Self {
            let (layers, tokens, heads, dim) = shape;
            let n = (tokens * heads * dim) as usize;
            let data: Vec<Vec<f32>> = (0..2 * layers as usize)
                .map(|t| (0..n).map(|i| fill(i, t) / 10.0 - 1.0).collect())
                .collect();
            let ptrs = data.iter().map(|d| d.as_ptr().cast()).collect();
            TestCache { shape, data, ptrs }
        }

        /// Elements per tensor.
        fn n(&self) -> usize {
            let (_, tokens, heads, dim) = self.shape;
            (tokens * heads * dim) as usize
        }

        /// The C view, borrowing this cache.
        fn view(&self) -> kvc_cache {
            let (layers, tokens, kv_heads, head_dim) = self.shape;
            kvc_cache {
                dtype: KVC_DTYPE_F32,
                layers,
                tokens,
                kv_heads,
                head_dim,
                k: self.ptrs[..layers as usize].as_ptr(),
                v: self.ptrs[layers as usize..].as_ptr(),
            }
        }
    }

    /// Every corruption of a small stream (each byte flipped, each truncation) through the C
    /// functions gives a status, never a caught panic (`KVC_ERR_INTERNAL`).
    #[test]
    fn damaged_streams_give_statuses_not_panics() {
        let test_cache = TestCache::new((2, 24, 1, 8), |i, t| ((i * 31 + t * 7) % 23) as f32);
        let (cache, n, tokens) = (test_cache.view(), test_cache.n(), test_cache.shape.1);
        let mut profile = core::ptr::null_mut();
        let mut params = core::mem::MaybeUninit::uninit();
        let mut stream = kvc_bytes {
            data: core::ptr::null_mut(),
            len: 0,
        };
        // SAFETY: every pointer is to live local storage of the right type and size (I1-I4).
        unsafe {
            let null = core::ptr::null();
            let rc = kvc_profile_learn(&cache, null, 1, core::ptr::null(), &mut profile);
            assert_eq!(rc, KVC_OK);
            kvc_encode_params_default(params.as_mut_ptr());
            let mut params = params.assume_init();
            params.chunk_tokens = 10;
            let rc = kvc_encode(&cache, null, profile, &params, &mut stream);
            assert_eq!(rc, KVC_OK);
        }
        // SAFETY: `kvc_encode` filled `stream` with `len` bytes.
        let good = unsafe { core::slice::from_raw_parts(stream.data, stream.len) }.to_vec();
        let mut out: Vec<Vec<f32>> = vec![vec![0.0; n]; 4];
        let outs: Vec<*mut c_void> = out.iter_mut().map(|o| o.as_mut_ptr().cast()).collect();
        let try_bytes = |bytes: &[u8]| {
            let mut s = core::ptr::null_mut();
            // SAFETY: `bytes` is live; the outputs hold `n` f32 each and do not overlap.
            unsafe {
                let rc = kvc_stream_open(bytes.as_ptr(), bytes.len(), profile, &mut s);
                assert_ne!(rc, KVC_ERR_INTERNAL);
                if rc == KVC_OK {
                    let (k, v) = (outs[..2].as_ptr(), outs[2..].as_ptr());
                    let rc = kvc_stream_decode(s, 0, tokens, KVC_DTYPE_F32, k, v, n * 4);
                    assert_ne!(rc, KVC_ERR_INTERNAL);
                    for c in 0..4 {
                        let rc = kvc_stream_decode_chunk(s, c, KVC_DTYPE_F16, k, v, n * 4);
                        assert_ne!(rc, KVC_ERR_INTERNAL);
                    }
                }
                kvc_stream_free(s);
            }
        };
        try_bytes(&good);
        for i in 0..good.len() {
            for mask in [0x01, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[i] ^= mask;
                try_bytes(&bad);
            }
            try_bytes(&good[..i]);
        }
        // SAFETY: handles and bytes from this library, freed once.
        unsafe {
            kvc_profile_free(profile);
            kvc_bytes_free(&mut stream);
        }
    }

    /// One handle decoded from four threads at once gives every thread the same values, and
    /// each thread its own last error.
    #[test]
    fn a_stream_decodes_from_several_threads() {
        let test_cache = TestCache::new((3, 64, 2, 8), |i, t| ((i * 13 + t * 5) % 29) as f32);
        let (cache, n, tokens) = (test_cache.view(), test_cache.n(), test_cache.shape.1);
        let mut stream = kvc_bytes {
            data: core::ptr::null_mut(),
            len: 0,
        };
        let mut s = core::ptr::null_mut();
        // SAFETY: live local storage of the right types and sizes (I1-I4).
        unsafe {
            assert_eq!(
                kvc_encode(
                    &cache,
                    core::ptr::null(),
                    core::ptr::null(),
                    core::ptr::null(),
                    &mut stream
                ),
                KVC_OK
            );
            assert_eq!(
                kvc_stream_open(stream.data, stream.len, core::ptr::null(), &mut s),
                KVC_OK
            );
        }
        let handle = s as usize;
        let decode = move || {
            let mut out: Vec<Vec<f32>> = vec![vec![0.0; n]; 6];
            let outs: Vec<*mut c_void> = out.iter_mut().map(|o| o.as_mut_ptr().cast()).collect();
            let s = handle as *const kvc_stream;
            // SAFETY: the handle lives until every thread is joined; outputs are this thread's.
            let rc = unsafe {
                kvc_stream_decode(
                    s,
                    0,
                    tokens,
                    KVC_DTYPE_F32,
                    outs[..3].as_ptr(),
                    outs[3..].as_ptr(),
                    n * 4,
                )
            };
            assert_eq!(rc, KVC_OK);
            // SAFETY: as above; chunk 7 does not exist, the error is this thread's.
            let rc = unsafe {
                kvc_stream_decode_chunk(
                    s,
                    7,
                    KVC_DTYPE_F32,
                    outs[..3].as_ptr(),
                    outs[3..].as_ptr(),
                    n * 4,
                )
            };
            assert_eq!(rc, KVC_ERR_OUT_OF_RANGE);
            out
        };
        let want = decode();
        let threads: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(move || (0..10).map(|_| decode()).collect::<Vec<_>>()))
            .collect();
        for t in threads {
            assert!(t.join().unwrap().iter().all(|got| *got == want));
        }
        // SAFETY: every thread is joined; handle and bytes freed once.
        unsafe {
            kvc_stream_free(s);
            kvc_bytes_free(&mut stream);
        }
    }

    /// A bad out-pointer, a misaligned struct, a cache of no tokens with huge dimensions and an
    /// empty level list are statuses with messages, before anything is made (nothing to leak:
    /// `examples/roundtrip.c` makes the same calls under LeakSanitizer).
    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        let test_cache = TestCache::new((1, 12, 1, 4), |i, t| ((i * 7 + t) % 11) as f32);
        let cache = test_cache.view();
        let (null, no_params) = (core::ptr::null(), core::ptr::null());
        let status = |rc: i32| {
            // SAFETY: this thread's NUL-terminated message, read before its next call.
            let msg = unsafe { CStr::from_ptr(kvc_last_error_message()) };
            (rc, msg.to_str().unwrap().to_owned())
        };
        let mut profile = core::ptr::null_mut();
        let mut defaults = core::mem::MaybeUninit::uninit();
        // SAFETY: live local storage of the right types and sizes (I1-I4).
        let mut params = unsafe {
            kvc_encode_params_default(defaults.as_mut_ptr());
            assert_eq!(
                kvc_profile_learn(&cache, null, 1, no_params, &mut profile),
                KVC_OK
            );
            defaults.assume_init()
        };
        let argument = |what: &str| (KVC_ERR_ARGUMENT, what.to_owned());
        // SAFETY: as above; the null out-pointers are what is being refused.
        unsafe {
            let rc = kvc_encode(&cache, null, profile, &params, core::ptr::null_mut());
            assert_eq!(status(rc), argument("out is null"));
            let rc = kvc_profile_learn(&cache, null, 1, no_params, core::ptr::null_mut());
            assert_eq!(status(rc), argument("out is null"));
            let rc = kvc_profile_save(profile, core::ptr::null_mut());
            assert_eq!(status(rc), argument("out is null"));
        }
        // A cache struct one byte off its alignment: refused, never read.
        let mut bytes = vec![0u8; size_of::<kvc_cache>() + align_of::<kvc_cache>()];
        let at = bytes.as_mut_ptr().align_offset(align_of::<kvc_cache>()) + 1;
        let misaligned = bytes.as_ptr().wrapping_add(at).cast::<kvc_cache>();
        let mut out = kvc_bytes {
            data: core::ptr::null_mut(),
            len: 0,
        };
        // SAFETY: as above; the misaligned pointer is what is being refused.
        let rc = unsafe { kvc_encode(misaligned, null, profile, &params, &mut out) };
        let want = format!("cache is not aligned to {} bytes", align_of::<kvc_cache>());
        assert_eq!(status(rc), argument(&want));
        // No tokens, 2^40 channels: learning would size a profile of them.
        let huge = kvc_cache {
            tokens: 0,
            kv_heads: 1 << 20,
            head_dim: 1 << 20,
            ..cache
        };
        let mut learned = core::ptr::null_mut();
        // SAFETY: `huge` points to no element (0 tokens); the rest as above.
        let rc = unsafe { kvc_profile_learn(&huge, null, 1, no_params, &mut learned) };
        let no_tokens = "no sample tokens given to learn a profile from";
        assert_eq!(status(rc), (KVC_ERR_ENCODE, no_tokens.to_owned()));
        assert!(learned.is_null());
        let levels = [1u8];
        params.levels = levels.as_ptr();
        params.n_levels = 0;
        params.embed_profile = 1;
        // SAFETY: as above (`levels` is read as 0 entries).
        let rc = unsafe { kvc_encode(&cache, null, profile, &params, &mut out) };
        assert_eq!(status(rc).0, KVC_ERR_ENCODE, "{}", status(rc).1);
        assert!(out.data.is_null());
        // SAFETY: the handle from this library, freed once.
        unsafe { kvc_profile_free(profile) };
    }

    /// Each encode path through the C structs gives the stream `kvc_bind::encode` gives for the
    /// same cache and parameters built in Rust: every field of `kvc_encode_params` and
    /// `kvc_queries` reaches the encoder as meant.
    #[test]
    fn c_streams_are_the_rust_api_streams() {
        let test_cache = TestCache::new((2, 40, 2, 8), |i, t| ((i * 17 + t * 3) % 37) as f32);
        let cache = test_cache.view();
        let n_q = 3usize;
        let q_data: Vec<Vec<f32>> = (0..2)
            .map(|l| {
                (0..n_q * 4 * 8)
                    .map(|i| ((i * 7 + l) % 13) as f32 / 6.5 - 1.0)
                    .collect()
            })
            .collect();
        let q_ptrs: Vec<*const f32> = q_data.iter().map(|q| q.as_ptr()).collect();
        let queries = kvc_queries {
            q: q_ptrs.as_ptr(),
            n_q: n_q as u32,
            q_heads: 4,
            q_start: 37,
        };
        let levels = [3u8, 9, 5];
        let mut defaults = core::mem::MaybeUninit::uninit();
        // SAFETY: writable storage of a `kvc_encode_params` (I4).
        let mut params = unsafe {
            kvc_encode_params_default(defaults.as_mut_ptr());
            defaults.assume_init()
        };
        params.levels = levels.as_ptr();
        params.n_levels = levels.len();
        params.chunk_tokens = 16;
        params.group = 4;
        params.sink = 2;
        params.model_id = c"model-x".as_ptr();
        params.rope_style = KVC_ROPE_GPTJ;
        params.rope_theta = 5e5;
        params.rope_scaling = 2.0;
        params.k_pre_rope = 1;
        params.first_position = 1000;
        let rust_params = EncodeParams {
            chunk_tokens: 16,
            group: 4,
            n_sink: 2,
            levels: levels.to_vec(),
            token_importance: true,
        };
        let meta = KvMeta {
            model_id: "model-x".into(),
            rope: Rope {
                theta: 5e5,
                style: RopeStyle::GptJ,
                scaling: 2.0,
                k_pre_rope: true,
            },
            first_position: 1000,
        };
        let (kd, vd) = test_cache.data.split_at(2);
        let view = KvView {
            shape: KvShape {
                layers: 2,
                tokens: 40,
                kv_heads: 2,
                head_dim: 8,
            },
            k: kd.iter().map(|t| TensorRef::F32(t)).collect(),
            v: vd.iter().map(|t| TensorRef::F32(t)).collect(),
            meta,
        };
        let rust_queries = Queries {
            q: q_data.iter().map(Vec::as_slice).collect(),
            q_heads: 4,
            q_start: 37,
        };
        let c_encode = |queries: *const kvc_queries, profile: *const kvc_profile, embed: u8| {
            let mut out = kvc_bytes {
                data: core::ptr::null_mut(),
                len: 0,
            };
            let params = kvc_encode_params {
                embed_profile: embed,
                ..params
            };
            // SAFETY: live local storage of the right types and sizes (I1-I4).
            unsafe {
                assert_eq!(
                    kvc_encode(&cache, queries, profile, &params, &mut out),
                    KVC_OK
                );
                let bytes = core::slice::from_raw_parts(out.data, out.len).to_vec();
                kvc_bytes_free(&mut out);
                bytes
            }
        };
        let learned = api::encode(
            &view,
            ProfileSource::Learn(Some(rust_queries.clone())),
            &rust_params,
        );
        assert_eq!(c_encode(&queries, core::ptr::null(), 0), learned.unwrap());
        let mut profile = core::ptr::null_mut();
        // SAFETY: as above.
        let rc = unsafe { kvc_profile_learn(&cache, &queries, 1, &params, &mut profile) };
        assert_eq!(rc, KVC_OK);
        let samples = [Sample {
            kv: view.clone(),
            queries: Some(rust_queries),
        }];
        let rust_profile = api::learn(&samples).unwrap();
        // SAFETY: a live handle from this library.
        assert_eq!(unsafe { &(*profile).profile }.hash(), rust_profile.hash());
        let referenced = api::encode(
            &view,
            ProfileSource::Referenced(&rust_profile),
            &rust_params,
        );
        assert_eq!(c_encode(core::ptr::null(), profile, 0), referenced.unwrap());
        let embedded = api::encode(&view, ProfileSource::Embedded(&rust_profile), &rust_params);
        assert_eq!(c_encode(core::ptr::null(), profile, 1), embedded.unwrap());
        // SAFETY: the handle from this library, freed once.
        unsafe { kvc_profile_free(profile) };
    }

    #[test]
    fn overlapping_outputs_are_refused() {
        let mut buf = [0u16; 16];
        let p = buf.as_mut_ptr().cast::<c_void>();
        let ks = [p];
        let vs = [p.wrapping_byte_add(8)];
        let r = outputs(ks.as_ptr(), vs.as_ptr(), 1, Dtype::F16, 8, 32);
        assert_eq!(r.unwrap_err().kind, ErrorKind::Argument);
    }
}
