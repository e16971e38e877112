//! Stage 3: sort the keys of one SparseCore, merge duplicates, apply the per-partition limits and
//! count the statistics (SPEC 3.6, 3.7).
//!
//! After sorting, entries come in (bucket, partition, local embedding id, row) order. One walk
//! then:
//! - merges repeated (row, column) pairs of one sample by adding their gains in sorted order;
//! - counts, per destination partition, the de-duplicated ids and the distinct columns (the FDO
//!   statistics are taken here: after de-duplication, before dropping);
//! - with `allow_id_dropping`, keeps only a prefix of each partition: the first `max_ids` pairs
//!   whose column is among the first `max_unique` columns, counting every raw occurrence it
//!   drops.

pub(crate) mod bucket;
mod sort;

use sort::{sort_chunk, sort_keys, sort_packed_chunk, RadixScratch};

use crate::extracted::Extracted;
use crate::gain::merge;
use crate::key::{Gains, KeyFormat, KeyWord};
use crate::reuse::reserve_to;
use crate::spec::{round_up, ALIGNMENT};

/// One de-duplicated, kept entry, ready for the fill stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    /// Stacked column id: partition in the low `log2 N` bits, local embedding id above.
    pub col: u32,
    /// Device-level sample row.
    pub row: u32,
    /// Combined gain.
    pub gain: f32,
}

/// Limits of one stack, as the walk applies them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Max de-duplicated ids per partition.
    pub max_ids: u32,
    /// Max distinct ids per partition.
    pub max_unique: u32,
    /// Drop what exceeds the limits (otherwise keep everything; the driver reports the excess).
    pub drop: bool,
}

/// Statistics of one SparseCore for one stack.
#[derive(Debug, Default, Clone)]
pub struct ScStats {
    /// De-duplicated ids sent to each partition (before dropping).
    pub ids: Vec<u32>,
    /// Distinct ids sent to each partition (before dropping).
    pub unique: Vec<u32>,
    /// Ids dropped by the limits (every raw occurrence).
    pub dropped: u64,
}

impl ScStats {
    /// Buffer this SparseCore needs: Σ over partitions of ids rounded up to 8.
    pub fn required(&self) -> u64 {
        self.ids.iter().map(|&n| round_up(n as u64, ALIGNMENT as u64)).sum()
    }

    /// Largest per-partition id count and its partition.
    pub fn max_ids(&self) -> (u32, usize) {
        max_with_index(&self.ids)
    }

    /// Largest per-partition distinct-id count and its partition.
    pub fn max_unique(&self) -> (u32, usize) {
        max_with_index(&self.unique)
    }
}

fn max_with_index(v: &[u32]) -> (u32, usize) {
    let mut best = (0, 0);
    for (i, &x) in v.iter().enumerate() {
        if x > best.0 {
            best = (x, i);
        }
    }
    best
}

