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
//! a swap lowers the worst cell without raising any cell it touches to that level; then, stack
//! by stack from the one nearest its limit, while a swap lowers that stack's own worst cell
//! without raising a stack already done above its worst or any other above the level of the
//! one being lowered (each stack's limit is tuned from its own worst cell); and after that
//! while a swap lowers the worst buffer without raising any stack's worst cell. By default unique
//! ids are not minimised: they depend on which samples share a slice, not on per-sample counts,
//! so lowering them means reading columns again ([`Refinement::UniqueIds`] does). The new
//! order is kept only if every output batch's worst `max_ids` relative to its limit is
//! strictly lower than its input batch's (W = 1) or than the window's worst input batch's
//! (W > 1, where batches trade samples), and no stack's `max_ids`, required buffer or
//! `max_unique_ids` rises above both that reference and its configured limit; otherwise the
//! input order is returned, and [`BalanceReport::outcome`] says why. So balancing never makes
//! a batch worse than what it was, or was pooled from, and a window that fit its limits still
//! fits them. Where the window's lower bound already reaches its worst input batch, no order
//! can pass, and the search is skipped.
//! Unique ids are the one number per-sample counts cannot give, so distinct columns are counted
//! per (slice, partition) with a bitmap or a hash set, only for the stacks where some cell's ids exceed
//! `max_unique_ids_per_partition` and so do the stack's columns per partition (the one case in
//! which unique ids could pass it), and before the permutation is applied, so a rejected order
//! costs no copy. [`count_loads`] gives the same numbers for any batches; [`measure`] runs the
//! pipeline's own statistics.
//!
//! Everything runs on one thread in a fixed order, so the result does not depend on the thread
//! count.

use arrow_array::RecordBatch;

use crate::error::{Error, Result};
use crate::input::{
    features_from_record_batch, features_from_record_batch_reusing, HashBuffers, SampleSource,
};
use crate::output::Output;
use crate::preprocess::Preprocessor;
use crate::spec::{Config, Plan};

mod apply;
mod count;
mod samples;
mod swap;
mod unique;

pub use apply::{apply, Reorder};
use count::{Counter, UniqueCounter};
pub use samples::SampleRef;
use samples::{SampleCounts, Shape};
pub use swap::Refinement;
use swap::{improve, SwapMemory, Weights};

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
    /// Whether the balanced order replaced the input order and, where it did not, why.
    pub outcome: Outcome,
}

impl BalanceReport {
    /// Whether the returned order is the balanced one (else it is the input order).
    pub fn reordered(&self) -> bool {
        self.outcome == Outcome::Reordered
    }
}

/// What became of a window's order. Every variant but [`Outcome::Reordered`] returns the input
/// order, and says why, so that a user can tell data that cannot be balanced from limits that
/// hold balancing back. A `stack_index` indexes [`BalanceReport::stacks`]; a `batch` is a
/// batch's position in the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The balanced order replaced the input order.
    Reordered,
    /// An empty window: nothing to balance.
    #[default]
    EmptyWindow,
    /// Batch `batch` has no rows, or rows that do not split evenly over the local SparseCores
    /// (which the pipeline rejects anyway).
    UnevenBatch {
        /// The first such batch.
        batch: usize,
    },
    /// Batch `batch` is planned differently from batch 0 (auto stacking may plan a batch of
    /// another size with other stacks): their samples' loads are not comparable.
    MixedPlans {
        /// The first such batch.
        batch: usize,
    },
    /// The window's worst input batch already reaches the lower bound in the stack at
    /// `stack_index` (relative to its limit): every order has a batch at least as bad, so none
    /// can make every batch better. Typical where one sample's ids fill a partition's cell.
    AtLowerBound {
        /// The stack whose bound decides.
        stack_index: usize,
    },
    /// The search found no order in which every batch is strictly better (for W > 1: better
    /// than the window's worst input batch).
    NoBetterOrder,
    /// The better order would raise the `max_ids_per_partition` or required buffer of the
    /// stack at `stack_index` above both what its input needed and its configured limit.
    WouldPassLimit {
        /// The first stack that would.
        stack_index: usize,
    },
    /// The better order would raise the `max_unique_ids_per_partition` of the stack at
    /// `stack_index` above both what its input needed and its configured limit.
    WouldPassUniqueLimit {
        /// The first stack that would.
        stack_index: usize,
    },
}

