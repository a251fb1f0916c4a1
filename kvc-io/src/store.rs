//! Multi-level stores (`spec/STREAM.md` §2): a context kept at several levels that share one
//! profile, header and chunking, so that any mix of levels assembles into a valid stream
//! ([`codec_core::assemble`]), with the context's token ids for the consumer that recomputes a
//! chunk from its text instead.
//!
//! ```text
//! CTX/store.json      the manifest (written last: a store without it is incomplete)
//! CTX/profile.kvcp    the profile every stream references
//! CTX/level-NN.kvc    one whole stream per level kept, NN its level in two digits
//! CTX/tokens.bin      the token ids, u32 little-endian, one per token (if the dump had them)
//! ```
//!
//! ```
//! use kvc_io::store::Store;
//!
//! let dump = kvc_io::load_dump(&kvc_io::fixtures::sample())?;
//! let profile = kvc_io::policy::learn(&[&dump], &mut kvc_io::Silent)?;
//! let params = codec_core::EncodeParams { chunk_tokens: 128, ..Default::default() };
//! let dir = tempfile::tempdir()?;
//! let ctx = dir.path().join("sample");
//! Store::write(&ctx, &dump, &profile, &params, &[1, 7, 11], false, 0)?;
//! let store = Store::open(&ctx)?;
//! assert_eq!((store.chunks(), store.levels()), (4, &[1, 7, 11][..]));
//! assert!(store.chunk_bytes(0, 11)? < store.chunk_bytes(0, 1)?);
//! // Any mix of levels is a stream that decodes with the store's profile.
//! let bytes = store.assemble(&[1, 11, 7, 7])?;
//! let cache = codec_core::decode(&bytes, Some(store.profile()), &codec_core::Limits::DEFAULT)?;
//! assert_eq!(cache.shape, dump.kv.shape);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use codec_core::{DecodeError, EncodeParams, Header, Limits, Profile, ProfileMode};

use crate::dump::Dump;
use crate::error::Error;
use crate::output::Output;

/// The manifest's format name; a store of another format is refused.
pub const STORE_FORMAT: &str = "kvc-store/1";
/// Largest manifest read, in bytes (a 1M-token context at 1536 tokens per chunk and 12 levels
/// takes about 80 KB).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Largest level stream read, in bytes: 16 GiB, twice the f16 bytes of the largest cache one
/// decode call takes within `Limits::DEFAULT` (its `max_elements`).
pub const MAX_LEVEL_BYTES: u64 = 4 * Limits::DEFAULT.max_elements;

const MANIFEST: &str = "store.json";
const PROFILE: &str = "profile.kvcp";
const TOKENS: &str = "tokens.bin";

fn level_file(level: u8) -> String {
    format!("level-{level:02}.kvc")
}

/// A context kept at several levels, opened and checked.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    levels: Vec<u8>,
    header: Header,
    profile: Profile,
    /// Per level (in `levels` order), the whole stream and its header.
    streams: Vec<(Vec<u8>, Header)>,
    tokens: Option<Vec<u32>>,
}

