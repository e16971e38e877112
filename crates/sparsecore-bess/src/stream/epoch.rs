//! Rigid shuffle's positives read from an epoch table: once per epoch, every step's rows of the
//! packed triple table, in the host's row order, and their mask; a step then decodes one
//! contiguous slice of it.
//!
//! Why: every partition reads the epoch's order at the same positions, so a step's rows are
//! scattered over the whole triple table, which preprocessing evicts between steps: the
//! per-step path ([`super::columns`]'s placed positives) misses on nearly every row. Built
//! diagonal by diagonal (see [`fill`]), the epoch's rows come from a small part of the table
//! at a time (in L1 or L2), without reducing any position by a count, and a step then reads
//! its rows front to back, which the hardware prefetches. The rows are the same: block `i`
//! of slot `s` in step `e·W + w` of epoch `e` (`W` steps an epoch) is partition
//! `(i, (first_sc + s + i + e·W + w) mod n)` at position `π(w·ppp + q) mod count`, real while
//! `π(w·ppp + q) < count`, exactly what [`crate::batch::BatchSampler::sample_rows_into`]
//! gives.

use arrow_buffer::BooleanBuffer;

use super::table::{
    decode_slots, pack_bools, with_rows, Row, RowBuffers, Table, SLICES_MAX_BYTES,
    SLICES_MAX_ROWS_PER_TRIPLE,
};
use crate::layout::SparseCoreLayout;
use crate::partition::PartitionedTriples;

/// One epoch's rows and mask, kept between steps and rebuilt when a step of another epoch
/// is drawn.
#[derive(Debug, Clone, Default)]
pub(super) struct EpochTable {
    /// The epoch the rows are of.
    epoch: Option<usize>,
    /// `W · L · T` rows of the table's type: step `w`'s `L` slots from row `w·L·T` on.
    rows: RowBuffers,
    /// The rows' mask, as bits in the same order.
    mask: Option<BooleanBuffer>,
    /// The mask as bools while it is built.
    bools: Vec<bool>,
    /// The epoch's order as `u32`.
    order: Vec<u32>,
    /// Tests: take the per-step path.
    #[cfg(test)]
    pub(super) off: bool,
}

/// A step of Rigid shuffle as the epoch table reads it.
pub(super) struct EpochStep<'a> {
    /// The step.
    pub(super) step: usize,
    /// Steps per epoch, `W`.
    pub(super) windows: usize,
    /// Positions per block, `ppp`.
    pub(super) positive_per_partition: usize,
    /// The epoch's order of its `W·ppp` positions.
    pub(super) order: &'a [usize],
}

impl EpochTable {
    /// Whether an epoch of `windows` steps of this host's `local · n · ppp` rows stays within
    /// the bounds of [`super::rigid::RigidSlices`]: at most 12 rows per triple of the table and
    /// 1 GiB (rows, their mask as bools while it is built, and as bits), its positions `u32`.
    pub(super) fn fits(table: &Table, lay: &SparseCoreLayout, ppp: usize, windows: usize) -> bool {
        fn row_bytes<R>(_: &[R]) -> usize {
            std::mem::size_of::<R>()
        }
        let (triples, row_bytes) = with_rows!(table, rows => (rows.len(), row_bytes(rows)));
        let t = lay.num_sparsecores() * ppp;
        let Some(rows) = windows
            .checked_mul(lay.local_sparsecores())
            .and_then(|x| x.checked_mul(t))
        else {
            return false;
        };
        let bytes = rows
            .checked_mul(row_bytes + 1)
            .and_then(|b| b.checked_add(rows.div_ceil(8)));
        let positions = windows
            .checked_mul(ppp)
            .is_some_and(|len| len <= u32::MAX as usize);
        positions
            && rows <= SLICES_MAX_ROWS_PER_TRIPLE.saturating_mul(triples)
            && bytes.is_some_and(|b| b <= SLICES_MAX_BYTES)
    }

