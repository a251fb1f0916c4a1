//! Batches for the PQ search kernel (`kernels/pq_search.cu`, spec/PQ.md §5): for many queries
//! (or GQA groups of query heads) over pq-core's packed codes, the score table, every token's
//! score and the selected token indices, one CUDA block per query, bit for bit
//! `pq_core::search(codes, &group_score_table(queries, codebook), k, n_init, n_local)`.
//!
//! Every query of a batch shares one codebook shape (method, key dim, books, bits); each may use
//! its own codebook (a (layer, KV head)) and see its own prefix of that head's tokens.

use pq_core::{packed_len, Codebook, Method};

use crate::error::CudaError;
use crate::ffi;

/// A query's place in its batch's buffers (`KvcPqQuery`). Any values are safe to launch: the
/// kernel checks them and reports [`PqStatus::BadRange`]. `#[repr(C)]`: the kernel reads it as
/// is (`src/ffi/`, invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PqQuery {
    /// Index of head 0's dim 0 in the batch's query values.
    pub query_start: u64,
    /// Index of book 0's codeword 0 in the batch's codewords.
    pub codebook_start: u64,
    /// Index of the byte holding token 0's first code in the batch's packed codes.
    pub codes_start: u64,
    /// Index of the query's ranking keys in the scratch buffer.
    pub keys_start: u64,
    /// Index of the selection in the output.
    pub out_start: u64,
    /// Tokens the query sees.
    pub tokens: u32,
    /// Query heads in the GQA group (>= 1).
    pub group_heads: u32,
    /// Tokens chosen by score outside the windows.
    pub k: u32,
    /// The first `n_init` tokens are always chosen.
    pub n_init: u32,
    /// The last `n_local` tokens are always chosen.
    pub n_local: u32,
    /// Unused (0).
    pub reserved: u32,
}

/// How a query ended (`KvcPqStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PqStatus {
    /// Selection written.
    Ok,
    /// The query's ranges lie outside the batch; nothing written.
    BadRange,
    /// The batch's codebook shape is invalid or its table does not fit; nothing written.
    BadShape,
    /// A code the kernel does not define (never written by the kernel).
    Unknown(u32),
}

/// A head (codebook and packed codes) added to a [`PqBatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadId(usize);

/// Where a head's data lies in the batch.
#[derive(Clone, Copy, Debug)]
struct HeadPlace {
    codebook_start: u64,
    codes_start: u64,
    tokens: usize,
    /// Tokens its codes have room for (>= `tokens`; [`PqBatch::add_head_with_room`]).
    capacity: usize,
    /// The byte of its codes holding the last code's high bits, when that code ends inside
    /// it (the room after it is zero): what an append ORs its first bits into.
    tail: u8,
}

/// What a query that sees all of its head's tokens asked for, kept so that it sees the tokens
/// appended after them too ([`PqBatch::append_tokens`]), its windows and k clamped anew.
#[derive(Clone, Copy, Debug)]
struct Follow {
    head: usize,
    k: usize,
    n_init: usize,
    n_local: usize,
}

/// The buffers of one PQ search launch.
#[derive(Clone, Debug)]
pub struct PqBatch {
    method: Method,
    dim: u32,
    queries: Vec<f32>,
    codewords: Vec<f32>,
    codes: Vec<u8>,
    /// The books, bits, heads and query records.
    layout: PqLayout,
    keys_len: usize,
    out_len: usize,
}

/// Table entries (`m * 2^bits`) the kernel's shared memory holds (32 KiB; pq-core's default,
/// `m = 2`, `b = 6`, has 128).
pub const MAX_TABLE_ENTRIES: u32 = 8192;

