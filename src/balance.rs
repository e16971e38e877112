//! Balanced batches for ordinary CTR data: reorder the samples of a window of record batches so
//! that every (local SparseCore slice, partition) cell gets an even share of ids.
//!
//! Limits and COO buffers are sized by the busiest cell of any batch. The S slices of a local
//! batch belong to one training step, so moving a sample (with every column of its row) from one
//! slice to another changes no gradient sum or mean, but it can lower the busiest cell. Pooling a
//! window of W batches and handing the samples back out as W batches of the same sizes lowers it
//! further.
//!
//! The balancer counts each sample's ids per (stack, partition) after the per-sample merge of
//! duplicate ids, exactly as the pipeline counts them (a sample's repeated id in one feature is
//! one id; the same id in two features of a stack is two, since their stacked rows differ). Those
//! counts, summed over a slice's samples, are the pipeline's per-(SparseCore, partition) id
//! counts, so the worst `max_ids_per_partition` and the required buffer of any order follow from
//! them without running the pipeline. It then places samples greedily: in decreasing order of
//! their largest count relative to the stack's `max_ids_per_partition`, each into the slice (with
//! room left) where the new peak is lowest; and then swaps pairs of samples between slices while
//! a swap lowers the worst cell without raising any cell it touches to that level (the greedy
//! alone stopped up to 3.5% above the lower bound where the swaps reach it), and after that
//! while a swap lowers the worst buffer without passing the peak reached. Unique ids are not
//! minimised: they need the pipeline's sort of a whole slice. The new order is kept only if every output batch's
//! worst `max_ids` relative to its limit is strictly lower than its input batch's (W = 1) or
//! than the window's worst input batch's (W > 1, where batches trade samples), and no stack's
//! `max_ids`, required buffer or `max_unique_ids` rises above both that reference and its
//! configured limit; otherwise the input order is returned. So balancing never makes a batch
//! worse than what it was, or was pooled from, and a window that fit its limits still fits them.
//! Unique ids are the one number the counts cannot give (they need the pipeline's sort), so the
//! pipeline's statistics run on both orders only when some cell's ids exceed the stack's
//! `max_unique_ids_per_partition`, the one case in which unique ids could pass it.
//! [`measure`] runs the same statistics when a report wants `max_unique_ids`.
//!
//! Everything runs on one thread in a fixed order, so the result does not depend on the thread
//! count.

use std::collections::BTreeSet;

use arrow_array::RecordBatch;

use crate::error::{Error, Result};
use crate::input::{features_from_record_batch, features_from_record_batch_reusing, FeatureView, HashBuffers, Ids, Offsets, SampleSource};
use crate::output::Output;
use crate::preprocess::Preprocessor;
use crate::spec::{Config, Plan};

/// Where one output row comes from: input batch `batch`, row `row` (both within the window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SampleRef {
    /// Index of the input batch in the window.
    pub batch: usize,
    /// Row within that batch.
    pub row: usize,
}

/// The pipeline's worst cells of one stack over a run of batches (see [`measure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StackLoad {
    /// Largest `max_ids_per_partition` of any batch.
    pub max_ids_per_partition: i32,
    /// Largest `max_unique_ids_per_partition` of any batch.
    pub max_unique_ids_per_partition: i32,
    /// Largest per-device required buffer of any batch.
    pub required_buffer: u64,
}

/// The worst cells of one stack over a window, counted from its samples. Both numbers equal
/// the pipeline's statistics for the same batches (`max_unique_ids` needs the pipeline's sort:
/// [`measure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct IdLoad {
    /// Largest `max_ids_per_partition` of any batch.
    pub max_ids_per_partition: i32,
    /// Largest per-device required buffer of any batch: S × the largest Σ over partitions of
    /// a SparseCore's ids rounded up to 8.
    pub required_buffer: u64,
}

/// What balancing a window did, per stack (in plan order).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct BalanceReport {
    /// Batches in the window.
    pub batches: usize,
    /// Stack names.
    pub stacks: Vec<String>,
    /// Worst cells in the input order.
    pub before: Vec<IdLoad>,
    /// Worst cells in the returned order (equal to `before` when the input order was kept).
    pub after: Vec<IdLoad>,
    /// No order of the window's samples can do better than this `max_ids_per_partition`
    /// (see [`lower_bound`]).
    pub lower_bound: Vec<u32>,
    /// Whether the balanced order was kept (false: it would not have made every batch better,
    /// or there was nothing to move).
    pub reordered: bool,
}