    /// Decodes step `st.step`'s positives into `head` and `tail` (`T` per local SparseCore)
    /// and `relation` (`R` per local SparseCore, the rows past `T` untouched), building the
    /// epoch's table first if it holds another epoch. Returns the step's mask (`T` bits per
    /// local SparseCore, a slice of the epoch's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
        &mut self,
        table: &Table,
        part: &PartitionedTriples,
        lay: &SparseCoreLayout,
        st: &EpochStep<'_>,
        (t, r): (usize, usize),
        head: &mut [i64],
        tail: &mut [i64],
        relation: &mut [i32],
    ) -> BooleanBuffer {
        with_rows!(table, phys => self.step_rows(phys, table, part, lay, st, (t, r), head, tail, relation))
    }

    #[allow(clippy::too_many_arguments)]
    fn step_rows<R: Row>(
        &mut self,
        phys: &[R],
        table: &Table,
        part: &PartitionedTriples,
        lay: &SparseCoreLayout,
        st: &EpochStep<'_>,
        (t, r): (usize, usize),
        head: &mut [i64],
        tail: &mut [i64],
        relation: &mut [i32],
    ) -> BooleanBuffer {
        let (n, local, first_sc) = (
            lay.num_sparsecores(),
            lay.local_sparsecores(),
            lay.global_sparsecore(0),
        );
        let windows = st.windows.max(1);
        let epoch = st.step / windows;
        let stride = local * t;
        let mut rows = std::mem::take(R::buffer(&mut self.rows));
        if self.epoch != Some(epoch) || self.mask.is_none() || rows.len() != windows * stride {
            self.epoch = None;
            self.order.clear();
            self.order.extend(st.order.iter().map(|&v| v as u32));
            rows.resize(windows * stride, R::default());
            self.bools.resize(windows * stride, false);
            let geometry = Geometry {
                n,
                local,
                first_sc,
                positive_per_partition: st.positive_per_partition,
                t,
                windows,
                epoch,
            };
            fill(
                phys,
                part,
                &geometry,
                &self.order,
                &mut rows,
                &mut self.bools,
            );
            self.mask = Some(pack_bools(&self.bools));
            self.epoch = Some(epoch);
        }
        let at = (st.step % windows) * stride;
        decode_slots(
            &rows[at..at + stride],
            table.decode,
            &table.shard_ids,
            (n, st.positive_per_partition, r),
            (first_sc, st.step),
            (head, tail, relation),
        );
        *R::buffer(&mut self.rows) = rows;
        self.mask
            .as_ref()
            .map_or_else(|| BooleanBuffer::new_unset(stride), |m| m.slice(at, stride))
    }
}

/// Where an epoch's blocks go: `local` slots of `n` blocks of `ppp` rows (`t = n·ppp` per
/// slot) per step, `windows` steps, the host's first SparseCore `first_sc`.
struct Geometry {
    n: usize,
    local: usize,
    first_sc: usize,
    positive_per_partition: usize,
    t: usize,
    windows: usize,
    epoch: usize,
}

/// Writes the epoch's rows of the table `phys` and their mask (`order`: the epoch's order of
/// its `windows · ppp` positions) into `rows` and `bools`, step by step in the host's row
/// order.
///
/// Why diagonal by diagonal: in every step the partitions `(i, i + d)` of one diagonal `d`
/// are the `n` blocks of one slot, so a step's blocks of a diagonal are written as one
/// contiguous run, and the rows read are the diagonal's (a `1/n` of the table, which stays
/// in L1 or L2 while it is read). Each partition's rows are first laid out cyclically over
/// all the positions (a copy), so that a position's row is one load, with no reduction by
/// the count; the window of positions is the same for every block of a step.
///
/// Why two copies: with AVX2 a block's loads at its positions (clamped to the copy, so with no
/// bounds checks) vectorize, and the gather takes about half the instructions; a copy compiled
/// for x86-64-v3 runs when the CPU has it ([`sparsecore_prep::dispatch_v3!`]). Both copies write
/// the same rows.
fn fill<R: Row>(
    phys: &[R],
    part: &PartitionedTriples,
    g: &Geometry,
    order: &[u32],
    rows: &mut [R],
    bools: &mut [bool],
) {
    sparsecore_prep::dispatch_v3!(<R: Row> (
        phys: &[R],
        part: &PartitionedTriples,
        g: &Geometry,
        order: &[u32],
        rows: &mut [R],
        bools: &mut [bool],
    ) -> () {
        fill_sizes(phys, part, g, order, rows, bools)
    });
}

#[inline(always)]
fn fill_sizes<R: Row>(
    phys: &[R],
    part: &PartitionedTriples,
    g: &Geometry,
    order: &[u32],
    rows: &mut [R],
    bools: &mut [bool],
) {
    // Blocks of a power of two of rows (`ppp = shard_bs / n`, as a rule) as fixed-size arrays:
    // unrolled, with no loop bookkeeping, and the positions of a step loaded once.
    match g.positive_per_partition {
        1 => fill_diagonals::<R, 1>(phys, part, g, order, rows, bools),
        2 => fill_diagonals::<R, 2>(phys, part, g, order, rows, bools),
        4 => fill_diagonals::<R, 4>(phys, part, g, order, rows, bools),
        8 => fill_diagonals::<R, 8>(phys, part, g, order, rows, bools),
        16 => fill_diagonals::<R, 16>(phys, part, g, order, rows, bools),
        32 => fill_diagonals::<R, 32>(phys, part, g, order, rows, bools),
        64 => fill_diagonals::<R, 64>(phys, part, g, order, rows, bools),
        _ => fill_diagonals::<R, 0>(phys, part, g, order, rows, bools),
    }
}

