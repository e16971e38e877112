//! `bess`: balanced entity sharding (the `sparsecore-bess` crate) on the command line.
//!
//! - `bess batches`: knowledge-graph triples (`head`, `relation`, `tail`) in, BESS batches laid
//!   out for SparseCores out (an Arrow IPC file, one record batch per step) with the config whose
//!   limits are the exact per-(SparseCore, partition) counts; `preprocess --config CFG --input
//!   OUT` then runs them with nothing dropped.
//! - `bess shard create` / `bess shard show`: a sharding as besskge's `Sharding.save` `.npz`, and
//!   back.
//!
//! Both files of `bess batches` are written to temporary names and renamed when complete. The
//! run ends with the per-partition load table (per local SparseCore slot: positives and
//! negatives per partition, against the config's limits) and, for the Rigid sampler, its
//! padding overhead.

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{Array, RecordBatch};
use arrow_ipc::writer::FileWriter;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sparsecore_bess::{
    seed_words, BessError, BessStream, Corruption, Sharding, StreamSampler, Triples,
};
use sparsecore_prep::io::{BatchReader, OutputFile};

use super::args::parse_layout;
use super::error::{CliError, ColumnProblem, Result, ShardingUse};
use super::outdir::{clean_stale, resolved, same_file};
use super::stdio::outln;

/// `--sampler`'s names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sampler {
    /// besskge's RandomShardedBatchSampler: with replacement inside every shard pair.
    Random,
    /// besskge's RigidShardedBatchSampler: every triple in turn, padded.
    Rigid,
}

/// `--corruption`'s names (besskge's `corruption_scheme`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CorruptionArg {
    /// Heads.
    H,
    /// Tails.
    T,
    /// Heads for half of each block, tails for the other half.
    Ht,
}

#[derive(clap::Subcommand)]
pub enum Command {
    /// Draw BESS batches from a triples file, laid out for SparseCores, and write them (Arrow
    /// IPC, one record batch per step) with the config whose limits are their exact counts.
    ///
    /// Each record batch holds R rows per local SparseCore (slice k is rows k·R .. (k+1)·R). In
    /// a slice, rows 0 .. T (T = n·ppp) are its triples: head, tail (one id each), relation and
    /// triple_mask. The negatives are one per row in rows 0 .. n·B·K of the same slice, beside
    /// the triples but not aligned with them: row r holds a negative drawn from shard
    /// r / (B·K), list (r / K) mod B, where K is --negatives and B is one list per triple (T),
    /// or with --flat-negatives one per slice (two with --corruption ht). R = max(T, n·B·K);
    /// past T (or n·B·K) the id lists are empty.
    Batches(BatchesArgs),
    /// Create a sharding (.npz, besskge's `Sharding.save` format) or show one.
    Shard {
        #[command(subcommand)]
        command: ShardCommand,
    },
}

#[derive(clap::Args)]
pub struct BatchesArgs {
    /// Triples: Arrow IPC or Parquet with Int32/Int64 columns head, relation, tail (global ids).
    #[arg(long)]
    triples: PathBuf,
    /// Number of entities E (entity ids are 0..E).
    #[arg(long)]
    entities: usize,
    /// Number of relation types (default: the largest relation id + 1).
    #[arg(long)]
    relations: Option<usize>,
    /// Device layout L/G/S; the sharding has N = G·S shards, one per SparseCore.
    #[arg(long, default_value = "1/1/4", value_parser = parse_layout)]
    layout: (usize, usize, usize),
    /// Which host this is (0 .. G/L): the batches hold its L·S SparseCores' slices.
    #[arg(long, default_value_t = 0)]
    host: usize,
    /// Positive triples per SparseCore per step (besskge's shard_bs), rounded up to a multiple
    /// of the n shards, as besskge does (at n = 4, 2 gives 4 and 6 gives 8), then down to an
    /// even number of triples per shard pair with --corruption ht.
    #[arg(long)]
    shard_batch_size: usize,
    /// Negatives per shard per list, K (0: no negatives). One list per triple, or per slice
    /// with --flat-negatives; one negative per output row (see `bess batches --help`).
    #[arg(long, default_value_t = 0)]
    negatives: usize,
    /// Batch sampler: random (with replacement) or rigid (every triple in turn, padded).
    #[arg(long, value_enum, default_value_t = Sampler::Random)]
    sampler: Sampler,
    /// Rigid only: shuffle the positions every epoch (our seeded generator, not besskge's).
    #[arg(long)]
    shuffle: bool,
    /// Corruption scheme of the negatives: h, t or ht.
    #[arg(long, value_enum, default_value_t = CorruptionArg::T)]
    corruption: CorruptionArg,
    /// One negative list per SparseCore slice (and side) instead of one per triple.
    #[arg(long)]
    flat_negatives: bool,
    /// Append inverse triples (t, r + R, h).
    #[arg(long)]
    inverse_triples: bool,
    /// Reuse a sharding (.npz of `bess shard create` or besskge's `Sharding.save`) instead of
    /// creating one from --seed.
    #[arg(long)]
    sharding: Option<PathBuf>,
    /// Embedding dimension of the entity table in the config.
    #[arg(long, default_value_t = 16)]
    embedding_dim: usize,
    /// Seed of the sharding, the batch sampler and the negative sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Steps to draw, at least 1 (default: one epoch).
    #[arg(long)]
    steps: Option<usize>,
    /// Refuse a configuration whose step needs more than this many bytes (its columns and the
    /// samplers' scratch), before anything is drawn; default: only what the allocator refuses.
    #[arg(long, value_name = "BYTES")]
    max_step_bytes: Option<usize>,
    /// Arrow IPC file to write.
    #[arg(long)]
    out: PathBuf,
    /// Config JSON to write.
    #[arg(long)]
    config_out: PathBuf,
}