impl Store {
    /// Encodes `dump` at each of `levels` with `profile` (referenced; `params.levels` is
    /// ignored) into the store directory `dir`, created if needed, on `threads` threads (0:
    /// every core). An existing store there is replaced only if `replace`.
    pub fn write(
        dir: &Path,
        dump: &Dump,
        profile: &Profile,
        params: &EncodeParams,
        levels: &[u8],
        replace: bool,
        threads: usize,
    ) -> Result<Store, Error> {
        let levels = checked_levels(dir, dump, profile, levels)?;
        let manifest = Output::checked(&dir.join(MANIFEST), &[], replace)?;
        fs::create_dir_all(dir).map_err(|e| store_err(dir, &format!("cannot create it: {e}")))?;
        let view = dump.kv.view();
        let mut streams = Vec::with_capacity(levels.len());
        for &level in &levels {
            let p = EncodeParams {
                levels: vec![level],
                ..params.clone()
            };
            let mode = ProfileMode::Referenced(profile);
            let bytes = codec_core::encode_threads(&view, mode, &p, threads)?;
            Output::checked(&dir.join(level_file(level)), &[], true)?.write(&bytes)?;
            let h = Header::parse(&bytes, &Limits::DEFAULT).map_err(DecodeError::from)?;
            streams.push((bytes, h));
        }
        Output::checked(&dir.join(PROFILE), &[], true)?.write(profile.as_bytes())?;
        let tokens = dump.tokens.clone();
        match &tokens {
            Some(t) => {
                let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
                Output::checked(&dir.join(TOKENS), &[], true)?.write(&bytes)?;
            }
            None => remove_if_there(&dir.join(TOKENS))?,
        }
        let header = streams[0].1.clone();
        let store = Store {
            dir: dir.to_path_buf(),
            levels,
            header,
            profile: profile.clone(),
            streams,
            tokens,
        };
        manifest.write(store.manifest().as_bytes())?;
        store.remove_other_levels()?;
        Ok(store)
    }

