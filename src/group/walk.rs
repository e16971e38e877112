//! The grouping walk of SPEC 3.7 over sorted keys, compiled once per [`Gains`] variant and
//! dropping mode: a branch-free walk over whole partitions when nothing is dropped and gains are
//! not per index, and an entry-by-entry walker otherwise.

use super::sink::{walk_block_plain, Block, Entry, EntrySink};
use super::sort::{self, sort_chunk, sort_keys, sort_packed_chunk};
use super::{Limits, ScStats, SortScratch};
use crate::extracted::Extracted;
use crate::key::{Gains, KeyFormat, KeyWord};

/// Sorts the extracted keys, then walks them into `out` (cleared first) and `stats`.
#[cfg(feature = "internals")]
pub fn sort_and_group(
    ex: &mut Extracted,
    scratch: &mut SortScratch,
    limits: Limits,
    out: &mut Vec<Entry>,
    stats: &mut ScStats,
) {
    out.clear();
    *out = sort_and_walk(ex, scratch, limits, std::mem::take(out), stats);
}

/// Sorts the extracted keys and runs the walk of SPEC 3.7 over them, sending kept entries to
/// `sink`, which is taken by value (so that its state stays in registers) and handed back.
/// Large key sets are sorted chunk by chunk (see [`sort::split`]), each chunk walked right
/// after its sort, while it is in cache. Compiled twice (see [`crate::isa`]): the walk's
/// variable shifts and selects are single instructions on x86-64-v3.
pub fn sort_and_walk<S: EntrySink>(
    ex: &mut Extracted,
    scratch: &mut SortScratch,
    limits: Limits,
    sink: S,
    stats: &mut ScStats,
) -> S {
    crate::dispatch_v3!(<S: EntrySink> (ex: &mut Extracted, scratch: &mut SortScratch, limits: Limits, sink: S, stats: &mut ScStats) -> S {
        sort_and_walk_body(ex, scratch, limits, sink, stats)
    })
}

#[inline(always)]
fn sort_and_walk_body<S: EntrySink>(
    ex: &mut Extracted,
    scratch: &mut SortScratch,
    limits: Limits,
    sink: S,
    stats: &mut ScStats,
) -> S {
    let n = 1usize << ex.format.nbits;
    stats.id_counts.clear();
    stats.id_counts.resize(n, 0);
    stats.unique_counts.clear();
    stats.unique_counts.resize(n, 0);
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
                sort_chunk(
                    &mut $ex.narrow_keys,
                    &mut $scratch.narrow,
                    format.data_bits,
                    format.width(),
                    sorted,
                );
                let ($keys, $high) = (&$ex.narrow_keys[..], 0u64);
                $body
            }
            Some(c) if format.gains == Gains::InKey => {
                // Weighted keys wider than 32 bits: each chunk's elements join the low 32 key
                // bits (high half) with the gain.
                let shift = format.width() - c;
                let SortScratch {
                    wide,
                    packed,
                    starts,
                    cursors,
                    ..
                } = &mut *$scratch;
                sort::split_packed(
                    &$ex.wide_keys,
                    &$ex.key_gains,
                    format.width(),
                    c,
                    packed,
                    starts,
                    cursors,
                );
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
                let SortScratch {
                    narrow,
                    wide,
                    chunks,
                    starts,
                    cursors,
                    ..
                } = &mut *$scratch;
                sort::split(
                    &$ex.wide_keys,
                    format.width(),
                    c,
                    chunks,
                    starts,
                    cursors,
                    wide,
                );
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
    let (ids, unique) = (&mut stats.id_counts[..n], &mut stats.unique_counts[..n]);
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
        PartitionCursor {
            last: u64::MAX,
            part_end: 1u64 << (format.data_bits + format.local_bits),
            part: 0,
            ids: 0,
            unique: 0,
        }
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
        let end =
            rest.partition_point(|&k| (element_key::<GAINS>(k.to_u64()) | high) < st.part_end);
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
            self.sink
                .push_parts(g as u32, local, format.nbits, row, gain);
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
