//! The codec's own commands: `kvc encode` (a stream, or a multi-level store), `kvc decode`,
//! `kvc shift`, `kvc inspect` and `kvc profile`.

use std::path::{Path, PathBuf};

use codec_core::profile::hex;
use codec_core::{EncodeParams, Limits, Stream};
use kvc_io::gpu::GpuCodec;
use kvc_io::policy::{self, ProfileUse};
use kvc_io::{write_dump, Dump, Output};

use crate::progress::Bars;
use crate::say::{note, out};
use crate::{load, output_file, read, Result};
use clap::Args;
use kvc_io::store::MAX_LEVEL_BYTES as MAX_STREAM_BYTES;

/// `kvc encode`'s arguments.
#[derive(Args)]
pub(crate) struct EncodeArgs {
    pub input: PathBuf,
    #[arg(required_unless_present = "store")]
    pub output: Option<PathBuf>,
    /// Write a multi-level store in this directory instead (spec/STREAM.md): every chunk at
    /// each of --levels, one profile (--profile, or learned from the input), the token ids.
    #[arg(long, conflicts_with_all = ["output", "level"], requires = "levels")]
    pub store: Option<PathBuf>,
    /// Level for every chunk (0 = finest).
    #[arg(long, default_value_t = 7, conflicts_with = "levels")]
    pub level: u8,
    /// Level per chunk, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub levels: Option<Vec<u8>>,
    /// Profile to reference (without it the stream embeds a profile learned from the input).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Tokens per chunk.
    #[arg(long, default_value_t = EncodeParams::DEFAULT_CHUNK_TOKENS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_tokens: u32,
    /// Tokens per group (anchor + deltas).
    #[arg(long, default_value_t = EncodeParams::DEFAULT_GROUP,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(EncodeParams::MAX_GROUP)))]
    pub group: u32,
    /// Leading tokens (attention sinks) stored exactly.
    #[arg(long, default_value_t = codec_core::EncodeParams::DEFAULT_SINK)]
    pub sink: u16,
    /// Same steps for every token: turn off the coarser steps for tokens that later queries
    /// barely read (use this if the cache will be read by queries at unusual positions).
    #[arg(long)]
    pub uniform_steps: bool,
    /// Code the chunks on GPU 0 (codec-cuda's encode chain; the same bytes as on the CPU).
    #[arg(long, conflicts_with = "store")]
    pub gpu: bool,
}

/// `kvc encode`: one stream, or a store with `--store`.
pub(crate) fn cmd_encode_args(a: EncodeArgs, (force, threads): (bool, usize)) -> Result<()> {
    let params = EncodeParams {
        chunk_tokens: a.chunk_tokens,
        group: a.group,
        n_sink: a.sink,
        levels: a.levels.unwrap_or_else(|| vec![a.level]),
        token_importance: !a.uniform_steps,
    };
    let profile = a.profile.as_deref();
    match (a.store, a.output) {
        (Some(dir), _) => cmd_encode_store(&a.input, &dir, profile, params, (force, threads)),
        (None, Some(out)) => cmd_encode(&a.input, &out, profile, params, (force, threads, a.gpu)),
        (None, None) => Err("give an output file, or --store DIR".into()),
    }
}

/// `kvc encode`: the dump at `input` as one stream in `output`, its chunks coded on GPU 0 with
/// `gpu`.
fn cmd_encode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    params: EncodeParams,
    (force, threads, gpu): (bool, usize, bool),
) -> Result<()> {
    let mut inputs = vec![input];
    inputs.extend(profile);
    let out = output_file(output, &inputs, force)?;
    let codec = gpu
        .then(GpuCodec::open)
        .transpose()
        .map_err(|e| e.to_string())?;
    let d = load(input)?;
    let (full, mode) = match profile {
        Some(pp) => {
            let p = policy::load_profile(pp).map_err(|e| e.to_string())?;
            let mode = format!("referencing profile {}", &p.hash_hex()[..16]);
            (p, mode)
        }
        None => {
            let p = policy::learn(&[&d], &mut Bars::on_stderr()).map_err(|e| e.to_string())?;
            (p, "self-contained".to_string())
        }
    };
    let use_ = match profile {
        Some(_) => ProfileUse::Referenced(&full),
        None => ProfileUse::SelfContained(&full),
    };
    let view = d.kv.view();
    let encoded = match &codec {
        None => policy::encode(&view, use_, &params, threads).map_err(|e| e.to_string()),
        Some(c) => policy::encode_with(&view, use_, &params, |kv, m, p| c.encode_stream(kv, m, p))
            .map_err(|e| e.to_string()),
    };
    let bytes = encoded?.bytes;
    out.write(&bytes).map_err(|e| e.to_string())?;
    let bpe = bytes.len() as f64 * 8.0 / d.kv.shape.total_elements() as f64;
    let on = codec.map_or(String::new(), |c| format!(", chunks coded on {}", c.name()));
    note!(
        "{}: {} bytes, {bpe:.3} bits/element, {mode}{on}",
        output.display(),
        bytes.len()
    );
    Ok(())
}

