//! Progress of long computations, reported to whoever draws it (the command's bars).

/// Receives the progress of a long computation: stages of counted steps.
pub trait Progress {
    /// A stage of `steps` steps named `label` begins.
    fn start(&mut self, label: &str, steps: u64);
    /// One more step of the current stage is done.
    fn step(&mut self);
    /// The current stage is done.
    fn finish(&mut self);
}

/// Progress that nobody watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Silent;

impl Progress for Silent {
    fn start(&mut self, _label: &str, _steps: u64) {}
    fn step(&mut self) {}
    fn finish(&mut self) {}
}