/// Where the grouping walk sends kept entries: a `Vec` (stats runs, tests) or a COO segment
/// written directly (the fill stage's `SegmentWriter`), so that the common path never
/// materialises the entries.
pub trait EntrySink {
    /// Appends a kept entry.
    fn push(&mut self, entry: Entry);
    /// Appends a kept entry given as partition and local embedding id (the column's two
    /// halves, which is how the walk has it); sinks that need only the halves override this.
    #[inline(always)]
    fn push_parts(&mut self, partition: u32, local: u32, nbits: u32, row: u32, gain: f32) {
        self.push(Entry { col: (local << nbits) | partition, row, gain });
    }
    /// Adds a duplicate's gain to the last appended entry.
    fn add_to_last(&mut self, gain: f32);
    /// Announces that the entries pushed next belong to `partition` (partitions arrive in
    /// order), for sinks that track the partition themselves. By value, so that a sink held in
    /// registers by the walk stays there.
    #[inline(always)]
    fn start_partition(self, _partition: u32) -> Self
    where
        Self: Sized,
    {
        self
    }
    /// Appends an entry of the partition last announced by
    /// [`EntrySink::start_partition`] (which is also passed, for sinks that do not track it).
    #[inline(always)]
    fn push_local(&mut self, partition: u32, local: u32, nbits: u32, row: u32, gain: f32) {
        self.push_parts(partition, local, nbits, row, gain);
    }
    /// How many more entries of the current partition can certainly be appended without
    /// overflowing, which is what lets the walk call [`EntrySink::walk_block`].
    #[inline(always)]
    fn room(&self) -> usize {
        usize::MAX
    }
    /// Walks `keys`, sorted keys of one partition (as [`Block`] describes them), continuing
    /// after the key `last`: a key equal to the one before it merges its gain into that entry,
    /// any other appends an entry. `gain` gives an element's gain from the element and its
    /// payload (unused when `block.unit`). Called with at most [`EntrySink::room`] keys.
    /// Returns the last key, and how many entries and distinct columns the block added.
    ///
    /// About a third of the keys of real batches are duplicates, in no pattern a branch
    /// predictor can learn, so sinks that can merge without a branch override this.
    #[inline(always)]
    fn walk_block<K: KeyWord>(&mut self, keys: &[K], block: Block, last: u64, gain: impl Fn(u64, u32) -> f32) -> (u64, u32, u32)
    where
        Self: Sized,
    {
        walk_block_plain(self, keys, block, last, gain)
    }
}

/// A run of one partition's sorted keys, as [`EntrySink::walk_block`] reads them.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    /// ORed into every element's key (a chunk's top bits).
    pub high: u64,
    /// Shift from an element to its key (32 when a gain is packed below the key).
    pub element_shift: u32,
    /// Bits of the payload.
    pub data_bits: u32,
    /// Mask of the local id, once shifted down by `data_bits`.
    pub local_mask: u64,
    /// log2 N.
    pub nbits: u32,
    /// The partition of every key.
    pub partition: u32,
    /// Row of payload 0: a key's row is `row_lo + payload`.
    pub row_lo: u32,
    /// Payloads are below this.
    pub row_span: u32,
    /// Every gain is 1.0 (the sum combiner without weights).
    pub unit: bool,
}

/// [`EntrySink::walk_block`] through `push_local` and `add_to_last`.
#[inline(always)]
pub fn walk_block_plain<S: EntrySink, K: KeyWord>(
    sink: &mut S,
    keys: &[K],
    b: Block,
    mut last: u64,
    gain: impl Fn(u64, u32) -> f32,
) -> (u64, u32, u32) {
    let dmask = (1u64 << b.data_bits) - 1;
    let (mut ids, mut unique) = (0u32, 0u32);
    for &k in keys {
        let element = k.to_u64();
        let key = (element >> b.element_shift) | b.high;
        let data = (key & dmask) as u32;
        let g = if b.unit { 1.0 } else { gain(element, data) };
        if key == last {
            sink.add_to_last(g);
            continue;
        }
        ids += 1;
        unique += ((key ^ last) >> b.data_bits != 0) as u32;
        sink.push_local(b.partition, ((key >> b.data_bits) & b.local_mask) as u32, b.nbits, b.row_lo + data, g);
        last = key;
    }
    (last, ids, unique)
}

impl EntrySink for Vec<Entry> {
    #[inline(always)]
    fn push(&mut self, entry: Entry) {
        Vec::push(self, entry);
    }
    #[inline(always)]
    fn add_to_last(&mut self, gain: f32) {
        if let Some(last) = self.last_mut() {
            last.gain = merge(last.gain, gain);
        }
    }
}

/// Sort memory, reused across batches: the chunks of [`sort::split`] with their bounds, and the
/// radix sort's second buffers for both key widths.
#[derive(Debug, Default)]
pub struct SortScratch {
    wide: RadixScratch<u64>,
    narrow: RadixScratch<u32>,
    chunks: Vec<u32>,
    /// The chunks of packed keys wider than 32 bits.
    packed: Vec<u64>,
    starts: Vec<u32>,
    cursors: Vec<u32>,
}

