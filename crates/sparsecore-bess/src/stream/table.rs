//! The stream's triple table: every triple of the partitioned set, in partition order, as
//! (local head, relation, local tail), bit-packed into 32 or 64 bits when they fit.
//!
//! Why: Random and Rigid shuffle read one row per position at random, and preprocessing evicts
//! the table between steps, so those reads miss the caches (and, on 4 KiB pages, the TLB). A
//! packed row is a third (4 bytes) or two thirds (8 bytes) of a 12-byte one, so more of the
//! table survives preprocessing, fewer pages cover it, and no row straddles two cache lines.
//! The physical ids are rebuilt per block: a partition (i, j) holds heads of shard i and tails
//! of shard j, and local id `v` of shard `x` is `v·N + shard_ids[x]` (a shift, N being a power
//! of two).

use crate::error::{BessError, Result};
use crate::layout::SparseCoreLayout;
use crate::partition::PartitionedTriples;

use super::prefetch::prefetch;

/// How a packed row splits: the local head in the low `hbits` bits, then the relation in
/// `rbits`, then the local tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Codec {
    hbits: u32,
    rbits: u32,
}

/// One row of the table.
pub(super) trait Row: Copy + Default {
    /// (local head, relation, local tail).
    fn fields(self, c: Codec) -> (u32, u32, u32);
    /// Prefetches the row's cache lines.
    fn prefetch(&self);
    /// This row type's buffer among `buffers`.
    fn buffer(buffers: &mut RowBuffers) -> &mut Vec<Self>;
}

/// One reusable buffer per row type, kept between steps by code that is generic over the
/// table's row type but must not allocate per step (Rigid's staged rows, the epoch table).
#[derive(Debug, Clone, Default)]
pub(super) struct RowBuffers {
    narrow: Vec<u32>,
    wide: Vec<u64>,
    unpacked: Vec<[u32; 3]>,
}

#[inline(always)]
fn unpack(v: u64, c: Codec) -> (u32, u32, u32) {
    let hmask = (1u64 << c.hbits) - 1;
    let rmask = (1u64 << c.rbits) - 1;
    (
        (v & hmask) as u32,
        ((v >> c.hbits) & rmask) as u32,
        (v >> (c.hbits + c.rbits)) as u32,
    )
}

impl Row for u32 {
    #[inline(always)]
    fn fields(self, c: Codec) -> (u32, u32, u32) {
        unpack(u64::from(self), c)
    }
    #[inline(always)]
    fn prefetch(&self) {
        prefetch(self);
    }
    fn buffer(buffers: &mut RowBuffers) -> &mut Vec<Self> {
        &mut buffers.narrow
    }
}

impl Row for u64 {
    #[inline(always)]
    fn fields(self, c: Codec) -> (u32, u32, u32) {
        unpack(self, c)
    }
    #[inline(always)]
    fn prefetch(&self) {
        prefetch(self);
    }
    fn buffer(buffers: &mut RowBuffers) -> &mut Vec<Self> {
        &mut buffers.wide
    }
}

impl Row for [u32; 3] {
    #[inline(always)]
    fn fields(self, _: Codec) -> (u32, u32, u32) {
        (self[0], self[1], self[2])
    }
    /// Both ends: one row in eight of 12 bytes straddles two cache lines.
    #[inline(always)]
    fn prefetch(&self) {
        prefetch(&self[0]);
        prefetch(&self[2]);
    }
    fn buffer(buffers: &mut RowBuffers) -> &mut Vec<Self> {
        &mut buffers.unpacked
    }
}

/// The rows, in the narrowest form that holds them.
#[derive(Debug, Clone)]
pub(super) enum Rows {
    U32(Vec<u32>),
    U64(Vec<u64>),
    Wide(Vec<[u32; 3]>),
}

/// Turns a row's local ids back into physical ids.
#[derive(Debug, Clone, Copy)]
pub(super) struct Decode {
    codec: Codec,
    /// `log2 N`.
    shift: u32,
}

