//! `soak`: a long run of random batches of varying shapes through one `Preprocessor` and one
//! reused `Output`, with every K-th result checked against the oracle model
//! (`sparsecore_testkit::model`) and the resident set size watched for growth.
//!
//! What it catches that short tests do not: state carried from one batch to the next (plan and
//! workspace caches, buffers resized between shapes, recovery after an error batch), slow
//! leaks, and rare data that only long random streams produce.
//!
//! The config is fixed: L/G/S = 2/4/2 (N = 8), auto stacking of five tables into a two-table
//! stack and three single-table ones, all three combiners, weights on two features, tight limits
//! with dropping, and a small suggested buffer on one stack so that it overflows. Each batch
//! draws each feature's batch size from four shapes (8 to 512 samples per SparseCore), row
//! lengths from 0 to the feature's maximum, and ids from a hot set or the whole vocabulary;
//! about one batch in 64 carries an out-of-range id, which must be an error on both sides, after
//! which the next batch must come out right.
//!
//! RSS (`VmRSS` of `/proc/self/status`) is sampled after a warm-up that runs every shape at its
//! largest, with a check, and then once a second; the run fails if the RSS at the end is more
//! than 5% above the warm-up's.

use std::io::Write;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sparsecore_prep::input::SampleSource;
use sparsecore_prep::{Config, Output, Preprocessor, Result};

use sparsecore_testkit::model;
use sparsecore_testkit::model::{Batch, Feature, FlatBatch};

use super::error::{self, CliError};
use super::stdio::outln;

/// Options of `soak`: the run's length, its random stream, and how often to pay for a check.
#[derive(clap::Args)]
pub struct Args {
    /// How long to run, in minutes (fractions allowed).
    #[arg(long)]
    minutes: f64,
    /// Seed of the random batches.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, help = crate::args::threads_help())]
    threads: Option<usize>,
    /// Check every K-th batch against the oracle model (batches with a planted error always).
    #[arg(long, default_value_t = 10)]
    check_every: u64,
}

const CONFIG: &str = r#"{
  "config": {"local_device_count": 2, "global_device_count": 4, "num_sc_per_device": 2,
             "allow_id_dropping": true, "stacking": "auto",
             "stack_limits": {"max_ids_per_partition": 512, "max_unique_ids_per_partition": 256},
             "stack_suggested_coo_buffer_size_per_device": {"hot": 320}},
  "tables": [
    {"name": "users", "vocabulary_size": 1000000, "embedding_dim": 16, "combiner": "sum",
     "max_ids_per_partition": 128, "max_unique_ids_per_partition": 128},
    {"name": "items", "vocabulary_size": 50000, "embedding_dim": 16, "combiner": "sum",
     "max_ids_per_partition": 128, "max_unique_ids_per_partition": 128},
    {"name": "tags", "vocabulary_size": 5000, "embedding_dim": 8, "combiner": "mean",
     "max_ids_per_partition": 48, "max_unique_ids_per_partition": 24},
    {"name": "hot", "vocabulary_size": 64, "embedding_dim": 32, "combiner": "sqrtn",
     "max_ids_per_partition": 64, "max_unique_ids_per_partition": 6},
    {"name": "big", "vocabulary_size": 2000000000, "embedding_dim": 4, "combiner": "mean",
     "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64}
  ],
  "features": [
    {"name": "user", "table": "users"},
    {"name": "item", "table": "items"},
    {"name": "tag", "table": "tags"},
    {"name": "hot_a", "table": "hot"},
    {"name": "clicked_item", "table": "items"},
    {"name": "hot_b", "table": "hot"},
    {"name": "huge", "table": "big"}
  ]
}"#;

/// Per feature (config order): max ids per sample, hot-set size, whether weighted.
const SHAPES: [(usize, u64, bool); 7] = [
    (1, 1 << 20, false),
    (6, 64, false),
    (12, 32, true),
    (4, 8, false),
    (20, 128, true),
    (2, 4, false),
    (3, 1 << 40, false),
];

/// Samples per SparseCore a feature can have in one batch.
const SAMPLES_PER_SC: [usize; 4] = [8, 32, 128, 512];

