//! `balance`: reorder the rows of a file so that every (SparseCore slice, partition) cell of
//! each batch gets an even share (`sparsecore_prep::balance`), window by window; and the
//! `Balancing` iterator `preprocess --balance W` runs its input through.
//!
//! The output is an Arrow IPC file in the input's schema, one record batch per input batch
//! (same sizes), written to a temporary name and renamed when complete: a bad window (batches of
//! different schemas, a missing column) writes nothing.

use std::collections::VecDeque;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use arrow_ipc::writer::FileWriter;
use sparsecore_prep::balance::{measure, BalanceReport, Balancer, Refinement, StackLoad};
use sparsecore_prep::io::{BatchReader, OutputFile};
use sparsecore_prep::{Config, Error, Result};

use super::error;
use super::outdir::clean_stale;
use super::stdio::outln;

#[derive(clap::Args)]
pub struct Args {
    /// Config JSON.
    #[arg(long)]
    config: PathBuf,
    /// Arrow IPC (file or stream) or Parquet input.
    #[arg(long)]
    input: PathBuf,
    /// Output Arrow IPC file: the same rows, reordered, one record batch per input batch.
    #[arg(long)]
    out: PathBuf,
    /// Balance windows of W consecutive batches (samples move between the window's batches).
    #[arg(long, default_value_t = 1, value_parser = parse_window)]
    window: usize,
    /// How far to search: `worst-cell` (the worst cell, then the worst buffer), `every-stack`
    /// (then also each stack's own worst cell: smaller tuned limits and buffers per stack, for
    /// more balancing work) or `unique-ids` (then also each stack's worst unique-ids cell, for
    /// the most work).
    #[arg(long, value_enum, default_value_t = Refine::WorstCell)]
    refine: Refine,
    /// Print one JSON object (the last line) instead of the summary (`required_buffer` per
    /// device, as the config's `suggested_coo_buffer_size_per_device`).
    #[arg(long)]
    json: bool,
}

/// The command line's names for [`Refinement`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Refine {
    WorstCell,
    EveryStack,
    UniqueIds,
}

impl From<Refine> for Refinement {
    fn from(r: Refine) -> Self {
        match r {
            Refine::WorstCell => Refinement::WorstCell,
            Refine::EveryStack => Refinement::EveryStack,
            Refine::UniqueIds => Refinement::UniqueIds,
        }
    }
}

impl Refine {
    /// The name `--refine` takes.
    pub fn name(self) -> &'static str {
        match self {
            Refine::WorstCell => "worst-cell",
            Refine::EveryStack => "every-stack",
            Refine::UniqueIds => "unique-ids",
        }
    }
}

/// Parses a window size (at least 1).
pub fn parse_window(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(w) if w >= 1 => Ok(w),
        _ => Err(format!("expected a window of at least 1 batch, got {s:?}")),
    }
}

/// Where each row of a balanced batch comes from, as (input record batch, row); `None` for a
/// batch whose window kept its input order. An error about a row of a balanced batch names
/// the input's row through it.
pub type Origin = Option<Vec<(usize, usize)>>;

/// Input batches, balanced window by window: yields `(input index, balanced batch, origin)`. Each
/// window holds `window` consecutive items of `inner` (the last may be shorter).
pub struct Balancing<I> {
    inner: I,
    config: Config,
    /// Made at the first window, so that a bad config is an item's error like any other.
    balancer: Option<Balancer>,
    window: usize,
    refinement: Refinement,
    input: PathBuf,
    ready: VecDeque<(usize, RecordBatch, Origin)>,
    failed: bool,
    /// Per-window reports, in order.
    pub reports: Vec<BalanceReport>,
    /// With [`Balancing::measuring`]: per window, the pipeline's worst cells before and after.
    pub measured: Vec<(Vec<StackLoad>, Vec<StackLoad>)>,
    measuring: bool,
}

impl<I: Iterator<Item = (usize, Result<RecordBatch>)>> Balancing<I> {
    pub fn new(
        inner: I,
        config: Config,
        window: usize,
        refinement: Refinement,
        input: &Path,
    ) -> Self {
        Balancing {
            inner,
            config,
            balancer: None,
            window: window.max(1),
            refinement,
            input: input.to_path_buf(),
            ready: VecDeque::new(),
            failed: false,
            reports: Vec::new(),
            measured: Vec::new(),
            measuring: false,
        }
    }

