//! Printing: results to stdout, notes to stderr, never a panic.
//!
//! `println!` panics when stdout cannot be written (`kvc demo >/dev/full`, or `kvc inspect s |
//! head -1` once `head` has gone). Here a result that cannot be written fails its command, and
//! a reader that went away (a broken pipe) ends the command quietly, as it stopped reading on
//! purpose. A note that cannot be written to stderr is dropped: there is nowhere left to say so.

use std::fmt;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a write to stdout found the reader gone.
static READER_GONE: AtomicBool = AtomicBool::new(false);

/// Writes one line of a command's result to stdout.
pub fn write_result(args: fmt::Arguments) -> crate::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{args}").map_err(|e| {
        if e.kind() == ErrorKind::BrokenPipe {
            READER_GONE.store(true, Ordering::Relaxed);
        }
        format!("writing to stdout: {e}")
    })
}

/// Writes one line to stderr, dropping it if stderr cannot take it.
pub fn write_note(args: fmt::Arguments) {
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// Whether the reader of stdout went away while a result was written.
pub fn reader_gone() -> bool {
    READER_GONE.load(Ordering::Relaxed)
}

/// `println!` for results: the failure returned (with `?`) from the enclosing function.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::say::write_result(format_args!($($arg)*))?
    };
}

/// `eprintln!` for notes and progress: a failure dropped.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::say::write_note(format_args!($($arg)*))
    };
}

pub(crate) use {note, out};