impl PqBatch {
    /// An empty batch for codebooks shaped like `codebook` (method, key dim, books, bits).
    pub fn new(codebook: &Codebook) -> Result<Self, CudaError> {
        let input = |what| CudaError::Input { what };
        let m = u32::try_from(codebook.m()).map_err(|_| input("too many books"))?;
        let dim = u32::try_from(codebook.dim()).map_err(|_| input("key dim over 2^32"))?;
        let bits = u32::from(codebook.bits());
        if u64::from(m) << bits > u64::from(MAX_TABLE_ENTRIES) {
            return Err(input(
                "m * 2^bits table entries exceed the kernel's shared memory",
            ));
        }
        Ok(PqBatch {
            method: codebook.method(),
            dim,
            queries: Vec::new(),
            codewords: Vec::new(),
            codes: Vec::new(),
            layout: PqLayout {
                m,
                bits,
                items: Vec::new(),
                heads: Vec::new(),
                follows: Vec::new(),
            },
            keys_len: 0,
            out_len: 0,
        })
    }

    /// Adds a head: its codebook (shaped as the batch's) and the packed codes of its first
    /// `tokens` keys (`pq_core::pack` of `[tokens, m]` codes; spec/PQ.md §2). Checks the length
    /// and that the padding bits are zero, as `pq_core::unpack` does.
    pub fn add_head(
        &mut self,
        codebook: &Codebook,
        packed: &[u8],
        tokens: usize,
    ) -> Result<HeadId, CudaError> {
        self.add_head_with_room(codebook, packed, tokens, 0)
    }

    /// [`add_head`](Self::add_head) with room for the codes of `room` more tokens after them,
    /// which [`append_tokens`](Self::append_tokens) (and [`Gpu::append_pq`](crate::Gpu::append_pq)
    /// on an uploaded batch) fills in place, a decode step's new key at a time.
    pub fn add_head_with_room(
        &mut self,
        codebook: &Codebook,
        packed: &[u8],
        tokens: usize,
        room: usize,
    ) -> Result<HeadId, CudaError> {
        let input = |what| CudaError::Input { what };
        if codebook.method() != self.method
            || codebook.dim() != self.dim as usize
            || codebook.m() != self.layout.m as usize
            || u32::from(codebook.bits()) != self.layout.bits
        {
            return Err(input("a codebook shaped unlike the batch's"));
        }
        let n = tokens
            .checked_mul(self.layout.m as usize)
            .ok_or(input("too many codes"))?;
        let len = packed_len(n, codebook.bits()).map_err(|_| input("too many codes"))?;
        if packed.len() != len {
            return Err(input(
                "packed codes are not ceil(tokens * m * bits / 8) bytes",
            ));
        }
        let used_bits = n as u64 * u64::from(self.layout.bits);
        if !used_bits.is_multiple_of(8) {
            let last = packed[len - 1];
            if last >> (used_bits % 8) != 0 {
                return Err(input("non-zero padding after the last code"));
            }
        }
        let capacity = tokens.checked_add(room).ok_or(input("too many codes"))?;
        if u32::try_from(capacity).is_err() {
            return Err(input("over 2^32 tokens in a head"));
        }
        let room_len = capacity
            .checked_mul(self.layout.m as usize)
            .and_then(|n| packed_len(n, codebook.bits()).ok())
            .ok_or(input("too many codes"))?;
        let heads = &mut self.layout.heads;
        heads.push(HeadPlace {
            codebook_start: self.codewords.len() as u64,
            codes_start: self.codes.len() as u64,
            tokens,
            capacity,
            tail: if used_bits.is_multiple_of(8) {
                0
            } else {
                packed[len - 1]
            },
        });
        self.codewords.extend_from_slice(codebook.centroids());
        self.codes.extend_from_slice(packed);
        self.codes.resize(self.codes.len() + (room_len - len), 0);
        Ok(HeadId(heads.len() - 1))
    }

    /// Appends the codes of more tokens to `head` (`[n, m]` codes, token-major, each below
    /// `2^bits`, as `pq_core::pack` takes them) within the room it was added with. Every query
    /// that saw all of the head's tokens sees the new ones too, its `k`, `n_init` and
    /// `n_local` as it asked, clamped to its tokens anew; the others are unchanged. An error
    /// (codes of part of a token, a code too large, no room, no such head) changes nothing.
    pub fn append_tokens(&mut self, head: HeadId, codes: &[u16]) -> Result<(), CudaError> {
        let (at, bytes) = self.layout.append(head, codes)?;
        // `append` checked that the bytes lie in the head's room.
        let at = at as usize;
        self.codes[at..at + bytes.len()].copy_from_slice(&bytes);
        Ok(())
    }