#[derive(clap::Subcommand)]
pub enum ShardCommand {
    /// Shard E entities randomly into N equal shards (besskge's `Sharding.create`) and write
    /// the sharding as .npz.
    Create {
        /// Number of entities E.
        #[arg(long)]
        entities: usize,
        /// Number of shards N (or give --layout: N = G·S).
        #[arg(long, conflicts_with = "layout")]
        shards: Option<usize>,
        /// Device layout L/G/S: one shard per SparseCore.
        #[arg(long, value_parser = parse_layout)]
        layout: Option<(usize, usize, usize)>,
        /// Seed (numpy's default_rng(seed), as besskge).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Entity types by global id ranges: the first id of each type, starting with 0
        /// (e.g. 0,100,250).
        #[arg(long, value_delimiter = ',')]
        type_offsets: Option<Vec<i64>>,
        /// The .npz file to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Read a sharding .npz (ours or besskge's) and print its shard counts.
    Show {
        /// The .npz file.
        file: PathBuf,
    },
}

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Batches(a) => batches(a),
        Command::Shard {
            command:
                ShardCommand::Create {
                    entities,
                    shards,
                    layout,
                    seed,
                    type_offsets,
                    out,
                },
        } => {
            let n = match (shards, layout) {
                (Some(n), _) => n,
                (None, Some((_, g, s))) => g * s,
                (None, None) => {
                    return Err(CliError::MissingArgument {
                        command: "bess shard create",
                        choices: "--shards N or --layout L/G/S",
                    })
                }
            };
            let sharding = Sharding::create(
                entities,
                n,
                &seed_words(u128::from(seed)),
                type_offsets.as_deref(),
            )
            .map_err(|source| CliError::CreateSharding {
                source: Box::new(source),
            })?;
            clean_stale(&out, false);
            sharding
                .save_npz(&out)
                .map_err(|source| CliError::ShardingFile {
                    action: ShardingUse::Write,
                    path: out.clone(),
                    source: Box::new(source),
                })?;
            outln!(
                "wrote {} ({} entities, seed {seed})",
                out.display(),
                entities
            );
            print_sharding(&sharding);
            Ok(())
        }
        Command::Shard {
            command: ShardCommand::Show { file },
        } => {
            let sharding = Sharding::load_npz(&file).map_err(|source| CliError::ShardingFile {
                action: ShardingUse::Read,
                path: file.clone(),
                source: Box::new(source),
            })?;
            outln!("{}", file.display());
            print_sharding(&sharding);
            Ok(())
        }
    }
}

fn print_sharding(sh: &Sharding) {
    outln!(
        "shards {}, entities {}, slots per shard {}",
        sh.n_shard,
        sh.n_entity(),
        sh.max_entity_per_shard()
    );
    let counts: Vec<String> = sh.shard_counts.iter().map(i64::to_string).collect();
    outln!("entities per shard: {}", counts.join(" "));
    if let Some(types) = &sh.entity_type_counts {
        for (s, row) in types.outer_iter().enumerate() {
            let row: Vec<String> = row.iter().map(i64::to_string).collect();
            outln!("shard {s}: entities per type: {}", row.join(" "));
        }
    }
}

