//! Deterministic synthetic workloads: the five profiles of `../shared/peer/make_workload.py`
//! (same vocabularies, valency and id distributions; our own random stream), as Arrow record
//! batches plus a config whose limits are exactly what the batches need.
//!
//! | profile | tables / features | ids per sample | ids |
//! |---|---|---|---|
//! | `criteo` | 26 features, one table each, vocab log-spaced 1e3..1e7, dim 16 | uniform 1..=1 + i % 5 | Zipf(1.1) ranks, scattered |
//! | `long` | 4 features over `items` (1e6, two features), `cats` (1e4), `queries` (1e7), dim 32 | exactly 100 | as criteo |
//! | `large-vocab` | 20 features on `table_0`, vocab 1e8 | lognormal(1.5, 1.9), ≥ 1 | p = 0.4243 Zipf(q = 1.00278), else uniform |
//! | `high-multivalency` | 1 feature, vocab 33 | lognormal(5.7, 0.2) | p = 0.5 Zipf, else uniform |
//! | `moderate-multivalency` | 5 features, vocab 1000, mean | lognormal(3.9, 0.3) | p = 0.5 Zipf, else uniform |
//!
//! Weights, when asked for, are k/16 for k uniform in 1..=64 (exact in f32 and in decimal), in a
//! column `<feature>__w`.
//!
//! With `raw_keys`, each id is written as a Criteo-style key instead: 8 lowercase hex digits of
//! `(id · 0x9E3779B1 mod 2³²) xor 0x5bd1e995·(feature + 1)` (a bijection on 32-bit ids, so
//! distinct ids stay distinct keys), in a `List<Utf8>` column, and every feature declares
//! `"hash": {"seed": <feature index>}`. The config's limits are measured on the hashed ids.
//!
//! With `minibatching: Some(k)`, `enable_minibatching` is on and the limits are the measured ones
//! over k: under exact limits no batch needs a split, so the bucketed pass would never run.

use std::str::FromStr;
use std::sync::Arc;

use arrow_array::{
    ArrayRef, Float32Array, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Normal, Zipf};

use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::spec::HashConfig;
use sparsecore_prep::spec::{
    Config, FeatureConfig, Options, StackLimits, Stacking, TableConfig, MAX_MINIBATCHING_BUCKETS,
};
use sparsecore_prep::Output;
use sparsecore_prep::Preprocessor;
use sparsecore_prep::{Error, Result};

/// A named workload shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// 26 one-table features, small valency, skewed ids over log-spaced vocabularies.
    Criteo,
    /// 4 features of exactly 100 ids, two sharing a table.
    Long,
    /// The reference benchmark's large-vocabulary profile (1e8 rows, heavy-tailed valency).
    LargeVocab,
    /// The reference benchmark's high-multivalency profile (~305 ids per sample over 33 rows).
    HighMultivalency,
    /// The reference benchmark's moderate-multivalency profile (~52 ids per sample, mean).
    ModerateMultivalency,
}

impl Profile {
    /// Every profile, in documentation order.
    pub const ALL: [Profile; 5] = [
        Profile::Criteo,
        Profile::Long,
        Profile::LargeVocab,
        Profile::HighMultivalency,
        Profile::ModerateMultivalency,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Criteo => "criteo",
            Profile::Long => "long",
            Profile::LargeVocab => "large-vocab",
            Profile::HighMultivalency => "high-multivalency",
            Profile::ModerateMultivalency => "moderate-multivalency",
        }
    }

    /// Default samples per batch: about 5M ids at most, like the reference's tools.
    pub fn default_batch_size(self) -> usize {
        match self {
            Profile::Criteo => 16384,
            Profile::Long => 8192,
            Profile::LargeVocab => 8192,
            Profile::HighMultivalency => 16384,
            Profile::ModerateMultivalency => 16384,
        }
    }
}

