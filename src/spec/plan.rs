//! The stacking planner: config + batch sizes → per-feature placement and per-stack sizes.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::config::{Config, Stacking};
use super::{round_up, ALIGNMENT, DATA_MASK, MAX_MINIBATCHING_BUCKETS};
use crate::error::{BatchCount, ConfigItem, Error, Result};

/// How the ids of one sample are turned into gains (SPEC Part 2, section 3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Combiner {
    /// Gains are the weights (1.0 without weights).
    Sum,
    /// Gains are the weights divided by their sum (1/n without weights).
    Mean,
    /// Gains are the weights divided by the square root of their sum of squares.
    Sqrtn,
}

impl Combiner {
    /// Parses a combiner name. The reference silently treats unknown names as "sum"; a typo in a
    /// config would then change every gain, so we reject it.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sum" => Some(Combiner::Sum),
            "mean" => Some(Combiner::Mean),
            "sqrtn" => Some(Combiner::Sqrtn),
            _ => None,
        }
    }

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Combiner::Sum => "sum",
            Combiner::Mean => "mean",
            Combiner::Sqrtn => "sqrtn",
        }
    }
}

/// The device layout: L local devices of G, each with S SparseCores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceLayout {
    /// L: devices fed by this host.
    pub local_devices: usize,
    /// G: devices in the job.
    pub global_devices: usize,
    /// S: SparseCores per device.
    pub sc_per_device: usize,
}

impl DeviceLayout {
    /// Checks the layout the way the reference's option validation does (SPEC 3.1, checks 2–6).
    pub fn new(local_devices: usize, global_devices: usize, sc_per_device: usize) -> Result<Self> {
        if local_devices == 0 {
            return Err(Error::option(
                "local_device_count",
                local_devices,
                "must be greater than 0",
            ));
        }
        if global_devices == 0 {
            return Err(Error::option(
                "global_device_count",
                global_devices,
                "must be greater than 0",
            ));
        }
        if global_devices < local_devices {
            return Err(Error::option(
                "global_device_count",
                global_devices,
                format!("must be greater than or equal to local_device_count ({local_devices})"),
            ));
        }
        if sc_per_device == 0 {
            return Err(Error::option(
                "num_sc_per_device",
                sc_per_device,
                "must be greater than 0",
            ));
        }
        let num_scs = global_devices
            .checked_mul(sc_per_device)
            .filter(|&n| n <= MAX_SPARSECORES);
        let Some(num_scs) = num_scs else {
            return Err(Error::option(
                "num_sc_per_device",
                sc_per_device,
                format!(
                    "global_device_count {global_devices} * num_sc_per_device {sc_per_device} exceeds the \
                     {MAX_SPARSECORES} SparseCores that 32-bit column ids can address"
                ),
            ));
        };
        if !num_scs.is_power_of_two() {
            return Err(Error::NotPowerOfTwo {
                global_devices,
                sc_per_device,
                num_scs,
            });
        }
        Ok(DeviceLayout {
            local_devices,
            global_devices,
            sc_per_device,
        })
    }

    /// N = G * S: SparseCores in the job, which is the number of table shards and of partitions.
    #[inline]
    pub fn num_partitions(&self) -> usize {
        self.global_devices * self.sc_per_device
    }

    /// log2(N).
    #[inline]
    pub fn partition_bits(&self) -> u32 {
        self.num_partitions().trailing_zeros()
    }

    /// SparseCores fed by this host (L * S): the number of independent pipeline tasks per stack.
    #[inline]
    pub fn local_scs(&self) -> usize {
        self.local_devices * self.sc_per_device
    }

    /// Row pointers per (SparseCore, minibatch) segment: max(N, 8).
    #[inline]
    pub fn row_pointers_per_segment(&self) -> usize {
        self.num_partitions().max(ALIGNMENT)
    }
}

/// Where one feature sits in its stack (the reference's `FeatureIdTransformation` and
/// `TableSettingInStack`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeaturePlan {
    /// Feature name.
    pub name: String,
    /// Table name.
    pub table: String,
    /// Index of the table in the config.
    pub table_index: usize,
    /// Index of the stack in [`Plan::stacks`].
    pub stack: usize,
    /// The feature's global batch size (samples across all hosts).
    pub global_batch_size: usize,
    /// First global stacked sample of this feature.
    pub row_offset: u64,
    /// Added to every column id: `row_offset_in_shard * N`.
    pub col_offset: u32,
    /// Shard rotation of the table, added to ids before the partition mask.
    pub col_shift: u32,
    /// The table's vocabulary rounded up to `8 * N`.
    pub padded_vocab_size: u64,
    /// The stack's padded embedding dim.
    pub padded_embedding_dim: u64,
    /// First shard-local row of the table inside each shard.
    pub row_offset_in_shard: u64,
    /// Shard rotation of the table.
    pub shard_rotation: u64,
    /// The table's (unpadded) vocabulary size; ids must be below it.
    pub vocabulary_size: u64,
    /// The table's (unpadded) embedding dim.
    pub embedding_dim: u64,
}

