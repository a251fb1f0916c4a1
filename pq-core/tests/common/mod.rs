//! Helpers shared by pq-core's integration tests.
#![allow(dead_code)] // each test binary uses a different subset

/// `normal`, or `miri` when the test runs under Miri, which interprets every step (about a
/// thousand times slower): smaller sizes and fewer proptest cases for `.ci/miri`.
pub fn or_under_miri<T>(normal: T, miri: T) -> T {
    if cfg!(miri) {
        miri
    } else {
        normal
    }
}

/// A proptest configuration with `cases` cases (proptest's default when `None`, which
/// `PROPTEST_CASES` sets), or one under Miri.
pub fn proptest_config(cases: Option<u32>) -> proptest::test_runner::Config {
    let default = proptest::test_runner::Config::default();
    let cases = or_under_miri(cases.unwrap_or(default.cases), 1);
    proptest::test_runner::Config { cases, ..default }
}

/// Test-only data generator: SplitMix64, plus uniform and Box-Muller normal draws.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1), never 0 (safe for `ln`).
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit(), self.unit());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}