/// [`fill`] for blocks of `P` rows (0: any number, `g.positive_per_partition`).
#[inline(always)]
fn fill_diagonals<R: Row, const P: usize>(
    phys: &[R],
    part: &PartitionedTriples,
    g: &Geometry,
    order: &[u32],
    rows: &mut [R],
    bools: &mut [bool],
) {
    let (n, t) = (g.n, g.t);
    let ppp = if P == 0 { g.positive_per_partition } else { P };
    let len = g.windows * ppp;
    if n == 0 || ppp == 0 || g.positive_per_partition != ppp || t != n * ppp || order.len() != len {
        return;
    }
    let stride = g.local * t;
    let mask_n = n - 1;
    // Slot `s` of step `w` takes diagonal d = first_sc + s + epoch·W + w (mod n).
    let base = g.first_sc.wrapping_add(g.epoch.wrapping_mul(g.windows));
    // The diagonal's partitions' rows, each over all `len` positions, and their counts.
    let mut cyclic: Vec<R> = Vec::with_capacity(n * len);
    let mut counts = vec![0u32; n];
    for d in 0..n {
        cyclic.clear();
        for (i, c_i) in counts.iter_mut().enumerate() {
            let p = i * n + (i.wrapping_add(d) & mask_n);
            let (o, c) = (
                part.triple_offsets.get(p).map_or(0, |&o| o.max(0) as usize),
                part.triple_counts.get(p).map_or(0, |&c| c.max(0) as usize),
            );
            let src = phys.get(o..o + c).unwrap_or_default();
            let end = cyclic.len() + len;
            while !src.is_empty() && cyclic.len() < end {
                cyclic.extend_from_slice(&src[..c.min(end - cyclic.len())]);
            }
            // An empty partition (which the stream refuses) reads default rows, all padding.
            cyclic.resize(end, R::default());
            *c_i = c as u32;
        }
        for (w, pos) in order.chunks_exact(ppp).enumerate() {
            let slot = d.wrapping_sub(base).wrapping_sub(w) & mask_n;
            if slot >= g.local {
                continue;
            }
            let at = w * stride + slot * t;
            let (Some(to), Some(m)) = (rows.get_mut(at..at + t), bools.get_mut(at..at + t)) else {
                continue;
            };
            let blocks = to
                .chunks_exact_mut(ppp)
                .zip(m.chunks_exact_mut(ppp))
                .zip(cyclic.chunks_exact(len))
                .zip(&counts);
            match <&[u32; P]>::try_from(pos) {
                Ok(pos) if P != 0 => {
                    for (((to, m), at_pos), &c) in blocks {
                        if let (Ok(to), Ok(m)) =
                            (<&mut [R; P]>::try_from(to), <&mut [bool; P]>::try_from(m))
                        {
                            block(to, m, pos, at_pos, c);
                        }
                    }
                }
                _ => {
                    for (((to, m), at_pos), &c) in blocks {
                        block(to, m, pos, at_pos, c);
                    }
                }
            }
        }
    }
}

/// A block's rows and mask from the partition's row at every position (`at_pos`) and its
/// count `c`.
#[inline(always)]
fn block<R: Row>(to: &mut [R], m: &mut [bool], pos: &[u32], at_pos: &[R], c: u32) {
    // Every position is below `at_pos.len()`; clamped, it needs no bounds check.
    let Some(last) = at_pos.len().checked_sub(1) else {
        return;
    };
    for ((o, m), &v) in to.iter_mut().zip(m).zip(pos) {
        *o = at_pos[(v as usize).min(last)];
        *m = v < c;
    }
}

#[cfg(test)]
mod tests {
    use crate::sharding::Sharding;
    use crate::stream::{BessStream, StreamSampler};
    use crate::{synth, Triples};

    /// Triples whose shard pair (i, j) (of the stream's sharding, seed 11) holds 1 + (i + 2j) mod 5 triples, but (1, 0) 60: every
    /// partition tiny, every step padded, blocks that wrap their partition several times.
    fn tiny_pairs(n: usize, n_entity: usize) -> Triples {
        let sharding = Sharding::create(n_entity, n, &crate::rng::seed_words(11), None).unwrap();
        let shard_of = &sharding.entity_to_shard;
        let of = |x: usize| {
            (0..n_entity as i64)
                .filter(|&e| shard_of[e as usize] == x as i64)
                .collect::<Vec<i64>>()
        };
        let mut rows = vec![];
        for (i, j) in (0..n).flat_map(|i| (0..n).map(move |j| (i, j))) {
            let k = if (i, j) == (1, 0) {
                60
            } else {
                1 + (i + 2 * j) % 5
            };
            let (hs, ts) = (of(i), of(j));
            rows.extend(
                (0..k).map(|q| [hs[q % hs.len()], (q % 3) as i64, ts[(q * 7 + 1) % ts.len()]]),
            );
        }
        Triples::from_rows(&rows)
    }

