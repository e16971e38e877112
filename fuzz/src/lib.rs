//! Helpers shared by the fuzz targets: byte-exact output comparison, the two-thread-count
//! determinism check, a memory budget for fuzzer-made configs, and scratch files for the
//! readers that only take paths.

#![deny(unsafe_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

/// The oracle: a slow re-implementation of SPEC 3.3-3.9 shared with the tests.
pub use sparsecore_testkit::model;

use sparsecore_prep::input::{FeatureView, Ids, Offsets, SampleSource};
use sparsecore_prep::{Config, Error, Output, Plan, Preprocessor};

/// Largest output (all stacks, all local devices, bytes) a target lets a fuzzer-made config
/// ask for. Buffer sizes are the config's to choose (they are the limits the user sets), so
/// the targets keep them small instead of letting libFuzzer's malloc limit trip on a config
/// that is merely large.
pub const OUTPUT_BUDGET_BYTES: u64 = 32 << 20;

/// Bytes the buffers of `plan` take: per stack, `L * (RP + 3 C)` four-byte words, plus the
/// `L * N` statistics twice.
pub fn output_bytes(plan: &Plan) -> u64 {
    let l = plan.layout.local_devices as u64;
    let n = plan.layout.num_partitions() as u64;
    plan.stacks
        .iter()
        .map(|s| {
            let words = (s.row_pointers_per_device as u64)
                .saturating_add((s.coo_buffer_size_per_device as u64).saturating_mul(3))
                .saturating_add(n.saturating_mul(2));
            l.saturating_mul(words).saturating_mul(4)
        })
        .fold(0u64, u64::saturating_add)
}

/// Every byte of two outputs, gains compared by bit pattern (padding is a NaN).
pub fn same_output(a: &Output, b: &Output) -> Result<(), String> {
    if a.num_minibatches != b.num_minibatches {
        return Err(format!(
            "num_minibatches {} vs {}",
            a.num_minibatches, b.num_minibatches
        ));
    }
    if a.stacks.len() != b.stacks.len() {
        return Err(format!("{} stacks vs {}", a.stacks.len(), b.stacks.len()));
    }
    for (x, y) in a.stacks.iter().zip(&b.stacks) {
        let name = &x.name;
        if x.name != y.name {
            return Err(format!("stack names {} vs {}", x.name, y.name));
        }
        if x.row_pointers != y.row_pointers {
            return Err(format!("stack {name}: row_pointers differ"));
        }
        if x.embedding_ids != y.embedding_ids {
            return Err(format!("stack {name}: embedding_ids differ"));
        }
        if x.sample_ids != y.sample_ids {
            return Err(format!("stack {name}: sample_ids differ"));
        }
        let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        if bits(&x.gains) != bits(&y.gains) {
            return Err(format!("stack {name}: gains differ"));
        }
        if x.stats != y.stats {
            return Err(format!(
                "stack {name}: stats differ: {:?} vs {:?}",
                x.stats, y.stats
            ));
        }
        if x.coo_buffer_size_per_device() != y.coo_buffer_size_per_device()
            || x.row_pointers_per_device() != y.row_pointers_per_device()
            || x.local_devices() != y.local_devices()
        {
            return Err(format!("stack {name}: sizes differ"));
        }
    }
    Ok(())
}

/// Two results of the same batch agree: both errors with the same message, or both outputs
/// byte for byte.
pub fn same_result(a: Result<&Output, &Error>, b: Result<&Output, &Error>) -> Result<(), String> {
    match (a, b) {
        (Ok(x), Ok(y)) => same_output(x, y),
        (Err(x), Err(y)) if x.to_string() == y.to_string() => Ok(()),
        (x, y) => Err(format!(
            "results differ: {:?} vs {:?}",
            x.map(|_| "Ok"),
            y.map(|_| "Ok")
        )),
    }
}

/// Worker pools of one and two threads, made once per process: starting threads for every
/// input would cost more than the input. Running a preprocessor built without `threads(n)`
/// inside `pool.install` is what `threads(n)` itself does.
fn pools() -> &'static [rayon::ThreadPool; 2] {
    static POOLS: OnceLock<[rayon::ThreadPool; 2]> = OnceLock::new();
    POOLS.get_or_init(|| {
        [1, 2].map(|n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("thread pool")
        })
    })
}

/// Runs `inputs` with one and with two worker threads (the two-thread preprocessor runs the
/// batch twice into the same `Output`, so buffer reuse is exercised too), panics unless all
/// three runs agree byte for byte, and returns the one-thread result.
///
/// `prepare` sets builder options shared by both (global batch sizes, all-reduce, ...).
pub fn run_deterministic(
    config: &Config,
    prepare: impl Fn(sparsecore_prep::PreprocessorBuilder) -> sparsecore_prep::PreprocessorBuilder,
    batch_number: u64,
    inputs: &[&dyn SampleSource],
) -> Result<Output, Error> {
    let [one, two] = pools();
    let r1 = run_checked(one, two, config, &prepare, batch_number, inputs);
    if verbose() {
        match &r1 {
            Ok(_) => eprintln!("fuzz outcome: Ok"),
            Err(e) => eprintln!("fuzz outcome: Err {}", kind_of(e.root())),
        }
    }
    r1
}

/// With `SPARSECORE_FUZZ_VERBOSE=1` in the environment, the targets print each input's outcome
/// (`fuzz outcome: ...`), so that running a corpus once (`-runs=0`) shows how many inputs reach
/// a successful run and the oracle.
pub fn verbose() -> bool {
    static VERBOSE: OnceLock<bool> = OnceLock::new();
    *VERBOSE.get_or_init(|| std::env::var_os("SPARSECORE_FUZZ_VERBOSE").is_some_and(|v| v == "1"))
}

