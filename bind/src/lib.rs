//! # kvc-bind
//!
//! What kvc's bindings share: error kinds with stable codes, the encode policies of the `kvc`
//! command (a profile learned from the cache and embedded with only the levels used, or a given
//! profile referenced or embedded), and decoding into the caller's buffers.
//!
//! The C ABI (`capi/`) and the Python package (`python/`) both call these functions, so a
//! stream written through either is the stream `kvc encode` writes from the same cache and
//! parameters. A crate of its own (no unsafe code, rlib only) so that building one binding
//! never rebuilds the other's libraries.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use core::fmt;
use core::ops::Range;

use codec_core::{
    ChunkEntry, DecodeError, EncodeError, EncodeParams, Header, KvView, LearnParams, Limits,
    Profile, ProfileError, ProfileMode, Queries, Sample, Stream, TensorMut,
};

/// The class of an error; its number is the C ABI's status code (`KVC_ERR_*`) and its name the
/// Python exception's (`kvc.<Name>Error`). Codes are stable: new kinds get new numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorKind {
    /// A caller's argument is invalid: a null pointer, an unknown dtype, a buffer of the wrong
    /// size or alignment, overlapping outputs, a string that is not UTF-8.
    Argument = 1,
    /// The stream's header or chunk index is invalid (`spec/FORMAT.md` §3.7, H1-H32): not a kvc
    /// stream, truncated, a bad CRC, counts over the limits.
    Header = 2,
    /// A profile's bytes are invalid (§4.6, P1-P23), embedded or given.
    Profile = 3,
    /// The profile does not fit the stream (O1-O4): required but not given, another hash,
    /// another shape, a level it lacks.
    ProfileMismatch = 4,
    /// A chunk is corrupt (§5.5, C1-C2, B1-B10).
    Chunk = 5,
    /// The output buffers do not match the stream (count or length).
    Output = 6,
    /// A chunk or token range outside the stream was requested.
    OutOfRange = 7,
    /// The cache or the parameters cannot be encoded (or a profile learned from them).
    Encode = 8,
    /// A bug: a panic caught at the boundary, or an error this version does not classify.
    Internal = 9,
}

impl ErrorKind {
    /// Every kind, in code order.
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::Argument,
        ErrorKind::Header,
        ErrorKind::Profile,
        ErrorKind::ProfileMismatch,
        ErrorKind::Chunk,
        ErrorKind::Output,
        ErrorKind::OutOfRange,
        ErrorKind::Encode,
        ErrorKind::Internal,
    ];

    /// The C status code (non-zero).
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The kind's name, as the Python exception names it (without `Error`).
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::Argument => "Argument",
            ErrorKind::Header => "Header",
            ErrorKind::Profile => "Profile",
            ErrorKind::ProfileMismatch => "ProfileMismatch",
            ErrorKind::Chunk => "Chunk",
            ErrorKind::Output => "Output",
            ErrorKind::OutOfRange => "OutOfRange",
            ErrorKind::Encode => "Encode",
            ErrorKind::Internal => "Internal",
        }
    }
}

/// An error from the bindings: its kind, the library's message, and for rejected input the spec
/// check and class that rejected it (`"H5"`, `"HeaderCrc"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// The class.
    pub kind: ErrorKind,
    /// The message (the library error's `Display`).
    pub message: String,
    /// The spec check that rejected the input (`"H5"`, `"P19"`, `"B7"`), if any.
    pub check: Option<&'static str>,
    /// The spec's error class (`"Truncated"`, `"ChunkCrc"`, ...), or the kind's name.
    pub class: &'static str,
}

impl Error {
    /// An error of `kind` with `message` and no spec check.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            check: None,
            class: kind.name(),
        }
    }

    /// An [`ErrorKind::Argument`] error.
    pub fn argument(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Argument, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Runs `f`; a panic inside is caught and becomes an [`ErrorKind::Internal`] error with the
/// panic's message, so that no panic crosses a binding's boundary.
///
/// ```
/// use kvc_bind::{catching_panics, ErrorKind};
///
/// assert_eq!(catching_panics(|| Ok(7)), Ok(7));
/// let e = catching_panics::<(), _>(|| panic!("bug {}", 1)).unwrap_err();
/// assert_eq!((e.kind, e.message.as_str()), (ErrorKind::Internal, "internal error (panic): bug 1"));
/// ```
pub fn catching_panics<T, F: FnOnce() -> Result<T, Error>>(f: F) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown payload".into());
        Err(Error::new(
            ErrorKind::Internal,
            format!("internal error (panic): {what}"),
        ))
    })
}

impl std::error::Error for Error {}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        let kind = match &e {
            DecodeError::Header(_) => ErrorKind::Header,
            DecodeError::Profile(_) => ErrorKind::Profile,
            DecodeError::Open(_) => ErrorKind::ProfileMismatch,
            DecodeError::Block(_) => ErrorKind::Chunk,
            DecodeError::OutputMismatch { .. } => ErrorKind::Output,
            DecodeError::OutOfRange { .. } => ErrorKind::OutOfRange,
            DecodeError::OtherBytes { .. } => ErrorKind::Argument,
            _ => ErrorKind::Internal,
        };
        Error {
            kind,
            message: e.to_string(),
            check: e.check(),
            class: e.kind(),
        }
    }
}