/// A balanced window: the batches in their new order, the permutation and the report.
#[derive(Debug, Clone)]
pub struct Balanced {
    /// The same rows, reordered; each batch keeps its input size and schema.
    pub batches: Vec<RecordBatch>,
    /// `permutation[k][i]`: where row i of output batch k comes from.
    pub permutation: Vec<Vec<SampleRef>>,
    /// Before and after.
    pub report: BalanceReport,
}

/// Balances a window of record batches for `config` (see the module docs). The batches must
/// share one schema; each output batch keeps the size of the input batch at its position.
/// A stream of windows should reuse one [`Balancer`] instead.
pub fn balance(config: &Config, window: &[RecordBatch]) -> Result<Balanced> {
    Balancer::new(config.clone())?.balance(window)
}

/// Balances window after window, keeping its plan and scratch memory between them.
#[derive(Debug)]
pub struct Balancer {
    /// Plans the layout (the pipeline's own planner and plan cache).
    prep: Preprocessor,
    hash_buffers: HashBuffers,
    counts: SampleCounts,
    /// Per (slice, cell) id counts while placing.
    load: Vec<u32>,
    /// Per cell: ids of one sample (`acc`) and the cells it touched (`touched`).
    acc: Vec<u32>,
    touched: Vec<u32>,
    seen: SeenSet,
}

/// Every sample's (cell, ids) pairs, stored flat: sample i owns `cells[start[i]..start[i + 1]]`.
#[derive(Debug, Default)]
struct SampleCounts {
    refs: Vec<SampleRef>,
    start: Vec<usize>,
    cells: Vec<(u32, u32)>,
    /// Largest ids / limit over the sample's cells.
    peak: Vec<f64>,
}

/// The shape the counts are laid out in.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Slices (local SparseCores) per batch.
    slices: usize,
    sc_per_device: usize,
    partitions: usize,
    stacks: usize,
}

impl Shape {
    fn cells(&self) -> usize {
        self.stacks * self.partitions
    }
}

impl Balancer {
    /// A balancer for `config`.
    pub fn new(config: Config) -> Result<Self> {
        Ok(Balancer {
            prep: Preprocessor::builder(config).threads(1).build()?,
            hash_buffers: HashBuffers::new(),
            counts: SampleCounts::default(),
            load: Vec::new(),
            acc: Vec::new(),
            touched: Vec::new(),
            seen: SeenSet::default(),
        })
    }

