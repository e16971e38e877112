//! [`BessStream`]: BESS batches laid out for SparseCores, as Arrow record batches that the
//! existing [`sparsecore_prep::Preprocessor`] runs unchanged, plus the config whose limits are
//! the exact per-cell counts, computed before any batch is drawn.
//!
//! Why: the pipeline's per-partition limits and COO buffers are sized by the busiest
//! (SparseCore, partition) cell. Here every cell gets exactly `ppp` heads, `ppp` tails and
//! `B·K` negatives (see [`crate::layout`]), so the limits can be exact, the buffers minimal, and
//! nothing is ever dropped.
//!
//! ## The record batch
//! Rows are laid out per local SparseCore, device-major, `R` rows each (the pipeline gives
//! SparseCore `k` rows `k·R .. (k+1)·R` of every feature). In SparseCore `g`'s slice:
//! - rows `0 .. T` (`T = n·ppp`) are its triples, block by block (head shard `i`, then position
//!   `j`): `head` and `tail` (`List<Int64>` of one physical id), `relation` (`Int32`),
//!   `triple_mask` (`Boolean`, Rigid's padding is false), `triple_idx` (`Int64`, the row of
//!   [`PartitionedTriples::triples`]);
//! - rows `0 .. NEG` (`NEG = n·B·K`) carry one negative each: `negative` (`List<Int64>` of one
//!   physical id), `negative_shard` (`Int32`, the shard it was drawn from), `negative_triple`
//!   (`Int32`: the slice row of the triple it belongs to, or −1 when shared by the slice),
//!   `negative_side` (`Int8`: 0 replaces the head, 1 the tail), `negative_mask` (`Boolean`:
//!   false for TripleBased's padding);
//! - `R = max(T, NEG)`; past `T` (or `NEG`) the id lists are empty and the plain columns null.
//!
//! One negative per row, so that each negative's embedding comes back as its own activation
//! row. The features `head`, `tail` and `negative` all index the table `entities`, so they form
//! one stack.

use std::sync::Arc;

use arrow_array::builder::{BooleanBuilder, Int32Builder, Int64Builder, Int8Builder};
use arrow_array::{ArrayRef, Int64Array, ListArray, RecordBatch};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use ndarray::{Array2, ArrayD, IxDyn};
use sparsecore_prep::Config;

use crate::batch::{Batch, BatchOptions, BatchSampler, SamplerKind};
use crate::error::{BessError, Result};
use crate::layout::SparseCoreLayout;
use crate::negative::{Corruption, NegativeOutput, NegativeSampler, RandomNegative, TripleBasedNegative, TypeBasedNegative};
use crate::partition::{PartitionMode, PartitionedTriples, Triples};
use crate::rng::seed_words;
use crate::sharding::Sharding;

/// The entity table's name in the config.
pub const TABLE: &str = "entities";
/// Feature (and column) names.
pub const HEAD: &str = "head";
/// Tail feature.
pub const TAIL: &str = "tail";
/// Negatives feature.
pub const NEGATIVE: &str = "negative";

/// Which batch sampler the stream uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamSampler {
    /// besskge's Random sampler (with replacement), exact.
    Random,
    /// besskge's Rigid sampler: exact with `shuffle = false`; shuffled positions come from our
    /// own seeded generator (see [`SamplerKind::Rigid`]).
    Rigid {
        /// Shuffle positions every epoch.
        shuffle: bool,
    },
}

/// Which negative sampler the stream uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NegativeKind {
    /// Uniform over each shard.
    Random,
    /// Same entity type as the corrupted side; entities are typed by global id ranges.
    TypeBased {
        /// `[0, o1, o2, ...]`.
        type_offsets: Vec<i64>,
    },
    /// Given lists `(N0 or 1, k)` of global ids (`k` replaces `negatives`).
    TripleBased {
        /// Negative heads ("h" and "ht").
        neg_heads: Option<Array2<i64>>,
        /// Negative tails ("t" and "ht").
        neg_tails: Option<Array2<i64>>,
    },
}