impl SortScratch {
    /// Grows every buffer to at least `other`'s capacity.
    pub fn reserve_like(&mut self, other: &SortScratch) {
        self.wide.reserve_like(&other.wide);
        self.narrow.reserve_like(&other.narrow);
        for (mine, theirs) in [(&mut self.chunks, &other.chunks), (&mut self.starts, &other.starts), (&mut self.cursors, &other.cursors)] {
            reserve_to(mine, theirs.capacity());
        }
        reserve_to(&mut self.packed, other.packed.capacity());
    }
}

/// Sorts the extracted keys, then walks them into `out` (cleared first) and `stats`.
#[cfg(feature = "internals")]
pub fn sort_and_group(ex: &mut Extracted, scratch: &mut SortScratch, limits: Limits, out: &mut Vec<Entry>, stats: &mut ScStats) {
    out.clear();
    *out = sort_and_walk(ex, scratch, limits, std::mem::take(out), stats);
}

/// Sorts the extracted keys and runs the walk of SPEC 3.7 over them, sending kept entries to
/// `sink`, which is taken by value (so that its state stays in registers) and handed back.
/// Large key sets are sorted chunk by chunk (see [`sort::split`]), each chunk walked right
/// after its sort, while it is in cache.
pub fn sort_and_walk<S: EntrySink>(ex: &mut Extracted, scratch: &mut SortScratch, limits: Limits, sink: S, stats: &mut ScStats) -> S {
    let n = 1usize << ex.format.nbits;
    stats.ids.clear();
    stats.ids.resize(n, 0);
    stats.unique.clear();
    stats.unique.resize(n, 0);
    stats.dropped = 0;
    // Gains come from per-index arrays (weights), packed beside the key (weights, narrow),
    // per-row arrays (unity mean/sqrtn), or are all 1.0 (unity sum).
    match (ex.format.gains, limits.drop) {
        (Gains::InKey, false) => walk::<S, IN_KEY, false>(ex, scratch, limits, sink, stats),
        (Gains::InKey, true) => walk::<S, IN_KEY, true>(ex, scratch, limits, sink, stats),
        (Gains::PerIndex, false) => walk::<S, PER_INDEX, false>(ex, scratch, limits, sink, stats),
        (Gains::PerIndex, true) => walk::<S, PER_INDEX, true>(ex, scratch, limits, sink, stats),
        (Gains::PerRow, false) => walk::<S, PER_ROW, false>(ex, scratch, limits, sink, stats),
        (Gains::PerRow, true) => walk::<S, PER_ROW, true>(ex, scratch, limits, sink, stats),
        (Gains::Unit, false) => walk::<S, UNIT, false>(ex, scratch, limits, sink, stats),
        (Gains::Unit, true) => walk::<S, UNIT, true>(ex, scratch, limits, sink, stats),
    }
}

/// [`Gains`] as const generic parameters of the walk, which is compiled once per variant.
const PER_INDEX: u8 = Gains::PerIndex as u8;
const PER_ROW: u8 = Gains::PerRow as u8;
const UNIT: u8 = Gains::Unit as u8;
const IN_KEY: u8 = Gains::InKey as u8;

