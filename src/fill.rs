//! Stage 4: write one SparseCore's grouped entries into its CSR-wrapped COO segment (SPEC 3.8).
//!
//! A segment is `Cs = C / S` slots of the device's COO buffer plus `rpb = max(N, 8)` row
//! pointers. Partitions are written in order; each starts at a multiple of 8 and the slots
//! between a partition's end and the next multiple of 8 hold the padding triple
//! (`i32::MAX`, `i32::MAX`, NaN `0x7fc00000`). `row_pointers[p]` is the exact (unrounded) end
//! of partition p relative to the segment; pointers `N..rpb` hold the final aligned cursor.
//! Entries that do not fit are dropped and counted; every pointer not yet written then equals
//! `Cs`. The tail after the final aligned cursor, which the reference leaves uninitialised, is
//! padded too, so the output is a pure function of the input.

use crate::group::Entry;
use crate::spec::{ALIGNMENT, PAD_GAIN_BITS, PAD_ID};

/// The padding gain (quiet NaN with the reference's bit pattern).
pub const PAD_GAIN: f32 = f32::from_bits(PAD_GAIN_BITS);

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

/// Writes the padding triple into `[from, to)`.
#[inline]
fn pad(seg: &mut Segment<'_>, from: usize, to: usize) {
    seg.embedding_ids[from..to].fill(PAD_ID);
    seg.sample_ids[from..to].fill(PAD_ID);
    seg.gains[from..to].fill(PAD_GAIN);
}

/// Fills `seg` from `entries` (sorted by partition) and returns how many entries did not fit.
///
/// `num_partitions` is N and `batch_per_sc` the per-SparseCore stacked batch (sample ids are
/// rows modulo it).
pub fn fill_segment(entries: &[Entry], num_partitions: usize, batch_per_sc: u32, seg: &mut Segment<'_>) -> u64 {
    let cs = seg.embedding_ids.len();
    let nbits = num_partitions.trailing_zeros();
    let mask = (num_partitions - 1) as u32;
    let mut i = 0usize;
    let mut p = 0usize;
    let mut dropped = 0u64;

    // Ends partition `p` at the cursor and pads the cursor to the next multiple of 8.
    let close = |seg: &mut Segment<'_>, p: usize, i: usize| -> usize {
        seg.row_pointers[p] = i as i32;
        let aligned = i.next_multiple_of(ALIGNMENT).min(cs);
        pad(seg, i, aligned);
        aligned
    };

    for (k, e) in entries.iter().enumerate() {
        let t = (e.col & mask) as usize;
        while p < t {
            i = close(seg, p, i);
            p += 1;
        }
        if i >= cs {
            dropped = (entries.len() - k) as u64;
            break;
        }
        seg.embedding_ids[i] = (e.col >> nbits) as i32;
        seg.sample_ids[i] = (e.row % batch_per_sc) as i32;
        seg.gains[i] = e.gain;
        i += 1;
    }
    while p < num_partitions {
        i = close(seg, p, i);
        p += 1;
    }
    for rp in &mut seg.row_pointers[num_partitions..] {
        *rp = i as i32;
    }
    pad(seg, i, cs);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(entries: &[Entry], n: usize, bsps: u32, cs: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<f32>, u64) {
        let mut rp = vec![-1; n.max(8)];
        let mut emb = vec![-1; cs];
        let mut smp = vec![-1; cs];
        let mut g = vec![-1.0; cs];
        let dropped = {
            let mut seg = Segment { row_pointers: &mut rp, embedding_ids: &mut emb, sample_ids: &mut smp, gains: &mut g };
            fill_segment(entries, n, bsps, &mut seg)
        };
        (rp, emb, smp, g, dropped)
    }

    const P: i32 = PAD_ID;

    #[test]
    fn spec_fill_buffer_sc() {
        // SPEC 3.8 FillBuffer: one SC, N = 4, two entries per partition, bsps 2, Cs 40.
        let entries: Vec<Entry> = (0..4u32)
            .flat_map(|p| (0..2u32).map(move |row| Entry { col: p, row, gain: 1.0 }))
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
    fn spec_overflow_single_partition() {
        // SPEC 3.8 overflow example: N = 1, C = 8, cols 0..3, 10..13, 20..23 over rows 0..3.
        let mut entries = Vec::new();
        for base in [0u32, 10, 20] {
            for r in 0..4u32 {
                entries.push(Entry { col: base + r, row: r, gain: 1.0 });
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
        let mut entries: Vec<Entry> = (0..7u32).map(|r| Entry { col: 0, row: r, gain: 1.0 }).collect();
        entries.push(Entry { col: 1, row: 0, gain: 1.0 });
        entries.push(Entry { col: 3, row: 1, gain: 1.0 });
        let (rp, emb, _, _, dropped) = run(&entries, 2, 8, 8);
        assert_eq!(rp, vec![7, 8, 8, 8, 8, 8, 8, 8]);
        assert_eq!(dropped, 2);
        assert_eq!(emb[7], P);
    }
}
