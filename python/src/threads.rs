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

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

static POOL: Mutex<Option<(u32, Arc<ThreadPool>)>> = Mutex::new(None);

/// This process's pool (one thread per CPU, as rayon's global pool).
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
    let pool = ThreadPoolBuilder::new()
        .thread_name(|i| format!("sparsecore-prep-{i}"))
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the thread pool: {e}")))?;
    let pool = Arc::new(pool);
    *slot = Some((pid, pool.clone()));
    Ok(pool)
}
