//! Counting each sample's ids per (stack, partition) after the per-sample merge, as the
//! pipeline counts them.

use crate::error::{Error, Result};
use crate::input::{FeatureView, Ids, Offsets, SampleSource};
use crate::spec::Plan;

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

/// A batch's features, read once per batch rather than once per sample.
pub(super) struct BatchFeatures<'a> {
    features: Vec<RaggedFeature<'a>>,
    /// Partitions minus one.
    mask: u32,
    /// Per cell, 1 / the stack's `max_ids_per_partition`.
    pub(super) inv_limit: Vec<f64>,
}

pub(super) fn ragged_views<'a>(plan: &Plan, inputs: &'a [&'a (dyn SampleSource + 'a)]) -> Result<BatchFeatures<'a>> {
    let n = plan.layout.num_partitions();
    let features = plan
        .features
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
        .collect::<Result<Vec<_>>>()?;
    let inv_limit = plan.stacks.iter().flat_map(|s| std::iter::repeat_n(1.0 / s.max_ids_per_partition.max(1) as f64, n)).collect();
    Ok(BatchFeatures { features, mask: (n - 1) as u32, inv_limit })
}

/// Adds one sample's ids per (stack, partition) cell to `acc` (listing first-touched cells in
/// `touched`), merged per feature as the pipeline merges them. Every feature has the batch's
/// rows (checked by the caller).
pub(super) fn count_sample(batch: &BatchFeatures<'_>, row: usize, seen: &mut SeenSet, acc: &mut [u32], touched: &mut Vec<u32>) {
    let mask = batch.mask;
    touched.clear();
    for f in &batch.features {
        let (a, b) = f.offsets.range(row);
        // The column is a bijection of the id (per feature), so distinct columns are distinct
        // ids, as the pipeline merges them.
        let col = |id: i64| {
            let id = id as u32;
            ((id.wrapping_add(f.col_shift) & mask) | (id & !mask)).wrapping_add(f.col_offset)
        };
        let mut cols = std::mem::take(&mut seen.cols);
        cols.clear();
        match f.ids {
            Ids::I32(v) => cols.extend(v.get(a..b).unwrap_or_default().iter().map(|&i| col(i as i64))),
            Ids::I64(v) => cols.extend(v.get(a..b).unwrap_or_default().iter().map(|&i| col(i))),
        }
        let mut add = |c: u32, n: i32| {
            let cell = f.base + (c & mask);
            let slot = &mut acc[cell as usize];
            if *slot == 0 {
                touched.push(cell);
            }
            *slot = slot.wrapping_add_signed(n);
        };
        match cols.len() {
            0 => {}
            1 => add(cols[0], 1),
            n if n <= SHORT_LIST => {
                for k in 0..n {
                    if !cols[..k].contains(&cols[k]) {
                        add(cols[k], 1);
                    }
                }
            }
            _ if f.dense => {
                seen.next_generation();
                for &c in &cols {
                    if seen.insert_dense(c) {
                        add(c, 1);
                    }
                }
            }
            _ => seen.count_long(&cols, &mut add),
        }
        seen.cols = cols;
    }
}

/// Lists of at most this many ids find their repeats by comparing each id with those before it.
const SHORT_LIST: usize = 16;

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

    /// Whether `c` is new in the current list (small stacks).
    #[inline]
    fn insert_dense(&mut self, c: u32) -> bool {
        // Columns of a small stack are below its vocabulary; an id beyond it is one the
        // pipeline rejects, counted here as it comes.
        let Some(stamp) = self.dense.get_mut(c as usize) else {
            return true;
        };
        let new = *stamp != self.generation;
        *stamp = self.generation;
        new
    }

    /// Counts a long list's distinct columns through `add(column, change)`. Every id is counted
    /// first, branch-free, while a Bloom-style bitmap (16 bits per id) marks the bits hit twice;
    /// only ids on those bits, a few percent, are then counted exactly, and each column seen k
    /// times takes back k − 1.
    fn count_long(&mut self, cols: &[u32], add: &mut impl FnMut(u32, i32)) {
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
            add(c, 1);
        }
        if any == 0 {
            return;
        }
        // Exact counts of the ids on collided bits.
        let candidates = cols.iter().filter(|&&c| {
            let h = hash(c);
            self.collided[h / 64] & (1u64 << (h % 64)) != 0
        });
        let n = candidates.clone().count();
        let size = (2 * n).next_power_of_two().max(16);
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
                add(c, -((k - 1) as i32));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeenSet;

    /// Distinct columns per partition (4), counted by `count_long`, against a sort.
    fn check(cols: &[u32]) {
        let mut counts = [0i64; 4];
        let mut seen = SeenSet::default();
        seen.count_long(cols, &mut |c, n| counts[(c & 3) as usize] += n as i64);
        let mut sorted = cols.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut want = [0i64; 4];
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