    /// Opens the store in `dir` and checks that its streams agree with each other, with its
    /// profile and with its manifest.
    pub fn open(dir: &Path) -> Result<Store, Error> {
        let m = read_manifest(dir)?;
        let profile_bytes = read_file(dir, PROFILE, Limits::DEFAULT.max_profile_bytes)?;
        let profile = Profile::from_bytes(&profile_bytes, &Limits::DEFAULT)
            .map_err(|e| store_err(dir, &format!("{PROFILE}: {e}")))?;
        if profile.hash_hex() != m.profile_sha256 {
            return Err(store_err(
                dir,
                "profile.kvcp is not the profile the manifest names",
            ));
        }
        let mut streams = Vec::with_capacity(m.levels.len());
        let mut header: Option<Header> = None;
        for &level in &m.levels {
            let name = level_file(level);
            let bytes = read_file(dir, &name, MAX_LEVEL_BYTES)?;
            let h = Header::parse(&bytes, &Limits::DEFAULT)
                .map_err(|e| store_err(dir, &format!("{name}: {e}")))?;
            check_level_stream(&h, level, &profile, header.as_ref())
                .map_err(|why| store_err(dir, &format!("{name}: {why}")))?;
            let sizes: Vec<u64> = h.chunks.iter().map(|e| u64::from(e.len_bytes)).collect();
            if m.sizes.get(&level) != Some(&sizes) {
                return Err(store_err(
                    dir,
                    &format!("{name}: chunk sizes differ from the manifest's"),
                ));
            }
            header.get_or_insert_with(|| h.clone());
            streams.push((bytes, h));
        }
        let header = header.ok_or_else(|| store_err(dir, "the manifest lists no level"))?;
        let tokens = match m.token_ids {
            true => Some(read_tokens(dir, header.shape.tokens)?),
            false => None,
        };
        Ok(Store {
            dir: dir.to_path_buf(),
            levels: m.levels,
            header,
            profile,
            streams,
            tokens,
        })
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The levels kept, ascending (finest first).
    pub fn levels(&self) -> &[u8] {
        &self.levels
    }

    /// Chunks of the context.
    pub fn chunks(&self) -> usize {
        self.header.chunks.len()
    }

    /// The header every assembled stream shares (its chunk levels and sizes those of the
    /// finest level).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The profile every stream references.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The tokens of chunk `i` (stream indices).
    pub fn chunk_range(&self, i: usize) -> Option<Range<u32>> {
        let e = self.header.chunks.get(i)?;
        Some(e.token_start..e.token_start + e.tokens)
    }

    /// The token ids of chunk `i`, if the store has them.
    pub fn chunk_token_ids(&self, i: usize) -> Option<&[u32]> {
        let r = self.chunk_range(i)?;
        Some(&self.tokens.as_ref()?[r.start as usize..r.end as usize])
    }

    /// The bytes of chunk `i` at `level` (its CRC included).
    pub fn chunk(&self, i: usize, level: u8) -> Result<&[u8], Error> {
        let j = self
            .levels
            .iter()
            .position(|&l| l == level)
            .ok_or_else(|| {
                store_err(
                    &self.dir,
                    &format!("no level {level} (kept: {:?})", self.levels),
                )
            })?;
        let (bytes, h) = &self.streams[j];
        let e = h.chunks.get(i).ok_or_else(|| {
            store_err(
                &self.dir,
                &format!("no chunk {i} (it has {})", self.chunks()),
            )
        })?;
        Ok(&bytes[e.offset as usize..][..e.len_bytes as usize])
    }

    /// The size of chunk `i` at `level`, in bytes.
    pub fn chunk_bytes(&self, i: usize, level: u8) -> Result<usize, Error> {
        Ok(self.chunk(i, level)?.len())
    }

    /// The stream of the whole context with chunk `i` at `levels[i]`, referencing
    /// [`profile`](Self::profile).
    pub fn assemble(&self, levels: &[u8]) -> Result<Vec<u8>, Error> {
        if levels.len() != self.chunks() {
            let why = format!("{} levels for {} chunks", levels.len(), self.chunks());
            return Err(store_err(&self.dir, &why));
        }
        let parts: Vec<(u8, &[u8])> = levels
            .iter()
            .enumerate()
            .map(|(i, &l)| Ok((l, self.chunk(i, l)?)))
            .collect::<Result<_, Error>>()?;
        Ok(codec_core::assemble(&self.header, &parts, &[])?)
    }

    /// The manifest's JSON text.
    fn manifest(&self) -> String {
        let chunks: Vec<serde_json::Value> = (0..self.chunks())
            .map(|i| {
                let e = &self.header.chunks[i];
                let sizes: serde_json::Map<String, serde_json::Value> = self
                    .levels
                    .iter()
                    .map(|&l| (l.to_string(), self.chunk_bytes(i, l).unwrap_or(0).into()))
                    .collect();
                serde_json::json!({"token_start": e.token_start, "tokens": e.tokens, "bytes": sizes})
            })
            .collect();
        let v = serde_json::json!({
            "format": STORE_FORMAT,
            "model_id": self.header.meta.model_id,
            "tokens": self.header.shape.tokens,
            "levels": self.levels,
            "profile_sha256": self.profile.hash_hex(),
            "token_ids": self.tokens.is_some(),
            "chunks": chunks,
        });
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    }

    /// Removes the level streams of an earlier store in the same directory that this one does
    /// not keep.
    fn remove_other_levels(&self) -> Result<(), Error> {
        for level in 0..=u8::MAX {
            if !self.levels.contains(&level) {
                remove_if_there(&self.dir.join(level_file(level)))?;
            }
        }
        Ok(())
    }
}

/// What the manifest says, checked for form.
struct Manifest {
    levels: Vec<u8>,
    profile_sha256: String,
    token_ids: bool,
    /// Per level, the chunk sizes in bytes.
    sizes: BTreeMap<u8, Vec<u64>>,
}

fn read_manifest(dir: &Path) -> Result<Manifest, Error> {
    let bytes = read_file(dir, MANIFEST, MAX_MANIFEST_BYTES)?;
    let bad = |why: &str| store_err(dir, &format!("{MANIFEST}: {why}"));
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(&format!("not JSON ({e})")))?;
    if v["format"] != STORE_FORMAT {
        return Err(bad(&format!(
            "format {} is not {STORE_FORMAT}",
            v["format"]
        )));
    }
    let levels: Vec<u8> = v["levels"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64()?.try_into().ok())
                .collect::<Option<_>>()
        })
        .filter(|l: &Vec<u8>| !l.is_empty() && l.windows(2).all(|w| w[0] < w[1]))
        .ok_or_else(|| bad("\"levels\" is not an ascending list of levels 0..=255"))?;
    let profile_sha256 = v["profile_sha256"]
        .as_str()
        .ok_or_else(|| bad("no \"profile_sha256\""))?
        .to_string();
    let token_ids = v["token_ids"]
        .as_bool()
        .ok_or_else(|| bad("no \"token_ids\""))?;
    let chunks = v["chunks"].as_array().ok_or_else(|| bad("no \"chunks\""))?;
    let mut sizes: BTreeMap<u8, Vec<u64>> = BTreeMap::new();
    for (i, c) in chunks.iter().enumerate() {
        for &l in &levels {
            let n = c["bytes"][l.to_string()]
                .as_u64()
                .ok_or_else(|| bad(&format!("chunk {i} has no size at level {l}")))?;
            sizes.entry(l).or_default().push(n);
        }
    }
    Ok(Manifest {
        levels,
        profile_sha256,
        token_ids,
        sizes,
    })
}

