//! `fdo merge`, `fdo tune`, `fdo import`, `fdo export`.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use sparsecore_prep::fdo::{csv, npz, tune, FdoStats, LayoutKey};
use sparsecore_prep::{Config, Error};

use super::args::parse_layout;
use super::error::{self, CliError};
use super::outdir::{clean_stale, write_config};
use super::stdio::{outln, warning};

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
    /// Convert the reference's NPZ or CSV stats dump into our stats JSON (batches: one per
    /// recorded row; values our stats cannot hold are clamped, with a warning).
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
    /// Convert our stats JSON into the reference's NPZ or CSV format (by extension). Neither
    /// holds the layout or a batch count; a warning names anything the file does not keep.
    Export {
        /// Stats JSON.
        input: PathBuf,
        /// A `.npz` or `.csv` file.
        #[arg(short, long)]
        out: PathBuf,
    },
}

fn ext(p: &Path) -> String {
    p.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default()
}

pub fn run(c: Command) -> error::Result<()> {
    match c {
        Command::Merge { inputs, out } => {
            let mut merged: Option<FdoStats> = None;
            for p in &inputs {
                let s = FdoStats::from_path(p)?;
                match &mut merged {
                    None => merged = Some(s),
                    Some(m) => m.merge(&s).map_err(|e| {
                        e.context(format!(
                            "merging {} into {}",
                            p.display(),
                            inputs[0].display()
                        ))
                    })?,
                }
            }
            let merged = merged.expect("clap requires at least one input");
            clean_stale(&out, false);
            merged.write(&out)?;
            outln!(
                "merged {} files, {} batches, {} stacks -> {}",
                inputs.len(),
                merged.batches,
                merged.stacks.len(),
                out.display()
            );
            Ok(())
        }
        Command::Tune {
            config,
            stats,
            headroom,
            out,
        } => {
            let cfg = Config::from_path(&config)?;
            let st = FdoStats::from_path(&stats)?;
            let (tuned, changes) = tune(&cfg, &st, headroom).map_err(|e| {
                e.context(format!(
                    "tuning config {} with stats {}",
                    config.display(),
                    stats.display()
                ))
            })?;
            // The tuned config must itself be valid.
            sparsecore_prep::Preprocessor::new(tuned.clone()).map_err(|e| {
                e.context(format!(
                    "the tuned config for {} ({})",
                    out.display(),
                    config.display()
                ))
            })?;
            write_config(&out, &tuned)?;
            outln!(
                "{:<24} {:>17} {:>17} {:>21}",
                "table/stack",
                "max ids",
                "max unique",
                "suggested buffer"
            );
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
            let key = LayoutKey {
                local_device_count: layout.0,
                global_device_count: layout.1,
                num_sc_per_device: layout.2,
            };
            let format = Format::of(&input, "--input")?;
            let name = input.display().to_string();
            // What `npz::import` / `csv::import` do, keeping the arrays for the summary and the
            // warnings.
            let arrays = match format {
                Format::Npz => npz::read_npz(&input)?,
                Format::Csv => {
                    let text = std::fs::read_to_string(&input).map_err(|source| Error::Io {
                        context: format!("reading {name}"),
                        source,
                    })?;
                    csv::parse(&text, &name)?
                }
            };
            let stats = npz::stats_from_arrays(key, &arrays, &name)?;
            clean_stale(&out, false);
            stats.write(&out)?;
            // Warnings first: a closed stdout ends the process at the summary.
            for w in import_losses(&arrays) {
                warning!("{}: {w}", input.display());
            }
            outln!(
                "imported {} ({}) from {} ({format}) to {}: layout {key}, batches {} (one per recorded row; {format} stores no batch count)",
                count(stats.stacks.len(), "stack"),
                count(arrays.len(), "array"),
                input.display(),
                out.display(),
                stats.batches,
            );
            Ok(())
        }
        Command::Export { input, out } => {
            let format = Format::of(&out, "--out")?;
            let stats = FdoStats::from_path(&input)?;
            clean_stale(&out, false);
            match format {
                Format::Npz => npz::export(&out, &stats)?,
                Format::Csv => csv::export(&out, &stats)?,
            }
            // What the file holds is what `fdo import` reads back from it (given the layout).
            // Warnings first: a closed stdout ends the process at the summary.
            let back = match format {
                Format::Npz => npz::import(&out, stats.layout),
                Format::Csv => csv::import(&out, stats.layout),
            };
            match back {
                Ok(back) => {
                    for w in export_losses(&stats, &back, format) {
                        warning!("{}: {w}", out.display());
                    }
                }
                Err(e) => warning!("{} does not read back: {e}", out.display()),
            }
            outln!(
                "exported {} ({}) of {} (batches {}, layout {}) to {} ({format}, the reference's {} dump); it stores no layout: import it with --layout {}",
                count(stats.stacks.len(), "stack"),
                count(4 * stats.stacks.len(), "array"),
                input.display(),
                stats.batches,
                stats.layout,
                out.display(),
                format.client(),
                stats.layout,
            );
            Ok(())
        }
    }
}