    /// Balances one window (see the module docs).
    pub fn balance(&mut self, window: &[RecordBatch]) -> Result<Balanced> {
        let Some(shape) = self.count(window)? else {
            return Ok(Balanced {
                batches: window.to_vec(),
                permutation: identity(window),
                report: BalanceReport { batches: window.len(), ..BalanceReport::default() },
            });
        };
        let plan = self.prep.plan().expect("count() planned").clone();
        let stacks: Vec<String> = plan.stacks.iter().map(|s| s.name.clone()).collect();
        let inv_limit: Vec<f64> = plan.stacks.iter().flat_map(|s| std::iter::repeat_n(1.0 / s.max_ids_per_partition.max(1) as f64, shape.partitions)).collect();
        let slice_rows: Vec<usize> = window.iter().map(|rb| rb.num_rows() / shape.slices).collect();
        let nslices = window.len() * shape.slices;
        let cells = shape.cells();

        // The input order's loads: slice j of batch b holds rows j·r..(j+1)·r.
        self.load.clear();
        self.load.resize(nslices * cells, 0);
        for (i, r) in self.counts.refs.iter().enumerate() {
            let s = r.batch * shape.slices + r.row / slice_rows[r.batch];
            for &(c, n) in &self.counts.cells[self.counts.start[i]..self.counts.start[i + 1]] {
                self.load[s * cells + c as usize] += n;
            }
        }
        let before_batches = batch_loads(&self.load, shape, window.len());
        let rows = slice_rows.iter().copied().min().unwrap_or(0);
        let bound = with_unsplit(bound_from(&self.load, shape, nslices), &self.counts, shape, rows);

        // Greedy placement: heaviest samples first, each where the new peak is lowest (ties:
        // the slice with the fewest ids so far, then the lowest index), so the order is
        // deterministic. Slices are visited in (peak, ids, index) order, so the search stops at
        // the first slice whose current peak exceeds the best new peak found.
        let counts = &self.counts;
        let mut order: Vec<usize> = (0..counts.refs.len()).collect();
        order.sort_by(|&a, &b| counts.peak[b].total_cmp(&counts.peak[a]).then(a.cmp(&b)));
        self.load.clear();
        self.load.resize(nslices * cells, 0);
        let capacity: Vec<usize> = (0..nslices).map(|s| slice_rows[s / shape.slices]).collect();
        let mut peak = vec![0f64; nslices];
        let mut total = vec![0u64; nslices];
        // Sample indices (into `counts`) per slice.
        let mut members: Vec<Vec<usize>> = capacity.iter().map(|&c| Vec::with_capacity(c)).collect();
        // Peaks are non-negative, so their bit patterns sort as the values do.
        let mut open: BTreeSet<(u64, u64, usize)> = (0..nslices).filter(|&s| capacity[s] > 0).map(|s| (0, 0, s)).collect();
        for &i in &order {
            let sample = &counts.cells[counts.start[i]..counts.start[i + 1]];
            let mut best: Option<(f64, u64, usize)> = None;
            for &(peak_bits, ids, s) in &open {
                let current = f64::from_bits(peak_bits);
                // Every later slice's new peak is at least its current one, and among equal
                // peaks the set's order is the tie-break's.
                if best.is_some_and(|b| current >= b.0) {
                    break;
                }
                let row = &self.load[s * cells..(s + 1) * cells];
                let new_peak = sample.iter().fold(current, |m, &(c, n)| m.max((row[c as usize] + n) as f64 * inv_limit[c as usize]));
                if best.is_none_or(|b| new_peak < b.0 || (new_peak == b.0 && (ids, s) < (b.1, b.2))) {
                    best = Some((new_peak, ids, s));
                }
            }
            let (new_peak, _, s) = best.ok_or_else(|| Error::input("balance", "the window's slices have no room for its samples"))?;
            open.remove(&(peak[s].to_bits(), total[s], s));
            for &(c, n) in sample {
                self.load[s * cells + c as usize] += n;
                total[s] += n as u64;
            }
            peak[s] = new_peak;
            members[s].push(i);
            if members[s].len() < capacity[s] {
                open.insert((new_peak.to_bits(), total[s], s));
            }
        }
        let inv_buffer: Vec<f64> = plan.stacks.iter().map(|st| shape.sc_per_device as f64 / st.coo_buffer_size_per_device.max(1) as f64).collect();
        let weights = Weights { inv_limit: &inv_limit, inv_buffer: &inv_buffer, partitions: shape.partitions };
        improve(counts, &mut members, &mut self.load, cells, &weights);
        let after_batches = batch_loads(&self.load, shape, window.len());
        let permutation: Vec<Vec<SampleRef>> = (0..window.len())
            .map(|b| {
                (0..shape.slices)
                    .flat_map(|j| {
                        let mut m: Vec<SampleRef> = members[b * shape.slices + j].iter().map(|&i| counts.refs[i]).collect();
                        m.sort();
                        m
                    })
                    .collect()
            })
            .collect();
        let identity = identity(window);
        let before = worst_per_stack(&before_batches);
        let keep = |before: Vec<IdLoad>, bound: Vec<u32>| Balanced {
            batches: window.to_vec(),
            permutation: identity.clone(),
            report: BalanceReport { batches: window.len(), stacks: stacks.clone(), after: before.clone(), before, lower_bound: bound, reordered: false },
        };
        if permutation == identity {
            return Ok(keep(before, bound));
        }

        // Keep the new order only if every batch is strictly better by its worst max_ids
        // relative to the limit: W = 1 against itself, W > 1 against the window's worst input.
        let score = |loads: &[IdLoad]| -> f64 {
            loads.iter().zip(&plan.stacks).map(|(l, st)| l.max_ids_per_partition as f64 / st.max_ids_per_partition.max(1) as f64).fold(0.0, f64::max)
        };
        let pooled = window.len() > 1;
        let window_worst = before_batches.iter().map(|b| score(b)).fold(0.0, f64::max);
        let better = before_batches.iter().zip(&after_batches).all(|(b, a)| score(a) < if pooled { window_worst } else { score(b) });
        // And no stack of any batch may pass what it is held to: its input batch (W = 1) or
        // the window's worst input batch (W > 1), or the configured limit where that is
        // higher. A window that fit its limits still fits them.
        let held_to = |b: usize| if pooled { &before } else { &before_batches[b] };
        let within = |b: usize| {
            after_batches[b].iter().zip(held_to(b)).zip(&plan.stacks).all(|((a, r), st)| {
                a.max_ids_per_partition <= r.max_ids_per_partition.max(limit(st.max_ids_per_partition))
                    && a.required_buffer <= r.required_buffer.max(st.coo_buffer_size_per_device as u64)
            })
        };
        if !better || !(0..window.len()).all(within) {
            return Ok(keep(before, bound));
        }
        let batches = apply(window, &permutation)?;
        // Unique ids need the pipeline's sort. A stack whose ids stay within its unique limit in
        // every cell keeps its unique ids within it too; otherwise measure both orders.
        let unique_at_risk =
            after_batches.iter().any(|a| a.iter().zip(&plan.stacks).any(|(l, st)| l.max_ids_per_partition > limit(st.max_unique_ids_per_partition)));
        if unique_at_risk {
            // The input order's unique ids are needed only where the new order passes a limit.
            let after_unique = window_loads(&mut self.prep, &batches)?;
            let within_limits =
                after_unique.iter().all(|a| a.iter().zip(&plan.stacks).all(|(a, st)| a.max_unique_ids_per_partition <= limit(st.max_unique_ids_per_partition)));
            if !within_limits {
                let before_unique = window_loads(&mut self.prep, window)?;
                let window_unique = worst_per_stack(&before_unique);
                let unique_ok = after_unique.iter().enumerate().all(|(b, a)| {
                    let r = if pooled { &window_unique } else { &before_unique[b] };
                    a.iter()
                        .zip(r)
                        .zip(&plan.stacks)
                        .all(|((a, r), st)| a.max_unique_ids_per_partition <= r.max_unique_ids_per_partition.max(limit(st.max_unique_ids_per_partition)))
                });
                if !unique_ok {
                    return Ok(keep(before, bound));
                }
            }
        }
        Ok(Balanced {
            batches,
            permutation,
            report: BalanceReport { batches: window.len(), stacks, before, after: worst_per_stack(&after_batches), lower_bound: bound, reordered: true },
        })
    }