    /// Adds a query over the first `tokens` tokens of `head`: `queries` is `[G, D]` (the `G >= 1`
    /// query heads of a GQA group, or one query), finite. Returns the query's index.
    pub fn add_query(
        &mut self,
        head: HeadId,
        queries: &[f32],
        tokens: usize,
        k: usize,
        n_init: usize,
        n_local: usize,
    ) -> Result<usize, CudaError> {
        let input = |what| CudaError::Input { what };
        let place = *self.layout.heads.get(head.0).ok_or(input("no such head"))?;
        if tokens > place.tokens {
            return Err(input("a query sees more tokens than its head holds"));
        }
        let d = self.dim as usize;
        if queries.is_empty() || !queries.len().is_multiple_of(d) {
            return Err(input("queries are not one or more rows of the key dim"));
        }
        if !queries.iter().all(|x| x.is_finite()) {
            return Err(input("a query value is not finite"));
        }
        let group_heads =
            u32::try_from(queries.len() / d).map_err(|_| input("too many query heads"))?;
        // A query over all of a head with room follows its appends: its scratch keys and
        // selection are reserved for the head's capacity.
        let follow = (tokens == place.tokens && place.capacity > place.tokens).then_some(Follow {
            head: head.0,
            k,
            n_init,
            n_local,
        });
        let reserved = follow.map_or(tokens, |_| place.capacity);
        let windows = |tokens: usize| (tokens, k, n_init, n_local);
        let mut item = PqQuery {
            query_start: self.queries.len() as u64,
            codebook_start: place.codebook_start,
            codes_start: place.codes_start,
            keys_start: self.keys_len as u64,
            out_start: self.out_len as u64,
            group_heads,
            ..PqQuery::default()
        };
        set_windows(&mut item, windows(reserved));
        let out_len = selection_len(&item);
        set_windows(&mut item, windows(tokens));
        self.queries.extend_from_slice(queries);
        self.keys_len += reserved;
        self.out_len += out_len;
        self.layout.items.push(item);
        self.layout.follows.push(follow);
        Ok(self.layout.items.len() - 1)
    }

    /// Replaces the values of every query (all of the batch's query values, `[G, D]` per
    /// query in the order the queries were added) with `values`, e.g. the next decode step's
    /// queries over the same heads and tokens: as many, finite.
    pub fn set_query_values(&mut self, values: &[f32]) -> Result<(), CudaError> {
        check_query_values(self.queries.len(), values)?;
        self.queries.copy_from_slice(values);
        Ok(())
    }

    /// The queries (for tests that corrupt them; the kernel checks every field).
    pub fn queries_mut(&mut self) -> &mut [PqQuery] {
        &mut self.layout.items
    }

    /// Queries in the batch.
    pub fn len(&self) -> usize {
        self.layout.items.len()
    }

    /// Whether the batch has no query.
    pub fn is_empty(&self) -> bool {
        self.layout.items.is_empty()
    }

