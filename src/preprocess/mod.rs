//! The driver: runs extract → group → fill for every (stack, local device, SparseCore) in
//! parallel and assembles the statistics.
//!
//! Tasks write disjoint slices of the output and keep their own scratch, and statistics are
//! merged afterwards in a fixed order, so the output bytes do not depend on the thread count or
//! on scheduling.

use arrow_array::RecordBatch;
use rayon::prelude::*;

use crate::error::{Error, LimitKind, Result};
use crate::extract::{extract_sc, ExtractScratch, StackCtx};
use crate::extracted::Extracted;
use crate::fill::{Segment, SegmentWriter};
use crate::group::bucket::BucketFn;
use crate::group::{sort_and_walk, Bucketed, CountedEntry, Entry, EntrySink, Limits, ScStats, SortScratch};
use crate::key::KeyFormat;
use crate::input::{features_from_record_batch, SampleSource};
use crate::output::Output;
use crate::spec::{Config, Plan, StackPlan, DATA_MASK};

mod minibatch;
use crate::allreduce::AllReduce;

/// What a run produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Buffers and stats; exceeded limits are errors unless dropping is allowed.
    Buffers,
    /// Stats only.
    StatsOnly,
    /// Minibatching's first pass: stats, and the merged entries kept for a later fill.
    Pass1,
}

/// A sink that keeps nothing (stats-only runs).
struct Discard;

impl EntrySink for Discard {
    #[inline(always)]
    fn push(&mut self, _: Entry) {}
    #[inline(always)]
    fn add_to_last(&mut self, _: f32) {}
}

/// The per-thread working memory of tasks: extracted keys and sort scratch. Only tasks running
/// at the same time need their own, so it lives with the worker thread (and is reused by every
/// task and batch it runs) rather than with each of the many tasks.
#[derive(Debug, Default)]
struct Workspace {
    extracted: Extracted,
    extract_scratch: ExtractScratch,
    sort_scratch: SortScratch,
}

impl Workspace {
    fn reserve_like(&mut self, other: &Workspace) {
        self.extracted.reserve_like(&other.extracted);
        self.extract_scratch.reserve_like(&other.extract_scratch);
        self.sort_scratch.reserve_like(&other.sort_scratch);
    }
}

/// One [`Workspace`] per worker thread of the pool that runs the tasks, found by rayon's
/// thread index. After each batch every workspace is grown to the largest capacities any of
/// them reached, so that a batch of the same shape allocates nothing whichever worker gets
/// whichever task (work stealing decides that).
#[derive(Debug, Default)]
struct Workspaces(Vec<std::sync::Mutex<Workspace>>);

impl Workspaces {
    fn new(workers: usize) -> Self {
        Workspaces((0..workers.max(1)).map(|_| Default::default()).collect())
    }

    /// Runs `f` on the calling worker's workspace.
    fn with<R>(&self, f: impl FnOnce(&mut Workspace) -> R) -> R {
        let i = rayon::current_thread_index().unwrap_or(0) % self.0.len().max(1);
        match self.0.get(i).map(|m| m.try_lock()) {
            Some(Ok(mut ws)) => f(&mut ws),
            // Only when tasks run on a thread of some other pool whose index collides (the
            // global pool when this preprocessor has none): correct, but allocating.
            _ => f(&mut Workspace::default()),
        }
    }

    /// Grows every workspace to the largest capacities among them.
    fn equalize(&mut self) {
        let Some((first, rest)) = self.0.split_first_mut() else { return };
        let first = first.get_mut().unwrap_or_else(|e| e.into_inner());
        for m in rest.iter_mut() {
            first.reserve_like(m.get_mut().unwrap_or_else(|e| e.into_inner()));
        }
        for m in rest.iter_mut() {
            m.get_mut().unwrap_or_else(|e| e.into_inner()).reserve_like(first);
        }
    }
}

/// What one (stack, local SparseCore) task leaves for the merge.
#[derive(Debug, Default)]
struct Task {
    /// Minibatching: the pass-1 entries, and the bucketed pass over them.
    pass1: Vec<CountedEntry>,
    bucketed: Bucketed,
    stats: ScStats,
    overflow: u64,
    error: Option<Error>,
}

