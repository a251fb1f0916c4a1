//! Batches for the rANS lane decode kernel (`kernels/rans_decode.cu`, spec/FORMAT.md §6.3): many
//! coded blocks, each with its lanes' words and one table per symbol, decoded in one launch.
//!
//! A [`LaneBatch`] holds the kernel's buffers exactly as it reads them: all words one after the
//! other, the tables packed (one `u32` per slot: symbol, frequency, `slot - cdf`), per block the
//! list of tables it uses and per symbol an index into that list. [`LaneBatch::decode_host`] runs
//! the kernel's own source compiled for the CPU; its output is what the device computes.

use codec_core::rans::{FreqTable, RansError};

use crate::error::CudaError;
use crate::ffi::{self, LANES, SLOTS};

/// Lane words as a stream stores them (spec/FORMAT.md §5.2): little-endian 32-bit words,
/// borrowed from the chunk's bytes. A decode plan gathers these bytes into its upload as they
/// are (the device reads little-endian words), with no copy on the host before.
///
/// ```
/// use codec_cuda::rans::LaneWords;
///
/// let stored = [0x78, 0x56, 0x34, 0x12, 1, 0, 0, 0];
/// let words = LaneWords::from_le_bytes(&stored).unwrap();
/// assert_eq!(words.to_vec(), [0x1234_5678, 1]);
/// assert!(LaneWords::from_le_bytes(&stored[..7]).is_none());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneWords<'b> {
    bytes: &'b [u8],
}

impl<'b> LaneWords<'b> {
    /// The words stored in `bytes`, or `None` if its length is not a multiple of 4.
    pub fn from_le_bytes(bytes: &'b [u8]) -> Option<Self> {
        bytes.len().is_multiple_of(4).then_some(LaneWords { bytes })
    }

    /// Words.
    pub fn len(&self) -> usize {
        self.bytes.len() / 4
    }

    /// Whether there are no words.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The words' bytes as stored.
    pub fn as_le_bytes(&self) -> &'b [u8] {
        self.bytes
    }

    /// The words in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u32> + 'b {
        self.bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The words in a vector.
    pub fn to_vec(self) -> Vec<u32> {
        self.iter().collect()
    }
}

/// A table added to a [`LaneBatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableId(u32);

/// A block's place in its batch's buffers (`KvcLaneBlock`). Any values are safe to launch: the
/// kernel checks them and reports [`LaneStatus::BadRange`] or [`LaneStatus::BadTable`].
///
/// `#[repr(C)]`: the kernel reads it as is (`src/ffi/`, invariant 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneBlock {
    /// Index of lane 0's first word; lane `l`'s words follow lane `l - 1`'s.
    pub word_start: u64,
    /// Index of the block's symbol 0 in the batch's symbols.
    pub symbol_start: u64,
    /// Symbols in the block; symbol `p` is lane `p % 32`'s.
    pub n_symbols: u32,
    /// The block's tables are `table_list[table_start..table_start + table_count]`.
    pub table_start: u32,
    /// See `table_start`.
    pub table_count: u32,
    /// Words per lane.
    pub lane_len: [u32; LANES],
}

/// How a lane ended (`KvcLaneStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LaneStatus {
    /// Every symbol decoded, every word read, final state 0.
    Ok,
    /// The lane's last word is 0; nothing decoded ([`RansError::ZeroFinalWord`]).
    ZeroFinalWord,
    /// Words left after the last symbol ([`RansError::TrailingData`]).
    TrailingData,
    /// Final state not 0 ([`RansError::BadFinalState`]).
    BadFinalState,
    /// The block's table list or a symbol's table index is out of range; the lane stopped there.
    BadTable,
    /// The block's words or symbols lie outside the batch; nothing decoded.
    BadRange,
    /// A code the kernel does not define (never written by the kernel).
    Unknown(u32),
}

impl LaneStatus {
    fn from_code(code: u32) -> Self {
        match code {
            0 => LaneStatus::Ok,
            1 => LaneStatus::ZeroFinalWord,
            2 => LaneStatus::TrailingData,
            3 => LaneStatus::BadFinalState,
            4 => LaneStatus::BadTable,
            5 => LaneStatus::BadRange,
            c => LaneStatus::Unknown(c),
        }
    }

    /// codec-core's error for this status of lane `lane`, if it has one.
    pub fn rans_error(self, lane: usize) -> Option<RansError> {
        match self {
            LaneStatus::ZeroFinalWord => Some(RansError::ZeroFinalWord { lane }),
            LaneStatus::TrailingData => Some(RansError::TrailingData { lane }),
            LaneStatus::BadFinalState => Some(RansError::BadFinalState { lane }),
            _ => None,
        }
    }
}

/// The lane of a block that decides its outcome, and its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneFailure {
    /// The lane.
    pub lane: usize,
    /// Its status (never [`LaneStatus::Ok`]).
    pub status: LaneStatus,
}

