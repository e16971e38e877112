//! Minibatching buckets (SPEC 5.2) and the split bitmask (SPEC 5.5).
//!
//! Every column id hashes to one of 64 buckets, so all occurrences of an embedding row land in
//! the same bucket and hence the same minibatch. Buckets are the leaves of a complete binary
//! tree; a split bit on an internal node is a minibatch boundary in the middle of its range.

use std::sync::Arc;

use highway::{HighwayHash, HighwayHasher, Key};

use super::sink::{CountedEntry, Entry};
use super::{max_with_index, Limits};

/// Number of buckets.
pub const BUCKETS: usize = 64;

/// The reference's fixed HighwayHash key (`kHighwayHashKey`).
pub const HIGHWAY_KEY: [u64; 4] = [
    0x4451e30f87db9609,
    0xca7358a1fd2737f8,
    0x4b2c991fcee4fdea,
    0x0b2658e18326f6ba,
];

/// HighwayHash-64 of a column id's 4 little-endian bytes under the reference's key.
pub fn highway_hash(col: u32) -> u64 {
    let mut h = HighwayHasher::new(Key(HIGHWAY_KEY));
    h.append(&col.to_le_bytes());
    h.finalize64()
}

/// Maps a column id to its bucket (< 64). Injectable, as in the reference, so that tests can
/// use the identity (`col & 63`).
#[derive(Clone)]
pub struct BucketFn(Arc<dyn Fn(u32) -> u32 + Send + Sync>);

impl BucketFn {
    /// The reference's hash: `HighwayHash64(col) & 63`.
    pub fn highway() -> Self {
        BucketFn(Arc::new(|col| (highway_hash(col) & 63) as u32))
    }

    /// `col & 63`, the reference's test hook.
    pub fn identity() -> Self {
        BucketFn(Arc::new(|col| col & 63))
    }

    /// A custom hash; its result is taken modulo 64.
    pub fn custom(f: impl Fn(u32) -> u32 + Send + Sync + 'static) -> Self {
        BucketFn(Arc::new(f))
    }

    /// The bucket of `col`.
    #[inline]
    pub fn bucket(&self, col: u32) -> u32 {
        (self.0)(col) & 63
    }
}

impl std::fmt::Debug for BucketFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BucketFn")
    }
}

impl Default for BucketFn {
    fn default() -> Self {
        Self::highway()
    }
}

/// The split bits of one counter vector over `2^h` leaves (SPEC 5.5): bottom-up, a node whose
/// two children sum above `limit` gets its bit set and keeps the larger child; otherwise it
/// holds the sum. Level ℓ's nodes are bits `2^h - 2^(h+1-ℓ) + i`.
pub fn split_bits(values: &[u32], limit: u32) -> u64 {
    let leaves = values.len();
    debug_assert!(leaves.is_power_of_two() && leaves <= 64);
    let h = leaves.trailing_zeros();
    let mut v: [u64; 64] = [0; 64];
    for (a, &b) in v.iter_mut().zip(values) {
        *a = b as u64;
    }
    let limit = limit as u64;
    let mut bits = 0u64;
    for level in 1..=h {
        let size = 1usize << level;
        let half = size / 2;
        let base = (1u64 << h) - (1u64 << (h + 1 - level));
        for i in 0..(leaves / size) {
            let (l, r) = (v[i * size], v[i * size + half]);
            if l + r > limit {
                bits |= 1 << (base + i as u64);
                v[i * size] = l.max(r);
            } else {
                v[i * size] = l + r;
            }
        }
    }
    bits
}

/// The bucket ranges `[start, end)` of the minibatches a 64-leaf split gives, in order.
pub fn minibatch_ranges(split: u64) -> Vec<(usize, usize)> {
    let mut ranges = Vec::with_capacity(split.count_ones() as usize + 1);
    let mut start = 0;
    for k in 1..BUCKETS {
        // Boundary k sits at level ctz(k) + 1, node k >> level.
        let level = k.trailing_zeros() + 1;
        let node = (k >> level) as u64;
        let bit = (BUCKETS as u64) - (1u64 << (7 - level)) + node;
        if split & (1 << bit) != 0 {
            ranges.push((start, k));
            start = k;
        }
    }
    ranges.push((start, BUCKETS));
    ranges
}