/// Builds a [`Preprocessor`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PreprocessorBuilder {
    config: Config,
    threads: Option<usize>,
    global_batch_sizes: Option<Vec<usize>>,
    minibatching: minibatch::Settings,
    plan: Option<Plan>,
}

impl PreprocessorBuilder {
    /// Runs every batch on this plan (from [`Plan::from_resolved`]) instead of planning the
    /// config's stacking: callers that already hold a stacking, such as the reference's
    /// `FeatureSpec`s, keep it exactly. The plan must be for this config's features.
    pub fn plan(mut self, plan: Plan) -> Self {
        self.plan = Some(plan);
        self
    }

    /// Runs on a dedicated pool of `n` threads (default: rayon's global pool, one thread per
    /// CPU). The output is identical for every `n`.
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = Some(n);
        self
    }

    /// Fixes each feature's global batch size (one per config feature) instead of deriving it
    /// as local * G / L. Row offsets and auto stacking are computed from these, as from the
    /// reference's `output_shape`.
    pub fn global_batch_sizes(mut self, sizes: Vec<usize>) -> Self {
        self.global_batch_sizes = Some(sizes);
        self
    }

    /// The cross-host agreement used by minibatching (default: this host alone). Required when
    /// minibatching with more global than local devices.
    pub fn all_reduce(mut self, all_reduce: std::sync::Arc<dyn AllReduce>) -> Self {
        self.minibatching.all_reduce = Some(all_reduce);
        self
    }

    /// The minibatching bucket function (default: the reference's HighwayHash).
    pub fn bucket_fn(mut self, f: BucketFn) -> Self {
        self.minibatching.bucket_fn = f;
        self
    }

    /// Validates the config and builds the preprocessor.
    pub fn build(self) -> Result<Preprocessor> {
        // Validate everything that does not depend on batch sizes now, not at the first batch.
        match &self.plan {
            Some(plan) if plan.features.len() != self.config.features.len() => {
                return Err(Error::InputCount { expected: self.config.features.len(), got: plan.features.len() });
            }
            Some(_) => {}
            None => {
                let nominal = self.global_batch_sizes.clone().unwrap_or_else(|| vec![0; self.config.features.len()]);
                Plan::new(&self.config, &nominal)?;
            }
        }
        let o = &self.config.config;
        if o.enable_minibatching && self.minibatching.all_reduce.is_none() && o.local_device_count < o.global_device_count {
            return Err(Error::option(
                "enable_minibatching",
                true,
                "all_reduce_interface must be provided when minibatching is enabled for multi-host",
            ));
        }
        let pool = match self.threads {
            None => None,
            Some(0) => return Err(Error::option("threads", 0, "must be at least 1")),
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("sparsecore-prep-{i}"))
                    .build()
                    .map_err(|e| Error::option("threads", n, format!("cannot start the thread pool: {e}")))?,
            ),
        };
        let workers = pool.as_ref().map_or_else(rayon::current_num_threads, |p| p.current_num_threads());
        Ok(Preprocessor {
            config: self.config,
            global_batch_sizes: self.global_batch_sizes,
            fixed_plan: self.plan.is_some(),
            plan: self.plan,
            plan_local_sizes: Vec::new(),
            local_sizes: Vec::new(),
            pool,
            workspaces: Workspaces::new(workers),
            tasks: Vec::new(),
            batch_per_sc: Vec::new(),
            minibatching: self.minibatching,
        })
    }
}