/// The per-cell counts the config's limits are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellCounts {
    /// Triples per shard-pair block (`positive_per_partition`).
    pub ppp: usize,
    /// Triples per SparseCore slice, `T = n·ppp`.
    pub triples_per_sparsecore: usize,
    /// Positive ids per (SparseCore, partition): `2·ppp` (heads and tails).
    pub positive_ids_per_partition: usize,
    /// Negative ids per (SparseCore, partition): `B·K`.
    pub negative_ids_per_partition: usize,
    /// Rows per SparseCore slice, `R`.
    pub rows_per_sparsecore: usize,
    /// `max_ids_per_partition` = `max_unique_ids_per_partition` of the config.
    pub max_ids_per_partition: usize,
    /// The COO buffer per device: `S·N·roundup(max_ids, 8)`, the theoretical size for those
    /// limits, which every batch fills exactly up to merged duplicates.
    pub coo_buffer_size_per_device: usize,
}

/// One step of the stream.
#[derive(Debug, Clone)]
pub struct StreamBatch {
    /// The step number.
    pub step: usize,
    /// The record batch to preprocess.
    pub record_batch: RecordBatch,
    /// The BESS sampler's own arrays of the step (negatives not included: see `negative`).
    pub bess: Batch,
    /// `[n, n, ppp]`, SparseCore-major: `[g][i][j]` is the `j`-th triple SparseCore `g` takes
    /// from head shard `i` (a row of [`PartitionedTriples::triples`]).
    pub sample_idx: ArrayD<i64>,
    /// The negative sampler's output for `sample_idx` (axis 1: the shard drawn from; axis 2:
    /// the SparseCore that uses them).
    pub negative: Option<NegativeOutput>,
}

/// Builds a [`BessStream`]. Required: triples, `n_entity`, `shard_batch_size`.
#[derive(Debug, Clone)]
#[must_use]
pub struct BessStreamBuilder {
    triples: Option<Triples>,
    n_entity: Option<usize>,
    n_relation: Option<usize>,
    sharding: Option<Arc<Sharding>>,
    devices: (usize, usize, usize),
    host: usize,
    col_shift: u32,
    embedding_dim: usize,
    shard_bs: Option<usize>,
    negatives: usize,
    negative_kind: NegativeKind,
    corruption: Corruption,
    flat_negatives: bool,
    sampler: StreamSampler,
    seeds: (u64, u64, u64),
    steps: Option<usize>,
    inverse_triples: bool,
}

impl Default for BessStreamBuilder {
    fn default() -> Self {
        BessStreamBuilder {
            triples: None,
            n_entity: None,
            n_relation: None,
            sharding: None,
            devices: (1, 1, 4),
            host: 0,
            col_shift: 0,
            embedding_dim: 16,
            shard_bs: None,
            negatives: 0,
            negative_kind: NegativeKind::Random,
            corruption: Corruption::T,
            flat_negatives: true,
            sampler: StreamSampler::Random,
            seeds: (0, 0, 0),
            steps: None,
            inverse_triples: false,
        }
    }
}

