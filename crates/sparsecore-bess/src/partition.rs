//! Partitioning triples by the shards of their head and tail (besskge's
//! `PartitionedTripleSet.create_from_dataset`, SPEC section 3).
//!
//! Why: a batch that takes the same number of triples from every shard pair `(h, t)` makes
//! every worker gather the same number of head and tail rows. Sorting the triples by partition
//! (stably, a counting sort) lets a sampler address partition `p` as the range
//! `offsets[p] .. offsets[p] + counts[p]`.

use std::sync::Arc;

use arrow_array::{Array, Int32Array, Int64Array, RecordBatch};
use arrow_schema::DataType;
use ndarray::Array2;

use crate::error::{BessError, Result};
use crate::sharding::{check_type_offsets, type_of, Sharding};

/// How triples are assigned to partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PartitionMode {
    /// `n²` partitions by (head shard, tail shard): `ht_shardpair`. Heads and tails become
    /// local ids. This is the mode that balances both gathers.
    HtShardPair,
    /// `n` partitions by head shard: `h_shard`. Heads become local ids.
    HShard,
    /// `n` partitions by tail shard: `t_shard`. Tails become local ids.
    TShard,
}

impl PartitionMode {
    /// besskge's name: `ht_shardpair`, `h_shard` or `t_shard`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionMode::HtShardPair => "ht_shardpair",
            PartitionMode::HShard => "h_shard",
            PartitionMode::TShard => "t_shard",
        }
    }

    /// Parses besskge's name (also `ht`, `h`, `t`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "ht_shardpair" | "ht" => Ok(PartitionMode::HtShardPair),
            "h_shard" | "h" => Ok(PartitionMode::HShard),
            "t_shard" | "t" => Ok(PartitionMode::TShard),
            _ => Err(BessError::param(
                "partition_mode",
                name,
                "must be ht_shardpair, h_shard or t_shard",
            )),
        }
    }

    /// Number of partitions for `n` shards.
    #[must_use]
    pub fn partitions(self, n: usize) -> usize {
        match self {
            PartitionMode::HtShardPair => n * n,
            _ => n,
        }
    }
}

/// Triples `(head, relation, tail)` with global ids, as three equal-length columns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Triples {
    /// Head entity ids.
    pub head: Vec<i64>,
    /// Relation ids.
    pub relation: Vec<i64>,
    /// Tail entity ids.
    pub tail: Vec<i64>,
}

fn column_values(name: &str, a: &dyn Array) -> Result<Vec<i64>> {
    if a.null_count() > 0 {
        let row = (0..a.len()).find(|&i| a.is_null(i)).unwrap_or(0);
        return Err(BessError::NullValue {
            column: name.to_string(),
            row,
        });
    }
    match a.data_type() {
        DataType::Int32 => Ok(a
            .as_any()
            .downcast_ref::<Int32Array>()
            .map(|x| x.values().iter().map(|&v| i64::from(v)).collect())
            .unwrap_or_default()),
        DataType::Int64 => Ok(a
            .as_any()
            .downcast_ref::<Int64Array>()
            .map(|x| x.values().to_vec())
            .unwrap_or_default()),
        other => Err(BessError::ColumnType {
            column: name.to_string(),
            found: other.to_string(),
        }),
    }
}

impl Triples {
    /// Three columns of equal length.
    pub fn new(head: Vec<i64>, relation: Vec<i64>, tail: Vec<i64>) -> Result<Self> {
        for (name, col) in [("relation", &relation), ("tail", &tail)] {
            if col.len() != head.len() {
                return Err(BessError::LengthMismatch {
                    column: name.into(),
                    got: col.len(),
                    other: "head".into(),
                    expected: head.len(),
                });
            }
        }
        Ok(Triples {
            head,
            relation,
            tail,
        })
    }

    /// From rows `[h, r, t]`.
    #[must_use]
    pub fn from_rows(rows: &[[i64; 3]]) -> Self {
        Triples {
            head: rows.iter().map(|r| r[0]).collect(),
            relation: rows.iter().map(|r| r[1]).collect(),
            tail: rows.iter().map(|r| r[2]).collect(),
        }
    }