impl Outcome {
    /// The variant's name in snake case, as the CLI's JSON and Python's reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Reordered => "reordered",
            Outcome::EmptyWindow => "empty_window",
            Outcome::UnevenBatch { .. } => "uneven_batch",
            Outcome::MixedPlans { .. } => "mixed_plans",
            Outcome::AtLowerBound { .. } => "at_lower_bound",
            Outcome::NoBetterOrder => "no_better_order",
            Outcome::WouldPassLimit { .. } => "would_pass_limit",
            Outcome::WouldPassUniqueLimit { .. } => "would_pass_unique_limit",
        }
    }

    /// The index of the stack the outcome names, if any.
    pub fn stack_index(self) -> Option<usize> {
        match self {
            Outcome::AtLowerBound { stack_index }
            | Outcome::WouldPassLimit { stack_index }
            | Outcome::WouldPassUniqueLimit { stack_index } => Some(stack_index),
            Outcome::Reordered
            | Outcome::EmptyWindow
            | Outcome::UnevenBatch { .. }
            | Outcome::MixedPlans { .. }
            | Outcome::NoBetterOrder => None,
        }
    }
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
    counter: Counter,
    unique: UniqueCounter,
    /// Output buffers taken back from the previous window's batches.
    reorder: Reorder,
    swap_memory: SwapMemory,
    refinement: Refinement,
}

impl Balancer {
    /// A balancer for `config`.
    pub fn new(config: Config) -> Result<Self> {
        Ok(Balancer {
            prep: Preprocessor::builder(config).threads(1).build()?,
            hash_buffers: HashBuffers::new(),
            counts: SampleCounts::default(),
            load: Vec::new(),
            counter: Counter::default(),
            unique: UniqueCounter::default(),
            reorder: Reorder::default(),
            swap_memory: SwapMemory::default(),
            refinement: Refinement::default(),
        })
    }

    /// Searches as far as `refinement` says (the default is [`Refinement::WorstCell`]).
    #[must_use]
    pub fn refinement(mut self, refinement: Refinement) -> Self {
        self.refinement = refinement;
        self
    }

