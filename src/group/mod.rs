//! Stage 3: sort the keys of one SparseCore, merge duplicates, apply the per-partition limits and
//! count the statistics (SPEC 3.6, 3.7).
//!
//! After sorting, entries come in (bucket, partition, local embedding id, row) order. One walk
//! then:
//! - merges repeated (row, column) pairs of one sample by adding their gains in sorted order;
//! - counts, per destination partition, the de-duplicated ids and the distinct columns (the FDO
//!   statistics are taken here: after de-duplication, before dropping);
//! - with `allow_id_dropping`, keeps only a prefix of each partition: the first `max_ids` pairs
//!   whose column is among the first `max_unique` columns, counting every raw occurrence it
//!   drops.

mod key;
mod sort;

pub use key::{decode_key, encode_key, KeyLayout};
pub use sort::sort_keys;

use crate::extract::Extracted;
use crate::spec::{round_up, ALIGNMENT};

/// One de-duplicated, kept entry, ready for the fill stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    /// Stacked column id: partition in the low `log2 N` bits, local embedding id above.
    pub col: u32,
    /// Device-level sample row.
    pub row: u32,
    /// Combined gain.
    pub gain: f32,
}

/// Limits of one stack, as the walk applies them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Max de-duplicated ids per partition.
    pub max_ids: u32,
    /// Max distinct ids per partition.
    pub max_unique: u32,
    /// Drop what exceeds the limits (otherwise keep everything; the driver reports the excess).
    pub drop: bool,
}

/// Statistics of one SparseCore for one stack.
#[derive(Debug, Default, Clone)]
pub struct ScStats {
    /// De-duplicated ids sent to each partition (before dropping).
    pub ids: Vec<u32>,
    /// Distinct ids sent to each partition (before dropping).
    pub unique: Vec<u32>,
    /// Ids dropped by the limits (every raw occurrence).
    pub dropped: u64,
}

impl ScStats {
    /// Buffer this SparseCore needs: Σ over partitions of ids rounded up to 8.
    pub fn required(&self) -> u64 {
        self.ids.iter().map(|&n| round_up(n as u64, ALIGNMENT as u64)).sum()
    }

    /// Largest per-partition id count and its partition.
    pub fn max_ids(&self) -> (u32, usize) {
        max_with_index(&self.ids)
    }

    /// Largest per-partition distinct-id count and its partition.
    pub fn max_unique(&self) -> (u32, usize) {
        max_with_index(&self.unique)
    }
}

fn max_with_index(v: &[u32]) -> (u32, usize) {
    let mut best = (0, 0);
    for (i, &x) in v.iter().enumerate() {
        if x > best.0 {
            best = (x, i);
        }
    }
    best
}

/// Sorts `ex.keys` in place (with `scratch` as the radix sort's second buffer), then walks them
/// into `out` (cleared first) and `stats`.
pub fn sort_and_group(
    ex: &mut Extracted,
    scratch: &mut Vec<u64>,
    layout: KeyLayout,
    limits: Limits,
    out: &mut Vec<Entry>,
    stats: &mut ScStats,
) {
    sort_keys(&mut ex.keys, scratch, layout, ex.data_sorted, false);
    group_sorted(ex, layout, limits, out, stats);
}

/// The walk of SPEC 3.7 over already sorted keys.
pub fn group_sorted(ex: &Extracted, layout: KeyLayout, limits: Limits, out: &mut Vec<Entry>, stats: &mut ScStats) {
    let n = 1usize << layout.nbits;
    let mask = (n - 1) as u32;
    out.clear();
    stats.ids.clear();
    stats.ids.resize(n, 0);
    stats.unique.clear();
    stats.unique.resize(n, 0);
    stats.dropped = 0;

    // `prev_*`: the last entry that was not merged (kept or dropped). Columns are < 2^32, so
    // u64::MAX means "none".
    let mut prev_row = u64::MAX;
    let mut prev_col = u64::MAX;
    let mut dropping_col = false;
    for &key in &ex.keys {
        let (_bucket, col, data) = layout.decode(key);
        let (row, gain) = ex.row_and_gain(data);
        // 1. Merge into the last appended entry.
        if let Some(last) = out.last_mut() {
            if last.row == row && last.col == col {
                last.gain += gain;
                continue;
            }
        }
        // 2. A repeat of a pair that was dropped.
        if limits.drop && row as u64 == prev_row && col as u64 == prev_col {
            stats.dropped += 1;
            continue;
        }
        // 3. Count.
        let new_col = col as u64 != prev_col;
        let g = (col & mask) as usize;
        stats.ids[g] += 1;
        if new_col {
            stats.unique[g] += 1;
        }
        // 4. Keep or drop. The kept counters equal the observed ones, so the counts above decide.
        if limits.drop {
            let exceeds = stats.ids[g] > limits.max_ids;
            if new_col {
                dropping_col = stats.unique[g] > limits.max_unique;
            }
            if exceeds || dropping_col {
                stats.dropped += 1;
            } else {
                out.push(Entry { col, row, gain });
            }
        } else {
            out.push(Entry { col, row, gain });
        }
        prev_row = row as u64;
        prev_col = col as u64;
    }
}