/// Turns batches of ids into per-SparseCore CSR-wrapped COO buffers.
///
/// Build it once per config and call it on every batch with the same [`Output`]: plans and
/// scratch are cached by batch shape, so steady-state batches reuse all memory.
///
/// A call either fills the `Output` with the whole batch or fails and leaves it empty (see
/// [`Preprocessor::run`]); a failed call changes nothing about later results.
///
/// # Threads
///
/// `Preprocessor` is `Send + Sync`, but its calls take `&mut self`: they reuse the cached plan
/// and per-task results, so calls on one preprocessor cannot overlap.
/// - To share one between threads, put it in a `Mutex`. Calls then take turns, each already
///   parallel inside (on its own pool with [`PreprocessorBuilder::threads`], otherwise on
///   rayon's global pool). Under minibatching, call [`Preprocessor::set_batch_number`] and the
///   run under the same lock, or another thread's number may key this step's cross-host
///   agreement.
/// - To preprocess several batches at the same time, give each thread its own preprocessor.
///
/// Either way each result is byte-identical to the same batch run alone (tests/concurrency.rs).
/// Scratch memory belongs to the pool's worker threads (one workspace each, used by one task at
/// a time), so preprocessors sharing a pool share those workspaces; a task that finds its
/// worker's workspace in use (a `SampleSource` whose `view()` runs rayon work of its own lets
/// rayon start another task on the waiting worker) takes a temporary one.
#[derive(Debug)]
pub struct Preprocessor {
    config: Config,
    global_batch_sizes: Option<Vec<usize>>,
    /// The plan was given ([`PreprocessorBuilder::plan`]) and is never re-planned.
    fixed_plan: bool,
    plan: Option<Plan>,
    plan_local_sizes: Vec<usize>,
    local_sizes: Vec<usize>,
    pool: Option<rayon::ThreadPool>,
    workspaces: Workspaces,
    /// Per stack, per local SparseCore (device-major).
    tasks: Vec<Vec<Task>>,
    /// Per stack: the per-SparseCore stacked batch of the current batch.
    batch_per_sc: Vec<usize>,
    minibatching: minibatch::Settings,
}

impl Preprocessor {
    /// Starts a builder for `config`.
    pub fn builder(config: Config) -> PreprocessorBuilder {
        PreprocessorBuilder {
            config,
            threads: None,
            global_batch_sizes: None,
            minibatching: minibatch::Settings::default(),
            plan: None,
        }
    }