    /// Balances one window (see the module docs).
    pub fn balance(&mut self, window: &[RecordBatch]) -> Result<Balanced> {
        let shape = match self.count(window)? {
            Ok(shape) => shape,
            Err(outcome) => {
                return Ok(Balanced {
                    batches: window.to_vec(),
                    permutation: identity(window),
                    report: BalanceReport {
                        batches: window.len(),
                        outcome,
                        ..BalanceReport::default()
                    },
                })
            }
        };
        let plan = self.prep.plan().expect("count() planned");
        let stacks: Vec<String> = plan.stacks.iter().map(|s| s.name.clone()).collect();
        let inv_limit: Vec<f64> = plan
            .stacks
            .iter()
            .flat_map(|s| {
                std::iter::repeat_n(
                    1.0 / s.max_ids_per_partition.max(1) as f64,
                    shape.partitions,
                )
            })
            .collect();
        let slice_rows: Vec<usize> = window
            .iter()
            .map(|rb| rb.num_rows() / shape.slices)
            .collect();
        let nslices = window.len() * shape.slices;
        let cells = shape.cells();

        input_order_loads(&self.counts, shape, &slice_rows, &mut self.load);
        let before_batches = batch_loads(&self.load, shape, window.len());
        let rows = slice_rows.iter().copied().min().unwrap_or(0);
        let totals: Vec<u64> = (0..cells)
            .map(|c| {
                self.load
                    .iter()
                    .skip(c)
                    .step_by(cells)
                    .map(|&n| n as u64)
                    .sum()
            })
            .collect();
        let bound = with_unsplit(
            bound_from(&self.load, shape, nslices),
            &self.counts,
            &totals,
            shape,
            rows,
        );
        let before = worst_per_stack(&before_batches);
        let keep = |before: Vec<IdLoad>, bound: Vec<u32>, outcome: Outcome| Balanced {
            batches: window.to_vec(),
            permutation: identity(window),
            report: BalanceReport {
                batches: window.len(),
                stacks: stacks.clone(),
                after: before.clone(),
                before,
                lower_bound: bound,
                outcome,
            },
        };
        // A new order is kept only if every batch's worst `max_ids` relative to its limit falls
        // strictly below the window's worst input batch's (for W = 1, the batch's own; see
        // below). Every order has some batch at or above the bound in every stack, so when a
        // stack's bound already reaches that worst, no order can pass and the search is
        // skipped: the input order is returned as the search would have returned it.
        let relative =
            |ids: f64, st: &crate::spec::StackPlan| ids / st.max_ids_per_partition.max(1) as f64;
        let score = |loads: &[IdLoad]| -> f64 {
            loads
                .iter()
                .zip(&plan.stacks)
                .map(|(l, st)| relative(l.max_ids_per_partition as f64, st))
                .fold(0.0, f64::max)
        };
        let window_worst = before_batches.iter().map(|b| score(b)).fold(0.0, f64::max);
        if let Some(stack) = bound
            .iter()
            .zip(&plan.stacks)
            .position(|(&b, st)| relative(b as f64, st) >= window_worst)
        {
            return Ok(keep(
                before,
                bound,
                Outcome::AtLowerBound { stack_index: stack },
            ));
        }

        self.load.clear();
        self.load.resize(nslices * cells, 0);
        let capacity: Vec<usize> = (0..nslices).map(|s| slice_rows[s / shape.slices]).collect();
        let mut members = place(&self.counts, &inv_limit, &capacity, cells, &mut self.load)?;
        let counts = &self.counts;
        let inv_buffer: Vec<f64> = plan
            .stacks
            .iter()
            .map(|st| shape.sc_per_device as f64 / st.coo_buffer_size_per_device.max(1) as f64)
            .collect();
        let weights = Weights {
            inv_limit: &inv_limit,
            inv_buffer: &inv_buffer,
            partitions: shape.partitions,
        };
        improve(
            counts,
            &mut members,
            &mut self.load,
            cells,
            &weights,
            self.refinement,
            &mut self.swap_memory,
        );
        if self.refinement == Refinement::UniqueIds {
            unique::lower(
                self.prep.config(),
                plan,
                window,
                counts,
                &mut members,
                &mut self.load,
                shape,
            )?;
        }
        let after_batches = batch_loads(&self.load, shape, window.len());
        let permutation = permutation(counts, &members, shape.slices, window.len());
        let identity = identity(window);
        if permutation == identity {
            return Ok(keep(before, bound, Outcome::NoBetterOrder));
        }

        // Keep the new order only if every batch is strictly better by its worst max_ids
        // relative to the limit: W = 1 against itself, W > 1 against the window's worst input.
        let pooled = window.len() > 1;
        let better = before_batches
            .iter()
            .zip(&after_batches)
            .all(|(b, a)| score(a) < if pooled { window_worst } else { score(b) });
        // And no stack of any batch may pass what it is held to: its input batch (W = 1) or
        // the window's worst input batch (W > 1), or the configured limit where that is
        // higher. A window that fit its limits still fits them.
        let held_to = |b: usize| if pooled { &before } else { &before_batches[b] };
        let passing = |b: usize| {
            after_batches[b]
                .iter()
                .zip(held_to(b))
                .zip(&plan.stacks)
                .position(|((a, r), st)| {
                    a.max_ids_per_partition
                        > r.max_ids_per_partition.max(limit(st.max_ids_per_partition))
                        || a.required_buffer
                            > r.required_buffer.max(st.coo_buffer_size_per_device as u64)
                })
        };
        if !better {
            return Ok(keep(before, bound, Outcome::NoBetterOrder));
        }
        if let Some(stack) = (0..window.len()).filter_map(passing).min() {
            return Ok(keep(
                before,
                bound,
                Outcome::WouldPassLimit { stack_index: stack },
            ));
        }
        // Unique ids need distinct columns per slice, which per-sample counts cannot give. A
        // stack whose ids stay within its unique limit in every cell keeps its unique ids within
        // it too, and so does one with no more columns per partition than that limit (checked
        // ids lie below the stack's vocabulary, a multiple of the partitions, split evenly over
        // them: the multivalency profiles' small tables never need counting); the others are
        // counted, in the new order and, where that passes the limit, in the input order.
        let risky: Vec<bool> = plan
            .stacks
            .iter()
            .enumerate()
            .map(|(st, stack)| {
                let unique_limit = limit(stack.max_unique_ids_per_partition);
                let columns_per_partition =
                    stack.stack_vocab_size.div_ceil(shape.partitions as u64);
                (!plan.validate_ids || columns_per_partition > unique_limit as u64)
                    && after_batches
                        .iter()
                        .any(|a| a[st].max_ids_per_partition > unique_limit)
            })
            .collect();
        if risky.contains(&true) {
            let config = self.prep.config();
            let after_unique = self.unique.worst_per_batch(
                config,
                plan,
                window,
                &permutation,
                shape.slices,
                &risky,
            )?;
            let over = |u: &[Vec<i32>]| {
                u.iter().any(|a| {
                    a.iter()
                        .zip(&plan.stacks)
                        .any(|(&a, st)| a > limit(st.max_unique_ids_per_partition))
                })
            };
            if over(&after_unique) {
                let before_unique = self.unique.worst_per_batch(
                    config,
                    plan,
                    window,
                    &identity,
                    shape.slices,
                    &risky,
                )?;
                let window_unique = (0..plan.stacks.len())
                    .map(|st| before_unique.iter().map(|b| b[st]).max().unwrap_or(0))
                    .collect::<Vec<_>>();
                let passing = after_unique.iter().enumerate().filter_map(|(b, a)| {
                    let r = if pooled {
                        &window_unique
                    } else {
                        &before_unique[b]
                    };
                    a.iter()
                        .zip(r)
                        .zip(&plan.stacks)
                        .position(|((&a, &r), st)| {
                            a > r.max(limit(st.max_unique_ids_per_partition))
                        })
                });
                if let Some(stack) = passing.min() {
                    return Ok(keep(
                        before,
                        bound,
                        Outcome::WouldPassUniqueLimit { stack_index: stack },
                    ));
                }
            }
        }
        let batches = self.reorder.apply(window, &permutation)?;
        Ok(Balanced {
            batches,
            permutation,
            report: BalanceReport {
                batches: window.len(),
                stacks,
                before,
                after: worst_per_stack(&after_batches),
                lower_bound: bound,
                outcome: Outcome::Reordered,
            },
        })
    }

