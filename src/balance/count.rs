//! Counting each sample's ids per (stack, partition) after the per-sample merge, as the
//! pipeline counts them.

use arrow_array::RecordBatch;

use super::{SampleCounts, SampleRef};
use crate::error::{Error, Result};
use crate::extract::InputInt;
use crate::input::{features_from_record_batch, FeatureView, Ids, Offsets, SampleSource};
use crate::spec::{Config, Plan};

/// One feature of a batch as counting reads it.
struct RaggedFeature<'a> {
    ids: Ids<'a>,
    offsets: Offsets<'a>,
    /// First cell of the feature's stack.
    base: u32,
    col_shift: u32,
    col_offset: u32,
    /// Repeated ids are found by direct indexing (see [`DENSE_SEEN_MAX`]).
    dense: bool,
}

fn ragged_views<'a>(plan: &Plan, inputs: &'a [&'a (dyn SampleSource + 'a)]) -> Result<Vec<RaggedFeature<'a>>> {
    let n = plan.layout.num_partitions();
    plan.features
        .iter()
        .zip(inputs)
        .map(|(fp, input)| match input.view() {
            FeatureView::Ragged { ids, offsets, .. } => Ok(RaggedFeature {
                ids,
                offsets,
                base: (fp.stack * n) as u32,
                col_shift: fp.col_shift,
                col_offset: fp.col_offset,
                dense: plan.stacks[fp.stack].stack_vocab_size <= DENSE_SEEN_MAX,
            }),
            _ => Err(Error::input(&fp.name, "balancing reads record batches, whose features are ragged lists")),
        })
        .collect()
}

/// Counts a batch's samples, reusing its scratch from batch to batch.
///
/// Two passes, because a sample's features are stored column by column: first feature by
/// feature, every row's merged ids per partition (one tight loop per feature, where a
/// sample-by-sample walk paid a feature's setup for every sample and id); then sample by
/// sample, its entries of every feature, summed where two features share a stack.
#[derive(Debug, Default)]
pub(super) struct Counter {
    seen: SeenSet,
    /// Per feature: every row's `(cell, ids)` entries, row `r` owning `entries[f][starts[f][r]..starts[f][r + 1]]`.
    entries: Vec<Vec<(u32, u32)>>,
    starts: Vec<Vec<u32>>,
    /// Per partition: one list's distinct ids (four interleaved copies for long lists, so that
    /// consecutive ids of one partition do not wait on each other's increments).
    hist: Vec<u32>,
    /// Per cell: one sample's ids in stacks of several features, and the cells it touched.
    acc: Vec<u32>,
    touched: Vec<u32>,
}

