//! Counting each sample's ids per (stack, partition) after the per-sample merge, as the
//! pipeline counts them.

use arrow_array::RecordBatch;

use super::samples::{SampleCounts, SampleRef};
use crate::error::{Error, Result};
use crate::extract::{col_of, InputInt};
use crate::input::{features_from_record_batch, FeatureView, Ids, Offsets, SampleSource};
use crate::spec::{Config, Plan};

/// One feature of a batch as counting reads it.
#[derive(Clone, Copy)]
struct RaggedFeature<'a> {
    ids: Ids<'a>,
    offsets: Offsets<'a>,
    /// First cell of the feature's stack.
    base: u32,
    col_shift: u32,
    col_offset: u32,
    /// Words of 64 columns covering the stack, whose repeated ids are found by direct indexing,
    /// or 0 when the stack is too large for that (see [`DENSE_SEEN_MAX`]).
    dense_words: usize,
}

fn ragged_views<'a>(
    plan: &Plan,
    inputs: &'a [&'a (dyn SampleSource + 'a)],
) -> Result<Vec<RaggedFeature<'a>>> {
    let n = plan.layout.num_partitions();
    plan.features
        .iter()
        .zip(inputs)
        .map(|(fp, input)| match input.view() {
            FeatureView::Ragged { ids, offsets, .. } => {
                let vocab = plan.stacks[fp.stack].stack_vocab_size;
                Ok(RaggedFeature {
                    ids,
                    offsets,
                    base: (fp.stack * n) as u32,
                    col_shift: fp.col_shift,
                    col_offset: fp.col_offset,
                    dense_words: if vocab <= DENSE_SEEN_MAX {
                        vocab.div_ceil(64).max(1) as usize
                    } else {
                        0
                    },
                })
            }
            _ => Err(Error::input(
                &fp.name,
                "balancing reads record batches, whose features are ragged lists",
            )),
        })
        .collect()
}

/// Counts a batch's samples, reusing its scratch from batch to batch.
///
/// Sample by sample, each stack's features in turn, so that a sample's entries are written once,
/// in place: a walk feature by feature first wrote every row's entries per feature, then copied
/// them sample by sample, which cost more than the counting itself on short lists.
#[derive(Debug, Default)]
pub(super) struct Counter {
    seen: SeenSet,
    /// Per partition: one list's distinct ids.
    hist: Vec<u32>,
    /// One sample's entries of a stack of several features, before they are merged.
    scratch: Vec<(u32, u32)>,
    /// Per cell: one sample's ids in stacks of several features, and the cells it touched.
    acc: Vec<u32>,
    touched: Vec<u32>,
}

impl Counter {
    /// Appends every row of a batch (index `batch` in the window) to `counts`. Every input has
    /// `rows` samples (checked by the caller).
    pub(super) fn count_batch<'a>(
        &mut self,
        plan: &Plan,
        inputs: &'a [&'a (dyn SampleSource + 'a)],
        batch: usize,
        rows: usize,
        counts: &mut SampleCounts,
    ) -> Result<()> {
        let features = ragged_views(plan, inputs)?;
        // The row loop for the id and offset types of every feature, when they share them (an
        // Arrow batch's lists usually do), so that no list pays for finding its types.
        if let Some(typed) = typed::<i64, i32>(&features) {
            self.count_rows(plan, &typed, batch, rows, counts);
        } else if let Some(typed) = typed::<i64, i64>(&features) {
            self.count_rows(plan, &typed, batch, rows, counts);
        } else if let Some(typed) = typed::<i32, i32>(&features) {
            self.count_rows(plan, &typed, batch, rows, counts);
        } else {
            self.count_rows(plan, &features, batch, rows, counts);
        }
        Ok(())
    }

    fn count_rows<F: CountRow>(
        &mut self,
        plan: &Plan,
        features: &[F],
        batch: usize,
        rows: usize,
        counts: &mut SampleCounts,
    ) {
        let n = plan.layout.num_partitions();
        let mask = (n - 1) as u32;
        self.hist.clear();
        self.hist.resize(n, 0);
        self.acc.clear();
        self.acc.resize(plan.stacks.len() * n, 0);
        // Stacks in plan order with their features and the inverse of their limit.
        struct StackRows<'s, F> {
            /// The feature of a stack of one (most of them), read without going through the vector.
            single: Option<&'s F>,
            features: Vec<&'s F>,
            inv_limit: f64,
        }
        let stacks: Vec<StackRows<'_, F>> = plan
            .stacks
            .iter()
            .map(|s| {
                let features: Vec<&F> =
                    s.features.iter().filter_map(|&f| features.get(f)).collect();
                let single = if let [f] = features[..] {
                    Some(f)
                } else {
                    None
                };
                StackRows {
                    single,
                    features,
                    inv_limit: 1.0 / s.max_ids_per_partition.max(1) as f64,
                }
            })
            .collect();
        counts.cells.reserve(rows * features.len());
        counts.refs.reserve(rows);
        counts.start.reserve(rows);
        counts.peak.reserve(rows);
        let (seen, hist) = (&mut self.seen, &mut self.hist[..]);
        // A local vector, which the loop keeps in registers.
        let mut cells = std::mem::take(&mut counts.cells);
        let ahead = features.len() >= PREFETCH_FEATURES;
        for row in 0..rows {
            if ahead {
                for f in features {
                    f.prefetch(row + PREFETCH_ROWS);
                }
            }
            let mut peak = 0f64;
            for stack in &stacks {
                let most = if let Some(f) = stack.single {
                    f.count_row(row, mask, seen, hist, &mut cells)
                } else {
                    self.scratch.clear();
                    for f in &stack.features {
                        f.count_row(row, mask, seen, hist, &mut self.scratch);
                    }
                    self.touched.clear();
                    for &(c, k) in &self.scratch {
                        let Some(slot) = self.acc.get_mut(c as usize) else {
                            continue;
                        };
                        if *slot == 0 {
                            self.touched.push(c);
                        }
                        *slot += k;
                    }
                    let mut most = 0;
                    for &c in &self.touched {
                        let k = self.acc.get_mut(c as usize).map_or(0, std::mem::take);
                        cells.push((c, k));
                        most = most.max(k);
                    }
                    most
                };
                // Never NaN, so the same as `f64::max`.
                let x = most as f64 * stack.inv_limit;
                if x > peak {
                    peak = x;
                }
            }
            counts.refs.push(SampleRef { batch, row });
            counts.start.push(cells.len());
            counts.peak.push(peak);
        }
        counts.cells = cells;
    }
}