/// Reads every record batch of the triples file into one set of triples.
fn read_triples(path: &Path) -> Result<Triples> {
    let file = |source| CliError::TriplesFile {
        path: path.to_path_buf(),
        source,
    };
    let reader = BatchReader::open(path).map_err(file)?;
    let (mut head, mut relation, mut tail) = (Vec::new(), Vec::new(), Vec::new());
    for (i, batch) in reader.enumerate() {
        let batch = batch.map_err(file)?;
        let rows = head.len();
        let t = Triples::from_record_batch(&batch).map_err(|source| CliError::TriplesBatch {
            path: path.to_path_buf(),
            batch: i,
            rows: rows..rows + batch.num_rows(),
            source: Box::new(source),
        })?;
        head.extend(t.head);
        relation.extend(t.relation);
        tail.extend(t.tail);
    }
    if head.is_empty() {
        return Err(CliError::NoTriples {
            path: path.to_path_buf(),
        });
    }
    Triples::new(head, relation, tail).map_err(|source| CliError::Triples {
        path: path.to_path_buf(),
        source: Box::new(source),
    })
}

/// Per (local SparseCore slot, partition): the fewest and most ids over the steps.
struct Loads {
    pos_min: Vec<Vec<usize>>,
    pos_max: Vec<Vec<usize>>,
    neg_min: Vec<Vec<usize>>,
    neg_max: Vec<Vec<usize>>,
    /// Most ids (positives + negatives) in one cell of one step, per slot.
    total_max: Vec<usize>,
    /// Triples drawn (rows with a head) and of those Rigid's padding (mask false).
    drawn: u64,
    padding: u64,
}

impl Loads {
    fn new(slots: usize, n: usize) -> Self {
        Loads {
            pos_min: vec![vec![usize::MAX; n]; slots],
            pos_max: vec![vec![0; n]; slots],
            neg_min: vec![vec![usize::MAX; n]; slots],
            neg_max: vec![vec![0; n]; slots],
            total_max: vec![0; slots],
            drawn: 0,
            padding: 0,
        }
    }

