//! Concurrency: a `Preprocessor` shared by threads, several preprocessors running at once, and a
//! `SampleSource` that runs rayon work of its own.
//!
//! `Preprocessor` is `Send + Sync` (asserted below), and `run` takes `&mut self` (it caches the
//! plan of the last batch shape and per-task results), so one preprocessor shared by threads
//! sits behind a `Mutex` and its calls take turns; each call is parallel inside. Independent
//! preprocessors run at the same time and share rayon's global pool and its per-worker
//! workspaces. In every case each result must be byte-identical to the same batch run alone on
//! a fresh single-threaded preprocessor, errors included (and a failed call leaves its `Output`
//! empty).

use std::sync::{Arc, Barrier, Mutex};

use ndarray::Array2;
use serde_json::json;

use sparsecore_prep::input::{DenseInput, FeatureView, RaggedInput, SampleSource};
use sparsecore_prep::{Config, Error, Output, Preprocessor, PreprocessorBuilder, StackOutput};

const THREADS: usize = 8;
const CALLS_PER_THREAD: usize = 48;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn preprocessor_output_and_error_are_send_and_sync() {
    assert_send_sync::<Preprocessor>();
    assert_send_sync::<PreprocessorBuilder>();
    assert_send_sync::<Output>();
    assert_send_sync::<Error>();
}

/// L = G = 2, S = 4 (N = 8). Stack `t0` holds features `f0` and `f1` (sum), stack `t1` holds
/// `f2` (mean); limits low enough that skewed batches drop ids (or, with `minibatching`, split).
fn config(minibatching: bool) -> Config {
    let v = json!({
        "config": {"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 4,
                   "allow_id_dropping": !minibatching, "enable_minibatching": minibatching,
                   "stacking": "feature"},
        "tables": [
            {"name": "t0", "vocabulary_size": 5000, "embedding_dim": 16, "combiner": "sum",
             "max_ids_per_partition": 8, "max_unique_ids_per_partition": 6},
            {"name": "t1", "vocabulary_size": 300, "embedding_dim": 8, "combiner": "mean",
             "max_ids_per_partition": 16, "max_unique_ids_per_partition": 12}
        ],
        "features": [{"name": "f0", "table": "t0"}, {"name": "f1", "table": "t0"}, {"name": "f2", "table": "t1"}]
    });
    Config::from_json(&v.to_string()).unwrap()
}

/// SplitMix64: a deterministic generator, so every run sees the same batches.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Skewed towards 0: hot ids make partitions exceed their limits.
    fn skewed(&mut self, n: u64) -> u64 {
        let a = self.below(n);
        a * self.below(n) / n
    }
    fn weight(&mut self) -> f32 {
        (self.below(64) as f32 - 24.0) / 16.0
    }
}

/// One call's data: `f0` ragged i64 (weighted or not), `f1` ragged i32, `f2` dense i32 of
/// valency 3 (weighted or not).
struct Batch {
    f0: (Vec<i64>, Vec<i64>, Option<Vec<f32>>),
    f1: (Vec<i32>, Vec<i32>),
    f2: (Array2<i32>, Option<Array2<f32>>),
}

impl Batch {
    fn new(seed: u64, hostile: bool) -> Batch {
        let mut rng = Rng(seed);
        let n0 = [16, 32, 48][rng.below(3) as usize];
        let n1 = [16, 32][rng.below(2) as usize];
        let n2 = [16, 24, 40][rng.below(3) as usize];
        let ragged = |n: usize, vocab: u64, rng: &mut Rng| {
            let mut values = Vec::new();
            let mut splits = vec![0i64];
            for _ in 0..n {
                for _ in 0..rng.below(9) {
                    values.push(rng.skewed(vocab) as i64);
                }
                splits.push(values.len() as i64);
            }
            (values, splits)
        };
        let (v0, s0) = ragged(n0, 5000, &mut rng);
        let w0 = (rng.below(2) == 0).then(|| (0..v0.len()).map(|_| rng.weight()).collect());
        let (v1, s1) = ragged(n1, 5000, &mut rng);
        let mut v1: Vec<i32> = v1.into_iter().map(|v| v as i32).collect();
        if hostile && !v1.is_empty() {
            // One id outside t0's vocabulary: the call must fail, and leave no output.
            let k = rng.below(v1.len() as u64) as usize;
            v1[k] = 5000 + k as i32;
        }
        let s1: Vec<i32> = s1.into_iter().map(|s| s as i32).collect();
        let ids2 = Array2::from_shape_fn((n2, 3), |_| rng.skewed(300) as i32);
        let w2 = (rng.below(2) == 0).then(|| Array2::from_shape_fn((n2, 3), |_| rng.weight()));
        Batch {
            f0: (v0, s0, w0),
            f1: (v1, s1),
            f2: (ids2, w2),
        }
    }

