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
//!
//! The samplers' column writers (`columns`, `rigid`, `epoch`) share from here what works on
//! the table's rows: their decoding into the columns ([`decode_slots`]), the bounds of the
//! tables of rows laid out per stream ([`SLICES_MAX_ROWS_PER_TRIPLE`], [`SLICES_MAX_BYTES`]),
//! and the packing of row masks ([`pack_bools`]).

use arrow_buffer::{BooleanBuffer, Buffer};

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

/// The most rows a [`RigidSlices`](super::rigid::RigidSlices) may hold per triple of the graph
/// (so at most 240 bytes per triple, against the triple table's 4 to 12). Each row costs 20
/// bytes (two `Int64` ids and an `Int32` relation), and a table holds every padded position
/// about twice (see `rigid::Order`): uniform graphs, which pad little, need 2–3 rows per triple
/// at any `n`, the power-law graph of MEASUREMENTS.md about 11 at n = 16 (5.5 positions per
/// triple); at n = 64 its blocks are padded to the hub pair's size (55 positions per triple)
/// and it copies runs instead. Rigid shuffle's epoch table (`super::epoch`) takes the same
/// bounds, in its packed rows.
pub(super) const SLICES_MAX_ROWS_PER_TRIPLE: usize = 12;

/// The most bytes a [`RigidSlices`](super::rigid::RigidSlices) may take, whatever the graph's
/// size.
pub(super) const SLICES_MAX_BYTES: usize = 1 << 30;

/// Decodes `read`, a host's rows of the triple table in the columns' row order (`T = n·ppp`
/// per slot, block `i` of slot `s` from partition (i, (first + s + i + step) mod n)), into
/// the columns (`T` rows per slot of `head` and `tail`, the first `T` of each slot's `R` in
/// `relation`).
///
/// Random's and Rigid shuffle's placed rows (`columns::decode_placed`) and Rigid's run copy,
/// which gathers its blocks itself, both decode here.
///
/// Why two copies: the decoding vectorizes twice as wide with AVX2; a copy compiled for
/// x86-64-v3 runs when the CPU has it ([`sparsecore_prep::dispatch_v3!`]). Both copies compute
/// the same columns.
pub(super) fn decode_slots<R: Row>(
    read: &[R],
    decode: Decode,
    shard_ids: &[i64],
    geometry: (usize, usize, usize),
    place: (usize, usize),
    columns: (&mut [i64], &mut [i64], &mut [i32]),
) {
    sparsecore_prep::dispatch_v3!(<R: Row> (
        read: &[R],
        decode: Decode,
        shard_ids: &[i64],
        geometry: (usize, usize, usize),
        place: (usize, usize),
        columns: (&mut [i64], &mut [i64], &mut [i32]),
    ) -> () {
        decode_slots_body(read, decode, shard_ids, geometry, place, columns)
    });
}

#[inline(always)]
fn decode_slots_body<R: Row>(
    read: &[R],
    decode: Decode,
    shard_ids: &[i64],
    (n, ppp, r): (usize, usize, usize),
    (first, step): (usize, usize),
    (head, tail, relation): (&mut [i64], &mut [i64], &mut [i32]),
) {
    let t = n * ppp;
    // Each position's first physical ids: a slot's blocks take the head shards in order, and
    // the tail shards in order from shard (g + step) mod n on, so one pattern of the head
    // shards serves every slot, and a window of the tail shards' pattern repeated twice.
    let (mut hoff, mut toff) = (Vec::with_capacity(t), Vec::with_capacity(2 * t));
    for &s in &shard_ids[..n] {
        hoff.resize(hoff.len() + ppp, s);
    }
    for &s in shard_ids[..n].iter().cycle().take(2 * n) {
        toff.resize(toff.len() + ppp, s);
    }
    for (slot, (((hs, ts), rs), src)) in head
        .chunks_exact_mut(t)
        .zip(tail.chunks_exact_mut(t))
        .zip(relation.chunks_exact_mut(r))
        .zip(read.chunks_exact(t))
        .enumerate()
    {
        let from = ((first + slot + step) & (n - 1)) * ppp;
        let (rs, to, ho, src) = (&mut rs[..t], &toff[from..from + t], &hoff[..t], &src[..t]);
        for q in 0..t {
            (hs[q], rs[q], ts[q]) = decode.row(src[q], (ho[q], to[q]));
        }
    }
}

/// The bools as bits, eight at a time: the bytes of eight bools (0 or 1 each), read as one
/// little-endian word (bool `k` at bit `8k`) and multiplied by `0x0102_0408_1020_4080` (bits
/// `56 − 7j` for j = 0..8), give terms at bits `56 + 8k − 7j`: all distinct (`8·Δk = 7·Δj` has
/// no other solution in range), so nothing carries, and the top byte holds exactly the terms
/// `j = k`, bool `k` at bit `56 + k` (`packed_bools_are_the_bools` checks it).
pub(super) fn pack_bools(bools: &[bool]) -> BooleanBuffer {
    let mut bytes = Vec::with_capacity(bools.len().div_ceil(8));
    let chunks = bools.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        let word = u64::from_le_bytes(std::array::from_fn(|k| u8::from(c[k])));
        bytes.push((word.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8);
    }
    if !rest.is_empty() {
        bytes.push(
            rest.iter()
                .enumerate()
                .fold(0u8, |w, (k, &b)| w | (u8::from(b) << k)),
        );
    }
    BooleanBuffer::new(Buffer::from_vec(bytes), 0, bools.len())
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

    #[test]
    fn packed_bools_are_the_bools() {
        let mut x = 12345u64;
        for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 1000] {
            let bools: Vec<bool> = (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    x >> 63 == 1
                })
                .collect();
            let packed = pack_bools(&bools);
            assert_eq!(packed.len(), len);
            assert_eq!(packed.iter().collect::<Vec<bool>>(), bools, "len {len}");
        }
        assert_eq!(pack_bools(&[true; 8]).values(), &[0xff]);
        assert_eq!(
            pack_bools(&[true, false, false, false, false, false, false, true, true]).values(),
            &[0x81, 0x01]
        );
    }
}
