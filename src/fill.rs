//! Stage 4: write one SparseCore's grouped entries into its CSR-wrapped COO segment (SPEC 3.8).
//!
//! A segment is `Cs = C / S` slots of the device's COO buffer plus `rpb = max(N, 8)` row
//! pointers. Partitions are written in order; each starts at a multiple of 8 and the slots
//! between a partition's end and the next multiple of 8 hold the padding triple
//! (`i32::MAX`, `i32::MAX`, NaN `0x7fc00000`). `row_pointers[p]` is the exact (unrounded) end
//! of partition p relative to the segment; pointers `N..rpb` hold the final aligned cursor.
//! Entries that do not fit are dropped and counted; every pointer not yet written then equals
//! `Cs`. The tail after the final aligned cursor, which the reference leaves uninitialised, is
//! padded too, so the output is a pure function of the input; in a reused buffer only up to
//! where the previous batch wrote ([`SegmentWriter::with_tail_extent`]), since the slots past
//! that still hold the padding.

use crate::gain::merge;
use crate::group::{walk_block_plain, Block, Entry, EntrySink};
use crate::key::KeyWord;
use crate::spec::{ALIGNMENT, PAD_GAIN_BITS, PAD_ID};

/// The padding gain (quiet NaN with the reference's bit pattern).
pub const PAD_GAIN: f32 = f32::from_bits(PAD_GAIN_BITS);

/// Fills COO slots with the padding triple (`i32::MAX`, `i32::MAX`, NaN `0x7fc00000`): alignment
/// gaps, and the unwritten tail of a segment or device buffer.
#[inline]
pub fn pad_slots(embedding_ids: &mut [i32], sample_ids: &mut [i32], gains: &mut [f32]) {
    embedding_ids.fill(PAD_ID);
    sample_ids.fill(PAD_ID);
    gains.fill(PAD_GAIN);
}

/// What the slots of a COO buffer past each segment's final (aligned) cursor hold, where the
/// reference leaves memory uninitialised. Either way the output is a pure function of the input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TailFill {
    /// The padding triple (`i32::MAX`, `i32::MAX`, NaN `0x7fc00000`), as in alignment gaps.
    #[default]
    Padding,
    /// Zeros: new buffers come zeroed from the allocator, so tail pages that no batch writes are
    /// never touched (resident memory follows the ids, not the buffer size).
    Zeros,
}

/// Fills the slots of a buffer's tail (past a segment's final cursor) with `fill`.
#[inline]
pub fn fill_tail(
    embedding_ids: &mut [i32],
    sample_ids: &mut [i32],
    gains: &mut [f32],
    fill: TailFill,
) {
    match fill {
        TailFill::Padding => pad_slots(embedding_ids, sample_ids, gains),
        TailFill::Zeros => {
            embedding_ids.fill(0);
            sample_ids.fill(0);
            gains.fill(0.0);
        }
    }
}

/// One SparseCore's slices of the four output arrays.
pub struct Segment<'a> {
    /// `rpb` row pointers.
    pub row_pointers: &'a mut [i32],
    /// `Cs` embedding ids.
    pub embedding_ids: &'a mut [i32],
    /// `Cs` sample ids.
    pub sample_ids: &'a mut [i32],
    /// `Cs` gains.
    pub gains: &'a mut [f32],
}

/// Writes entries (in partition order) into one segment as they come, so that the grouping walk
/// can fill the buffer directly. Call [`SegmentWriter::finish`] at the end.
///
/// It owns the segment's slices (not a reference to a [`Segment`]) so that, once inlined into the
/// walk, its fields live in registers.
pub struct SegmentWriter<'a> {
    row_pointers: &'a mut [i32],
    embedding_ids: &'a mut [i32],
    sample_ids: &'a mut [i32],
    gains: &'a mut [f32],
    /// Added to every row pointer: 0 for segment-relative pointers, the segment's offset in
    /// the device buffer for the absolute pointers of minibatching.
    base: usize,
    /// Write cursor.
    cursor: usize,
    /// Current partition.
    partition: usize,
    /// Slots in the segment (`C / S`).
    capacity: usize,
    num_partitions: usize,
    nbits: u32,
    mask: u32,
    batch_per_sc: u32,
    /// First row of this SparseCore: rows in `[row_lo, row_lo + batch_per_sc)` map to their
    /// offset without a division.
    row_lo: u32,
    /// Rows the walked keys can reference, from `row_lo` on (unknown: `u32::MAX`). When it is
    /// at most `batch_per_sc`, a payload is its own sample id and `walk_block` skips the modulo.
    row_span: u32,
    dropped: u64,
    /// Whether the last pushed entry was written (duplicates merge into it only then).
    last_written: bool,
    /// The gain of the last written entry, kept in a register for branch-free merging.
    last_gain: f32,
    /// Occurrences merged into the last written entry.
    count: u32,
    /// Whether `finish` pads the slice's tail (not when the next segment follows in it).
    pad_tail: bool,
    /// Slots at or past it hold the tail fill already: `finish` fills the tail up to it.
    tail_extent: usize,
    /// What the tail holds.
    tail_fill: TailFill,
}