    /// From three Arrow arrays of Int32 or Int64 (no nulls).
    pub fn from_arrow(head: &dyn Array, relation: &dyn Array, tail: &dyn Array) -> Result<Self> {
        Self::new(
            column_values("head", head)?,
            column_values("relation", relation)?,
            column_values("tail", tail)?,
        )
    }

    /// From a record batch's columns `head`, `relation` and `tail`.
    pub fn from_record_batch(batch: &RecordBatch) -> Result<Self> {
        let col = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| BessError::MissingColumn {
                    column: name.to_string(),
                })
        };
        let (h, r, t) = (col("head")?, col("relation")?, col("tail")?);
        Self::from_arrow(h.as_ref(), r.as_ref(), t.as_ref())
    }

    /// Number of triples.
    #[must_use]
    pub fn len(&self) -> usize {
        self.head.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.head.is_empty()
    }
}

/// A set of triples sorted by partition, with local entity ids (besskge's
/// `PartitionedTripleSet`). Every index a sampler returns points into [`Self::triples`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionedTriples {
    /// The entity sharding used.
    pub sharding: Arc<Sharding>,
    /// Partition mode.
    pub mode: PartitionMode,
    /// Whether inverse triples `(t, r + R, h)` were appended.
    pub inverse_triples: bool,
    /// `[N, 3]` sorted triples; entity columns are local ids where the mode says so.
    pub triples: Array2<i64>,
    /// `[P]` triples per partition (`P = n²` flattened row-major, or `n`).
    pub triple_counts: Vec<i64>,
    /// `[P]` exclusive prefix sum of `triple_counts`.
    pub triple_offsets: Vec<i64>,
    /// `[N]` the stable sort of the rows by partition: sorted row `i` is input row
    /// `triple_sort_idx[i]`.
    pub triple_sort_idx: Vec<i64>,
    /// `[N, 2]` head and tail entity types (typed sets only).
    pub types: Option<Array2<i64>>,
    /// `[1 or N, k]` negative heads (global ids), in sorted order.
    pub neg_heads: Option<Array2<i64>>,
    /// `[1 or N, k]` negative tails (global ids), in sorted order.
    pub neg_tails: Option<Array2<i64>>,
}

/// Builds a [`PartitionedTriples`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PartitionBuilder {
    sharding: Arc<Sharding>,
    mode: PartitionMode,
    n_relation: Option<i64>,
    inverse: bool,
    type_offsets: Option<Vec<i64>>,
    neg_heads: Option<Array2<i64>>,
    neg_tails: Option<Array2<i64>>,
}

impl PartitionBuilder {
    /// Number of relation types `R`: relation ids are checked against it, and inverse triples
    /// get relation `r + R`.
    pub fn n_relation(mut self, n_relation: usize) -> Self {
        self.n_relation = Some(n_relation as i64);
        self
    }

    /// Appends the inverse triple `(t, r + R, h)` of every triple (needs [`Self::n_relation`]).
    pub fn inverse_triples(mut self, on: bool) -> Self {
        self.inverse = on;
        self
    }

    /// Entity types by global id ranges `[0, o1, o2, ...]`, for the `types` table the
    /// TypeBased negative sampler reads.
    pub fn type_offsets(mut self, offsets: Vec<i64>) -> Self {
        self.type_offsets = Some(offsets);
        self
    }

    /// Negative heads per triple `(N0, k)` or shared `(1, k)`, global ids, in input order.
    pub fn neg_heads(mut self, neg: Array2<i64>) -> Self {
        self.neg_heads = Some(neg);
        self
    }

    /// Negative tails per triple `(N0, k)` or shared `(1, k)`, global ids, in input order.
    pub fn neg_tails(mut self, neg: Array2<i64>) -> Self {
        self.neg_tails = Some(neg);
        self
    }

