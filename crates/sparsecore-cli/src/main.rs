//! The `sparsecore-prep` command-line tool: argument parsing and dispatch. Each subcommand lives
//! in its own file.

mod args;
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

use clap::{Parser, Subcommand};

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
        #[arg(long, help = args::threads_help())]
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
