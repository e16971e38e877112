//! `generate`: a synthetic workload as an Arrow IPC file plus its config.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use arrow_ipc::writer::FileWriter;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sparsecore_prep::io::OutputFile;
use sparsecore_prep::spec::Stacking;
use sparsecore_prep::{Error, Result};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

use super::args::parse_layout;
use super::error::{self, io_err, CliError};
use super::stdio::outln;

#[derive(clap::Args)]
pub struct Args {
    /// criteo, long, large-vocab, high-multivalency or moderate-multivalency.
    #[arg(long)]
    profile: Profile,
    /// Arrow IPC file to write.
    #[arg(long)]
    out: PathBuf,
    /// Config JSON to write (limits are the exact maxima the batches need).
    #[arg(long)]
    config_out: PathBuf,
    /// Samples per record batch (default: the profile's, at most about 5M ids).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Record batches.
    #[arg(long, default_value_t = 1)]
    num_batches: usize,
    /// Device layout L/G/S.
    #[arg(long, default_value = "1/1/4", value_parser = parse_layout)]
    layout: (usize, usize, usize),
    /// Add a `<feature>__w` weights column per feature.
    #[arg(long)]
    weights: bool,
    /// Random seed.
    #[arg(long, default_value_t = 20240611)]
    seed: u64,
    /// Stacking mode of the config: feature or auto.
    #[arg(long, default_value = "feature", value_parser = parse_stacking)]
    stacking: Stacking,
    /// Write ids as Int32 instead of Int64.
    #[arg(long)]
    int32_ids: bool,
    /// Write Criteo-style hex string keys (List<Utf8>) on features hashed with xxh3 instead of
    /// ids.
    #[arg(long, conflicts_with = "int32_ids")]
    raw_keys: bool,
}

fn parse_stacking(s: &str) -> std::result::Result<Stacking, String> {
    match s {
        "feature" => Ok(Stacking::Feature),
        "auto" => Ok(Stacking::Auto),
        _ => Err(format!("expected feature or auto, got {s:?}")),
    }
}

pub fn run(a: Args) -> error::Result<()> {
    let mut spec = WorkloadSpec::new(a.profile);
    spec.batch_size = a.batch_size.unwrap_or(spec.batch_size);
    spec.num_batches = a.num_batches;
    spec.layout = a.layout;
    spec.weights = a.weights;
    spec.seed = a.seed;
    spec.stacking = a.stacking;
    spec.int32_ids = a.int32_ids;
    spec.raw_keys = a.raw_keys;
    // Progress on stderr, drawn only when it is a terminal (indicatif hides it otherwise), so
    // pipes and tests see nothing. The workload is built in one call (the test kit's), which
    // shows as a ticking spinner; writing it shows batches and bytes.
    let pb = progress(None, "{spinner} [{elapsed_precise}] {wide_msg}");
    pb.set_message(format!(
        "generating {} batch{} of {} samples ({}) and measuring their limits",
        spec.num_batches,
        if spec.num_batches == 1 { "" } else { "es" },
        spec.batch_size,
        a.profile.name()
    ));
    let w = generate(&spec)?;
    pb.finish_and_clear();

    // Both files go to temporary names first and are renamed only when both are complete.
    super::outdir::clean_stale(&a.out, false);
    super::outdir::clean_stale(&a.config_out, false);
    let (out, config_out) = (OutputFile::new(&a.out)?, OutputFile::new(&a.config_out)?);
    if super::outdir::same_file(&a.out, &a.config_out) {
        return Err(CliError::SameFile {
            out: a.out.clone(),
            config_out: a.config_out.clone(),
            resolved: super::outdir::resolved(&a.out),
        });
    }
    let pb = progress(
        Some(w.batches.len() as u64),
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} batches written to {wide_msg}",
    );
    let write = || -> Result<()> {
        let file = out.create()?;
        let arrow = |source| Error::Arrow {
            context: format!("writing {}", a.out.display()),
            source,
        };
        let mut writer = FileWriter::try_new(
            Counting {
                inner: file,
                bytes: 0,
            },
            &w.schema,
        )
        .map_err(arrow)?;
        pb.set_message(format!("{} (0 B)", a.out.display()));
        for b in &w.batches {
            writer.write(b).map_err(arrow)?;
            pb.set_message(format!(
                "{} ({})",
                a.out.display(),
                HumanBytes(writer.get_ref().bytes)
            ));
            pb.inc(1);
        }
        writer.finish().map_err(arrow)?;
        std::fs::write(config_out.path(), w.config.to_json())
            .map_err(io_err(format!("writing {}", config_out.path().display())))
    };
    let written = write();
    pb.finish_and_clear();
    // On an error both temporaries go with `out` and `config_out`: nothing is written.
    written?;
    out.commit()?;
    config_out.commit()?;
    let line = serde_json::json!({
        "profile": a.profile.name(),
        "arrow": a.out.display().to_string(),
        "config": a.config_out.display().to_string(),
        "layout": format!("{}/{}/{}", a.layout.0, a.layout.1, a.layout.2),
        "batches": w.batches.len(),
        "rows_per_batch": spec.batch_size,
        "features": w.config.features.len(),
        "tables": w.config.tables.len(),
        "raw_keys": a.raw_keys,
        "total_ids": w.total_ids(),
        "max_ids_per_partition": w.config.tables.iter().map(|t| t.max_ids_per_partition).max(),
        "max_unique_ids_per_partition": w.config.tables.iter().map(|t| t.max_unique_ids_per_partition).max(),
    });
    outln!("{line}");
    Ok(())
}

/// A progress bar (or spinner, without a length) on stderr, ticking on its own when drawn.
fn progress(len: Option<u64>, template: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    if !pb.is_hidden() {
        pb.enable_steady_tick(Duration::from_millis(100));
    }
    pb
}

/// A writer that counts the bytes written through it.
struct Counting<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