    /// Counts every sample of the window into `self.counts`; `None` when the window cannot be
    /// balanced (empty, or a batch that does not split evenly over the slices, which the
    /// pipeline would reject anyway).
    fn count(&mut self, window: &[RecordBatch]) -> Result<Option<Shape>> {
        let Some(first) = window.first() else {
            return Ok(None);
        };
        for (k, b) in window.iter().enumerate().skip(1) {
            if b.schema() != first.schema() {
                return Err(Error::input(
                    "balance",
                    format!("batch {k} of the window has another schema than batch 0 ({} vs {} columns, or other types)", b.num_columns(), first.num_columns()),
                ));
            }
        }
        let counts = &mut self.counts;
        counts.refs.clear();
        counts.cells.clear();
        counts.peak.clear();
        counts.start.clear();
        counts.start.push(0);
        let config = self.prep.config().clone();
        let mut shape = None;
        for (b, rb) in window.iter().enumerate() {
            let features = features_from_record_batch_reusing(&config, rb, &mut self.hash_buffers)?;
            let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
            let sizes: Vec<usize> = inputs.iter().map(|i| i.num_samples()).collect();
            let plan = self.prep.plan_for(&sizes)?;
            let this = Shape {
                slices: plan.layout.local_scs(),
                sc_per_device: plan.layout.sc_per_device,
                partitions: plan.layout.num_partitions(),
                stacks: plan.stacks.len(),
            };
            let rows = rb.num_rows();
            if rows == 0 || !rows.is_multiple_of(this.slices) || sizes.iter().any(|&s| s != rows) {
                drop(inputs);
                self.hash_buffers.recycle(features);
                return Ok(None);
            }
            self.acc.clear();
            self.acc.resize(this.cells(), 0);
            let features_of_batch = ragged_views(plan, &inputs)?;
            for row in 0..rows {
                count_sample(&features_of_batch, row, &mut self.seen, &mut self.acc, &mut self.touched);
                let mut peak = 0f64;
                for &c in &self.touched {
                    let n = std::mem::take(&mut self.acc[c as usize]);
                    peak = peak.max(n as f64 * features_of_batch.inv_limit[c as usize]);
                    counts.cells.push((c, n));
                }
                counts.refs.push(SampleRef { batch: b, row });
                counts.start.push(counts.cells.len());
                counts.peak.push(peak);
            }
            shape = Some(this);
            drop(inputs);
            self.hash_buffers.recycle(features);
        }
        Ok(shape)
    }
}

/// Pair checks [`improve`] may spend per sample of the window on the worst cell, and then on
/// the worst buffer (whose checks cost more and gain less: under 1.5% of the tuned buffer on the
/// test kit's profiles).
const SWAPS_CHECKED_PER_SAMPLE: usize = 32;
const BUFFER_SWAPS_CHECKED_PER_SAMPLE: usize = 4;

/// What a round of [`improve`] lowers.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The worst cell: ids / the stack's `max_ids_per_partition`.
    Peak,
    /// The worst (slice, stack) buffer: S × Σ over partitions of ids rounded up to 8 / the
    /// stack's buffer per device, with no cell above `peak` (the first objective's result).
    Buffer { peak: f64 },
}

