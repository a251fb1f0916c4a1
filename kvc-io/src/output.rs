//! Output files as `zstd` and `gzip` treat them: written whole into a temporary file beside the
//! destination and moved into place at the end, so that a reader never sees a partial file; an
//! existing file replaced only when the caller allows it; an input never overwritten, even then.
//!
//! Every temporary file alive is registered, so that a signal handler can remove them all
//! ([`remove_temporaries`]) before the process exits: nothing is left behind on Ctrl-C.
//!
//! ```
//! use kvc_io::output::{Output, OutputError};
//!
//! let dir = tempfile::tempdir()?;
//! let input = dir.path().join("in.bin");
//! std::fs::write(&input, b"input")?;
//! let out = dir.path().join("out.bin");
//!
//! Output::checked(&out, &[&input], false)?.write(b"first")?;
//! // Without permission to replace, the existing output is kept.
//! let e = Output::checked(&out, &[&input], false).unwrap_err();
//! assert!(matches!(e, OutputError::Exists { .. }));
//! Output::checked(&out, &[&input], true)?.write(b"second")?;
//! assert_eq!(std::fs::read(&out)?, b"second");
//! // The input itself is refused even with permission to replace.
//! let e = Output::checked(&input, &[&input], true).unwrap_err();
//! assert!(matches!(e, OutputError::SameAsInput { .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Why an output file was refused or could not be written.
#[derive(Debug)]
#[non_exhaustive]
pub enum OutputError {
    /// The output exists and replacing it was not allowed.
    Exists {
        /// The output.
        path: PathBuf,
    },
    /// The output is one of the inputs (the same path once links are resolved, or the same
    /// file through a hard link).
    SameAsInput {
        /// The output as named.
        output: PathBuf,
        /// The input as named.
        input: PathBuf,
    },
    /// The output names a directory.
    IsDirectory {
        /// The output.
        path: PathBuf,
    },
    /// An I/O operation failed.
    Io {
        /// The file (or directory) concerned.
        path: PathBuf,
        /// What was being done ("create temporary file", "write", ...).
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
}

impl fmt::Display for OutputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OutputError::Exists { path } => write!(
                f,
                "{} already exists (use -f/--force to replace it)",
                path.display()
            ),
            OutputError::SameAsInput { output, input } if output == input => write!(
                f,
                "{} is both an input and the output: writing it would destroy the input \
                 (name another output file)",
                output.display()
            ),
            OutputError::SameAsInput { output, input } => write!(
                f,
                "{} is the same file as the input {}: writing it would destroy the input \
                 (name another output file)",
                output.display(),
                input.display()
            ),
            OutputError::IsDirectory { path } => write!(
                f,
                "{} is a directory (name a file to write)",
                path.display()
            ),
            OutputError::Io { path, op, source } => {
                write!(f, "{}: {op} failed: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for OutputError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OutputError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_err(path: &Path, op: &'static str, source: io::Error) -> OutputError {
    OutputError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// A file to write, with what it may replace.
#[derive(Clone, Debug)]
pub struct Output {
    path: PathBuf,
    inputs: Vec<PathBuf>,
    replace: bool,
}

impl Output {
    /// An output that replaces an existing file at `path`, as [`std::fs::write`] does (but
    /// atomically). For programs writing their own files.
    pub fn replacing(path: &Path) -> Output {
        Output {
            path: path.to_path_buf(),
            inputs: Vec::new(),
            replace: true,
        }
    }

    /// A user's output: an existing file at `path` is an error unless `replace`, and so is a
    /// path that is one of `inputs` (whatever `replace` says). Checked now, so that a command
    /// fails before its work, and again when the file is written.
    pub fn checked(path: &Path, inputs: &[&Path], replace: bool) -> Result<Output, OutputError> {
        let out = Output {
            path: path.to_path_buf(),
            inputs: inputs.iter().map(|p| p.to_path_buf()).collect(),
            replace,
        };
        out.check()?;
        Ok(out)
    }

    /// The path written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` to the path: into a new temporary file in the same directory, then moved
    /// into place. When that replaces an existing file, the new one is flushed to disk first,
    /// and the directory after, so that a crash cannot leave neither (a new file that a crash
    /// loses is the command's to redo, as with `zstd` or `cp`, and is not flushed: that would
    /// cost a decode a good part of its time). On any error the temporary file is removed and
    /// the path is left as it was.
    pub fn write(&self, bytes: &[u8]) -> Result<(), OutputError> {
        self.check()?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (guard, mut file) = Temporary::create(&dir, &self.path)?;
        file.write_all(bytes)
            .map_err(|e| io_err(&guard.path, "write", e))?;
        let replaces = fs::symlink_metadata(&self.path).is_ok();
        if replaces {
            file.sync_all()
                .map_err(|e| io_err(&guard.path, "sync", e))?;
        }
        drop(file);
        self.check()?;
        guard.persist(&self.path, self.replace)?;
        // Make the new name durable where the platform allows; failure here loses nothing.
        if let (true, Ok(d)) = (replaces, File::open(&dir)) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    fn check(&self) -> Result<(), OutputError> {
        let meta = match fs::symlink_metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&self.path, "inspect output", e)),
        };
        if let Some(input) = self.inputs.iter().find(|i| same_file(&self.path, i)) {
            return Err(OutputError::SameAsInput {
                output: self.path.clone(),
                input: input.clone(),
            });
        }
        if fs::metadata(&self.path).is_ok_and(|m| m.is_dir()) || meta.is_dir() {
            return Err(OutputError::IsDirectory {
                path: self.path.clone(),
            });
        }
        if !self.replace {
            return Err(OutputError::Exists {
                path: self.path.clone(),
            });
        }
        Ok(())
    }
}

/// Whether two paths name one file: the same path once links are resolved, or (on Unix) the
/// same device and inode, as a hard link is.
fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(x), Ok(y)) = (fs::canonicalize(a), fs::canonicalize(b)) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (fs::metadata(a), fs::metadata(b)) {
            return (x.dev(), x.ino()) == (y.dev(), y.ino());
        }
    }
    false
}