/// Rows ahead of the counted one whose lists are fetched into cache, in batches of at least
/// [`PREFETCH_FEATURES`] features. A sample reads a list from every feature (26 on criteo),
/// two streams each (offsets and ids), more than the hardware prefetcher follows, so that
/// without this most short lists' line is a cache miss; with a few features it follows them.
const PREFETCH_ROWS: usize = 4;
const PREFETCH_FEATURES: usize = 8;

/// A feature whose rows can be counted one by one.
trait CountRow {
    /// Appends row `row`'s distinct ids per partition to `out` as `(cell, ids)` entries;
    /// returns the largest count.
    fn count_row(
        &self,
        row: usize,
        mask: u32,
        seen: &mut SeenSet,
        hist: &mut [u32],
        out: &mut Vec<(u32, u32)>,
    ) -> u32;

    /// Starts fetching the first ids of row `row` (if there is one) into cache.
    fn prefetch(&self, row: usize);
}

/// Starts fetching the cache line of `p` (any address: a prefetch never faults).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that reads nothing into the program and never faults, whatever
    // the address.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The address of row `row`'s first id, for [`prefetch`]; dangling (never read) past the ids.
#[inline(always)]
fn list_start<I, O: InputInt>(ids: &[I], offsets: &[O], row: usize) -> *const I {
    ids.as_ptr()
        .wrapping_add(offsets.get(row).map_or(0, |o| o.to_usize()))
}

impl CountRow for RaggedFeature<'_> {
    #[inline(always)]
    fn count_row(
        &self,
        row: usize,
        mask: u32,
        seen: &mut SeenSet,
        hist: &mut [u32],
        out: &mut Vec<(u32, u32)>,
    ) -> u32 {
        match (self.ids, self.offsets) {
            (Ids::I32(ids), Offsets::I32(o)) => {
                count_list(self, list_of(ids, o, row), mask, seen, hist, out)
            }
            (Ids::I32(ids), Offsets::I64(o)) => {
                count_list(self, list_of(ids, o, row), mask, seen, hist, out)
            }
            (Ids::I64(ids), Offsets::I32(o)) => {
                count_list(self, list_of(ids, o, row), mask, seen, hist, out)
            }
            (Ids::I64(ids), Offsets::I64(o)) => {
                count_list(self, list_of(ids, o, row), mask, seen, hist, out)
            }
        }
    }

    #[inline(always)]
    fn prefetch(&self, row: usize) {
        match (self.ids, self.offsets) {
            (Ids::I32(ids), Offsets::I32(o)) => prefetch(list_start(ids, o, row)),
            (Ids::I32(ids), Offsets::I64(o)) => prefetch(list_start(ids, o, row)),
            (Ids::I64(ids), Offsets::I32(o)) => prefetch(list_start(ids, o, row)),
            (Ids::I64(ids), Offsets::I64(o)) => prefetch(list_start(ids, o, row)),
        }
    }
}

/// A feature with its id and offset types known.
struct Typed<'a, I, O> {
    ids: &'a [I],
    offsets: &'a [O],
    feature: RaggedFeature<'a>,
}

impl<I: InputInt, O: InputInt> CountRow for Typed<'_, I, O> {
    #[inline(always)]
    fn count_row(
        &self,
        row: usize,
        mask: u32,
        seen: &mut SeenSet,
        hist: &mut [u32],
        out: &mut Vec<(u32, u32)>,
    ) -> u32 {
        count_list(
            &self.feature,
            list_of(self.ids, self.offsets, row),
            mask,
            seen,
            hist,
            out,
        )
    }

    #[inline(always)]
    fn prefetch(&self, row: usize) {
        prefetch(list_start(self.ids, self.offsets, row));
    }
}

/// An integer type of ids and offsets, picked out of their enums.
trait Pick: Sized {
    fn ids<'a>(ids: Ids<'a>) -> Option<&'a [Self]>;
    fn offsets<'a>(offsets: Offsets<'a>) -> Option<&'a [Self]>;
}

impl Pick for i32 {
    fn ids<'a>(ids: Ids<'a>) -> Option<&'a [i32]> {
        match ids {
            Ids::I32(x) => Some(x),
            Ids::I64(_) => None,
        }
    }
    fn offsets<'a>(offsets: Offsets<'a>) -> Option<&'a [i32]> {
        match offsets {
            Offsets::I32(x) => Some(x),
            Offsets::I64(_) => None,
        }
    }
}

impl Pick for i64 {
    fn ids<'a>(ids: Ids<'a>) -> Option<&'a [i64]> {
        match ids {
            Ids::I64(x) => Some(x),
            Ids::I32(_) => None,
        }
    }
    fn offsets<'a>(offsets: Offsets<'a>) -> Option<&'a [i64]> {
        match offsets {
            Offsets::I64(x) => Some(x),
            Offsets::I32(_) => None,
        }
    }
}

