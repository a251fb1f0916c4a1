//! A plan's chain of launches laid out on the host ([`Chain`]): every block's lane words,
//! tables, launch records and level constants, in the order the kernels read them.

use std::ops::Range;
use std::sync::Arc;

use super::{check_expanded, DecodePlan, PlannedChunk};
use crate::error::CudaError;
use crate::ffi::{self, ResolveBlock, ValueBlock, LANES};
use crate::levels::{time_builds, time_placed_builds, LevelCache, LevelConsts, Placer};
use crate::quant::{DequantBatch, DequantBlock, OutLayout};
use crate::rans::{LaneBlock, LaneWords};
use crate::stream::{ChunkLanes, CodedBlock, Destination};

/// A plan as one chain of launches whose inputs are all uploaded at once: the exponent lane
/// decode, table resolution (`kvc_resolve_tables`, skipped by the fused chain), the symbol
/// lane decode, value mapping and dequantization, each reading the previous launches' outputs
/// where they are (on the device, no host round trip).
#[derive(Debug)]
pub(crate) struct Chain<'p> {
    /// Every block's lane words, in order, as the chunks store them (little-endian): borrowed
    /// from the streams, so that an upload copies them once, straight into its staging buffer
    /// ([`Chain::words`] joins them).
    pub word_parts: Vec<LaneWords<'p>>,
    /// Words in `word_parts`.
    pub n_words: usize,
    /// Every table's frequencies, one after another, and per table (its id) where they lie:
    /// the device expands them into the lane decoders' packed tables (`kvc_expand_tables`)
    /// instead of an upload carrying 16 KiB a table ([`Chain::expanded_tables`] on the host).
    pub table_freqs: Vec<u16>,
    pub table_items: Vec<ffi::TableFreqs>,
    /// The last exponent table added, which the next block with the same frequencies shares
    /// (kvc's encoder gives a layer's K and V blocks one).
    last_exp_table: Option<u32>,
    pub table_list: Vec<u32>,
    pub exp_blocks: Vec<LaneBlock>,
    pub n_exps: usize,
    pub sym_blocks: Vec<LaneBlock>,
    pub n_symbols: usize,
    pub map: Vec<u16>,
    pub resolve: Vec<ResolveBlock>,
    pub radius: Vec<u8>,
    /// Every block's escape values, in order, as stored (little-endian i32), borrowed as
    /// `word_parts` are ([`Chain::escapes`] joins them).
    pub escape_parts: Vec<LaneWords<'p>>,
    /// Escapes in `escape_parts`.
    pub n_escapes: usize,
    pub values: Vec<ValueBlock>,
    pub n_q: usize,
    pub dequant: DequantBatch,
    /// Per block, its chunk (for errors).
    pub chunk_of: Vec<usize>,
    /// The chunks whose CRCs are checked at decode.
    pub checks: Vec<ChunkCrc<'p>>,
}

/// A chunk whose CRC (C1) a decode checks: the bytes it covers, the CRC stored after them and
/// the chunk (for errors).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkCrc<'p> {
    pub covered: &'p [u8],
    pub crc: u32,
    pub chunk: usize,
}

impl<'p> Chain<'p> {
    /// Every block's words in one buffer (for the host-run chain).
    pub fn words(&self) -> Vec<u32> {
        self.word_parts.iter().flat_map(|w| w.iter()).collect()
    }

    /// Every block's escapes in one buffer (for the host-run chain).
    pub fn escapes(&self) -> Vec<i32> {
        let parts = self.escape_parts.iter();
        parts.flat_map(|e| e.iter().map(|x| x as i32)).collect()
    }

    /// Adds a table with its radius; returns its id.
    fn add_table(&mut self, t: &codec_core::rans::FreqTable, radius: u8) -> u32 {
        let id = self.radius.len() as u32;
        self.push_freqs(t.freqs());
        self.radius.push(radius);
        id
    }

    /// The id of a block's exponent table `t`: the last exponent table's when it has the same
    /// frequencies, else a new table's.
    fn exp_table_id(&mut self, t: &codec_core::rans::FreqTable) -> u32 {
        if let Some(id) = self.last_exp_table {
            let item = &self.table_items[id as usize];
            let start = item.freq_start as usize;
            if self.table_freqs[start..start + item.n_freqs as usize] == *t.freqs() {
                return id;
            }
        }
        let id = self.add_table(t, 0);
        self.last_exp_table = Some(id);
        id
    }

    /// Appends one table's frequencies (its id the next).
    fn push_freqs(&mut self, freqs: &[u16]) {
        self.table_items.push(ffi::TableFreqs {
            freq_start: self.table_freqs.len() as u64,
            n_freqs: freqs.len() as u32,
            table: self.table_items.len() as u32,
        });
        self.table_freqs.extend_from_slice(freqs);
    }

