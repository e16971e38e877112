//! Running tasks on the calling thread, with a pool's threads joining as they come: the
//! schedule of [`crate::Preprocessor::run_helped`], public for the Python package's gather of
//! row objects, which has the same problem.
//!
//! `ThreadPool::install` from a thread outside the pool hands the whole batch over and puts the
//! caller to sleep until a worker has finished it. When the pool's threads are asleep (the
//! caller did other work since the last batch: a training step, another library's call), the
//! batch first waits for them to wake, and on a VM whose other vCPU was idle that took 1-1.5 ms,
//! longer than a whole batch of 500 Criteo samples (BENCHMARKS.md, "Calls after idle time").
//! Here the caller starts on the tasks at once, and each helper takes tasks from the same
//! counter once it runs; a helper that comes late finds none left and leaves without waiting
//! for anything. Which thread runs which task does not change the bytes: each task writes only
//! its own segment and task record.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

/// `state`'s flag: the caller has stopped admitting helpers (the work may be gone).
const CLOSED: usize = 1 << (usize::BITS - 1);

/// What the caller and its helpers share. It outlives the call (a helper may start after it),
/// but `work` is only valid while the caller waits for it: a helper calls it only after it has
/// entered (counted in `state`) before `CLOSED` was set, and the caller returns only after the
/// last entered helper has left.
struct Shared {
    /// The next task to claim.
    next: AtomicUsize,
    /// How many tasks there are.
    count: usize,
    /// Helpers inside (the low bits) and [`CLOSED`].
    state: AtomicUsize,
    /// The call's task function, its lifetime erased (see the type's docs).
    work: WorkPtr,
    /// The caller, woken when the last helper leaves after it closed.
    caller: Thread,
    /// A helper's panic, re-raised on the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// The erased task function.
#[derive(Clone, Copy)]
struct WorkPtr(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync`, and it is only dereferenced under the protocol of `Shared`.
#[allow(unsafe_code)]
unsafe impl Send for WorkPtr {}
// SAFETY: as for `Send`.
#[allow(unsafe_code)]
unsafe impl Sync for WorkPtr {}

impl Shared {
    /// Claims and runs tasks until none are left.
    fn drain(&self, work: &(dyn Fn(usize) + Sync)) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= self.count {
                return;
            }
            work(k);
        }
    }

    /// A helper's turn: enters unless closed, runs tasks, leaves.
    #[allow(unsafe_code)]
    fn help(&self) {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSED != 0 || self.next.load(Ordering::Relaxed) >= self.count {
                return;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        // SAFETY: entered before `CLOSED`, so the caller is still inside `run_helped`, which
        // keeps the function alive until this helper has left.
        let work = unsafe { &*self.work.0 };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| self.drain(work))) {
            let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
        let before = self.state.fetch_sub(1, Ordering::AcqRel);
        if before == CLOSED | 1 {
            self.caller.unpark();
        }
    }
}

/// Runs `work(k)` for every `k` in `0..count`, each exactly once: on the calling thread, with up
/// to `helpers` of `pool`'s threads taking tasks too as soon as they run. Returns when every
/// task has finished; a panicking task's panic is re-raised here.
#[allow(unsafe_code)]
pub fn run_helped(
    pool: &rayon::ThreadPool,
    helpers: usize,
    count: usize,
    work: &(dyn Fn(usize) + Sync),
) {
    let helpers = helpers.min(count.saturating_sub(1));
    if helpers == 0 {
        (0..count).for_each(work);
        return;
    }
    // SAFETY (of the erasure): see `Shared`; `Closing` below waits for every entered helper
    // before this frame, and so `work`, can go, also when a task panics.
    let erased: *const (dyn Fn(usize) + Sync + '_) = work;
    let erased = WorkPtr(unsafe {
        std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
            erased,
        )
    });
    let shared = Arc::new(Shared {
        next: AtomicUsize::new(0),
        count,
        state: AtomicUsize::new(0),
        work: erased,
        caller: std::thread::current(),
        panic: Mutex::new(None),
    });
    for _ in 0..helpers {
        let s = shared.clone();
        pool.spawn(move || s.help());
    }
    /// Closes and waits for the entered helpers, when the caller is done or unwinding.
    struct Closing<'a>(&'a Shared);
    impl Drop for Closing<'_> {
        fn drop(&mut self) {
            let s = self.0;
            s.state.fetch_or(CLOSED, Ordering::AcqRel);
            // Helpers inside run one task at most after this; the timeout covers a wake-up that
            // raced with the park.
            while s.state.load(Ordering::Acquire) != CLOSED {
                std::thread::park_timeout(Duration::from_micros(200));
            }
        }
    }
    {
        let _closing = Closing(&shared);
        shared.drain(work);
    }
    let panic = shared
        .panic
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(p) = panic {
        resume_unwind(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for count in [0usize, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicU64> = (0..count).map(|_| AtomicU64::new(0)).collect();
            run_helped(&pool, 3, count, &|k| {
                hits[k].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "count {count}"
            );
        }
    }

    #[test]
    fn late_helpers_find_nothing_and_the_caller_does_not_wait_for_them() {
        // One pool thread, kept busy: the helper cannot start before the caller has done every
        // task, and the call must still return.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        pool.spawn(move || {
            let _ = rx.recv();
        });
        let sum = AtomicU64::new(0);
        run_helped(&pool, 1, 50, &|k| {
            sum.fetch_add(k as u64, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), (0..50).sum::<u64>());
        tx.send(()).unwrap();
    }

    #[test]
    fn a_helpers_panic_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let caller = std::thread::current().id();
        let got = catch_unwind(AssertUnwindSafe(|| {
            run_helped(&pool, 2, 64, &|_| {
                if std::thread::current().id() != caller {
                    panic!("task panicked on a helper");
                }
                std::thread::sleep(Duration::from_millis(1));
            })
        }));
        // Either a helper took a task (and its panic came back here) or the caller ran all 64.
        if let Err(p) = got {
            assert_eq!(p.downcast_ref::<&str>(), Some(&"task panicked on a helper"));
        }
    }
}