/// Lowers the greedy's result by swapping samples between slices, first its worst cell, then
/// its worst buffer. While the worst value can be brought below itself by swapping one of its
/// slice's samples with one of another slice, such that no cell or buffer the swap touches
/// reaches that value (and, for the buffer, no cell passes the peak reached first), swap. The
/// greedy places each sample once, so a sample placed early can end up beside the samples that
/// fill its slice last; a swap undoes that. Values tied at the worst are fixed one at a time, so
/// the worst falls once all of them are. Deterministic (fixed visiting orders); the checks are
/// capped per sample, so a window costs at most a fixed multiple of its samples.
fn improve(counts: &SampleCounts, members: &mut [Vec<usize>], load: &mut [u32], cells: usize, weights: &Weights<'_>) {
    let mut swaps = Swaps {
        counts,
        members,
        load,
        cells,
        w: weights,
        delta: vec![0i64; cells],
        marked: Vec::new(),
        mark: vec![false; cells],
        sums: Vec::new(),
        stack_change: vec![0; 2 * weights.inv_buffer.len()],
        budget: SWAPS_CHECKED_PER_SAMPLE * counts.refs.len(),
    };
    while swaps.round(Target::Peak) {}
    let peak = swaps.worst_cell().0;
    swaps.budget = BUFFER_SWAPS_CHECKED_PER_SAMPLE * counts.refs.len();
    let p = weights.partitions;
    swaps.sums = swaps.load.chunks(p).map(|part| part.iter().map(|&k| padded(k as i64)).sum()).collect();
    while swaps.round(Target::Buffer { peak }) {}
}

/// Per cell, 1 / the stack's `max_ids_per_partition`; per stack, S / its buffer per device.
struct Weights<'a> {
    inv_limit: &'a [f64],
    inv_buffer: &'a [f64],
    partitions: usize,
}

/// The state [`improve`] swaps in.
struct Swaps<'a> {
    counts: &'a SampleCounts,
    members: &'a mut [Vec<usize>],
    load: &'a mut [u32],
    cells: usize,
    w: &'a Weights<'a>,
    /// Per cell: a swap's change to slice A (b in, a out), cleared after each check.
    delta: Vec<i64>,
    /// The cells `delta` holds, listed and flagged.
    marked: Vec<usize>,
    mark: Vec<bool>,
    /// Per (slice, stack): Σ over partitions of ids rounded up to 8 (kept from the buffer
    /// rounds on); per stack, a swap's change of it in A, then in B.
    sums: Vec<i64>,
    stack_change: Vec<i64>,
    budget: usize,
}

/// A count rounded up to the alignment buffers are padded to.
fn padded(ids: i64) -> i64 {
    (ids + 7).div_euclid(8) * 8
}