/// Sorts `ex`'s keys and runs `$body` over each sorted slice in key order, with `$keys` bound
/// to the slice (of `u32` or `u64`) and `$high` to the bits to OR into each of its elements.
/// A macro rather than a closure so that the body can move the sink in and out.
macro_rules! for_each_sorted {
    ($ex:ident, $scratch:ident, |$keys:ident, $high:ident| $body:block) => {{
        let format = $ex.format;
        let sorted = $ex.payloads_sorted;
        match sort::chunk_bits_for($ex.len(), &format) {
            // Few keys: sorted in place, one slice.
            Some(0) => {
                sort_chunk(&mut $ex.narrow_keys, &mut $scratch.narrow, format.data_bits, format.width(), sorted);
                let ($keys, $high) = (&$ex.narrow_keys[..], 0u64);
                $body
            }
            Some(c) if format.gains == Gains::InKey => {
                // Weighted keys wider than 32 bits: each chunk's elements join the low 32 key
                // bits (high half) with the gain.
                let shift = format.width() - c;
                let SortScratch { wide, packed, starts, cursors, .. } = &mut *$scratch;
                sort::split_packed(&$ex.wide_keys, &$ex.key_gains, format.width(), c, packed, starts, cursors);
                for b in 0..1usize << c {
                    let (lo, hi) = (starts[b] as usize, starts[b + 1] as usize);
                    if lo == hi {
                        continue;
                    }
                    let chunk = &mut packed[lo..hi];
                    sort_packed_chunk(chunk, wide, 32 + format.data_bits, sorted);
                    let ($keys, $high) = (&chunk[..], (b as u64) << shift);
                    $body
                }
            }
            Some(c) => {
                let shift = format.width() - c;
                // (Keys wider than 32 bits, so `ex.keys` holds them.)
                let SortScratch { narrow, wide, chunks, starts, cursors, .. } = &mut *$scratch;
                sort::split(&$ex.wide_keys, format.width(), c, chunks, starts, cursors, wide);
                for b in 0..1usize << c {
                    let (lo, hi) = (starts[b] as usize, starts[b + 1] as usize);
                    if lo == hi {
                        continue;
                    }
                    let chunk = &mut chunks[lo..hi];
                    sort_chunk(chunk, narrow, format.data_bits, shift, sorted);
                    let ($keys, $high) = (&chunk[..], (b as u64) << shift);
                    $body
                }
            }
            None => {
                sort_keys(&mut $ex.wide_keys, &mut $scratch.wide, format, sorted);
                let ($keys, $high) = (&$ex.wide_keys[..], 0u64);
                $body
            }
        }
    }};
}

/// Runs the walker over every key in sorted order, whichever way the keys are stored.
#[inline(always)]
fn walk<S: EntrySink, const GAINS: u8, const DROP: bool>(
    ex: &mut Extracted,
    scratch: &mut SortScratch,
    limits: Limits,
    mut sink: S,
    stats: &mut ScStats,
) -> S {
    let n = 1usize << ex.format.nbits;
    let (ids, unique) = (&mut stats.ids[..n], &mut stats.unique[..n]);
    if !DROP && GAINS != PER_INDEX {
        // The common case gets a walk over whole partitions (see `walk_partitions`).
        let mut st = PartitionCursor::new(ex.format);
        for_each_sorted!(ex, scratch, |keys, high| {
            sink = walk_partitions::<S, GAINS, _>(ex, sink, keys, high, &mut st, ids, unique);
        });
        st.flush(ids, unique);
        stats.dropped = 0;
        return sink;
    }
    let mut w = Walker::<S, GAINS, DROP> {
        limits,
        sink,
        ids,
        unique,
        dropped: 0,
        last_col: u64::MAX,
        last_row: u32::MAX,
        prev_col: u64::MAX,
        prev_row: u32::MAX,
        dropping_col: false,
    };
    for_each_sorted!(ex, scratch, |keys, high| {
        for &k in keys {
            w.step(ex, k.to_u64(), high);
        }
    });
    let (dropped, sink) = (w.dropped, w.sink);
    stats.dropped = dropped;
    sink
}

/// Where [`walk_partitions`] stands between key slices.
#[derive(Clone, Copy)]
struct PartitionCursor {
    /// The last appended key (payload included); `u64::MAX` before the first.
    last: u64,
    /// Keys at or above this belong to a later partition.
    part_end: u64,
    /// Current partition and its running counters.
    part: usize,
    ids: u32,
    unique: u32,
}

