//! The thread pool the package's calls run on, rebuilt in a forked child.
//!
//! rayon's global pool does not survive `fork`: the child inherits the pool's state but none of
//! its threads, so the first parallel call in the child waits forever. A `ProcessPoolExecutor`
//! (whose default start method is `fork` on Linux up to Python 3.13), `multiprocessing.Pool`,
//! Spark's Python workers and many data loaders fork a process that has already preprocessed a
//! batch. So every call runs on this pool instead, which knows the process it was started in and
//! starts a new one in a child.
//!
//! Take the pool while holding the GIL ([`pool`] is called before the GIL is released): `fork`
//! from Python also holds it, so no other thread can be inside the lock when a process forks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

static POOL: Mutex<Option<(u32, Arc<ThreadPool>)>> = Mutex::new(None);

/// The reference's thread-count variable, with its meaning: a whole number `n` (ASCII
/// whitespace around it allowed) sizes the pool only when `0 < n <` the CPUs this process may
/// run on; anything else leaves the default.
pub const THREADS_ENV: &str = "SPARSECORE_INPUT_PREPROCESSING_THREADS";

/// The pool size [`THREADS_ENV`] asks for, given the variable's value and the CPUs this process
/// may run on (`None`: the default, one thread per CPU or `RAYON_NUM_THREADS`).
pub fn threads_from_env(value: Option<&str>, cpus: usize) -> Option<usize> {
    let n: i64 = value?.trim_ascii().parse().ok()?;
    (0 < n && (n as u64) < cpus as u64).then_some(n as usize)
}

/// This process's pool: [`THREADS_ENV`]'s size when it sets one, as the reference's pool does,
/// else one thread per CPU (as rayon's global pool, `RAYON_NUM_THREADS` included). Read once,
/// when the process first needs the pool.
pub fn pool() -> PyResult<Arc<ThreadPool>> {
    let pid = std::process::id();
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((owner, pool)) = &*slot {
        if *owner == pid {
            return Ok(pool.clone());
        }
    }
    // None yet, or the parent's, whose threads do not exist in this process: it is leaked, since
    // there is nothing to join or wake.
    if let Some(inherited) = slot.take() {
        std::mem::forget(inherited);
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut builder = ThreadPoolBuilder::new().thread_name(|i| format!("sparsecore-prep-{i}"));
    if let Some(n) = threads_from_env(std::env::var(THREADS_ENV).ok().as_deref(), cpus) {
        builder = builder.num_threads(n);
    }
    let pool = builder
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the thread pool: {e}")))?;
    let pool = Arc::new(pool);
    *slot = Some((pid, pool.clone()));
    Ok(pool)
}

/// The calls in flight on the shared pool (the drop-in's and `Preprocessor`'s), and the process they run in: `pid << 32 | count`. A forked
/// child finds its parent's id here, with the parent's calls at the fork counted: those calls do
/// not exist in the child, so it starts again from none.
static IN_FLIGHT: AtomicU64 = AtomicU64::new(0);

/// Where one call runs (a drop-in call, or a `Preprocessor`'s on the shared pool): on the pool when it is the only call in flight, else on its
/// calling thread alone. Loaders call from several threads at once (keras-rs's from 4); queued
/// for one pool, their calls ran one at a time, each handing its work over and waiting, so that
/// more callers gave no more throughput. Concurrent calls run their tasks one after another on
/// their own threads instead and share the cores; the pool, whose idle threads spin looking for
/// work, is left to a call that runs alone. The bytes are the same either way.
pub struct Turn {
    /// The pool, if this call has it.
    pool: Option<Arc<ThreadPool>>,
}

impl Turn {
    /// Counts this call in; the pool if no other call is in flight.
    pub fn take() -> PyResult<Turn> {
        let pool = pool()?;
        let me = u64::from(std::process::id());
        let mut alone = false;
        let _ = IN_FLIGHT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            let count = if v >> 32 == me {
                v & u64::from(u32::MAX)
            } else {
                0
            };
            alone = count == 0;
            Some(me << 32 | (count + 1))
        });
        Ok(Turn {
            pool: alone.then_some(pool),
        })
    }

    /// The pool, if this call has it.
    pub fn pool(&self) -> Option<&ThreadPool> {
        self.pool.as_deref()
    }
}

impl Drop for Turn {
    /// Counts this call out.
    fn drop(&mut self) {
        let me = u64::from(std::process::id());
        let _ = IN_FLIGHT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            (v >> 32 == me && v & u64::from(u32::MAX) > 0).then(|| v - 1)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::threads_from_env;

    #[test]
    fn the_variable_counts_only_below_the_cpus() {
        assert_eq!(threads_from_env(Some("3"), 8), Some(3));
        assert_eq!(threads_from_env(Some(" 2\n"), 8), Some(2));
        assert_eq!(threads_from_env(Some("+1"), 8), Some(1));
        assert_eq!(threads_from_env(Some("8"), 8), None);
        assert_eq!(threads_from_env(Some("9"), 8), None);
        assert_eq!(threads_from_env(Some("0"), 8), None);
        assert_eq!(threads_from_env(Some("-2"), 8), None);
        assert_eq!(threads_from_env(Some("two"), 8), None);
        assert_eq!(threads_from_env(Some("1.5"), 8), None);
        assert_eq!(threads_from_env(None, 8), None);
        assert_eq!(threads_from_env(Some("1"), 1), None);
    }
}