/// One stacked table: the unit of preprocessing, with its own output buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackPlan {
    /// Stack name (the table name, or the joined table names under auto stacking).
    pub name: String,
    /// Member features (indices into [`Plan::features`]), sorted by `row_offset`.
    pub features: Vec<usize>,
    /// Member tables (config indices), in stacking order.
    pub tables: Vec<usize>,
    /// The stack's combiner.
    pub combiner: Combiner,
    /// Limit on de-duplicated ids per (SparseCore, partition).
    pub max_ids_per_partition: u32,
    /// Limit on distinct ids per (SparseCore, partition).
    pub max_unique_ids_per_partition: u32,
    /// The suggested COO buffer size per device, if any.
    pub suggested_coo_buffer_size_per_device: Option<u64>,
    /// Σ padded vocabularies of the member tables.
    pub stack_vocab_size: u64,
    /// Padded embedding dim shared by the member tables.
    pub stack_embedding_dim: u64,
    /// Σ global batch sizes of the member features.
    pub total_sample_count: u64,
    /// C: COO buffer elements per device.
    pub coo_buffer_size_per_device: usize,
    /// RP: row pointers per device.
    pub row_pointers_per_device: usize,
}

impl StackPlan {
    /// COO buffer elements per local SparseCore (C / S) without minibatching.
    pub fn coo_buffer_size_per_sc(&self, layout: &DeviceLayout) -> usize {
        self.coo_buffer_size_per_device / layout.sc_per_device
    }
}

/// The resolved stacking and buffer sizes for one config and one set of batch sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Device layout.
    pub layout: DeviceLayout,
    /// Per config feature, in config order.
    pub features: Vec<FeaturePlan>,
    /// Stacks, in order of first appearance of their tables among the features.
    pub stacks: Vec<StackPlan>,
    /// Whether limits exceeded drop ids instead of failing.
    pub allow_id_dropping: bool,
    /// Whether ids are range-checked.
    pub validate_ids: bool,
    /// Whether minibatching is on.
    pub enable_minibatching: bool,
}

/// Where one feature already sits in its stack (the reference's `FeatureIdTransformation` and
/// stack name), for [`Plan::from_resolved`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Name of the stack (one of the [`ResolvedStack`]s).
    pub stack: String,
    /// First global stacked sample of the feature.
    pub row_offset: u64,
    /// Added to every column id (`row_offset_in_shard * N` of its table).
    pub col_offset: u64,
    /// Shard rotation of its table (below N).
    pub col_shift: u64,
    /// The feature's global batch size (reported in the plan; offsets are taken as given).
    pub global_batch_size: usize,
}

/// A stack's settings as its `StackedTableSpec` holds them, for [`Plan::from_resolved`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedStack {
    /// Stack name.
    pub name: String,
    /// "sum", "mean" or "sqrtn".
    pub combiner: String,
    /// Limit on de-duplicated ids per (SparseCore, partition).
    pub max_ids_per_partition: u64,
    /// Limit on distinct ids per (SparseCore, partition).
    pub max_unique_ids_per_partition: u64,
    /// Suggested COO buffer size per device, if any.
    pub suggested_coo_buffer_size_per_device: Option<u64>,
}

/// Most SparseCores (N) a job can have: partitions are addressed by the low bits of a 32-bit
/// column id, and the 2^31 padded vocabulary must still give every shard a row.
pub const MAX_SPARSECORES: usize = 1 << 30;

/// Auto stacking's activation budget per stack: 2 MiB (the reference's default).
pub const ACTIVATION_MEM_BYTES_LIMIT: u64 = 2 * 1024 * 1024;

const STACK_NAME_DISPLAY_CHARS: usize = 50;
const STACK_NAME_HASH_CHARS: usize = 12;

