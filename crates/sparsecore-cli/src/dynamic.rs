//! `dynamic load`: drive a dynamic table (in memory or in Redis) with a deterministic stream of
//! lookups and updates, and report lookups/s and updates/s. Several processes running it with
//! different `--worker` indices against one Redis table are a multi-worker load test whose
//! result any process can replay (every batch is a pure function of the seed and its id).

use std::time::{Duration, Instant};

use sparsecore_kernel::dynamic::{
    DynamicTable, DynamicTableSpec, Initializer, LoadStream, MemoryTable,
};
use sparsecore_kernel::Optimizer;
use sparsecore_kernel::{KernelError, Result};

use super::error;
use super::stdio::outln;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Run `--batches` batches of lookups and tagged updates against a table and print one
    /// JSON line with the counts and rates. Batch `i` of worker `w` has update id `w·2³² + i`.
    Load(LoadArgs),
}

/// `--backend`'s names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// In this process only.
    Memory,
    /// A Redis server, shared by every worker.
    Redis,
}

#[derive(clap::Args)]
pub struct LoadArgs {
    /// `memory` (this process only) or `redis`.
    #[arg(long, value_enum, default_value_t = Backend::Memory)]
    backend: Backend,
    /// Redis URL (with `--backend redis`).
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    url: String,
    /// Key-name prefix in Redis.
    #[arg(long, default_value = "sparsecore")]
    namespace: String,
    /// Table name.
    #[arg(long, default_value = "load")]
    table: String,
    /// Row width.
    #[arg(long, default_value_t = 16)]
    dim: usize,
    /// sgd, adagrad or adam.
    #[arg(long, default_value = "adagrad")]
    optimizer: String,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    /// Rows start uniform in [-scale, scale).
    #[arg(long, default_value_t = 0.05)]
    init_scale: f32,
    /// This worker's index (the high half of its update ids).
    #[arg(long, default_value_t = 0)]
    worker: u32,
    /// Batches to run.
    #[arg(long, default_value_t = 100)]
    batches: u32,
    /// Distinct keys updated per batch.
    #[arg(long, default_value_t = 512)]
    keys_per_batch: usize,
    /// Raw ints the update keys are drawn from (smaller means more overlap between batches).
    #[arg(long, default_value_t = 100_000)]
    key_space: u64,
    /// Extra keys only looked up per batch.
    #[arg(long, default_value_t = 512)]
    lookups_per_batch: usize,
    /// Seed of the key stream and of the initializer.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Redis connect/read/write timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

/// The optimizer named on the command line.
pub fn optimizer(name: &str, lr: f32) -> Result<Optimizer> {
    match name {
        "sgd" => Ok(Optimizer::Sgd { lr }),
        "adagrad" => Ok(Optimizer::Adagrad { lr }),
        "adam" => Ok(Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 0,
        }),
        _ => Err(KernelError::parameter(
            "optimizer",
            name,
            "expected sgd, adagrad or adam",
        )),
    }
}

pub fn run(command: Command) -> error::Result<()> {
    match command {
        Command::Load(a) => Ok(load(a)?),
    }
}

fn load(a: LoadArgs) -> Result<()> {
    let opt = optimizer(&a.optimizer, a.lr)?;
    let spec = DynamicTableSpec::new(
        &a.table,
        a.dim,
        &opt,
        Initializer::Uniform {
            scale: a.init_scale,
            seed: a.seed,
        },
    )?;
    let stream = LoadStream {
        seed: a.seed,
        keys_per_batch: a.keys_per_batch,
        key_space: a.key_space,
        lookups_per_batch: a.lookups_per_batch,
        dim: a.dim,
    };
    stream.validate()?;
    let table: Box<dyn DynamicTable> = match a.backend {
        Backend::Memory => Box::new(MemoryTable::new(spec)),
        Backend::Redis => {
            let mut config = sparsecore_kernel::dynamic::RedisConfig::new(&a.url);
            config.namespace = a.namespace.clone();
            config.connect_timeout = Duration::from_millis(a.timeout_ms);
            config.io_timeout = Duration::from_millis(a.timeout_ms);
            Box::new(sparsecore_kernel::dynamic::RedisTable::open(spec, config)?)
        }
    };
    let (mut lookup_time, mut update_time) = (Duration::ZERO, Duration::ZERO);
    let (mut looked_up, mut updated, mut applied, mut already) = (0u64, 0u64, 0u64, 0u64);
    let mut rows = Vec::new();
    for i in 0..a.batches {
        let id = (a.worker as u64) << 32 | i as u64;
        let lookups = stream.lookups(id);
        let (keys, grads) = stream.update(id);
        // The training step's lookups: the batch's updated keys and its lookup-only keys.
        let all: Vec<u64> = keys.iter().chain(&lookups).copied().collect();
        rows.resize(all.len() * a.dim, 0.0);
        let t = Instant::now();
        table
            .get_or_init(&all, &mut rows)
            .map_err(|e| e.context(format!("batch {i} (update id {id})")))?;
        lookup_time += t.elapsed();
        let t = Instant::now();
        match table
            .apply_update(Some(id), &keys, &grads, &opt)
            .map_err(|e| e.context(format!("batch {i} (update id {id})")))?
        {
            sparsecore_kernel::dynamic::Applied::Now => applied += 1,
            sparsecore_kernel::dynamic::Applied::Already => already += 1,
        }
        update_time += t.elapsed();
        looked_up += all.len() as u64;
        updated += keys.len() as u64;
    }
    let rate = |n: u64, d: Duration| {
        if d.is_zero() {
            0.0
        } else {
            n as f64 / d.as_secs_f64()
        }
    };
    let line = serde_json::json!({
        "backend": match a.backend {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
        },
        "worker": a.worker,
        "batches": a.batches,
        "applied": applied,
        "already_applied": already,
        "keys_looked_up": looked_up,
        "keys_updated": updated,
        "lookup_seconds": lookup_time.as_secs_f64(),
        "update_seconds": update_time.as_secs_f64(),
        "lookups_per_s": rate(looked_up, lookup_time),
        "updates_per_s": rate(updated, update_time),
    });
    outln!("{line}");
    Ok(())
}