impl PartitionCursor {
    fn new(format: KeyFormat) -> Self {
        PartitionCursor { last: u64::MAX, part_end: 1u64 << (format.data_bits + format.local_bits), part: 0, ids: 0, unique: 0 }
    }

    /// Stores the current partition's counters.
    fn flush(&mut self, ids: &mut [u32], unique: &mut [u32]) {
        if let (Some(i), Some(u)) = (ids.get_mut(self.part), unique.get_mut(self.part)) {
            *i += std::mem::take(&mut self.ids);
            *u += std::mem::take(&mut self.unique);
        }
    }
}

/// The walk without dropping, for gains that are not per-index (unit, per row, or packed):
/// there a whole key (column bits and row) identifies a (row, column) pair, so merging is one
/// compare, and since nothing is dropped the current partition's counters stay in registers.
/// The keys are cut at partition boundaries (a binary search each: keys are sorted), and within
/// a partition every key either merges or appends without a branch, in blocks the sink has
/// room for. The state and the sink are locals of this loop, passed by value, so that they are
/// not re-read from memory per key.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn walk_partitions<S: EntrySink, const GAINS: u8, K: KeyWord>(
    ex: &Extracted,
    mut sink: S,
    keys: &[K],
    high: u64,
    state: &mut PartitionCursor,
    ids: &mut [u32],
    unique: &mut [u32],
) -> S {
    let format = ex.format;
    let part_bits = format.data_bits + format.local_bits;
    let mut st = *state;
    let mut rest = keys;
    while let Some(&first) = rest.first() {
        let key = element_key::<GAINS>(first.to_u64()) | high;
        if key >= st.part_end {
            st.flush(ids, unique);
            st.part = format.partition(key);
            st.part_end = ((st.part as u64) + 1) << part_bits;
            sink = sink.start_partition(st.part as u32);
        }
        let end = rest.partition_point(|&k| (element_key::<GAINS>(k.to_u64()) | high) < st.part_end);
        let (part, next) = rest.split_at(end);
        sink = walk_partition::<S, GAINS, K>(ex, sink, part, high, &mut st);
        rest = next;
    }
    *state = st;
    sink
}

/// The key of a stored element (packed elements carry the gain in their low half).
#[inline(always)]
fn element_key<const GAINS: u8>(element: u64) -> u64 {
    if GAINS == IN_KEY {
        element >> 32
    } else {
        element
    }
}

/// [`walk_partitions`] over the keys of one partition, `st.part`.
#[inline(always)]
fn walk_partition<S: EntrySink, const GAINS: u8, K: KeyWord>(
    ex: &Extracted,
    mut sink: S,
    keys: &[K],
    high: u64,
    st: &mut PartitionCursor,
) -> S {
    let format = ex.format;
    let (db, lmask) = (format.data_bits, (1u64 << format.local_bits) - 1);
    let (row_lo, part) = (ex.first_row, st.part as u32);
    let gain_of = |element: u64, data: u32| match GAINS {
        PER_ROW => ex.row_gains.get(data as usize).copied().unwrap_or(0.0),
        IN_KEY => f32::from_bits(element as u32),
        _ => 1.0,
    };
    let block = Block {
        high,
        element_shift: if GAINS == IN_KEY { 32 } else { 0 },
        data_bits: db,
        local_mask: lmask,
        nbits: format.nbits,
        partition: part,
        row_lo,
        row_span: ex.row_span,
        unit: GAINS == UNIT,
    };
    let mut rest = keys;
    while !rest.is_empty() {
        // Each key appends at most one entry, so a block no longer than the room never
        // overflows.
        let take = rest.len().min(sink.room());
        if take == 0 {
            break;
        }
        let (keys, next) = rest.split_at(take);
        let (last, ids, unique) = sink.walk_block(keys, block, st.last, gain_of);
        (st.last, st.ids, st.unique) = (last, st.ids + ids, st.unique + unique);
        rest = next;
    }
    // Out of room: what is left overflows, entry by entry, as the sink decides.
    let (last, ids, unique) = walk_block_plain(&mut sink, rest, block, st.last, gain_of);
    (st.last, st.ids, st.unique) = (last, st.ids + ids, st.unique + unique);
    sink
}