/// `1 stack`, `26 stacks`.
fn count(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// The reference's two stats dump formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Npz,
    Csv,
}

impl Format {
    /// By the file's extension; `flag` names the argument in the error.
    fn of(path: &Path, flag: &'static str) -> error::Result<Format> {
        match ext(path).as_str() {
            "npz" => Ok(Format::Npz),
            "csv" => Ok(Format::Csv),
            other => Err(CliError::Argument {
                flag,
                value: path.display().to_string(),
                reason: format!("unknown extension {other:?}; expected .npz or .csv"),
            }),
        }
    }

    /// The reference's client that reads and writes it.
    fn client(self) -> &'static str {
        match self {
            Format::Npz => "NPZFileFDOClient",
            Format::Csv => "CSVFileFDOClient",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Npz => "NPZ",
            Format::Csv => "CSV",
        })
    }
}

/// What an export lost: every difference between the stats and what reads back from the file.
fn export_losses(ours: &FdoStats, back: &FdoStats, format: Format) -> Vec<String> {
    let mut lost = Vec::new();
    if ours.batches != back.batches {
        lost.push(format!(
            "the {format} format holds no batch count: batches ({}) is not kept and will read back as {}",
            ours.batches, back.batches
        ));
    }
    for (name, st) in &ours.stacks {
        let Some(b) = back.stacks.get(name) else {
            lost.push(format!("stack `{name}` does not read back"));
            continue;
        };
        let arrays = [
            (
                "max_ids_per_partition",
                &st.max_ids_per_partition,
                &b.max_ids_per_partition,
            ),
            (
                "max_unique_ids_per_partition",
                &st.max_unique_ids_per_partition,
                &b.max_unique_ids_per_partition,
            ),
            (
                "required_buffer_size_per_sc",
                &st.required_buffer_size_per_sc,
                &b.required_buffer_size_per_sc,
            ),
        ];
        for (field, a, b) in arrays {
            if a != b {
                lost.push(format!(
                    "stack `{name}`: {field} reads back as {b:?}, not {a:?}"
                ));
            }
        }
        if st.dropped_id_count != b.dropped_id_count {
            lost.push(format!(
                "stack `{name}`: dropped_id_count ({}) does not fit the format's int64 and will read back as {}",
                st.dropped_id_count, b.dropped_id_count
            ));
        }
    }
    for name in back.stacks.keys().filter(|n| !ours.stacks.contains_key(*n)) {
        lost.push(format!(
            "reads back with a stack `{name}` the stats do not have"
        ));
    }
    lost
}

/// What an import changed: a negative drop count, imported as 0 (as `npz::stats_from_arrays`
/// does; counts outside int32 or negative fail the import instead).
fn import_losses(arrays: &std::collections::BTreeMap<String, npz::NpyArray>) -> Vec<String> {
    let mut lost = Vec::new();
    // Only the drop counters: counts outside int32, or negative, are errors of the import.
    for (key, a) in arrays
        .iter()
        .filter(|(key, _)| matches!(npz::split_key(key), Some((_, 3))))
    {
        // The count is the largest value; a negative one cannot be a count.
        if let Some(v) = a.data.iter().copied().max().filter(|&v| v < 0) {
            lost.push(format!("{key} is negative ({v}), imported as 0"));
        }
    }
    lost
}
