//! Progress bars on stderr, drawn only when stderr is a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Draws each stage of a [`kvc_io::Progress`] as a bar on stderr when it is a terminal, and
/// nothing otherwise.
#[derive(Debug)]
pub struct Bars {
    draw: bool,
    bar: Option<ProgressBar>,
}

impl Bars {
    /// Bars that draw if stderr is a terminal.
    pub fn on_stderr() -> Bars {
        Bars {
            draw: std::io::stderr().is_terminal(),
            bar: None,
        }
    }

    /// Bars that never draw.
    #[cfg(test)]
    pub fn hidden() -> Bars {
        Bars {
            draw: false,
            bar: None,
        }
    }

    /// `true` if a bar is being drawn.
    #[cfg(test)]
    pub fn is_visible(&self) -> bool {
        self.bar.is_some()
    }
}

impl kvc_io::Progress for Bars {
    fn start(&mut self, label: &str, steps: u64) {
        if !self.draw {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        bar.set_message(label.to_string());
        self.bar = Some(bar);
    }

    fn step(&mut self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    /// Completes the bar (leaving it drawn at 100%).
    fn finish(&mut self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_io::Progress;

    #[test]
    fn hidden_is_noop() {
        let mut p = Bars::hidden();
        p.start("x", 3);
        assert!(!p.is_visible());
        p.step();
        p.finish();
        // Under the test harness stderr is normally captured (not a terminal).
        let mut q = Bars::on_stderr();
        q.start("x", 10);
        assert_eq!(q.is_visible(), std::io::stderr().is_terminal());
        q.step();
        q.finish();
    }
}