    /// Also runs the pipeline's statistics on every window before and after (for the
    /// `balance` command's report, which shows `max_unique_ids`; balancing's own report
    /// does not carry them).
    pub fn measuring(mut self) -> Self {
        self.measuring = true;
        self
    }

    fn fill(&mut self) -> Result<()> {
        // Not sized from `window`, which comes from the command line: a window larger than the
        // input holds only the input's batches.
        let (mut indices, mut batches) = (Vec::new(), Vec::new());
        while batches.len() < self.window {
            let Some((index, batch)) = self.inner.next() else {
                break;
            };
            indices.push(index);
            batches.push(batch?);
        }
        let (Some(&a), Some(&b)) = (indices.first(), indices.last()) else {
            return Ok(());
        };
        let context = |e: Error| {
            e.context(format!(
                "input {}, balancing record batches {a}..={b}",
                self.input.display()
            ))
        };
        let balancer = match &mut self.balancer {
            Some(balancer) => balancer,
            None => self.balancer.insert(
                Balancer::new(self.config.clone())
                    .map_err(context)?
                    .refinement(self.refinement),
            ),
        };
        let balanced = balancer.balance(&batches).map_err(context)?;
        if self.measuring {
            let before = measure(&self.config, &batches).map_err(context)?;
            let after = if balanced.report.reordered() {
                measure(&self.config, &balanced.batches).map_err(context)?
            } else {
                before.clone()
            };
            self.measured.push((before, after));
        }
        let origins: Vec<Origin> = if balanced.report.reordered() {
            balanced
                .permutation
                .iter()
                .map(|rows| Some(rows.iter().map(|r| (indices[r.batch], r.row)).collect()))
                .collect()
        } else {
            vec![None; indices.len()]
        };
        self.reports.push(balanced.report);
        self.ready.extend(
            indices
                .into_iter()
                .zip(balanced.batches)
                .zip(origins)
                .map(|((i, b), o)| (i, b, o)),
        );
        Ok(())
    }
}

impl<I: Iterator<Item = (usize, Result<RecordBatch>)>> Iterator for Balancing<I> {
    type Item = (usize, Result<RecordBatch>, Origin);

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        if self.ready.is_empty() {
            if let Err(e) = self.fill() {
                self.failed = true;
                return Some((0, Err(e), None));
            }
        }
        self.ready.pop_front().map(|(i, b, o)| (i, Ok(b), o))
    }
}

/// The context of an error about balanced batch `index`: where the row it names came from.
pub fn balanced_at(input: &Path, index: usize, origin: &Origin, e: &Error) -> String {
    let row = match e.root() {
        Error::IdOutOfRange { row, .. }
        | Error::InvalidWeight { row, .. }
        | Error::WeightsShape { row, .. } => Some(*row),
        _ => None,
    };
    match (origin, row) {
        (Some(rows), Some(r)) if r < rows.len() => {
            let (b, r0) = rows[r];
            format!("input {}, balanced record batch {index} (its sample row {r} is record batch {b}, row {r0} of the input)", input.display())
        }
        _ => format!("input {}, record batch {index}", input.display()),
    }
}

/// Per stack (in plan order), the worst before and after over all windows.
pub fn aggregate(
    reports: &[BalanceReport],
    measured: &[(Vec<StackLoad>, Vec<StackLoad>)],
) -> Vec<(String, StackLoad, StackLoad)> {
    let mut out: Vec<(String, StackLoad, StackLoad)> = Vec::new();
    let worse = |w: &mut StackLoad, l: &StackLoad| {
        w.max_ids_per_partition = w.max_ids_per_partition.max(l.max_ids_per_partition);
        w.max_unique_ids_per_partition = w
            .max_unique_ids_per_partition
            .max(l.max_unique_ids_per_partition);
        w.required_buffer = w.required_buffer.max(l.required_buffer);
    };
    for (r, (before, after)) in reports.iter().zip(measured) {
        for (k, name) in r.stacks.iter().enumerate() {
            let i = match out.iter().position(|(n, _, _)| n == name) {
                Some(i) => i,
                None => {
                    out.push((name.clone(), StackLoad::default(), StackLoad::default()));
                    out.len() - 1
                }
            };
            if let Some(b) = before.get(k) {
                worse(&mut out[i].1, b);
            }
            if let Some(a) = after.get(k) {
                worse(&mut out[i].2, a);
            }
        }
    }
    out
}