    /// Validates and partitions `triples`.
    pub fn build(self, triples: &Triples) -> Result<PartitionedTriples> {
        let sh = &self.sharding;
        let n = sh.n_shard;
        let n0 = triples.len();
        if triples.relation.len() != n0 || triples.tail.len() != n0 {
            let (column, got) = if triples.relation.len() != n0 {
                ("relation", triples.relation.len())
            } else {
                ("tail", triples.tail.len())
            };
            return Err(BessError::LengthMismatch {
                column: column.into(),
                got,
                other: "head".into(),
                expected: n0,
            });
        }
        if n0 == 0 {
            return Err(BessError::param("triples", 0, "need at least one triple"));
        }
        let rel_limit = self.n_relation.unwrap_or(i64::from(i32::MAX));
        if self.inverse && self.n_relation.is_none() {
            return Err(BessError::param(
                "inverse_triples",
                true,
                "needs n_relation (inverse relations are r + n_relation)",
            ));
        }
        if self.inverse && rel_limit > i64::from(i32::MAX) / 2 {
            return Err(BessError::param(
                "n_relation",
                rel_limit,
                "2 * n_relation must fit in int32 with inverse triples",
            ));
        }
        let mut shards = Vec::with_capacity(n0 * 2);
        for row in 0..n0 {
            let (hs, _) = sh.locate(triples.head[row], "head", row)?;
            let (ts, _) = sh.locate(triples.tail[row], "tail", row)?;
            let r = triples.relation[row];
            if r < 0 || r >= rel_limit {
                return Err(BessError::RelationOutOfRange {
                    column: "relation".into(),
                    row,
                    value: r,
                    n_relation: rel_limit,
                });
            }
            shards.push((hs, ts));
        }
        let rows = if self.inverse { 2 * n0 } else { n0 };
        if rows > i64::MAX as usize / 4 {
            return Err(BessError::param("triples", rows, "too many"));
        }
        // Row i: (h, r, t) global; inverse rows follow the originals.
        let row_of = |i: usize| -> (i64, i64, i64, usize, usize) {
            if i < n0 {
                (
                    triples.head[i],
                    triples.relation[i],
                    triples.tail[i],
                    shards[i].0,
                    shards[i].1,
                )
            } else {
                let j = i - n0;
                (
                    triples.tail[j],
                    triples.relation[j] + rel_limit,
                    triples.head[j],
                    shards[j].1,
                    shards[j].0,
                )
            }
        };
        let p_count = self.mode.partitions(n);
        let pid = |hs: usize, ts: usize| match self.mode {
            PartitionMode::HtShardPair => hs * n + ts,
            PartitionMode::HShard => hs,
            PartitionMode::TShard => ts,
        };
        let mut counts = vec![0i64; p_count];
        for i in 0..rows {
            let (_, _, _, hs, ts) = row_of(i);
            counts[pid(hs, ts)] += 1;
        }
        let mut offsets = vec![0i64; p_count];
        for p in 1..p_count {
            offsets[p] = offsets[p - 1] + counts[p - 1];
        }
        let mut cursor = offsets.clone();
        let mut sort_idx = vec![0i64; rows];
        for i in 0..rows {
            let (_, _, _, hs, ts) = row_of(i);
            let p = pid(hs, ts);
            sort_idx[cursor[p] as usize] = i as i64;
            cursor[p] += 1;
        }
        let mut sorted = Array2::<i64>::zeros((rows, 3));
        for (k, &i) in sort_idx.iter().enumerate() {
            let (h, r, t, _, _) = row_of(i as usize);
            let local = |e: i64| sh.entity_to_idx[e as usize];
            let (h, t) = match self.mode {
                PartitionMode::HtShardPair => (local(h), local(t)),
                PartitionMode::HShard => (local(h), t),
                PartitionMode::TShard => (h, local(t)),
            };
            sorted[[k, 0]] = h;
            sorted[[k, 1]] = r;
            sorted[[k, 2]] = t;
        }
        let types = match &self.type_offsets {
            None => None,
            Some(offsets_t) => {
                check_type_offsets(offsets_t, sh.n_entity())?;
                let mut ty = Array2::<i64>::zeros((rows, 2));
                for (k, &i) in sort_idx.iter().enumerate() {
                    let (h, _, t, _, _) = row_of(i as usize);
                    ty[[k, 0]] = type_of(offsets_t, h);
                    ty[[k, 1]] = type_of(offsets_t, t);
                }
                Some(ty)
            }
        };
        let check_neg = |name: &str, a: &Array2<i64>| -> Result<()> {
            if a.nrows() != 1 && a.nrows() != n0 {
                return Err(BessError::LengthMismatch {
                    column: name.into(),
                    got: a.nrows(),
                    other: "head".into(),
                    expected: n0,
                });
            }
            if a.ncols() == 0 {
                return Err(BessError::param(
                    "n_negative",
                    0,
                    format!("`{name}` has no negatives per row"),
                ));
            }
            for (idx, &e) in a.iter().enumerate() {
                if e < 0 || e as usize >= sh.n_entity() {
                    return Err(BessError::EntityOutOfRange {
                        column: name.into(),
                        row: idx / a.ncols(),
                        value: e,
                        n_entity: sh.n_entity(),
                    });
                }
            }
            Ok(())
        };
        if let Some(a) = &self.neg_heads {
            check_neg("neg_heads", a)?;
        }
        if let Some(a) = &self.neg_tails {
            check_neg("neg_tails", a)?;
        }
        let reorder = |a: &Array2<i64>| -> Array2<i64> {
            let k = a.ncols();
            Array2::from_shape_fn((sort_idx.len(), k), |(row, c)| {
                a[[sort_idx[row] as usize, c]]
            })
        };
        let broadcast = |a: &Array2<i64>| -> Array2<i64> {
            Array2::from_shape_fn((n0, a.ncols()), |(r, c)| {
                a[[if a.nrows() == 1 { 0 } else { r }, c]]
            })
        };
        let (neg_heads, neg_tails) = if self.inverse {
            match (&self.neg_heads, &self.neg_tails) {
                (None, None) => (None, None),
                (Some(nh), Some(nt)) => {
                    if nh.ncols() != nt.ncols() {
                        return Err(BessError::LengthMismatch {
                            column: "neg_tails (negatives per row)".into(),
                            got: nt.ncols(),
                            other: "neg_heads".into(),
                            expected: nh.ncols(),
                        });
                    }
                    let (bh, bt) = (broadcast(nh), broadcast(nt));
                    let ext_h = ndarray::concatenate(ndarray::Axis(0), &[bh.view(), bt.view()])
                        .map_err(|e| BessError::param("neg_heads", "shape", e.to_string()))?;
                    let ext_t = ndarray::concatenate(ndarray::Axis(0), &[bt.view(), bh.view()])
                        .map_err(|e| BessError::param("neg_tails", "shape", e.to_string()))?;
                    (Some(reorder(&ext_h)), Some(reorder(&ext_t)))
                }
                _ => return Err(BessError::param(
                    "neg_heads/neg_tails",
                    "one of them",
                    "with inverse triples, give both negative heads and negative tails, or neither",
                )),
            }
        } else {
            let r = |a: &Option<Array2<i64>>| {
                a.as_ref().map(|a| {
                    if a.nrows() == 1 {
                        a.clone()
                    } else {
                        reorder(a)
                    }
                })
            };
            (r(&self.neg_heads), r(&self.neg_tails))
        };
        Ok(PartitionedTriples {
            sharding: self.sharding.clone(),
            mode: self.mode,
            inverse_triples: self.inverse,
            triples: sorted,
            triple_counts: counts,
            triple_offsets: offsets,
            triple_sort_idx: sort_idx,
            types,
            neg_heads,
            neg_tails,
        })
    }
}

