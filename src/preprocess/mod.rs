//! The driver: runs extract → group → fill for every (stack, local device, SparseCore) in
//! parallel and assembles the statistics.
//!
//! Tasks write disjoint slices of the output and keep their own scratch, and statistics are
//! merged afterwards in a fixed order, so the output bytes do not depend on the thread count or
//! on scheduling.

use arrow_array::RecordBatch;

use crate::error::{Error, Result};
use crate::input::{features_from_record_batch, SampleSource};
use crate::output::Output;
use crate::spec::{Config, Plan};
use assemble::assemble;
use checks::check_batches;
use task::{run_stacks, run_stacks_helped, Mode, Schedule, Task};
use workers::Workers;

mod assemble;
mod builder;
mod checks;
mod minibatch;
mod task;
mod workers;
mod workspace;

pub use builder::{Preprocessor, PreprocessorBuilder};
pub use workers::SMALL_BATCH_IDS;

/// Where one call's tasks run.
#[derive(Clone, Copy, Debug)]
enum Placement<'p> {
    /// As the builder's threads and small-batch size say.
    AsBuilt,
    /// On the calling thread, one after another.
    CallerThread,
    /// On the calling thread, with the pool's threads helping (see
    /// [`Preprocessor::run_helped`]).
    Helped(&'p rayon::ThreadPool),
}

/// The ids of a batch, duplicates included.
fn batch_ids(inputs: &[&dyn SampleSource]) -> usize {
    inputs
        .iter()
        .map(|s| s.view().num_ids())
        .fold(0usize, usize::saturating_add)
}

impl Preprocessor {
    /// Starts a builder for `config`.
    pub fn builder(config: Config) -> PreprocessorBuilder {
        PreprocessorBuilder::new(config)
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
        self.run_or_clear(inputs, out, Mode::Buffers, Placement::AsBuilt)
    }

    /// [`Preprocessor::run`] with every task on the calling thread, one after another, whatever
    /// [`PreprocessorBuilder::threads`] says: the same bytes, no pool. For callers that already
    /// run several batches at once on threads of their own (loader threads, each with its own
    /// preprocessor), where a shared pool would make them queue for it.
    pub fn run_on_caller_thread(
        &mut self,
        inputs: &[&dyn SampleSource],
        out: &mut Output,
    ) -> Result<()> {
        self.run_or_clear(inputs, out, Mode::Buffers, Placement::CallerThread)
    }

    /// [`Preprocessor::run`] started on the calling thread, with `pool`'s threads taking tasks
    /// too as soon as they run: the same bytes. For a thread outside `pool` whose batches come
    /// with idle time between them (a training step, other work), in which the pool's threads
    /// fall asleep: `ThreadPool::install` would hand the batch over and wait for a worker to
    /// wake, which on a VM took longer than a batch of a few hundred samples (BENCHMARKS.md,
    /// "Calls after idle time"). Every one of the pool's threads may help (with one fewer, the
    /// helper was often woken on the caller's own CPU, and large batches lost a tenth of their
    /// speed against `install`). Batches under the small-batch size run on
    /// the calling thread alone, and minibatching runs on `pool` as [`Preprocessor::run`] does
    /// (its passes wait for each other anyway).
    ///
    /// Unlike [`Preprocessor::run`], each call allocates its list of tasks.
    pub fn run_helped(
        &mut self,
        pool: &rayon::ThreadPool,
        inputs: &[&dyn SampleSource],
        out: &mut Output,
    ) -> Result<()> {
        self.run_or_clear(inputs, out, Mode::Buffers, Placement::Helped(pool))
    }

    /// Computes only the FDO statistics of a batch: extraction, sorting and grouping run, the
    /// buffers are not written (`out`'s arrays are left empty), and exceeded limits are not an
    /// error, since the point is to measure them. `dropped_id_count` counts the ids the limits
    /// would drop when `allow_id_dropping` is on (always 0 under minibatching, whose first pass
    /// never drops); buffer overflow is not simulated, and the buffer sizes read as 0.
    ///
    /// On `Err`, `out` is left empty, as after a failed [`Preprocessor::run`].
    pub fn run_stats(&mut self, inputs: &[&dyn SampleSource], out: &mut Output) -> Result<()> {
        self.run_or_clear(inputs, out, Mode::StatsOnly, Placement::AsBuilt)
    }