    /// The launch's buffers, as the kernel reads them.
    pub(crate) fn io<'a>(
        &'a self,
        keys: &'a mut [u32],
        out: &'a mut [u32],
        status: &'a mut [u32],
    ) -> ffi::PqIo<'a> {
        ffi::PqIo {
            queries: &self.queries,
            codewords: &self.codewords,
            codes: &self.codes,
            keys,
            out,
            items: &self.layout.items,
            status,
            dim: self.dim,
            m: self.layout.m,
            bits: self.layout.bits,
            residual: u32::from(self.method == Method::Residual),
        }
    }

    /// Scratch keys and output lengths of a launch.
    pub(crate) fn lens(&self) -> (usize, usize) {
        (self.keys_len, self.out_len)
    }

    /// Runs the kernel compiled for the host: each query's selection (ascending token indices)
    /// and status (an empty selection for a query that is not [`PqStatus::Ok`]). Every
    /// query's ranking keys are kept in shared memory, as on a device with room for them.
    pub fn search_host(&self) -> Result<PqSelected, CudaError> {
        self.search_host_keeping(u32::MAX)
    }

    /// As [`search_host`](Self::search_host), with the ranking keys of the queries of at most
    /// `shared_keys` tokens in shared memory and the others' in the scratch buffer (as
    /// [`Gpu::set_pq_shared_keys`](crate::Gpu::set_pq_shared_keys) sets it for a device): the
    /// selections are the same either way.
    pub fn search_host_keeping(&self, shared_keys: u32) -> Result<PqSelected, CudaError> {
        let shape = self.shape(shared_keys, u64::MAX)?;
        let mut keys = vec![0u32; self.keys_len];
        let mut out = vec![0u32; self.out_len];
        let mut status = vec![0u32; self.layout.items.len()];
        ffi::host_pq_search(self.io(&mut keys, &mut out, &mut status), shape)?;
        Ok(self.selected(out, status))
    }

    /// The launch's shape with at most `shared_keys` ranking keys per query in shared memory
    /// and `shared_budget` bytes of it per block.
    pub(crate) fn shape(
        &self,
        shared_keys: u32,
        shared_budget: u64,
    ) -> Result<ffi::PqShape, CudaError> {
        self.layout.shape(shared_keys, shared_budget)
    }

    /// The launch's output as selections.
    pub(crate) fn selected(&self, out: Vec<u32>, status: Vec<u32>) -> PqSelected {
        self.layout.selected(out, status)
    }

    /// What a search needs of the batch besides its buffers (kept by an uploaded batch).
    pub(crate) fn layout(&self) -> &PqLayout {
        &self.layout
    }
}

/// A batch's shape, heads and query records, without its buffers: how a launch over it is
/// shaped, its output read and its heads grown.
#[derive(Clone, Debug)]
pub(crate) struct PqLayout {
    m: u32,
    bits: u32,
    items: Vec<PqQuery>,
    heads: Vec<HeadPlace>,
    /// Per query, whether it follows its head's appends.
    follows: Vec<Option<Follow>>,
}

impl PqLayout {
    /// The query records, as the kernel reads them.
    pub(crate) fn items(&self) -> &[PqQuery] {
        &self.items
    }

    /// Appends `codes` to `head` ([`PqBatch::append_tokens`]): the head and the queries that
    /// follow it grown, and the bytes of the batch's codes that change (from the index
    /// returned), which lie in the head's room. An error changes nothing.
    pub(crate) fn append(
        &mut self,
        head: HeadId,
        codes: &[u16],
    ) -> Result<(u64, Vec<u8>), CudaError> {
        let input = |what| CudaError::Input { what };
        let place = self.heads.get(head.0).ok_or(input("no such head"))?;
        let m = self.m as usize;
        if !codes.len().is_multiple_of(m) {
            return Err(input("appended codes are not whole tokens of m codes"));
        }
        let n = codes.len() / m;
        if n > place.capacity - place.tokens {
            return Err(input("appended tokens past the head's room"));
        }
        if codes.iter().any(|&c| u32::from(c) >> self.bits != 0) {
            return Err(input("an appended code of more than the batch's bits"));
        }
        let first_bit = place.tokens as u64 * m as u64 * u64::from(self.bits);
        let (bytes, tail) = pack_after(codes, self.bits, (first_bit % 8) as u32, place.tail);
        let at = place.codes_start + first_bit / 8;
        let place = &mut self.heads[head.0];
        place.tokens += n;
        place.tail = tail;
        let tokens = place.tokens;
        for (item, follow) in self.items.iter_mut().zip(&self.follows) {
            if let Some(f) = follow.filter(|f| f.head == head.0) {
                set_windows(item, (tokens, f.k, f.n_init, f.n_local));
            }
        }
        Ok((at, bytes))
    }

