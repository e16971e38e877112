//! Per-worker working memory of the tasks.

use crate::extract::ExtractScratch;
use crate::extracted::Extracted;
use crate::group::SortScratch;

/// The per-thread working memory of tasks: extracted keys and sort scratch. Only tasks running
/// at the same time need their own, so it lives with the worker thread (and is reused by every
/// task and batch it runs) rather than with each of the many tasks.
#[derive(Debug, Default)]
pub(super) struct Workspace {
    pub extracted: Extracted,
    pub extract_scratch: ExtractScratch,
    pub sort_scratch: SortScratch,
}

impl Workspace {
    fn reserve_like(&mut self, other: &Workspace) {
        self.extracted.reserve_like(&other.extracted);
        self.extract_scratch.reserve_like(&other.extract_scratch);
        self.sort_scratch.reserve_like(&other.sort_scratch);
    }
}

/// One [`Workspace`] per worker thread of the pool that runs the tasks, found by rayon's
/// thread index, and one for a thread outside any pool (the caller of a run on its own thread,
/// or of a helped run, see [`crate::parallel`]). After each batch every workspace is grown to
/// the largest capacities any of them reached, so that a batch of the same shape allocates
/// nothing whichever worker gets whichever task (work stealing decides that).
#[derive(Debug, Default)]
pub(super) struct Workspaces(Vec<std::sync::Mutex<Workspace>>);

impl Workspaces {
    pub(super) fn new(workers: usize) -> Self {
        Workspaces(
            (0..workers.max(1) + 1)
                .map(|_| Default::default())
                .collect(),
        )
    }

    /// Runs `f` on the calling worker's workspace.
    pub(super) fn with<R>(&self, f: impl FnOnce(&mut Workspace) -> R) -> R {
        let n = self.0.len();
        let i = rayon::current_thread_index().map_or(n.saturating_sub(1), |i| i % n.max(1));
        match self.0.get(i).map(|m| m.try_lock()) {
            Some(Ok(mut ws)) => f(&mut ws),
            // Only when tasks run on a thread of some other pool whose index collides (the
            // global pool when this preprocessor has none): correct, but allocating.
            _ => f(&mut Workspace::default()),
        }
    }

    /// Grows every workspace to the largest capacities among them.
    pub(super) fn equalize(&mut self) {
        let Some((first, rest)) = self.0.split_first_mut() else {
            return;
        };
        let first = first.get_mut().unwrap_or_else(|e| e.into_inner());
        for m in rest.iter_mut() {
            first.reserve_like(m.get_mut().unwrap_or_else(|e| e.into_inner()));
        }
        for m in rest.iter_mut() {
            m.get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .reserve_like(first);
        }
    }
}