/// Every feature with ids of type `I` and offsets of type `O`, or `None` if one has others.
fn typed<'a, I: Pick, O: Pick>(features: &[RaggedFeature<'a>]) -> Option<Vec<Typed<'a, I, O>>> {
    features
        .iter()
        .map(|&feature| {
            Some(Typed {
                ids: I::ids(feature.ids)?,
                offsets: O::offsets(feature.offsets)?,
                feature,
            })
        })
        .collect()
}

/// Row `row`'s ids; none for a row past the offsets or with offsets that are out of order or
/// past the ids.
#[inline(always)]
fn list_of<'a, I, O: InputInt>(ids: &'a [I], offsets: &[O], row: usize) -> &'a [I] {
    match (offsets.get(row), offsets.get(row + 1)) {
        (Some(a), Some(b)) => ids.get(a.to_usize()..b.to_usize()).unwrap_or_default(),
        _ => &[],
    }
}

/// Starts a new generation of `stamps` (at least `size` of them), so that every stamp is stale
/// without clearing any; clears them only when the generation wraps. Returns whether the
/// stamps were reallocated (the caller's slots of the same length must be too).
pub(super) fn next_generation(stamps: &mut Vec<u32>, generation: &mut u32, size: usize) -> bool {
    let grown = stamps.len() < size;
    if grown {
        *stamps = vec![0; size];
        *generation = 0;
    }
    *generation = generation.wrapping_add(1);
    if *generation == 0 {
        stamps.fill(0);
        *generation = 1;
    }
    grown
}

/// A set of columns by open addressing, emptied in O(1): a slot is taken when its stamp is the
/// current generation, so starting over clears nothing. Counting a list's repeats and a slice's
/// unique ids both use it.
#[derive(Debug, Default)]
struct StampedSet {
    keys: Vec<u32>,
    stamps: Vec<u32>,
    generation: u32,
    /// Slots in use (a power of two, at most the allocated ones).
    size: usize,
}

impl StampedSet {
    /// Empties the set, using `slots` slots (rounded up to a power of two, at least 16).
    fn start(&mut self, slots: usize) {
        let size = slots.next_power_of_two().max(16);
        if next_generation(&mut self.stamps, &mut self.generation, size) {
            self.keys = vec![0; size];
        }
        self.size = size;
    }

    /// The slots in use, as plain slices that a loop of inserts keeps in registers (stores to
    /// the slots cannot change them, as they might the set's own fields).
    fn slots(&mut self) -> Slots<'_> {
        let size = self.size;
        Slots {
            keys: self.keys.get_mut(..size).unwrap_or_default(),
            stamps: self.stamps.get_mut(..size).unwrap_or_default(),
            generation: self.generation,
            shift: 64 - size.trailing_zeros(),
        }
    }
}

/// A started [`StampedSet`]'s slots.
struct Slots<'a> {
    keys: &'a mut [u32],
    stamps: &'a mut [u32],
    generation: u32,
    shift: u32,
}

impl Slots<'_> {
    /// Whether `c` is new to the set (it is in it afterwards).
    #[inline(always)]
    fn insert(&mut self, c: u32) -> bool {
        let last = self.stamps.len().min(self.keys.len()).wrapping_sub(1);
        let mut i = ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize;
        loop {
            let (Some(stamp), Some(key)) =
                (self.stamps.get_mut(i & last), self.keys.get_mut(i & last))
            else {
                return false;
            };
            if *stamp != self.generation {
                *stamp = self.generation;
                *key = c;
                return true;
            }
            if *key == c {
                return false;
            }
            i += 1;
        }
    }
}

/// Distinct columns per (slice, cell): the pipeline's unique ids, which per-sample counts cannot
/// give (two samples of a slice may share an id). Counted per (slice, stack) instead of by the
/// pipeline's sort of every stack, only for the stacks that could pass their unique limit: with
/// a bit per column where the stack is small against the slice's ids, else a hash set.
#[derive(Debug, Default)]
pub(super) struct UniqueCounter {
    set: StampedSet,
    /// Per partition: distinct columns of the current (slice, stack).
    per_partition: Vec<u32>,
    /// Small stacks: a bit per column, all clear between (slice, stack)s.
    bits: Vec<u64>,
    /// Small stacks: columns beyond the stack (ids the pipeline rejects), merged by a sort.
    spill: Vec<u32>,
}

impl UniqueCounter {
    /// Per output batch (`order[k]`: its rows, `slices` equal runs of them) and stack, the
    /// largest number of distinct columns of any (slice, partition) cell; 0 for stacks not in
    /// `stacks`. All batches of the window share the plan's stack layout.
    pub(super) fn worst_per_batch(
        &mut self,
        config: &Config,
        plan: &Plan,
        window: &[RecordBatch],
        order: &[Vec<SampleRef>],
        slices: usize,
        stacks: &[bool],
    ) -> Result<Vec<Vec<i32>>> {
        let features = window
            .iter()
            .map(|rb| features_from_record_batch(config, rb))
            .collect::<Result<Vec<_>>>()?;
        let inputs: Vec<Vec<&dyn SampleSource>> = features
            .iter()
            .map(|fs| fs.iter().map(|f| f as &dyn SampleSource).collect())
            .collect();
        let views = inputs
            .iter()
            .map(|i| ragged_views(plan, i))
            .collect::<Result<Vec<_>>>()?;
        let n = plan.layout.num_partitions();
        let mask = (n - 1) as u32;
        let mut worst = vec![vec![0i32; plan.stacks.len()]; order.len()];
        for (k, rows) in order.iter().enumerate() {
            let per_slice = rows.len() / slices.max(1);
            for slice in rows.chunks(per_slice.max(1)) {
                for (st, stack) in plan
                    .stacks
                    .iter()
                    .enumerate()
                    .filter(|&(st, _)| stacks.get(st).copied().unwrap_or(false))
                {
                    let fs = &stack.features;
                    let length = |r: &SampleRef, f: usize| {
                        let (a, b) = views[r.batch][f].offsets.range(r.row);
                        b - a
                    };
                    let ids: usize = slice
                        .iter()
                        .map(|r| fs.iter().map(|&f| length(r, f)).sum::<usize>())
                        .sum();
                    self.per_partition.clear();
                    self.per_partition.resize(n, 0);
                    // A bit per column costs a clear of the bitmap, but no hashing and a
                    // fraction of the hash set's memory (16 bytes per id at most against 32 at
                    // least), which a large set's cache misses make the dearer part.
                    let words = stack.stack_vocab_size.div_ceil(64);
                    if words <= 2 * ids as u64 {
                        self.count_dense(&views, slice, fs, words as usize, mask);
                    } else {
                        self.count_hashed(&views, slice, fs, ids, mask);
                    }
                    let most = self.per_partition.iter().copied().max().unwrap_or(0);
                    worst[k][st] = worst[k][st].max(most.min(i32::MAX as u32) as i32);
                }
            }
        }
        Ok(worst)
    }