impl Swaps<'_> {
    fn sample(&self, i: usize) -> &[(u32, u32)] {
        &self.counts.cells[self.counts.start[i]..self.counts.start[i + 1]]
    }

    /// The worst cell: (ids / limit, slice, cell), first in (slice, cell) order.
    fn worst_cell(&self) -> (f64, usize, usize) {
        let mut worst = (0f64, 0, 0);
        for (k, &n) in self.load.iter().enumerate() {
            let v = n as f64 * self.w.inv_limit[k % self.cells];
            if v > worst.0 {
                worst = (v, k / self.cells, k % self.cells);
            }
        }
        worst
    }

    /// S × Σ over the stack's partitions of `slice`'s ids rounded up to 8 (plus `change`), /
    /// the stack's buffer.
    fn buffer(&self, slice: usize, stack: usize, change: i64) -> f64 {
        let stacks = self.w.inv_buffer.len();
        (self.sums[slice * stacks + stack] + change) as f64 * self.w.inv_buffer[stack]
    }

    /// The worst buffer: (value, slice, stack), first in (slice, stack) order.
    fn worst_buffer(&self) -> (f64, usize, usize) {
        let mut worst = (0f64, 0, 0);
        for s in 0..self.members.len() {
            for st in 0..self.w.inv_buffer.len() {
                let v = self.buffer(s, st, 0);
                if v > worst.0 {
                    worst = (v, s, st);
                }
            }
        }
        worst
    }

    /// A sample's ids in what the target measures: its cell, or its stack's cells.
    fn share(&self, i: usize, target: Target, key: usize) -> u32 {
        let p = self.w.partitions;
        self.sample(i)
            .iter()
            .filter(|&&(c, _)| match target {
                Target::Peak => c as usize == key,
                Target::Buffer { .. } => c as usize / p == key,
            })
            .map(|x| x.1)
            .sum()
    }

    /// One swap that lowers the worst value of `target`; false when none does (or the budget
    /// is spent).
    fn round(&mut self, target: Target) -> bool {
        let (top, a_slice, key) = match target {
            Target::Peak => self.worst_cell(),
            Target::Buffer { .. } => self.worst_buffer(),
        };
        if top == 0.0 || self.budget == 0 {
            return false;
        }
        let nslices = self.members.len();
        // Samples of A by their share of the key, largest first.
        let mut outgoing: Vec<(u32, usize)> =
            (0..self.members[a_slice].len()).map(|k| (self.share(self.members[a_slice][k], target, key), k)).filter(|x| x.0 > 0).collect();
        outgoing.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        // Other slices, least loaded in the key first.
        let level = |sw: &Self, s: usize| match target {
            Target::Peak => sw.load[s * sw.cells + key] as f64 * sw.w.inv_limit[key],
            Target::Buffer { .. } => sw.buffer(s, key, 0),
        };
        let mut others: Vec<(f64, usize)> = (0..nslices).filter(|&s| s != a_slice).map(|s| (level(self, s), s)).collect();
        others.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        // Each other slice's members' shares of the key, worked out when first visited.
        let mut shares: Vec<Vec<u32>> = vec![Vec::new(); nslices];
        for &(out_share, ka) in &outgoing {
            for &(b_level, b_slice) in &others {
                // B's key gains (the sample it gives up has less of it); the slices come least
                // loaded first, so no later one can take it either.
                let floor = match target {
                    Target::Peak => (self.load[b_slice * self.cells + key] + 1) as f64 * self.w.inv_limit[key],
                    Target::Buffer { .. } => b_level,
                };
                if floor >= top {
                    break;
                }
                if shares[b_slice].is_empty() {
                    shares[b_slice] = self.members[b_slice].iter().map(|&b| self.share(b, target, key)).collect();
                }
                for (kb, &share) in shares[b_slice].iter().enumerate() {
                    if self.budget == 0 {
                        return false;
                    }
                    self.budget -= 1;
                    if share >= out_share {
                        continue;
                    }
                    if self.try_swap(a_slice, ka, b_slice, kb, top, target, key) {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Swaps sample `ka` of A with `kb` of B if every cell (and, for the buffer, every stack)
    /// the two touch stays below `top` in both slices; `key` is the round's cell or stack.
    #[allow(clippy::too_many_arguments)]
    fn try_swap(&mut self, a_slice: usize, ka: usize, b_slice: usize, kb: usize, top: f64, target: Target, key: usize) -> bool {
        let (a, b) = (self.members[a_slice][ka], self.members[b_slice][kb]);
        let cells = self.cells;
        let p = self.w.partitions;
        self.marked.clear();
        for (i, sign) in [(a, -1i64), (b, 1)] {
            for k in self.counts.start[i]..self.counts.start[i + 1] {
                let (x, n) = self.counts.cells[k];
                let x = x as usize;
                if !self.mark[x] {
                    self.mark[x] = true;
                    self.marked.push(x);
                }
                self.delta[x] += sign * n as i64;
            }
        }
        let cap = match target {
            Target::Peak => top,
            Target::Buffer { peak } => peak,
        };
        // Cells: below the top (peak), or at most the first objective's peak (buffer).
        let cells_fit = self.marked.iter().all(|&x| {
            [(a_slice, 1i64), (b_slice, -1)].iter().all(|&(s, sign)| {
                let v = (self.load[s * cells + x] as i64 + sign * self.delta[x]) as f64 * self.w.inv_limit[x];
                match target {
                    Target::Peak => v < cap,
                    Target::Buffer { .. } => v <= cap,
                }
            })
        });
        let fits = cells_fit
            && match target {
                Target::Peak => true,
                Target::Buffer { .. } => {
                    // Per touched stack, the change of each slice's padded sum.
                    let stacks = self.w.inv_buffer.len();
                    for &x in &self.marked {
                        let st = x / p;
                        let d = self.delta[x];
                        let (la, lb) = (self.load[a_slice * cells + x] as i64, self.load[b_slice * cells + x] as i64);
                        self.stack_change[st] += padded(la + d) - padded(la);
                        self.stack_change[stacks + st] += padded(lb - d) - padded(lb);
                    }
                    // The key stack first: most candidates fail there.
                    let below =
                        |sw: &Self, st: usize| sw.buffer(a_slice, st, sw.stack_change[st]) < top && sw.buffer(b_slice, st, sw.stack_change[stacks + st]) < top;
                    let ok = below(self, key) && self.marked.iter().all(|&x| below(self, x / p));
                    for &x in &self.marked {
                        let st = x / p;
                        if ok {
                            self.sums[a_slice * stacks + st] += self.stack_change[st];
                            self.sums[b_slice * stacks + st] += self.stack_change[stacks + st];
                        }
                        self.stack_change[st] = 0;
                        self.stack_change[stacks + st] = 0;
                    }
                    ok
                }
            };
        for &x in &self.marked {
            self.mark[x] = false;
            let d = std::mem::take(&mut self.delta[x]);
            if fits {
                self.load[a_slice * cells + x] = (self.load[a_slice * cells + x] as i64 + d) as u32;
                self.load[b_slice * cells + x] = (self.load[b_slice * cells + x] as i64 - d) as u32;
            }
        }
        if fits {
            self.members[a_slice][ka] = b;
            self.members[b_slice][kb] = a;
        }
        fits
    }
}

/// A configured limit as the statistics' type.
fn limit(value: u32) -> i32 {
    value.min(i32::MAX as u32) as i32
}

fn identity(window: &[RecordBatch]) -> Vec<Vec<SampleRef>> {
    window.iter().enumerate().map(|(b, rb)| (0..rb.num_rows()).map(|row| SampleRef { batch: b, row }).collect()).collect()
}

/// Each batch's per-stack worst cells, from per-(slice, cell) id counts.
fn batch_loads(load: &[u32], shape: Shape, batches: usize) -> Vec<Vec<IdLoad>> {
    let cells = shape.cells();
    let n = shape.partitions;
    (0..batches)
        .map(|b| {
            (0..shape.stacks)
                .map(|st| {
                    let mut worst = IdLoad::default();
                    for j in 0..shape.slices {
                        let row = &load[(b * shape.slices + j) * cells + st * n..][..n];
                        let max = row.iter().copied().max().unwrap_or(0);
                        let buffer: u64 = row.iter().map(|&k| (k as u64).div_ceil(8) * 8).sum();
                        worst.max_ids_per_partition = worst.max_ids_per_partition.max(max.min(i32::MAX as u32) as i32);
                        worst.required_buffer = worst.required_buffer.max(buffer * shape.sc_per_device as u64);
                    }
                    worst
                })
                .collect()
        })
        .collect()
}

/// Per stack, max over partitions of ⌈ids to the partition / slices⌉ (see [`lower_bound`]).
fn bound_from(load: &[u32], shape: Shape, nslices: usize) -> Vec<u32> {
    let cells = shape.cells();
    let n = shape.partitions;
    (0..shape.stacks)
        .map(|st| {
            (0..n)
                .map(|p| {
                    let total: u64 = (0..nslices).map(|s| load[s * cells + st * n + p] as u64).sum();
                    total.div_ceil(nslices.max(1) as u64) as u32
                })
                .max()
                .unwrap_or(0)
        })
        .collect()
}

/// Raises each stack's bound to what the slice holding a cell's heaviest sample must get: that
/// sample's ids (a sample is never split) plus the fewest ids any `rows - 1` other samples send
/// to the cell (the slice holds `rows` samples; `rows` is the smallest slice of the window).
fn with_unsplit(mut bound: Vec<u32>, counts: &SampleCounts, shape: Shape, rows: usize) -> Vec<u32> {
    let mut per_cell: Vec<Vec<u32>> = vec![Vec::new(); shape.cells()];
    for &(c, n) in &counts.cells {
        per_cell[c as usize].push(n);
    }
    let samples = counts.refs.len();
    for (c, shares) in per_cell.iter_mut().enumerate() {
        let Some(k) = (0..shares.len()).max_by_key(|&k| shares[k]) else { continue };
        let heaviest = shares.swap_remove(k);
        // Samples sending nothing to the cell are the cheapest company.
        let zeros = samples - 1 - shares.len();
        let need = rows.saturating_sub(1).saturating_sub(zeros).min(shares.len());
        let company: u64 = if need == 0 {
            0
        } else {
            shares.select_nth_unstable(need - 1);
            shares[..need].iter().map(|&n| n as u64).sum()
        };
        let b = &mut bound[c / shape.partitions];
        *b = (*b).max((heaviest as u64 + company).min(u32::MAX as u64) as u32);
    }
    bound
}

/// Applies a permutation to a window: output batch k takes `permutation[k]`'s rows, every
/// column moving together (Arrow `take`).
pub fn apply(window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Result<Vec<RecordBatch>> {
    let arrow = |source| Error::Arrow { context: "reordering a window of batches".into(), source };
    let sources: Vec<&RecordBatch> = window.iter().collect();
    let mut index = Vec::new();
    permutation
        .iter()
        .map(|rows| {
            index.clear();
            for r in rows {
                if r.batch >= window.len() || r.row >= window[r.batch].num_rows() {
                    return Err(Error::input("balance", format!("permutation names row {} of batch {}, which does not exist", r.row, r.batch)));
                }
                index.push((r.batch, r.row));
            }
            arrow_select::interleave::interleave_record_batch(&sources, &index).map_err(arrow)
        })
        .collect()
}

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
struct BatchFeatures<'a> {
    features: Vec<RaggedFeature<'a>>,
    /// Partitions minus one.
    mask: u32,
    /// Per cell, 1 / the stack's `max_ids_per_partition`.
    inv_limit: Vec<f64>,
}

fn ragged_views<'a>(plan: &Plan, inputs: &'a [&'a (dyn SampleSource + 'a)]) -> Result<BatchFeatures<'a>> {
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
fn count_sample(batch: &BatchFeatures<'_>, row: usize, seen: &mut SeenSet, acc: &mut [u32], touched: &mut Vec<u32>) {
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
struct SeenSet {
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

/// Each batch's per-stack worst cells, from the pipeline's own statistics.
fn window_loads(prep: &mut Preprocessor, batches: &[RecordBatch]) -> Result<Vec<Vec<StackLoad>>> {
    let mut out = Output::new();
    let mut loads = Vec::with_capacity(batches.len());
    // (A copy: the batch's views borrow the config while `prep` runs mutably.)
    let config = prep.config().clone();
    for rb in batches {
        let features = features_from_record_batch(&config, rb)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
        prep.run_stats(&inputs, &mut out)?;
        let s = prep.plan().map(|p| p.layout.sc_per_device).unwrap_or(1);
        loads.push(
            out.stacks
                .iter()
                .map(|so| StackLoad {
                    max_ids_per_partition: so.stats.max_ids(),
                    max_unique_ids_per_partition: so.stats.max_unique_ids(),
                    required_buffer: so.stats.required_buffer_size_per_device(s),
                })
                .collect(),
        );
    }
    Ok(loads)
}

/// The pipeline's worst cells per stack (in plan order) over `batches`: its statistics, with
/// `max_unique_ids`, which balancing itself does not count. Costs a statistics pass of the
/// pipeline over every batch.
pub fn measure(config: &Config, batches: &[RecordBatch]) -> Result<Vec<StackLoad>> {
    let mut prep = Preprocessor::builder(config.clone()).threads(1).build()?;
    Ok(worst_per_stack(&window_loads(&mut prep, batches)?))
}

fn worst_per_stack<L: Worst>(loads: &[Vec<L>]) -> Vec<L> {
    let mut worst: Vec<L> = Vec::new();
    for batch in loads {
        worst.resize(worst.len().max(batch.len()), L::default());
        for (w, l) in worst.iter_mut().zip(batch) {
            w.worst_of(l);
        }
    }
    worst
}

/// Loads that combine into the worst of both, field by field.
trait Worst: Default + Clone {
    fn worst_of(&mut self, other: &Self);
}

impl Worst for StackLoad {
    fn worst_of(&mut self, l: &Self) {
        self.max_ids_per_partition = self.max_ids_per_partition.max(l.max_ids_per_partition);
        self.max_unique_ids_per_partition = self.max_unique_ids_per_partition.max(l.max_unique_ids_per_partition);
        self.required_buffer = self.required_buffer.max(l.required_buffer);
    }
}

impl Worst for IdLoad {
    fn worst_of(&mut self, l: &Self) {
        self.max_ids_per_partition = self.max_ids_per_partition.max(l.max_ids_per_partition);
        self.required_buffer = self.required_buffer.max(l.required_buffer);
    }
}

/// A lower bound on any order's worst `max_ids_per_partition`, per stack: the ids a window sends
/// to partition p must land in one of its W·L·S slices, so some slice gets at least
/// ⌈ids to p / (W·L·S)⌉ of them; and a sample is never split, so the slice holding it gets at
/// least the ids it sends to p, plus the fewest its other samples can add. (Per device the pipeline reports the largest over its S
/// SparseCores, so the bound holds for every device's statistic too.)
pub fn lower_bound(config: &Config, window: &[RecordBatch]) -> Result<Vec<u32>> {
    let mut balancer = Balancer::new(config.clone())?;
    let Some(shape) = balancer.count(window)? else {
        return Ok(Vec::new());
    };
    let cells = shape.cells();
    let mut totals = vec![0u32; cells];
    for &(c, n) in &balancer.counts.cells {
        totals[c as usize] += n;
    }
    let spread = bound_from(&totals, shape, 1).into_iter().map(|t| t.div_ceil((window.len() * shape.slices).max(1) as u32)).collect();
    let rows = window.iter().map(|b| b.num_rows() / shape.slices).min().unwrap_or(0);
    Ok(with_unsplit(spread, &balancer.counts, shape, rows))
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