/// The buffers of one lane-decode launch; see the module documentation.
#[derive(Clone, Debug, Default)]
pub struct LaneBatch {
    words: Vec<u32>,
    tables: Vec<u32>,
    table_list: Vec<u32>,
    symbol_table: Vec<u16>,
    blocks: Vec<LaneBlock>,
}

impl LaneBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `table` in the kernel's packed form (16 KiB).
    pub fn add_table(&mut self, table: &FreqTable) -> TableId {
        let id = TableId((self.tables.len() / SLOTS) as u32);
        self.tables.extend(packed_table(table));
        id
    }

    /// Adds a block: `words` holds its lanes' words one lane after another (`lane_len[l]` each,
    /// in stored order), and `tables[p]` is the table of symbol `p`. Returns the block's index.
    pub fn add_block(
        &mut self,
        words: &[u32],
        lane_len: [usize; LANES],
        tables: &[TableId],
    ) -> Result<usize, CudaError> {
        self.push_block(words.len(), lane_len, tables, |w| {
            w.extend_from_slice(words)
        })
    }

    /// [`add_block`](Self::add_block) with the words as a stream stores them.
    pub fn add_stored_block(
        &mut self,
        words: LaneWords<'_>,
        lane_len: [usize; LANES],
        tables: &[TableId],
    ) -> Result<usize, CudaError> {
        self.push_block(words.len(), lane_len, tables, |w| w.extend(words.iter()))
    }

    /// Adds a block of `n_words` words, which `append` appends to the batch's words.
    fn push_block(
        &mut self,
        n_words: usize,
        lane_len: [usize; LANES],
        tables: &[TableId],
        append: impl FnOnce(&mut Vec<u32>),
    ) -> Result<usize, CudaError> {
        let input = |what| CudaError::Input { what };
        if lane_len.iter().try_fold(0usize, |a, &l| a.checked_add(l)) != Some(n_words) {
            return Err(input("lane lengths do not add up to the words given"));
        }
        let n_tables = (self.tables.len() / SLOTS) as u32;
        if tables.iter().any(|t| t.0 >= n_tables) {
            return Err(input("a symbol's table is not in the batch"));
        }
        let n_symbols = u32::try_from(tables.len()).map_err(|_| input("over 2^32 symbols"))?;
        let mut lens = [0u32; LANES];
        for (d, &l) in lens.iter_mut().zip(&lane_len) {
            *d = u32::try_from(l).map_err(|_| input("over 2^32 words in a lane"))?;
        }
        let table_start = u32::try_from(self.table_list.len())
            .map_err(|_| input("over 2^32 table-list entries"))?;
        let (list, index) = block_tables(tables).ok_or(input("over 65536 tables in a block"))?;
        self.blocks.push(LaneBlock {
            word_start: self.words.len() as u64,
            symbol_start: self.symbol_table.len() as u64,
            n_symbols,
            table_start,
            table_count: list.len() as u32,
            lane_len: lens,
        });
        append(&mut self.words);
        self.table_list.extend(list);
        self.symbol_table.extend(index);
        Ok(self.blocks.len() - 1)
    }

    /// The blocks.
    pub fn blocks(&self) -> &[LaneBlock] {
        &self.blocks
    }

    /// The blocks, for tests that corrupt them (the kernel checks every field).
    pub fn blocks_mut(&mut self) -> &mut [LaneBlock] {
        &mut self.blocks
    }

    /// Per symbol, its table's index in its block's table list (mutable, for tests).
    pub fn symbol_tables_mut(&mut self) -> &mut [u16] {
        &mut self.symbol_table
    }

    /// All blocks' words (mutable, for tests that corrupt them).
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    /// The launch's input buffers.
    pub(crate) fn buffers(&self) -> LaneBuffers<'_> {
        LaneBuffers {
            words: &self.words,
            tables: &self.tables,
            table_list: &self.table_list,
            symbol_table: &self.symbol_table,
            blocks: &self.blocks,
        }
    }

    /// A launch's output as [`LaneDecoded`].
    pub(crate) fn decoded(&self, symbols: Vec<u8>, status: Vec<u32>) -> LaneDecoded {
        LaneDecoded::new(symbols, status, self.blocks.clone())
    }

    /// Bytes of every block's lane words (4 per word): the coded payload of the batch.
    pub fn payload_bytes(&self) -> usize {
        self.words.len() * 4
    }

    /// Decodes every block with the kernel compiled for the host, `shared_tables` (at most
    /// [`LaneShape::MAX_SHARED_TABLES`]) tables per block staged in shared memory, one block per
    /// CUDA block.
    pub fn decode_host(&self, shared_tables: u32) -> Result<LaneDecoded, CudaError> {
        self.decode_host_shaped(LaneShape::new(1, shared_tables)?)
    }

    /// Decodes every block with the kernel compiled for the host, launched in `shape`.
    pub fn decode_host_shaped(&self, shape: LaneShape) -> Result<LaneDecoded, CudaError> {
        let (symbols, status) = decode_host_parts(
            &self.words,
            (&self.tables, &self.table_list, &self.symbol_table),
            &self.blocks,
            shape,
        )?;
        Ok(self.decoded(symbols, status))
    }
}