impl Plan {
    /// Plans `config` for features whose global batch sizes are `global_batch_sizes` (one per
    /// config feature).
    ///
    /// Global batch sizes matter because row offsets, auto stacking's activation budget and
    /// `total_sample_count` are counted in global samples, as the reference's `output_shape`.
    pub fn new(config: &Config, global_batch_sizes: &[usize]) -> Result<Self> {
        let opts = &config.config;
        if let Some(s) = &opts.sharding_strategy {
            if !s.eq_ignore_ascii_case("mod") {
                return Err(Error::option(
                    "sharding_strategy",
                    s,
                    "Unsupported sharding strategy. Only MOD is supported.",
                ));
            }
        }
        let layout = DeviceLayout::new(
            opts.local_device_count,
            opts.global_device_count,
            opts.num_sc_per_device,
        )?;
        if config.features.is_empty() {
            return Err(Error::NoFeatures);
        }
        if global_batch_sizes.len() != config.features.len() {
            return Err(Error::InputCount {
                expected: config.features.len(),
                got: global_batch_sizes.len(),
            });
        }
        let n = layout.num_partitions() as u64;
        let combiners = validate_tables(config)?;
        let feature_tables = validate_features(config)?;

        let mut features: Vec<FeaturePlan> = config
            .features
            .iter()
            .zip(&feature_tables)
            .zip(global_batch_sizes)
            .map(|((f, &t), &batch)| {
                let table = &config.tables[t];
                FeaturePlan {
                    name: f.name.clone(),
                    table: table.name.clone(),
                    table_index: t,
                    stack: usize::MAX,
                    global_batch_size: batch,
                    row_offset: 0,
                    col_offset: 0,
                    col_shift: 0,
                    padded_vocab_size: round_up(table.vocabulary_size, 8 * n),
                    padded_embedding_dim: round_up(table.embedding_dim, ALIGNMENT as u64),
                    row_offset_in_shard: 0,
                    shard_rotation: 0,
                    vocabulary_size: table.vocabulary_size,
                    embedding_dim: table.embedding_dim,
                }
            })
            .collect();

        // Tables in order of first appearance among the features (the reference's flattened
        // table dict).
        let mut tables_in_order: Vec<usize> = Vec::new();
        for &t in &feature_tables {
            if !tables_in_order.contains(&t) {
                tables_in_order.push(t);
            }
        }

        let groups: Vec<Vec<usize>> = match opts.stacking {
            Stacking::Feature => tables_in_order.iter().map(|&t| vec![t]).collect(),
            Stacking::Auto => auto_groups(config, &features, &tables_in_order, &combiners, n),
        };

        let mut stacks = Vec::with_capacity(groups.len());
        for group in groups {
            let stack_index = stacks.len();
            let stack = match opts.stacking {
                Stacking::Feature => plan_feature_stack(
                    config,
                    &mut features,
                    group[0],
                    combiners[group[0]],
                    stack_index,
                    n,
                )?,
                Stacking::Auto => {
                    plan_auto_stack(config, &mut features, &group, &combiners, n, stack_index)?
                }
            };
            stacks.push(stack);
        }

        if let Some(overrides) = &opts.stack_suggested_coo_buffer_size_per_device {
            for (name, &size) in overrides {
                let stack = stacks.iter_mut().find(|s| &s.name == name).ok_or_else(|| {
                    Error::config(
                        ConfigItem::Stack,
                        name,
                        "named in stack_suggested_coo_buffer_size_per_device but not planned",
                    )
                })?;
                stack.suggested_coo_buffer_size_per_device = Some(size);
            }
        }

        for stack in &mut stacks {
            let feature = first_feature(stack, &features);
            size_buffers(stack, &feature, &layout, opts.enable_minibatching)?;
        }

        Ok(Plan {
            layout,
            features,
            stacks,
            allow_id_dropping: opts.allow_id_dropping,
            validate_ids: opts.validate_ids,
            enable_minibatching: opts.enable_minibatching,
        })
    }

    /// Plans `config` for local batches of `local_batch_sizes` samples per feature, taking each
    /// global batch as local * G / L (every host feeds the same number of samples).
    pub fn for_local_batches(config: &Config, local_batch_sizes: &[usize]) -> Result<Self> {
        let o = &config.config;
        if o.local_device_count == 0 {
            return Err(Error::option(
                "local_device_count",
                0,
                "must be greater than 0",
            ));
        }
        let global: Vec<usize> = local_batch_sizes
            .iter()
            .map(|&b| b.saturating_mul(o.global_device_count) / o.local_device_count)
            .collect();
        Self::new(config, &global)
    }