impl Decode {
    /// (physical head, relation, physical tail) of a row of a partition whose shards' first
    /// physical ids are `(hoff, toff)`.
    #[inline(always)]
    pub(super) fn row<R: Row>(self, row: R, (hoff, toff): (i64, i64)) -> (i64, i32, i64) {
        let (h, r, t) = row.fields(self.codec);
        (
            (i64::from(h) << self.shift) + hoff,
            r as i32,
            (i64::from(t) << self.shift) + toff,
        )
    }
}

/// The triple table.
#[derive(Debug, Clone)]
pub(super) struct Table {
    pub(super) rows: Rows,
    pub(super) decode: Decode,
    /// `shard_ids[x]`: the physical id of local id 0 of shard `x`.
    pub(super) shard_ids: Vec<i64>,
}

/// Bits to hold `x`.
fn bits(x: u64) -> u32 {
    u64::BITS - x.leading_zeros()
}

impl Table {
    /// The table of `part`. The stream checks before that its relations are below `i32::MAX`
    /// and its local ids fit in `i32`; a value that does not is refused here too, as clamping
    /// it would merge it with another (every relation past `i32::MAX` became `i32::MAX`).
    pub(super) fn new(part: &PartitionedTriples, lay: &SparseCoreLayout) -> Result<Self> {
        Self::with_widest(part, lay, 32)
    }

    /// [`Self::new`] in rows of at least `min_bits` bits (32, 64, or more for unpacked).
    pub(super) fn with_widest(
        part: &PartitionedTriples,
        lay: &SparseCoreLayout,
        min_bits: u32,
    ) -> Result<Self> {
        let n = lay.num_sparsecores();
        let max = i64::from(i32::MAX);
        for (row, tr) in part.triples.rows().into_iter().enumerate() {
            // The row of the input (inverse triples numbered after the originals).
            let input = part.triple_sort_idx.get(row).map_or(row, |&i| i as usize);
            if !(0..max).contains(&tr[1]) {
                return Err(BessError::RelationOutOfRange {
                    column: "relation".into(),
                    row: input,
                    value: tr[1],
                    n_relation: max,
                });
            }
            if let Some(c) = [0, 2].into_iter().find(|&c| !(0..=max).contains(&tr[c])) {
                let column = if c == 0 { "head" } else { "tail" };
                return Err(BessError::param(
                    "n_entity",
                    part.sharding.n_entity(),
                    format!(
                        "row {input}: local {column} id {} does not fit in int32",
                        tr[c]
                    ),
                ));
            }
        }
        let field = |row: usize, c: usize| part.triples[[row, c]] as u64;
        let (mut mh, mut mr, mut mt) = (0u64, 0u64, 0u64);
        for row in 0..part.len() {
            mh = mh.max(field(row, 0));
            mr = mr.max(field(row, 1));
            mt = mt.max(field(row, 2));
        }
        let codec = Codec {
            hbits: bits(mh),
            rbits: bits(mr),
        };
        let total = (codec.hbits + codec.rbits + bits(mt)).max(min_bits);
        let pack = |row: usize| {
            field(row, 0)
                | (field(row, 1) << codec.hbits)
                | (field(row, 2) << (codec.hbits + codec.rbits))
        };
        let order = || {
            part.triple_offsets
                .iter()
                .zip(&part.triple_counts)
                .flat_map(|(&off, &cnt)| off.max(0) as usize..(off.max(0) + cnt.max(0)) as usize)
        };
        let rows = if total <= 32 {
            Rows::U32(order().map(|row| pack(row) as u32).collect())
        } else if total <= 63 {
            Rows::U64(order().map(pack).collect())
        } else {
            Rows::Wide(
                order()
                    .map(|row| {
                        [
                            field(row, 0) as u32,
                            field(row, 1) as u32,
                            field(row, 2) as u32,
                        ]
                    })
                    .collect(),
            )
        };
        Ok(Table {
            rows,
            decode: Decode {
                codec,
                shift: n.trailing_zeros(),
            },
            shard_ids: (0..n).map(|s| lay.physical_id(s, 0)).collect(),
        })
    }