    /// Every table in the lane decoders' packed form ([`ffi::SLOTS`] entries each) or, when
    /// `compact`, their compact form, expanded from its frequencies by the host-run
    /// `kvc_expand_tables`.
    pub fn expanded_tables(&self, compact: bool) -> Result<Vec<u32>, CudaError> {
        let mut tables = vec![0u32; self.table_items.len() * ffi::table_entries(compact)];
        let mut status = vec![0u32; self.table_items.len()];
        ffi::host_expand_tables(ffi::ExpandIo {
            freqs: &self.table_freqs,
            tables: &mut tables,
            items: &self.table_items,
            status: &mut status,
            compact,
        })?;
        check_expanded(&status)?;
        Ok(tables)
    }

    /// Appends one coded block of `lanes` (its chunk) to every launch of the chain: `level_ids`
    /// are the chunk level's tables, `map_start` and `consts_start` where its (layer, K/V)'s
    /// table map and channel constants start, `dest` where the chunk's output goes.
    fn push_block(
        &mut self,
        lanes: &ChunkLanes<'_>,
        blk: &'p CodedBlock<'p>,
        level_ids: &[u32],
        (map_start, consts_start): (u64, u64),
        dest: Destination,
    ) -> Result<(), CudaError> {
        let n = BlockCounts::of(blk)?;
        let (list_start, list_len) = self.push_table_list(blk, level_ids)?;
        self.push_lane_blocks(blk, &n, list_start, list_len);
        let group = u32::from(lanes.stream().header().group);
        let has_exps = u32::from(blk.exp_table.is_some());
        self.resolve.push(ResolveBlock {
            symbol_start: self.n_symbols as u64,
            exp_start: self.n_exps as u64,
            map_start,
            n_e: n.n_e,
            n_sym: n.n_sym,
            sink_rows: lanes.sink_rows() as u32,
            group,
            has_exps,
            reserved: 0,
        });
        self.values.push(ValueBlock {
            index_start: (self.n_symbols + blk.n_e) as u64,
            list_start: u64::from(list_start),
            escape_start: self.n_escapes as u64,
            q_start: self.n_q as u64,
            n_sym: n.n_sym,
            n_escapes: n.n_escapes,
            list_len,
            reserved: 0,
        });
        self.escape_parts.push(blk.escapes);
        self.n_escapes += blk.escapes.len();
        self.push_dequant_block(lanes, blk, consts_start, dest)?;
        self.n_exps += blk.n_e;
        self.n_symbols += blk.n_e + blk.n_sym;
        self.n_q += blk.n_sym;
        self.chunk_of.push(lanes.chunk());
        Ok(())
    }

    /// Appends the block's table list (its exponent table, or a stand-in, then the level's
    /// tables) and returns where it starts and its length.
    fn push_table_list(
        &mut self,
        blk: &CodedBlock<'_>,
        level_ids: &[u32],
    ) -> Result<(u32, u32), CudaError> {
        let start = u32::try_from(self.table_list.len()).map_err(|_| CudaError::Input {
            what: "over 2^32 table-list entries",
        })?;
        let exp_id = match &blk.exp_table {
            Some(t) => self.exp_table_id(t),
            None => level_ids[0],
        };
        self.table_list.push(exp_id);
        self.table_list.extend_from_slice(level_ids);
        Ok((start, (level_ids.len() + 1) as u32))
    }

    /// Appends the block's two lane decodes, of its exponents and of all its symbols, over
    /// the same words and table list.
    fn push_lane_blocks(
        &mut self,
        blk: &'p CodedBlock<'p>,
        n: &BlockCounts,
        table_start: u32,
        table_count: u32,
    ) {
        let word_start = self.n_words as u64;
        self.word_parts.push(blk.words);
        self.n_words += blk.words.len();
        let block = |symbol_start: usize, n_symbols| LaneBlock {
            word_start,
            symbol_start: symbol_start as u64,
            n_symbols,
            table_start,
            table_count,
            lane_len: n.lane_len,
        };
        self.exp_blocks.push(block(self.n_exps, n.n_e));
        self.sym_blocks.push(block(self.n_symbols, n.n_all));
    }