impl Counter {
    /// Appends every row of a batch (index `batch` in the window) to `counts`. Every input has
    /// `rows` samples (checked by the caller).
    pub(super) fn count_batch<'a>(&mut self, plan: &Plan, inputs: &'a [&'a (dyn SampleSource + 'a)], batch: usize, rows: usize, counts: &mut SampleCounts) -> Result<()> {
        let features = ragged_views(plan, inputs)?;
        let n = plan.layout.num_partitions();
        let mask = (n - 1) as u32;
        self.entries.resize_with(features.len(), Vec::new);
        self.starts.resize_with(features.len(), Vec::new);
        self.hist.clear();
        self.hist.resize(4 * n, 0);
        for (f, feature) in features.iter().enumerate() {
            let (entries, starts) = (&mut self.entries[f], &mut self.starts[f]);
            entries.clear();
            starts.clear();
            starts.push(0);
            match (feature.ids, feature.offsets) {
                (Ids::I32(ids), Offsets::I32(o)) => count_feature(feature, ids, o, rows, mask, &mut self.seen, &mut self.hist, entries, starts),
                (Ids::I32(ids), Offsets::I64(o)) => count_feature(feature, ids, o, rows, mask, &mut self.seen, &mut self.hist, entries, starts),
                (Ids::I64(ids), Offsets::I32(o)) => count_feature(feature, ids, o, rows, mask, &mut self.seen, &mut self.hist, entries, starts),
                (Ids::I64(ids), Offsets::I64(o)) => count_feature(feature, ids, o, rows, mask, &mut self.seen, &mut self.hist, entries, starts),
            }
        }
        // Stacks in plan order with their features; one feature's entries are already merged.
        let inv_limit: Vec<f64> = plan.stacks.iter().map(|s| 1.0 / s.max_ids_per_partition.max(1) as f64).collect();
        self.acc.clear();
        self.acc.resize(plan.stacks.len() * n, 0);
        counts.cells.reserve(self.entries[..features.len()].iter().map(Vec::len).sum());
        for row in 0..rows {
            let mut peak = 0f64;
            for (stack, &inv) in plan.stacks.iter().zip(&inv_limit) {
                let fs = &stack.features;
                if let [f] = fs[..] {
                    let (a, b) = (self.starts[f][row] as usize, self.starts[f][row + 1] as usize);
                    for &e in &self.entries[f][a..b] {
                        counts.cells.push(e);
                        peak = peak.max(e.1 as f64 * inv);
                    }
                } else {
                    self.touched.clear();
                    for &f in fs {
                        for &(c, k) in &self.entries[f][self.starts[f][row] as usize..self.starts[f][row + 1] as usize] {
                            let slot = &mut self.acc[c as usize];
                            if *slot == 0 {
                                self.touched.push(c);
                            }
                            *slot += k;
                        }
                    }
                    for &c in &self.touched {
                        let k = std::mem::take(&mut self.acc[c as usize]);
                        counts.cells.push((c, k));
                        peak = peak.max(k as f64 * inv);
                    }
                }
            }
            counts.refs.push(SampleRef { batch, row });
            counts.start.push(counts.cells.len());
            counts.peak.push(peak);
        }
        Ok(())
    }
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
        if self.keys.len() < size {
            self.keys = vec![0; size];
            self.stamps = vec![0; size];
            self.generation = 0;
        }
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.stamps.fill(0);
            self.generation = 1;
        }
        self.size = size;
    }

    /// Whether `c` is new to the set (it is in it afterwards).
    #[inline]
    fn insert(&mut self, c: u32) -> bool {
        let shift = 64 - self.size.trailing_zeros();
        let mut i = ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize;
        loop {
            if self.stamps[i] != self.generation {
                self.stamps[i] = self.generation;
                self.keys[i] = c;
                return true;
            }
            if self.keys[i] == c {
                return false;
            }
            i = (i + 1) & (self.size - 1);
        }
    }
}

/// Distinct columns per (slice, cell): the pipeline's unique ids, which per-sample counts cannot
/// give (two samples of a slice may share an id). Counted with a hash set per (slice, stack)
/// instead of the pipeline's sort of every stack: only the stacks that could pass their unique
/// limit are asked for.
#[derive(Debug, Default)]
pub(super) struct UniqueCounter {
    set: StampedSet,
    /// Per partition: distinct columns of the current (slice, stack).
    per_partition: Vec<u32>,
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
        let features = window.iter().map(|rb| features_from_record_batch(config, rb)).collect::<Result<Vec<_>>>()?;
        let inputs: Vec<Vec<&dyn SampleSource>> = features.iter().map(|fs| fs.iter().map(|f| f as &dyn SampleSource).collect()).collect();
        let views = inputs.iter().map(|i| ragged_views(plan, i)).collect::<Result<Vec<_>>>()?;
        let n = plan.layout.num_partitions();
        let mask = (n - 1) as u32;
        let mut worst = vec![vec![0i32; plan.stacks.len()]; order.len()];
        for (k, rows) in order.iter().enumerate() {
            let per_slice = rows.len() / slices.max(1);
            for slice in rows.chunks(per_slice.max(1)) {
                for (st, stack) in plan.stacks.iter().enumerate().filter(|&(st, _)| stacks.get(st).copied().unwrap_or(false)) {
                    let fs = &stack.features;
                    let length = |r: &SampleRef, f: usize| {
                        let (a, b) = views[r.batch][f].offsets.range(r.row);
                        b - a
                    };
                    let ids: usize = slice.iter().map(|r| fs.iter().map(|&f| length(r, f)).sum::<usize>()).sum();
                    self.start(ids, n);
                    for r in slice {
                        for &f in fs {
                            let v = &views[r.batch][f];
                            let (a, b) = v.offsets.range(r.row);
                            match v.ids {
                                Ids::I32(x) => x.get(a..b).unwrap_or_default().iter().for_each(|&id| self.insert(column(v, id as u32, mask), mask)),
                                Ids::I64(x) => x.get(a..b).unwrap_or_default().iter().for_each(|&id| self.insert(column(v, id as u32, mask), mask)),
                            }
                        }
                    }
                    let most = self.per_partition.iter().copied().max().unwrap_or(0);
                    worst[k][st] = worst[k][st].max(most.min(i32::MAX as u32) as i32);
                }
            }
        }
        Ok(worst)
    }

    /// Empties the set for up to `ids` columns over `partitions` partitions.
    fn start(&mut self, ids: usize, partitions: usize) {
        self.set.start(2 * ids);
        self.per_partition.clear();
        self.per_partition.resize(partitions, 0);
    }

    #[inline]
    fn insert(&mut self, c: u32, mask: u32) {
        if self.set.insert(c) {
            self.per_partition[(c & mask) as usize] += 1;
        }
    }
}