    /// Adds one (slice, stack)'s distinct columns (of its `ids` ids) to `per_partition` with
    /// the hash set.
    fn count_hashed(
        &mut self,
        views: &[Vec<RaggedFeature<'_>>],
        slice: &[SampleRef],
        fs: &[usize],
        ids: usize,
        mask: u32,
    ) {
        self.set.start(2 * ids);
        let (mut set, parts) = (self.set.slots(), &mut self.per_partition[..]);
        for_each_list(views, slice, fs, |f, list| match list {
            Ids::I32(x) => hashed_list(f, x, mask, &mut set, parts),
            Ids::I64(x) => hashed_list(f, x, mask, &mut set, parts),
        });
    }

    /// Adds one (slice, stack)'s distinct columns to `per_partition` with a bit per column of
    /// the stack's `words` words.
    fn count_dense(
        &mut self,
        views: &[Vec<RaggedFeature<'_>>],
        slice: &[SampleRef],
        fs: &[usize],
        words: usize,
        mask: u32,
    ) {
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        let (bits, spill) = (&mut self.bits[..words], &mut self.spill);
        spill.clear();
        let Some(parts) = self.per_partition.get_mut(..=mask as usize) else {
            return;
        };
        for_each_list(views, slice, fs, |f, list| match list {
            Ids::I32(x) => dense_list(f, x, mask, bits, parts, spill),
            Ids::I64(x) => dense_list(f, x, mask, bits, parts, spill),
        });
        bits.fill(0);
        if !spill.is_empty() {
            spill.sort_unstable();
            spill.dedup();
            for &c in spill.iter() {
                parts[(c & mask) as usize] += 1;
            }
        }
    }
}

/// Calls `each` with every list of a slice's samples in the stack of features `fs`, and its
/// feature.
#[inline(always)]
fn for_each_list<'a>(
    views: &'a [Vec<RaggedFeature<'a>>],
    slice: &[SampleRef],
    fs: &[usize],
    mut each: impl FnMut(&RaggedFeature<'a>, Ids<'a>),
) {
    for r in slice {
        for &f in fs {
            let Some(v) = views.get(r.batch).and_then(|v| v.get(f)) else {
                continue;
            };
            let (a, b) = v.offsets.range(r.row);
            match v.ids {
                Ids::I32(x) => each(v, Ids::I32(x.get(a..b).unwrap_or_default())),
                Ids::I64(x) => each(v, Ids::I64(x.get(a..b).unwrap_or_default())),
            }
        }
    }
}

/// Sets the bit of every column of `list` in `bits`, counting the new ones per partition in
/// `parts` (one per partition); columns past the bitmap go to `spill`. Out of line, and with the
/// feature's numbers read once into locals, so that the loop keeps more of them in registers
/// (read through `f`, they would be read again after every count, which might have changed
/// them as far as the compiler knows).
#[inline(never)]
fn dense_list<I: InputInt>(
    f: &RaggedFeature<'_>,
    list: &[I],
    mask: u32,
    bits: &mut [u64],
    parts: &mut [u32],
    spill: &mut Vec<u32>,
) {
    let (shift, offset) = (f.col_shift, f.col_offset);
    let Some(last) = parts.len().checked_sub(1) else {
        return;
    };
    for &id in list {
        let c = col_of(low32(id), shift, mask, offset);
        match bits.get_mut((c / 64) as usize) {
            Some(w) => {
                let m = 1u64 << (c % 64);
                parts[c as usize & last] += u32::from(*w & m == 0);
                *w |= m;
            }
            None => spill.push(c),
        }
    }
}

/// [`dense_list`] with a hash set instead of a bitmap.
#[inline(never)]
fn hashed_list<I: InputInt>(
    f: &RaggedFeature<'_>,
    list: &[I],
    mask: u32,
    set: &mut Slots<'_>,
    parts: &mut [u32],
) {
    let (shift, offset) = (f.col_shift, f.col_offset);
    let Some(last) = parts.len().checked_sub(1) else {
        return;
    };
    for &id in list {
        let c = col_of(low32(id), shift, mask, offset);
        if set.insert(c) {
            parts[c as usize & last] += 1;
        }
    }
}

/// Column of an id within its stack, as the pipeline computes it. It is a bijection of the id
/// (per feature), so distinct columns are distinct ids, as the pipeline merges them.
#[inline(always)]
fn column(f: &RaggedFeature<'_>, id: u32, mask: u32) -> u32 {
    col_of(id, f.col_shift, mask, f.col_offset)
}