    /// Plans `config` with a stacking that was already decided elsewhere: per config feature,
    /// its stack and offsets (`placements[i]` for `config.features[i]`), and per stack, its
    /// combiner, limits and suggested buffer size. This is what the reference's preprocessing
    /// reads from `FeatureSpec`s after `prepare_feature_specs_for_training`, `auto_stack_tables`
    /// or a hand-written `stack_tables` (SPEC Part 2, section 2.6), so the Python drop-in can
    /// honour any stacking its caller made instead of re-deriving it from `config.stacking`.
    ///
    /// Members of a stack are taken in `row_offset` order (equal offsets are an error, as they
    /// would give two features the same samples), stacks in order of first appearance. The key
    /// layout is sized from the offsets and vocabularies, never from a caller-supplied stack
    /// vocabulary, so a wrong spec cannot corrupt keys.
    pub fn from_resolved(
        config: &Config,
        placements: &[Placement],
        stacks: &[ResolvedStack],
    ) -> Result<Self> {
        let opts = &config.config;
        if let Some(s) = &opts.sharding_strategy {
            if !s.eq_ignore_ascii_case("mod") {
                return Err(Error::option(
                    "sharding_strategy",
                    s,
                    "Unsupported sharding strategy. Only MOD is supported.",
                ));
            }
        }
        let layout = DeviceLayout::new(
            opts.local_device_count,
            opts.global_device_count,
            opts.num_sc_per_device,
        )?;
        if config.features.is_empty() {
            return Err(Error::NoFeatures);
        }
        if placements.len() != config.features.len() {
            return Err(Error::InputCount {
                expected: config.features.len(),
                got: placements.len(),
            });
        }
        let n = layout.num_partitions() as u64;
        let feature_tables = validate_features(config)?;
        for (i, t) in config.tables.iter().enumerate() {
            if config.tables[..i].iter().any(|u| u.name == t.name) {
                return Err(Error::config(
                    ConfigItem::Table,
                    &t.name,
                    "duplicate table name",
                ));
            }
            if t.vocabulary_size == 0 || t.vocabulary_size > i32::MAX as u64 {
                return Err(Error::config(
                    ConfigItem::Table,
                    &t.name,
                    format!(
                        "vocabulary_size {} must be in 1..=2147483647",
                        t.vocabulary_size
                    ),
                ));
            }
        }
        let mut features = Vec::with_capacity(placements.len());
        for ((f, &t), p) in config.features.iter().zip(&feature_tables).zip(placements) {
            let table = &config.tables[t];
            let stack = stacks
                .iter()
                .position(|s| s.name == p.stack)
                .ok_or_else(|| {
                    Error::config(
                        ConfigItem::Feature,
                        &f.name,
                        format!(
                            "placed in stack `{}`, which is not among the given stacks",
                            p.stack
                        ),
                    )
                })?;
            let col_offset = u32::try_from(p.col_offset)
                .ok()
                .filter(|&c| c <= i32::MAX as u32)
                .ok_or_else(|| {
                    Error::config(
                        ConfigItem::Feature,
                        &f.name,
                        format!(
                            "col_offset {} exceeds the 32-bit column ids (2147483647)",
                            p.col_offset
                        ),
                    )
                })?;
            if p.row_offset > MAX_STACK_SAMPLES {
                return Err(Error::BatchTooLarge {
                    stack: p.stack.clone(),
                    what: BatchCount::RowOffset,
                    count: p.row_offset,
                    limit: MAX_STACK_SAMPLES,
                });
            }
            if p.col_shift >= n {
                return Err(Error::config(
                    ConfigItem::Feature,
                    &f.name,
                    format!(
                        "col_shift {} must be below the {n} SparseCores",
                        p.col_shift
                    ),
                ));
            }
            features.push(FeaturePlan {
                name: f.name.clone(),
                table: table.name.clone(),
                table_index: t,
                stack,
                global_batch_size: p.global_batch_size,
                row_offset: p.row_offset,
                col_offset,
                col_shift: p.col_shift as u32,
                padded_vocab_size: round_up(table.vocabulary_size, 8 * n),
                padded_embedding_dim: round_up(table.embedding_dim, ALIGNMENT as u64),
                row_offset_in_shard: p.col_offset / n,
                shard_rotation: p.col_shift,
                vocabulary_size: table.vocabulary_size,
                embedding_dim: table.embedding_dim,
            });
        }
        let mut order: Vec<usize> = Vec::new();
        for f in &features {
            if !order.contains(&f.stack) {
                order.push(f.stack);
            }
        }
        // Members by the given stacks' indices, taken before the features are renumbered to
        // planned stacks.
        let groups: Vec<(usize, Vec<usize>)> = order
            .iter()
            .map(|&s| {
                let mut members: Vec<usize> = (0..features.len())
                    .filter(|&i| features[i].stack == s)
                    .collect();
                members.sort_by_key(|&i| features[i].row_offset);
                (s, members)
            })
            .collect();
        let mut planned = Vec::with_capacity(order.len());
        for (index, (s, members)) in groups.into_iter().enumerate() {
            let rs = &stacks[s];
            for w in members.windows(2) {
                if features[w[0]].row_offset == features[w[1]].row_offset {
                    return Err(Error::config(
                        ConfigItem::Stack,
                        &rs.name,
                        format!(
                            "features `{}` and `{}` have the same row_offset {}",
                            features[w[0]].name, features[w[1]].name, features[w[0]].row_offset
                        ),
                    ));
                }
            }
            let combiner = Combiner::parse(&rs.combiner).ok_or_else(|| {
                Error::config(
                    ConfigItem::Stack,
                    &rs.name,
                    format!(
                        "unknown combiner {:?}; expected \"sum\", \"mean\" or \"sqrtn\"",
                        rs.combiner
                    ),
                )
            })?;
            // Every column id of the stack is below the largest col_offset + padded vocabulary.
            let vocab = members
                .iter()
                .map(|&i| features[i].col_offset as u64 + features[i].padded_vocab_size)
                .max()
                .unwrap_or(0);
            check_stack_vocab(&rs.name, vocab, n)?;
            let mut tables: Vec<usize> = Vec::new();
            for &i in &members {
                if !tables.contains(&features[i].table_index) {
                    tables.push(features[i].table_index);
                }
            }
            let total = members.iter().fold(0u64, |acc, &i| {
                acc.saturating_add(features[i].global_batch_size as u64)
            });
            let dim = members
                .iter()
                .map(|&i| features[i].padded_embedding_dim)
                .max()
                .unwrap_or(0);
            for &i in &members {
                features[i].stack = index;
                features[i].padded_embedding_dim = dim;
            }
            planned.push(StackPlan {
                name: rs.name.clone(),
                features: members,
                tables,
                combiner,
                max_ids_per_partition: check_limit(
                    ConfigItem::Stack,
                    &rs.name,
                    "max_ids_per_partition",
                    rs.max_ids_per_partition,
                )?,
                max_unique_ids_per_partition: check_limit(
                    ConfigItem::Stack,
                    &rs.name,
                    "max_unique_ids_per_partition",
                    rs.max_unique_ids_per_partition,
                )?,
                suggested_coo_buffer_size_per_device: rs.suggested_coo_buffer_size_per_device,
                stack_vocab_size: vocab,
                stack_embedding_dim: dim,
                total_sample_count: total,
                coo_buffer_size_per_device: 0,
                row_pointers_per_device: 0,
            });
        }
        for stack in &mut planned {
            let feature = first_feature(stack, &features);
            size_buffers(stack, &feature, &layout, opts.enable_minibatching)?;
        }
        Ok(Plan {
            layout,
            features,
            stacks: planned,
            allow_id_dropping: opts.allow_id_dropping,
            validate_ids: opts.validate_ids,
            enable_minibatching: opts.enable_minibatching,
        })
    }