    /// Runs the batch through `p` into `out`.
    fn run(&self, p: &mut Preprocessor, out: &mut Output) -> Result<(), Error> {
        let mut f0 = RaggedInput::from_i64("f0", &self.f0.0, &self.f0.1)?;
        if let Some(w) = &self.f0.2 {
            f0 = f0.with_weights("f0", w)?;
        }
        let f1 = RaggedInput::from_i32("f1", &self.f1.0, &self.f1.1)?;
        let mut f2 = DenseInput::from_i32(self.f2.0.view());
        if let Some(w) = &self.f2.1 {
            f2 = f2.with_weights("f2", w.view())?;
        }
        p.run(&[&f0, &f1, &f2], out)
    }
}

/// One stack in comparable form: name, row pointers, embedding ids, sample ids, gain bits and
/// the stats (as text).
type Stack = (String, Vec<i32>, Vec<i32>, Vec<i32>, Vec<u32>, String);

/// A result in comparable form: the number of minibatches and every stack, or the error
/// message.
type Outcome = Result<(usize, Vec<Stack>), String>;

fn outcome(r: Result<(), Error>, out: &Output) -> Outcome {
    match r {
        Ok(()) => Ok((
            out.num_minibatches,
            out.stacks.iter().map(flatten).collect(),
        )),
        Err(e) => {
            assert!(
                out.stacks.is_empty() && out.num_minibatches == 0,
                "a failed call left output: {e}"
            );
            Err(e.to_string())
        }
    }
}

fn flatten(s: &StackOutput) -> Stack {
    (
        s.name.clone(),
        s.row_pointers.clone(),
        s.embedding_ids.clone(),
        s.sample_ids.clone(),
        s.gains.iter().map(|g| g.to_bits()).collect(),
        format!("{:?}", s.stats),
    )
}

/// Every thread's batches, and what each gives alone on a fresh single-threaded preprocessor.
fn workload(cfg: &Config) -> (Vec<Vec<Batch>>, Vec<Vec<Outcome>>) {
    let batches: Vec<Vec<Batch>> = (0..THREADS)
        .map(|t| {
            (0..CALLS_PER_THREAD)
                .map(|c| Batch::new((t * 1000 + c) as u64, (t + c) % 11 == 5))
                .collect()
        })
        .collect();
    let expected = batches
        .iter()
        .map(|thread| {
            thread
                .iter()
                .map(|b| {
                    let mut p = Preprocessor::builder(cfg.clone())
                        .threads(1)
                        .build()
                        .unwrap();
                    let mut out = Output::new();
                    outcome(b.run(&mut p, &mut out), &out)
                })
                .collect()
        })
        .collect();
    (batches, expected)
}

/// The workload really mixes successes and failures, batch shapes, and drops (or, under
/// minibatching, splits).
fn check_workload_covers(batches: &[Vec<Batch>], expected: &[Vec<Outcome>], minibatching: bool) {
    let shapes: std::collections::BTreeSet<(usize, usize, usize, bool, bool)> = batches
        .iter()
        .flatten()
        .map(|b| {
            (
                b.f0.1.len(),
                b.f1.1.len(),
                b.f2.0.nrows(),
                b.f0.2.is_some(),
                b.f2.1.is_some(),
            )
        })
        .collect();
    assert!(shapes.len() >= 30, "only {} batch shapes", shapes.len());
    let all: Vec<&Outcome> = expected.iter().flatten().collect();
    let failures = all.iter().filter(|o| o.is_err()).count();
    assert!(
        failures >= 20 && failures < all.len() / 2,
        "{failures} failures of {}",
        all.len()
    );
    let ok: Vec<&(usize, Vec<Stack>)> = all.iter().filter_map(|o| o.as_ref().ok()).collect();
    if minibatching {
        let split = ok.iter().filter(|(m, _)| *m > 1).count();
        assert!(
            split > 0 && split < ok.len(),
            "{split} of {} calls split into minibatches",
            ok.len()
        );
    } else {
        let dropping = ok
            .iter()
            .filter(|(_, s)| s.iter().any(|st| !st.5.contains("dropped_id_count: 0")))
            .count();
        assert!(
            dropping > 0 && dropping < ok.len(),
            "{dropping} of {} calls dropped ids",
            ok.len()
        );
    }
}