impl BessStreamBuilder {
    /// The triples (global ids).
    pub fn triples(mut self, triples: Triples) -> Self {
        self.triples = Some(triples);
        self
    }
    /// Number of entities `E`.
    pub fn n_entity(mut self, n: usize) -> Self {
        self.n_entity = Some(n);
        self
    }
    /// Number of relation types (default: largest relation id + 1).
    pub fn n_relation(mut self, n: usize) -> Self {
        self.n_relation = Some(n);
        self
    }
    /// Reuse a sharding (e.g. [`Sharding::load_npz`] of besskge's) instead of creating one.
    pub fn sharding(mut self, sharding: Arc<Sharding>) -> Self {
        self.sharding = Some(sharding);
        self
    }
    /// Device layout: L, G, S (default 1, 1, 4). The sharding has `N = G·S` shards.
    pub fn devices(mut self, local: usize, global: usize, sc_per_device: usize) -> Self {
        self.devices = (local, global, sc_per_device);
        self
    }
    /// Which host this stream feeds (`0 .. G / L`); every host draws the same steps.
    pub fn host(mut self, host: usize) -> Self {
        self.host = host;
        self
    }
    /// The entity table's `col_shift` (rotation) when its stack puts it behind other tables.
    pub fn col_shift(mut self, shift: u32) -> Self {
        self.col_shift = shift;
        self
    }
    /// Embedding dimension of the entity table in the config (default 16).
    pub fn embedding_dim(mut self, dim: usize) -> Self {
        self.embedding_dim = dim;
        self
    }
    /// Positive triples per SparseCore per batch (besskge's `shard_bs`).
    pub fn shard_batch_size(mut self, bs: usize) -> Self {
        self.shard_bs = Some(bs);
        self
    }
    /// Negatives per shard per list, `k` (0: no negatives feature).
    pub fn negatives(mut self, k: usize) -> Self {
        self.negatives = k;
        self
    }
    /// The negative sampler (default Random).
    pub fn negative_sampler(mut self, kind: NegativeKind) -> Self {
        self.negative_kind = kind;
        self
    }
    /// Corruption scheme (default `t`).
    pub fn corruption(mut self, c: Corruption) -> Self {
        self.corruption = c;
        self
    }
    /// Flat negatives: one list per SparseCore slice (and side) instead of one per triple
    /// (default true).
    pub fn flat_negatives(mut self, on: bool) -> Self {
        self.flat_negatives = on;
        self
    }
    /// The batch sampler (default Random).
    pub fn sampler(mut self, s: StreamSampler) -> Self {
        self.sampler = s;
        self
    }
    /// One seed for the sharding, the batch sampler and the negative sampler (each still owns
    /// an independent generator, as in besskge).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seeds = (seed, seed, seed);
        self
    }
    /// Separate seeds: sharding, batch sampler, negative sampler.
    pub fn seeds(mut self, sharding: u64, batch: u64, negative: u64) -> Self {
        self.seeds = (sharding, batch, negative);
        self
    }
    /// Number of steps to yield (default: one epoch, besskge's `len` for Random and
    /// `len / pss` for Rigid).
    pub fn steps(mut self, steps: usize) -> Self {
        self.steps = Some(steps);
        self
    }
    /// Append inverse triples `(t, r + R, h)`.
    pub fn inverse_triples(mut self, on: bool) -> Self {
        self.inverse_triples = on;
        self
    }

    /// Validates everything and computes the config.
    pub fn build(self) -> Result<BessStream> {
        let triples = self.triples.ok_or_else(|| BessError::param("triples", "missing", "required"))?;
        let n_entity = self.n_entity.ok_or_else(|| BessError::param("n_entity", "missing", "required"))?;
        let shard_bs = self.shard_bs.ok_or_else(|| BessError::param("shard_batch_size", "missing", "required"))?;
        let (l, g, s) = self.devices;
        let layout = SparseCoreLayout::new(l, g, s, self.host)?.with_col_shift(self.col_shift);
        let n = layout.num_sparsecores();
        let sharding = match self.sharding {
            Some(sh) => {
                if sh.n_entity() != n_entity {
                    return Err(BessError::param("n_entity", n_entity, format!("the given sharding has {} entities", sh.n_entity())));
                }
                sh
            }
            None => Arc::new(Sharding::create(n_entity, n, &seed_words(u128::from(self.seeds.0)), None)?),
        };
        layout.check_shards(sharding.n_shard)?;
        if self.embedding_dim == 0 {
            return Err(BessError::param("embedding_dim", 0, "must be at least 1"));
        }
        if let Some(row) = triples.relation.iter().position(|&r| r < 0) {
            return Err(BessError::RelationOutOfRange { column: "relation".into(), row, value: triples.relation[row], n_relation: i64::from(i32::MAX) });
        }
        let n_relation = self.n_relation.unwrap_or_else(|| triples.relation.iter().copied().max().map_or(0, |m| m as usize + 1));
        let mut pb = PartitionedTriples::builder(sharding.clone(), PartitionMode::HtShardPair).n_relation(n_relation).inverse_triples(self.inverse_triples);
        match &self.negative_kind {
            NegativeKind::TypeBased { type_offsets } => pb = pb.type_offsets(type_offsets.clone()),
            NegativeKind::TripleBased { neg_heads, neg_tails } => {
                if let Some(h) = neg_heads {
                    pb = pb.neg_heads(h.clone());
                }
                if let Some(t) = neg_tails {
                    pb = pb.neg_tails(t.clone());
                }
            }
            NegativeKind::Random => {}
        }
        // TypeBased needs the sharding's type tables: recreate a typed one (same permutation).
        let pb = match (&self.negative_kind, sharding.entity_type_counts.is_some()) {
            (NegativeKind::TypeBased { type_offsets }, false) => {
                let typed = Arc::new(Sharding::create(n_entity, n, &seed_words(u128::from(self.seeds.0)), Some(type_offsets))?);
                if typed.shard_and_idx_to_entity != sharding.shard_and_idx_to_entity {
                    return Err(BessError::param("sharding", "untyped", "the TypeBased sampler needs a typed sharding (created with type_offsets)"));
                }
                PartitionedTriples::builder(typed, PartitionMode::HtShardPair)
                    .n_relation(n_relation)
                    .inverse_triples(self.inverse_triples)
                    .type_offsets(type_offsets.clone())
            }
            _ => pb,
        };
        let part = Arc::new(pb.build(&triples)?);
        let sharding = part.sharding.clone();
        // Every shard pair must hold triples: an empty pair's block would be filled with another
        // pair's triples (Rigid) or fail (Random), and the cells would no longer be equal.
        if let Some(p) = part.triple_counts.iter().position(|&c| c == 0) {
            let sampler = match self.sampler {
                StreamSampler::Random => "random batch sampler",
                StreamSampler::Rigid { .. } => "rigid batch sampler",
            };
            return Err(BessError::EmptyPartition { sampler, partition: part.partition_name(p) });
        }
        let kind = match self.sampler {
            StreamSampler::Random => SamplerKind::Random { seed_words: seed_words(u128::from(self.seeds.1)) },
            StreamSampler::Rigid { shuffle } => SamplerKind::Rigid { shuffle: shuffle.then(|| seed_words(u128::from(self.seeds.1))) },
        };
        let options = BatchOptions { shard_bs, batches_per_step: 1, duplicate_batch: false, return_triple_idx: true, kind };
        let sampler = BatchSampler::positives_only(part.clone(), options, self.corruption)?;
        let ppp = sampler.geometry().ppp;
        let neg_words = seed_words(u128::from(self.seeds.2));
        let negative = match (&self.negative_kind, self.negatives) {
            (NegativeKind::TripleBased { .. }, _) => {
                Some(NegativeSampler::TripleBased(Box::new(TripleBasedNegative::new(&part, self.corruption, true, false)?)))
            }
            (_, 0) => None,
            (NegativeKind::Random, k) => Some(NegativeSampler::Random(RandomNegative::new(k, &neg_words, self.corruption, false, self.flat_negatives)?)),
            (NegativeKind::TypeBased { .. }, k) => {
                if self.flat_negatives {
                    return Err(BessError::param("flat_negatives", true, "the TypeBased sampler draws per triple (besskge has no flat format for it)"));
                }
                Some(NegativeSampler::TypeBased(TypeBasedNegative::new(k, &neg_words, self.corruption, false)?))
            }
        };
        let t = n * ppp;
        let (b, k) = match &negative {
            None => (0, 0),
            Some(NegativeSampler::TripleBased(tb)) => {
                let b = if tb.flat_negative_format { if self.corruption == Corruption::Ht { 2 } else { 1 } } else { t };
                (b, tb.padded_shard_length)
            }
            Some(NegativeSampler::Random(r)) => (if r.flat_negative_format { if self.corruption == Corruption::Ht { 2 } else { 1 } } else { t }, r.n_negative),
            Some(NegativeSampler::TypeBased(r)) => (t, r.n_negative),
        };
        let flat = match &negative {
            Some(NegativeSampler::TripleBased(tb)) => tb.flat_negative_format,
            Some(NegativeSampler::Random(r)) => r.flat_negative_format,
            _ => false,
        };
        let neg_rows = n * b * k;
        let rows = t.max(neg_rows);
        let max_ids = 2 * ppp + b * k;
        let coo = s * n * max_ids.div_ceil(8) * 8;
        if max_ids > i32::MAX as usize || coo >= i32::MAX as usize {
            return Err(BessError::param("shard_batch_size", shard_bs, "gives per-partition counts beyond the 32-bit buffers"));
        }
        let counts = CellCounts {
            ppp,
            triples_per_sparsecore: t,
            positive_ids_per_partition: 2 * ppp,
            negative_ids_per_partition: b * k,
            rows_per_sparsecore: rows,
            max_ids_per_partition: max_ids,
            coo_buffer_size_per_device: coo,
        };
        let vocab = n * sharding.max_entity_per_shard();
        let mut features = vec![serde_json::json!({"name": HEAD, "table": TABLE}), serde_json::json!({"name": TAIL, "table": TABLE})];
        if negative.is_some() {
            features.push(serde_json::json!({"name": NEGATIVE, "table": TABLE}));
        }
        let config = Config::from_value(serde_json::json!({
            "version": 1,
            "config": {"local_device_count": l, "global_device_count": g, "num_sc_per_device": s,
                       "allow_id_dropping": false, "stacking": "feature"},
            "tables": [{"name": TABLE, "vocabulary_size": vocab, "embedding_dim": self.embedding_dim, "combiner": "sum",
                        "max_ids_per_partition": max_ids, "max_unique_ids_per_partition": max_ids,
                        "suggested_coo_buffer_size_per_device": coo}],
            "features": features,
        }))?;
        let steps = self.steps.unwrap_or_else(|| sampler.steps_per_epoch());
        let schema = schema(negative.is_some());
        Ok(BessStream { config, layout, part, sampler, negative, counts, neg_b: b, neg_k: k, flat, step: 0, steps, schema, corruption: self.corruption })
    }
}