    /// Appends the block's dequantization into tensor (layer, K/V) of `dest`.
    fn push_dequant_block(
        &mut self,
        lanes: &ChunkLanes<'_>,
        blk: &CodedBlock<'_>,
        consts_start: u64,
        dest: Destination,
    ) -> Result<(), CudaError> {
        let h = lanes.stream().header();
        let block = DequantBlock {
            q_start: self.n_q as u64,
            exp_start: self.n_exps as u64,
            sink_start: 0,
            out_start: dest.tensor_start(blk.layer, blk.kv)?,
            page_start: dest.page_start,
            consts_start,
            rows: lanes.rows() as u32,
            sink_rows: lanes.sink_rows() as u32,
            group: u32::from(h.group),
            has_exps: u32::from(blk.exp_table.is_some()),
            token_start: h.chunks[lanes.chunk()].token_start,
            reserved: 0,
        };
        self.dequant.add_block_external(block, &blk.sink);
        Ok(())
    }
}

/// Those of `chunks` whose CRCs are checked at decode, in order.
pub(super) fn crc_checks<'p>(chunks: &[PlannedChunk<'p>]) -> Vec<ChunkCrc<'p>> {
    let checks = chunks.iter().filter_map(|pc| {
        pc.crc.map(|(covered, crc)| ChunkCrc {
            covered,
            crc,
            chunk: pc.lanes.chunk(),
        })
    });
    checks.collect()
}

/// A coded block's counts as the launches' 32-bit fields hold them.
struct BlockCounts {
    /// Exponent symbols.
    n_e: u32,
    /// Value symbols.
    n_sym: u32,
    /// Both: what the symbol launch decodes.
    n_all: u32,
    /// Escape values.
    n_escapes: u32,
    /// Words per lane.
    lane_len: [u32; LANES],
}

impl BlockCounts {
    fn of(blk: &CodedBlock<'_>) -> Result<Self, CudaError> {
        let input = |what| CudaError::Input { what };
        let mut lane_len = [0u32; LANES];
        for (d, &l) in lane_len.iter_mut().zip(&blk.lane_len) {
            *d = u32::try_from(l).map_err(|_| input("over 2^32 words in a lane"))?;
        }
        let n_e = u32::try_from(blk.n_e).map_err(|_| input("over 2^32 symbols"))?;
        let n_sym = u32::try_from(blk.n_sym).map_err(|_| input("over 2^32 symbols"))?;
        Ok(BlockCounts {
            n_e,
            n_sym,
            n_all: n_e.checked_add(n_sym).ok_or(input("over 2^32 symbols"))?,
            n_escapes: u32::try_from(blk.escapes.len()).map_err(|_| input("over 2^32 escapes"))?,
            lane_len,
        })
    }
}

/// Where one (profile, level)'s constants start in a chain: its tables' ids, and the first of
/// its table maps and of its channel constants (every (layer, K/V)'s, in order).
struct LevelStarts {
    ids: Vec<u32>,
    consts: Arc<LevelConsts>,
    map_base: u64,
    consts_base: u64,
}

/// The (profile, level)s a chain's blocks use so far, each's constants taken from `cache` and
/// appended to the chain once, or placed by `place`.
struct Shared<'c, 'p> {
    cache: &'c LevelCache,
    levels: Vec<((usize, u8), LevelStarts)>,
    place: Option<Placer<'p>>,
}

impl<'c, 'p> Shared<'c, 'p> {
    fn new(cache: &'c LevelCache, place: Option<Placer<'p>>) -> Self {
        Shared {
            cache,
            levels: Vec::new(),
            place,
        }
    }

    /// Where `pc`'s (profile, level) constants start in `ch`, appended the first time.
    fn level(&mut self, ch: &mut Chain<'_>, pc: &PlannedChunk<'_>) -> Result<usize, CudaError> {
        let key = (pc.profile, pc.lanes.level());
        if let Some(i) = self.levels.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let consts = self
            .cache
            .get(pc.lanes.stream().profile(), key.1)
            .map_err(|what| CudaError::Stream {
                chunk: pc.lanes.chunk(),
                what,
            })?;
        let first = ch.radius.len() as u32;
        for range in consts.table_ranges() {
            ch.push_freqs(&consts.freqs[range]);
        }
        ch.radius.extend_from_slice(&consts.radius);
        let ids = (first..first + consts.n_tables() as u32).collect();
        let (map_base, consts_base) = match self.place.as_mut() {
            Some(place) => place(&pc.lanes.stream().profile().hash(), key.1, &consts)?,
            None => {
                let map_base = ch.map.len() as u64;
                ch.map.extend_from_slice(&consts.maps);
                (map_base, ch.dequant.add_consts(&consts.consts))
            }
        };
        let starts = LevelStarts {
            ids,
            consts,
            map_base,
            consts_base,
        };
        self.levels.push((key, starts));
        Ok(self.levels.len() - 1)
    }
}

