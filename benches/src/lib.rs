//! Shared loaders for the benches.
