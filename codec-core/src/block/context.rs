//! What a chunk's blocks are coded against besides their own bytes: the stream's shape, dtype,
//! positions, group size and profile (`spec/FORMAT.md` §5.1).

use crate::consts::group_is_valid;
use crate::error::EncodeError;
use crate::kv::{Dtype, KvShape, Rope};
use crate::profile::Profile;

/// Everything a chunk encoder or decoder needs besides the chunk itself. Built only by
/// [`ChunkContext::new`], which checks that the parts agree, so encoding and decoding a chunk
/// check only the chunk.
#[derive(Clone, Debug)]
pub struct ChunkContext<'p> {
    shape: KvShape,
    dtype: Dtype,
    first_position: u64,
    group: u32,
    n_sink: u16,
    profile: &'p Profile,
    rope: Rope,
    query_position: Option<u64>,
}

impl<'p> ChunkContext<'p> {
    /// The context of a stream of `shape` (its token count is not used) and `dtype` whose token 0
    /// is at absolute position `first_position`, coded in groups of `group` tokens with the
    /// tokens at absolute positions below `n_sink` stored exactly, against `profile`. `rope` is
    /// the cache's rotary setting (the encoder's importance policy rotates with it).
    ///
    /// Fails if `group` is not in `1..=1024` or `profile` was learned for another
    /// `(layers, kv_heads, head_dim)`.
    pub fn new(
        shape: KvShape,
        dtype: Dtype,
        first_position: u64,
        group: u32,
        n_sink: u16,
        profile: &'p Profile,
        rope: Rope,
    ) -> Result<Self, EncodeError> {
        if !group_is_valid(group) {
            let got = u64::from(group);
            return Err(EncodeError::InvalidParam { what: "group", got });
        }
        let p = profile;
        if (p.layers(), p.kv_heads(), p.head_dim())
            != (shape.layers, shape.kv_heads, shape.head_dim)
        {
            return Err(EncodeError::ProfileShape {
                profile: [p.layers(), p.kv_heads(), p.head_dim()],
                input: [shape.layers, shape.kv_heads, shape.head_dim],
            });
        }
        Ok(ChunkContext {
            shape,
            dtype,
            first_position,
            group,
            n_sink,
            profile,
            rope,
            query_position: None,
        })
    }

    /// Encoder only: the absolute position of the queries that will read the cache (usually the
    /// position after the stream's last token), which turns on the token-importance step policy
    /// (`spec/FORMAT.md` §9.2) when the profile carries its hints; `None` (the default) codes
    /// uniform steps.
    pub fn with_query_position(mut self, position: Option<u64>) -> Self {
        self.query_position = position;
        self
    }

    /// Shape of the stream.
    pub fn shape(&self) -> KvShape {
        self.shape
    }
    /// Dtype of the source; sink rows are stored in it.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// The profile.
    pub fn profile(&self) -> &'p Profile {
        self.profile
    }
    /// Token-group size.
    pub fn group(&self) -> usize {
        self.group as usize
    }
    /// The cache's rotary setting.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }
    /// The position of the queries the importance policy codes for, if it is on.
    pub fn query_position(&self) -> Option<u64> {
        self.query_position
    }

    /// Absolute position of stream token `token`.
    pub fn position(&self, token: u32) -> u64 {
        self.first_position.saturating_add(u64::from(token))
    }

    /// Number of leading rows of a chunk of `rows` tokens starting at stream token
    /// `token_start` that are sink rows (§5.3).
    pub fn sink_rows(&self, token_start: u32, rows: u32) -> usize {
        let pos = self.position(token_start);
        (u64::from(self.n_sink).saturating_sub(pos)).min(u64::from(rows)) as usize
    }
}
