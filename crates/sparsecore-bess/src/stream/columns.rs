//! Building a step's Arrow columns: their names, the per-cell counts that size them, the
//! schema, what every batch shares (list offsets, validity, Random's constant mask), the
//! buffers reused between batches, and the positives' and negatives' columns.

use std::sync::Arc;

use arrow_array::{ArrayRef, BooleanArray, Int32Array, Int64Array, Int8Array, ListArray};
use arrow_buffer::{
    ArrowNativeType, BooleanBufferBuilder, Buffer, NullBuffer, OffsetBuffer, ScalarBuffer,
};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use super::epoch::{EpochStep, EpochTable};
use super::rigid::{Cursor, Rigid};
use super::table::{decode_slots, pack_bools, with_rows, Decode, Row, Table};
use crate::batch::BatchSampler;
use crate::error::{BessError, Result};
use crate::layout::SparseCoreLayout;
use crate::negative::{Corruption, RandomNegative};
use crate::partition::PartitionedTriples;

/// The heads' feature (and column) name.
pub const HEAD: &str = "head";
/// The tails' feature (and column) name.
pub const TAIL: &str = "tail";
/// The negatives' feature (and column) name.
pub const NEGATIVE: &str = "negative";

/// The per-cell counts the config's limits are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellCounts {
    /// Triples per shard-pair block (besskge's `positive_per_partition`, `ppp`).
    pub positive_per_partition: usize,
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

pub(super) fn list_field() -> Arc<Field> {
    Arc::new(Field::new_list_field(DataType::Int64, false))
}

/// A `List<Int64>` column of one id per list (or none past a slice's used rows).
fn id_list(offsets: &OffsetBuffer<i32>, ids: ScalarBuffer<i64>) -> Result<ArrayRef> {
    Ok(Arc::new(ListArray::try_new(
        list_field(),
        offsets.clone(),
        Arc::new(Int64Array::new(ids, None)),
        None,
    )?))
}

/// A `triple_mask` of `local` slices of `r` rows: the first `t` of each from `bits(slot)`
/// (which appends them), the rest false. Whole runs of bits, not a bool per row: with
/// per-triple negatives `r` is `n·t`.
fn slice_mask(
    local: usize,
    (t, r): (usize, usize),
    bits: impl Fn(usize, &mut BooleanBufferBuilder),
) -> ArrayRef {
    let mut b = BooleanBufferBuilder::new(local * r);
    for slot in 0..local {
        bits(slot, &mut b);
        b.append_n(r - t, false);
    }
    Arc::new(BooleanArray::new(b.finish(), None))
}

/// Which optional columns a stream's record batches carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Columns {
    pub(super) negatives: bool,
    pub(super) negative_mask: bool,
    pub(super) annotations: bool,
}

pub(super) fn schema(c: Columns) -> SchemaRef {
    let list = DataType::List(list_field());
    let mut fields = vec![
        Field::new(HEAD, list.clone(), false),
        Field::new(TAIL, list.clone(), false),
        Field::new("relation", DataType::Int32, true),
        Field::new("triple_mask", DataType::Boolean, false),
    ];
    if c.annotations {
        fields.push(Field::new("triple_idx", DataType::Int64, true));
    }
    if c.negatives {
        fields.push(Field::new(NEGATIVE, list, false));
        if c.negative_mask {
            fields.push(Field::new("negative_mask", DataType::Boolean, true));
        }
        if c.annotations {
            fields.extend([
                Field::new("negative_shard", DataType::Int32, true),
                Field::new("negative_triple", DataType::Int32, true),
                Field::new("negative_side", DataType::Int8, true),
            ]);
        }
    }
    Arc::new(Schema::new(fields))
}