/// One SparseCore's bucketed pass (SPEC 5.4 step 4), reused across batches.
#[derive(Debug, Default, Clone)]
pub struct Bucketed {
    /// Kept entries in (partition, bucket, local id, row) order.
    pub entries: Vec<Entry>,
    /// `starts[g * 64 + b] .. starts[g * 64 + b + 1]` are the entries of partition g, bucket b.
    pub starts: Vec<u32>,
    /// Count of de-duplicated ids per (partition, bucket), before dropping.
    pub id_counts: Vec<u32>,
    /// Count of distinct ids per (partition, bucket), before dropping.
    pub unique_counts: Vec<u32>,
    /// Occurrences dropped by the per-bucket limits.
    pub dropped: u64,
    /// This SparseCore's split bits.
    pub split: u64,
    buckets: Vec<u8>,
    order: Vec<Entry>,
    next: Vec<u32>,
}

impl Bucketed {
    /// Largest per-(partition, bucket) count of ids and of distinct ids, with the partition of
    /// each.
    pub fn max_counts(&self) -> ((u32, usize), (u32, usize)) {
        let ids = max_with_index(&self.id_counts);
        let uniq = max_with_index(&self.unique_counts);
        ((ids.0, ids.1 / BUCKETS), (uniq.0, uniq.1 / BUCKETS))
    }
}