/// How a lane-decode launch is shaped: the coded blocks each CUDA block holds (one warp of 32
/// threads each) and the tables each of them stages in shared memory. The symbols and statuses
/// are the same in every shape; it only changes how a device schedules the work.
///
/// ```
/// use codec_cuda::LaneShape;
///
/// let shape = LaneShape::new(4, 2)?;
/// assert_eq!((shape.warps(), shape.shared_tables()), (4, 2));
/// // At most LaneShape::MAX_SHARED_TABLES tables per CUDA block, at most 32 warps.
/// assert!(LaneShape::new(8, 2).is_err());
/// assert!(LaneShape::new(33, 0).is_err());
/// assert!(LaneShape::new(0, 0).is_err());
/// # Ok::<(), codec_cuda::CudaError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneShape {
    warps: u32,
    shared_tables: u32,
}

impl LaneShape {
    /// Most warps (coded blocks) per CUDA block: 1024 threads.
    pub const MAX_WARPS: u32 = 32;

    /// Most tables a CUDA block stages in shared memory (16 KiB each), over all its warps:
    /// blocks with at most their share of tables read them from shared memory, others from
    /// global memory.
    pub const MAX_SHARED_TABLES: u32 = 14;

    /// A device's lane decodes by default ([`crate::Gpu`]): one coded block per CUDA block and
    /// no table in shared memory, every table read through the L1/L2 cache. Measured on an
    /// H100 (codec-cuda/README.md), the fixture's 47 M symbols decode in 0.71 ms this way and
    /// in 2.23 ms with 2 tables staged per block (the 32 KiB of shared memory per 32-thread
    /// block left few blocks per SM, and staging reads 16 KiB per table and block).
    pub const DEFAULT: LaneShape = LaneShape {
        warps: 1,
        shared_tables: 0,
    };

    /// `warps` coded blocks per CUDA block (1 to [`Self::MAX_WARPS`]), each staging
    /// `shared_tables` tables (16 KiB each) in shared memory: at most
    /// [`LaneShape::MAX_SHARED_TABLES`] tables per CUDA block in all.
    pub fn new(warps: u32, shared_tables: u32) -> Result<Self, CudaError> {
        let input = |what| Err(CudaError::Input { what });
        if warps == 0 || warps > Self::MAX_WARPS {
            return input("lane-decode warps per block outside 1..=32");
        }
        if u64::from(warps) * u64::from(shared_tables) > u64::from(LaneShape::MAX_SHARED_TABLES) {
            return input("more shared tables than a device's shared memory holds");
        }
        Ok(LaneShape {
            warps,
            shared_tables,
        })
    }

    /// Coded blocks per CUDA block.
    pub const fn warps(self) -> u32 {
        self.warps
    }

    /// Tables each coded block stages in shared memory.
    pub const fn shared_tables(self) -> u32 {
        self.shared_tables
    }

    /// Threads per CUDA block.
    pub(crate) fn threads(self) -> u32 {
        self.warps * LANES as u32
    }

    /// Dynamic shared memory per CUDA block, in bytes (at most 14 tables of 16 KiB).
    pub(crate) fn shared_bytes(self) -> u32 {
        self.warps * self.shared_tables * SLOTS as u32 * 4
    }
}

/// A lane batch's buffers (words of either width; tables, table lists and per-symbol table
/// indices; blocks) decoded by the host build of its kernel launched in `shape`: the symbols
/// and every lane's status.
pub(crate) fn decode_host_parts<W: ffi::LaneWord>(
    words: &[W],
    (tables, table_list, symbol_table): (&[u32], &[u32], &[u16]),
    blocks: &[LaneBlock],
    shape: LaneShape,
) -> Result<(Vec<u8>, Vec<u32>), CudaError> {
    let mut symbols = vec![0u8; symbol_table.len()];
    let mut status = vec![0u32; blocks.len() * LANES];
    ffi::host_lane_decode(ffi::LaneDecodeIo {
        compact: false,
        words,
        tables,
        table_list,
        symbol_table,
        blocks,
        symbols: &mut symbols,
        status: &mut status,
        shape,
    })?;
    Ok((symbols, status))
}

/// A [`LaneBatch`]'s buffers, as a device upload reads them.
#[derive(Debug)]
pub(crate) struct LaneBuffers<'a, W = u32> {
    pub words: &'a [W],
    pub tables: &'a [u32],
    pub table_list: &'a [u32],
    pub symbol_table: &'a [u16],
    pub blocks: &'a [LaneBlock],
}