/// Offsets of a list column over `slices` slices of `r` rows each, whose first `used` rows hold
/// one id each and the rest none. They depend only on the stream's shape, so they are built
/// once and shared by every batch (Arrow buffers are reference-counted).
pub(super) fn one_id_offsets(slices: usize, used: usize, r: usize) -> Result<OffsetBuffer<i32>> {
    let total = slices
        .checked_mul(r)
        .filter(|&total| total < i32::MAX as usize);
    let Some(total) = total else {
        return Err(BessError::param(
            "rows",
            format!("{slices} slices of {r}"),
            "too many for a List column",
        ));
    };
    let mut offsets = Vec::new();
    offsets
        .try_reserve_exact(total + 1)
        .map_err(|_| BessError::TooLarge {
            what: format!("the list offsets of {slices} SparseCore slices of {r} rows"),
            bytes: (total as u128 + 1) * 4,
            reason: "the allocator refuses that much (the memory available, or `ulimit -v`)".into(),
        })?;
    offsets.push(0i32);
    for slice in 0..slices {
        let base = (slice * used) as i32;
        offsets.extend((1..=r).map(|row| base + row.min(used) as i32));
    }
    Ok(OffsetBuffer::new(ScalarBuffer::from(offsets)))
}

/// `Some(validity)` of `slices` slices of `r` rows whose first `len` rows are valid, when some
/// are not.
pub(super) fn validity(slices: usize, len: usize, r: usize) -> Option<NullBuffer> {
    (len < r)
        .then(|| NullBuffer::from_iter((0..slices).flat_map(|_| (0..r).map(move |row| row < len))))
}

/// What every batch of a stream shares: list offsets, validity, Random's constant mask.
#[derive(Debug, Clone)]
pub(super) struct Shared {
    pub(super) pos_offsets: OffsetBuffer<i32>,
    pub(super) neg_offsets: OffsetBuffer<i32>,
    pub(super) pos_valid: Option<NullBuffer>,
    pub(super) neg_valid: Option<NullBuffer>,
    /// `triple_mask` when there is no Rigid mask: true for the triples' rows.
    pub(super) full_mask: ArrayRef,
    /// The physical id of local id 0 of every shard: local id `v` of shard `x` is
    /// `v·N + shard_ids[x]`.
    pub(super) shard_ids: Vec<i64>,
}

/// About how many rows ahead of the one it copies [`Parts::positives`] prefetches (whole
/// blocks).
const AHEAD: usize = 32;

/// Buffers reused from batch to batch (the pipeline reuses its own; a fresh megabyte per batch
/// would cost more in page faults than the sampling itself).
#[derive(Debug, Clone, Default)]
pub(super) struct Scratch {
    pub(super) pos: PosScratch,
    pub(super) neg: Vec<i32>,
    /// The previous batch's `negative` values (see [`PosScratch::values`]).
    pub(super) neg_values: Option<Buffer>,
}

/// The positives' reused buffers.
#[derive(Debug, Clone, Default)]
pub(super) struct PosScratch {
    pub(super) bess_idx: Vec<i64>,
    pub(super) bess_mask: Vec<bool>,
    pub(super) sidx: Vec<i64>,
    pub(super) smask: Vec<bool>,
    /// The Rigid mask in row order, before it is packed into bits.
    pub(super) row_mask: Vec<bool>,
    /// The rows of the triple table in row order (see [`Parts::placed_positives`]).
    pub(super) row_at: Vec<u32>,
    /// Rigid's run copy: where the last step's windows fell in every partition.
    pub(super) rigid_cursor: Cursor,
    /// Rigid shuffle: the rows of the epoch last drawn.
    pub(super) epoch: EpochTable,
    /// The previous batch's column values (`head`, `tail`, `relation`): taken back when the
    /// caller has dropped that batch, so steady-state batches write into warm memory.
    pub(super) values: [Option<Buffer>; 3],
}

/// Where a host's positives come from: `local` SparseCore slots of `n` blocks of `ppp` rows,
/// block `i` of slot `s` at `of(s, i) = (start in the sampler's indices, tail shard)`; `R` rows
/// per slot in `relation`.
struct Blocks<F> {
    n: usize,
    positive_per_partition: usize,
    r: usize,
    local: usize,
    of: F,
}