/// Partition of an id's column, `column(f, id, mask) & mask`: the low bits of a sum depend only
/// on the low bits of its terms.
#[inline(always)]
fn partition(f: &RaggedFeature<'_>, id: u32, mask: u32) -> u32 {
    id.wrapping_add(f.col_shift.wrapping_add(f.col_offset)) & mask
}

/// One list: appends its distinct ids per partition to `out` as `(cell, ids)` entries (in the
/// order of their first id; by partition for lists over [`SHORT_LIST`] ids); returns the largest
/// count. `hist` (one count per partition) is all zero before and after.
#[inline(always)]
fn count_list<I: InputInt>(
    f: &RaggedFeature<'_>,
    list: &[I],
    mask: u32,
    seen: &mut SeenSet,
    hist: &mut [u32],
    out: &mut Vec<(u32, u32)>,
) -> u32 {
    let cell = |id: I| f.base + partition(f, low32(id), mask);
    if let [a] = *list {
        out.push((cell(a), 1));
        return 1;
    }
    match *list {
        [] => 0,
        [a, b] => {
            let (ca, cb) = (cell(a), cell(b));
            if low32(a) == low32(b) {
                out.push((ca, 1));
                1
            } else if ca == cb {
                out.push((ca, 2));
                2
            } else {
                out.extend([(ca, 1), (cb, 1)]);
                1
            }
        }
        _ if list.len() <= SHORT_LIST => {
            let from = out.len();
            let mut most = 1;
            for (k, &id) in list.iter().enumerate() {
                let c = cell(id);
                match out
                    .get_mut(from..)
                    .and_then(|e| e.iter_mut().find(|e| e.0 == c))
                {
                    None => out.push((c, 1)),
                    Some(e) => {
                        // A repeat falls on the cell of its first occurrence, so only ids on a cell
                        // already taken need comparing. Equal low 32 bits are equal columns (the
                        // column is a bijection of them).
                        let id = low32(id);
                        if !list
                            .get(..k)
                            .unwrap_or_default()
                            .iter()
                            .any(|&p| low32(p) == id)
                        {
                            e.1 += 1;
                            most = most.max(e.1);
                        }
                    }
                }
            }
            most
        }
        _ => count_merged(f, list, mask, seen, hist, out),
    }
}

/// A list over [`SHORT_LIST`] ids, merged by partition; out of line, so that the short lists'
/// loop keeps its registers.
#[inline(never)]
fn count_merged<I: InputInt>(
    f: &RaggedFeature<'_>,
    list: &[I],
    mask: u32,
    seen: &mut SeenSet,
    hist: &mut [u32],
    out: &mut Vec<(u32, u32)>,
) -> u32 {
    if f.dense_words > 0 {
        seen.count_dense(f, list, mask, hist);
    } else if list.len() <= MEDIUM_LIST {
        seen.count_medium(f, list, mask, hist);
    } else {
        let mut cols = std::mem::take(&mut seen.cols);
        cols.clear();
        cols.extend(list.iter().map(|&id| column(f, low32(id), mask)));
        seen.count_long(&cols, mask, hist);
        seen.cols = cols;
    }
    let mut most = 0;
    for (p, h) in hist.iter_mut().enumerate() {
        if *h > 0 {
            most = most.max(*h);
            out.push((f.base + p as u32, std::mem::take(h)));
        }
    }
    most
}

/// An id by its low 32 bits, as the pipeline's column arithmetic reads it.
#[inline(always)]
fn low32<T: InputInt>(id: T) -> u32 {
    id.to_i64() as u32
}

/// Lists of at most this many ids find their repeats by comparing each id with those before it.
const SHORT_LIST: usize = 8;

/// Lists of at most this many ids (and more than [`SHORT_LIST`]) find their repeats in a hash
/// table of four to eight slots per id, which stays in L1 or L2 (256 KiB at most): fewer
/// instructions and cache misses than the bitmap of longer lists, which stays smaller.
const MEDIUM_LIST: usize = 16384;

/// Stacks of at most this many columns find repeated ids by direct indexing: a 64 KiB array
/// stays in cache, where an array for a larger stack would miss on most ids and cost more than
/// hashing them.
const DENSE_SEEN_MAX: u64 = 1 << 14;

/// Per partition (of at most 64), the bits of a 64-column word whose columns fall on it.
fn partition_masks(n: usize) -> [u64; 64] {
    let mut m = [0u64; 64];
    for b in 0..64 {
        m[b % n] |= 1 << b;
    }
    m
}

/// [`SeenSet::count_medium`]'s loop over the ids, testing an empty slot and the id's own in one
/// branch (`ONE_BRANCH`) or in two.
#[inline(always)]
fn medium_loop<I: InputInt, const ONE_BRANCH: bool>(
    f: &RaggedFeature<'_>,
    list: &[I],
    mask: u32,
    table: &mut [u32],
    hist: &mut [u32],
) {
    let size = table.len();
    // A 32-bit multiplier (a medium list has at most 2^16 slots): an immediate operand, which
    // leaves the loop one more register.
    let shift = 32 - size.trailing_zeros();
    let Some(last) = hist.len().checked_sub(1) else {
        return;
    };
    let mut max_seen = false;
    for &id in list {
        let id = low32(id);
        let key = id.wrapping_add(1);
        if key == 0 {
            // u32::MAX, which the table cannot hold.
            hist[partition(f, id, mask) as usize & last] += u32::from(!max_seen);
            max_seen = true;
            continue;
        }
        let mut i = (key.wrapping_mul(0x9E37_79B1) >> shift) as usize;
        let k = loop {
            let slot = &mut table[i & (size - 1)];
            let k = *slot;
            // The product is 0 exactly when a factor is: both are below 2^32 in magnitude.
            let (wide, wide_key) = (u64::from(k), u64::from(key));
            if if ONE_BRANCH {
                wide.wrapping_mul(wide.wrapping_sub(wide_key)) == 0
            } else {
                k == 0 || k == key
            } {
                *slot = key;
                break k;
            }
            i += 1;
        };
        hist[partition(f, id, mask) as usize & last] += u32::from(k == 0);
    }
}