fn list_field() -> Arc<Field> {
    Arc::new(Field::new_list_field(DataType::Int64, false))
}

fn schema(negatives: bool) -> SchemaRef {
    let list = DataType::List(list_field());
    let mut fields = vec![
        Field::new(HEAD, list.clone(), false),
        Field::new(TAIL, list.clone(), false),
        Field::new("relation", DataType::Int32, true),
        Field::new("triple_mask", DataType::Boolean, false),
        Field::new("triple_idx", DataType::Int64, true),
    ];
    if negatives {
        fields.extend([
            Field::new(NEGATIVE, list, false),
            Field::new("negative_shard", DataType::Int32, true),
            Field::new("negative_triple", DataType::Int32, true),
            Field::new("negative_side", DataType::Int8, true),
            Field::new("negative_mask", DataType::Boolean, true),
        ]);
    }
    Arc::new(Schema::new(fields))
}

/// A list column of at most one id per row: `Some(id)` or an empty list.
fn one_id_lists(ids: &[Option<i64>]) -> Result<ArrayRef> {
    let mut offsets = Vec::with_capacity(ids.len() + 1);
    let mut values = Vec::with_capacity(ids.len());
    offsets.push(0i32);
    for id in ids {
        if let Some(v) = id {
            values.push(*v);
        }
        offsets.push(i32::try_from(values.len()).map_err(|_| BessError::param("rows", ids.len(), "too many for a List column"))?);
    }
    let arr = ListArray::try_new(list_field(), OffsetBuffer::new(ScalarBuffer::from(offsets)), Arc::new(Int64Array::from(values)), None)?;
    Ok(Arc::new(arr))
}