    /// Counts every sample of the window into `self.counts`; `Err` with the reason when the
    /// window cannot be balanced.
    fn count(&mut self, window: &[RecordBatch]) -> Result<std::result::Result<Shape, Outcome>> {
        if window.is_empty() {
            return Ok(Err(Outcome::EmptyWindow));
        }
        apply::one_schema(window)?;
        let counts = &mut self.counts;
        counts.refs.clear();
        counts.cells.clear();
        counts.peak.clear();
        counts.start.clear();
        counts.start.push(0);
        let config = self.prep.config().clone();
        let mut shape = Err(Outcome::EmptyWindow);
        let mut first_plan: Option<PlanKey> = None;
        // Which batch of a window of several, for messages about a row.
        let pooled = window.len() > 1;
        let which = |b: usize| {
            move |e: Error| {
                if pooled {
                    e.context(format!("batch {b} of the window"))
                } else {
                    e
                }
            }
        };
        for (b, rb) in window.iter().enumerate() {
            let features = features_from_record_batch_reusing(&config, rb, &mut self.hash_buffers)
                .map_err(which(b))?;
            let inputs: Vec<&dyn SampleSource> =
                features.iter().map(|f| f as &dyn SampleSource).collect();
            let sizes: Vec<usize> = inputs.iter().map(|i| i.num_samples()).collect();
            let plan = self.prep.plan_for(&sizes)?;
            let this = Shape {
                slices: plan.layout.local_scs(),
                sc_per_device: plan.layout.sc_per_device,
                partitions: plan.layout.num_partitions(),
                stacks: plan.stacks.len(),
            };
            let rows = rb.num_rows();
            // Batches of other sizes can be planned differently (auto stacking chooses stacks
            // per batch size): their samples' cells and weights would not be comparable.
            let key = PlanKey::of(plan);
            let same_plan = first_plan.get_or_insert_with(|| key.clone()) == &key;
            let unfit = if rows == 0
                || !rows.is_multiple_of(this.slices)
                || sizes.iter().any(|&s| s != rows)
            {
                Some(Outcome::UnevenBatch { batch: b })
            } else if !same_plan {
                Some(Outcome::MixedPlans { batch: b })
            } else {
                None
            };
            if let Some(outcome) = unfit {
                drop(inputs);
                self.hash_buffers.recycle(features);
                return Ok(Err(outcome));
            }
            self.counter
                .count_batch(plan, &inputs, b, rows, counts)
                .map_err(which(b))?;
            shape = Ok(this);
            drop(inputs);
            self.hash_buffers.recycle(features);
        }
        Ok(shape)
    }
}

