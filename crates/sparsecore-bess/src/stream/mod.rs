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
//!   `j`): `head` and `tail` (`List<Int64>` of one physical id), `relation` (`Int32`) and
//!   `triple_mask` (`Boolean`; Rigid's cyclic padding is false);
//! - rows `0 .. NEG` (`NEG = n·B·K`) carry one negative each: `negative` (`List<Int64>` of one
//!   physical id), drawn from shard `row / (B·K)`, list `(row / K) mod B`; with TripleBased
//!   negatives, `negative_mask` (`Boolean`, false for its padding);
//! - `R = max(T, NEG)`; past `T` (or `NEG`) the id lists are empty and the plain columns null
//!   (`triple_mask` false).
//!
//! With [`BessStreamBuilder::annotations`], also `triple_idx` (`Int64`, the row of
//! [`PartitionedTriples::triples`]), `negative_shard` (`Int32`), `negative_triple` (`Int32`:
//! the slice row of the triple a per-triple negative belongs to, −1 for flat lists shared by
//! the slice) and `negative_side` (`Int8`: 0 replaces the head, 1 the tail).
//!
//! One negative per row, so that each negative's embedding comes back as its own activation
//! row. The features `head`, `tail` and `negative` all index the table `entities`, so they form
//! one stack.

use std::sync::Arc;

use arrow_array::{ArrayRef, BooleanArray, RecordBatch};
use arrow_schema::SchemaRef;
use ndarray::{Array2, ArrayD, IxDyn};
use sparsecore_prep::Config;

use crate::batch::{BatchOptions, BatchSampler, SamplerKind};
use crate::error::{BessError, Result};
use crate::layout::SparseCoreLayout;
use crate::negative::{
    Corruption, NegativeOutput, NegativeSampler, RandomNegative, TripleBasedNegative,
    TypeBasedNegative,
};
use crate::partition::{PartitionMode, PartitionedTriples, Triples};
use crate::rng::seed_words;
use crate::sharding::Sharding;

mod columns;
mod epoch;
mod prefetch;
mod rigid;
mod table;

use columns::{one_id_offsets, schema, validity, Columns, Parts, Scratch, Shared};
pub use columns::{CellCounts, HEAD, NEGATIVE, TAIL};
use rigid::Rigid;
use table::Table;

/// Negatives per step (all SparseCores) from which uniform negatives are drawn on a second
/// thread while the positives are drawn.
const PARALLEL_NEGATIVES: usize = 1 << 16;

/// The entity table's name in the config.
pub const TABLE: &str = "entities";

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

/// One step of the stream.
#[derive(Debug, Clone)]
pub struct StreamBatch {
    /// The step number.
    pub step: usize,
    /// The record batch to preprocess.
    pub record_batch: RecordBatch,
    /// With annotations: `[n, n, ppp]`, SparseCore-major: `[g][i][j]` is the `j`-th triple
    /// SparseCore `g` takes from head shard `i` (a row of [`PartitionedTriples::triples`]).
    pub sample_idx: Option<ArrayD<i64>>,
    /// With annotations, Rigid only: `[n·n·ppp]` in `sample_idx`'s order, false for cyclic
    /// padding.
    pub triple_mask: Option<Vec<bool>>,
    /// With annotations: the negative sampler's output for `sample_idx` (axis 1: the shard
    /// drawn from; axis 2: the SparseCore that uses them).
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
    annotations: bool,
    max_step_bytes: Option<usize>,
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
            annotations: false,
            max_step_bytes: None,
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
    /// Number of steps to yield, at least 1 (default: one epoch, besskge's `len` for Random
    /// and `len / pss` for Rigid).
    pub fn steps(mut self, steps: usize) -> Self {
        self.steps = Some(steps);
        self
    }
    /// Add the annotation columns `triple_idx`, `negative_shard`, `negative_triple` and
    /// `negative_side`, and keep the samplers' arrays in [`StreamBatch`] (default off: the
    /// pipeline reads none of them, and building them costs as much as a feature column).
    pub fn annotations(mut self, on: bool) -> Self {
        self.annotations = on;
        self
    }
    /// Append inverse triples `(t, r + R, h)`.
    pub fn inverse_triples(mut self, on: bool) -> Self {
        self.inverse_triples = on;
        self
    }
    /// The most memory a step may need ([`BessStream::step_bytes`]); a stream that needs more
    /// is refused by [`Self::build`] with [`BessError::TooLarge`] (default: no cap but what
    /// the allocator gives).
    pub fn max_step_bytes(mut self, bytes: usize) -> Self {
        self.max_step_bytes = Some(bytes);
        self
    }