    /// The plan in the shape of a golden case's `resolved` block: the reference's stacking
    /// result, for side-by-side comparison.
    pub fn resolved(&self) -> Value {
        let features: Vec<Value> = self
            .features
            .iter()
            .map(|f| {
                json!({
                    "feature": f.name,
                    "table": f.table,
                    "stack_name": self.stacks[f.stack].name,
                    "row_offset": f.row_offset,
                    "col_offset": f.col_offset,
                    "col_shift": f.col_shift,
                    "padded_vocab_size": f.padded_vocab_size,
                    "padded_embedding_dim": f.padded_embedding_dim,
                    "row_offset_in_shard": f.row_offset_in_shard,
                    "shard_rotation": f.shard_rotation,
                })
            })
            .collect();
        let stacks: serde_json::Map<String, Value> = self
            .stacks
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    json!({
                        "stack_name": s.name,
                        "stack_vocab_size": s.stack_vocab_size,
                        "stack_embedding_dim": s.stack_embedding_dim,
                        "combiner": s.combiner.as_str(),
                        "total_sample_count": s.total_sample_count,
                        "max_ids_per_partition": s.max_ids_per_partition,
                        "max_unique_ids_per_partition": s.max_unique_ids_per_partition,
                        "suggested_coo_buffer_size_per_device": s.suggested_coo_buffer_size_per_device,
                    }),
                )
            })
            .collect();
        json!({ "features": features, "stacks": stacks })
    }

    /// Finds a stack by name.
    pub fn stack(&self, name: &str) -> Option<&StackPlan> {
        self.stacks.iter().find(|s| s.name == name)
    }
}

