//! Caller-set limits checked by the decoder before anything is allocated (`spec/FORMAT.md`, "Limits").

/// Limits a decoder enforces on untrusted input. Every count read from a stream or profile is
/// checked against these and against the bytes actually present before it is used to size an
/// allocation. The defaults accept any cache up to 2^32 decoded elements (16 GiB of f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Maximum number of layers.
    pub max_layers: u32,
    /// Maximum `kv_heads * head_dim`.
    pub max_channels: u32,
    /// Maximum number of tokens in a stream.
    pub max_tokens: u32,
    /// Maximum number of chunks in a stream.
    pub max_chunks: u32,
    /// Maximum number of decoded elements (`layers * 2 * tokens * channels`) of a stream: all
    /// its chunks, whether decoded whole or a chunk at a time.
    pub max_elements: u64,
    /// Maximum size of a profile in bytes (embedded or separate).
    pub max_profile_bytes: u64,
}

impl Limits {
    /// Generous defaults suitable for servers decoding trusted-size caches.
    pub const DEFAULT: Limits = Limits {
        max_layers: 1024,
        max_channels: 1 << 16,
        max_tokens: 1 << 24,
        max_chunks: 1 << 20,
        max_elements: 1 << 32,
        max_profile_bytes: 1 << 28,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}