/// The bucketed pass over one SparseCore's pass-1 entries (in pass-1 order: partition, local id,
/// row). Counting per (partition, bucket) in this order equals the reference's walk over keys
/// re-sorted with bucket bits: a column's entries are contiguous and share one bucket, so the
/// "new column" test and each (partition, bucket) group's order are the same.
pub fn bucket_pass(
    pass1: &[CountedEntry],
    nbits: u32,
    buckets: &BucketFn,
    limits: Limits,
    out: &mut Bucketed,
) {
    const B: usize = BUCKETS;
    let n = 1usize << nbits;
    let mask = (n - 1) as u32;
    for v in [&mut out.id_counts, &mut out.unique_counts] {
        v.clear();
        v.resize(n * B, 0);
    }
    out.order.clear();
    out.buckets.clear();
    out.dropped = 0;
    let mut prev_col = u64::MAX;
    let mut b = 0u32;
    let mut dropping_col = false;
    for ce in pass1 {
        let col = ce.entry.col;
        let new_col = col as u64 != prev_col;
        if new_col {
            b = buckets.bucket(col);
        }
        prev_col = col as u64;
        let idx = (col & mask) as usize * B + b as usize;
        out.id_counts[idx] += 1;
        out.unique_counts[idx] += new_col as u32;
        if limits.drop {
            if new_col {
                dropping_col = out.unique_counts[idx] > limits.max_unique;
            }
            if out.id_counts[idx] > limits.max_ids || dropping_col {
                out.dropped += ce.count as u64;
                continue;
            }
        }
        out.order.push(ce.entry);
        out.buckets.push(b as u8);
    }
    // Split bits of this SparseCore.
    out.split = 0;
    for g in 0..n {
        out.split |= split_bits(&out.id_counts[g * B..(g + 1) * B], limits.max_ids);
        out.split |= split_bits(&out.unique_counts[g * B..(g + 1) * B], limits.max_unique);
    }
    // Stable counting sort of the kept entries by (partition, bucket).
    out.starts.clear();
    out.starts.resize(n * B + 1, 0);
    for (e, &bk) in out.order.iter().zip(&out.buckets) {
        out.starts[(e.col & mask) as usize * B + bk as usize + 1] += 1;
    }
    for i in 1..out.starts.len() {
        out.starts[i] += out.starts[i - 1];
    }
    out.entries.clear();
    out.entries.resize(
        out.order.len(),
        Entry {
            col: 0,
            row: 0,
            gain: 0.0,
        },
    );
    out.next.clear();
    out.next.extend_from_slice(&out.starts[..n * B]);
    for (e, &bk) in out.order.iter().zip(&out.buckets) {
        let k = (e.col & mask) as usize * B + bk as usize;
        out.entries[out.next[k] as usize] = *e;
        out.next[k] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highway_reference_vectors() {
        // Canonical HighwayHash test vectors, with the reference key 0x0706050403020100...
        let key = Key([
            0x0706050403020100,
            0x0F0E0D0C0B0A0908,
            0x1716151413121110,
            0x1F1E1D1C1B1A1918,
        ]);
        let h = |bytes: &[u8]| {
            let mut x = HighwayHasher::new(key);
            x.append(bytes);
            x.finalize64()
        };
        assert_eq!(h(&[]), 0x907A56DE22C26E53);
        assert_eq!(h(&[0]), 0x7EAB43AAC7CDDD78);
        assert_eq!(h(&[0, 1, 2, 3]), 0xF205A46893007EDA);
    }

    #[test]
    fn peer_key_vectors() {
        // SPEC 5.2: col -> hash -> bucket with the peer's key.
        let table: [(u32, u64, u32); 22] = [
            (0, 0x286118c966bafb07, 7),
            (1, 0x655193192efacaa7, 39),
            (2, 0x271ba71641c27acd, 13),
            (3, 0x1dddacbe862539a3, 35),
            (4, 0xc86e1fb4d76bc5a2, 34),
            (5, 0x463351079b9ece35, 53),
            (6, 0xb042c520f130d209, 9),
            (7, 0xff9774b1749041f6, 54),
            (8, 0xc1d25f6036862a0e, 14),
            (15, 0x9ae5bf0337be244c, 12),
            (16, 0x0b71691e536848ee, 46),
            (31, 0x0160e37cbcea7d3d, 61),
            (32, 0x1c46c8a71947a790, 16),
            (63, 0x843b4e55c2046250, 16),
            (64, 0x63a744c19b19e02e, 46),
            (70, 0x6e1da2c05542fff0, 48),
            (127, 0x8620e34fce15ef00, 0),
            (156, 0x48ebafb543697372, 50),
            (1000, 0x567d7e80c44c5278, 56),
            (12345, 0x739891b7b6fd0e2e, 46),
            (1048576, 0x94d00b69bf384dd2, 18),
            (2147483647, 0xd3a183578274bdae, 46),
        ];
        let f = BucketFn::highway();
        for (col, hash, bucket) in table {
            assert_eq!(highway_hash(col), hash, "col {col}");
            assert_eq!(f.bucket(col), bucket, "col {col}");
        }
    }

    #[test]
    fn split_vectors_8_leaves() {
        // SPEC 5.5 (ComputeMinibatchingSplitTest, 8 leaves).
        assert_eq!(split_bits(&[10; 8], 100), 0);
        assert_eq!(split_bits(&[100; 8], 150), 0b1111111);
        assert_eq!(
            split_bits(&[10, 20, 30, 40, 50, 60, 70, 80], 100),
            0b1101100
        );
        assert_eq!(
            split_bits(&[50, 50, 20, 80, 10, 10, 70, 10], 100),
            0b1010000
        );
        assert_eq!(
            split_bits(&[90, 10, 90, 10, 90, 10, 90, 10], 100),
            0b1110000
        );
        assert_eq!(split_bits(&[2, 5, 1, 6, 3, 4, 2, 0], 7), 0b1110000);
    }

    #[test]
    fn boundaries_of_four_minibatches() {
        // SPEC 5.5: bits {57, 60, 61} -> [0,16) [16,24) [24,48) [48,64).
        let split = (1u64 << 57) | (1 << 60) | (1 << 61);
        assert_eq!(
            minibatch_ranges(split),
            vec![(0, 16), (16, 24), (24, 48), (48, 64)]
        );
        assert_eq!(minibatch_ranges(0), vec![(0, 64)]);
        // Every bit set: 64 single-bucket minibatches.
        let all = minibatch_ranges((1u64 << 63) - 1);
        assert_eq!(all.len(), 64);
        assert!(all
            .iter()
            .enumerate()
            .all(|(i, &(a, b))| a == i && b == i + 1));
    }
}