impl FromStr for Profile {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::option(
                "profile",
                s,
                "expected criteo, long, large-vocab, high-multivalency or moderate-multivalency",
            )
            })
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    /// The profile.
    pub profile: Profile,
    /// Samples per record batch (the local batch).
    pub batch_size: usize,
    /// Record batches.
    pub num_batches: usize,
    /// L, G, S.
    pub layout: (usize, usize, usize),
    /// Whether to add weights columns.
    pub weights: bool,
    /// Random seed.
    pub seed: u64,
    /// Stacking mode of the config.
    pub stacking: Stacking,
    /// Ids as Int32 instead of Int64.
    pub int32_ids: bool,
    /// Criteo-style hex string keys (`List<Utf8>`) on hashed features instead of ids.
    pub raw_keys: bool,
    /// `Some(k)`: minibatching on, under each table's measured limits divided by k (rounded up),
    /// so that k ≥ 2 makes the busiest SparseCores split their batch. Too large a k puts a single
    /// bucket over a limit, which is `Error::LimitExceeded` at run time, not here: only running
    /// the batches knows their buckets.
    pub minibatching: Option<u64>,
}

impl WorkloadSpec {
    /// The profile's defaults: its batch size, 1 batch, layout 1/1/4, no weights, seed 20240611.
    pub fn new(profile: Profile) -> Self {
        WorkloadSpec {
            profile,
            batch_size: profile.default_batch_size(),
            num_batches: 1,
            layout: (1, 1, 4),
            weights: false,
            seed: 20240611,
            stacking: Stacking::Feature,
            int32_ids: false,
            raw_keys: false,
            minibatching: None,
        }
    }
}

/// A generated workload: the config (with exact limits) and the batches.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Config in the SPEC Part 1 schema.
    pub config: Config,
    /// Schema of every batch.
    pub schema: SchemaRef,
    /// The record batches.
    pub batches: Vec<RecordBatch>,
}

impl Workload {
    /// Ids over all batches and features (duplicates included).
    pub fn total_ids(&self) -> u64 {
        self.batches
            .iter()
            .map(|b| {
                features_from_record_batch(&self.config, b)
                    .map(|fs| fs.iter().map(|f| f.view().num_ids() as u64).sum::<u64>())
                    .unwrap_or(0)
            })
            .sum()
    }
}

/// How one feature draws its data.
struct FeatureGen {
    name: String,
    table: usize,
    lengths: Lengths,
    ids: IdDist,
}

enum Lengths {
    Uniform(usize, usize),
    LogNormal(f64, f64),
}

enum IdDist {
    /// Zipf(1.1) ranks in [0, vocab), scattered by a multiplicative hash.
    ScatteredZipf { vocab: u64, zipf: Zipf<f64> },
    /// With probability `p`, a Zipf(q) draw in [0, vocab); otherwise uniform.
    Skewed { vocab: u64, p: f64, zipf: Zipf<f64> },
}

const SCATTER: u64 = 2654435761;

impl IdDist {
    fn scattered(vocab: u64) -> Self {
        IdDist::ScatteredZipf {
            vocab,
            zipf: Zipf::new(vocab as f64, 1.1).expect("valid Zipf"),
        }
    }
    fn skewed(vocab: u64, p: f64) -> Self {
        IdDist::Skewed {
            vocab,
            p,
            zipf: Zipf::new(vocab as f64, 1.00278).expect("valid Zipf"),
        }
    }
    fn draw(&self, rng: &mut StdRng) -> i64 {
        match self {
            IdDist::ScatteredZipf { vocab, zipf } => {
                let rank = zipf.sample(rng) as u64 - 1;
                ((rank.wrapping_mul(SCATTER) + 12345) % vocab) as i64
            }
            IdDist::Skewed { vocab, p, zipf } => {
                if rng.random::<f64>() < *p {
                    zipf.sample(rng) as i64 - 1
                } else {
                    rng.random_range(0..*vocab) as i64
                }
            }
        }
    }
}

