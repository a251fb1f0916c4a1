//! A chain's inputs queued to the device on one stream, without a synchronization: the
//! step that [`Gpu::upload_plan`] and the decode in pieces share.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PinnedHostSlice};

use super::from_host::{WordSource, Words};
use super::resident::LevelViews;
use super::Gpu;
use crate::decode::{check_crcs, check_expanded, check_gather, Chain, ChunkCrc};
use crate::error::CudaError;
use crate::ffi::{self, DevBuf, PackSlot, LANES};
use crate::quant::{ChannelConsts, DequantBlock};
use crate::rans::{LaneBlock, LaneWords};

/// A chain's inputs queued on a stream ([`Gpu::queue_chain`]), its outputs in place.
#[derive(Debug)]
pub(super) struct QueuedChain {
    pub dev: ffi::ChainDev,
    /// Every status of the chain, of its word gather and of its chunk checks (and the
    /// exponents' table indices, which must be zero), zeroed, in one allocation: read back in
    /// one copy.
    pub statuses: Arc<CudaSlice<u8>>,
    /// The word gather's and the chunk checks' statuses (words copied as they lie only).
    gathered: Option<[DevBuf<u32>; 2]>,
    /// The table expansion's statuses.
    expanded: DevBuf<u32>,
    /// The statuses a verdict reads (all but the exponents' table indices) and how: the
    /// exponent lanes' first.
    judged: DevBuf<u32>,
    rule: ffi::VerdictRule,
    /// The bytes copied as they lie, which the word gather and the chunk checks read: kept
    /// until they have run. Dropping a device buffer queues, on the stream that made it (the
    /// copy stream, in pieces), a wait for the launches reading it: dropped in
    /// [`Gpu::queue_chain`], it held the next piece's upload behind this piece's gather,
    /// itself queued behind the launches of the piece two back.
    raw: Option<DevBuf<u8>>,
}