impl PartitionedTriples {
    /// Starts a builder over `sharding` in `mode`.
    pub fn builder(sharding: Arc<Sharding>, mode: PartitionMode) -> PartitionBuilder {
        PartitionBuilder {
            sharding,
            mode,
            n_relation: None,
            inverse: false,
            type_offsets: None,
            neg_heads: None,
            neg_tails: None,
        }
    }

    /// Number of shards `n`.
    #[must_use]
    pub fn n_shard(&self) -> usize {
        self.sharding.n_shard
    }

    /// Number of partitions `P`.
    #[must_use]
    pub fn n_partitions(&self) -> usize {
        self.triple_counts.len()
    }

    /// Number of (sorted) triples `N`.
    #[must_use]
    pub fn len(&self) -> usize {
        self.triples.nrows()
    }

    /// Whether there are no triples (never, for a built set).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.triples.nrows() == 0
    }

    /// Partition `p` as text: `(h, t)` for shard pairs, else the shard.
    #[must_use]
    pub fn partition_name(&self, p: usize) -> String {
        match self.mode {
            PartitionMode::HtShardPair => format!(
                "(head shard {}, tail shard {})",
                p / self.n_shard(),
                p % self.n_shard()
            ),
            _ => format!("shard {p}"),
        }
    }
}