/// BESS batches, negatives and their SparseCore layout, as record batches for the pipeline.
#[derive(Debug, Clone)]
pub struct BessStream {
    config: Config,
    layout: SparseCoreLayout,
    part: Arc<PartitionedTriples>,
    sampler: BatchSampler,
    negative: Option<NegativeSampler>,
    counts: CellCounts,
    neg_b: usize,
    neg_k: usize,
    flat: bool,
    step: usize,
    steps: usize,
    schema: SchemaRef,
    corruption: Corruption,
}

impl BessStream {
    /// Starts a builder.
    pub fn builder() -> BessStreamBuilder {
        BessStreamBuilder::default()
    }

    /// The config to build the [`sparsecore_prep::Preprocessor`] from: one table `entities`
    /// of `N·M` rows, features `head`, `tail` (and `negative`), limits = [`Self::counts`].
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The per-cell counts (computed before any batch).
    #[must_use]
    pub fn counts(&self) -> &CellCounts {
        &self.counts
    }

    /// The SparseCore layout.
    #[must_use]
    pub fn layout(&self) -> &SparseCoreLayout {
        &self.layout
    }

    /// The sharding.
    #[must_use]
    pub fn sharding(&self) -> &Arc<Sharding> {
        &self.part.sharding
    }

    /// The partitioned triples (`triple_idx` points into them).
    #[must_use]
    pub fn partitioned(&self) -> &Arc<PartitionedTriples> {
        &self.part
    }