/// Scratch for merging one (sample, feature)'s repeated ids without sorting the list or probing
/// a hash set per id (a cache miss or a mispredicted branch per id on long lists).
#[derive(Debug, Default)]
pub(super) struct SeenSet {
    /// The current list's columns.
    cols: Vec<u32>,
    /// Small stacks, lists long against the stack: a bit per column, all clear between lists.
    bits: Vec<u64>,
    /// Small stacks: columns beyond the stack (ids the pipeline rejects), merged by a sort.
    spill: Vec<u32>,
    /// Small stacks, other lists: per column, the generation that last saw it, so starting the
    /// next list clears nothing.
    stamps: Vec<u32>,
    generation: u32,
    /// For a partition count `n`, the bits of a word on each partition.
    masks: Option<(usize, Box<[u64; 64]>)>,
    /// Medium lists: ids + 1 by open addressing (0: empty), all clear between lists.
    table: Vec<u32>,
    /// Long lists: a bit per hashed column (`filter`) and the bits hit twice (`collided`).
    filter: Vec<u64>,
    collided: Vec<u64>,
    /// Long lists: (column, occurrences) of the columns whose bit was hit twice, open addressing.
    slots: Vec<(u32, u32)>,
    /// Whether the last medium list repeated a share of its ids that makes telling repeats
    /// from new ids a coin toss (see [`SeenSet::count_medium`]).
    mixed: bool,
}

impl SeenSet {
    /// Adds a list's distinct columns to `hist` (one count per partition) for a small stack, by
    /// direct indexing. A list long against the stack (high-multivalency's: hundreds of ids
    /// over 33 columns) only sets a bit per id, and each word of the bitmap is then counted
    /// per partition; any other stamps each column with the list's generation.
    fn count_dense<I: InputInt>(
        &mut self,
        f: &RaggedFeature<'_>,
        list: &[I],
        mask: u32,
        hist: &mut [u32],
    ) {
        let n = (mask + 1) as usize;
        let words = f.dense_words;
        self.spill.clear();
        if n <= 64 && 2 * words * n <= list.len() {
            self.count_bits(f, list, mask, hist);
        } else {
            let size = words * 64;
            next_generation(&mut self.stamps, &mut self.generation, size);
            let (stamps, generation) = (&mut self.stamps[..size], self.generation);
            // A partition masked by `last` needs no bounds check.
            let Some(parts) = hist.get_mut(..=mask as usize) else {
                return;
            };
            let last = parts.len() - 1;
            for &id in list {
                let c = column(f, low32(id), mask);
                match stamps.get_mut(c as usize) {
                    Some(stamp) => {
                        parts[c as usize & last] += u32::from(*stamp != generation);
                        *stamp = generation;
                    }
                    None => self.spill.push(c),
                }
            }
        }
        if !self.spill.is_empty() {
            self.spill.sort_unstable();
            self.spill.dedup();
            for &c in &self.spill {
                hist[(c & mask) as usize] += 1;
            }
        }
    }

    /// [`Self::count_dense`]'s bitmap, for at most 64 partitions. Compiled twice (see
    /// [`crate::isa`]): with hardware popcount, each word's count per partition is two
    /// instructions instead of a dozen.
    #[inline(never)]
    fn count_bits<I: InputInt>(
        &mut self,
        f: &RaggedFeature<'_>,
        list: &[I],
        mask: u32,
        hist: &mut [u32],
    ) {
        let seen = self;
        crate::dispatch_v3!(<I: InputInt> (seen: &mut SeenSet, f: &RaggedFeature<'_>, list: &[I], mask: u32, hist: &mut [u32]) -> () {
            seen.count_bits_body(f, list, mask, hist)
        })
    }

    #[inline(always)]
    fn count_bits_body<I: InputInt>(
        &mut self,
        f: &RaggedFeature<'_>,
        list: &[I],
        mask: u32,
        hist: &mut [u32],
    ) {
        let (n, words) = ((mask + 1) as usize, f.dense_words);
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        let bits = &mut self.bits[..words];
        if let [word] = bits {
            // A stack of at most 64 columns: the word stays in a register, and the loop has no
            // branch (vector shifts, where the CPU has them); columns past it are rare.
            let (mut x, mut past) = (0u64, false);
            for &id in list {
                let c = column(f, low32(id), mask);
                x |= if c < 64 { 1 << c } else { 0 };
                past |= c >= 64;
            }
            *word = x;
            if past {
                self.spill.extend(
                    list.iter()
                        .map(|&id| column(f, low32(id), mask))
                        .filter(|&c| c >= 64),
                );
            }
        } else {
            for &id in list {
                let c = column(f, low32(id), mask);
                match bits.get_mut((c / 64) as usize) {
                    Some(w) => *w |= 1 << (c % 64),
                    None => self.spill.push(c),
                }
            }
        }
        let masks = match &mut self.masks {
            Some((m, masks)) if *m == n => masks,
            slot => &mut slot.insert((n, Box::new(partition_masks(n)))).1,
        };
        for w in bits.iter_mut() {
            let x = std::mem::take(w);
            if x != 0 {
                for (h, &m) in hist.iter_mut().zip(masks.iter()) {
                    *h += (x & m).count_ones();
                }
            }
        }
    }