fn check_limit(what: ConfigItem, name: &str, limit: &'static str, value: u64) -> Result<u32> {
    if value == 0 || value > i32::MAX as u64 {
        return Err(Error::InvalidLimit {
            what,
            name: name.to_string(),
            limit,
            value,
            reason: "must be in 1..=2147483647".into(),
        });
    }
    Ok(value as u32)
}

/// Adds a feature's global batch to a stack's running sample count, refusing counts no
/// device could hold.
fn add_samples(stack: &str, offset: u64, batch: usize) -> Result<u64> {
    offset
        .checked_add(batch as u64)
        .filter(|&o| o <= MAX_STACK_SAMPLES)
        .ok_or_else(|| Error::BatchTooLarge {
            stack: stack.to_string(),
            what: BatchCount::GlobalSamples,
            count: offset.saturating_add(batch as u64),
            limit: MAX_STACK_SAMPLES,
        })
}

/// Most global samples a stack can have: 2^26 - 1 per device times at most 2^30 devices.
const MAX_STACK_SAMPLES: u64 = DATA_MASK << 30;

/// A stack's padded vocabulary must keep its column ids in 32 bits and its rows per shard (the
/// embedding ids written to the buffers) in an `i32`. The reference itself bounds only what it
/// passes as a C++ `int`: a table of 2^31 - 1 rows pads to 2^31 and is planned, while a table
/// whose `col_offset` would pass 2^31 - 1 is refused (`check_col_offset`).
fn check_stack_vocab(stack: &str, vocab: u64, n: u64) -> Result<()> {
    let limit = (1u64 << 32).min((1u64 << 31).saturating_mul(n));
    if vocab > limit {
        return Err(Error::config(
            ConfigItem::Stack,
            stack,
            format!("padded vocabulary {vocab} exceeds what 32-bit column ids and rows per shard hold ({limit})"),
        ));
    }
    Ok(())
}

/// A table's first column in its stack is a C++ `int` in the reference, which refuses the
/// stack when it does not fit.
fn check_col_offset(stack: &str, table: &str, col_offset: u64) -> Result<()> {
    if col_offset > i32::MAX as u64 {
        return Err(Error::config(
            ConfigItem::Stack,
            stack,
            format!("table `{table}` would start at column {col_offset}: col_offset exceeds the 32-bit column ids (2147483647)"),
        ));
    }
    Ok(())
}

/// Validates tables and returns their combiners, by config index.
fn validate_tables(config: &Config) -> Result<Vec<Combiner>> {
    let mut combiners = Vec::with_capacity(config.tables.len());
    for (i, t) in config.tables.iter().enumerate() {
        if config.tables[..i].iter().any(|u| u.name == t.name) {
            return Err(Error::config(
                ConfigItem::Table,
                &t.name,
                "duplicate table name",
            ));
        }
        if t.vocabulary_size == 0 || t.vocabulary_size > i32::MAX as u64 {
            return Err(Error::config(
                ConfigItem::Table,
                &t.name,
                format!(
                    "vocabulary_size {} must be in 1..=2147483647",
                    t.vocabulary_size
                ),
            ));
        }
        if t.embedding_dim == 0 || t.embedding_dim > i32::MAX as u64 {
            return Err(Error::config(
                ConfigItem::Table,
                &t.name,
                format!(
                    "embedding_dim {} must be in 1..=2147483647",
                    t.embedding_dim
                ),
            ));
        }
        check_limit(
            ConfigItem::Table,
            &t.name,
            "max_ids_per_partition",
            t.max_ids_per_partition,
        )?;
        check_limit(
            ConfigItem::Table,
            &t.name,
            "max_unique_ids_per_partition",
            t.max_unique_ids_per_partition,
        )?;
        let c = Combiner::parse(&t.combiner).ok_or_else(|| {
            Error::config(
                ConfigItem::Table,
                &t.name,
                format!(
                    "unknown combiner {:?}; expected \"sum\", \"mean\" or \"sqrtn\"",
                    t.combiner
                ),
            )
        })?;
        combiners.push(c);
    }
    Ok(combiners)
}

/// Validates features and returns each feature's table index.
fn validate_features(config: &Config) -> Result<Vec<usize>> {
    let mut tables = Vec::with_capacity(config.features.len());
    for (i, f) in config.features.iter().enumerate() {
        if config.features[..i].iter().any(|g| g.name == f.name) {
            return Err(Error::config(
                ConfigItem::Feature,
                &f.name,
                "duplicate feature name",
            ));
        }
        let t = config.table_index(&f.table).ok_or_else(|| {
            let known: Vec<&str> = config.tables.iter().map(|t| t.name.as_str()).collect();
            Error::config(
                ConfigItem::Feature,
                &f.name,
                format!("unknown table `{}` (tables: {})", f.table, known.join(", ")),
            )
        })?;
        tables.push(t);
    }
    Ok(tables)
}

