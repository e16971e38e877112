//! Steady state is allocation-free: after the first batch, preprocessing a batch of the same
//! shape into the same `Output` performs no heap allocation (counted by a global allocator).
//!
//! This is exact for any number of worker threads: each worker has its own workspace, and after
//! every batch all of them are grown to the largest capacities any reached, so whichever worker
//! runs whichever task of the next batch, nothing grows.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `f`.
fn count(f: impl FnOnce()) -> usize {
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst)
}

/// Threads of this process (Linux), else `None`.
fn threads_alive() -> Option<usize> {
    std::fs::read_dir("/proc/self/task").ok().map(|d| d.count())
}

/// Waits (up to 10 s) until at most `n` threads are alive. The counter counts every thread's
/// allocations, and a dropped preprocessor's pool lets its workers exit on their own time (right
/// after the drop, 1 to 4 of them are still alive here). A worker's teardown can allocate (most
/// likely crossbeam's epoch state handing its pending garbage on): once, on a loaded machine, 6
/// allocations fell into the count of the case after one with 3 workers.
fn wait_for_threads(n: Option<usize>) {
    let Some(n) = n else { return };
    let start = std::time::Instant::now();
    while threads_alive().is_some_and(|alive| alive > n)
        && start.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `threads`: a pool of that many (None: rayon's global pool); `small_batch_ids`: the builder's
/// bound below which a batch runs on the calling thread.
fn steady_state(
    profile: Profile,
    batch: usize,
    weights: bool,
    threads: Option<usize>,
    small_batch_ids: usize,
) {
    let mut spec = WorkloadSpec::new(profile);
    spec.batch_size = batch;
    spec.num_batches = 3;
    spec.weights = weights;
    spec.layout = (2, 2, 4);
    let w = generate(&spec).unwrap();
    let features: Vec<Vec<_>> = w
        .batches
        .iter()
        .map(|b| features_from_record_batch(&w.config, b).unwrap())
        .collect();
    let inputs: Vec<Vec<&dyn SampleSource>> = features
        .iter()
        .map(|fs| fs.iter().map(|f| f as &dyn SampleSource).collect())
        .collect();
    // After generating the workload, which starts rayon's global pool the first time.
    let before = threads_alive();
    let mut builder = Preprocessor::builder(w.config.clone()).small_batch_ids(small_batch_ids);
    if let Some(n) = threads {
        builder = builder.threads(n);
    }
    let mut prep = builder.build().unwrap();
    let mut out = Output::new();
    // Warm up: the first batches size every buffer (the next batches may be larger).
    for inp in &inputs {
        prep.run(inp, &mut out).unwrap();
    }
    for inp in &inputs {
        prep.run(inp, &mut out).unwrap();
    }
    let first_checksum: i64 = out
        .stacks
        .iter()
        .map(|s| s.embedding_ids.iter().map(|&v| v as i64).sum::<i64>())
        .sum();
    assert!(first_checksum != 0, "the workload produced no entries");
    let n = count(|| {
        for inp in &inputs {
            prep.run(inp, &mut out).unwrap();
        }
    });
    assert_eq!(
        n,
        0,
        "{} allocations in steady state ({}, weights {weights}, threads {threads:?})",
        n,
        profile.name()
    );
    drop(prep);
    wait_for_threads(before);
}

/// One test function: the counter is process-wide, so a second test running beside this one
/// would be counted too.
#[test]
fn steady_state_is_allocation_free() {
    steady_state(Profile::Criteo, 256, false, Some(1), 0);
    steady_state(Profile::Long, 64, true, Some(1), 0);
    steady_state(Profile::ModerateMultivalency, 128, false, Some(1), 0);
    // With several workers, work stealing hands tasks to workers unpredictably; the per-worker
    // workspaces are grown to the largest one's capacities after each batch, so steady state is
    // exact there too. Repeated, since which worker runs what changes from run to run. Every
    // batch goes to the workers (`small_batch_ids(0)`), however small.
    for _ in 0..3 {
        steady_state(Profile::Criteo, 256, false, Some(2), 0);
        steady_state(Profile::Long, 64, true, Some(3), 0);
        steady_state(Profile::ModerateMultivalency, 128, false, Some(4), 0);
    }
    // A preprocessor on a pool whose batches all run on the calling thread (a bound above every
    // batch here, as the default is above small ones), taking the first of its workspaces. The
    // global pool, because a pool of its own would still be starting its threads, which allocate,
    // while the counted batches run: the global pool was started by `generate`.
    steady_state(Profile::Criteo, 256, false, None, usize::MAX);
    steady_state(Profile::Long, 64, true, None, usize::MAX);
}