impl<'a> SegmentWriter<'a> {
    /// A writer for `seg`; `num_partitions` is N, `batch_per_sc` the per-SparseCore stacked
    /// batch (sample ids are rows modulo it) and `row_lo` the SparseCore's first row.
    pub fn new(seg: Segment<'a>, num_partitions: usize, batch_per_sc: u32, row_lo: u32) -> Self {
        let capacity = seg
            .embedding_ids
            .len()
            .min(seg.sample_ids.len())
            .min(seg.gains.len());
        SegmentWriter {
            row_pointers: seg.row_pointers,
            embedding_ids: seg.embedding_ids,
            sample_ids: seg.sample_ids,
            gains: seg.gains,
            base: 0,
            cursor: 0,
            partition: 0,
            capacity,
            num_partitions,
            nbits: num_partitions.trailing_zeros(),
            mask: (num_partitions - 1) as u32,
            batch_per_sc: batch_per_sc.max(1),
            row_lo,
            row_span: u32::MAX,
            dropped: 0,
            last_written: false,
            last_gain: 0.0,
            count: 0,
            pad_tail: true,
            tail_extent: capacity,
            tail_fill: TailFill::Padding,
        }
    }

    /// Fills the tail with `fill`, and declares that the segment's slots at or past `extent`
    /// hold it already (what the previous batch left in a reused buffer), so that `finish`
    /// fills the tail only up to there.
    pub fn with_tail(mut self, extent: usize, fill: TailFill) -> Self {
        self.tail_extent = extent.min(self.capacity);
        self.tail_fill = fill;
        self
    }

    /// Declares that the keys walked into this writer reference rows below `row_lo + row_span`
    /// (the extracted keys' span), which lets `walk_block` write payloads as sample ids.
    pub fn with_row_span(mut self, row_span: u32) -> Self {
        self.row_span = row_span;
        self
    }

    /// Makes row pointers absolute: `base` is this segment's offset in the device buffer.
    pub fn with_base(mut self, base: usize) -> Self {
        self.base = base;
        self
    }

    /// Leaves the slice's tail alone at `finish`: the next segment starts there.
    pub fn without_tail(mut self) -> Self {
        self.pad_tail = false;
        self
    }

    /// Appends an entry of partition `t` (partitions arrive in order).
    #[inline(always)]
    fn write(&mut self, t: usize, local: u32, row: u32, gain: f32) {
        while self.partition < t {
            self.close();
        }
        let before = self.dropped;
        self.write_here(local, row, gain);
        self.last_written = self.dropped == before;
    }