/// The state of the walk, specialised for where gains live and for dropping. Columns are
/// compared as the key's column bits (bucket, partition, local id).
struct Walker<'a, S, const GAINS: u8, const DROP: bool> {
    limits: Limits,
    sink: S,
    ids: &'a mut [u32],
    unique: &'a mut [u32],
    dropped: u64,
    /// The last appended entry; column fields are < 2^38, so u64::MAX means "none".
    last_col: u64,
    last_row: u32,
    /// The last entry that was not merged (kept or dropped).
    prev_col: u64,
    prev_row: u32,
    dropping_col: bool,
}

impl<S: EntrySink, const GAINS: u8, const DROP: bool> Walker<'_, S, GAINS, DROP> {
    #[inline(always)]
    fn step(&mut self, ex: &Extracted, element: u64, high: u64) {
        let format = ex.format;
        let key = element_key::<GAINS>(element) | high;
        let colbits = format.col_field(key);
        let data = format.data(key);
        let (row, gain) = match GAINS {
            PER_INDEX => ex.index_rows[data as usize],
            PER_ROW => (ex.first_row + data, ex.row_gains[data as usize]),
            IN_KEY => (ex.first_row + data, f32::from_bits(element as u32)),
            _ => (ex.first_row + data, 1.0),
        };
        // 1. Merge into the last appended entry.
        if colbits == self.last_col && row == self.last_row {
            self.sink.add_to_last(gain);
            return;
        }
        if !DROP {
            // Without dropping every entry that is not merged is appended, so the last appended
            // entry is also the last unmerged one: fewer live values on the hot path.
            let g = format.partition(key) & (self.ids.len() - 1);
            self.ids[g] += 1;
            self.unique[g] += (colbits != self.last_col) as u32;
            let local = (colbits & ((1u64 << format.local_bits) - 1)) as u32;
            self.sink.push_parts(g as u32, local, format.nbits, row, gain);
            self.last_col = colbits;
            self.last_row = row;
            return;
        }
        // 2. A repeat of a pair that was dropped.
        if row == self.prev_row && colbits == self.prev_col {
            self.dropped += 1;
            return;
        }
        // 3. Count.
        let new_col = colbits != self.prev_col;
        let g = format.partition(key) & (self.ids.len() - 1);
        self.ids[g] += 1;
        self.unique[g] += new_col as u32;
        // 4. Keep or drop. The kept counters equal the observed ones, so the counts above decide.
        if new_col {
            self.dropping_col = self.unique[g] > self.limits.max_unique;
        }
        if self.ids[g] > self.limits.max_ids || self.dropping_col {
            self.dropped += 1;
        } else {
            let (col, _) = format.decode(key);
            self.sink.push(Entry { col, row, gain });
            self.last_col = colbits;
            self.last_row = row;
        }
        self.prev_col = colbits;
        self.prev_row = row;
    }
}

/// A pass-1 entry under minibatching: the merged pair and how many raw occurrences merged into
/// it (pass 2 drops whole pairs, and counts every occurrence it drops).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CountedEntry {
    /// The merged entry.
    pub entry: Entry,
    /// Raw occurrences merged into it.
    pub count: u32,
}

impl EntrySink for Vec<CountedEntry> {
    #[inline(always)]
    fn push(&mut self, entry: Entry) {
        Vec::push(self, CountedEntry { entry, count: 1 });
    }
    #[inline(always)]
    fn add_to_last(&mut self, gain: f32) {
        if let Some(last) = self.last_mut() {
            last.entry.gain = merge(last.entry.gain, gain);
            last.count += 1;
        }
    }
}