/// `kvc encode --store`: the input at every level of `params.levels`, as a store in `dir`.
fn cmd_encode_store(
    input: &Path,
    dir: &Path,
    profile: Option<&Path>,
    params: EncodeParams,
    (force, threads): (bool, usize),
) -> Result<()> {
    let d = load(input)?;
    let p = match profile {
        Some(pp) => policy::load_profile(pp).map_err(|e| e.to_string())?,
        None => policy::learn(&[&d], &mut Bars::on_stderr()).map_err(|e| e.to_string())?,
    };
    let store = kvc_io::store::Store::write(dir, &d, &p, &params, &params.levels, force, threads)
        .map_err(|e| e.to_string())?;
    let elements = d.kv.shape.total_elements() as f64;
    for &l in store.levels() {
        let bytes: usize = (0..store.chunks())
            .map(|i| store.chunk_bytes(i, l))
            .sum::<std::result::Result<usize, _>>()
            .map_err(|e| e.to_string())?;
        note!(
            "level {l:>2}: {bytes} bytes, {:.3} bits/element",
            bytes as f64 * 8.0 / elements
        );
    }
    note!(
        "{}: {} chunks at {} levels, profile {}, {}",
        dir.display(),
        store.chunks(),
        store.levels().len(),
        &p.hash_hex()[..16],
        if d.tokens.is_some() {
            "token ids kept (chunks can be recomputed from text)"
        } else {
            "no token ids in the dump (no text fallback; kvc dump records them)"
        }
    );
    Ok(())
}