    /// Runs, and empties `out` on any error so that no partial or stale batch survives it.
    fn run_or_clear(
        &mut self,
        inputs: &[&dyn SampleSource],
        out: &mut Output,
        mode: Mode,
        placement: Placement<'_>,
    ) -> Result<()> {
        let result = self.run_mode(inputs, out, mode, placement);
        if result.is_err() {
            out.clear();
        }
        result
    }

    fn run_mode(
        &mut self,
        inputs: &[&dyn SampleSource],
        out: &mut Output,
        mode: Mode,
        placement: Placement<'_>,
    ) -> Result<()> {
        if inputs.len() != self.config.features.len() {
            return Err(Error::InputCount {
                expected: self.config.features.len(),
                got: inputs.len(),
            });
        }
        let mut sizes = std::mem::take(&mut self.local_sizes);
        sizes.clear();
        sizes.extend(inputs.iter().map(|s| s.num_samples()));
        let planned = self.plan_for(&sizes).map(|_| ());
        self.local_sizes = sizes;
        planned?;

        let Preprocessor {
            plan,
            workers,
            small_batch_ids,
            workspaces,
            tasks,
            batch_per_sc,
            minibatching,
            ..
        } = self;
        let plan = plan.as_ref().expect("planned above");
        check_batches(plan, inputs, batch_per_sc)?;
        let batch_per_sc = &batch_per_sc[..];
        out.prepare(plan, mode == Mode::Buffers)?;
        let mode = if plan.enable_minibatching && mode == Mode::Buffers {
            Mode::Pass1
        } else {
            mode
        };
        let local_scs = plan.layout.local_scs();
        tasks.resize_with(plan.stacks.len(), Vec::new);
        for t in tasks.iter_mut() {
            t.resize_with(local_scs, Task::default);
        }

        let schedule = match placement {
            Placement::CallerThread => Schedule::InOrder,
            _ if batch_ids(inputs) < *small_batch_ids => Schedule::InOrder,
            Placement::Helped(_) => Schedule::Parallel,
            Placement::AsBuilt => workers.schedule(),
        };
        // The pool a parallel schedule runs on: the helped run's, else the preprocessor's own
        // (None: the pool of the calling context, rayon's global one outside any).
        let pool = match (placement, &*workers) {
            (Placement::Helped(pool), _) | (_, Workers::Pool(pool)) => Some(pool),
            _ => None,
        };
        // A helped run shares its tasks with the pool's threads; minibatching's pass 1 runs on
        // the pool, as its passes wait for each other anyway.
        let helped_by = match (schedule, placement) {
            (Schedule::Parallel, Placement::Helped(pool)) if mode != Mode::Pass1 => Some(pool),
            _ => None,
        };
        if let Some(pool) = helped_by {
            run_stacks_helped(
                pool,
                pool.current_num_threads(),
                plan,
                inputs,
                batch_per_sc,
                out,
                tasks,
                workspaces,
                mode,
            );
        } else {
            let mut work = || {
                run_stacks(
                    plan,
                    inputs,
                    batch_per_sc,
                    out,
                    tasks,
                    workspaces,
                    mode,
                    schedule,
                )
            };
            match (schedule, pool) {
                (Schedule::Parallel, Some(pool)) => pool.install(work),
                _ => work(),
            }
        }
        workspaces.equalize();

        assemble(plan, tasks, out, mode)?;
        if mode == Mode::Pass1 {
            let mut work =
                || minibatch::finish(plan, batch_per_sc, out, tasks, minibatching, schedule);
            match (schedule, pool) {
                (Schedule::Parallel, Some(pool)) => pool.install(&mut work)?,
                _ => work()?,
            }
        }
        Ok(())
    }

    /// Whether [`Preprocessor::run`] runs this batch on the calling thread (`threads(1)`, or a
    /// batch of fewer ids than [`PreprocessorBuilder::small_batch_ids`]) rather than on a pool. A caller that
    /// puts every call on a pool of its own, as the Python package does to survive `fork`, can
    /// skip that hand-over for such batches: the call then starts no parallel work.
    pub fn runs_on_caller_thread(&self, inputs: &[&dyn SampleSource]) -> bool {
        matches!(self.workers, Workers::CallerThread) || batch_ids(inputs) < self.small_batch_ids
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
        let inputs: Vec<&dyn SampleSource> =
            features.iter().map(|f| f as &dyn SampleSource).collect();
        self.run(&inputs, out)
    }
}