    /// A preprocessor with default settings.
    pub fn new(config: Config) -> Result<Self> {
        Self::builder(config).build()
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sets the batch number, which keys the cross-host agreements of minibatching (`2b` and
    /// `2b + 1`); it must be the same on every host for a step and differ between steps.
    pub fn set_batch_number(&mut self, batch_number: u64) {
        self.minibatching.batch_number = batch_number;
    }

    /// The plan of the last batch, if any.
    pub fn plan(&self) -> Option<&Plan> {
        self.plan.as_ref()
    }

    /// Plans (or returns the cached plan) for local batches of the given sizes, one per feature.
    pub fn plan_for(&mut self, local_batch_sizes: &[usize]) -> Result<&Plan> {
        if !self.fixed_plan && (self.plan.is_none() || self.plan_local_sizes != local_batch_sizes) {
            let plan = match &self.global_batch_sizes {
                Some(global) => Plan::new(&self.config, global)?,
                None => Plan::for_local_batches(&self.config, local_batch_sizes)?,
            };
            self.plan = Some(plan);
            self.plan_local_sizes.clear();
            self.plan_local_sizes.extend_from_slice(local_batch_sizes);
        }
        Ok(self.plan.as_ref().expect("plan was just set"))
    }

    /// Preprocesses one batch: `inputs[i]` is the local batch of config feature `i`.
    ///
    /// On `Ok`, `out` holds exactly this batch. On `Err`, whatever the error and whether or not
    /// `out` held an earlier batch, `out` is left empty, as by [`Output::clear`]: no stacks and
    /// `num_minibatches == 0`. Many errors (ids out of range, exceeded limits) are found while
    /// the buffers are being written, so the alternative, keeping the previous batch intact,
    /// would need a second set of buffers; an empty output cannot be mistaken for a batch. The
    /// memory is kept, and the preprocessor is ready for the next batch.
    pub fn run(&mut self, inputs: &[&dyn SampleSource], out: &mut Output) -> Result<()> {
        self.run_or_clear(inputs, out, Mode::Buffers)
    }

    /// Computes only the FDO statistics of a batch: extraction, sorting and grouping run, the
    /// buffers are not written (`out`'s arrays are left empty), and exceeded limits are not an
    /// error, since the point is to measure them. `dropped_id_count` counts the ids the limits
    /// would drop when `allow_id_dropping` is on (always 0 under minibatching, whose first pass
    /// never drops); buffer overflow is not simulated, and the buffer sizes read as 0.
    ///
    /// On `Err`, `out` is left empty, as after a failed [`Preprocessor::run`].
    pub fn run_stats(&mut self, inputs: &[&dyn SampleSource], out: &mut Output) -> Result<()> {
        self.run_or_clear(inputs, out, Mode::StatsOnly)
    }

    /// Runs, and empties `out` on any error so that no partial or stale batch survives it.
    fn run_or_clear(&mut self, inputs: &[&dyn SampleSource], out: &mut Output, mode: Mode) -> Result<()> {
        let result = self.run_mode(inputs, out, mode);
        if result.is_err() {
            out.clear();
        }
        result
    }

    fn run_mode(&mut self, inputs: &[&dyn SampleSource], out: &mut Output, mode: Mode) -> Result<()> {
        if inputs.len() != self.config.features.len() {
            return Err(Error::InputCount { expected: self.config.features.len(), got: inputs.len() });
        }
        let mut sizes = std::mem::take(&mut self.local_sizes);
        sizes.clear();
        sizes.extend(inputs.iter().map(|s| s.num_samples()));
        let planned = self.plan_for(&sizes).map(|_| ());
        self.local_sizes = sizes;
        planned?;

        let Preprocessor { plan, pool, workspaces, tasks, batch_per_sc, minibatching, .. } = self;
        let plan = plan.as_ref().expect("planned above");
        check_batches(plan, inputs, batch_per_sc)?;
        let batch_per_sc = &batch_per_sc[..];
        out.prepare(plan, mode == Mode::Buffers)?;
        let mode = if plan.enable_minibatching && mode == Mode::Buffers { Mode::Pass1 } else { mode };
        let local_scs = plan.layout.local_scs();
        tasks.resize_with(plan.stacks.len(), Vec::new);
        for t in tasks.iter_mut() {
            t.resize_with(local_scs, Task::default);
        }

        let mut work = || run_stacks(plan, inputs, batch_per_sc, out, tasks, workspaces, mode);
        match pool {
            Some(pool) => pool.install(work),
            None => work(),
        }
        workspaces.equalize();

        assemble(plan, tasks, out, mode)?;
        if mode == Mode::Pass1 {
            let mut work = || minibatch::finish(plan, batch_per_sc, out, tasks, minibatching);
            match pool {
                Some(pool) => pool.install(&mut work)?,
                None => work()?,
            }
        }
        Ok(())
    }

    /// Preprocesses one batch into a new [`Output`].
    pub fn run_new(&mut self, inputs: &[&dyn SampleSource]) -> Result<Output> {
        let mut out = Output::new();
        self.run(inputs, &mut out)?;
        Ok(out)
    }

    /// Preprocesses one Arrow record batch, mapping columns to features by the config's
    /// `column` / `weights_column`. On `Err` (a missing or mistyped column too), `out` is left
    /// empty, as after a failed [`Preprocessor::run`].
    pub fn run_record_batch(&mut self, batch: &RecordBatch, out: &mut Output) -> Result<()> {
        let features = match features_from_record_batch(&self.config, batch) {
            Ok(features) => features,
            Err(e) => {
                out.clear();
                return Err(e);
            }
        };
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
        self.run(&inputs, out)
    }
}

/// Per-stack batch checks of SPEC 3.1 (check 8) and 3.3; writes each stack's `bsps`.
fn check_batches(plan: &Plan, inputs: &[&dyn SampleSource], batch_per_sc: &mut Vec<usize>) -> Result<()> {
    let layout = &plan.layout;
    let s = layout.sc_per_device;
    batch_per_sc.clear();
    for stack in &plan.stacks {
        let bsps = {
            // Saturating: a custom source may report any count (the plan only bounds them when
            // it derives global sizes from local ones, not with fixed `global_batch_sizes`).
            let bsd: u64 = stack
                .features
                .iter()
                .fold(0u64, |sum, &f| sum.saturating_add((inputs[f].num_samples() / layout.local_devices) as u64));
            if bsd > DATA_MASK {
                return Err(Error::BatchTooLarge { stack: stack.name.clone(), what: "samples", count: bsd, limit: DATA_MASK });
            }
            let bsd = bsd as usize;
            if !bsd.is_multiple_of(s) {
                return Err(Error::BatchNotDivisible {
                    stack: stack.name.clone(),
                    feature: plan.features[stack.features[0]].name.clone(),
                    batch: bsd,
                    sc_per_device: s,
                });
            }
            if bsd < s * stack.features.len() {
                return Err(Error::BatchTooSmall {
                    stack: stack.name.clone(),
                    batch: bsd,
                    sc_per_device: s,
                    features: stack.features.len(),
                });
            }
            bsd / s
        };
        batch_per_sc.push(bsps);
    }
    Ok(())
}

/// Runs every (stack, device, SparseCore) task; errors are parked in the tasks.
fn run_stacks(
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    batch_per_sc: &[usize],
    out: &mut Output,
    tasks: &mut [Vec<Task>],
    workspaces: &Workspaces,
    mode: Mode,
) {
    let layout = plan.layout;
    let rpb = layout.row_pointers_per_segment();
    out.stacks
        .par_iter_mut()
        .zip(tasks.par_iter_mut())
        .zip(plan.stacks.par_iter().zip(batch_per_sc.par_iter()))
        .for_each(|((so, stack_tasks), (stack, &bsps))| {
            let cs = stack.coo_buffer_size_per_sc(&layout);
            let weighted = stack.features.iter().any(|&f| inputs[f].has_weights());
            let ctx = StackCtx {
                name: &stack.name,
                layout,
                combiner: stack.combiner,
                weighted,
                validate_ids: plan.validate_ids,
                batch_per_sc: bsps,
                local_bits: KeyFormat::local_bits_for(layout.partition_bits(), stack.stack_vocab_size, plan.validate_ids),
            };
            let limits = Limits {
                max_ids: stack.max_ids_per_partition,
                max_unique: stack.max_unique_ids_per_partition,
                // Pass 1 of minibatching never drops (SPEC 5.4); only its bucketed pass may.
                drop: plan.allow_id_dropping && !plan.enable_minibatching,
            };
            let job = StackJob { plan, stack, ctx: &ctx, limits, inputs, workspaces };
            let s = layout.sc_per_device;
            match mode {
                Mode::Buffers => so
                    .row_pointers
                    .par_chunks_mut(rpb)
                    .zip(so.embedding_ids.par_chunks_mut(cs))
                    .zip(so.sample_ids.par_chunks_mut(cs))
                    .zip(so.gains.par_chunks_mut(cs))
                    .zip(stack_tasks.par_iter_mut())
                    .enumerate()
                    .for_each(|(i, ((((rp, emb), smp), gains), task))| {
                        let seg = Segment { row_pointers: rp, embedding_ids: emb, sample_ids: smp, gains };
                        run_task(&job, i / s, i % s, Destination::Segment(seg), task);
                    }),
                Mode::StatsOnly => stack_tasks.par_iter_mut().enumerate().for_each(|(i, task)| {
                    run_task(&job, i / s, i % s, Destination::Stats, task);
                }),
                Mode::Pass1 => stack_tasks.par_iter_mut().enumerate().for_each(|(i, task)| {
                    run_task(&job, i / s, i % s, Destination::Entries, task);
                }),
            }
        });
}

/// What every task of one stack shares.
struct StackJob<'a> {
    plan: &'a Plan,
    stack: &'a StackPlan,
    ctx: &'a StackCtx<'a>,
    limits: Limits,
    inputs: &'a [&'a dyn SampleSource],
    workspaces: &'a Workspaces,
}

