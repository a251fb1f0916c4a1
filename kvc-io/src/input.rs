//! Files read whole, within a limit: what the server and the command read from disk.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::Path;

/// The bytes of the regular file at `path`, if it holds at most `limit` of them.
///
/// Anything but a regular file (a device such as `/dev/zero`, a FIFO, a directory) is refused
/// before it is opened, and the read stops one byte past `limit` whatever the file's size said,
/// so a file that grows while it is read costs at most `limit + 1` bytes. Errors are
/// `InvalidInput` (not a regular file), `FileTooLarge`, or the file system's.
pub fn read_limited(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let regular = |m: &fs::Metadata| {
        if m.is_file() {
            Ok(m.len())
        } else {
            let msg = "not a regular file";
            Err(io::Error::new(io::ErrorKind::InvalidInput, msg))
        }
    };
    let too_large = || io::Error::new(io::ErrorKind::FileTooLarge, format!("over {limit} bytes"));
    regular(&fs::metadata(path)?)?;
    let file = File::open(path)?;
    let len = regular(&file.metadata()?)?;
    if len > limit {
        return Err(too_large());
    }
    // `len` is at most `limit`, which the caller chose to hold in memory.
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}