impl QueuedChain {
    /// The table expansion's and the word gather's statuses, then the CRCs of `crcs` (the
    /// chain's chunks checked at decode) by the chunk checks' statuses, as `bytes` (the
    /// statuses copied back) hold them.
    pub fn check_gathered(&self, bytes: &[u8], crcs: &[ChunkCrc<'_>]) -> Result<(), CudaError> {
        check_expanded(&self.expanded.read_in(bytes)?)?;
        if let Some([gather, crc]) = &self.gathered {
            check_gather(&gather.read_in(bytes)?)?;
            check_crcs(crcs, &crc.read_in(bytes)?)?;
        }
        Ok(())
    }

    /// Queues the chain's verdict on `s`, after its launches, into `verdict` (a zeroed word of
    /// [`Verdicts`]): 0 stays when every status the checks read passes them. Only a chain
    /// with another verdict needs its statuses read back to name what failed.
    pub fn judge(
        &self,
        s: &Arc<CudaStream>,
        judge: &CudaFunction,
        verdict: &DevBuf<u32>,
    ) -> Result<(), CudaError> {
        ffi::launch_chain_verdict(s, judge, &self.judged, self.rule, verdict)
    }

    /// Frees the bytes copied as they lie, once the word gather and the chunk checks have run
    /// (the caller has synchronized with them).
    pub fn free_raw(&mut self) {
        self.raw = None;
    }

    /// [`check_gathered`](Self::check_gathered) with only the table expansion's, the word
    /// gather's and the chunk checks' statuses copied back on `s` (synchronized).
    pub fn check_gathered_on(
        &self,
        s: &Arc<CudaStream>,
        crcs: &[ChunkCrc<'_>],
    ) -> Result<(), CudaError> {
        check_expanded(&self.expanded.download_part(s)?)?;
        if let Some([gather, crc]) = &self.gathered {
            check_gather(&gather.download_part(s)?)?;
            check_crcs(crcs, &crc.download_part(s)?)?;
        }
        Ok(())
    }

    /// The chain's statuses (exponent lanes, table resolution, symbol lanes, values,
    /// dequantization; the fused chain's table resolution's stay 0) as `bytes` hold them.
    pub fn chain_statuses(&self, bytes: &[u8]) -> Result<[Vec<u32>; 5], CudaError> {
        let d = &self.dev;
        Ok([
            d.lanes_exp.status.read_in(bytes)?,
            d.resolve_status.read_in(bytes)?,
            d.sym_status.read_in(bytes)?,
            d.value_status.read_in(bytes)?,
            d.dequant.status.read_in(bytes)?,
        ])
    }
}

/// Where a chain's statuses lie in their one zeroed allocation.
struct ChainStatuses {
    base: Arc<CudaSlice<u8>>,
    exp_tables: PackSlot<u16>,
    exp: PackSlot<u32>,
    resolve: PackSlot<u32>,
    sym: PackSlot<u32>,
    value: PackSlot<u32>,
    dequant: PackSlot<u32>,
    gather: PackSlot<u32>,
    crc: PackSlot<u32>,
    expand: PackSlot<u32>,
    /// From the exponent lanes' statuses to the end: what a verdict reads.
    judged: PackSlot<u32>,
}

impl ChainStatuses {
    /// Zeroed room on `s` for the statuses of `ch` (`dq_blocks` dequantization blocks, its
    /// tables' expansion), of `n_parts` gather parts and of `n_checks` chunk checks.
    fn new(
        s: &Arc<CudaStream>,
        ch: &Chain<'_>,
        dq_blocks: usize,
        (n_parts, n_checks): (usize, usize),
    ) -> Result<Self, CudaError> {
        let mut z = ffi::Packer::default();
        let exp_tables = z.reserve(ch.n_exps);
        let exp = z.reserve(ch.exp_blocks.len() * LANES);
        let resolve = z.reserve(ch.resolve.len());
        let sym = z.reserve(ch.sym_blocks.len() * LANES);
        let value = z.reserve(ch.values.len());
        let dequant = z.reserve(dq_blocks);
        let (gather, crc) = (z.reserve(n_parts), z.reserve(n_checks));
        let expand = z.reserve(ch.table_items.len());
        let judged = exp.up_to(z.reserve(0));
        let base = s
            .alloc_zeros::<u8>(z.total())
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        Ok(ChainStatuses {
            base: Arc::new(base),
            exp_tables,
            exp,
            resolve,
            sym,
            value,
            dequant,
            gather,
            crc,
            expand,
            judged,
        })
    }

    fn view(&self, slot: PackSlot<u32>) -> Result<DevBuf<u32>, CudaError> {
        DevBuf::view(&self.base, slot)
    }
}

/// Where a chain's inputs other than its words lie in its packed upload
/// ([`PackedChain::add`]).
struct PackedChain {
    table_freqs: PackSlot<u16>,
    table_items: PackSlot<ffi::TableFreqs>,
    table_list: PackSlot<u32>,
    exp_blocks: PackSlot<LaneBlock>,
    sym_blocks: PackSlot<LaneBlock>,
    resolve: PackSlot<ffi::ResolveBlock>,
    radius: PackSlot<u8>,
    values: PackSlot<ffi::ValueBlock>,
    sink: PackSlot<f32>,
    /// The chain's own table maps and channel constants, when no resident ones are given.
    own_levels: Option<(PackSlot<u16>, PackSlot<ChannelConsts>)>,
    pages: PackSlot<u32>,
    dq_blocks: PackSlot<DequantBlock>,
}

impl PackedChain {
    /// The chain's table maps and channel constants: the resident `levels` given, else its
    /// own in the upload `base`.
    fn level_views(
        &self,
        levels: Option<LevelViews>,
        base: &Arc<CudaSlice<u8>>,
    ) -> Result<LevelViews, CudaError> {
        match (levels, self.own_levels) {
            (Some(views), _) => Ok(views),
            (None, Some((map, consts))) => {
                Ok((DevBuf::view(base, map)?, DevBuf::view(base, consts)?))
            }
            (None, None) => Err(CudaError::Input {
                what: "a chain without level constants",
            }),
        }
    }

    /// Adds `ch`'s inputs to `p` (`io` its dequantization's, `own_levels` whether its table
    /// maps and channel constants go too), and says where its words and escapes go: words
    /// copied as they lie (`source`) are queued on `s` now, before the packed upload, whose
    /// filling overlaps that copy (unless the source holds them queued on `s` already).
    fn add<'a>(
        p: &mut ffi::Packer<'a>,
        ch: &'a Chain<'_>,
        io: &ffi::DequantIo<'a>,
        source: WordSource<'a>,
        s: &Arc<CudaStream>,
        own_levels: bool,
    ) -> Result<(Words, Self), CudaError> {
        let bytes = |parts: &[LaneWords<'a>]| -> Vec<&'a [u8]> {
            parts.iter().map(|w| w.as_le_bytes()).collect()
        };
        let words = match source {
            WordSource::Packed => Words::Packed(
                p.add_bytes_as::<u32>(&bytes(&ch.word_parts)),
                p.add_bytes_as::<i32>(&bytes(&ch.escape_parts)),
            ),
            WordSource::Raw {
                raw,
                places,
                copied,
            } => Words::Raw(
                match copied {
                    Some(queued) => queued,
                    None => DevBuf::upload_runs(s, raw, places.runs.runs())?,
                },
                (p.add(&places.parts), places.word_parts),
                p.add(&places.checks),
            ),
        };
        let packed = PackedChain {
            table_freqs: p.add(&ch.table_freqs),
            table_items: p.add(&ch.table_items),
            table_list: p.add(&ch.table_list),
            exp_blocks: p.add(&ch.exp_blocks),
            sym_blocks: p.add(&ch.sym_blocks),
            resolve: p.add(&ch.resolve),
            radius: p.add(&ch.radius),
            values: p.add(&ch.values),
            sink: p.add(io.sink),
            own_levels: own_levels.then(|| (p.add(&ch.map), p.add(io.consts))),
            pages: p.add(io.pages),
            dq_blocks: p.add(io.blocks),
        };
        Ok((words, packed))
    }
}

/// Where a chain's large outputs lie in its scratch slot.
struct ChainScratch {
    exps: PackSlot<u8>,
    /// Only for the five-launch chain (the fused one finds the tables through the table maps).
    sym_table: Option<PackSlot<u16>>,
    symbols: PackSlot<u8>,
    q: PackSlot<i32>,
    bytes: usize,
}

impl ChainScratch {
    fn reserve(ch: &Chain<'_>, fused: bool) -> Self {
        let mut o = ffi::Packer::default();
        let exps = o.reserve::<u8>(ch.n_exps);
        let sym_table = (!fused).then(|| o.reserve::<u16>(ch.n_symbols));
        let symbols = o.reserve::<u8>(ch.n_symbols);
        let q = o.reserve::<i32>(ch.n_q);
        ChainScratch {
            exps,
            sym_table,
            symbols,
            q,
            bytes: o.total(),
        }
    }
}

/// A chain's lane words and escapes on the device, with (words copied as they lie) the word
/// gather's and chunk checks' statuses and the bytes they read.
type PlacedWords = (
    (DevBuf<u32>, DevBuf<i32>),
    Option<[DevBuf<u32>; 2]>,
    Option<DevBuf<u8>>,
);

impl Gpu {
    /// Queues every input of `ch`'s launches on `s` in one packed upload through `staging`
    /// (see [`ffi::Packer::queue`]; the caller keeps `staging` until `s` has passed it); its
    /// launches' large outputs in scratch slot `slot`. On `launch_on` (the stream the
    /// caller launches the chain on, `s` or one that waits for it), every status zeroed in
    /// one allocation and, with words copied as they lie, the word gather and the chunk
    /// checks once `s` has copied them: `s` only moves bytes (no memset either, which the
    /// device runs as a kernel), so that a copy stream's next upload does not wait behind
    /// kernels. With `levels`, the chain's table maps and channel constants are those
    /// resident arrays ([`Gpu::resident_chain`]); without, the chain's own, packed. The chain runs fused if this `Gpu` decodes fused now
    /// ([`Gpu::set_decode_chain_fused`]).
    pub(super) fn queue_chain(
        &self,
        ch: &Chain<'_>,
        source: WordSource<'_>,
        (s, staging): (&Arc<CudaStream>, &mut Option<PinnedHostSlice<u8>>),
        slot: usize,
        levels: Option<LevelViews>,
        launch_on: &Arc<CudaStream>,
    ) -> Result<QueuedChain, CudaError> {
        let io = ch.dequant.io(&mut [], &mut []);
        let mut p = ffi::Packer::default();
        let (words, packed) = PackedChain::add(&mut p, ch, &io, source, s, levels.is_none())?;
        let base = p.queue(s, staging, self.upload_threads)?;
        // What `launch_on` runs first reads what `s` has just queued.
        if !Arc::ptr_eq(s, launch_on) {
            ffi::wait_event(launch_on, &ffi::record_event(s, false)?)?;
        }
        let gather_counts = match &words {
            Words::Packed(..) => (0, 0),
            Words::Raw(_, (parts, _), checks) => (parts.len(), checks.len()),
        };
        let z = ChainStatuses::new(launch_on, ch, io.blocks.len(), gather_counts)?;
        let ((words, escapes), gathered, raw) =
            self.place_words(ch, words, &base, launch_on, &z)?;
        let tables = self.expand_tables(&packed, &base, launch_on, &z)?;
        let o = ChainScratch::reserve(ch, self.fused);
        let x = &self.scratch(slot, o.bytes, launch_on)?;
        let (map, consts) = packed.level_views(levels, &base)?;
        let b = &base;
        let dev = ffi::ChainDev {
            lanes_exp: ffi::LaneDecodeDev {
                words,
                tables,
                table_list: DevBuf::view(b, packed.table_list)?,
                symbol_table: DevBuf::view(&z.base, z.exp_tables)?,
                blocks: DevBuf::view(b, packed.exp_blocks)?,
                symbols: DevBuf::view(x, o.exps)?,
                status: z.view(z.exp)?,
                compact: self.compact_tables,
            },
            sym_blocks: DevBuf::view(b, packed.sym_blocks)?,
            sym_table: o.sym_table.map(|t| DevBuf::view(x, t)).transpose()?,
            symbols: DevBuf::view(x, o.symbols)?,
            sym_status: z.view(z.sym)?,
            map,
            resolve: DevBuf::view(b, packed.resolve)?,
            resolve_status: z.view(z.resolve)?,
            radius: DevBuf::view(b, packed.radius)?,
            escapes,
            q: DevBuf::view(x, o.q)?,
            values: DevBuf::view(b, packed.values)?,
            value_status: z.view(z.value)?,
            dequant: ffi::DequantDev {
                q: DevBuf::zeros(launch_on, 0)?,
                exps: DevBuf::zeros(launch_on, 0)?,
                sink: DevBuf::view(b, packed.sink)?,
                consts,
                pages: DevBuf::view(b, packed.pages)?,
                blocks: DevBuf::view(b, packed.dq_blocks)?,
                status: z.view(z.dequant)?,
                heads: io.heads,
                head_dim: io.head_dim,
                page_size: io.page_size,
            },
            heads: io.heads,
            head_dim: io.head_dim,
        };
        Ok(QueuedChain {
            dev,
            judged: z.view(z.judged)?,
            rule: ffi::VerdictRule {
                lenient: z.exp.len(),
                lenient_below: crate::decode::EXP_LANES_FAIL_FROM,
            },
            expanded: z.view(z.expand)?,
            statuses: z.base,
            gathered,
            raw,
        })
    }

    /// `ch`'s lane words and escapes on the device: packed, views of the upload `base`; or
    /// copied as they lie (raw), gathered on `l` (which waits for the copies) into buffers of
    /// their own, the chunks' CRCs checked beside, into `z`'s statuses.
    fn place_words(
        &self,
        ch: &Chain<'_>,
        words: Words,
        base: &Arc<CudaSlice<u8>>,
        l: &Arc<CudaStream>,
        z: &ChainStatuses,
    ) -> Result<PlacedWords, CudaError> {
        let (raw, (parts, n_word_parts), checks) = match words {
            Words::Packed(words, escapes) => {
                let placed = (DevBuf::view(base, words)?, DevBuf::view(base, escapes)?);
                return Ok((placed, None, None));
            }
            Words::Raw(raw, parts, checks) => (raw, parts, checks),
        };
        let (parts, checks) = (DevBuf::view(base, parts)?, DevBuf::view(base, checks)?);
        let k = self.kernels(None)?;
        // Both in one zeroed allocation: one allocation and memset a piece, not two.
        let mut o = ffi::Packer::default();
        let (w, e) = (o.reserve::<u32>(ch.n_words), o.reserve::<i32>(ch.n_escapes));
        let gathered = l.alloc_zeros::<u8>(o.total());
        let gathered = Arc::new(gathered.map_err(ffi::driver_err("cuMemAllocAsync"))?);
        let (words, escapes) = (DevBuf::view(&gathered, w)?, DevBuf::view(&gathered, e)?);
        let (gather, crc) = (z.view(z.gather)?, z.view(z.crc)?);
        let io = ffi::GatherDev {
            raw: &raw,
            words: &words,
            escapes: &escapes,
            parts: &parts,
            n_word_parts,
            status: &gather,
        };
        ffi::launch_gather_words(l, &k.gather_words, io)?;
        ffi::launch_check_chunks(l, &k.check_chunks, &raw, &checks, &crc)?;
        Ok(((words, escapes), Some([gather, crc]), Some(raw)))
    }
}

impl Gpu {
    /// The chain's tables, expanded on `l` (which waits for the upload `base`) from the
    /// frequencies `packed` placed there into a buffer of their own (in the compact form if
    /// this `Gpu` reads compact tables now), a status each into `z`'s.
    fn expand_tables(
        &self,
        packed: &PackedChain,
        base: &Arc<CudaSlice<u8>>,
        l: &Arc<CudaStream>,
        z: &ChainStatuses,
    ) -> Result<DevBuf<u32>, CudaError> {
        let items = DevBuf::view(base, packed.table_items)?;
        let compact = self.compact_tables;
        let tables = DevBuf::zeros(l, items.len() * ffi::table_entries(compact))?;
        let freqs = DevBuf::view(base, packed.table_freqs)?;
        let k = self.kernels(None)?;
        let status = z.view(z.expand)?;
        let (from, to) = ((&freqs, &items), (&tables, compact));
        ffi::launch_expand_tables(l, &k.expand_tables, from, to, &status)?;
        Ok(tables)
    }
}

/// The verdicts of a decode's chains ([`QueuedChain::judge`]): a zeroed word each, in one
/// allocation, read back in one copy.
pub(super) struct Verdicts {
    base: Arc<CudaSlice<u8>>,
    words: Vec<DevBuf<u32>>,
}

impl Verdicts {
    /// `n` zeroed words on `s`.
    pub fn new(s: &Arc<CudaStream>, n: usize) -> Result<Self, CudaError> {
        let mut p = ffi::Packer::default();
        let slots: Vec<PackSlot<u32>> = (0..n).map(|_| p.reserve(1)).collect();
        let base = s
            .alloc_zeros::<u8>(p.total().max(1))
            .map_err(ffi::driver_err("cuMemAllocAsync"))?;
        let base = Arc::new(base);
        let words = slots.into_iter().map(|w| DevBuf::view(&base, w));
        Ok(Verdicts {
            words: words.collect::<Result<_, _>>()?,
            base,
        })
    }

    /// Chain `i`'s word.
    pub fn word(&self, i: usize) -> Result<&DevBuf<u32>, CudaError> {
        self.words.get(i).ok_or(CudaError::Input {
            what: "a chain past the verdicts",
        })
    }

    /// Whether every chain decoded: every word, copied back on `s` (synchronized), still 0.
    pub fn all_passed(&self, s: &Arc<CudaStream>) -> Result<bool, CudaError> {
        Ok(ffi::download_base(s, &self.base)?.iter().all(|&b| b == 0))
    }
}