impl DecodePlan<'_> {
    /// The plan's chain of launches ([`Chain`]).
    pub(crate) fn chain(&self) -> Result<Chain<'_>, CudaError> {
        self.chain_with(&LevelCache::default())
    }

    /// [`chain`](Self::chain), each (profile, level)'s constants taken from `cache` (and kept
    /// there).
    pub(crate) fn chain_with(&self, cache: &LevelCache) -> Result<Chain<'_>, CudaError> {
        self.chain_of(cache, 0..self.chunks.len())
    }

    /// [`chain_with`](Self::chain_with) of the plan's chunks `chunks` alone (the pieces of
    /// [`pieces`](Self::pieces) write disjoint parts of the output, as the whole plan does).
    pub(crate) fn chain_of(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
    ) -> Result<Chain<'_>, CudaError> {
        self.chain_placed(cache, chunks, None)
    }

    /// [`chain_of`](Self::chain_of), each level's table maps and channel constants placed by
    /// `place` instead of appended to the chain (its `map` and channel constants stay empty).
    pub(crate) fn chain_placed(
        &self,
        cache: &LevelCache,
        chunks: Range<usize>,
        place: Option<Placer<'_>>,
    ) -> Result<Chain<'_>, CudaError> {
        if self.heads == 0 || self.head_dim == 0 {
            return Err(CudaError::Input {
                what: "no channels",
            });
        }
        let chunks = self.chunks.get(chunks).ok_or(CudaError::Input {
            what: "chunks past the plan's",
        })?;
        let mut ch = self.empty_chain(chunks);
        ch.checks = crc_checks(chunks);
        let mut shared = Shared::new(cache, place);
        for pc in chunks {
            let at = shared.level(&mut ch, pc)?;
            let level = &shared.levels[at].1;
            for blk in &pc.lanes.blocks {
                let (map, consts) = level.consts.starts(blk.layer, blk.kv);
                let starts = (
                    level.map_base + map as u64,
                    level.consts_base + consts as u64,
                );
                ch.push_block(&pc.lanes, blk, &level.ids, starts, pc.dest)?;
            }
        }
        Ok(ch)
    }

    /// A chain with no blocks yet, with room for all of `chunks`' (and the plan's page
    /// tables).
    fn empty_chain(&self, chunks: &[PlannedChunk<'_>]) -> Chain<'_> {
        let blocks = chunks.iter().map(|pc| pc.lanes.blocks.len()).sum();
        let mut ch = Chain {
            word_parts: Vec::with_capacity(blocks),
            n_words: 0,
            table_freqs: Vec::new(),
            table_items: Vec::new(),
            last_exp_table: None,
            table_list: Vec::new(),
            exp_blocks: Vec::with_capacity(blocks),
            n_exps: 0,
            sym_blocks: Vec::with_capacity(blocks),
            n_symbols: 0,
            map: Vec::new(),
            resolve: Vec::with_capacity(blocks),
            radius: Vec::new(),
            escape_parts: Vec::with_capacity(blocks),
            n_escapes: 0,
            values: Vec::with_capacity(blocks),
            n_q: 0,
            dequant: DequantBatch::with_output(self.heads, self.head_dim, self.output),
            chunk_of: Vec::with_capacity(blocks),
            checks: Vec::new(),
        };
        if matches!(self.output.layout, OutLayout::Paged { .. }) {
            ch.dequant.add_page_table(&self.page_tables);
        }
        // Room for every block's sink rows at once (no regrowth while copying).
        let all_blocks = || chunks.iter().flat_map(|pc| &pc.lanes.blocks);
        let sink = all_blocks().map(|b| b.sink.len()).sum();
        ch.dequant.reserve_external(blocks, sink);
        ch
    }

    #[cfg(feature = "internals")]
    /// For benches: the seconds `reps` builds of the plan's chain of launches take on the host
    /// (the first step of every `Gpu` upload): with `kept`, each (profile, level)'s constants
    /// built before the first and kept, as a `Gpu` keeps them after its first call; without,
    /// built in every build, as in a `Gpu`'s first call.
    pub fn time_chain(&self, reps: usize, kept: bool) -> Result<f64, CudaError> {
        time_builds(reps, kept, |cache| self.chain_with(cache))
    }

    #[cfg(feature = "internals")]
    /// For benches: [`time_chain`](Self::time_chain) with the constants kept and each level's
    /// table maps and channel constants resident where the chain's launches read them (as a
    /// `Gpu` keeps them on its device after its first call): the host's part of every later
    /// call, without copying them into the chain.
    pub fn time_chain_resident(&self, reps: usize) -> Result<f64, CudaError> {
        let all = 0..self.chunks.len();
        time_placed_builds(reps, |cache, place| {
            self.chain_placed(cache, all.clone(), Some(place))
        })
    }
}