/// Resident set size in KiB, if /proc is readable.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or("n/a".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

/// A random batch; `largest` gives every feature its largest shape and longest rows.
fn random_batch(
    config: &Config,
    rng: &mut StdRng,
    local_scs: usize,
    largest: bool,
    plant_error: bool,
) -> Batch {
    let mut features: Vec<Feature> = config
        .features
        .iter()
        .zip(SHAPES)
        .map(|(f, (max_len, hot, weighted))| {
            let vocab = config.tables[config.table_index(&f.table).expect("config is consistent")]
                .vocabulary_size;
            let per_sc = if largest {
                SAMPLES_PER_SC[SAMPLES_PER_SC.len() - 1]
            } else {
                SAMPLES_PER_SC[rng.random_range(0..SAMPLES_PER_SC.len())]
            };
            let rows: Vec<Vec<i64>> = (0..per_sc * local_scs)
                .map(|_| {
                    let len = if largest {
                        max_len
                    } else {
                        rng.random_range(0..=max_len)
                    };
                    (0..len)
                        .map(|_| match rng.random_range(0..16) {
                            0 => vocab as i64 - 1,
                            1..=8 => rng.random_range(0..hot.min(vocab)) as i64,
                            _ => rng.random_range(0..vocab) as i64,
                        })
                        .collect()
                })
                .collect();
            let weights = weighted.then(|| {
                rows.iter()
                    .map(|r| {
                        r.iter()
                            .map(|_| rng.random_range(-16..=64) as f32 / 16.0)
                            .collect()
                    })
                    .collect()
            });
            Feature {
                name: f.name.clone(),
                rows,
                weights,
            }
        })
        .collect();
    if plant_error {
        let f = rng.random_range(0..features.len());
        let vocab = config.tables[config
            .table_index(&config.features[f].table)
            .expect("consistent")]
        .vocabulary_size;
        let rows = &mut features[f].rows;
        let r = rng.random_range(0..rows.len());
        rows[r].push(vocab as i64);
        if let Some(w) = &mut features[f].weights {
            w[r].push(1.0);
        }
    }
    Batch { features }
}

/// Counters of the run.
#[derive(Default)]
struct Tally {
    batches: u64,
    ids: u64,
    busy: Duration,
    checks: u64,
    failures: u64,
    error_batches: u64,
    dropped: u64,
}