    /// The batch sampler.
    #[must_use]
    pub fn batch_sampler(&self) -> &BatchSampler {
        &self.sampler
    }

    /// The record batches' schema.
    #[must_use]
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Steps this stream yields.
    #[must_use]
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The physical id of global entity `e` (its shard and local id through the sharding).
    pub fn physical_id_of_entity(&self, e: i64) -> Result<i64> {
        let (s, i) = self.part.sharding.locate(e, "entity", 0)?;
        Ok(self.layout.physical_id(s, i as i64))
    }

    /// Draws step `step` (Random continues its stream whatever `step` is; Rigid takes the
    /// positions of `step`).
    pub fn draw(&mut self, step: usize) -> Result<StreamBatch> {
        let n = self.layout.num_sparsecores();
        let ppp = self.counts.ppp;
        let bess = self.sampler.sample(step)?;
        let si = &bess.sample_idx; // (1, n, n, ppp)
        let mut sample_idx = ArrayD::<i64>::zeros(IxDyn(&[n, n, ppp]));
        for g in 0..n {
            for i in 0..n {
                let j = self.layout.tail_shard(g, i, step);
                for p in 0..ppp {
                    sample_idx[[g, i, p]] = si[[0, i, j, p]];
                }
            }
        }
        let negative = match &mut self.negative {
            Some(ns) => Some(ns.sample(&self.part, &sample_idx.clone().insert_axis(ndarray::Axis(0)))?),
            None => None,
        };
        let record_batch = self.record_batch(step, &bess, &sample_idx, negative.as_ref())?;
        Ok(StreamBatch { step, record_batch, bess, sample_idx, negative })
    }