/// The metadata of a dump of a cache with `m`: its model and rotary settings, as `kvc dump`
/// writes them.
pub(crate) fn dump_metadata(m: &codec_core::KvMeta) -> std::collections::BTreeMap<String, String> {
    let style = match m.rope.style {
        codec_core::RopeStyle::NeoX => "rotate_half (NeoX)",
        codec_core::RopeStyle::GptJ => "interleaved (GPT-J)",
        codec_core::RopeStyle::None => "none",
    };
    [
        ("model", m.model_id.clone()),
        ("rope_theta", m.rope.theta.to_string()),
        ("pre_rope", u8::from(m.rope.k_pre_rope).to_string()),
        ("first_position", m.first_position.to_string()),
        ("rope_style", style.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

pub(crate) fn cmd_decode(
    input: &Path,
    output: &Path,
    profile: Option<&Path>,
    (level, position, gpu): (Option<u8>, Option<u64>, bool),
    (force, threads): (bool, usize),
) -> Result<()> {
    let mut inputs = vec![input];
    inputs.extend(profile);
    let out = output_file(output, &inputs, force)?;
    // With --gpu the file goes into page-locked memory, which the device copies it from as is.
    let gpu = match gpu {
        true => {
            let codec = GpuCodec::open().map_err(|e| e.to_string())?;
            let host = codec.read_file(input).map_err(|e| e.to_string())?;
            Some((codec, host))
        }
        false => None,
    };
    let owned = match gpu {
        Some(_) => Vec::new(),
        None => read(input, MAX_STREAM_BYTES)?,
    };
    let bytes = match &gpu {
        Some((_, host)) => host.as_slice().map_err(|e| e.to_string())?,
        None => &owned,
    };
    let p = profile
        .map(policy::load_profile)
        .transpose()
        .map_err(|e| e.to_string())?;
    let s = Stream::open(bytes, p.as_ref(), &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    if let Some(l) = level {
        check_level(input, &s, l)?;
    }
    let h = s.header();
    let done = |shape: codec_core::KvShape| {
        let dtype = h.dtype.name();
        let name = output.display();
        note!(
            "{name}: {} layers x {} tokens, {dtype}",
            shape.layers,
            shape.tokens
        );
    };
    let in_err = |e: &dyn std::fmt::Display| format!("{}: {e}", input.display());
    if gpu.is_none() && position.is_none() {
        decode_to_file(input, &s, &out, threads)?;
        done(h.shape);
        return Ok(());
    }
    let mut cache = match &gpu {
        Some((codec, host)) => codec.decode_from(&s, host).map_err(|e| in_err(&e))?,
        None => s.decode().map_err(|e| in_err(&e))?,
    };
    if let Some(q) = position {
        codec_core::shift_cache(&mut cache, q)
            .map_err(|e| format!("{}: --position {q}: {e}", input.display()))?;
    }
    write_dump(&out, &cache, &dump_metadata(&cache.meta)).map_err(|e| e.to_string())?;
    done(cache.shape);
    Ok(())
}

/// `kvc decode --level l`: an error naming the first chunk of `s` not coded at level `l` (by
/// the ladder's names where the profile was cut down).
fn check_level(input: &Path, s: &Stream<'_>, l: u8) -> Result<()> {
    let ladder = policy::ladder_levels(s.profile());
    let named = |e: &codec_core::ChunkEntry| ladder[e.level as usize].unwrap_or(e.level);
    match s.header().chunks.iter().find(|e| named(e) != l) {
        Some(e) => Err(format!(
            "{}: the chunk at token {} is coded at level {}, not {l} (a stream keeps the levels it was encoded at)",
            input.display(),
            e.token_start,
            named(e)
        )),
        None => Ok(()),
    }
}

/// Decodes all of `s` (read from `input`) straight into the output file's buffer, and writes
/// it once to `out`.
fn decode_to_file(input: &Path, s: &Stream<'_>, out: &Output, threads: usize) -> Result<()> {
    let h = s.header();
    let metadata = dump_metadata(&h.meta);
    let mut file = kvc_io::dump::DumpFile::new(h.shape, h.dtype, &h.meta, &metadata)
        .map_err(|e| e.to_string())?;
    let (mut k, mut v) = file.kv_mut().map_err(|e| e.to_string())?;
    s.decode_range_into_threads(0..h.shape.tokens, &mut k, &mut v, threads)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    drop((k, v));
    file.write(out).map_err(|e| e.to_string())
}

/// `kvc shift`: the dump at `input` moved to start at `to`, with the rotary settings overridden
/// by `rope` (style, theta) where given.
pub(crate) fn cmd_shift(
    input: &Path,
    out: &Output,
    from: Option<u64>,
    to: u64,
    rope: (Option<codec_core::RopeStyle>, Option<f32>),
) -> Result<()> {
    let mut d = load(input)?;
    let meta = &mut d.kv.meta;
    meta.rope.style = rope.0.unwrap_or(meta.rope.style);
    meta.rope.theta = rope.1.unwrap_or(meta.rope.theta);
    meta.first_position = from.unwrap_or(meta.first_position);
    let from = meta.first_position;
    codec_core::shift_cache(&mut d.kv, to).map_err(|e| format!("{}: {e}", input.display()))?;
    write_dump(out, &d.kv, &d.metadata).map_err(|e| e.to_string())?;
    note!(
        "{}: {} tokens moved from position {from} to {to} ({:?} pairing, theta {}){}",
        out.path().display(),
        d.kv.shape.tokens,
        d.kv.meta.rope.style,
        d.kv.meta.rope.theta,
        if d.q.is_some() {
            "; queries dropped"
        } else {
            ""
        }
    );
    Ok(())
}

pub(crate) fn cmd_inspect(input: &Path, profile: Option<&Path>) -> Result<()> {
    let bytes = read(input, MAX_STREAM_BYTES)?;
    let h = codec_core::Header::parse(&bytes, &Limits::DEFAULT)
        .map_err(|e| format!("{}: {e}", input.display()))?;
    print_header(input, &bytes, &h)?;
    let levels = stream_profile(&bytes, &h, profile)?;
    let s = h.shape;
    out!("chunk  tokens          level  multiplier  bytes       bits/element");
    for (i, e) in h.chunks.iter().enumerate() {
        let el = s.layers as f64 * 2.0 * e.tokens as f64 * s.channels() as f64;
        let (level, mult) = match &levels {
            Some(p) => {
                let ladder = policy::ladder_levels(p);
                let named = ladder.get(e.level as usize).copied().flatten();
                let m = p.level_multipliers().get(e.level as usize);
                (
                    named.map_or_else(|| format!("p{}", e.level), |l| l.to_string()),
                    m.map_or_else(|| "-".into(), |m| format!("x{m}")),
                )
            }
            None => (e.level.to_string(), "-".into()),
        };
        out!(
            "{i:<6} {:>6}..{:<7} {level:>5}  {mult:<10}  {:<10}  {:.4}",
            e.token_start,
            e.token_start + e.tokens,
            e.len_bytes,
            e.len_bytes as f64 * 8.0 / el
        );
    }
    if levels.is_none() {
        out!("(levels of the referenced profile; --profile FILE shows their multipliers)");
    }
    Ok(())
}

/// The profile whose levels the chunks name: the embedded one, or the referenced one if given
/// (and matching the stream's hash).
fn stream_profile(
    bytes: &[u8],
    h: &codec_core::Header,
    profile: Option<&Path>,
) -> Result<Option<codec_core::Profile>> {
    if h.profile_len > 0 {
        let at = h.header_len();
        let embedded = bytes
            .get(at..at + h.profile_len as usize)
            .ok_or("the stream is shorter than its embedded profile")?;
        return codec_core::Profile::from_bytes(embedded, &Limits::DEFAULT)
            .map(Some)
            .map_err(|e| format!("embedded profile: {e}"));
    }
    let Some(path) = profile else { return Ok(None) };
    let p = policy::load_profile(path).map_err(|e| e.to_string())?;
    if p.hash() != h.profile_hash {
        return Err(format!(
            "{} (profile {}) is not the profile the stream references ({})",
            path.display(),
            &p.hash_hex()[..16],
            &hex(&h.profile_hash)[..16]
        ));
    }
    Ok(Some(p))
}

/// The stream's header, one field per line.
fn print_header(input: &Path, bytes: &[u8], h: &codec_core::Header) -> Result<()> {
    let s = h.shape;
    out!(
        "file            {} ({} bytes)",
        input.display(),
        bytes.len()
    );
    out!("format          kvc stream v{}", h.version);
    out!(
        "model           {}",
        if h.meta.model_id.is_empty() {
            "(none)"
        } else {
            &h.meta.model_id
        }
    );
    out!(
        "shape           {} layers x {} kv heads x {} head dim, {} tokens, {}",
        s.layers,
        s.kv_heads,
        s.head_dim,
        s.tokens,
        h.dtype.name()
    );
    out!(
        "rope            {:?}, theta {}, scaling {}, K {}-RoPE",
        h.meta.rope.style,
        h.meta.rope.theta,
        h.meta.rope.scaling,
        if h.meta.rope.k_pre_rope {
            "pre"
        } else {
            "post"
        }
    );
    out!("first position  {}", h.meta.first_position);
    out!(
        "chunking        {} tokens/chunk, groups of {}, {} sink token(s)",
        h.chunk_tokens,
        h.group,
        h.n_sink
    );
    out!(
        "profile         {} ({})",
        hex(&h.profile_hash),
        if h.profile_len > 0 {
            // The embedded profile's format version (its bytes 4..6), when present.
            let at = h.header_len();
            match bytes.get(at + 4..at + 6) {
                Some(v) => format!(
                    "embedded, {} bytes, profile v{}",
                    h.profile_len,
                    u16::from_le_bytes([v[0], v[1]])
                ),
                None => format!("embedded, {} bytes", h.profile_len),
            }
        } else {
            "referenced".to_string()
        }
    );
    let total = s.total_elements().max(1) as f64;
    out!("header          {} bytes", h.header_len());
    out!(
        "total           {:.4} bits/element",
        bytes.len() as f64 * 8.0 / total
    );
    Ok(())
}

pub(crate) fn cmd_profile(output: &Path, samples: &[PathBuf], force: bool) -> Result<()> {
    let inputs: Vec<&Path> = samples.iter().map(|p| p.as_path()).collect();
    let out = output_file(output, &inputs, force)?;
    let dumps = samples
        .iter()
        .map(|p| load(p))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Dump> = dumps.iter().collect();
    let p = policy::learn(&refs, &mut Bars::on_stderr()).map_err(|e| e.to_string())?;
    out.write(p.as_bytes()).map_err(|e| e.to_string())?;
    note!(
        "{}: profile {} ({} bytes, {} levels)",
        output.display(),
        p.hash_hex(),
        p.as_bytes().len(),
        p.levels()
    );
    Ok(())
}