/// THREADS threads take turns on one preprocessor; each call's result must equal its solo run.
fn run_shared(
    builder: PreprocessorBuilder,
    batches: &[Vec<Batch>],
    expected: &[Vec<Outcome>],
) -> usize {
    let shared = Arc::new(Mutex::new(builder.build().unwrap()));
    let barrier = Barrier::new(THREADS);
    let calls = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for (t, (mine, want)) in batches.iter().zip(expected).enumerate() {
            let shared = Arc::clone(&shared);
            let (barrier, calls) = (&barrier, &calls);
            scope.spawn(move || {
                let mut out = Output::new();
                barrier.wait();
                for (c, (batch, want)) in mine.iter().zip(want).enumerate() {
                    let got = {
                        let mut p = shared.lock().unwrap();
                        // The batch number keys minibatching's cross-host agreement: set it
                        // under the same lock as the call it is for.
                        p.set_batch_number((t * CALLS_PER_THREAD + c) as u64);
                        let r = batch.run(&mut p, &mut out);
                        outcome(r, &out)
                    };
                    calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    assert!(
                        got == *want,
                        "thread {t}, call {c}: differs from the same batch run alone"
                    );
                    std::thread::yield_now();
                }
            });
        }
    });
    calls.into_inner()
}

#[test]
fn one_shared_preprocessor_gives_every_thread_its_solo_result() {
    for minibatching in [false, true] {
        let cfg = config(minibatching);
        let (batches, expected) = workload(&cfg);
        check_workload_covers(&batches, &expected, minibatching);
        // With a dedicated pool of 2 threads, and on rayon's global pool.
        let calls = run_shared(
            Preprocessor::builder(cfg.clone())
                .threads(2)
                .small_batch_ids(0),
            &batches,
            &expected,
        );
        assert_eq!(calls, THREADS * CALLS_PER_THREAD);
        let calls = run_shared(
            Preprocessor::builder(cfg.clone()).small_batch_ids(0),
            &batches,
            &expected,
        );
        assert_eq!(calls, THREADS * CALLS_PER_THREAD);
    }
}

/// THREADS preprocessors (one per thread, same config) run at the same time on rayon's global
/// pool, whose workers keep one workspace each for every preprocessor's tasks.
#[test]
fn independent_preprocessors_run_at_the_same_time() {
    for minibatching in [false, true] {
        let cfg = config(minibatching);
        let (batches, expected) = workload(&cfg);
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|scope| {
            for (t, (mine, want)) in batches.iter().zip(&expected).enumerate() {
                let (barrier, cfg) = (&barrier, &cfg);
                scope.spawn(move || {
                    let mut p = Preprocessor::new(cfg.clone()).unwrap();
                    let mut out = Output::new();
                    barrier.wait();
                    for (c, (batch, want)) in mine.iter().zip(want).enumerate() {
                        let got = outcome(batch.run(&mut p, &mut out), &out);
                        assert!(
                            got == *want,
                            "thread {t}, call {c}: differs from the same batch run alone"
                        );
                    }
                });
            }
        });
    }
}

/// A source that runs `on_view` each time it is asked for its view, as user code in `view()`
/// may (a lazily decoded column, say).
struct OnView<'a, F: Fn() + Sync>(RaggedInput<'a>, F);

impl<F: Fn() + Sync> SampleSource for OnView<'_, F> {
    fn num_samples(&self) -> usize {
        self.0.num_samples()
    }
    fn has_weights(&self) -> bool {
        self.0.has_weights()
    }
    fn view(&self) -> FeatureView<'_> {
        (self.1)();
        self.0.view()
    }
}