/// Copies the positives' rows into the columns in row order (`T = n·ppp` per slot of `head`
/// and `tail`, of `relation` the first `T` of each slot's `R`), decoding each block's ids
/// from its shards' first physical ids. The blocks `AHEAD / ppp` ahead of the one copied are
/// prefetched.
fn gather<R: Row, F: Fn(usize, usize) -> (usize, usize)>(
    rows: &[R],
    decode: Decode,
    shard_ids: &[i64],
    idx: &[i64],
    bl: &Blocks<F>,
    (head, tail, relation): (&mut [i64], &mut [i64], &mut [i32]),
) {
    let (n, ppp) = (bl.n, bl.positive_per_partition);
    let t = n * ppp;
    let blocks = bl.local * n;
    // N is a power of two: block `b` is (slot b >> log2 N, head shard b & (N − 1)).
    let (shift, mask) = (n.trailing_zeros(), n - 1);
    let fetch = |b: usize| {
        let (at, _) = (bl.of)(b >> shift, b & mask);
        for &k in idx.get(at..at + ppp).unwrap_or_default() {
            if let Some(row) = rows.get(k as usize) {
                row.prefetch();
            }
        }
    };
    let ahead = AHEAD.div_ceil(ppp);
    (0..ahead.min(blocks)).for_each(fetch);
    for b in 0..blocks {
        if b + ahead < blocks {
            fetch(b + ahead);
        }
        let (slot, i) = (b >> shift, b & mask);
        let (at, j) = (bl.of)(slot, i);
        let offs = (shard_ids[i], shard_ids[j]);
        let dst = slot * t + i * ppp;
        let (h, tl, rel) = (
            &mut head[dst..dst + ppp],
            &mut tail[dst..dst + ppp],
            &mut relation[slot * bl.r + i * ppp..][..ppp],
        );
        for (q, &k) in idx[at..at + ppp].iter().enumerate() {
            let Some(&row) = rows.get(k as usize) else {
                continue;
            };
            (h[q], rel[q], tl[q]) = decode.row(row, offs);
        }
    }
}

/// Copies the rows `at` of the triple table, given in the columns' row order (`T = n·ppp` per
/// slot, block `i` of slot `s` from partition (i, (first + s + i + step) mod n)), into the
/// columns, decoding each block's ids from its shards' first physical ids. `at` holds `AHEAD`
/// more rows past the step's (any rows of the table): the row that far ahead of the one
/// copied is prefetched.
///
/// Why two passes: the rows are first read, in one loop over the whole step, into a
/// contiguous buffer, and then decoded block by block from there. The reads miss the caches;
/// alone in a short loop, with no block bookkeeping and no stores to three columns between
/// them, they cost a few instructions each, and the decoding of a block's contiguous rows
/// (shifts and masks of counts fixed for the table) vectorizes ([`decode_slots`]).
fn decode_placed<R: Row>(
    rows: &[R],
    decode: Decode,
    shard_ids: &[i64],
    at: &[u32],
    geometry: (usize, usize, usize),
    place: (usize, usize),
    columns: (&mut [i64], &mut [i64], &mut [i32]),
) {
    let len = columns.0.len().min(at.len().saturating_sub(AHEAD));
    let read: Vec<R> = at[..len]
        .iter()
        .zip(&at[AHEAD..AHEAD + len])
        .map(|(&k, &a)| {
            if let Some(row) = rows.get(a as usize) {
                row.prefetch();
            }
            rows[k as usize]
        })
        .collect();
    decode_slots(&read, decode, shard_ids, geometry, place, columns);
}