    /// Counts one step's record batch: slot `k` is rows `k·R .. (k+1)·R`.
    fn add(
        &mut self,
        rb: &RecordBatch,
        rows_per_slot: usize,
        partition_of: impl Fn(i64) -> usize,
    ) -> Result<()> {
        let (slots, n) = (self.pos_max.len(), self.pos_max.first().map_or(0, Vec::len));
        let mut pos = vec![vec![0usize; n]; slots];
        let mut neg = vec![vec![0usize; n]; slots];
        let count = |name: &str, into: &mut Vec<Vec<usize>>| -> Result<()> {
            let Some(col) = rb.column_by_name(name) else {
                return Ok(());
            };
            let column = |reason| CliError::Column {
                column: name.to_string(),
                reason,
            };
            let list = col
                .as_list_opt::<i32>()
                .ok_or_else(|| column(ColumnProblem::NotAList))?;
            let values = list
                .values()
                .as_primitive_opt::<Int64Type>()
                .ok_or_else(|| column(ColumnProblem::NotInt64))?;
            let offsets = list.value_offsets();
            for row in 0..list.len() {
                let slot = row / rows_per_slot;
                for v in offsets[row]..offsets[row + 1] {
                    into[slot][partition_of(values.value(v as usize))] += 1;
                }
            }
            Ok(())
        };
        count(sparsecore_bess::stream::HEAD, &mut pos)?;
        count(sparsecore_bess::stream::TAIL, &mut pos)?;
        count(sparsecore_bess::stream::NEGATIVE, &mut neg)?;
        for k in 0..slots {
            for p in 0..n {
                self.pos_min[k][p] = self.pos_min[k][p].min(pos[k][p]);
                self.pos_max[k][p] = self.pos_max[k][p].max(pos[k][p]);
                self.neg_min[k][p] = self.neg_min[k][p].min(neg[k][p]);
                self.neg_max[k][p] = self.neg_max[k][p].max(neg[k][p]);
                self.total_max[k] = self.total_max[k].max(pos[k][p] + neg[k][p]);
            }
        }
        if let (Some(head), Some(mask)) = (
            rb.column_by_name(sparsecore_bess::stream::HEAD),
            rb.column_by_name("triple_mask"),
        ) {
            let (head, mask) = (head.as_list::<i32>(), mask.as_boolean());
            for row in 0..head.len() {
                if head.value_length(row) > 0 {
                    self.drawn += 1;
                    if mask.is_valid(row) && !mask.value(row) {
                        self.padding += 1;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `a` or `a..b`.
fn range(lo: usize, hi: usize) -> String {
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}..{hi}")
    }
}

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

fn batches(a: BatchesArgs) -> Result<()> {
    let (l, g, s) = a.layout;
    // Checked before anything is read or written: both outputs go through a temporary next to
    // them, and the same file twice would end up holding the config alone.
    if same_file(&a.out, &a.config_out) {
        return Err(CliError::SameFile {
            out: a.out.clone(),
            config_out: a.config_out.clone(),
            resolved: resolved(&a.out),
        });
    }
    if a.steps == Some(0) {
        return Err(CliError::Argument {
            flag: "--steps",
            value: "0".into(),
            reason: "steps must be at least 1 (leave --steps out for one epoch)".into(),
        });
    }
    let corruption = match a.corruption {
        CorruptionArg::H => Corruption::H,
        CorruptionArg::T => Corruption::T,
        CorruptionArg::Ht => Corruption::Ht,
    };
    let sampler = match a.sampler {
        Sampler::Rigid => StreamSampler::Rigid { shuffle: a.shuffle },
        Sampler::Random if a.shuffle => {
            return Err(CliError::OnlyWith {
                flag: "--shuffle",
                requires: "--sampler rigid",
            })
        }
        Sampler::Random => StreamSampler::Random,
    };
    let pb = progress(None, "{spinner} [{elapsed_precise}] {wide_msg}");
    pb.set_message(format!(
        "reading {} and partitioning the triples",
        a.triples.display()
    ));
    let triples = read_triples(&a.triples)?;
    let n_triples = triples.len();
    let mut builder = BessStream::builder()
        .triples(triples)
        .n_entity(a.entities)
        .devices(l, g, s)
        .host(a.host)
        .shard_batch_size(a.shard_batch_size)
        .negatives(a.negatives)
        .corruption(corruption)
        .flat_negatives(a.flat_negatives)
        .sampler(sampler)
        .embedding_dim(a.embedding_dim)
        .inverse_triples(a.inverse_triples)
        .seed(a.seed);
    if let Some(n) = a.relations {
        builder = builder.n_relation(n);
    }
    if let Some(steps) = a.steps {
        builder = builder.steps(steps);
    }
    if let Some(bytes) = a.max_step_bytes {
        builder = builder.max_step_bytes(bytes);
    }
    if let Some(path) = &a.sharding {
        let sh = Sharding::load_npz(path).map_err(|source| CliError::ShardingFile {
            action: ShardingUse::Batches,
            path: path.clone(),
            source: Box::new(source),
        })?;
        builder = builder.sharding(Arc::new(sh));
    }
    let triples_err = |source| CliError::Triples {
        path: a.triples.clone(),
        source: Box::new(source),
    };
    let mut stream = builder.build().map_err(|e| match (e, a.max_step_bytes) {
        (BessError::TooLarge { what, bytes, .. }, Some(cap)) if bytes > cap as u128 => {
            CliError::StepTooLarge { cap, what, bytes }
        }
        (e, _) => triples_err(e),
    })?;
    pb.finish_and_clear();

    let counts = *stream.counts();
    let layout = *stream.layout();
    let (n, slots) = (layout.num_sparsecores(), layout.local_sparsecores());
    let steps = stream.steps();
    let schema = stream.schema().clone();
    let padding_fraction = matches!(sampler, StreamSampler::Rigid { .. })
        .then(|| stream.batch_sampler().rigid_padding_fraction());
    let config_json = stream.config().to_json();

    clean_stale(&a.out, false);
    clean_stale(&a.config_out, false);
    // Both files are written whole or not at all, and only once both are complete.
    let out = OutputFile::new(&a.out)?;
    let config_out = OutputFile::new(&a.config_out)?;
    let pb = progress(Some(steps as u64), "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps written to {wide_msg} (ETA {eta})");
    pb.set_message(a.out.display().to_string());
    let mut loads = Loads::new(slots, n);
    let mut rows = 0u64;
    let mut write = || -> Result<()> {
        let arrow = |source| CliError::WriteArrow {
            path: a.out.clone(),
            source,
        };
        let file = out.create()?;
        let mut writer = FileWriter::try_new(BufWriter::new(file), &schema).map_err(arrow)?;
        for batch in stream.by_ref() {
            let batch = batch.map_err(triples_err)?;
            loads.add(&batch.record_batch, counts.rows_per_sparsecore, |id| {
                layout.partition_of(id)
            })?;
            rows += batch.record_batch.num_rows() as u64;
            writer.write(&batch.record_batch).map_err(arrow)?;
            pb.inc(1);
        }
        writer.finish().map_err(arrow)?;
        std::fs::write(config_out.path(), &config_json).map_err(|source| CliError::Write {
            path: config_out.path().to_path_buf(),
            source,
        })
    };
    let written = write();
    pb.finish_and_clear();
    written?;
    out.commit()?;
    config_out.commit()?;

    outln!(
        "wrote {steps} steps ({rows} rows, {} per SparseCore slice) of {n_triples} triples to {} and the config to {}",
        counts.rows_per_sparsecore,
        a.out.display(),
        a.config_out.display()
    );
    outln!(
        "layout {l}/{g}/{s}, host {}: {n} shards, ppp {} triples per shard-pair block per step, COO buffer {} per device",
        a.host,
        counts.positive_per_partition,
        counts.coo_buffer_size_per_device
    );
    print_loads(&loads, &counts, n, |k| layout.global_sparsecore(k), steps);
    if let Some(f) = padding_fraction {
        outln!(
            "rigid padding: {:.2}% of an epoch's positions pad the shorter shard pairs; {} of the {} triples drawn here were padding ({:.2}%)",
            100.0 * f,
            loads.padding,
            loads.drawn,
            if loads.drawn == 0 { 0.0 } else { 100.0 * loads.padding as f64 / loads.drawn as f64 }
        );
    }
    Ok(())
}

/// The per-partition load table: per local SparseCore slot, positives and negatives per
/// partition over the steps, against the config's limits.
fn print_loads(
    loads: &Loads,
    c: &sparsecore_bess::CellCounts,
    n: usize,
    global: impl Fn(usize) -> usize,
    steps: usize,
) {
    outln!(
        "per-partition load over {steps} steps (limits: positives {}, negatives {}, max_ids_per_partition {})",
        c.positive_ids_per_partition,
        c.negative_ids_per_partition,
        c.max_ids_per_partition
    );
    let detailed = n <= 8;
    let mut header = format!(
        "{:>4} {:>4} {:>12} {:>12} {:>13} {:>6}",
        "slot", "sc", "positives", "negatives", "max ids/lim", "ok"
    );
    if detailed {
        for p in 0..n {
            header.push_str(&format!(" {:>11}", format!("p{p} pos+neg")));
        }
    }
    outln!("{header}");
    let mut over = 0;
    for k in 0..loads.pos_max.len() {
        let lo = |v: &[usize]| {
            v.iter()
                .copied()
                .min()
                .unwrap_or(0)
                .min(v.iter().copied().max().unwrap_or(0))
        };
        let hi = |v: &[usize]| v.iter().copied().max().unwrap_or(0);
        let (pmin, pmax) = (lo(&loads.pos_min[k]), hi(&loads.pos_max[k]));
        let (nmin, nmax) = (lo(&loads.neg_min[k]), hi(&loads.neg_max[k]));
        let ok = loads.total_max[k] <= c.max_ids_per_partition
            && pmax <= c.positive_ids_per_partition
            && nmax <= c.negative_ids_per_partition;
        if !ok {
            over += 1;
        }
        let mut line = format!(
            "{:>4} {:>4} {:>12} {:>12} {:>13} {:>6}",
            k,
            global(k),
            range(pmin, pmax),
            range(nmin, nmax),
            format!("{}/{}", loads.total_max[k], c.max_ids_per_partition),
            if ok { "yes" } else { "OVER" }
        );
        if detailed {
            for p in 0..n {
                line.push_str(&format!(
                    " {:>11}",
                    format!("{}+{}", loads.pos_max[k][p], loads.neg_max[k][p])
                ));
            }
        }
        outln!("{line}");
    }
    if over > 0 {
        outln!("{over} slots exceed the config's limits");
    }
}