/// The temporary files alive in this process. Creating, moving and removing one happen under
/// this lock, so that [`remove_temporaries`] sees each either registered or gone.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Removes every temporary file this process is writing, and holds the registry locked until
/// the process ends, so that no new one appears. For a signal handler that then exits the
/// process; after it, no output can be written.
pub fn remove_temporaries() {
    let live = live();
    for p in live.iter() {
        let _ = fs::remove_file(p);
    }
    std::mem::forget(live);
}

/// A registered temporary file, removed on drop unless persisted.
struct Temporary {
    path: PathBuf,
    /// Given its final name: nothing left to remove.
    persisted: bool,
}

impl Temporary {
    /// Creates `.NAME.tmp-PID-N` in `dir` for the output `target`; `create_new` never clobbers
    /// anything, so the first free `N` is taken.
    fn create(dir: &Path, target: &Path) -> Result<(Temporary, File), OutputError> {
        let name = target.file_name().ok_or_else(|| {
            let e = io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name");
            io_err(target, "write", e)
        })?;
        let mut live = live();
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let mut tmp = OsString::from(".");
            tmp.push(name);
            tmp.push(format!(".tmp-{}-{n}", std::process::id()));
            let path = dir.join(tmp);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => {
                    live.push(path.clone());
                    let t = Temporary {
                        path,
                        persisted: false,
                    };
                    return Ok((t, f));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&path, "create temporary file", e)),
            }
        }
    }

    /// Gives the file its final name: renamed over `target` when `replace`, else linked to it,
    /// which fails if `target` appeared meanwhile (nothing existing is ever replaced).
    /// On error, `live` is released before `self` drops (locals drop before parameters).
    fn persist(mut self, target: &Path, replace: bool) -> Result<(), OutputError> {
        let mut live = live();
        let linked = if replace {
            fs::rename(&self.path, target)
        } else {
            fs::hard_link(&self.path, target)
        };
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(OutputError::Exists {
                    path: target.to_path_buf(),
                })
            }
            // A file system without hard links: rename, the target being absent a moment ago.
            Err(_) if !replace && fs::symlink_metadata(target).is_err() => {
                fs::rename(&self.path, target)
                    .map_err(|e| io_err(target, "rename temporary file onto", e))?
            }
            Err(e) => return Err(io_err(target, "move temporary file onto", e)),
        }
        if !replace {
            let _ = fs::remove_file(&self.path);
        }
        live.retain(|p| p != &self.path);
        self.persisted = true;
        Ok(())
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if self.persisted {
            return;
        }
        let mut live = live();
        let _ = fs::remove_file(&self.path);
        live.retain(|p| p != &self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> usize {
        fs::read_dir(dir).unwrap().count()
    }

    #[test]
    fn failure_between_create_and_persist_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.bin");
        {
            let (t, mut f) = Temporary::create(dir.path(), &target).unwrap();
            f.write_all(b"partial").unwrap();
            assert!(live().contains(&t.path));
            // An error here drops the temporary.
        }
        assert_eq!(files(dir.path()), 0);
        assert!(!live().iter().any(|p| p.starts_with(dir.path())));
    }

    #[test]
    fn target_appearing_meanwhile_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.bin");
        let (t, mut f) = Temporary::create(dir.path(), &target).unwrap();
        f.write_all(b"new").unwrap();
        fs::write(&target, b"someone else's").unwrap();
        let e = t.persist(&target, false).unwrap_err();
        assert!(matches!(e, OutputError::Exists { .. }), "{e}");
        assert_eq!(fs::read(&target).unwrap(), b"someone else's");
        assert_eq!(files(dir.path()), 1);
    }
}