impl From<ProfileError> for Error {
    fn from(e: ProfileError) -> Self {
        Error {
            kind: ErrorKind::Profile,
            message: e.to_string(),
            check: Some(e.check()),
            class: e.kind(),
        }
    }
}

impl From<EncodeError> for Error {
    fn from(e: EncodeError) -> Self {
        Error::new(ErrorKind::Encode, e.to_string())
    }
}

/// Where an encoded stream's profile comes from.
#[derive(Clone, Debug)]
pub enum ProfileSource<'a> {
    /// Learned from the cache being encoded (with its queries, if given) with the default
    /// parameters, and embedded with only the levels the stream uses: `kvc encode` without
    /// `--profile`.
    Learn(Option<Queries<'a>>),
    /// This profile, referenced by its hash (`kvc encode --profile`), the reader supplies it.
    Referenced(&'a Profile),
    /// This profile, embedded with only the levels the stream uses.
    Embedded(&'a Profile),
}

/// Encodes `kv` with `params`, whose levels name levels of the profile (the full profile's when
/// it is learned or embedded, as `kvc encode --level` does).
pub fn encode(
    kv: &KvView<'_>,
    source: ProfileSource<'_>,
    params: &EncodeParams,
) -> Result<Vec<u8>, Error> {
    if params.levels.is_empty() {
        // codec_core::encode's error, before a profile is learned for nothing.
        return Err(EncodeError::ChunkLevels {
            given: 0,
            tokens: kv.shape.tokens,
            chunk_tokens: params.chunk_tokens,
        }
        .into());
    }
    check_decodable(kv, params.chunk_tokens)?;
    let learned;
    let full = match source {
        ProfileSource::Referenced(p) => {
            return Ok(codec_core::encode(kv, ProfileMode::Referenced(p), params)?);
        }
        ProfileSource::Embedded(p) => p,
        ProfileSource::Learn(queries) => {
            learned = learn(&[Sample {
                kv: kv.clone(),
                queries,
            }])?;
            &learned
        }
    };
    let (cut, levels) = self_contained(full, &params.levels)?;
    let params = EncodeParams {
        levels,
        ..params.clone()
    };
    Ok(codec_core::encode(
        kv,
        ProfileMode::Embedded(&cut),
        &params,
    )?)
}

/// Refuses a cache whose stream the decoders here, which keep to [`Limits::DEFAULT`], would
/// refuse (the encoder has no limits of its own): before its encoding is spent.
fn check_decodable(kv: &KvView<'_>, chunk_tokens: u32) -> Result<(), Error> {
    let (s, l) = (kv.shape, Limits::DEFAULT);
    let chunks = s.tokens.div_ceil(chunk_tokens.max(1));
    let channels = u64::from(s.kv_heads) * u64::from(s.head_dim);
    let elements = [2, u64::from(s.tokens), channels]
        .iter()
        .try_fold(u64::from(s.layers), |n, &f| n.checked_mul(f))
        .unwrap_or(u64::MAX);
    for (what, got, max) in [
        ("layers", u64::from(s.layers), u64::from(l.max_layers)),
        ("channels", channels, u64::from(l.max_channels)),
        ("tokens", u64::from(s.tokens), u64::from(l.max_tokens)),
        ("chunks", u64::from(chunks), u64::from(l.max_chunks)),
        ("elements", elements, l.max_elements),
    ] {
        if got > max {
            let message = format!(
                "the stream would hold {got} {what}: decoders accept at most {max} by default"
            );
            return Err(Error::new(ErrorKind::Encode, message));
        }
    }
    Ok(())
}

/// Learns a profile from samples with the default parameters (what `kvc profile` does).
pub fn learn(samples: &[Sample<'_>]) -> Result<Profile, Error> {
    Ok(codec_core::learn_profile(samples, &LearnParams::default())?)
}

/// `full` cut down to the levels in `levels` (ascending), and `levels` renumbered into it: the
/// profile a self-contained stream embeds (the policy of `kvc_io::policy::self_contained`).
pub fn self_contained(full: &Profile, levels: &[u8]) -> Result<(Profile, Vec<u8>), Error> {
    if levels.is_empty() {
        return Err(Error::new(ErrorKind::Encode, "no level given"));
    }
    let mut used = levels.to_vec();
    used.sort_unstable();
    used.dedup();
    if let Some(&level) = used.iter().find(|&&l| l >= full.levels()) {
        let levels = full.levels();
        return Err(EncodeError::UnknownLevel { level, levels }.into());
    }
    let renumbered = levels
        .iter()
        .map(|l| used.iter().position(|u| u == l).unwrap_or(0) as u8)
        .collect();
    Ok((full.with_levels(&used), renumbered))
}

/// Reads a profile's bytes within the default limits.
pub fn load_profile(bytes: &[u8]) -> Result<Profile, Error> {
    Ok(Profile::from_bytes(bytes, &Limits::DEFAULT)?)
}

/// Opens a stream within the default limits (`profile` for a stream that references one).
pub fn open<'a>(bytes: &'a [u8], profile: Option<&'a Profile>) -> Result<Stream<'a>, Error> {
    Ok(Stream::open(bytes, profile, &Limits::DEFAULT)?)
}

/// Chunk `chunk` of a stream's index.
pub fn chunk_entry(header: &Header, chunk: u32) -> Result<&ChunkEntry, Error> {
    header.chunks.get(chunk as usize).ok_or_else(|| {
        let n = header.chunks.len();
        Error::new(
            ErrorKind::OutOfRange,
            format!("chunk {chunk} is outside the stream ({n} chunks)"),
        )
    })
}

/// Decodes tokens `range` into the caller's per-layer K and V buffers (`range.len() * channels`
/// elements each, any dtype: values are rounded into it).
pub fn decode_into<'o>(
    stream: &Stream<'_>,
    range: Range<u32>,
    k: &mut [TensorMut<'o>],
    v: &mut [TensorMut<'o>],
) -> Result<(), Error> {
    Ok(stream.decode_range_into(range, k, v)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use codec_core::{KvMeta, KvShape, TensorRef};

    fn cache(shape: KvShape) -> (Vec<f32>, Vec<f32>) {
        let n = shape.tensor_len() * shape.layers as usize;
        let k = (0..n)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let v = (0..n)
            .map(|i| ((i * 53) % 97) as f32 / 40.0 - 1.0)
            .collect();
        (k, v)
    }

    fn view<'a>(shape: KvShape, k: &'a [f32], v: &'a [f32]) -> KvView<'a> {
        let n = shape.tensor_len();
        KvView {
            shape,
            k: k.chunks(n).map(TensorRef::F32).collect(),
            v: v.chunks(n).map(TensorRef::F32).collect(),
            meta: KvMeta::default(),
        }
    }

    #[test]
    fn codes_are_distinct_and_named() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.code(), i as i32 + 1);
            assert!(!k.name().is_empty());
        }
    }

    #[test]
    fn learned_streams_embed_the_used_levels_only() {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            tokens: 40,
        };
        let (k, v) = cache(shape);
        let kv = view(shape, &k, &v);
        let params = EncodeParams {
            chunk_tokens: 16,
            levels: vec![7, 2, 7],
            ..EncodeParams::default()
        };
        let bytes = encode(&kv, ProfileSource::Learn(None), &params).unwrap();
        let s = open(&bytes, None).unwrap();
        assert_eq!(s.profile().levels(), 2);
        let levels: Vec<u8> = s.header().chunks.iter().map(|c| c.level).collect();
        assert_eq!(levels, [1, 0, 1]);
        let e = chunk_entry(s.header(), 2).unwrap();
        assert_eq!((e.token_start, e.tokens), (32, 8));
        assert_eq!(
            chunk_entry(s.header(), 3).unwrap_err().kind,
            ErrorKind::OutOfRange
        );
    }

    #[test]
    fn no_level_is_an_encode_error_from_every_source() {
        let shape = KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            tokens: 8,
        };
        let (k, v) = cache(shape);
        let kv = view(shape, &k, &v);
        let profile = learn(&[Sample {
            kv: kv.clone(),
            queries: None,
        }])
        .unwrap();
        let params = EncodeParams {
            levels: vec![],
            ..EncodeParams::default()
        };
        for source in [
            ProfileSource::Learn(None),
            ProfileSource::Referenced(&profile),
            ProfileSource::Embedded(&profile),
        ] {
            let e = encode(&kv, source, &params).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Encode, "{e}");
            assert!(e.message.contains("0 chunk levels"), "{e}");
        }
        let e = self_contained(&profile, &[]).unwrap_err();
        assert_eq!(
            (e.kind, e.message.as_str()),
            (ErrorKind::Encode, "no level given")
        );
    }

    #[test]
    fn streams_the_decoders_would_refuse_are_not_encoded() {
        // Before: encoded, then refused at open (H20: more than 2^20 chunks).
        let shape = KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            tokens: (1 << 20) + 1,
        };
        let (k, v) = cache(shape);
        let params = EncodeParams {
            chunk_tokens: 1,
            ..EncodeParams::default()
        };
        let e = encode(&view(shape, &k, &v), ProfileSource::Learn(None), &params).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Encode);
        assert_eq!(
            e.message,
            "the stream would hold 1048577 chunks: decoders accept at most 1048576 by default"
        );
        // 2^51 elements, each dimension within its limit: refused before any tensor is read.
        let huge = KvShape {
            layers: 1024,
            kv_heads: 256,
            head_dim: 256,
            tokens: 1 << 24,
        };
        let e = encode(
            &view(huge, &[], &[]),
            ProfileSource::Learn(None),
            &EncodeParams::default(),
        );
        assert!(e.unwrap_err().message.contains("2251799813685248 elements"));
    }

    #[test]
    fn errors_keep_their_spec_check() {
        let e = open(b"nope", None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Header);
        assert!(e.check.is_some());
        let e = load_profile(b"").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Profile);
    }
}