/// `triple_mask` from Rigid's mask in row order (`t` rows per slot), packed eight rows at a time
/// (appending bools one by one costs more than drawing them), the rows past `t` of a slot's
/// `r` false.
fn packed_mask(row_mask: &[bool], local: usize, (t, r): (usize, usize)) -> ArrayRef {
    if r == t {
        Arc::new(BooleanArray::new(pack_bools(&row_mask[..local * t]), None))
    } else {
        slice_mask(local, (t, r), |slot, b| {
            b.append_buffer(&pack_bools(&row_mask[slot * t..(slot + 1) * t]))
        })
    }
}

/// `len` values in the buffer `slot` held, if the caller has dropped the batch that shared it
/// and it has that length (its contents are overwritten, except padding, which stays zero: the
/// layout of every batch of a stream is the same), else `len` zeros.
fn reuse<T: ArrowNativeType>(slot: &mut Option<Buffer>, len: usize) -> Vec<T> {
    match slot.take().map(Buffer::into_vec::<T>) {
        Some(Ok(v)) if v.len() == len => v,
        _ => vec![T::default(); len],
    }
}

/// The values as an Arrow buffer, keeping a reference in `slot` for [`reuse`].
fn keep<T: ArrowNativeType>(slot: &mut Option<Buffer>, v: Vec<T>) -> ScalarBuffer<T> {
    let b = ScalarBuffer::from(v);
    *slot = Some(b.inner().clone());
    b
}

/// What building a record batch needs, borrowed apart from the samplers (so that positives and
/// negatives can be built on two threads).
pub(super) struct Parts<'a> {
    pub(super) layout: &'a SparseCoreLayout,
    pub(super) counts: &'a CellCounts,
    pub(super) table: &'a Table,
    pub(super) rigid: Option<&'a Rigid>,
    pub(super) neg_b: usize,
    pub(super) neg_k: usize,
    pub(super) flat: bool,
    pub(super) corruption: Corruption,
    pub(super) columns: Columns,
    pub(super) shared: &'a Shared,
}