    /// The first physical ids of partition `p`'s head and tail shards.
    pub(super) fn offsets(&self, p: usize) -> (i64, i64) {
        let n = self.shard_ids.len();
        (self.shard_ids[p / n], self.shard_ids[p % n])
    }
}

/// Runs `$body` with `$rows` bound to the table's rows as a slice of their type (the body is
/// compiled once per row type).
macro_rules! with_rows {
    ($table:expr, $rows:ident => $body:expr) => {
        match &$table.rows {
            $crate::stream::table::Rows::U32(v) => {
                let $rows = &v[..];
                $body
            }
            $crate::stream::table::Rows::U64(v) => {
                let $rows = &v[..];
                $body
            }
            $crate::stream::table::Rows::Wide(v) => {
                let $rows = &v[..];
                $body
            }
        }
    };
}
pub(super) use with_rows;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::partition::PartitionMode;
    use crate::sharding::Sharding;
    use crate::synth;

    #[test]
    fn a_relation_past_int32_is_refused_not_clamped() {
        let lay = SparseCoreLayout::new(1, 1, 4, 0).unwrap();
        let sharding = Arc::new(Sharding::create(100, 4, &[9], None).unwrap());
        // The partitioning bounds relations by the n_relation it is given, not by int32.
        let triples = crate::Triples::from_rows(&[[0, 1, 2], [3, 3_000_000_000, 4]]);
        let part = PartitionedTriples::builder(sharding, PartitionMode::HtShardPair)
            .n_relation(5_000_000_000)
            .build(&triples)
            .unwrap();
        let e = Table::new(&part, &lay).unwrap_err();
        assert!(
            matches!(
                &e,
                BessError::RelationOutOfRange {
                    row: 1,
                    value: 3_000_000_000,
                    n_relation: 2147483647,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "column `relation`, row 1: relation id 3000000000 is outside 0..2147483647"
        );
    }

    #[test]
    fn every_row_form_gives_the_physical_ids() {
        // Relation ids up to 50, then up to 2^20 (more than 32 bits in all).
        for (big_relation, forms) in [
            (0i64, vec![(32, "u32"), (33, "u64"), (64, "wide")]),
            (1 << 20, vec![(32, "u64"), (64, "wide")]),
        ] {
            let lay = SparseCoreLayout::new(1, 1, 4, 0).unwrap().with_col_shift(3);
            let sharding = Arc::new(Sharding::create(5000, 4, &[9], None).unwrap());
            let mut triples = synth::uniform(5000, 50, 2000, 3);
            triples
                .relation
                .iter_mut()
                .step_by(2)
                .for_each(|r| *r += big_relation);
            let part = PartitionedTriples::builder(sharding, PartitionMode::HtShardPair)
                .build(&triples)
                .unwrap();
            for (min_bits, form) in forms {
                let table = Table::with_widest(&part, &lay, min_bits).unwrap();
                let got = match (&table.rows, form) {
                    (Rows::U32(_), "u32") | (Rows::U64(_), "u64") | (Rows::Wide(_), "wide") => form,
                    (rows, _) => panic!("{form} expected, got {rows:?}"),
                };
                let mut row = 0;
                for p in 0..part.triple_counts.len() {
                    let (off, cnt) = (
                        part.triple_offsets[p] as usize,
                        part.triple_counts[p] as usize,
                    );
                    assert_eq!(off, row, "partitions are stored in order");
                    for k in off..off + cnt {
                        let tr = part.triples.row(k);
                        let want = (
                            lay.physical_id(p / 4, tr[0]),
                            tr[1] as i32,
                            lay.physical_id(p % 4, tr[2]),
                        );
                        let decoded =
                            with_rows!(table, rows => table.decode.row(rows[k], table.offsets(p)));
                        assert_eq!(decoded, want, "{got}, row {k}");
                    }
                    row += cnt;
                }
            }
        }
    }
}
