//! Stage 3: sort the keys of one SparseCore, merge duplicates, apply the per-partition limits and
//! count the statistics (SPEC 3.6, 3.7).
//!
//! After sorting, entries come in (partition, local embedding id, row) order. One walk
//! then:
//! - merges repeated (row, column) pairs of one sample by adding their gains in sorted order;
//! - counts, per destination partition, the de-duplicated ids and the distinct columns (the FDO
//!   statistics are taken here: after de-duplication, before dropping);
//! - with `allow_id_dropping`, keeps only a prefix of each partition: the first `max_ids` pairs
//!   whose column is among the first `max_unique` columns, counting every raw occurrence it
//!   drops.
//!
//! Modules: `sort` (radix sort and split), `walk` (the walk, which sorts chunk by chunk and
//! walks each while it is in cache), `sink` (where kept entries go), and `bucket`
//! (minibatching's buckets and its bucketed pass over merged entries).

pub(crate) mod bucket;
mod sink;
mod sort;
mod walk;

pub use bucket::{bucket_pass, Bucketed};
pub use sink::{walk_block_plain, Block, CountedEntry, Entry, EntrySink};
#[cfg(feature = "internals")]
pub use walk::sort_and_group;
pub use walk::sort_and_walk;

use sort::RadixScratch;

use crate::reuse::reserve_to;
use crate::spec::{round_up, ALIGNMENT};

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
    /// Count of de-duplicated ids sent to each partition (before dropping).
    pub id_counts: Vec<u32>,
    /// Count of distinct ids sent to each partition (before dropping).
    pub unique_counts: Vec<u32>,
    /// Ids dropped by the limits (every raw occurrence).
    pub dropped: u64,
}

impl ScStats {
    /// Buffer this SparseCore needs: Σ over partitions of ids rounded up to 8.
    pub fn required(&self) -> u64 {
        self.id_counts
            .iter()
            .map(|&n| round_up(n as u64, ALIGNMENT as u64))
            .sum()
    }

    /// Largest per-partition id count and its partition.
    pub fn max_ids(&self) -> (u32, usize) {
        max_with_index(&self.id_counts)
    }

    /// Largest per-partition distinct-id count and its partition.
    pub fn max_unique(&self) -> (u32, usize) {
        max_with_index(&self.unique_counts)
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

/// Sort memory, reused across batches: the chunks of [`sort::split`] with their bounds, and the
/// radix sort's second buffers for both key widths.
#[derive(Debug, Default)]
pub struct SortScratch {
    wide: RadixScratch<u64>,
    narrow: RadixScratch<u32>,
    chunks: Vec<u32>,
    /// The chunks of packed keys wider than 32 bits.
    packed: Vec<u64>,
    starts: Vec<u32>,
    cursors: Vec<u32>,
}

impl SortScratch {
    /// Grows every buffer to at least `other`'s capacity.
    pub fn reserve_like(&mut self, other: &SortScratch) {
        self.wide.reserve_like(&other.wide);
        self.narrow.reserve_like(&other.narrow);
        for (mine, theirs) in [
            (&mut self.chunks, &other.chunks),
            (&mut self.starts, &other.starts),
            (&mut self.cursors, &other.cursors),
        ] {
            reserve_to(mine, theirs.capacity());
        }
        reserve_to(&mut self.packed, other.packed.capacity());
    }
}