pub fn run(a: Args) -> error::Result<()> {
    let config = Config::from_path(&a.config)?;
    let reader = BatchReader::open(&a.input)?;
    let schema = reader.schema();
    clean_stale(&a.out, false);
    let out = OutputFile::new(&a.out)?;
    let arrow = |source| Error::Arrow {
        context: format!("writing {}", a.out.display()),
        source,
    };
    let mut batches = 0usize;
    let mut rows = 0usize;
    let mut reordered = 0usize;
    let mut reports = Vec::new();
    let mut measured = Vec::new();
    let write = || -> Result<()> {
        let mut writer =
            FileWriter::try_new(BufWriter::new(out.create()?), &schema).map_err(arrow)?;
        let mut it = Balancing::new(
            reader.enumerate(),
            config,
            a.window,
            a.refine.into(),
            &a.input,
        )
        .measuring();
        for (index, batch, _) in it.by_ref() {
            let batch = batch?;
            if batch.schema() != schema {
                return Err(Error::data(
                    format!("input {}, record batch {index}", a.input.display()),
                    "another schema than the file's",
                ));
            }
            writer.write(&batch).map_err(arrow)?;
            batches += 1;
            rows += batch.num_rows();
        }
        writer.finish().map_err(arrow)?;
        drop(writer);
        reordered = it.reports.iter().filter(|r| r.reordered()).count();
        reports = std::mem::take(&mut it.reports);
        measured = std::mem::take(&mut it.measured);
        Ok(())
    };
    // On an error the temporary goes with `out`: nothing is written.
    write()?;
    out.commit()?;
    let stacks = aggregate(&reports, &measured);
    // Why the input order was kept: per reason (in the order the reasons first occur), its
    // windows and the stacks it named.
    let mut kept: Vec<(&'static str, usize, Vec<&str>)> = Vec::new();
    for r in reports.iter().filter(|r| !r.reordered()) {
        let i = match kept
            .iter()
            .position(|(name, _, _)| *name == r.outcome.name())
        {
            Some(i) => i,
            None => {
                kept.push((r.outcome.name(), 0, Vec::new()));
                kept.len() - 1
            }
        };
        kept[i].1 += 1;
        if let Some(stack) = r.outcome.stack_index().and_then(|k| r.stacks.get(k)) {
            if !kept[i].2.contains(&stack.as_str()) {
                kept[i].2.push(stack);
            }
        }
    }
    if a.json {
        let load = |l: &StackLoad| {
            serde_json::json!({
                "max_ids_per_partition": l.max_ids_per_partition,
                "max_unique_ids_per_partition": l.max_unique_ids_per_partition,
                "required_buffer": l.required_buffer,
            })
        };
        let json = serde_json::json!({
            "window": a.window,
            "refine": a.refine.name(),
            "batches": batches,
            "rows": rows,
            "windows": reports.len(),
            "reordered_windows": reordered,
            "kept_windows": kept.iter().map(|(name, n, stacks)| (name.to_string(), serde_json::json!({"windows": n, "stacks": stacks}))).collect::<serde_json::Map<_, _>>(),
            "out": a.out.display().to_string(),
            "stacks": stacks.iter().map(|(name, b, af)| serde_json::json!({"name": name, "before": load(b), "after": load(af)})).collect::<Vec<_>>(),
        });
        outln!("{json}");
    } else {
        let why = kept
            .iter()
            .map(|(name, n, stacks)| {
                let stacks = if stacks.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", stacks.join(", "))
                };
                format!(", {n} kept: {}{stacks}", name.replace('_', " "))
            })
            .collect::<String>();
        outln!(
            "balanced {batches} batches ({rows} rows) in {} windows of {} ({reordered} reordered{why}) into {}",
            reports.len(),
            a.window,
            a.out.display()
        );
        for (name, b, af) in &stacks {
            outln!(
                "{name}: max_ids_per_partition {} -> {}, max_unique_ids_per_partition {} -> {}, required buffer {} -> {}",
                b.max_ids_per_partition,
                af.max_ids_per_partition,
                b.max_unique_ids_per_partition,
                af.max_unique_ids_per_partition,
                b.required_buffer,
                af.required_buffer
            );
        }
    }
    Ok(())
}
