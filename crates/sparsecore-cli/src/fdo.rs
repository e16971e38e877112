//! `fdo merge`, `fdo tune`, `fdo import`, `fdo export`.

use crate::stdio::outln;
use std::path::{Path, PathBuf};

use clap::Subcommand;
use sparsecore_prep::fdo::{csv, npz, tune, FdoStats, LayoutKey};
use sparsecore_prep::{Config, Error, Result};

use super::{parse_layout, write_config};

#[derive(Subcommand)]
pub enum Command {
    /// Merge stats files: element-wise max of the arrays, sum of drops and batches.
    Merge {
        /// Stats JSON files.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Merged stats JSON.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Turn stats into limits and buffer sizes: a new config.
    Tune {
        /// The config the stats were measured with.
        #[arg(long)]
        config: PathBuf,
        /// Stats JSON.
        #[arg(long)]
        stats: PathBuf,
        /// Multiplier applied before rounding up (>= 1).
        #[arg(long, default_value_t = 1.1)]
        headroom: f64,
        /// Tuned config JSON.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Convert the reference's NPZ or CSV stats dump into our stats JSON.
    Import {
        /// A `.npz` or `.csv` file written by the reference's FDO client.
        input: PathBuf,
        /// Layout the stats were measured on, L/G/S.
        #[arg(long, value_parser = parse_layout)]
        layout: (usize, usize, usize),
        /// Stats JSON.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Convert our stats JSON into the reference's NPZ or CSV format (by extension).
    Export {
        /// Stats JSON.
        input: PathBuf,
        /// A `.npz` or `.csv` file.
        #[arg(short, long)]
        out: PathBuf,
    },
}

fn ext(p: &Path) -> String {
    p.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default()
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Merge { inputs, out } => {
            let mut merged: Option<FdoStats> = None;
            for p in &inputs {
                let s = FdoStats::from_path(p)?;
                match &mut merged {
                    None => merged = Some(s),
                    Some(m) => m
                        .merge(&s)
                        .map_err(|e| e.context(format!("merging {} into {}", p.display(), inputs[0].display())))?,
                }
            }
            let merged = merged.expect("clap requires at least one input");
            merged.write(&out)?;
            outln!("merged {} files, {} batches, {} stacks -> {}", inputs.len(), merged.batches, merged.stacks.len(), out.display());
            Ok(())
        }
        Command::Tune { config, stats, headroom, out } => {
            let cfg = Config::from_path(&config)?;
            let st = FdoStats::from_path(&stats)?;
            let (tuned, changes) = tune(&cfg, &st, headroom)
                .map_err(|e| e.context(format!("tuning config {} with stats {}", config.display(), stats.display())))?;
            // The tuned config must itself be valid.
            sparsecore_prep::Preprocessor::new(tuned.clone())
                .map_err(|e| e.context(format!("the tuned config for {} ({})", out.display(), config.display())))?;
            write_config(&out, &tuned)?;
            outln!("{:<24} {:>17} {:>17} {:>21}", "table/stack", "max ids", "max unique", "suggested buffer");
            for ch in &changes {
                let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                outln!(
                    "{:<24} {:>17} {:>17} {:>21}",
                    ch.name,
                    format!("{} -> {}", ch.max_ids.0, ch.max_ids.1),
                    format!("{} -> {}", ch.max_unique.0, ch.max_unique.1),
                    format!("{} -> {}", opt(ch.suggested.0), opt(ch.suggested.1)),
                );
            }
            outln!("wrote {}", out.display());
            Ok(())
        }
        Command::Import { input, layout, out } => {
            let key = LayoutKey { local_device_count: layout.0, global_device_count: layout.1, num_sc_per_device: layout.2 };
            let stats = match ext(&input).as_str() {
                "npz" => npz::import(&input, key)?,
                "csv" => csv::import(&input, key)?,
                other => return Err(Error::option("input", input.display(), format!("unknown extension {other:?}; expected .npz or .csv"))),
            };
            stats.write(&out)
        }
        Command::Export { input, out } => {
            let stats = FdoStats::from_path(&input)?;
            match ext(&out).as_str() {
                "npz" => npz::export(&out, &stats),
                "csv" => csv::export(&out, &stats),
                other => Err(Error::option("out", out.display(), format!("unknown extension {other:?}; expected .npz or .csv"))),
            }
        }
    }
}