    /// Validates everything and computes the config.
    pub fn build(self) -> Result<BessStream> {
        let triples = self
            .triples
            .ok_or_else(|| BessError::param("triples", "missing", "required"))?;
        let n_entity = self
            .n_entity
            .ok_or_else(|| BessError::param("n_entity", "missing", "required"))?;
        let shard_bs = self
            .shard_bs
            .ok_or_else(|| BessError::param("shard_batch_size", "missing", "required"))?;
        if self.steps == Some(0) {
            return Err(BessError::param("steps", 0, "must be at least 1"));
        }
        let (l, g, s) = self.devices;
        let layout = SparseCoreLayout::new(l, g, s, self.host)?.with_col_shift(self.col_shift);
        let n = layout.num_sparsecores();
        let sharding = match self.sharding {
            Some(sh) => {
                if sh.n_entity() != n_entity {
                    return Err(BessError::param(
                        "n_entity",
                        n_entity,
                        format!("the given sharding has {} entities", sh.n_entity()),
                    ));
                }
                sh
            }
            None => Arc::new(Sharding::create(
                n_entity,
                n,
                &seed_words(u128::from(self.seeds.0)),
                None,
            )?),
        };
        layout.check_shards(sharding.n_shard)?;
        if self.embedding_dim == 0 {
            return Err(BessError::param("embedding_dim", 0, "must be at least 1"));
        }
        // The batches' `relation` column is Int32, but the partitioning bounds relation ids by
        // `n_relation` only (by default the largest id + 1): ids and counts past it stop here,
        // with the partitioning's own default bound (`0..i32::MAX`).
        let rel_limit = i64::from(i32::MAX);
        if let Some(row) = triples
            .relation
            .iter()
            .position(|&r| !(0..rel_limit).contains(&r))
        {
            return Err(BessError::RelationOutOfRange {
                column: "relation".into(),
                row,
                value: triples.relation[row],
                n_relation: rel_limit,
            });
        }
        if let Some(nr) = self.n_relation.filter(|&nr| nr > i32::MAX as usize) {
            return Err(BessError::param(
                "n_relation",
                nr,
                format!(
                    "the `relation` column is Int32: at most {} relation types",
                    i32::MAX
                ),
            ));
        }
        let n_relation = self.n_relation.unwrap_or_else(|| {
            triples
                .relation
                .iter()
                .copied()
                .max()
                .map_or(0, |m| m as usize + 1)
        });
        let mut pb = PartitionedTriples::builder(sharding.clone(), PartitionMode::HtShardPair)
            .n_relation(n_relation)
            .inverse_triples(self.inverse_triples);
        match &self.negative_kind {
            NegativeKind::TypeBased { type_offsets } => pb = pb.type_offsets(type_offsets.clone()),
            NegativeKind::TripleBased {
                neg_heads,
                neg_tails,
            } => {
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
                let typed = Arc::new(Sharding::create(
                    n_entity,
                    n,
                    &seed_words(u128::from(self.seeds.0)),
                    Some(type_offsets),
                )?);
                if typed.shard_and_idx_to_entity != sharding.shard_and_idx_to_entity {
                    return Err(BessError::param(
                        "sharding",
                        "untyped",
                        "the TypeBased sampler needs a typed sharding (created with type_offsets)",
                    ));
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
            return Err(BessError::EmptyPartition {
                sampler,
                partition: part.partition_name(p),
            });
        }
        let kind = match self.sampler {
            StreamSampler::Random => SamplerKind::Random {
                seed_words: seed_words(u128::from(self.seeds.1)),
            },
            StreamSampler::Rigid { shuffle } => SamplerKind::Rigid {
                shuffle: shuffle.then(|| seed_words(u128::from(self.seeds.1))),
            },
        };
        let options = BatchOptions {
            shard_bs,
            batches_per_step: 1,
            duplicate_batch: false,
            return_triple_idx: true,
            kind,
        };
        let sampler = BatchSampler::positives_only(part.clone(), options, self.corruption)?;
        let ppp = sampler.geometry().positive_per_partition;
        let neg_words = seed_words(u128::from(self.seeds.2));
        let negative = match (&self.negative_kind, self.negatives) {
            (NegativeKind::TripleBased { .. }, _) => Some(NegativeSampler::TripleBased(Box::new(
                TripleBasedNegative::new(&part, self.corruption, true, false)?,
            ))),
            (_, 0) => None,
            (NegativeKind::Random, k) => Some(NegativeSampler::Random(RandomNegative::new(
                k,
                &neg_words,
                self.corruption,
                false,
                self.flat_negatives,
            )?)),
            (NegativeKind::TypeBased { .. }, k) => {
                if self.flat_negatives {
                    return Err(BessError::param("flat_negatives", true, "the TypeBased sampler draws per triple (besskge has no flat format for it)"));
                }
                Some(NegativeSampler::TypeBased(TypeBasedNegative::new(
                    k,
                    &neg_words,
                    self.corruption,
                    false,
                )?))
            }
        };
        let t = n * ppp;
        let (b, k) = match &negative {
            None => (0, 0),
            Some(NegativeSampler::TripleBased(tb)) => {
                let b = if tb.flat_negative_format {
                    if self.corruption == Corruption::Ht {
                        2
                    } else {
                        1
                    }
                } else {
                    t
                };
                (b, tb.padded_shard_length)
            }
            Some(NegativeSampler::Random(r)) => (
                if r.flat_negative_format {
                    if self.corruption == Corruption::Ht {
                        2
                    } else {
                        1
                    }
                } else {
                    t
                },
                r.n_negative,
            ),
            Some(NegativeSampler::TypeBased(r)) => (t, r.n_negative),
        };
        let flat = match &negative {
            Some(NegativeSampler::TripleBased(tb)) => tb.flat_negative_format,
            Some(NegativeSampler::Random(r)) => r.flat_negative_format,
            _ => false,
        };
        // Every count below must fit the pipeline's 32-bit buffers, and a batch's rows an Arrow
        // List column: checked, never wrapped.
        let limit = i32::MAX as u128;
        let (n_, b_, k_, ppp_) = (n as u128, b as u128, k as u128, ppp as u128);
        let max_ids_ = 2 * ppp_ + b_ * k_;
        let rows_ = (n_ * ppp_).max(n_ * b_ * k_);
        let coo_ = s as u128 * n_ * max_ids_.div_ceil(8) * 8;
        if max_ids_ > limit || coo_ >= limit || rows_ * layout.local_sparsecores() as u128 >= limit
        {
            return Err(BessError::param(
                "shard_batch_size / negatives",
                format!("{shard_bs} / {}", self.negatives),
                "give per-partition counts, buffers or rows beyond the pipeline's 32-bit buffers",
            ));
        }
        let neg_rows = n * b * k;
        let rows = t.max(neg_rows);
        let local = layout.local_sparsecores();
        let step_bytes = step_bytes(
            local,
            (n, t, rows, neg_rows),
            !matches!(negative, None | Some(NegativeSampler::Random(_))) || self.annotations,
        );
        let too_large = |reason: String| {
            BessError::TooLarge {
            what: format!(
                "a step of layout {l}/{g}/{s} ({local} SparseCores on this host), shard batch size {shard_bs} ({t} triples per SparseCore) \
                 and {b} negative lists of {k} per shard ({neg_rows} negative rows per SparseCore; negatives = {})",
                self.negatives
            ),
            bytes: step_bytes,
            reason,
        }
        };
        if let Some(cap) = self.max_step_bytes.filter(|&cap| step_bytes > cap as u128) {
            return Err(too_large(format!("more than max_step_bytes = {cap}")));
        }
        // Asked of the allocator once, before anything is drawn (address space only: nothing is
        // touched, and it is given back at once), so that a step the process cannot hold is an
        // error here and not an abort on whichever allocation fails first.
        if usize::try_from(step_bytes).map_or(true, |bytes| {
            Vec::<u8>::new().try_reserve_exact(bytes).is_err()
        }) {
            return Err(too_large(
                "the allocator refuses that much (the memory available, or `ulimit -v`); use fewer negatives, a smaller shard \
                 batch size or fewer SparseCores per host"
                    .into(),
            ));
        }
        let max_ids = 2 * ppp + b * k;
        let coo = s * n * max_ids.div_ceil(8) * 8;
        let counts = CellCounts {
            positive_per_partition: ppp,
            triples_per_sparsecore: t,
            positive_ids_per_partition: 2 * ppp,
            negative_ids_per_partition: b * k,
            rows_per_sparsecore: rows,
            max_ids_per_partition: max_ids,
            coo_buffer_size_per_device: coo,
        };
        let vocab = n * sharding.max_entity_per_shard();
        let mut features = vec![
            serde_json::json!({"name": HEAD, "table": TABLE}),
            serde_json::json!({"name": TAIL, "table": TABLE}),
        ];
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
        let columns = Columns {
            negatives: negative.is_some(),
            negative_mask: matches!(negative, Some(NegativeSampler::TripleBased(_))),
            annotations: self.annotations,
        };
        let schema = schema(columns);
        if vocab > i32::MAX as usize {
            return Err(BessError::param(
                "n_entity",
                n_entity,
                "N * ceil(E / N) physical ids must fit in int32",
            ));
        }
        let table = Table::new(&part, &layout)?;
        let rigid = match self.sampler {
            StreamSampler::Rigid { shuffle: false } => Some(Arc::new(Rigid::new(
                &part,
                &table,
                &layout,
                ppp,
                sampler.steps_per_epoch(),
            ))),
            _ => None,
        };
        let full_mask: ArrayRef = Arc::new(BooleanArray::from_iter(
            (0..local).flat_map(|_| (0..rows).map(|row| Some(row < t))),
        ));
        let shared = Shared {
            pos_offsets: one_id_offsets(local, t, rows)?,
            neg_offsets: one_id_offsets(local, neg_rows, rows)?,
            pos_valid: validity(local, t, rows),
            neg_valid: validity(local, neg_rows, rows),
            full_mask,
            shard_ids: table.shard_ids.clone(),
        };
        Ok(BessStream {
            config,
            layout,
            part,
            table,
            rigid,
            sampler,
            negative,
            counts,
            step_bytes,
            neg_b: b,
            neg_k: k,
            flat,
            step: 0,
            steps,
            schema,
            columns,
            corruption: self.corruption,
            shared,
            scratch: Scratch::default(),
        })
    }
}

/// Bytes a stream holds for a step, at least: the `head` and `negative` list offsets every batch
/// shares (4 bytes a row each), and one step's `relation` (4 a row), `head` and `tail` values and
/// the positives' rows of the triple table (8 + 8 + 4 a triple), `negative` values (8 a
/// negative) and, with annotations or a per-triple sampler other than Random, every
/// SparseCore's negatives as the sampler's array (4 each), for `local` SparseCores of `(n, T, R,
/// NEG)`: shards, triples, rows and negative rows per SparseCore. Saturates at `u128::MAX`.
fn step_bytes(
    local: usize,
    (n, t, rows, neg_rows): (usize, usize, usize, usize),
    all_negatives: bool,
) -> u128 {
    let [local, n, t, rows, neg_rows] = [local, n, t, rows, neg_rows].map(|x| x as u128);
    let terms = [
        local
            .checked_mul(rows)
            .and_then(|r| r.checked_mul(4 + 4 + 4)),
        local.checked_mul(t).and_then(|r| r.checked_mul(8 + 8 + 4)),
        local.checked_mul(neg_rows).and_then(|r| r.checked_mul(8)),
        if all_negatives {
            n.checked_mul(neg_rows).and_then(|r| r.checked_mul(4))
        } else {
            Some(0)
        },
    ];
    terms
        .into_iter()
        .try_fold(0u128, |sum, x| sum.checked_add(x?))
        .unwrap_or(u128::MAX)
}

/// BESS batches, negatives and their SparseCore layout, as record batches for the pipeline.
#[derive(Debug, Clone)]
pub struct BessStream {
    config: Config,
    layout: SparseCoreLayout,
    part: Arc<PartitionedTriples>,
    table: Table,
    /// Rigid without shuffle: how its steps are read without index arrays.
    rigid: Option<Arc<Rigid>>,
    sampler: BatchSampler,
    negative: Option<NegativeSampler>,
    counts: CellCounts,
    step_bytes: u128,
    neg_b: usize,
    neg_k: usize,
    flat: bool,
    step: usize,
    steps: usize,
    schema: SchemaRef,
    columns: Columns,
    corruption: Corruption,
    shared: Shared,
    scratch: Scratch,
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

    /// The memory a step needs, at least ([`BessStreamBuilder::max_step_bytes`]): what every
    /// batch shares (list offsets) and one step's columns, scratch and draws.
    #[must_use]
    pub fn step_bytes(&self) -> u128 {
        self.step_bytes
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
    /// positions of `step`). Uniform negatives do not depend on the positives, so in steps with
    /// many of them they are drawn and laid out on a second thread while the positives are.
    pub fn draw(&mut self, step: usize) -> Result<StreamBatch> {
        let parts = Parts {
            layout: &self.layout,
            counts: &self.counts,
            table: &self.table,
            rigid: self.rigid.as_deref(),
            neg_b: self.neg_b,
            neg_k: self.neg_k,
            flat: self.flat,
            corruption: self.corruption,
            columns: self.columns,
            shared: &self.shared,
        };
        let (sampler, part) = (&mut self.sampler, &self.part);
        let Scratch {
            pos,
            neg,
            neg_values,
        } = &mut self.scratch;
        let keep = self.columns.annotations;
        let f = self.counts.triples_per_sparsecore;
        let n = parts.layout.num_sparsecores();
        let (mut columns, rigid, negative) = match &mut self.negative {
            Some(NegativeSampler::Random(rn)) => {
                let mut positives = || parts.positives(sampler, step, pos, keep);
                let mut negatives = || -> Result<Vec<ArrayRef>> {
                    if keep {
                        rn.draw_into(part, 1, f, neg)?;
                        parts.negative_columns(neg, None, neg_values)
                    } else {
                        Ok(vec![parts.random_negative_column(rn, part, neg_values)?])
                    }
                };
                // Waking a second thread costs more than small steps take, so only steps with
                // many negatives draw them on a second thread.
                let (p, ng) =
                    if self.counts.negative_ids_per_partition * n * n >= PARALLEL_NEGATIVES {
                        rayon::join(positives, negatives)
                    } else {
                        (positives(), negatives())
                    };
                let (mut columns, rigid) = p?;
                columns.extend(ng?);
                let kept = keep.then(|| NegativeOutput {
                    negative: ArrayD::from_shape_vec(
                        IxDyn(&[1, n, n, parts.neg_b, parts.neg_k]),
                        neg.clone(),
                    )
                    .expect("drawn shape"),
                    mask: None,
                    sort_idx: None,
                });
                (columns, rigid, kept)
            }
            Some(ns) => {
                let (mut columns, rigid) = parts.positives(sampler, step, pos, true)?;
                let shape = [1, n, n, parts.counts.positive_per_partition];
                let si = ArrayD::from_shape_vec(IxDyn(&shape), pos.sidx.clone())
                    .expect("n * n * ppp indices");
                let no = ns.sample(part, &si)?;
                let flat_neg = no.negative.as_slice().expect("standard layout");
                let flat_mask = no
                    .mask
                    .as_ref()
                    .map(|m| m.as_slice().expect("standard layout"));
                columns.extend(parts.negative_columns(flat_neg, flat_mask, neg_values)?);
                (columns, rigid, keep.then_some(no))
            }
            None => {
                let (columns, rigid) = parts.positives(sampler, step, pos, keep)?;
                (columns, rigid, None)
            }
        };
        let record_batch = RecordBatch::try_new(self.schema.clone(), std::mem::take(&mut columns))?;
        let n = self.layout.num_sparsecores();
        let ppp = self.counts.positive_per_partition;
        let sample_idx = keep.then(|| {
            ArrayD::from_shape_vec(IxDyn(&[n, n, ppp]), self.scratch.pos.sidx.clone())
                .expect("n * n * ppp indices")
        });
        let triple_mask = (keep && rigid).then(|| self.scratch.pos.smask.clone());
        Ok(StreamBatch {
            step,
            record_batch,
            sample_idx,
            triple_mask,
            negative,
        })
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
