//! `preprocess` and `stats`: stream a file through the pipeline, batch by batch.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arrow_array::{
    ArrayRef, FixedSizeListArray, Float32Array, Int32Array, RecordBatch, UInt64Array,
};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sparsecore_prep::balance::Refinement;
use sparsecore_prep::fdo::FdoStats;
use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::io::BatchReader;
use sparsecore_prep::{Config, ConfigItem, Error, Output, Preprocessor, Result, StackOutput};

use super::args::parse_shard;
use super::balance::{balanced_at, Origin};
use super::error::{self, io_err};
use super::outdir::{clean_stale, some_names, Staged};
use super::stdio::outln;
use super::table::{self, count_ids};

#[derive(clap::Args)]
pub struct Args {
    /// Config JSON (SPEC Part 1, section 1.1).
    #[arg(long)]
    config: PathBuf,
    /// Arrow IPC (file or stream) or Parquet input.
    #[arg(long)]
    input: PathBuf,
    /// Output directory: <stack>.arrow per stack and stats.json. It must not exist or be empty,
    /// unless --overwrite is given.
    #[arg(long)]
    out: PathBuf,
    /// Replace the outputs of an earlier run in --out (all at once, when this run succeeds;
    /// stack files the earlier run wrote and this one does not are removed).
    #[arg(long)]
    overwrite: bool,
    /// Process record batches i, i+N, ... only.
    #[arg(long, value_parser = parse_shard)]
    shard: Option<(usize, usize)>,
    #[arg(long, help = crate::args::threads_help())]
    threads: Option<usize>,
    /// Balance each window of W input batches (as `balance --window W`) before preprocessing it.
    #[arg(long, value_name = "W", value_parser = super::balance::parse_window)]
    balance: Option<usize>,
    /// With --balance: how far to search (as `balance --refine`).
    #[arg(long, value_enum, default_value_t = super::balance::Refine::WorstCell, requires = "balance")]
    balance_refine: super::balance::Refine,
}

#[derive(clap::Args)]
pub struct StatsArgs {
    /// Config JSON.
    #[arg(long)]
    config: PathBuf,
    /// Arrow IPC (file or stream) or Parquet input.
    #[arg(long)]
    input: PathBuf,
    /// Where to write the merged stats JSON (default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Process record batches i, i+N, ... only.
    #[arg(long, value_parser = parse_shard)]
    shard: Option<(usize, usize)>,
    #[arg(long, help = crate::args::threads_help())]
    threads: Option<usize>,
}

fn progress(total: Option<usize>) -> ProgressBar {
    let pb = match total {
        Some(n) => ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr()),
        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} batches, {msg} (ETA {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// One stack's output file, written into the staging directory until the run succeeds.
struct StackFile {
    /// `<stack>.arrow`.
    file_name: String,
    /// Where it will be (for messages).
    path: PathBuf,
    schema: SchemaRef,
    writer: FileWriter<BufWriter<File>>,
    rp: usize,
    c: usize,
}

impl StackFile {
    fn create(staging: &Path, out: &Path, so: &StackOutput) -> Result<Self> {
        let name = format!("{}.arrow", file_name(&so.name));
        let (staged, path) = (staging.join(&name), out.join(&name));
        let rp = so.row_pointers_per_device() as i32;
        let c = so.coo_buffer_size_per_device() as i32;
        let item = |t: DataType| Arc::new(Field::new_list_field(t, false));
        let schema = Arc::new(Schema::new(vec![
            Field::new("batch", DataType::UInt64, false),
            Field::new("device", DataType::Int32, false),
            Field::new(
                "row_pointers",
                DataType::FixedSizeList(item(DataType::Int32), rp),
                false,
            ),
            Field::new(
                "embedding_ids",
                DataType::FixedSizeList(item(DataType::Int32), c),
                false,
            ),
            Field::new(
                "sample_ids",
                DataType::FixedSizeList(item(DataType::Int32), c),
                false,
            ),
            Field::new(
                "gains",
                DataType::FixedSizeList(item(DataType::Float32), c),
                false,
            ),
        ]));
        let file =
            File::create(&staged).map_err(io_err(format!("creating {}", staged.display())))?;
        let writer =
            FileWriter::try_new(BufWriter::new(file), &schema).map_err(|source| Error::Arrow {
                context: format!("writing {}", path.display()),
                source,
            })?;
        Ok(StackFile {
            file_name: name,
            path,
            schema,
            writer,
            rp: rp as usize,
            c: c as usize,
        })
    }

    fn write(&mut self, batch_index: u64, so: &StackOutput) -> Result<()> {
        let arrow = |source| Error::Arrow {
            context: format!("writing {}", self.path.display()),
            source,
        };
        if so.row_pointers_per_device() != self.rp || so.coo_buffer_size_per_device() != self.c {
            return Err(Error::config(
                ConfigItem::Stack,
                &so.name,
                format!(
                    "buffer sizes changed between batches (writing {})",
                    self.path.display()
                ),
            ));
        }
        let l = so.local_devices();
        let fsl = |values: ArrayRef, width: usize, t: DataType| -> Result<ArrayRef> {
            Ok(Arc::new(
                FixedSizeListArray::try_new(
                    Arc::new(Field::new_list_field(t, false)),
                    width as i32,
                    values,
                    None,
                )
                .map_err(arrow)?,
            ))
        };
        let columns: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from(vec![batch_index; l])),
            Arc::new(Int32Array::from((0..l as i32).collect::<Vec<_>>())),
            fsl(
                Arc::new(Int32Array::from(so.row_pointers.clone())),
                self.rp,
                DataType::Int32,
            )?,
            fsl(
                Arc::new(Int32Array::from(so.embedding_ids.clone())),
                self.c,
                DataType::Int32,
            )?,
            fsl(
                Arc::new(Int32Array::from(so.sample_ids.clone())),
                self.c,
                DataType::Int32,
            )?,
            fsl(
                Arc::new(Float32Array::from(so.gains.clone())),
                self.c,
                DataType::Float32,
            )?,
        ];
        let batch = RecordBatch::try_new(self.schema.clone(), columns).map_err(arrow)?;
        self.writer.write(&batch).map_err(arrow)
    }

    /// Completes the file (in the staging directory).
    fn finish(mut self) -> Result<()> {
        self.writer.finish().map_err(|source| Error::Arrow {
            context: format!("writing {}", self.path.display()),
            source,
        })
    }
}