/// One SparseCore's bucketed pass (SPEC 5.4 step 4), reused across batches.
#[derive(Debug, Default, Clone)]
pub struct Bucketed {
    /// Kept entries in (partition, bucket, local id, row) order.
    pub entries: Vec<Entry>,
    /// `starts[g * 64 + b] .. starts[g * 64 + b + 1]` are the entries of partition g, bucket b.
    pub starts: Vec<u32>,
    /// De-duplicated ids per (partition, bucket), before dropping.
    pub ids: Vec<u32>,
    /// Distinct ids per (partition, bucket), before dropping.
    pub unique: Vec<u32>,
    /// Occurrences dropped by the per-bucket limits.
    pub dropped: u64,
    /// This SparseCore's split bits.
    pub split: u64,
    buckets: Vec<u8>,
    order: Vec<Entry>,
    next: Vec<u32>,
}

impl Bucketed {
    /// Largest per-(partition, bucket) count of ids and of distinct ids, with the partition of
    /// each.
    pub fn max_counts(&self) -> ((u32, usize), (u32, usize)) {
        let ids = max_with_index(&self.ids);
        let uniq = max_with_index(&self.unique);
        ((ids.0, ids.1 / bucket::BUCKETS), (uniq.0, uniq.1 / bucket::BUCKETS))
    }
}

/// The bucketed pass over one SparseCore's pass-1 entries (in pass-1 order: partition, local id,
/// row). Counting per (partition, bucket) in this order equals the reference's walk over keys
/// re-sorted with bucket bits: a column's entries are contiguous and share one bucket, so the
/// "new column" test and each (partition, bucket) group's order are the same.
pub fn bucket_pass(pass1: &[CountedEntry], nbits: u32, buckets: &bucket::BucketFn, limits: Limits, out: &mut Bucketed) {
    const B: usize = bucket::BUCKETS;
    let n = 1usize << nbits;
    let mask = (n - 1) as u32;
    for v in [&mut out.ids, &mut out.unique] {
        v.clear();
        v.resize(n * B, 0);
    }
    out.order.clear();
    out.buckets.clear();
    out.dropped = 0;
    let mut prev_col = u64::MAX;
    let mut b = 0u32;
    let mut dropping_col = false;
    for ce in pass1 {
        let col = ce.entry.col;
        let new_col = col as u64 != prev_col;
        if new_col {
            b = buckets.bucket(col);
        }
        prev_col = col as u64;
        let idx = (col & mask) as usize * B + b as usize;
        out.ids[idx] += 1;
        out.unique[idx] += new_col as u32;
        if limits.drop {
            if new_col {
                dropping_col = out.unique[idx] > limits.max_unique;
            }
            if out.ids[idx] > limits.max_ids || dropping_col {
                out.dropped += ce.count as u64;
                continue;
            }
        }
        out.order.push(ce.entry);
        out.buckets.push(b as u8);
    }
    // Split bits of this SparseCore.
    out.split = 0;
    for g in 0..n {
        out.split |= bucket::split_bits(&out.ids[g * B..(g + 1) * B], limits.max_ids);
        out.split |= bucket::split_bits(&out.unique[g * B..(g + 1) * B], limits.max_unique);
    }
    // Stable counting sort of the kept entries by (partition, bucket).
    out.starts.clear();
    out.starts.resize(n * B + 1, 0);
    for (e, &bk) in out.order.iter().zip(&out.buckets) {
        out.starts[(e.col & mask) as usize * B + bk as usize + 1] += 1;
    }
    for i in 1..out.starts.len() {
        out.starts[i] += out.starts[i - 1];
    }
    out.entries.clear();
    out.entries.resize(out.order.len(), Entry { col: 0, row: 0, gain: 0.0 });
    out.next.clear();
    out.next.extend_from_slice(&out.starts[..n * B]);
    for (e, &bk) in out.order.iter().zip(&out.buckets) {
        let k = (e.col & mask) as usize * B + bk as usize;
        out.entries[out.next[k] as usize] = *e;
        out.next[k] += 1;
    }
}