    /// Adds a list's distinct columns to `hist`: a table of its ids (+ 1, 0 meaning empty) by
    /// open addressing, at most a quarter full so that nearly every id finds its slot or its
    /// repeat at the first probe (each further probe is a likely mispredicted branch, which
    /// costs more time than a larger fill); cleared in one `fill`.
    ///
    /// Whether an id is new or a repeat is a branch the CPU cannot predict where lists repeat
    /// a good share of their ids (long's Zipf lists: about a third), and the compiler splits
    /// `k == 0 || k == key` into two branches however it is written. After a list that repeated
    /// between a quarter and three quarters of its ids, the next one tests both at once with
    /// a product (three more instructions per id, no mispredicted branch).
    #[inline(never)]
    fn count_medium<I: InputInt>(
        &mut self,
        f: &RaggedFeature<'_>,
        list: &[I],
        mask: u32,
        hist: &mut [u32],
    ) {
        let size = (4 * list.len()).next_power_of_two().max(32);
        if self.table.len() < size {
            self.table.resize(size, 0);
        }
        let table = &mut self.table[..size];
        // One count per partition; a partition masked by `last` needs no bounds check.
        let Some(hist) = hist.get_mut(..=mask as usize) else {
            return;
        };
        if self.mixed {
            medium_loop::<I, true>(f, list, mask, table, hist);
        } else {
            medium_loop::<I, false>(f, list, mask, table, hist);
        }
        // `hist` was all zero: it now holds the list's distinct columns.
        let repeats = list
            .len()
            .saturating_sub(hist.iter().map(|&h| h as usize).sum());
        self.mixed = 4 * repeats >= list.len() && 4 * repeats <= 3 * list.len();
        table.fill(0);
    }