/// A stack name as a file name: anything but `[A-Za-z0-9._-]` becomes `_`.
fn file_name(stack: &str) -> String {
    stack
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The last plan, and the ids each of its stacks received over the whole file.
type PlanAndIds = (sparsecore_prep::Plan, Vec<u64>);

/// Streams the file (with `balance_window`, each window of that many selected batches balanced
/// first, as `balance --window W --refine R` does): calls `each(batch_index, prep, out, ids)` after every processed batch.
#[allow(clippy::too_many_arguments)] // one private helper behind `preprocess` and `stats`
fn stream(
    config: Config,
    config_path: &Path,
    input: &Path,
    shard: Option<(usize, usize)>,
    threads: Option<usize>,
    balance_window: Option<(usize, Refinement)>,
    stats_only: bool,
    mut each: impl FnMut(u64, &Preprocessor, &Output) -> Result<()>,
) -> Result<(FdoStats, Option<PlanAndIds>)> {
    let balance_config = balance_window.map(|_| config.clone());
    let mut builder = Preprocessor::builder(config);
    if let Some(t) = threads {
        builder = builder.threads(t);
    }
    let mut prep = builder
        .build()
        .map_err(|e| e.context(format!("config {}", config_path.display())))?;
    let reader = BatchReader::open(input)?;
    let at = |i: usize| format!("input {}, record batch {i}", input.display());
    let (i0, n) = shard.unwrap_or((0, 1));
    let total = reader.num_batches().map(|b| (b + n - 1 - i0) / n);
    let pb = progress(total);
    let start = Instant::now();
    let mut out = Output::new();
    let mut stats: Option<FdoStats> = None;
    let mut ids_per_stack: Vec<u64> = Vec::new();
    let mut all_ids = 0u64;
    let selected = reader.enumerate().filter(|(index, _)| index % n == i0);
    let batches: Box<dyn Iterator<Item = (usize, Result<RecordBatch>, Origin)>> =
        match (balance_window, balance_config) {
            (Some((w, r)), Some(c)) => {
                Box::new(super::balance::Balancing::new(selected, c, w, r, input))
            }
            _ => Box::new(selected.map(|(i, b)| (i, b, None))),
        };
    for (index, batch, origin) in batches {
        let batch = batch?;
        // A row named in a balanced batch is named where it is in the input too.
        let row_at = |e: Error| {
            let context = balanced_at(input, index, &origin, &e);
            e.context(context)
        };
        let features = features_from_record_batch(prep.config(), &batch).map_err(row_at)?;
        let inputs: Vec<&dyn SampleSource> =
            features.iter().map(|f| f as &dyn SampleSource).collect();
        let result = if stats_only {
            prep.run_stats(&inputs, &mut out)
        } else {
            prep.run(&inputs, &mut out)
        };
        result.map_err(row_at)?;
        let plan = prep.plan().expect("planned");
        let ids = count_ids(plan, &inputs);
        ids_per_stack.resize(ids.len(), 0);
        for (a, b) in ids_per_stack.iter_mut().zip(&ids) {
            *a += b;
        }
        all_ids += ids.iter().sum::<u64>();
        stats
            .get_or_insert_with(|| FdoStats::new(plan.layout))
            .record(plan, &out)
            .map_err(|e| e.context(at(index)))?;
        each(index as u64, &prep, &out).map_err(|e| e.context(at(index)))?;
        pb.inc(1);
        pb.set_message(format!(
            "{:.1} M ids/s",
            all_ids as f64 / start.elapsed().as_secs_f64().max(1e-9) / 1e6
        ));
    }
    pb.finish_and_clear();
    let plan = prep.plan().cloned();
    let stats = match (stats, &plan) {
        (Some(s), _) => s,
        (None, _) => FdoStats::new(sparsecore_prep::spec::DeviceLayout::new(
            prep.config().config.local_device_count,
            prep.config().config.global_device_count,
            prep.config().config.num_sc_per_device,
        )?),
    };
    Ok((stats, plan.map(|p| (p, ids_per_stack))))
}

fn summary(stats: &FdoStats, plan: &Option<PlanAndIds>, buffers: bool) {
    let Some((plan, ids)) = plan else {
        outln!("no record batch processed");
        return;
    };
    let per_stack: Vec<&sparsecore_prep::StackStats> =
        plan.stacks.iter().map(|s| &stats.stacks[&s.name]).collect();
    outln!("{} batches, {} ids", stats.batches, ids.iter().sum::<u64>());
    table::print(
        &table::rows(plan, &per_stack, ids, buffers),
        plan.layout.sc_per_device,
    );
}

pub fn run(a: Args) -> error::Result<()> {
    let config = Config::from_path(&a.config)?;
    // Before any work: refuses an --out it must not write into, and stages the outputs.
    let staged = Staged::prepare(&a.out, a.overwrite)?;
    let stale: Vec<String> = staged
        .stale_removed()
        .iter()
        .map(|p| p.display().to_string())
        .collect();

    let mut files: BTreeMap<String, StackFile> = BTreeMap::new();
    let (stats, plan) = stream(
        config,
        &a.config,
        &a.input,
        a.shard,
        a.threads,
        a.balance.map(|w| (w, a.balance_refine.into())),
        false,
        |index, _prep, out| {
            for so in &out.stacks {
                if !files.contains_key(&so.name) {
                    let f = StackFile::create(staged.dir(), &a.out, so)?;
                    if let Some((other, _)) = files.iter().find(|(_, g)| g.file_name == f.file_name)
                    {
                        return Err(Error::config(
                            ConfigItem::Stack,
                            &so.name,
                            format!(
                                "its output file {} would also be stack `{other}`'s",
                                f.path.display()
                            ),
                        ));
                    }
                    files.insert(so.name.clone(), f);
                }
                files
                    .get_mut(&so.name)
                    .expect("inserted")
                    .write(index, so)?;
            }
            Ok(())
        },
    )?;
    let mut names: Vec<String> = Vec::new();
    for (_, f) in std::mem::take(&mut files) {
        names.push(f.file_name.clone());
        f.finish()?;
    }
    names.push("stats.json".into());
    let stats_path = staged.dir().join("stats.json");
    std::fs::write(&stats_path, stats.to_json()).map_err(io_err(format!(
        "writing {}",
        a.out.join("stats.json").display()
    )))?;
    // Everything is complete in the staging directory; only now does it reach --out (and on an
    // error before this, dropping `staged` removes it).
    let committed = staged.commit()?;

    summary(&stats, &plan, true);
    outln!(
        "wrote {} files to {}: {}",
        names.len(),
        a.out.display(),
        names.join(", ")
    );
    if !committed.replaced.is_empty() || !committed.stale.is_empty() {
        let stale = match committed.stale.len() {
            0 => "none stale".to_string(),
            n => format!("removed {n} stale: {}", some_names(&committed.stale, 8)),
        };
        outln!(
            "replaced the {} files of the earlier run in {} ({stale})",
            committed.replaced.len() + committed.stale.len(),
            a.out.display()
        );
    }
    if !stale.is_empty() {
        outln!(
            "cleaned up {} temporaries of killed runs: {}",
            stale.len(),
            some_names(&stale, 8)
        );
    }
    Ok(())
}

pub fn run_stats(a: StatsArgs) -> error::Result<()> {
    let config = Config::from_path(&a.config)?;
    let (stats, plan) = stream(
        config,
        &a.config,
        &a.input,
        a.shard,
        a.threads,
        None,
        true,
        |_, _, _| Ok(()),
    )?;
    match &a.out {
        Some(path) => {
            clean_stale(path, false);
            stats.write(path)?;
            summary(&stats, &plan, false);
        }
        None => outln!("{}", stats.to_json()),
    }
    Ok(())
}
