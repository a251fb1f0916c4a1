//! A progress bar on stderr, shown only when stderr is a terminal.
#![allow(dead_code)]

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar that draws on stderr when it is a terminal and does nothing otherwise.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar counting to `len`, labelled `msg`.
    pub fn new(len: u64, msg: &str) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress { bar: None };
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        bar.set_message(msg.to_string());
        Progress { bar: Some(bar) }
    }

    /// A progress that never draws.
    pub fn hidden() -> Progress {
        Progress { bar: None }
    }

    /// `true` if a bar is being drawn.
    pub fn is_visible(&self) -> bool {
        self.bar.is_some()
    }

    /// Advances by `n`.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
    }

    /// Completes the bar (leaving it drawn at 100%).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_is_noop() {
        let p = Progress::hidden();
        assert!(!p.is_visible());
        p.inc(3);
        p.finish();
        // Under the test harness stderr is normally captured (not a terminal).
        let q = Progress::new(10, "x");
        assert_eq!(q.is_visible(), std::io::stderr().is_terminal());
        q.inc(10);
        q.finish();
    }
}