/// The output of a lane-decode launch.
#[derive(Clone, Debug)]
pub struct LaneDecoded {
    symbols: Vec<u8>,
    status: Vec<LaneStatus>,
    blocks: Vec<LaneBlock>,
}

impl LaneDecoded {
    /// A launch's symbols and status codes over `blocks`.
    pub(crate) fn new(symbols: Vec<u8>, status: Vec<u32>, blocks: Vec<LaneBlock>) -> Self {
        LaneDecoded {
            symbols,
            status: status.into_iter().map(LaneStatus::from_code).collect(),
            blocks,
        }
    }

    /// Block `b`'s decoded symbols (empty for a block whose range was out of the batch). A lane
    /// that stopped early leaves its remaining symbols 0.
    pub fn symbols(&self, b: usize) -> &[u8] {
        let Some(blk) = self.blocks.get(b) else {
            return &[];
        };
        let start = usize::try_from(blk.symbol_start).unwrap_or(usize::MAX);
        let end = start.saturating_add(blk.n_symbols as usize);
        self.symbols.get(start..end).unwrap_or(&[])
    }

    /// Block `b`'s lane statuses.
    pub fn status(&self, b: usize) -> &[LaneStatus] {
        self.status.get(b * LANES..(b + 1) * LANES).unwrap_or(&[])
    }

    /// Block `b`'s outcome as codec-core's `LaneDecoder` reports it: the lowest lane whose last
    /// word is 0 (checked before any decoding), else the lowest lane with another failure.
    pub fn outcome(&self, b: usize) -> Result<(), LaneFailure> {
        let status = self.status(b);
        let failure = |(lane, &status): (usize, &LaneStatus)| LaneFailure { lane, status };
        let zero = status
            .iter()
            .enumerate()
            .find(|s| *s.1 == LaneStatus::ZeroFinalWord);
        let first = status.iter().enumerate().find(|s| *s.1 != LaneStatus::Ok);
        match zero.or(first) {
            Some(f) => Err(failure(f)),
            None => Ok(()),
        }
    }
}

/// A table in the kernel's packed form: per slot, the symbol (bits 0..8), its frequency (bits
/// 8..20) and the slot's offset from the symbol's cumulative frequency (bits 20..32).
pub(crate) fn packed_table(table: &FreqTable) -> Vec<u32> {
    let mut out = Vec::with_capacity(SLOTS);
    for (s, &f) in table.freqs().iter().enumerate() {
        out.extend((0..u32::from(f)).map(|k| s as u32 | u32::from(f) << 8 | k << 20));
    }
    out
}

/// The value-table map of `(layer, kv)` at `level` as the chain kernels read it: entry
/// `(kind * 16 + e) * C + ch` is the table-list index of a value symbol of row kind `kind` (0
/// anchor, 1 delta), step exponent `e` and channel `ch` (§6.1), in a list whose entry 0 is the
/// block's exponent table and entry `1 + t` the level's table `t`.
pub(crate) fn value_table_map(
    profile: &codec_core::Profile,
    level: u8,
    layer: u32,
    kv: usize,
) -> Vec<u16> {
    // Per exponent, every table's table at that exponent (a map entry is one of them), so that
    // the 2 x 16 x C entries are plain lookups.
    let n = profile.level_tables(level).tables.len().min(256);
    let at: Vec<u16> = (0..16u8)
        .flat_map(|e| (0..n).map(move |b| 1 + u16::from(profile.table_at(level, b as u8, e))))
        .collect();
    let mut map = Vec::with_capacity(2 * 16 * profile.channels());
    for kind in 0..2 {
        let bases = profile.table_map(level, layer, kv, kind);
        for row in at.chunks_exact(n.max(1)) {
            // A profile names only its level's tables (P22); u16::MAX, beyond any table list,
            // would make the kernel report the block otherwise.
            map.extend(
                bases
                    .iter()
                    .map(|&b| row.get(usize::from(b)).copied().unwrap_or(u16::MAX)),
            );
        }
    }
    map
}

/// A block's distinct tables in order of first use, and each symbol's index among them;
/// `None` beyond 65536 distinct tables.
fn block_tables(tables: &[TableId]) -> Option<(Vec<u32>, Vec<u16>)> {
    let mut list: Vec<u32> = Vec::new();
    let mut slot_of = std::collections::HashMap::new();
    let mut index = Vec::with_capacity(tables.len());
    for t in tables {
        let i = match slot_of.get(&t.0) {
            Some(&i) => i,
            None => {
                let i = u16::try_from(list.len()).ok()?;
                list.push(t.0);
                slot_of.insert(t.0, i);
                i
            }
        };
        index.push(i);
    }
    Some((list, index))
}
