//! Where a preprocessor's tasks run (rayon's global pool, the calling thread or a pool of its
//! own), and the batch size under which they stay on the calling thread.

use super::task::Schedule;

/// The default of [`PreprocessorBuilder::small_batch_ids`]: a batch of fewer ids runs on the
/// calling thread, its tasks one after another, whatever [`PreprocessorBuilder::threads`] says,
/// because handing it to a pool thread and waking the caller afterwards costs more than its
/// whole work. It sits at the low end of the crossover measured on a VM (BENCHMARKS.md, "Small
/// batches"), since faster wake-ups move the crossover lower.
///
/// [`PreprocessorBuilder::small_batch_ids`]: super::PreprocessorBuilder::small_batch_ids
/// [`PreprocessorBuilder::threads`]: super::PreprocessorBuilder::threads
pub const SMALL_BATCH_IDS: usize = 8192;

/// Where a preprocessor's tasks run.
#[derive(Debug)]
pub(super) enum Workers {
    /// rayon's global pool (no [`PreprocessorBuilder::threads`]).
    ///
    /// [`PreprocessorBuilder::threads`]: super::PreprocessorBuilder::threads
    Global,
    /// The calling thread alone (`threads(1)`), with no pool: a pool of one would hand every
    /// batch to its thread and put the caller to sleep until it is done, and waking it again
    /// cost more than a small batch's whole work on a VM (BENCHMARKS.md, "Small batches").
    CallerThread,
    /// A dedicated pool (`threads(n)`, n ≥ 2).
    Pool(rayon::ThreadPool),
}

impl Workers {
    pub(super) fn schedule(&self) -> Schedule {
        match self {
            Workers::Global | Workers::Pool(_) => Schedule::Parallel,
            Workers::CallerThread => Schedule::InOrder,
        }
    }

    /// Threads that may run tasks at once, one workspace each.
    pub(super) fn count(&self) -> usize {
        match self {
            Workers::Global => rayon::current_num_threads(),
            Workers::CallerThread => 1,
            Workers::Pool(pool) => pool.current_num_threads(),
        }
    }
}