    /// The launch's shape with at most `shared_keys` ranking keys per query in shared memory
    /// and `shared_budget` bytes of it per block.
    pub(crate) fn shape(
        &self,
        shared_keys: u32,
        shared_budget: u64,
    ) -> Result<ffi::PqShape, CudaError> {
        let max_tokens = self.items.iter().map(|q| q.tokens).max().unwrap_or(0);
        ffi::PqShape::new(max_tokens, self.m, self.bits, shared_keys, shared_budget)
    }

    /// A launch's output as selections.
    pub(crate) fn selected(&self, out: Vec<u32>, status: Vec<u32>) -> PqSelected {
        PqSelected {
            out,
            status: status.into_iter().map(status_of).collect(),
            items: self.items.clone(),
        }
    }
}

/// An input error unless `values` are `len` finite query values.
pub(crate) fn check_query_values(len: usize, values: &[f32]) -> Result<(), CudaError> {
    if values.len() != len {
        return Err(CudaError::Input {
            what: "query values not as many as the batch's",
        });
    }
    if !values.iter().all(|x| x.is_finite()) {
        return Err(CudaError::Input {
            what: "a query value is not finite",
        });
    }
    Ok(())
}

fn status_of(code: u32) -> PqStatus {
    match code {
        0 => PqStatus::Ok,
        1 => PqStatus::BadRange,
        2 => PqStatus::BadShape,
        c => PqStatus::Unknown(c),
    }
}

/// Sets a query's tokens, and its k and windows as asked, clamped to them (tokens below 2^32,
/// as the head's capacity is).
fn set_windows(q: &mut PqQuery, (tokens, k, n_init, n_local): (usize, usize, usize, usize)) {
    let clamp = |x: usize| u32::try_from(x.min(tokens)).unwrap_or(u32::MAX);
    q.tokens = clamp(tokens);
    q.k = clamp(k);
    q.n_init = clamp(n_init);
    q.n_local = clamp(n_local);
}

/// `codes` of `bits` each packed as `pq_core::pack` packs them, from bit `shift` (0-7) of a
/// first byte holding `tail` below it: the bytes from that one on, and the last byte when the
/// last code ends inside it (else 0).
fn pack_after(codes: &[u16], bits: u32, shift: u32, tail: u8) -> (Vec<u8>, u8) {
    let mut out = Vec::with_capacity((shift as usize + codes.len() * bits as usize).div_ceil(8));
    // Pending bits: at most 7 plus one code of at most 16.
    let (mut acc, mut n) = (u32::from(tail) & ((1 << shift) - 1), shift);
    for &c in codes {
        acc |= u32::from(c) << n;
        n += bits;
        while n >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            n -= 8;
        }
    }
    if n > 0 {
        out.push(acc as u8);
        return (out, acc as u8);
    }
    (out, 0)
}

/// Entries of a query's selection: `min(n_init, T) + min(k, rest) + (T - local_start)`.
fn selection_len(q: &PqQuery) -> usize {
    let t = q.tokens;
    let init_end = q.n_init.min(t);
    let local_start = (t - q.n_local.min(t)).max(init_end);
    let k = q.k.min(local_start - init_end);
    (init_end + k + (t - local_start)) as usize
}

/// The output of a PQ search launch.
#[derive(Clone, Debug)]
pub struct PqSelected {
    out: Vec<u32>,
    status: Vec<PqStatus>,
    items: Vec<PqQuery>,
}

impl PqSelected {
    /// Query `i`'s selected tokens, ascending (empty unless its status is [`PqStatus::Ok`]).
    pub fn tokens(&self, i: usize) -> &[u32] {
        let (Some(q), Some(PqStatus::Ok)) = (self.items.get(i), self.status.get(i)) else {
            return &[];
        };
        let start = usize::try_from(q.out_start).unwrap_or(usize::MAX);
        let end = start.saturating_add(selection_len(q));
        self.out.get(start..end).unwrap_or(&[])
    }

    /// Query `i`'s status.
    pub fn status(&self, i: usize) -> Option<PqStatus> {
        self.status.get(i).copied()
    }

    /// Queries.
    pub fn len(&self) -> usize {
        self.status.len()
    }

    /// Whether there is no query.
    pub fn is_empty(&self) -> bool {
        self.status.is_empty()
    }
}