/// What counting and placing read from a batch's plan: where each feature's ids fall (its
/// stack and column mapping), and each stack's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PlanKey {
    slices: usize,
    partitions: usize,
    features: Vec<(usize, u32, u32)>,
    stacks: Vec<(u32, u32, usize, u64)>,
}

impl PlanKey {
    fn of(plan: &Plan) -> Self {
        PlanKey {
            slices: plan.layout.local_scs(),
            partitions: plan.layout.num_partitions(),
            features: plan
                .features
                .iter()
                .map(|f| (f.stack, f.col_shift, f.col_offset))
                .collect(),
            stacks: plan
                .stacks
                .iter()
                .map(|s| {
                    (
                        s.max_ids_per_partition,
                        s.max_unique_ids_per_partition,
                        s.coo_buffer_size_per_device,
                        s.stack_vocab_size,
                    )
                })
                .collect(),
        }
    }
}

/// Greedy placement into slices of `capacity` samples: heaviest samples first, each where the
/// new peak is lowest (ties: the slice with the fewest ids so far, then the lowest index), so
/// the order is deterministic. Slices are visited in (peak, ids, index) order, so the search
/// stops at the first slice whose current peak exceeds the best new peak found. `load` (zeroed,
/// per (slice, cell)) ends with the placed ids; returns each slice's sample indices.
fn place(
    counts: &SampleCounts,
    inv_limit: &[f64],
    capacity: &[usize],
    cells: usize,
    load: &mut [u32],
) -> Result<Vec<Vec<usize>>> {
    let nslices = capacity.len();
    // Largest peak first (in `f64::total_cmp`'s order, as integer keys), then by index.
    let mut keyed: Vec<(i64, usize)> = counts
        .peak
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let bits = p.to_bits() as i64;
            (!(bits ^ (((bits >> 63) as u64) >> 1) as i64), i)
        })
        .collect();
    keyed.sort_unstable();
    let order: Vec<usize> = keyed.into_iter().map(|(_, i)| i).collect();
    let mut total = vec![0u64; nslices];
    let mut members: Vec<Vec<usize>> = capacity.iter().map(|&c| Vec::with_capacity(c)).collect();
    // Peaks are non-negative, so their bit patterns sort as the values do. Kept sorted; a
    // slice's key only grows, so it moves towards the end.
    let mut open: Vec<(u64, u64, usize)> = (0..nslices)
        .filter(|&s| capacity[s] > 0)
        .map(|s| (0, 0, s))
        .collect();
    for &i in &order {
        let sample = counts
            .cells
            .get(counts.start[i]..counts.start[i + 1])
            .unwrap_or_default();
        // (new peak, ids, slice, position in `open`).
        let mut best: Option<(f64, u64, usize, usize)> = None;
        // The entry that set the last slice's peak or put it out is tried first: where it puts
        // this slice out too, the rest of the sample is not read (the result is the same in any
        // order).
        let mut probe = 0;
        for (at, &(peak_bits, ids, s)) in open.iter().enumerate() {
            let current = f64::from_bits(peak_bits);
            // Every later slice's new peak is at least its current one, and among equal
            // peaks the set's order is the tie-break's.
            if best.is_some_and(|b| current >= b.0) {
                break;
            }
            let Some(row) = load.get(s * cells..(s + 1) * cells) else {
                continue;
            };
            let inv_limit = &inv_limit[..row.len()];
            // A slice whose new peak passes the best found so far is out as soon as it does.
            let bar = best.map_or(f64::INFINITY, |b| b.0);
            let level = |&(c, n): &(u32, u32)| {
                row.get(c as usize)
                    .map_or(f64::INFINITY, |&k| (k + n) as f64 * inv_limit[c as usize])
            };
            if let Some(e) = sample.get(probe) {
                if level(e) > bar {
                    continue;
                }
            }
            let mut new_peak = current;
            for (k, e) in sample.iter().enumerate() {
                let v = level(e);
                if v > new_peak {
                    new_peak = v;
                    probe = k;
                    if v > bar {
                        break;
                    }
                }
            }
            if new_peak > bar {
                continue;
            }
            if best.is_none_or(|b| new_peak < b.0 || (new_peak == b.0 && (ids, s) < (b.1, b.2))) {
                best = Some((new_peak, ids, s, at));
            }
        }
        let (new_peak, _, s, at) = best.ok_or_else(|| {
            let rows: usize = capacity.iter().sum();
            Error::data(
                "balancing window",
                format!("its {nslices} slices of {rows} rows in all have no room for sample {i}"),
            )
        })?;
        let row = &mut load[s * cells..(s + 1) * cells];
        for &(c, n) in sample {
            row[c as usize] += n;
            total[s] += n as u64;
        }
        members[s].push(i);
        if members[s].len() < capacity[s] {
            let key = (new_peak.to_bits(), total[s], s);
            let mut at = at;
            while let Some(&next) = open.get(at + 1).filter(|&&next| next < key) {
                open[at] = next;
                at += 1;
            }
            open[at] = key;
        } else {
            open.remove(at);
        }
    }
    Ok(members)
}