/// Column of an id within its stack, as the pipeline computes it. It is a bijection of the id
/// (per feature), so distinct columns are distinct ids, as the pipeline merges them.
#[inline(always)]
fn column(f: &RaggedFeature<'_>, id: u32, mask: u32) -> u32 {
    ((id.wrapping_add(f.col_shift) & mask) | (id & !mask)).wrapping_add(f.col_offset)
}

/// One feature's rows: per row, its distinct ids per partition as `(cell, ids)` entries.
#[allow(clippy::too_many_arguments)]
fn count_feature<I: InputInt, O: InputInt>(
    f: &RaggedFeature<'_>,
    ids: &[I],
    offsets: &[O],
    rows: usize,
    mask: u32,
    seen: &mut SeenSet,
    hist: &mut [u32],
    entries: &mut Vec<(u32, u32)>,
    starts: &mut Vec<u32>,
) {
    let offsets = &offsets[..(rows + 1).min(offsets.len())];
    let first = offsets.first().map_or(0, |o| o.to_usize());
    // Every row holding exactly one id (criteo's features): one entry per row, no merging.
    if offsets.len() == rows + 1 && offsets.windows(2).all(|w| w[1].to_usize() == w[0].to_usize() + 1) {
        if let Some(run) = ids.get(first..first + rows) {
            entries.extend(run.iter().map(|&id| (f.base + (column(f, low32(id), mask) & mask), 1)));
            starts.extend(1..=rows as u32);
            return;
        }
    }
    let n = (mask + 1) as usize;
    let mut cols = std::mem::take(&mut seen.cols);
    for row in 0..rows {
        let (a, b) = match (offsets.get(row), offsets.get(row + 1)) {
            (Some(a), Some(b)) => (a.to_usize(), b.to_usize()),
            _ => (0, 0),
        };
        let list = ids.get(a..b).unwrap_or_default();
        let from = entries.len();
        match list.len() {
            0 => {}
            1 => entries.push((f.base + (column(f, low32(list[0]), mask) & mask), 1)),
            len if len <= SHORT_LIST => {
                // Equal low 32 bits are equal columns (the column is a bijection of them).
                for k in 0..len {
                    let id = low32(list[k]);
                    if list[..k].iter().any(|&p| low32(p) == id) {
                        continue;
                    }
                    let cell = f.base + (column(f, id, mask) & mask);
                    match entries[from..].iter_mut().find(|e| e.0 == cell) {
                        Some(e) => e.1 += 1,
                        None => entries.push((cell, 1)),
                    }
                }
            }
            _ => {
                cols.clear();
                cols.extend(list.iter().map(|&id| column(f, low32(id), mask)));
                if f.dense {
                    seen.count_dense(&cols, mask, hist);
                } else if cols.len() <= MEDIUM_LIST {
                    seen.count_medium(&cols, mask, hist);
                } else {
                    seen.count_long(&cols, mask, hist);
                }
                // Fold the four copies into the first and emit the partitions hit.
                for p in 0..n {
                    let k = hist[p].wrapping_add(hist[n + p]).wrapping_add(hist[2 * n + p]).wrapping_add(hist[3 * n + p]);
                    hist[p] = 0;
                    hist[n + p] = 0;
                    hist[2 * n + p] = 0;
                    hist[3 * n + p] = 0;
                    if k > 0 {
                        entries.push((f.base + p as u32, k));
                    }
                }
            }
        }
        starts.push(entries.len() as u32);
    }
    seen.cols = cols;
}

/// An id by its low 32 bits, as the pipeline's column arithmetic reads it.
#[inline(always)]
fn low32<T: InputInt>(id: T) -> u32 {
    id.to_i64() as u32
}

/// Lists of at most this many ids find their repeats by comparing each id with those before it.
const SHORT_LIST: usize = 16;

/// Lists of at most this many ids (and more than [`SHORT_LIST`]) find their repeats in a hash
/// set that stays in L1.
const MEDIUM_LIST: usize = 512;

/// Stacks of at most this many columns find repeated ids by direct indexing (a 64 KiB array,
/// which stays in cache; a 4 MiB one made criteo's balancing 4× slower than hashing).
const DENSE_SEEN_MAX: u64 = 1 << 14;