/// `prepare_feature_specs_for_training`: one stack per table, same-table features by name.
fn plan_feature_stack(
    config: &Config,
    features: &mut [FeaturePlan],
    table: usize,
    combiner: Combiner,
    stack_index: usize,
    n: u64,
) -> Result<StackPlan> {
    let t = &config.tables[table];
    let mut members: Vec<usize> = (0..features.len())
        .filter(|&i| features[i].table_index == table)
        .collect();
    members.sort_by(|&a, &b| features[a].name.cmp(&features[b].name));
    let mut offset = 0u64;
    for &i in &members {
        let f = &mut features[i];
        f.stack = stack_index;
        f.row_offset = offset;
        offset = add_samples(&t.name, offset, f.global_batch_size)?;
    }
    let padded_vocab = features[members[0]].padded_vocab_size;
    check_stack_vocab(&t.name, padded_vocab, n)?;
    let padded_dim = features[members[0]].padded_embedding_dim;
    Ok(StackPlan {
        name: t.name.clone(),
        features: members,
        tables: vec![table],
        combiner,
        max_ids_per_partition: t.max_ids_per_partition as u32,
        max_unique_ids_per_partition: t.max_unique_ids_per_partition as u32,
        suggested_coo_buffer_size_per_device: t.suggested_coo_buffer_size_per_device,
        stack_vocab_size: padded_vocab,
        stack_embedding_dim: padded_dim,
        total_sample_count: offset,
        coo_buffer_size_per_device: 0,
        row_pointers_per_device: 0,
    })
}

/// `auto_stack_tables`' grouping: by (padded dim, combiner) in order of first appearance, then
/// split first-fit so that each group's activations stay within 2 MiB.
fn auto_groups(
    config: &Config,
    features: &[FeaturePlan],
    tables_in_order: &[usize],
    combiners: &[Combiner],
    n: u64,
) -> Vec<Vec<usize>> {
    let mut keyed: Vec<((u64, Combiner), Vec<usize>)> = Vec::new();
    for &t in tables_in_order {
        let key = (
            round_up(config.tables[t].embedding_dim, ALIGNMENT as u64),
            combiners[t],
        );
        match keyed.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(t),
            None => keyed.push((key, vec![t])),
        }
    }
    let activation_bytes = |t: usize| -> u64 {
        let samples = features
            .iter()
            .filter(|f| f.table_index == t)
            .fold(0u64, |acc, f| {
                acc.saturating_add(f.global_batch_size as u64 / n)
            });
        round_up(config.tables[t].embedding_dim, ALIGNMENT as u64)
            .saturating_mul(samples)
            .saturating_mul(4)
    };
    let mut groups = Vec::new();
    for (_, group) in keyed {
        let mut split: Vec<(u64, Vec<usize>)> = Vec::new();
        for t in group {
            let bytes = activation_bytes(t);
            match split
                .iter_mut()
                .find(|(used, _)| used.saturating_add(bytes) <= ACTIVATION_MEM_BYTES_LIMIT)
            {
                Some((used, g)) => {
                    *used += bytes;
                    g.push(t);
                }
                None => split.push((bytes, vec![t])),
            }
        }
        groups.extend(split.into_iter().map(|(_, g)| g));
    }
    groups
}