/// Output batch b takes slices b·S..(b + 1)·S of `members`, each slice's samples in input order.
fn permutation(
    counts: &SampleCounts,
    members: &[Vec<usize>],
    slices: usize,
    batches: usize,
) -> Vec<Vec<SampleRef>> {
    let refs = &counts.refs;
    // `Counter::count_batch` records samples batch by batch and row by row, so walking them in
    // index order lists every slice's samples in input order, with no sort.
    debug_assert!(
        refs.windows(2).all(|w| w[0] < w[1]),
        "samples are counted in input order"
    );
    let mut slice_of = vec![usize::MAX; refs.len()];
    for (s, m) in members.iter().enumerate() {
        for &i in m {
            if let Some(x) = slice_of.get_mut(i) {
                *x = s;
            }
        }
    }
    // Where each slice's next sample goes in its batch.
    let mut next = vec![0usize; members.len()];
    let mut out: Vec<Vec<SampleRef>> = Vec::with_capacity(batches);
    for b in 0..batches {
        let mut at = 0;
        for s in b * slices..((b + 1) * slices).min(members.len()) {
            next[s] = at;
            at += members[s].len();
        }
        out.push(vec![SampleRef { batch: 0, row: 0 }; at]);
    }
    for (i, &s) in slice_of.iter().enumerate() {
        if let (Some(batch), Some(at)) = (out.get_mut(s / slices.max(1)), next.get_mut(s)) {
            batch[*at] = refs[i];
            *at += 1;
        }
    }
    out
}

/// Per (slice, cell) ids of the input order: slice j of batch b holds rows j·r..(j+1)·r.
fn input_order_loads(
    counts: &SampleCounts,
    shape: Shape,
    slice_rows: &[usize],
    load: &mut Vec<u32>,
) {
    let cells = shape.cells();
    load.clear();
    load.resize(slice_rows.len() * shape.slices * cells, 0);
    for (i, r) in counts.refs.iter().enumerate() {
        let s = r.batch * shape.slices + r.row / slice_rows[r.batch];
        for &(c, n) in &counts.cells[counts.start[i]..counts.start[i + 1]] {
            load[s * cells + c as usize] += n;
        }
    }
}

/// A configured limit as the statistics' type.
fn limit(value: u32) -> i32 {
    value.min(i32::MAX as u32) as i32
}