    /// Appends an entry of the current partition.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn write_here(&mut self, local: u32, row: u32, gain: f32) {
        let i = self.cursor;
        if i >= self.capacity {
            self.dropped += 1;
            return;
        }
        let offset = row.wrapping_sub(self.row_lo);
        let sample = if offset < self.batch_per_sc {
            offset
        } else {
            row % self.batch_per_sc
        };
        // SAFETY: `capacity` is the minimum of the three slices' lengths (set in `new`, the slices
        // are never replaced), and i < capacity.
        unsafe {
            *self.embedding_ids.get_unchecked_mut(i) = local as i32;
            *self.sample_ids.get_unchecked_mut(i) = sample as i32;
            *self.gains.get_unchecked_mut(i) = gain;
        }
        self.last_gain = gain;
        self.count = 1;
        self.cursor = i + 1;
    }

    /// Writes the padding triple into `[from, to)`.
    #[inline]
    fn pad(&mut self, from: usize, to: usize) {
        pad_slots(
            &mut self.embedding_ids[from..to],
            &mut self.sample_ids[from..to],
            &mut self.gains[from..to],
        );
    }

    /// Ends partition `p` at the cursor and pads the cursor to the next multiple of 8.
    #[inline]
    fn close(&mut self) {
        self.row_pointers[self.partition] = (self.base + self.cursor) as i32;
        let aligned = self.cursor.next_multiple_of(ALIGNMENT).min(self.capacity);
        self.pad(self.cursor, aligned);
        self.cursor = aligned;
        self.partition += 1;
    }

    /// Closes the remaining partitions, sets pointers `N..rpb` to the final cursor, pads the
    /// tail, and returns how many entries did not fit.
    pub fn finish(self) -> u64 {
        self.finish_at().0
    }

    /// [`SegmentWriter::finish`], also returning the final (aligned) cursor.
    pub fn finish_at(mut self) -> (u64, usize) {
        while self.partition < self.num_partitions {
            self.close();
        }
        let i = self.cursor;
        let end = (self.base + i) as i32;
        for rp in &mut self.row_pointers[self.num_partitions..] {
            *rp = end;
        }
        if self.pad_tail && i < self.tail_extent {
            let end = self.tail_extent;
            fill_tail(
                &mut self.embedding_ids[i..end],
                &mut self.sample_ids[i..end],
                &mut self.gains[i..end],
                self.tail_fill,
            );
        }
        (self.dropped, i)
    }
}

impl EntrySink for SegmentWriter<'_> {
    #[inline(always)]
    fn push(&mut self, e: Entry) {
        self.write(
            (e.col & self.mask) as usize,
            e.col >> self.nbits,
            e.row,
            e.gain,
        );
    }

    #[inline(always)]
    fn push_parts(&mut self, partition: u32, local: u32, _nbits: u32, row: u32, gain: f32) {
        self.write(partition as usize, local, row, gain);
    }

    #[inline(always)]
    fn add_to_last(&mut self, gain: f32) {
        if self.last_written {
            // Merged as the reference does, on a thread that flushes subnormals to zero.
            self.last_gain = merge(self.last_gain, gain);
            self.gains[self.cursor - 1] = self.last_gain;
            self.count += 1;
        }
    }

    #[inline(never)]
    fn start_partition(mut self, partition: u32) -> Self {
        while self.partition < partition as usize {
            self.close();
        }
        self
    }

    #[inline(always)]
    fn push_local(&mut self, _partition: u32, local: u32, _nbits: u32, row: u32, gain: f32) {
        self.write_here(local, row, gain);
        // Once an entry is dropped every later one is (the cursor stays at `capacity`), so the
        // last entry was written exactly when nothing has been dropped yet.
        self.last_written = self.dropped == 0;
    }

    #[inline(always)]
    fn room(&self) -> usize {
        self.capacity - self.cursor
    }

    /// The branch-free block walk: every key writes its entry at the cursor, or, when it
    /// repeats the previous key, over the previous entry (same id and sample) with the merged
    /// gain, chosen by a select; unit gains are counted in an integer register.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn walk_block<K: KeyWord>(
        &mut self,
        keys: &[K],
        b: Block,
        last: u64,
        gain: impl Fn(u64, u32) -> f32,
    ) -> (u64, u32, u32) {
        let start = self.cursor;
        if b.row_lo != self.row_lo
            || self.row_span > self.batch_per_sc
            || keys.len() > self.capacity - start
        {
            // Payloads that are not this segment's samples, or no room: the plain walk.
            return walk_block_plain(self, keys, b, last, gain);
        }
        // With nothing written yet there is nothing to merge into (`last` then belongs to no
        // entry of this segment, and cannot equal a key of this partition anyway).
        let mut last = if start == 0 { u64::MAX } else { last };
        let dmask = (1u64 << b.data_bits) - 1;
        let (emb, smp, gains) = (
            self.embedding_ids.as_mut_ptr(),
            self.sample_ids.as_mut_ptr(),
            self.gains.as_mut_ptr(),
        );
        let (mut i, mut count, mut acc, mut unique) = (start, self.count, self.last_gain, 0u32);
        for &k in keys {
            let element = k.to_u64();
            let key = (element >> b.element_shift) | b.high;
            let dup = key == last;
            unique += ((key ^ last) >> b.data_bits != 0) as u32;
            let data = (key & dmask) as u32;
            let g = if b.unit {
                count = std::hint::select_unpredictable(dup, count.saturating_add(1), 1);
                // The f32 sum of `count` ones: exact up to 2^24, where it stops growing.
                (count as f32).min(16_777_216.0)
            } else {
                let g = gain(element, data);
                let merged = merge(acc, g);
                // Selected as bits: a float select tends to become a branch.
                f32::from_bits(std::hint::select_unpredictable(
                    dup,
                    merged.to_bits(),
                    g.to_bits(),
                ))
            };
            acc = g;
            let j = i - dup as usize;
            // SAFETY: `dup` needs an entry before the cursor (start > 0, or a key of this
            // block), so j cannot underflow; the cursor grows by at most one per key from
            // `start`, and start + keys.len() <= capacity (checked above), so j < capacity, the length of
            // all three slices.
            unsafe {
                emb.add(j)
                    .write(((key >> b.data_bits) & b.local_mask) as i32);
                // The sample is the payload: rows of this segment (row_lo matches) and below
                // batch_per_sc (`row_span` does).
                smp.add(j).write(data as i32);
                gains.add(j).write(g);
            }
            i = j + 1;
            last = key;
        }
        if i > start || !keys.is_empty() {
            self.last_written = true;
        }
        (self.cursor, self.count, self.last_gain) = (i, count, acc);
        (last, (i - start) as u32, unique)
    }
}