/// Where a task's grouped entries go.
enum Destination<'a> {
    /// Straight into the SparseCore's segment of the output buffers: no intermediate list.
    Segment(Segment<'a>),
    /// Into the task's entry list, for the fill that follows minibatching's first pass.
    Entries,
    /// Nowhere: only the statistics are kept.
    Stats,
}

/// Runs the task of SparseCore `sc` of local device `device`.
fn run_task(job: &StackJob<'_>, device: usize, sc: usize, destination: Destination<'_>, task: &mut Task) {
    task.error = None;
    task.overflow = 0;
    let StackJob { plan, stack, ctx, limits, inputs, workspaces } = *job;
    // Our own code never calls back into rayon inside a task, but a user's
    // `SampleSource::view` may (a lazily decoded source, say): while it waits, rayon can run
    // another task on this thread, which then finds the workspace locked and takes a temporary
    // one instead (see `Workspaces::with`).
    workspaces.with(|ws| {
        let Workspace { extracted: ex, extract_scratch, sort_scratch } = ws;
        if let Err(e) = extract_sc(ctx, &plan.features, &stack.features, inputs, device, sc, ex, extract_scratch) {
            task.error = Some(e);
            return;
        }
        match destination {
            Destination::Segment(seg) => {
                let writer = SegmentWriter::new(seg, plan.layout.num_partitions(), ctx.batch_per_sc as u32, ex.first_row);
                task.overflow = sort_and_walk(ex, sort_scratch, limits, writer, &mut task.stats).finish();
            }
            Destination::Entries => {
                let mut kept = std::mem::take(&mut task.pass1);
                kept.clear();
                task.pass1 = sort_and_walk(ex, sort_scratch, limits, kept, &mut task.stats);
            }
            Destination::Stats => {
                sort_and_walk(ex, sort_scratch, limits, Discard, &mut task.stats);
            }
        }
    });
}