fn identity(window: &[RecordBatch]) -> Vec<Vec<SampleRef>> {
    window
        .iter()
        .enumerate()
        .map(|(b, rb)| {
            (0..rb.num_rows())
                .map(|row| SampleRef { batch: b, row })
                .collect()
        })
        .collect()
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
                        worst.max_ids_per_partition = worst
                            .max_ids_per_partition
                            .max(max.min(i32::MAX as u32) as i32);
                        worst.required_buffer = worst
                            .required_buffer
                            .max(buffer * shape.sc_per_device as u64);
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
                    let total: u64 = (0..nslices)
                        .map(|s| load[s * cells + st * n + p] as u64)
                        .sum();
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
fn with_unsplit(
    mut bound: Vec<u32>,
    counts: &SampleCounts,
    totals: &[u64],
    shape: Shape,
    rows: usize,
) -> Vec<u32> {
    // Per cell: the samples sending ids to it and the most one sends; with the cell's total
    // ids (`totals`), these settle most cells (enough samples send nothing, or all must be
    // taken, or even the average company could not raise the bound). Only the rest list their
    // shares.
    let cells = shape.cells();
    let samples = counts.refs.len();
    let mut sent = vec![(0u32, 0u32); cells];
    for &(c, n) in &counts.cells {
        if let Some(s) = sent.get_mut(c as usize) {
            s.0 += 1;
            s.1 = s.1.max(n);
        }
    }
    let candidate =
        |heaviest: u32, company: u64| (heaviest as u64 + company).min(u32::MAX as u64) as u32;
    // Cells left to list, each with the number of its other samples to take.
    let mut open: Vec<(usize, usize)> = Vec::new();
    for (c, &(senders, heaviest)) in sent.iter().enumerate() {
        if senders == 0 {
            continue;
        }
        let senders = senders as usize;
        let others = senders - 1;
        // What the other samples send to the cell.
        let rest = totals
            .get(c)
            .copied()
            .unwrap_or(0)
            .saturating_sub(heaviest as u64);
        // Samples sending nothing to the cell are the cheapest company.
        let zeros = samples.saturating_sub(senders);
        let need = rows.saturating_sub(1).saturating_sub(zeros).min(others);
        let b = &mut bound[c / shape.partitions];
        if need == 0 || need == others {
            *b = (*b).max(candidate(heaviest, if need == 0 { 0 } else { rest }));
        } else if candidate(heaviest, rest.saturating_mul(need as u64) / others as u64) > *b {
            // The cheapest `need` of the others send at most their average each.
            open.push((c, need));
        }
    }
    if open.is_empty() {
        return bound;
    }
    // The open cells' shares, grouped by cell (a counting sort into one flat buffer).
    let mut slot = vec![usize::MAX; cells];
    let mut start = vec![0usize; open.len() + 1];
    for (k, &(c, _)) in open.iter().enumerate() {
        slot[c] = k;
        start[k + 1] = start[k] + sent[c].0 as usize;
    }
    let mut next = start.clone();
    let mut shares = vec![0u32; start[open.len()]];
    for &(c, n) in &counts.cells {
        let k = slot[c as usize];
        if k != usize::MAX {
            shares[next[k]] = n;
            next[k] += 1;
        }
    }
    for (k, &(c, need)) in open.iter().enumerate() {
        let shares = &mut shares[start[k]..start[k + 1]];
        let Some(h) = (0..shares.len()).max_by_key(|&h| shares[h]) else {
            continue;
        };
        let heaviest = shares[h];
        let last = shares.len() - 1;
        shares.swap(h, last);
        let shares = &mut shares[..last];
        shares.select_nth_unstable(need - 1);
        let company: u64 = shares[..need].iter().map(|&n| n as u64).sum();
        let b = &mut bound[c / shape.partitions];
        *b = (*b).max(candidate(heaviest, company));
    }
    bound
}

/// Each batch's per-stack worst cells, from the pipeline's own statistics.
fn window_loads(prep: &mut Preprocessor, batches: &[RecordBatch]) -> Result<Vec<Vec<StackLoad>>> {
    let mut out = Output::new();
    let mut loads = Vec::with_capacity(batches.len());
    // (A copy: the batch's views borrow the config while `prep` runs mutably.)
    let config = prep.config().clone();
    let n = batches.len();
    let which = |b: usize| {
        move |e: Error| {
            if n > 1 {
                e.context(format!("batch {b} of {n}"))
            } else {
                e
            }
        }
    };
    for (b, rb) in batches.iter().enumerate() {
        let features = features_from_record_batch(&config, rb).map_err(which(b))?;
        let inputs: Vec<&dyn SampleSource> =
            features.iter().map(|f| f as &dyn SampleSource).collect();
        prep.run_stats(&inputs, &mut out).map_err(which(b))?;
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
        self.max_unique_ids_per_partition = self
            .max_unique_ids_per_partition
            .max(l.max_unique_ids_per_partition);
        self.required_buffer = self.required_buffer.max(l.required_buffer);
    }
}

impl Worst for IdLoad {
    fn worst_of(&mut self, l: &Self) {
        self.max_ids_per_partition = self.max_ids_per_partition.max(l.max_ids_per_partition);
        self.required_buffer = self.required_buffer.max(l.required_buffer);
    }
}

/// [`measure`]'s numbers counted as the balancer counts them, without a pass of the pipeline:
/// per-sample ids per cell, and distinct columns per cell for unique ids. They equal the
/// pipeline's statistics (a test holds them to it on every workload profile); unlike
/// [`measure`], ids are not checked against the vocabularies.
pub fn count_loads(config: &Config, batches: &[RecordBatch]) -> Result<Vec<StackLoad>> {
    let mut balancer = Balancer::new(config.clone())?;
    let Ok(shape) = balancer.count(batches)? else {
        return Ok(Vec::new());
    };
    let plan = balancer.prep.plan().expect("count() planned").clone();
    let slice_rows: Vec<usize> = batches
        .iter()
        .map(|rb| rb.num_rows() / shape.slices)
        .collect();
    let mut load = Vec::new();
    input_order_loads(&balancer.counts, shape, &slice_rows, &mut load);
    let ids = batch_loads(&load, shape, batches.len());
    let unique = balancer.unique.worst_per_batch(
        config,
        &plan,
        batches,
        &identity(batches),
        shape.slices,
        &vec![true; shape.stacks],
    )?;
    let loads: Vec<Vec<StackLoad>> = ids
        .iter()
        .zip(&unique)
        .map(|(ids, unique)| {
            ids.iter()
                .zip(unique)
                .map(|(l, &u)| StackLoad {
                    max_ids_per_partition: l.max_ids_per_partition,
                    max_unique_ids_per_partition: u,
                    required_buffer: l.required_buffer,
                })
                .collect()
        })
        .collect();
    Ok(worst_per_stack(&loads))
}

/// A lower bound on any order's worst `max_ids_per_partition`, per stack: the ids a window sends
/// to partition p must land in one of its W·L·S slices, so some slice gets at least
/// ⌈ids to p / (W·L·S)⌉ of them; and a sample is never split, so the slice holding it gets at
/// least the ids it sends to p, plus the fewest its other samples can add. (Per device the pipeline reports the largest over its S
/// SparseCores, so the bound holds for every device's statistic too.)
pub fn lower_bound(config: &Config, window: &[RecordBatch]) -> Result<Vec<u32>> {
    let mut balancer = Balancer::new(config.clone())?;
    let Ok(shape) = balancer.count(window)? else {
        return Ok(Vec::new());
    };
    let cells = shape.cells();
    let mut totals = vec![0u32; cells];
    for &(c, n) in &balancer.counts.cells {
        totals[c as usize] += n;
    }
    let spread = bound_from(&totals, shape, 1)
        .into_iter()
        .map(|t| t.div_ceil((window.len() * shape.slices).max(1) as u32))
        .collect();
    let rows = window
        .iter()
        .map(|b| b.num_rows() / shape.slices)
        .min()
        .unwrap_or(0);
    let totals: Vec<u64> = totals.iter().map(|&n| n as u64).collect();
    Ok(with_unsplit(spread, &balancer.counts, &totals, shape, rows))
}