    fn record_batch(&self, step: usize, bess: &Batch, sample_idx: &ArrayD<i64>, negative: Option<&NegativeOutput>) -> Result<RecordBatch> {
        let lay = &self.layout;
        let n = lay.num_sparsecores();
        let c = &self.counts;
        let (ppp, t, r) = (c.ppp, c.triples_per_sparsecore, c.rows_per_sparsecore);
        let local = lay.local_sparsecores();
        let rows = local * r;
        let triples = &self.part.triples;
        let mut head = Vec::with_capacity(rows);
        let mut tail = Vec::with_capacity(rows);
        let mut relation = Int32Builder::with_capacity(rows);
        let mut mask = BooleanBuilder::with_capacity(rows);
        let mut tidx = Int64Builder::with_capacity(rows);
        let has_neg = negative.is_some();
        let mut neg = Vec::with_capacity(if has_neg { rows } else { 0 });
        let mut neg_shard = Int32Builder::with_capacity(rows);
        let mut neg_triple = Int32Builder::with_capacity(rows);
        let mut neg_side = Int8Builder::with_capacity(rows);
        let mut neg_mask = BooleanBuilder::with_capacity(rows);
        let triple_mask = bess.triple_mask.as_ref();
        let (b, k) = (self.neg_b, self.neg_k);
        let flat = self.flat;
        for slot in 0..local {
            let g = lay.global_sparsecore(slot);
            for row in 0..r {
                if row < t {
                    let (i, jp) = (row / ppp, row % ppp);
                    let j = lay.tail_shard(g, i, step);
                    let idx = sample_idx[[g, i, jp]];
                    let tr = triples.row(idx as usize);
                    head.push(Some(lay.physical_id(i, tr[0])));
                    tail.push(Some(lay.physical_id(j, tr[2])));
                    relation.append_value(tr[1] as i32);
                    mask.append_value(triple_mask.is_none_or(|m| m[[0, i, j, jp]]));
                    tidx.append_value(idx);
                } else {
                    head.push(None);
                    tail.push(None);
                    relation.append_null();
                    mask.append_value(false);
                    tidx.append_null();
                }
                if let Some(no) = negative {
                    let nrows = n * b * k;
                    if row < nrows {
                        let x = row / (b * k);
                        let bb = (row / k) % b;
                        let ii = row % k;
                        let v = no.negative[[0, x, g, bb, ii]];
                        neg.push(Some(lay.physical_id(x, i64::from(v))));
                        neg_shard.append_value(x as i32);
                        let (trip, side) = if flat {
                            (-1, match self.corruption {
                                Corruption::H => 0,
                                Corruption::T => 1,
                                Corruption::Ht => bb as i8,
                            })
                        } else {
                            (bb as i32, match self.corruption {
                                Corruption::H => 0,
                                Corruption::T => 1,
                                Corruption::Ht => i8::from(bb % ppp >= ppp / 2),
                            })
                        };
                        neg_triple.append_value(trip);
                        neg_side.append_value(side);
                        neg_mask.append_value(no.mask.as_ref().is_none_or(|m| m[[0, x, g, bb, ii]]));
                    } else {
                        neg.push(None);
                        neg_shard.append_null();
                        neg_triple.append_null();
                        neg_side.append_null();
                        neg_mask.append_null();
                    }
                }
            }
        }
        let mut columns: Vec<ArrayRef> =
            vec![one_id_lists(&head)?, one_id_lists(&tail)?, Arc::new(relation.finish()), Arc::new(mask.finish()), Arc::new(tidx.finish())];
        if has_neg {
            columns.extend([
                one_id_lists(&neg)?,
                Arc::new(neg_shard.finish()) as ArrayRef,
                Arc::new(neg_triple.finish()),
                Arc::new(neg_side.finish()),
                Arc::new(neg_mask.finish()),
            ]);
        }
        Ok(RecordBatch::try_new(self.schema.clone(), columns)?)
    }
}

impl Iterator for BessStream {
    type Item = Result<StreamBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.step >= self.steps {
            return None;
        }
        let step = self.step;
        self.step += 1;
        Some(self.draw(step))
    }
}