fn table(name: &str, vocab: u64, dim: u64, combiner: &str) -> TableConfig {
    TableConfig {
        name: name.to_string(),
        vocabulary_size: vocab,
        embedding_dim: dim,
        combiner: combiner.to_string(),
        max_ids_per_partition: 1,
        max_unique_ids_per_partition: 1,
        suggested_coo_buffer_size_per_device: None,
    }
}

fn build(profile: Profile) -> (Vec<TableConfig>, Vec<FeatureGen>) {
    match profile {
        Profile::Criteo => {
            let mut tables = Vec::new();
            let mut feats = Vec::new();
            for i in 0..26usize {
                let vocab = 10f64.powf(3.0 + 4.0 * i as f64 / 25.0).round() as u64;
                tables.push(table(&format!("t{i:02}"), vocab, 16, "sum"));
                feats.push(FeatureGen {
                    name: format!("f{i:02}"),
                    table: i,
                    lengths: Lengths::Uniform(1, 1 + i % 5),
                    ids: IdDist::scattered(vocab),
                });
            }
            (tables, feats)
        }
        Profile::Long => {
            let tables = vec![
                table("items", 1_000_000, 32, "sum"),
                table("cats", 10_000, 32, "sum"),
                table("queries", 10_000_000, 32, "sum"),
            ];
            let feats = [0usize, 0, 1, 2]
                .iter()
                .enumerate()
                .map(|(i, &t)| FeatureGen {
                    name: format!("l{i}"),
                    table: t,
                    lengths: Lengths::Uniform(100, 100),
                    ids: IdDist::scattered(tables[t].vocabulary_size),
                })
                .collect();
            (tables, feats)
        }
        Profile::LargeVocab | Profile::HighMultivalency | Profile::ModerateMultivalency => {
            let (vocab, mu, sigma, p, features, combiner) = match profile {
                Profile::LargeVocab => (100_000_000, 1.5, 1.9, 0.42430, 20, "sum"),
                Profile::HighMultivalency => (33, 5.7, 0.2, 0.5, 1, "sum"),
                _ => (1000, 3.9, 0.3, 0.5, 5, "mean"),
            };
            let tables = vec![table("table_0", vocab, 16, combiner)];
            let feats = (0..features)
                .map(|i| FeatureGen {
                    name: format!("f{i:02}"),
                    table: 0,
                    lengths: Lengths::LogNormal(mu, sigma),
                    ids: IdDist::skewed(vocab, p),
                })
                .collect();
            (tables, feats)
        }
    }
}

/// The Criteo-style key of id `id` of feature `feature` (module docs).
fn raw_key(id: i64, feature: usize) -> String {
    let salt = 0x5bd1_e995u32.wrapping_mul(feature as u32 + 1);
    format!("{:08x}", (id as u32).wrapping_mul(0x9E37_79B1) ^ salt)
}

/// The profiles and batch sizes the criterion benches of the pipeline and of its stages run:
/// smaller than the profiles' defaults so that a bench's samples stay short, and the same in
/// both benches so that their figures can be read against each other.
pub const BENCH_PROFILES: [(Profile, usize); 5] = [
    (Profile::Criteo, 4096),
    (Profile::Long, 2048),
    (Profile::LargeVocab, 2048),
    (Profile::HighMultivalency, 2048),
    (Profile::ModerateMultivalency, 4096),
];

/// The benches' spec of `profile` with `batch` samples: criteo at 4/4/4 (its 26 stacks spread
/// over 64 SparseCores, as the reference benchmark runs it), the others at 1/1/4. Benches that
/// change one more field (weights, raw keys, minibatching) start from it, so that their figures
/// differ from [`bench_workload`]'s by that field alone.
pub fn bench_spec(profile: Profile, batch: usize) -> WorkloadSpec {
    let mut spec = WorkloadSpec::new(profile);
    spec.batch_size = batch;
    spec.layout = if profile == Profile::Criteo {
        (4, 4, 4)
    } else {
        (1, 1, 4)
    };
    spec
}