    /// Adds a long list's distinct columns to `hist` (one count per partition). Every id is
    /// counted first, branch-free, while a Bloom-style bitmap (16 bits per id) marks the bits
    /// hit twice; only ids on those bits, a few percent, are then counted exactly, and each
    /// column seen k times takes back k − 1.
    fn count_long(&mut self, cols: &[u32], mask: u32, hist: &mut [u32]) {
        let bits = (16 * cols.len()).next_power_of_two().max(1024);
        let words = bits / 64;
        let shift = 64 - bits.trailing_zeros();
        let hash = |c: u32| ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize;
        self.filter.clear();
        self.filter.resize(words, 0);
        self.collided.clear();
        self.collided.resize(words, 0);
        let mut any = 0u64;
        for &c in cols {
            let h = hash(c);
            let (w, m) = (h / 64, 1u64 << (h % 64));
            let hit = self.filter[w] & m;
            self.collided[w] |= hit;
            self.filter[w] |= m;
            any |= hit;
            hist[(c & mask) as usize] += 1;
        }
        if any == 0 {
            return;
        }
        // Exact counts of the ids on collided bits.
        let candidates = cols.iter().filter(|&&c| {
            let h = hash(c);
            self.collided[h / 64] & (1u64 << (h % 64)) != 0
        });
        let size = (2 * candidates.clone().count()).next_power_of_two().max(16);
        self.slots.clear();
        self.slots.resize(size, (0, 0));
        let slot_shift = 64 - size.trailing_zeros();
        for &c in candidates {
            let mut i = ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> slot_shift) as usize;
            loop {
                let slot = &mut self.slots[i];
                if slot.1 == 0 {
                    *slot = (c, 1);
                    break;
                }
                if slot.0 == c {
                    slot.1 += 1;
                    break;
                }
                i = (i + 1) & (size - 1);
            }
        }
        for &(c, k) in &self.slots {
            if k > 1 {
                let h = &mut hist[(c & mask) as usize];
                *h = h.wrapping_sub(k - 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{column, CountRow, RaggedFeature, SeenSet};
    use crate::input::{Ids, Offsets};

    /// Every row's entries from `count_row` against a sort of the row's columns, for a
    /// stack of `vocab` columns (dense below 2^14) over `n` partitions.
    fn check_feature(lists: &[Vec<i64>], vocab: u64, n: u32, col_shift: u32, col_offset: u32) {
        let ids: Vec<i64> = lists.concat();
        let mut offsets = vec![0i32];
        for l in lists {
            offsets.push(offsets.last().unwrap() + l.len() as i32);
        }
        let f = RaggedFeature {
            ids: Ids::I64(&ids),
            offsets: Offsets::I32(&offsets),
            base: 3 * n,
            col_shift,
            col_offset,
            dense_words: if vocab <= super::DENSE_SEEN_MAX {
                vocab.div_ceil(64) as usize
            } else {
                0
            },
        };
        let mask = n - 1;
        let (mut seen, mut hist, mut entries, mut starts) = (
            SeenSet::default(),
            vec![0u32; n as usize],
            Vec::new(),
            vec![0u32],
        );
        for r in 0..lists.len() {
            let most = f.count_row(r, mask, &mut seen, &mut hist, &mut entries);
            let from = *starts.last().unwrap() as usize;
            assert_eq!(
                most,
                entries[from..].iter().map(|e| e.1).max().unwrap_or(0),
                "row {r}: largest count"
            );
            starts.push(entries.len() as u32);
        }
        for (r, l) in lists.iter().enumerate() {
            let mut cols: Vec<u32> = l.iter().map(|&id| column(&f, id as u32, mask)).collect();
            cols.sort_unstable();
            cols.dedup();
            let mut want = vec![0u32; n as usize];
            for c in cols {
                want[(c & mask) as usize] += 1;
            }
            let mut got = vec![0u32; n as usize];
            for &(cell, k) in &entries[starts[r] as usize..starts[r + 1] as usize] {
                assert!(
                    got[(cell - 3 * n) as usize] == 0,
                    "row {r}: cell {cell} twice"
                );
                got[(cell - 3 * n) as usize] = k;
            }
            assert_eq!(
                got,
                want,
                "row {r} of {} ids, vocab {vocab}, {n} partitions",
                l.len()
            );
        }
        assert!(hist.iter().all(|&h| h == 0), "scratch left dirty");
    }

    #[test]
    fn every_list_length_counts_each_column_once() {
        let mut x = 99u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (vocab, n) in [
            (33u64, 4u32),
            (1000, 4),
            (1000, 16),
            (10_000, 4),
            (1 << 14, 64),
            (100_000_000, 4),
            (100_000_000, 16),
        ] {
            let mut lists = Vec::new();
            for len in [
                0usize, 1, 2, 2, 3, 5, 8, 9, 16, 17, 40, 100, 300, 513, 4096, 5000, 20_000,
            ] {
                for spread in [vocab, 20] {
                    lists.push(
                        (0..len)
                            .map(|_| (next() % spread.min(vocab)) as i64)
                            .collect::<Vec<i64>>(),
                    );
                }
            }
            // Ids past the stack (rejected by the pipeline), negative ids and u32::MAX.
            lists.push(vec![
                vocab as i64 + 70,
                5,
                vocab as i64 + 70,
                1 << 20,
                5,
                1 << 20,
                7,
                9,
                11,
                13,
            ]);
            lists.push(
                (0..600)
                    .map(|k| {
                        if k % 3 == 0 {
                            -1
                        } else {
                            (vocab + 64 * (k % 5)) as i64
                        }
                    })
                    .collect(),
            );
            lists.push(vec![u32::MAX as i64; 30]);
            lists.push(vec![7, 7]);
            check_feature(
                &lists,
                vocab,
                n,
                1 % n,
                if vocab > 1000 { 0 } else { 8 * n },
            );
        }
    }

    /// A slice's distinct columns per partition over two features of a stack, by the unique
    /// guard's bitmap (some columns past it) and its hash set, against a sort.
    #[test]
    fn a_slices_distinct_columns_by_bitmap_and_hash_set() {
        use super::{SampleRef, UniqueCounter};
        let mut x = 7u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let n = 4u32;
        let mask = n - 1;
        // Ids mostly below 1000 (a feature's vocabulary), some past it, negative or u32::MAX.
        let lists: Vec<Vec<Vec<i64>>> = (0..2)
            .map(|_| {
                (0..50)
                    .map(|r| {
                        (0..r % 13)
                            .map(|_| match next() % 40 {
                                0 => 1000 + (next() % 5000) as i64,
                                1 => -1 - (next() % 3) as i64,
                                2 => u32::MAX as i64,
                                _ => (next() % 1000) as i64,
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let flat: Vec<(Vec<i64>, Vec<i32>)> = lists
            .iter()
            .map(|ls| {
                let mut offsets = vec![0i32];
                for l in ls {
                    offsets.push(offsets.last().unwrap() + l.len() as i32);
                }
                (ls.concat(), offsets)
            })
            .collect();
        let features: Vec<RaggedFeature<'_>> = flat
            .iter()
            .enumerate()
            .map(|(k, (ids, offsets))| RaggedFeature {
                ids: Ids::I64(ids),
                offsets: Offsets::I32(offsets),
                base: 0,
                col_shift: k as u32 % n,
                col_offset: 1000 * k as u32,
                dense_words: 0,
            })
            .collect();
        let views = vec![features];
        let slice: Vec<SampleRef> = (0..50).map(|row| SampleRef { batch: 0, row }).collect();
        let mut want = vec![0u32; n as usize];
        let mut cols: Vec<u32> = Vec::new();
        for (f, ls) in views[0].iter().zip(&lists) {
            cols.extend(ls.iter().flatten().map(|&id| column(f, id as u32, mask)));
        }
        let ids = cols.len();
        cols.sort_unstable();
        cols.dedup();
        for c in cols {
            want[(c & mask) as usize] += 1;
        }
        let mut counter = UniqueCounter::default();
        for round in 0..2 {
            for words in [1usize, 20, 32, 100] {
                counter.per_partition = vec![0; n as usize];
                counter.count_dense(&views, &slice, &[0, 1], words, mask);
                assert_eq!(
                    counter.per_partition, want,
                    "bitmap of {words} words, round {round}"
                );
            }
            counter.per_partition = vec![0; n as usize];
            counter.count_hashed(&views, &slice, &[0, 1], ids, mask);
            assert_eq!(counter.per_partition, want, "hash set, round {round}");
        }
    }

    /// Distinct columns per partition (4), counted by `count_long`, against a sort.
    fn check(cols: &[u32]) {
        let mut hist = [0u32; 4];
        let mut seen = SeenSet::default();
        seen.count_long(cols, 3, &mut hist);
        let counts: Vec<i64> = hist.iter().map(|&h| h as i64).collect();
        let mut sorted = cols.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut want = vec![0i64; 4];
        for c in sorted {
            want[(c & 3) as usize] += 1;
        }
        assert_eq!(counts, want, "{} ids", cols.len());
    }

    #[test]
    fn long_lists_count_each_column_once() {
        // No repeats, a few, mostly repeats, one column only, and a list long enough that its
        // bitmap has many collisions of distinct columns.
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        check(&(0..1000).map(|k| k * 7 + 1).collect::<Vec<u32>>());
        check(
            &(0..1000)
                .map(|_| (next() % 100_000_000) as u32)
                .chain([5, 5, 9, 5])
                .collect::<Vec<u32>>(),
        );
        check(
            &(0..3000)
                .map(|_| (next() % 50) as u32)
                .collect::<Vec<u32>>(),
        );
        check(&[42u32; 40]);
        check(
            &(0..100_000)
                .map(|_| (next() % 60_000) as u32)
                .collect::<Vec<u32>>(),
        );
    }
}