// Regression: each rayon worker keeps one workspace in a thread-local `RefCell`, borrowed for
// the whole task on the premise that a task never calls back into rayon. A `SampleSource`'s
// `view()` is user code and may: while it waits, rayon runs another task on the same worker,
// whose `borrow_mut` panicked with "RefCell already borrowed". That task now gets a temporary
// workspace instead.
#[test]
fn a_source_that_uses_rayon_itself_does_not_panic() {
    let v = json!({
        "config": {"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 4},
        "tables": [{"name": "t0", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "mean",
                    "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64}],
        "features": [{"name": "f0", "table": "t0"}]
    });
    let cfg = Config::from_json(&v.to_string()).unwrap();
    let ids: Vec<i32> = (0..128).map(|i| (i * 37) % 1000).collect();
    let splits: Vec<i32> = (0..=64).map(|r| 2 * r).collect();
    let plain = RaggedInput::from_i32("f0", &ids, &splits).unwrap();
    let expected = Preprocessor::builder(cfg.clone())
        .threads(1)
        .build()
        .unwrap()
        .run_new(&[&plain])
        .unwrap();
    // Rayon work of its own in `view()`, so that rayon may start another of the preprocessor's
    // tasks on the same worker while this one waits.
    let source = OnView(RaggedInput::from_i32("f0", &ids, &splits).unwrap(), || {
        use rayon::prelude::*;
        (0..16u64)
            .into_par_iter()
            .for_each(|i| std::thread::sleep(std::time::Duration::from_micros(200 * (i % 3))));
    });
    // On the pool however small the batch, so that the tasks run on workers that `view()` reenters.
    let mut p = Preprocessor::builder(cfg)
        .threads(4)
        .small_batch_ids(0)
        .build()
        .unwrap();
    let mut out = Output::new();
    for _ in 0..20 {
        p.run(&[&source], &mut out).unwrap();
        assert!(outcome(Ok(()), &out) == outcome(Ok(()), &expected));
    }
}

// A small batch runs on the calling thread, in order, whatever the preprocessor's threads (a
// pool's hand-over and wake-up cost more than its work); `small_batch_ids(0)` sends it to the
// pool; a batch of at least `SMALL_BATCH_IDS` ids goes to the pool by default. The output is
// the same each way.
#[test]
fn small_batches_run_on_the_calling_thread() {
    let v = json!({
        "config": {"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 4},
        "tables": [{"name": "t0", "vocabulary_size": 100000, "embedding_dim": 16, "combiner": "sum",
                    "max_ids_per_partition": 100000, "max_unique_ids_per_partition": 100000}],
        "features": [{"name": "f0", "table": "t0"}]
    });
    let cfg = Config::from_json(&v.to_string()).unwrap();
    let batch = |ids_per_row: usize| {
        let ids: Vec<i32> = (0..64 * ids_per_row)
            .map(|i| ((i * 7919) % 100000) as i32)
            .collect();
        let splits: Vec<i32> = (0..=64).map(|r| (r * ids_per_row) as i32).collect();
        (ids, splits)
    };
    // (whether the preprocessor says it runs on the caller, whether any view was on the pool, output)
    let run = |p: &mut Preprocessor, ids: &[i32], splits: &[i32]| {
        // Whether each view was taken on a pool thread (named `sparsecore-prep-i` by `threads(n)`).
        let seen = Mutex::new(Vec::new());
        let source = OnView(RaggedInput::from_i32("f0", ids, splits).unwrap(), || {
            seen.lock().unwrap().push(
                std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with("sparsecore-prep-")),
            );
        });
        let on_caller = p.runs_on_caller_thread(&[&source]);
        let out = p.run_new(&[&source]).unwrap();
        let on_pool = seen.into_inner().unwrap().into_iter().any(|b| b);
        (on_caller, on_pool, out)
    };
    let (small_ids, small_splits) = batch(2);
    let (large_ids, large_splits) = batch(sparsecore_prep::SMALL_BATCH_IDS / 64);
    let small = RaggedInput::from_i32("f0", &small_ids, &small_splits).unwrap();
    let expected_small = Preprocessor::builder(cfg.clone())
        .threads(1)
        .build()
        .unwrap()
        .run_new(&[&small])
        .unwrap();

    let mut pooled = Preprocessor::builder(cfg.clone())
        .threads(2)
        .build()
        .unwrap();
    let (on_caller, on_pool, out) = run(&mut pooled, &small_ids, &small_splits);
    assert!(on_caller && !on_pool, "a batch of 128 ids ran on the pool");
    assert!(outcome(Ok(()), &out) == outcome(Ok(()), &expected_small));
    let (on_caller, on_pool, _) = run(&mut pooled, &large_ids, &large_splits);
    assert!(
        !on_caller && on_pool,
        "a batch of {} ids did not run on the pool",
        large_ids.len()
    );

    let mut always = Preprocessor::builder(cfg.clone())
        .threads(2)
        .small_batch_ids(0)
        .build()
        .unwrap();
    let (on_caller, on_pool, out) = run(&mut always, &small_ids, &small_splits);
    assert!(
        !on_caller && on_pool,
        "small_batch_ids(0) still ran a small batch on the calling thread"
    );
    assert!(outcome(Ok(()), &out) == outcome(Ok(()), &expected_small));

    let mut one = Preprocessor::builder(cfg).threads(1).build().unwrap();
    let (on_caller, on_pool, _) = run(&mut one, &large_ids, &large_splits);
    assert!(on_caller && !on_pool, "threads(1) ran a batch on a pool");
}