/// Fills `seg` from `entries` (sorted by partition) and returns how many entries did not fit.
#[cfg(any(test, feature = "internals"))]
pub fn fill_segment(
    entries: &[Entry],
    num_partitions: usize,
    batch_per_sc: u32,
    seg: Segment<'_>,
) -> u64 {
    let mut w = SegmentWriter::new(seg, num_partitions, batch_per_sc, 0);
    for &e in entries {
        w.push(e);
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        entries: &[Entry],
        n: usize,
        bsps: u32,
        cs: usize,
    ) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<f32>, u64) {
        let mut rp = vec![-1; n.max(8)];
        let mut emb = vec![-1; cs];
        let mut smp = vec![-1; cs];
        let mut g = vec![-1.0; cs];
        let dropped = {
            let seg = Segment {
                row_pointers: &mut rp,
                embedding_ids: &mut emb,
                sample_ids: &mut smp,
                gains: &mut g,
            };
            fill_segment(entries, n, bsps, seg)
        };
        (rp, emb, smp, g, dropped)
    }

    const P: i32 = PAD_ID;

    #[test]
    fn spec_fill_buffer_sc() {
        // SPEC 3.8 FillBuffer: one SC, N = 4, two entries per partition, bsps 2, Cs 40.
        let entries: Vec<Entry> = (0..4u32)
            .flat_map(|p| {
                (0..2u32).map(move |row| Entry {
                    col: p,
                    row,
                    gain: 1.0,
                })
            })
            .collect();
        let (rp, emb, smp, g, dropped) = run(&entries, 4, 2, 40);
        assert_eq!(rp, vec![2, 10, 18, 26, 32, 32, 32, 32]);
        assert_eq!(dropped, 0);
        for part in 0..4 {
            assert_eq!(&emb[part * 8..part * 8 + 8], &[0, 0, P, P, P, P, P, P]);
            assert_eq!(&smp[part * 8..part * 8 + 8], &[0, 1, P, P, P, P, P, P]);
            assert_eq!(g[part * 8].to_bits(), 1.0f32.to_bits());
            assert_eq!(g[part * 8 + 2].to_bits(), PAD_GAIN_BITS);
        }
        // The deterministic tail.
        assert!(emb[32..].iter().all(|&v| v == P));
        assert!(g[32..].iter().all(|v| v.to_bits() == PAD_GAIN_BITS));
    }

    #[test]
    fn branch_free_walk_equals_the_plain_one() {
        // Runs of equal keys (local id in the high half, sample in the low): the writer's
        // branch-free walk against the plain one, for unit gains (including a count past
        // 2^24, where summing ones in f32 stops growing) and for given gains.
        let runs: [(u64, u64, usize); 5] = [
            (0, 0, 1),
            (1, 1, 3),
            (2, 2, (1 << 24) + 3),
            (3, 3, 2),
            (5, 4, 2),
        ];
        let keys: Vec<u64> = runs
            .iter()
            .flat_map(|&(local, row, n)| std::iter::repeat_n(local << 3 | row, n))
            .collect();
        let gain = |element: u64, _data: u32| if element >> 3 == 5 { 1.5 } else { 0.25 };
        for unit in [true, false] {
            let block = Block {
                high: 0,
                element_shift: 0,
                data_bits: 3,
                local_mask: 7,
                nbits: 0,
                partition: 0,
                row_lo: 0,
                unit,
            };
            let written = |fast: bool| {
                let mut bufs = (
                    vec![0i32; 8],
                    vec![0i32; 16],
                    vec![0i32; 16],
                    vec![0f32; 16],
                );
                let seg = Segment {
                    row_pointers: &mut bufs.0,
                    embedding_ids: &mut bufs.1,
                    sample_ids: &mut bufs.2,
                    gains: &mut bufs.3,
                };
                let mut w = SegmentWriter::new(seg, 1, 8, 0).with_row_span(8);
                // Two blocks, split inside a run.
                let (a, b) = keys.split_at(2);
                let mut last = u64::MAX;
                let mut totals = (0, 0);
                for part in [a, b] {
                    let (l, ids, unique) = if fast {
                        w.walk_block(part, block, last, gain)
                    } else {
                        walk_block_plain(&mut w, part, block, last, gain)
                    };
                    last = l;
                    totals = (totals.0 + ids, totals.1 + unique);
                }
                w.finish();
                (bufs, totals)
            };
            let ((fast, ft), (plain, pt)) = (written(true), written(false));
            assert_eq!(ft, pt);
            assert_eq!(ft, (5, 5));
            assert_eq!(fast.1, plain.1);
            assert_eq!(&fast.2[..5], &[0, 1, 2, 3, 4]);
            assert_eq!(fast.2, plain.2);
            let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast.3), bits(&plain.3));
            if unit {
                assert_eq!(&fast.3[..5], &[1.0, 3.0, 16_777_216.0, 2.0, 2.0]);
            } else {
                assert_eq!(&fast.3[..2], &[0.25, 0.75]);
                assert_eq!(&fast.3[3..5], &[0.5, 3.0]);
            }
        }
    }

    #[test]
    fn spec_overflow_single_partition() {
        // SPEC 3.8 overflow example: N = 1, C = 8, cols 0..3, 10..13, 20..23 over rows 0..3.
        let mut entries = Vec::new();
        for base in [0u32, 10, 20] {
            for r in 0..4u32 {
                entries.push(Entry {
                    col: base + r,
                    row: r,
                    gain: 1.0,
                });
            }
        }
        let (rp, emb, smp, _, dropped) = run(&entries, 1, 4, 8);
        assert_eq!(rp, vec![8; 8]);
        assert_eq!(emb, vec![0, 1, 2, 3, 10, 11, 12, 13]);
        assert_eq!(smp, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(dropped, 4);
    }

    #[test]
    fn overflow_mid_partitions_sets_remaining_pointers_to_segment_size() {
        // N = 2, Cs = 8: partition 0 takes 7 slots, partition 1's two entries start at 8 = Cs.
        let mut entries: Vec<Entry> = (0..7u32)
            .map(|r| Entry {
                col: 0,
                row: r,
                gain: 1.0,
            })
            .collect();
        entries.push(Entry {
            col: 1,
            row: 0,
            gain: 1.0,
        });
        entries.push(Entry {
            col: 3,
            row: 1,
            gain: 1.0,
        });
        let (rp, emb, _, _, dropped) = run(&entries, 2, 8, 8);
        assert_eq!(rp, vec![7, 8, 8, 8, 8, 8, 8, 8]);
        assert_eq!(dropped, 2);
        assert_eq!(emb[7], P);
    }
}