/// Runs the soak; `Ok(false)` means a mismatch or RSS growth (the details are printed).
pub fn run(a: Args) -> error::Result<bool> {
    if !(a.minutes.is_finite() && a.minutes >= 0.0) {
        return Err(CliError::Argument {
            flag: "--minutes",
            value: a.minutes.to_string(),
            reason: "a finite number of minutes, at least 0".into(),
        });
    }
    let config = Config::from_json(CONFIG)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut prep = Preprocessor::builder(config.clone())
        .threads(threads)
        .build()?;
    let local_scs = config.config.local_device_count * config.config.num_sc_per_device;
    let check_every = a.check_every.max(1);
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut out = Output::new();
    let mut t = Tally::default();
    let mut stderr = std::io::stderr();
    outln!(
        "soak: L/G/S 2/4/2, {} tables, {} features, auto stacking; {threads} thread(s), seed {}, check every {check_every}, {} min",
        config.tables.len(),
        config.features.len(),
        a.seed,
        a.minutes
    );

    // One batch: run, maybe check; false on a mismatch.
    let mut step = |batch: &Batch,
                    check: bool,
                    prep: &mut Preprocessor,
                    out: &mut Output,
                    t: &mut Tally|
     -> Result<bool> {
        let flat = FlatBatch::new(batch);
        let sources = flat.sources()?;
        let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
        prep.set_batch_number(t.batches);
        let start = Instant::now();
        let result = prep.run(&inputs, out);
        t.busy += start.elapsed();
        t.batches += 1;
        t.ids += flat.num_ids() as u64;
        match &result {
            Ok(()) => {
                t.dropped += out
                    .stacks
                    .iter()
                    .map(|s| s.stats.dropped_id_count)
                    .sum::<u64>()
            }
            Err(_) => t.error_batches += 1,
        }
        if !check {
            return Ok(true);
        }
        t.checks += 1;
        match model::check(
            &config,
            batch,
            t.batches - 1,
            result.as_ref().map(|_| &*out),
        ) {
            Ok(()) => Ok(true),
            Err(e) => {
                t.failures += 1;
                let _ = writeln!(
                    stderr,
                    "soak: batch {} (seed {}) disagrees with the model: {e}",
                    t.batches - 1,
                    a.seed
                );
                Ok(false)
            }
        }
    };

    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64((a.minutes * 60.0).max(0.0));
    // Warm-up: every shape once at its largest (with a check), then random batches, so that
    // caches, workspaces and the allocator have seen the peak before the baseline.
    let mut ok = step(
        &random_batch(&config, &mut rng, local_scs, true, false),
        true,
        &mut prep,
        &mut out,
        &mut t,
    )?;
    let warm_until = started + Duration::from_secs_f64((a.minutes * 60.0 * 0.1).clamp(1.0, 30.0));
    while ok && Instant::now() < warm_until {
        let plant = rng.random_range(0..64) == 0;
        let check = plant || t.batches % check_every == 0;
        ok = step(
            &random_batch(&config, &mut rng, local_scs, false, plant),
            check,
            &mut prep,
            &mut out,
            &mut t,
        )?;
    }
    let warm_rss = rss_kib();
    let warm_batches = t.batches;
    outln!(
        "soak: warm-up {} batches in {:.1} s, RSS {}",
        t.batches,
        started.elapsed().as_secs_f64(),
        mib(warm_rss)
    );

    let mut peak = warm_rss;
    let mut next_sample = Instant::now() + Duration::from_secs(1);
    let mut next_report = Instant::now() + Duration::from_secs(60);
    while ok && Instant::now() < deadline {
        let plant = rng.random_range(0..64) == 0;
        let check = plant || t.batches % check_every == 0;
        ok = step(
            &random_batch(&config, &mut rng, local_scs, false, plant),
            check,
            &mut prep,
            &mut out,
            &mut t,
        )?;
        let now = Instant::now();
        if now >= next_sample {
            peak = peak.max(rss_kib());
            next_sample = now + Duration::from_secs(1);
        }
        if now >= next_report {
            outln!(
                "soak: {:>4.0} s: {} batches, {:.1} M ids/s, checks {}/{} passed, RSS {}",
                started.elapsed().as_secs_f64(),
                t.batches,
                t.ids as f64 / t.busy.as_secs_f64() / 1e6,
                t.checks - t.failures,
                t.checks,
                mib(rss_kib())
            );
            next_report = now + Duration::from_secs(60);
        }
    }
    let end_rss = rss_kib();
    peak = peak.max(end_rss);
    let growth = match (warm_rss, end_rss) {
        (Some(w), Some(e)) if w > 0 => Some((e as f64 - w as f64) / w as f64 * 100.0),
        _ => None,
    };
    outln!(
        "soak: {} batches ({} after warm-up) in {:.1} s; {} ids in {:.1} s of preprocessing = {:.1} M ids/s",
        t.batches,
        t.batches - warm_batches,
        started.elapsed().as_secs_f64(),
        t.ids,
        t.busy.as_secs_f64(),
        t.ids as f64 / t.busy.as_secs_f64().max(1e-9) / 1e6
    );
    outln!(
        "soak: checks passed {}/{} (error batches {}, all checked; ids dropped {})",
        t.checks - t.failures,
        t.checks,
        t.error_batches,
        t.dropped
    );
    outln!(
        "soak: RSS after warm-up {}, at end {} ({}), peak {}",
        mib(warm_rss),
        mib(end_rss),
        growth.map_or("n/a".into(), |g| format!("{g:+.2}%")),
        mib(peak)
    );
    if t.failures > 0 {
        outln!(
            "soak: FAILED: {} batch(es) disagree with the model",
            t.failures
        );
        return Ok(false);
    }
    if let Some(g) = growth {
        if g > 5.0 {
            outln!("soak: FAILED: RSS grew {g:.2}% after warm-up (limit 5%)");
            return Ok(false);
        }
    }
    outln!("soak: OK");
    Ok(true)
}