/// The largest count seen for a limit: (observed, device, SparseCore, partition).
pub(super) type Worst = (u32, usize, usize, usize);

/// `Error::LimitExceeded` for the first of the stack's two limits that `ids` / `unique` exceed.
pub(super) fn check_limits(stack: &StackPlan, ids: Worst, unique: Worst) -> Result<()> {
    for (kind, (observed, device, sc, partition), limit) in [
        (LimitKind::MaxIds, ids, stack.max_ids_per_partition),
        (LimitKind::MaxUniqueIds, unique, stack.max_unique_ids_per_partition),
    ] {
        if observed > limit {
            return Err(Error::LimitExceeded { stack: stack.name.clone(), kind, observed, limit, device, sc, partition });
        }
    }
    Ok(())
}

/// Merges task results into the per-stack statistics, in a fixed order, and reports the first
/// error (by stack, device, SparseCore).
fn assemble(plan: &Plan, tasks: &mut [Vec<Task>], out: &mut Output, mode: Mode) -> Result<()> {
    for stack_tasks in tasks.iter_mut() {
        if let Some(e) = stack_tasks.iter_mut().find_map(|t| t.error.take()) {
            return Err(e);
        }
    }
    let layout = &plan.layout;
    let n = layout.num_partitions();
    let s = layout.sc_per_device;
    for ((stack, so), stack_tasks) in plan.stacks.iter().zip(out.stacks.iter_mut()).zip(tasks.iter()) {
        let stats = &mut so.stats;
        // (observed, device, sc, partition) of the largest count per limit.
        let mut worst_ids = (0u32, 0, 0, 0);
        let mut worst_unique = (0u32, 0, 0, 0);
        for (i, task) in stack_tasks.iter().enumerate() {
            let d = i / s;
            let row = &mut stats.max_ids_per_partition[d * n..(d + 1) * n];
            for (m, &v) in row.iter_mut().zip(&task.stats.ids) {
                *m = (*m).max(v as i32);
            }
            let row = &mut stats.max_unique_ids_per_partition[d * n..(d + 1) * n];
            for (m, &v) in row.iter_mut().zip(&task.stats.unique) {
                *m = (*m).max(v as i32);
            }
            stats.required_buffer_size_per_sc[i] = task.stats.required().min(i32::MAX as u64) as i32;
            stats.dropped_id_count += task.stats.dropped + task.overflow;
            let (ids, p) = task.stats.max_ids();
            if ids > worst_ids.0 {
                worst_ids = (ids, d, i % s, p);
            }
            let (uniq, p) = task.stats.max_unique();
            if uniq > worst_unique.0 {
                worst_unique = (uniq, d, i % s, p);
            }
        }
        if !plan.allow_id_dropping && mode == Mode::Buffers {
            // (Pass 1 of minibatching never fails on limits; the bucketed pass may.)
            check_limits(stack, worst_ids, worst_unique)?;
        }
    }
    Ok(())
}