    /// The epoch table's batches against the per-step path's (the same stream with the table
    /// switched off): every column and mask of every step, over several epochs, in sequence,
    /// backwards (which replays the generator from its seed), repeated and jumping; tiny
    /// partitions, a skewed graph (most positions padding) and a uniform one; n = 4 and 16,
    /// one host and later hosts of two and four; blocks of every fixed size (1 to 64 rows) and
    /// of 3; no negatives, flat ones and per-triple ones (slices of more rows than triples, with
    /// blocks of up to 4 rows). The grid is kept to what tells the paths apart, because CI runs
    /// this test twice in a debug build.
    #[test]
    fn epoch_table_equals_the_per_step_rows() {
        let (mut checked, mut tabled) = (0, 0);
        for (l, g, s, host) in [(1, 1, 4, 0), (1, 2, 2, 1), (4, 4, 4, 0), (1, 4, 4, 3)] {
            let n = g * s;
            let n_entity = 40 * n;
            let graphs = [
                ("tiny pairs", tiny_pairs(n, n_entity)),
                (
                    "power law",
                    synth::power_law(n_entity, 5, 60 * n * n, 1.0, 4),
                ),
                ("uniform", synth::uniform(n_entity, 5, 30 * n * n, 6)),
            ];
            for (graph, triples) in graphs {
                for shard_bs in [n, 2 * n, 3 * n, 4 * n, 8 * n, 16 * n, 32 * n, 64 * n] {
                    for (negatives, flat) in [(0, true), (2, true), (1, false)] {
                        // Per-triple negatives (n rows a triple) only with blocks of up to 4 rows: their
                        // draws do not touch the table, and with larger blocks they would be most of
                        // the test's time.
                        if !flat && shard_bs > 4 * n {
                            continue;
                        }
                        let make = || {
                            BessStream::builder()
                                .triples(triples.clone())
                                .n_entity(n_entity)
                                .devices(l, g, s)
                                .host(host)
                                .shard_batch_size(shard_bs)
                                .negatives(negatives)
                                .flat_negatives(flat)
                                .sampler(StreamSampler::Rigid { shuffle: true })
                                .seed(11)
                                .build()
                        };
                        let Ok(mut table) = make() else { continue };
                        let mut per_step = make().unwrap();
                        per_step.scratch.pos.epoch.off = true;
                        let w = table.batch_sampler().steps_per_epoch();
                        // Rigid shuffle reads empty partitions by the sampler's index arrays, and
                        // epochs past the bounds by the per-step path.
                        let fits = super::EpochTable::fits(
                            &table.table,
                            &table.layout,
                            table.counts.positive_per_partition,
                            w,
                        );
                        let used = fits && table.partitioned().triple_counts.iter().all(|&c| c > 0);
                        tabled += usize::from(used);
                        // In sequence over three epochs (their ends, where epochs are long),
                        // backwards across an epoch's start, repeated and jumping.
                        let mut steps: Vec<usize> = (0..(3 * w + 2).min(24)).collect();
                        steps.extend(
                            (w.saturating_sub(3)..w + 3)
                                .chain(2 * w - 2..2 * w + 2)
                                .chain(3 * w - 1..3 * w + 1),
                        );
                        steps.extend((w.saturating_sub(3)..w + 2).rev());
                        steps.extend([4 * w + 1, 4 * w + 1, 0, w, 2 * w - 1, 1, 5 * w, 3]);
                        for (k, &step) in steps.iter().enumerate() {
                            let (a, b) = (table.draw(step).unwrap(), per_step.draw(step).unwrap());
                            let what = format!("{graph}, devices ({l}, {g}, {s}) host {host}, shard_bs {shard_bs}, negatives {negatives} flat {flat}, step {step} (#{k})");
                            assert_eq!(
                                table.scratch.pos.epoch.epoch,
                                used.then_some(step / w),
                                "the epoch table's epoch: {what}"
                            );
                            assert_eq!(a.record_batch.schema(), b.record_batch.schema(), "{what}");
                            for (c, (x, y)) in a
                                .record_batch
                                .columns()
                                .iter()
                                .zip(b.record_batch.columns())
                                .enumerate()
                            {
                                assert_eq!(x.to_data(), y.to_data(), "column {c}: {what}");
                            }
                            checked += 1;
                        }
                        assert!(
                            per_step.scratch.pos.epoch.epoch.is_none(),
                            "the per-step path used the table"
                        );
                    }
                }
            }
        }
        assert!(
            checked > 1000 && tabled > 40,
            "{checked} steps checked, {tabled} configurations with the table"
        );
    }
}
