//! Command-line front end: argument parsing and dispatch. Each subcommand lives in its own file.

mod demo;
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
        /// Worker threads (default: one per CPU).
        #[arg(long)]
        threads: Option<usize>,
    },
}

/// Runs the tool; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo { threads } => demo::run(threads),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sparsecore-prep: error: {e}");
            1
        }
    }
}

/// Ids per stack in a record batch (duplicates included).
fn count_ids(plan: &sparsecore_prep::Plan, inputs: &[&dyn sparsecore_prep::input::SampleSource]) -> table::StackIds {
    plan.stacks.iter().map(|s| s.features.iter().map(|&f| inputs[f].view().num_ids() as u64).sum()).collect()
}
