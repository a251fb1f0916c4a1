//! Encode policies: where a stream's profile comes from, and which of its levels a stream keeps.
//!
//! A stream either references a profile learned once per model (the reader needs the same
//! profile) or is self-contained: it embeds a profile learned from the cache itself, cut down to
//! the levels its chunks use, so that the embedded bytes (counted in the stream's size) carry no
//! unused level.

use std::path::Path;

use codec_core::{EncodeParams, KvView, LearnParams, Limits, Profile, ProfileMode};

use crate::dump::Dump;
use crate::error::Error;
use crate::progress::Progress;

/// How a stream carries its profile.
#[derive(Clone, Copy, Debug)]
pub enum ProfileUse<'a> {
    /// The stream references this profile; its reader must supply the same one.
    Referenced(&'a Profile),
    /// The stream embeds this profile, keeping only the levels the stream uses.
    SelfContained(&'a Profile),
}

/// An encoded stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// The stream's bytes.
    pub bytes: Vec<u8>,
    /// The profile embedded in a self-contained stream (`None` when the stream references
    /// one).
    pub embedded: Option<Profile>,
}

/// Reads a profile file (`.kvcp`) within the default limits (a file over their
/// `max_profile_bytes` is refused before it is read).
pub fn load_profile(path: &Path) -> Result<Profile, Error> {
    let limit = Limits::DEFAULT.max_profile_bytes;
    let bytes = crate::input::read_limited(path, limit).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Profile::from_bytes(&bytes, &Limits::DEFAULT).map_err(|source| Error::Profile {
        path: path.to_path_buf(),
        source,
    })
}

/// Learns a profile from dumps with the default parameters, using their queries where they have
/// them; reported to `progress` as one step.
pub fn learn(dumps: &[&Dump], progress: &mut dyn Progress) -> Result<Profile, Error> {
    let samples: Vec<_> = dumps.iter().map(|d| d.sample()).collect();
    progress.start("learning profile", 1);
    let p = codec_core::learn_profile(&samples, &LearnParams::default())?;
    progress.finish();
    Ok(p)
}

/// The self-contained policy: the profile to embed (`full` with only the levels in `levels`,
/// in ascending order) and the chunk levels renumbered into it.
///
/// Errors with [`Error::NoSuchLevel`] if `full` lacks one of `levels`.
pub fn self_contained(full: &Profile, levels: &[u8]) -> Result<(Profile, Vec<u8>), Error> {
    let mut used: Vec<u8> = levels.to_vec();
    used.sort_unstable();
    used.dedup();
    if let Some(&level) = used.iter().find(|&&l| l >= full.levels()) {
        return Err(Error::NoSuchLevel {
            level,
            levels: full.levels(),
        });
    }
    let renumbered = levels
        .iter()
        .map(|l| used.iter().position(|u| u == l).unwrap_or(0) as u8)
        .collect();
    Ok((full.with_levels(&used), renumbered))
}

/// The level a user names for each level of `profile`: its place on the default ladder
/// (the multipliers of [`LearnParams::default`], which `kvc profile` learns and `--level` counts
/// in), found
/// by its multiplier; `None` for a multiplier not on the ladder. A self-contained stream's profile
/// keeps only the levels its chunks use, so its own level numbers are not the ones asked for.
pub fn ladder_levels(profile: &Profile) -> Vec<Option<u8>> {
    let ladder = LearnParams::default().level_mult;
    profile
        .level_multipliers()
        .iter()
        .map(|m| {
            let at = ladder.iter().position(|l| l.to_bits() == m.to_bits());
            at.map(|i| i as u8)
        })
        .collect()
}

/// Encodes `kv` with `params` (its `levels` name levels of the given profile), referencing the
/// profile or self-contained as `profile` says, on `threads` threads (0: every core; the bytes
/// are the same for every count).
pub fn encode(
    kv: &KvView<'_>,
    profile: ProfileUse<'_>,
    params: &EncodeParams,
    threads: usize,
) -> Result<Encoded, Error> {
    encode_with(kv, profile, params, |kv, mode, params| {
        Ok(codec_core::encode_threads(kv, mode, params, threads)?)
    })
}

/// [`encode`] with the stream written by `code` (given the cache, the profile as the stream
/// carries it and the parameters, its chunk levels renumbered for a self-contained stream):
/// for encoders other than codec-core's on the CPU, e.g. codec-cuda's device chain, which must
/// write the same bytes.
pub fn encode_with<E: From<Error>>(
    kv: &KvView<'_>,
    profile: ProfileUse<'_>,
    params: &EncodeParams,
    code: impl FnOnce(&KvView<'_>, ProfileMode<'_>, &EncodeParams) -> Result<Vec<u8>, E>,
) -> Result<Encoded, E> {
    match profile {
        ProfileUse::Referenced(p) => Ok(Encoded {
            bytes: code(kv, ProfileMode::Referenced(p), params)?,
            embedded: None,
        }),
        ProfileUse::SelfContained(full) => {
            let (p, levels) = self_contained(full, &params.levels)?;
            let params = EncodeParams {
                levels,
                ..params.clone()
            };
            Ok(Encoded {
                bytes: code(kv, ProfileMode::Embedded(&p), &params)?,
                embedded: Some(p),
            })
        }
    }
}