impl Parts<'_> {
    /// Samples step `step`'s positives and builds their columns. With `keep_sidx`, also lays
    /// all SparseCores' indices out SparseCore-major into `sidx` (and the Rigid mask into
    /// `smask`): what annotations and the per-triple negative samplers read. Returns the
    /// columns and whether there is a Rigid mask.
    pub(super) fn positives(
        &self,
        sampler: &mut BatchSampler,
        step: usize,
        scratch: &mut PosScratch,
        keep_sidx: bool,
    ) -> Result<(Vec<ArrayRef>, bool)> {
        let lay = self.layout;
        let n = lay.num_sparsecores();
        let (ppp, t, r) = (
            self.counts.positive_per_partition,
            self.counts.triples_per_sparsecore,
            self.counts.rows_per_sparsecore,
        );
        if let (Some(rt), false) = (self.rigid, keep_sidx) {
            return self.rigid_positives(rt, step, scratch);
        }
        if !keep_sidx {
            if let Some(done) = self.epoch_positives(sampler, step, scratch)? {
                return Ok(done);
            }
            if let Some(done) = self.placed_positives(sampler, step, scratch)? {
                return Ok(done);
            }
        }
        let PosScratch {
            bess_idx,
            bess_mask,
            sidx,
            smask,
            values,
            ..
        } = scratch;
        // BESS indices, row-major over (head shard i, tail shard j, position).
        let rigid = sampler.sample_indices_into(step, bess_idx, bess_mask)?;
        let local = lay.local_sparsecores();
        let first = lay.global_sparsecore(0);
        // SparseCore `g` takes block (i, tail_shard(g, i, step)) from every head shard i.
        let block = |g: usize, i: usize| {
            let j = lay.tail_shard(g, i, step);
            ((i * n + j) * ppp, j)
        };
        sidx.clear();
        smask.clear();
        if keep_sidx {
            for g in 0..n {
                for i in 0..n {
                    let (at, _) = block(g, i);
                    sidx.extend_from_slice(&bess_idx[at..at + ppp]);
                    if rigid {
                        smask.extend_from_slice(&bess_mask[at..at + ppp]);
                    }
                }
            }
        }
        let rows = local * r;
        let [vh, vt, vr] = values;
        let mut head: Vec<i64> = reuse(vh, local * t);
        let mut tail: Vec<i64> = reuse(vt, local * t);
        let mut relation: Vec<i32> = reuse(vr, rows);
        let tb = self.table;
        let blocks = Blocks {
            n,
            positive_per_partition: ppp,
            r,
            local,
            of: |slot, i| block(first + slot, i),
        };
        with_rows!(tb, rows => gather(rows, tb.decode, &tb.shard_ids, bess_idx, &blocks, (&mut head, &mut tail, &mut relation)));
        let sh = self.shared;
        let head = keep(vh, head);
        let tail = keep(vt, tail);
        let relation = keep(vr, relation);
        let lists = |ids| id_list(&sh.pos_offsets, ids);
        let row_bits = |slot: usize, b: &mut BooleanBufferBuilder| {
            for i in 0..n {
                let (at, _) = block(first + slot, i);
                b.append_slice(&bess_mask[at..at + ppp]);
            }
        };
        let mask: ArrayRef = if rigid {
            slice_mask(local, (t, r), row_bits)
        } else {
            sh.full_mask.clone()
        };
        let mut columns: Vec<ArrayRef> = vec![
            lists(head)?,
            lists(tail)?,
            Arc::new(Int32Array::new(relation, sh.pos_valid.clone())),
            mask,
        ];
        if self.columns.annotations {
            let mine = &sidx[first * t..(first + local) * t];
            let mut tidx = Vec::with_capacity(rows);
            for slice in mine.chunks(t) {
                tidx.extend_from_slice(slice);
                tidx.resize(tidx.len() + (r - t), 0);
            }
            columns.push(Arc::new(Int64Array::new(tidx.into(), sh.pos_valid.clone())));
        }
        Ok((columns, rigid))
    }

    /// [`Self::positives`] without the sampler's index arrays (Random and Rigid with shuffle):
    /// the sampler writes each block's rows of the triple table straight into the columns' row
    /// order, and one front-to-back pass decodes them. `None` (nothing drawn) where the
    /// sampler cannot ([`BatchSampler::sample_rows_into`]).
    fn placed_positives(
        &self,
        sampler: &mut BatchSampler,
        step: usize,
        scratch: &mut PosScratch,
    ) -> Result<Option<(Vec<ArrayRef>, bool)>> {
        let lay = self.layout;
        let n = lay.num_sparsecores();
        let (ppp, t, r) = (
            self.counts.positive_per_partition,
            self.counts.triples_per_sparsecore,
            self.counts.rows_per_sparsecore,
        );
        let (local, first) = (lay.local_sparsecores(), lay.global_sparsecore(0));
        let PosScratch {
            row_mask,
            row_at,
            values,
            ..
        } = scratch;
        row_at.resize(local * t + AHEAD, 0);
        row_mask.resize(local * t, false);
        // Block `b` is (slot b / n, head shard i = b mod n): SparseCore g = first + slot takes
        // partition (i, (i + g + step) mod n). N is a power of two.
        let (shift, mask) = (n.trailing_zeros(), n - 1);
        let part_of = |b: usize| {
            let i = b & mask;
            (i << shift)
                | (i.wrapping_add(first)
                    .wrapping_add(b >> shift)
                    .wrapping_add(step)
                    & mask)
        };
        // Partition (i, j) goes to slot (j − i − first − step) mod n, if this host has it.
        let block_of = |p: usize| {
            let (i, j) = (p >> shift, p & mask);
            let slot = j.wrapping_sub(i.wrapping_add(first).wrapping_add(step)) & mask;
            (slot < local).then_some((slot << shift) | i)
        };
        let Some(rigid) =
            sampler.sample_rows_into(step, (local * n, part_of, block_of), row_at, row_mask)
        else {
            return Ok(None);
        };
        let [vh, vt, vr] = values;
        let mut head: Vec<i64> = reuse(vh, local * t);
        let mut tail: Vec<i64> = reuse(vt, local * t);
        let mut relation: Vec<i32> = reuse(vr, local * r);
        let tb = self.table;
        with_rows!(tb, rows => decode_placed(rows, tb.decode, &tb.shard_ids, row_at, (n, ppp, r), (first, step), (&mut head, &mut tail, &mut relation)));
        let sh = self.shared;
        let mask = if rigid {
            packed_mask(row_mask, local, (t, r))
        } else {
            sh.full_mask.clone()
        };
        let lists = |ids| id_list(&sh.pos_offsets, ids);
        let relation = Arc::new(Int32Array::new(keep(vr, relation), sh.pos_valid.clone()));
        Ok(Some((
            vec![
                lists(keep(vh, head))?,
                lists(keep(vt, tail))?,
                relation,
                mask,
            ],
            rigid,
        )))
    }

    /// [`Self::positives`] of Rigid with shuffle from its epoch table ([`EpochTable`], built
    /// at the epoch's first step drawn), where the table fits its bounds. `None` (nothing
    /// drawn) elsewhere: other samplers, and where the sampler's rows do not apply
    /// ([`BatchSampler::sample_rows_into`]).
    fn epoch_positives(
        &self,
        sampler: &mut BatchSampler,
        step: usize,
        scratch: &mut PosScratch,
    ) -> Result<Option<(Vec<ArrayRef>, bool)>> {
        let lay = self.layout;
        let (ppp, t, r) = (
            self.counts.positive_per_partition,
            self.counts.triples_per_sparsecore,
            self.counts.rows_per_sparsecore,
        );
        let windows = sampler.steps_per_epoch();
        #[cfg(test)]
        if scratch.epoch.off {
            return Ok(None);
        }
        if !EpochTable::fits(self.table, lay, ppp, windows) {
            return Ok(None);
        }
        let part = sampler.partitioned().clone();
        let Some(order) = sampler.epoch_order(step) else {
            return Ok(None);
        };
        let local = lay.local_sparsecores();
        let PosScratch { epoch, values, .. } = scratch;
        let [vh, vt, vr] = values;
        let mut head: Vec<i64> = reuse(vh, local * t);
        let mut tail: Vec<i64> = reuse(vt, local * t);
        let mut relation: Vec<i32> = reuse(vr, local * r);
        let st = EpochStep {
            step,
            windows,
            positive_per_partition: ppp,
            order,
        };
        let bits = epoch.step(
            self.table,
            &part,
            lay,
            &st,
            (t, r),
            &mut head,
            &mut tail,
            &mut relation,
        );
        let sh = self.shared;
        let mask: ArrayRef = if r == t {
            Arc::new(BooleanArray::new(bits, None))
        } else {
            slice_mask(local, (t, r), |slot, b| {
                b.append_buffer(&bits.slice(slot * t, t))
            })
        };
        let lists = |ids| id_list(&sh.pos_offsets, ids);
        let relation = Arc::new(Int32Array::new(keep(vr, relation), sh.pos_valid.clone()));
        Ok(Some((
            vec![
                lists(keep(vh, head))?,
                lists(keep(vt, tail))?,
                relation,
                mask,
            ],
            true,
        )))
    }

    /// [`Self::positives`] of Rigid without shuffle: slices of its step table, or each block
    /// copied as contiguous runs of the triple table.
    fn rigid_positives(
        &self,
        rg: &Rigid,
        step: usize,
        scratch: &mut PosScratch,
    ) -> Result<(Vec<ArrayRef>, bool)> {
        let lay = self.layout;
        let (t, r) = (
            self.counts.triples_per_sparsecore,
            self.counts.rows_per_sparsecore,
        );
        let local = lay.local_sparsecores();
        let rows = local * r;
        let sh = self.shared;
        let PosScratch {
            values,
            rigid_cursor,
            ..
        } = scratch;
        let [vh, vt, vr] = values;
        let (head, tail, relation, mask) = if let Some(sl) = &rg.slices {
            let (at, len) = (sl.start(step) * t, local * t);
            let relation = if r == t {
                sl.relation.slice(at, len)
            } else {
                let mut v: Vec<i32> = reuse(vr, rows);
                for (to, from) in v
                    .chunks_exact_mut(r)
                    .zip(sl.relation[at..at + len].chunks_exact(t))
                {
                    to[..t].copy_from_slice(from);
                }
                keep(vr, v)
            };
            let mask: ArrayRef = match (sl.padded(step), r == t) {
                (false, _) => sh.full_mask.clone(),
                (true, true) => Arc::new(BooleanArray::new(sl.mask.slice(at, len), None)),
                (true, false) => slice_mask(local, (t, r), |slot, b| {
                    b.append_buffer(&sl.mask.slice(at + slot * t, t))
                }),
            };
            (
                sl.head.slice(at, len),
                sl.tail.slice(at, len),
                relation,
                mask,
            )
        } else {
            let mut head: Vec<i64> = reuse(vh, local * t);
            let mut tail: Vec<i64> = reuse(vt, local * t);
            let mut relation: Vec<i32> = reuse(vr, rows);
            let bits = rg.copy_step(
                self.table,
                lay,
                step,
                (t, r),
                rigid_cursor,
                &mut head,
                &mut tail,
                &mut relation,
                rg.padded(step),
            );
            let mask: ArrayRef = match bits {
                None => sh.full_mask.clone(),
                Some(b) if r == t => Arc::new(BooleanArray::new(b, None)),
                Some(b) => slice_mask(local, (t, r), |slot, bb| {
                    bb.append_buffer(&b.slice(slot * t, t))
                }),
            };
            (keep(vh, head), keep(vt, tail), keep(vr, relation), mask)
        };
        let lists = |ids| id_list(&sh.pos_offsets, ids);
        let columns: Vec<ArrayRef> = vec![
            lists(head)?,
            lists(tail)?,
            Arc::new(Int32Array::new(relation, sh.pos_valid.clone())),
            mask,
        ];
        Ok((columns, true))
    }

    /// The `negative` column of uniform negatives, drawn straight into place (the draws
    /// of SparseCores of other hosts are drawn and dropped, to keep the generator's stream).
    pub(super) fn random_negative_column(
        &self,
        rn: &mut RandomNegative,
        part: &PartitionedTriples,
        values: &mut Option<Buffer>,
    ) -> Result<ArrayRef> {
        let lay = self.layout;
        let n = lay.num_sparsecores();
        let (local, first) = (lay.local_sparsecores(), lay.global_sparsecore(0));
        let bk = self.neg_b * self.neg_k;
        let mut ids: Vec<i64> = reuse(values, local * n * bk);
        // N is a power of two (the pipeline's layout checks it): `v·N` is a shift.
        let (shift, shard_ids) = (n.trailing_zeros(), &self.shared.shard_ids);
        let place = |_, x: usize, g: usize| {
            g.checked_sub(first)
                .filter(|&s| s < local)
                .map(|slot| (slot * n + x) * bk)
        };
        let map = |x: usize| {
            let hx = shard_ids[x];
            move |v: u32| (i64::from(v) << shift) + hx
        };
        rn.draw_placed(
            part,
            (1, self.counts.triples_per_sparsecore),
            &mut ids,
            place,
            map,
        )?;
        id_list(&self.shared.neg_offsets, keep(values, ids))
    }

    /// The negative columns from the sampler's values `negs`, row-major over
    /// `(1, n, n, B, K)` (and its mask): SparseCore `g`'s slice takes `negs[0][x][g]` from every
    /// shard `x`, one per row.
    pub(super) fn negative_columns(
        &self,
        negs: &[i32],
        nmask: Option<&[bool]>,
        values: &mut Option<Buffer>,
    ) -> Result<Vec<ArrayRef>> {
        let lay = self.layout;
        let n = lay.num_sparsecores();
        let (ppp, r) = (
            self.counts.positive_per_partition,
            self.counts.rows_per_sparsecore,
        );
        let local = lay.local_sparsecores();
        let rows = local * r;
        let (b, k) = (self.neg_b, self.neg_k);
        let bk = b * k;
        let nrows = n * bk;
        let n64 = n as i64;
        let hoff = &self.shared.shard_ids;
        let ann = self.columns.annotations;
        let cap = |on: bool| if on { rows } else { 0 };
        let mut ids: Vec<i64> = reuse(values, local * nrows);
        let mut nm = Vec::with_capacity(cap(self.columns.negative_mask));
        let (mut shard, mut trip, mut side) = (
            Vec::with_capacity(cap(ann)),
            Vec::with_capacity(cap(ann)),
            Vec::with_capacity(cap(ann)),
        );
        let side_of = |bb: usize| -> i8 {
            match (self.corruption, self.flat) {
                (Corruption::H, _) => 0,
                (Corruption::T, _) => 1,
                (Corruption::Ht, true) => bb as i8,
                (Corruption::Ht, false) => i8::from(bb % ppp >= ppp / 2),
            }
        };
        let fill = r - nrows;
        for slot in 0..local {
            let g = lay.global_sparsecore(slot);
            for (x, &hx) in hoff.iter().enumerate() {
                // negs[0][x][g][bb][ii], contiguous over (bb, ii).
                let at = (x * n + g) * bk;
                let to = &mut ids[(slot * n + x) * bk..][..bk];
                for (o, &v) in to.iter_mut().zip(&negs[at..at + bk]) {
                    *o = i64::from(v) * n64 + hx;
                }
                if self.columns.negative_mask {
                    match nmask {
                        Some(m) => nm.extend_from_slice(&m[at..at + bk]),
                        None => nm.resize(nm.len() + bk, true),
                    }
                }
                if ann {
                    shard.resize(shard.len() + bk, x as i32);
                    for bb in 0..b {
                        trip.resize(trip.len() + k, if self.flat { -1 } else { bb as i32 });
                        side.resize(side.len() + k, side_of(bb));
                    }
                }
            }
            if self.columns.negative_mask {
                nm.resize(nm.len() + fill, false);
            }
            if ann {
                shard.resize(shard.len() + fill, 0);
                trip.resize(trip.len() + fill, 0);
                side.resize(side.len() + fill, 0);
            }
        }
        let sh = self.shared;
        let valid = &sh.neg_valid;
        let mut columns: Vec<ArrayRef> = vec![id_list(&sh.neg_offsets, keep(values, ids))?];
        if self.columns.negative_mask {
            columns.push(Arc::new(BooleanArray::new(nm.into(), valid.clone())));
        }
        if ann {
            columns.extend([
                Arc::new(Int32Array::new(shard.into(), valid.clone())) as ArrayRef,
                Arc::new(Int32Array::new(trip.into(), valid.clone())),
                Arc::new(Int8Array::new(side.into(), valid.clone())),
            ]);
        }
        Ok(columns)
    }
}

#[cfg(test)]
mod tests {
    use super::one_id_offsets;
    use crate::error::BessError;

    #[test]
    fn offsets_past_a_list_column_are_an_error_not_an_overflow() {
        let e = one_id_offsets(1 << 62, 1, 8).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "invalid `rows` = {} slices of 8: too many for a List column",
                1u64 << 62
            )
        );
        let e = one_id_offsets(4, 1, i32::MAX as usize / 4 + 1).unwrap_err();
        assert!(
            matches!(e, BessError::InvalidParameter { name: "rows", .. }),
            "{e:?}"
        );
        let ok = one_id_offsets(2, 1, 3).unwrap();
        assert_eq!(&ok[..], &[0, 1, 1, 1, 2, 2, 2]);
    }
}