/// A level's stream against the store: it references `profile`, every chunk is at `level`, and
/// it matches the first stream (`first`) in everything but its chunks' levels and sizes.
fn check_level_stream(
    h: &Header,
    level: u8,
    profile: &Profile,
    first: Option<&Header>,
) -> Result<(), String> {
    if h.profile_len != 0 || h.profile_hash != profile.hash() {
        return Err("does not reference the store's profile".into());
    }
    if let Some(e) = h.chunks.iter().find(|e| e.level != level) {
        return Err(format!(
            "the chunk at token {} is at level {}",
            e.token_start, e.level
        ));
    }
    let Some(f) = first else { return Ok(()) };
    let tiles = |h: &Header| -> Vec<(u32, u32)> {
        h.chunks.iter().map(|e| (e.token_start, e.tokens)).collect()
    };
    let same = (h.shape, h.dtype, &h.meta, h.chunk_tokens, h.group, h.n_sink)
        == (f.shape, f.dtype, &f.meta, f.chunk_tokens, f.group, f.n_sink)
        && tiles(h) == tiles(f);
    if !same {
        return Err("its shape, metadata or chunking differ from the other levels'".into());
    }
    Ok(())
}

fn read_tokens(dir: &Path, tokens: u32) -> Result<Vec<u32>, Error> {
    let bytes = read_file(dir, TOKENS, 4 * u64::from(tokens))?;
    if bytes.len() as u64 != 4 * u64::from(tokens) {
        let why = format!(
            "{TOKENS} holds {} bytes, not 4 per token ({tokens} tokens)",
            bytes.len()
        );
        return Err(store_err(dir, &why));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// The file `name` of the store, a regular file of at most `limit` bytes.
fn read_file(dir: &Path, name: &str, limit: u64) -> Result<Vec<u8>, Error> {
    crate::input::read_limited(&dir.join(name), limit)
        .map_err(|e| store_err(dir, &format!("cannot read {name}: {e}")))
}

fn remove_if_there(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(store_err(
            path.parent().unwrap_or(path),
            &format!("cannot remove {}: {e}", path.display()),
        )),
        _ => Ok(()),
    }
}

/// `levels` sorted without repeats, each one the profile has, for a dump whose token ids (if
/// any) are one a token.
fn checked_levels(
    dir: &Path,
    dump: &Dump,
    profile: &Profile,
    levels: &[u8],
) -> Result<Vec<u8>, Error> {
    let mut levels = levels.to_vec();
    levels.sort_unstable();
    levels.dedup();
    if levels.is_empty() {
        return Err(store_err(dir, "no level to keep (give --levels)"));
    }
    if let Some(&l) = levels.iter().find(|&&l| l >= profile.levels()) {
        let n = profile.levels();
        let why = format!("level {l}: the profile has levels 0..={}", n - 1);
        return Err(store_err(dir, &why));
    }
    let tokens = dump.kv.shape.tokens;
    if let Some(t) = dump.tokens.as_ref().filter(|t| t.len() != tokens as usize) {
        let why = format!("{} token ids for {tokens} tokens", t.len());
        return Err(store_err(dir, &why));
    }
    Ok(levels)
}

fn store_err(dir: &Path, reason: &str) -> Error {
    Error::Store {
        dir: dir.to_path_buf(),
        reason: reason.to_string(),
    }
}