/// Scratch for merging one (sample, feature)'s repeated ids. Sorting each list to merge it cost
/// more than the rest of balancing together, and a hash set probed per id was most of the
/// balancer's time on long lists (a cache miss or a mispredicted branch per id).
#[derive(Debug, Default)]
pub(super) struct SeenSet {
    /// The current list's columns.
    cols: Vec<u32>,
    /// Per column of a small stack: the generation that last saw it, so starting the next list
    /// clears nothing.
    dense: Vec<u32>,
    generation: u32,
    /// Long lists: a bit per hashed column (`filter`) and the bits hit twice (`collided`).
    filter: Vec<u64>,
    collided: Vec<u64>,
    /// Long lists: (column, occurrences) of the columns whose bit was hit twice, open addressing.
    slots: Vec<(u32, u32)>,
    /// Medium lists: their columns so far.
    medium: StampedSet,
}

impl SeenSet {
    fn next_generation(&mut self) {
        if self.dense.is_empty() {
            self.dense = vec![0; DENSE_SEEN_MAX as usize];
        }
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.dense.fill(0);
            self.generation = 1;
        }
    }

    /// Adds a long list's distinct columns to `hist` (four interleaved copies of the
    /// partitions), for a small stack: a stamp per column says whether this list saw it.
    fn count_dense(&mut self, cols: &[u32], mask: u32, hist: &mut [u32]) {
        self.next_generation();
        let n = (mask + 1) as usize;
        let generation = self.generation;
        for (k, &c) in cols.iter().enumerate() {
            // Columns of a small stack are below its vocabulary; an id beyond it is one the
            // pipeline rejects, counted here as it comes.
            let new = match self.dense.get_mut(c as usize) {
                Some(stamp) => {
                    let new = *stamp != generation;
                    *stamp = generation;
                    new
                }
                None => true,
            };
            hist[(k & 3) * n + (c & mask) as usize] += u32::from(new);
        }
    }

    /// Adds a list's distinct columns to `hist`: a hash set small enough to stay in L1, whose
    /// slots are claimed by stamping them with the list's generation (nothing to clear).
    fn count_medium(&mut self, cols: &[u32], mask: u32, hist: &mut [u32]) {
        let n = (mask + 1) as usize;
        self.medium.start(4 * cols.len());
        for (k, &c) in cols.iter().enumerate() {
            hist[(k & 3) * n + (c & mask) as usize] += u32::from(self.medium.insert(c));
        }
    }

    /// Adds a long list's distinct columns to `hist` (four interleaved copies of the
    /// partitions). Every id is counted first, branch-free, while a Bloom-style bitmap (16 bits
    /// per id) marks the bits hit twice; only ids on those bits, a few percent, are then counted
    /// exactly, and each column seen k times takes back k − 1.
    fn count_long(&mut self, cols: &[u32], mask: u32, hist: &mut [u32]) {
        let n = (mask + 1) as usize;
        let bits = (16 * cols.len()).next_power_of_two().max(1024);
        let words = bits / 64;
        let shift = 64 - bits.trailing_zeros();
        let hash = |c: u32| ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize;
        self.filter.clear();
        self.filter.resize(words, 0);
        self.collided.clear();
        self.collided.resize(words, 0);
        let mut any = 0u64;
        for (k, &c) in cols.iter().enumerate() {
            let h = hash(c);
            let (w, m) = (h / 64, 1u64 << (h % 64));
            let hit = self.filter[w] & m;
            self.collided[w] |= hit;
            self.filter[w] |= m;
            any |= hit;
            hist[(k & 3) * n + (c & mask) as usize] += 1;
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
                // The copies are summed with wrapping arithmetic, so the first may go below zero.
                let h = &mut hist[(c & mask) as usize];
                *h = h.wrapping_sub(k - 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeenSet;

    /// Distinct columns per partition (4), counted by `count_long`, against a sort.
    fn check(cols: &[u32]) {
        let mut hist = [0u32; 16];
        let mut seen = SeenSet::default();
        seen.count_long(cols, 3, &mut hist);
        let counts: Vec<i64> = (0..4).map(|p| (0..4).fold(0u32, |sum, k| sum.wrapping_add(hist[k * 4 + p])) as i64).collect();
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
        check(&(0..1000).map(|_| (next() % 100_000_000) as u32).chain([5, 5, 9, 5]).collect::<Vec<u32>>());
        check(&(0..3000).map(|_| (next() % 50) as u32).collect::<Vec<u32>>());
        check(&[42u32; 40]);
        check(&(0..100_000).map(|_| (next() % 60_000) as u32).collect::<Vec<u32>>());
    }
}
