//! The `sparsecore-prep` command-line tool: argument parsing and dispatch. Each subcommand lives
//! in its own file.

mod balance;
mod bench;
mod bess;
mod demo;
mod dynamic;
mod error;
mod fdo;
mod generate;
mod outdir;
mod preprocess;
mod report;
mod soak;
mod stdio;
mod table;

use std::path::Path;

use clap::{Parser, Subcommand};
use sparsecore_prep::input::SampleSource;
use sparsecore_prep::{Error, Result};

/// Host-side SparseCore input preprocessing: ids → CSR-wrapped COO buffers + FDO stats.
#[derive(Parser)]
#[command(name = "sparsecore-prep", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Preprocess the bundled demo batch (criteo-like, 26 features, 256 samples, with weights)
    /// and print a per-stack table of stats and buffer usage.
    Demo {
        #[arg(long, help = crate::threads_help())]
        threads: Option<usize>,
    },
    /// Write a deterministic synthetic workload (Arrow IPC file) and its config.
    Generate(generate::Args),
    /// Preprocess an Arrow IPC or Parquet file batch by batch into per-stack Arrow files and
    /// merged FDO stats.
    Preprocess(preprocess::Args),
    /// Compute FDO stats of a file without writing buffers.
    Stats(preprocess::StatsArgs),
    /// Reorder the rows of a file, window by window, so that every (SparseCore slice,
    /// partition) cell gets an even share; writes the same rows in the input's schema.
    Balance(balance::Args),
    /// Draw stats files as per-partition load charts (SVG, or HTML with tables), one panel per
    /// (stack, run), runs side by side; with --config, against its limits and buffers.
    Report(report::Args),
    /// Merge, tune, import and export FDO stats.
    Fdo {
        #[command(subcommand)]
        command: fdo::Command,
    },
    /// Time preprocessing of a file held in memory (same fields as ../shared/peer/run_peer.py).
    Bench(bench::Args),
    /// Stream random batches of varying shapes through one preprocessor for M minutes, check
    /// every K-th output against the oracle model, and fail on a mismatch or on RSS growth.
    Soak(soak::Args),
    /// Dynamic tables (raw keys, lazily created rows): load tests against memory or Redis.
    Dynamic {
        #[command(subcommand)]
        command: dynamic::Command,
    },
    /// Balanced entity sharding (BESS) of knowledge-graph triples: batches laid out for
    /// SparseCores with exact limits, and shardings (.npz).
    Bess {
        #[command(subcommand)]
        command: bess::Command,
    },
}

/// The `--threads` help of every subcommand that preprocesses, naming the library's bound for
/// batches small enough to run on the calling thread.
fn threads_help() -> String {
    format!(
        "Worker threads (default: one per CPU); a batch of fewer than {} ids runs on the \
         calling thread",
        sparsecore_prep::SMALL_BATCH_IDS
    )
}

/// Runs the tool and exits with its status: 0, 1 on an error (one line on stderr), 2 on a usage
/// error (clap's), 141 when stdout was closed by its reader (`stdio`).
fn main() {
    let code = run();
    // Lines are flushed as they are written; this reports (or ends quietly on) a closed stdout
    // for anything still buffered.
    stdio::flush_stdout();
    std::process::exit(code);
}

fn run() -> i32 {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo { threads } => demo::run(threads),
        Command::Generate(a) => generate::run(a),
        Command::Preprocess(a) => preprocess::run(a),
        Command::Stats(a) => preprocess::run_stats(a),
        Command::Balance(a) => balance::run(a),
        Command::Report(a) => report::run(a),
        Command::Fdo { command } => fdo::run(command),
        Command::Bench(a) => bench::run(a),
        Command::Soak(a) => match soak::run(a) {
            Ok(true) => Ok(()),
            // The soak printed what went wrong.
            Ok(false) => return 1,
            Err(e) => Err(e),
        },
        Command::Dynamic { command } => dynamic::run(command),
        Command::Bess { command } => bess::run(command),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            stdio::write_stderr(format_args!("sparsecore-prep: error: {e}\n"));
            1
        }
    }
}

/// Ids per stack of a batch (duplicates included).
fn count_ids(plan: &sparsecore_prep::Plan, inputs: &[&dyn SampleSource]) -> Vec<u64> {
    plan.stacks
        .iter()
        .map(|s| {
            s.features
                .iter()
                .map(|&f| inputs[f].view().num_ids() as u64)
                .sum()
        })
        .collect()
}

/// Parses `L/G/S`.
fn parse_layout(s: &str) -> std::result::Result<(usize, usize, usize), String> {
    let parts: Vec<&str> = s.split('/').collect();
    let nums: Vec<usize> = parts.iter().filter_map(|p| p.trim().parse().ok()).collect();
    match nums.as_slice() {
        [l, g, sc] if parts.len() == 3 && *l > 0 && *g > 0 && *sc > 0 => Ok((*l, *g, *sc)),
        _ => Err(format!(
            "expected L/G/S (three integers, each at least 1), got {s:?}"
        )),
    }
}

/// Parses `i/N` with `i < N`.
fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("expected i/N, got {s:?}"))?;
    let (i, n): (usize, usize) = (
        i.trim()
            .parse()
            .map_err(|_| format!("bad shard index in {s:?}"))?,
        n.trim()
            .parse()
            .map_err(|_| format!("bad shard count in {s:?}"))?,
    );
    if n == 0 || i >= n {
        return Err(format!("shard {i}/{n}: need 0 <= i < N"));
    }
    Ok((i, n))
}

/// Writes a config JSON atomically.
fn write_config(path: &Path, config: &sparsecore_prep::Config) -> Result<()> {
    outdir::clean_stale(path, false);
    sparsecore_prep::fdo::write_atomic(path, config.to_json().as_bytes())
}

/// An I/O error with context.
fn io_err(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}