/// The variant name of an error (its `Debug` text up to the fields).
pub fn kind_of(e: &Error) -> String {
    let text = format!("{e:?}");
    text.split([' ', '{', '('])
        .next()
        .unwrap_or_default()
        .to_string()
}

fn run_checked(
    one: &rayon::ThreadPool,
    two: &rayon::ThreadPool,
    config: &Config,
    prepare: &impl Fn(sparsecore_prep::PreprocessorBuilder) -> sparsecore_prep::PreprocessorBuilder,
    batch_number: u64,
    inputs: &[&dyn SampleSource],
) -> Result<Output, Error> {
    let build = || prepare(Preprocessor::builder(config.clone())).build();
    let mut p1 = build()?;
    p1.set_batch_number(batch_number);
    let mut out1 = Output::new();
    let r1 = one.install(|| p1.run(inputs, &mut out1)).map(|()| out1);

    // Every batch on the pool's two threads, however small (the default runs small batches on
    // the calling thread, in order, as the one-thread run does).
    let mut p2 = prepare(Preprocessor::builder(config.clone()))
        .small_batch_ids(0)
        .build()
        .expect("the first build succeeded, so the second must");
    p2.set_batch_number(batch_number);
    let mut out2 = Output::new();
    for pass in 0..2 {
        let r2 = two.install(|| p2.run(inputs, &mut out2));
        if let Err(e) = same_result(r1.as_ref(), r2.as_ref().map(|()| &out2)) {
            panic!("1 thread vs 2 threads (pass {pass}): {e}");
        }
    }
    r1
}

/// A scratch file path unique to this process (libFuzzer `-jobs`/`-fork` run several), under
/// `/dev/shm` when it exists so that the writes stay in memory.
pub fn scratch_path(name: &str) -> PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("sparsecore-fuzz-{}-{name}", std::process::id()))
}

/// A scratch file holding one input, removed when dropped (the readers under test only take
/// paths).
pub struct Scratch(PathBuf);

impl Scratch {
    /// The file's path.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `data` to this process's scratch file `name`.
pub fn write_scratch(name: &str, data: &[u8]) -> Scratch {
    let path = scratch_path(name);
    std::fs::write(&path, data).expect("scratch file is writable");
    Scratch(path)
}

/// A feature's rows as plain vectors (ids widened to i64, weights by their own offsets), for
/// the oracle model's `Batch`. The view must come from a validating constructor (its offsets
/// in bounds), as every view the targets build does.
pub fn rows_of(source: &dyn SampleSource) -> (Vec<Vec<i64>>, Option<Vec<Vec<f32>>>) {
    let FeatureView::Ragged {
        ids,
        offsets,
        weights,
    } = source.view()
    else {
        panic!("the targets only build ragged views");
    };
    let rows_by = |o: &Offsets<'_>| (0..o.rows()).map(|r| o.range(r)).collect::<Vec<_>>();
    let rows = rows_by(&offsets)
        .into_iter()
        .map(|(a, b)| match ids {
            Ids::I32(v) => v[a..b].iter().map(|&x| x as i64).collect(),
            Ids::I64(v) => v[a..b].to_vec(),
        })
        .collect();
    let weights = weights.map(|(w, wo)| {
        rows_by(&wo)
            .into_iter()
            .map(|(a, b)| w[a..b].to_vec())
            .collect()
    });
    (rows, weights)
}

/// Checks `ours` against the oracle model for the same config and inputs (panics with the
/// difference). Minibatching configs are skipped: the model covers SPEC 3 only.
pub fn check_oracle(
    config: &Config,
    inputs: &[&dyn SampleSource],
    batch_number: u64,
    ours: Result<&Output, &Error>,
) {
    if config.config.enable_minibatching {
        return;
    }
    let features = config
        .features
        .iter()
        .zip(inputs)
        .map(|(f, s)| {
            let (rows, weights) = rows_of(*s);
            model::Feature {
                name: f.name.clone(),
                rows,
                weights,
            }
        })
        .collect();
    let batch = model::Batch { features };
    if let Err(e) = model::check(config, &batch, batch_number, ours) {
        panic!("crate and oracle model disagree: {e}");
    }
    if verbose() {
        eprintln!(
            "fuzz outcome: oracle agrees ({})",
            if ours.is_ok() { "Ok" } else { "Err" }
        );
    }
}

/// Lets a panic raised inside the arrow-* and parquet crates unwind instead of aborting, for
/// targets that read files: `io::BatchReader` contains those (arrow-ipc 60 and parquet 60 still
/// panic on some malformed files) and returns an error. Every other panic still goes to
/// libfuzzer-sys's hook, which aborts and reports it; and a dependency panic that escapes the
/// library unwinds into libfuzzer-sys's own `catch_unwind`, which aborts too. So only what the
/// library contains is let through.
pub fn let_decoder_panics_unwind() {
    let abort_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let decoder = info.location().map(|l| l.file()).filter(|f| {
            f.contains("/registry/") && ["/arrow-", "/parquet-"].iter().any(|c| f.contains(c))
        });
        match decoder {
            Some(file) => {
                if verbose() {
                    eprintln!("fuzz outcome: contained decoder panic in {file}");
                }
            }
            None => abort_hook(info),
        }
    }));
}
