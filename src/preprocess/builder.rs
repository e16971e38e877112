//! A [`Preprocessor`]'s state, and the builder that sets it up.

use super::minibatch;
use super::task::Task;
use super::workers::{Workers, SMALL_BATCH_IDS};
use super::workspace::Workspaces;
use crate::allreduce::AllReduce;
use crate::error::{Error, Result};
use crate::group::bucket::BucketFn;
use crate::spec::{Config, Plan};

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
/// - To share one between threads, put it in a `Mutex`. Calls then take turns, each parallel
///   inside (on its own pool with [`PreprocessorBuilder::threads`], otherwise on rayon's global
///   pool), except with `threads(1)` and for batches under
///   [`PreprocessorBuilder::small_batch_ids`], which run on the calling thread. Under
///   minibatching, call [`Preprocessor::set_batch_number`] and the run under the same lock, or
///   another thread's number may key this step's cross-host agreement.
/// - To preprocess several batches at the same time, give each thread its own preprocessor.
///
/// Either way each result is byte-identical to the same batch run alone (`tests/pipeline/concurrency.rs`).
/// Each preprocessor holds one scratch workspace per thread that may run its tasks, found by
/// rayon's thread index (the calling thread takes the first), each used by one task at a time;
/// a task that finds its workspace in use (a `SampleSource` whose `view()` runs rayon work of its
/// own lets rayon start another task on the waiting worker) takes a temporary one.
///
/// [`Output`]: crate::Output
#[derive(Debug)]
pub struct Preprocessor {
    pub(super) config: Config,
    pub(super) global_batch_sizes: Option<Vec<usize>>,
    /// The plan was given ([`PreprocessorBuilder::plan`]) and is never re-planned.
    pub(super) fixed_plan: bool,
    pub(super) plan: Option<Plan>,
    pub(super) plan_local_sizes: Vec<usize>,
    pub(super) local_sizes: Vec<usize>,
    pub(super) workers: Workers,
    /// Batches of fewer ids run on the calling thread.
    pub(super) small_batch_ids: usize,
    pub(super) workspaces: Workspaces,
    /// Per stack, per local SparseCore (device-major).
    pub(super) tasks: Vec<Vec<Task>>,
    /// Per stack: the per-SparseCore stacked batch of the current batch.
    pub(super) batch_per_sc: Vec<usize>,
    pub(super) minibatching: minibatch::Settings,
}

/// Builds a [`Preprocessor`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PreprocessorBuilder {
    config: Config,
    threads: Option<usize>,
    small_batch_ids: usize,
    global_batch_sizes: Option<Vec<usize>>,
    minibatching: minibatch::Settings,
    plan: Option<Plan>,
}

impl PreprocessorBuilder {
    pub(super) fn new(config: Config) -> Self {
        PreprocessorBuilder {
            config,
            threads: None,
            small_batch_ids: SMALL_BATCH_IDS,
            global_batch_sizes: None,
            minibatching: minibatch::Settings::default(),
            plan: None,
        }
    }

    /// Runs every batch on this plan (from [`Plan::from_resolved`]) instead of planning the
    /// config's stacking: callers that already hold a stacking, such as the reference's
    /// `FeatureSpec`s, keep it exactly. The plan must be for this config's features.
    pub fn plan(mut self, plan: Plan) -> Self {
        self.plan = Some(plan);
        self
    }

    /// Runs on a dedicated pool of `n` threads (default: rayon's global pool, one thread per
    /// CPU); `n = 1` runs on the calling thread, with no pool and no hand-over per batch. Small
    /// batches run on the calling thread whatever `n` ([`PreprocessorBuilder::small_batch_ids`]).
    /// The output is identical for every `n`.
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = Some(n);
        self
    }

    /// Runs a batch of fewer than `ids` ids (duplicates included) on the calling thread, its
    /// tasks one after another, whatever [`PreprocessorBuilder::threads`] says (default
    /// [`SMALL_BATCH_IDS`]); 0 sends every batch to the pool (but for `threads(1)`, which has
    /// none). The output is the same either way.
    pub fn small_batch_ids(mut self, ids: usize) -> Self {
        self.small_batch_ids = ids;
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
                return Err(Error::InputCount {
                    expected: self.config.features.len(),
                    got: plan.features.len(),
                });
            }
            Some(_) => {}
            None => {
                let nominal = self
                    .global_batch_sizes
                    .clone()
                    .unwrap_or_else(|| vec![0; self.config.features.len()]);
                Plan::new(&self.config, &nominal)?;
            }
        }
        let o = &self.config.config;
        if o.enable_minibatching
            && self.minibatching.all_reduce.is_none()
            && o.local_device_count < o.global_device_count
        {
            return Err(Error::option(
                "enable_minibatching",
                true,
                "all_reduce_interface must be provided when minibatching is enabled for multi-host",
            ));
        }
        let workers = match self.threads {
            None => Workers::Global,
            Some(0) => return Err(Error::option("threads", 0, "must be at least 1")),
            Some(1) => Workers::CallerThread,
            Some(n) => Workers::Pool(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("sparsecore-prep-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::option("threads", n, format!("cannot start the thread pool: {e}"))
                    })?,
            ),
        };
        let workspaces = Workspaces::new(workers.count());
        Ok(Preprocessor {
            config: self.config,
            global_batch_sizes: self.global_batch_sizes,
            fixed_plan: self.plan.is_some(),
            plan: self.plan,
            plan_local_sizes: Vec::new(),
            local_sizes: Vec::new(),
            workers,
            small_batch_ids: self.small_batch_ids,
            workspaces,
            tasks: Vec::new(),
            batch_per_sc: Vec::new(),
            minibatching: self.minibatching,
        })
    }
}
