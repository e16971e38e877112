//! `bench`: time preprocessing of a whole file held in memory, reporting the same fields as
//! `../shared/peer/run_peer.py` so that both can be compared in one run.

use std::path::PathBuf;
use std::time::Instant;

use sparsecore_prep::input::{features_from_record_batch, ArrowListInput, SampleSource};
use sparsecore_prep::io::BatchReader;
use sparsecore_prep::{Config, Output, Preprocessor, Result};

use super::error;
use super::stdio::outln;
use super::table;

#[derive(clap::Args)]
pub struct Args {
    /// Config JSON.
    #[arg(long)]
    config: PathBuf,
    /// Arrow IPC or Parquet input.
    #[arg(long)]
    input: PathBuf,
    #[arg(long, help = crate::args::threads_help())]
    threads: Option<usize>,
    /// Timed passes (at most 100000).
    #[arg(long, default_value_t = 5, value_parser = parse_passes)]
    repeat: usize,
    /// Untimed passes first (at most 100000).
    #[arg(long, default_value_t = 1, value_parser = parse_passes)]
    warmup: usize,
    /// Print one JSON line (run_peer.py's fields) instead of a report.
    #[arg(long)]
    json: bool,
}

/// The most passes of either kind: a median settles within tens, and a count past this is a
/// mistyped one that would run for days (every timed pass is kept).
const MAX_PASSES: usize = 100_000;

fn parse_passes(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n <= MAX_PASSES => Ok(n),
        _ => Err(format!(
            "expected a number of passes from 0 to {MAX_PASSES}, got {s:?}"
        )),
    }
}

pub fn run(a: Args) -> error::Result<()> {
    let config = Config::from_path(&a.config)?;
    let batches = BatchReader::open(&a.input)?.collect::<Result<Vec<_>>>()?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut prep = Preprocessor::builder(config.clone())
        .threads(threads)
        .build()?;
    // Map columns once, like the reference's untimed Arrow -> numpy conversion.
    let features: Vec<Vec<ArrowListInput<'_>>> = batches
        .iter()
        .map(|b| features_from_record_batch(&config, b))
        .collect::<Result<_>>()?;
    let inputs: Vec<Vec<&dyn SampleSource>> = features
        .iter()
        .map(|fs| fs.iter().map(|f| f as &dyn SampleSource).collect())
        .collect();
    let ids: u64 = inputs
        .iter()
        .flatten()
        .map(|s| s.view().num_ids() as u64)
        .sum();

    let mut outs: Vec<Output> = (0..inputs.len()).map(|_| Output::new()).collect();
    let mut pass = |prep: &mut Preprocessor| -> Result<f64> {
        let t = Instant::now();
        for (inp, out) in inputs.iter().zip(outs.iter_mut()) {
            prep.run(inp, out)?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    for _ in 0..a.warmup {
        pass(&mut prep)?;
    }
    let mut times = Vec::new();
    for _ in 0..a.repeat {
        times.push(pass(&mut prep)?);
    }
    times.sort_by(f64::total_cmp);
    let median = if times.is_empty() {
        None
    } else {
        Some(times[times.len() / 2])
    };
    let dropped: u64 = outs
        .iter()
        .flat_map(|o| o.stacks.iter().map(|s| s.stats.dropped_id_count))
        .sum();
    let plan = prep.plan().cloned();
    let weights = config.features.iter().any(|f| f.weights_column.is_some());
    let line = serde_json::json!({
        "tool": "sparsecore-prep",
        "version": env!("CARGO_PKG_VERSION"),
        "ids": ids,
        "batches": batches.len(),
        "threads": threads,
        "median_ms": median,
        "min_ms": times.first(),
        "max_ms": times.last(),
        "ids_per_sec": median.map(|m| (ids as f64 / (m / 1e3)).round() as u64),
        "repeat": a.repeat,
        "warmup": a.warmup,
        "layout": format!("{}/{}/{}", config.config.local_device_count, config.config.global_device_count, config.config.num_sc_per_device),
        "stacking": config.config.stacking,
        "stacks": plan.as_ref().map(|p| p.stacks.len()),
        "weights": weights,
        "dropped_ids": dropped,
        "config": a.config.display().to_string(),
        "input": a.input.display().to_string(),
    });
    if a.json {
        outln!("{line}");
    } else {
        outln!(
            "{} batches, {} ids, {} threads: median {:.2} ms (min {:.2}, max {:.2}) over {} passes = {:.1} M ids/s",
            batches.len(),
            ids,
            threads,
            median.unwrap_or(f64::NAN),
            times.first().copied().unwrap_or(f64::NAN),
            times.last().copied().unwrap_or(f64::NAN),
            a.repeat,
            median.map_or(f64::NAN, |m| ids as f64 / (m / 1e3) / 1e6)
        );
        if let (Some(plan), Some(out)) = (plan.as_ref(), outs.last()) {
            let stats: Vec<_> = out.stacks.iter().map(|s| &s.stats).collect();
            let per_stack = table::count_ids(plan, inputs.last().map(Vec::as_slice).unwrap_or(&[]));
            outln!("last batch:");
            table::print(
                &table::rows(plan, &stats, &per_stack, true),
                plan.layout.sc_per_device,
            );
        }
    }
    Ok(())
}