/// The bench paths that [`BENCH_PROFILES`]' workloads leave out, each on one profile at its
/// bench batch size and otherwise that profile's [`bench_spec`]: weights on `long`, whose 100 ids
/// per sample repeat within a sample, so gains are merged; raw keys on `criteo`, the data they
/// come from; minibatching on `moderate-multivalency`, whose ids spread over the buckets evenly
/// enough that halved limits split its batch (in 4) without putting a single bucket over a limit.
pub fn bench_paths() -> [(&'static str, WorkloadSpec); 3] {
    let spec = |profile: Profile| {
        let (_, batch) = BENCH_PROFILES
            .into_iter()
            .find(|&(p, _)| p == profile)
            .unwrap_or((profile, profile.default_batch_size()));
        bench_spec(profile, batch)
    };
    let mut weights = spec(Profile::Long);
    weights.weights = true;
    let mut raw_keys = spec(Profile::Criteo);
    raw_keys.raw_keys = true;
    let mut minibatching = spec(Profile::ModerateMultivalency);
    minibatching.minibatching = Some(2);
    [
        ("long/weights", weights),
        ("criteo/raw-keys", raw_keys),
        ("moderate-multivalency/minibatching", minibatching),
    ]
}

/// Checks that a bench path measures what it names: its first batch has ids, drops none, and,
/// under minibatching, splits. A limit too tight for minibatching would make its case a single
/// pass, and a buffer too small would drop ids. The bench runs this before timing; a test runs
/// it on every path, since CI builds the benches but does not run them.
pub fn check_bench_path(
    name: &str,
    spec: &WorkloadSpec,
    workload: &Workload,
) -> std::result::Result<(), String> {
    let batch = workload
        .batches
        .first()
        .ok_or_else(|| format!("{name}: no batch"))?;
    if workload.total_ids() == 0 {
        return Err(format!("{name}: no ids counted"));
    }
    let mut out = Output::new();
    Preprocessor::builder(workload.config.clone())
        .threads(1)
        .build()
        .and_then(|mut prep| prep.run_record_batch(batch, &mut out))
        .map_err(|e| format!("{name}: {e}"))?;
    if spec.minibatching.is_some() && out.num_minibatches < 2 {
        return Err(format!(
            "{name}: {} minibatch(es), expected a split",
            out.num_minibatches
        ));
    }
    match out.stacks.iter().find(|s| s.stats.dropped_id_count != 0) {
        Some(s) => Err(format!(
            "{name}: stack {}: {} ids dropped",
            s.name, s.stats.dropped_id_count
        )),
        None => Ok(()),
    }
}

/// The benches' workload of `profile` with `batch` samples ([`bench_spec`]).
pub fn bench_workload(profile: Profile, batch: usize) -> Result<Workload> {
    generate(&bench_spec(profile, batch))
}

/// Generates a workload. The same spec always gives the same bytes (for one build of the crate).
pub fn generate(spec: &WorkloadSpec) -> Result<Workload> {
    let (l, g, s) = spec.layout;
    let local_scs = l.checked_mul(s).ok_or_else(|| {
        Error::option(
            "layout",
            format!("{l}/{g}/{s}"),
            format!(
                "L * S = {l} * {s} local SparseCores does not fit in {} bits",
                usize::BITS
            ),
        )
    })?;
    if spec.batch_size == 0 || !spec.batch_size.is_multiple_of(local_scs) {
        return Err(Error::option(
            "batch-size",
            spec.batch_size,
            format!("must be a positive multiple of L * S = {local_scs}"),
        ));
    }
    // Every sample has at least one id, and a list column's offsets are int32.
    if spec.batch_size > i32::MAX as usize {
        return Err(Error::option(
            "batch-size",
            spec.batch_size,
            format!("at most {} samples: every sample has at least one id, and a list column's offsets are int32", i32::MAX),
        ));
    }
    let (mut tables, feats) = build(spec.profile);
    // The batches are held in memory until they are returned: a workload whose least size (one
    // id per sample and feature, with its offset and weight) is past what a process can address
    // is refused before anything is drawn, instead of running until an allocation aborts.
    let id_bytes: u128 = if spec.raw_keys {
        8 + 4
    } else if spec.int32_ids {
        4
    } else {
        8
    };
    let per_sample = feats.len() as u128 * (id_bytes + 4 + if spec.weights { 4 + 4 } else { 0 });
    let least = spec.num_batches as u128 * spec.batch_size as u128 * per_sample;
    if least > isize::MAX as u128 {
        return Err(Error::option(
            "num-batches",
            spec.num_batches,
            format!(
                "batches of {} samples take at least {least} bytes ({per_sample} per sample), more than a process can address ({})",
                spec.batch_size,
                isize::MAX
            ),
        ));
    }
    let mut rng = StdRng::seed_from_u64(spec.seed);

    if spec.raw_keys && spec.int32_ids {
        return Err(Error::option(
            "int32-ids",
            true,
            "raw keys are strings; int32 ids do not apply",
        ));
    }
    if spec.minibatching == Some(0) {
        return Err(Error::option(
            "minibatching",
            0,
            "the limits' divisor must be at least 1",
        ));
    }
    let id_type = if spec.raw_keys {
        DataType::Utf8
    } else if spec.int32_ids {
        DataType::Int32
    } else {
        DataType::Int64
    };
    let mut fields = Vec::new();
    for f in &feats {
        fields.push(Field::new_list(
            &f.name,
            Field::new_list_field(id_type.clone(), false),
            false,
        ));
        if spec.weights {
            fields.push(Field::new_list(
                format!("{}__w", f.name),
                Field::new_list_field(DataType::Float32, false),
                false,
            ));
        }
    }
    let schema = Arc::new(Schema::new(fields));

    // Not sized from the counts: a count that passes the bound above can still be more than
    // the allocator gives, which would abort the process at once.
    let mut batches = Vec::new();
    for _ in 0..spec.num_batches {
        let mut columns: Vec<ArrayRef> = Vec::new();
        for (fi, f) in feats.iter().enumerate() {
            let mut lengths = Vec::new();
            for _ in 0..spec.batch_size {
                lengths.push(match f.lengths {
                    Lengths::Uniform(lo, hi) => rng.random_range(lo..=hi),
                    Lengths::LogNormal(mu, sigma) => {
                        let x: f64 = Normal::new(mu, sigma)
                            .expect("valid normal")
                            .sample(&mut rng);
                        (x.exp() + 0.5).floor().max(1.0) as usize
                    }
                });
            }
            let total: usize = lengths.iter().sum();
            if total > i32::MAX as usize {
                return Err(Error::option(
                    "batch-size",
                    spec.batch_size,
                    format!("feature `{}` drew {total} ids in one batch, past the int32 offsets of a list column ({})", f.name, i32::MAX),
                ));
            }
            let ids: Vec<i64> = (0..total).map(|_| f.ids.draw(&mut rng)).collect();
            let offsets = OffsetBuffer::<i32>::from_lengths(lengths.iter().copied());
            let values: ArrayRef = if spec.raw_keys {
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|&v| raw_key(v, fi)),
                ))
            } else if spec.int32_ids {
                Arc::new(Int32Array::from(
                    ids.iter().map(|&v| v as i32).collect::<Vec<_>>(),
                ))
            } else {
                Arc::new(Int64Array::from(ids))
            };
            let item = Arc::new(Field::new_list_field(id_type.clone(), false));
            columns.push(Arc::new(
                ListArray::try_new(item, offsets.clone(), values, None).map_err(|source| {
                    Error::Arrow {
                        context: format!("building column {}", f.name),
                        source,
                    }
                })?,
            ));
            if spec.weights {
                let w: Vec<f32> = (0..total)
                    .map(|_| rng.random_range(1..=64) as f32 / 16.0)
                    .collect();
                let item = Arc::new(Field::new_list_field(DataType::Float32, false));
                columns.push(Arc::new(
                    ListArray::try_new(item, offsets, Arc::new(Float32Array::from(w)), None)
                        .map_err(|source| Error::Arrow {
                            context: format!("building column {}__w", f.name),
                            source,
                        })?,
                ));
            }
        }
        batches.push(
            RecordBatch::try_new(schema.clone(), columns).map_err(|source| Error::Arrow {
                context: "building a record batch".into(),
                source,
            })?,
        );
    }

    let features: Vec<FeatureConfig> = feats
        .iter()
        .enumerate()
        .map(|(fi, f)| FeatureConfig {
            name: f.name.clone(),
            table: tables[f.table].name.clone(),
            column: None,
            weights_column: spec.weights.then(|| format!("{}__w", f.name)),
            hash: spec.raw_keys.then_some(HashConfig { seed: fi as u64 }),
        })
        .collect();
    let mut options = Options {
        local_device_count: l,
        global_device_count: g,
        num_sc_per_device: s,
        allow_id_dropping: false,
        stacking: Stacking::Feature,
        stack_limits: None,
        enable_minibatching: false,
        stack_suggested_coo_buffer_size_per_device: None,
        validate_ids: true,
        sharding_strategy: None,
    };

    // Exact limits: measure the batches under feature stacking (one stack per table).
    let probe = Config {
        config: options.clone(),
        tables: tables.clone(),
        features: features.clone(),
    };
    let mut prep = Preprocessor::new(probe)?;
    let mut out = Output::new();
    let mut seen = vec![(0i32, 0i32, 0u64); tables.len()];
    for batch in &batches {
        let fs = features_from_record_batch(prep.config(), batch)?;
        let inputs: Vec<&dyn SampleSource> = fs.iter().map(|f| f as &dyn SampleSource).collect();
        prep.run_stats(&inputs, &mut out)?;
        let plan = prep.plan().expect("planned");
        for (stack, so) in plan.stacks.iter().zip(&out.stacks) {
            let e = &mut seen[stack.tables[0]];
            e.0 = e.0.max(so.stats.max_ids());
            e.1 = e.1.max(so.stats.max_unique_ids());
            e.2 = e.2.max(so.stats.required_buffer_size_per_device(s));
        }
    }
    for (t, (ids, uniq, req)) in tables.iter_mut().zip(seen) {
        t.max_ids_per_partition = ids.max(1) as u64;
        t.max_unique_ids_per_partition = uniq.max(1) as u64;
        t.suggested_coo_buffer_size_per_device = Some(round_up(req.max(1), 8 * s as u64));
    }
    if let Some(k) = spec.minibatching {
        options.enable_minibatching = true;
        // Once split, each (SparseCore, minibatch, partition) pads its entries to a multiple of 8
        // on its own, so the measured size gets 8 slots more per such triple: without them the
        // split would drop ids at the buffer's end. Capped at the plan's theoretical size, above
        // which it refuses a suggested one.
        let n = (g * s) as u64;
        let triples = s as u64 * MAX_MINIBATCHING_BUCKETS as u64 * n;
        for t in &mut tables {
            t.max_ids_per_partition = t.max_ids_per_partition.div_ceil(k);
            t.max_unique_ids_per_partition = t.max_unique_ids_per_partition.div_ceil(k);
            let theoretical = round_up(t.max_ids_per_partition, 8) * triples;
            t.suggested_coo_buffer_size_per_device = t
                .suggested_coo_buffer_size_per_device
                .map(|c| (c + 8 * triples).min(theoretical));
        }
    }
    if spec.stacking == Stacking::Auto {
        options.stacking = Stacking::Auto;
        options.stack_limits = Some(StackLimits {
            max_ids_per_partition: tables.iter().map(|t| t.max_ids_per_partition).sum(),
            max_unique_ids_per_partition: tables
                .iter()
                .map(|t| t.max_unique_ids_per_partition)
                .sum(),
        });
    }
    Ok(Workload {
        config: Config {
            config: options,
            tables,
            features,
        },
        schema,
        batches,
    })
}

/// `x` rounded up to a multiple of `m`.
fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}