/// The reference's `_get_stack_name`: joined table names, shortened past 50 characters with a
/// SHA-256 suffix so that names stay unique.
fn stack_name(config: &Config, tables: &[usize]) -> String {
    let full: String = tables
        .iter()
        .map(|&t| config.tables[t].name.as_str())
        .collect::<Vec<_>>()
        .join("_");
    if full.chars().count() <= STACK_NAME_DISPLAY_CHARS {
        return full;
    }
    let digest = Sha256::digest(full.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut short: String = full.chars().take(STACK_NAME_DISPLAY_CHARS).collect();
    short.push_str("...");
    short.push_str(&hex[..STACK_NAME_HASH_CHARS]);
    short
}

/// `stack_tables` for one auto group: in-shard offsets, rotation = S, pytree-order row offsets.
fn plan_auto_stack(
    config: &Config,
    features: &mut [FeaturePlan],
    group: &[usize],
    combiners: &[Combiner],
    n: u64,
    stack_index: usize,
) -> Result<StackPlan> {
    let s = config.config.num_sc_per_device as u64;
    let name = stack_name(config, group);
    let padded_dim = group
        .iter()
        .map(|&t| round_up(config.tables[t].embedding_dim, ALIGNMENT as u64))
        .max()
        .unwrap_or(0);
    let mut row_offset_in_shard = 0u64;
    let mut rotation = 0u64;
    let mut stack_vocab = 0u64;
    let mut settings = Vec::with_capacity(group.len());
    for &t in group {
        let padded_vocab = round_up(config.tables[t].vocabulary_size, 8 * n);
        check_col_offset(&name, &config.tables[t].name, row_offset_in_shard * n)?;
        settings.push((t, row_offset_in_shard, rotation));
        row_offset_in_shard += padded_vocab / n;
        rotation = (rotation + s) % n;
        stack_vocab += padded_vocab;
    }
    check_stack_vocab(&name, stack_vocab, n)?;
    let mut members = Vec::new();
    let mut offset = 0u64;
    for (i, f) in features.iter_mut().enumerate() {
        let Some(&(_, in_shard, rot)) = settings.iter().find(|(t, _, _)| *t == f.table_index)
        else {
            continue;
        };
        f.stack = stack_index;
        f.row_offset = offset;
        f.row_offset_in_shard = in_shard;
        f.shard_rotation = rot;
        f.col_offset = (in_shard * n) as u32;
        f.col_shift = rot as u32;
        f.padded_embedding_dim = padded_dim;
        offset = add_samples(&name, offset, f.global_batch_size)?;
        members.push(i);
    }
    // Features are consumed in row-offset order, which here is already pytree order.
    let (max_ids, max_unique) = if group.len() == 1 {
        let t = &config.tables[group[0]];
        (t.max_ids_per_partition, t.max_unique_ids_per_partition)
    } else {
        let l = config.config.stack_limits.unwrap_or_default();
        (l.max_ids_per_partition, l.max_unique_ids_per_partition)
    };
    let max_ids = check_limit(ConfigItem::Stack, &name, "max_ids_per_partition", max_ids)?;
    let max_unique = check_limit(
        ConfigItem::Stack,
        &name,
        "max_unique_ids_per_partition",
        max_unique,
    )?;
    Ok(StackPlan {
        combiner: combiners[features[members[0]].table_index],
        name,
        features: members,
        tables: group.to_vec(),
        max_ids_per_partition: max_ids,
        max_unique_ids_per_partition: max_unique,
        suggested_coo_buffer_size_per_device: None,
        stack_vocab_size: stack_vocab,
        stack_embedding_dim: padded_dim,
        total_sample_count: offset,
        coo_buffer_size_per_device: 0,
        row_pointers_per_device: 0,
    })
}

/// The name by which the reference's buffer checks name a stack: its first feature's (the stack's
/// own name when it has none).
fn first_feature(stack: &StackPlan, features: &[FeaturePlan]) -> String {
    stack
        .features
        .first()
        .and_then(|&f| features.get(f))
        .map_or_else(|| stack.name.clone(), |f| f.name.clone())
}

/// SPEC 3.2: row pointers per device and the COO buffer size C. `feature` names the stack in
/// errors as the reference does.
fn size_buffers(
    stack: &mut StackPlan,
    feature: &str,
    layout: &DeviceLayout,
    minibatching: bool,
) -> Result<()> {
    let s = layout.sc_per_device as u64;
    let n = layout.num_partitions() as u64;
    let mb = if minibatching {
        MAX_MINIBATCHING_BUCKETS as u64
    } else {
        1
    };
    stack.row_pointers_per_device =
        layout.row_pointers_per_segment() * mb as usize * layout.sc_per_device;
    // max_ids < 2^31 and N <= 2^30, so the product can exceed u64 only through S; saturate and
    // let the range check below report it.
    let theoretical = round_up(stack.max_ids_per_partition as u64, ALIGNMENT as u64)
        .saturating_mul(s)
        .saturating_mul(n)
        .saturating_mul(mb);
    let size = match stack.suggested_coo_buffer_size_per_device {
        None => theoretical,
        Some(suggested) => {
            let rounded = round_up(suggested, ALIGNMENT as u64 * s);
            if rounded > theoretical {
                return Err(Error::SuggestedBufferTooLarge {
                    stack: stack.name.clone(),
                    feature: feature.to_string(),
                    suggested,
                    rounded,
                    theoretical,
                });
            }
            rounded
        }
    };
    if size == 0 || size >= i32::MAX as u64 {
        return Err(Error::BufferSizeOutOfRange {
            stack: stack.name.clone(),
            feature: feature.to_string(),
            size,
        });
    }
    stack.coo_buffer_size_per_device = size as usize;
    Ok(())
}
