//! The sort key.
//!
//! The reference's key (SPEC 3.6) is `bucket:6 | rotr32(col, log2 N):32 | data:26`: rotating
//! the column puts its partition (`col mod N`) above its local embedding id (`col / N`), so one
//! integer sort orders entries by (bucket, partition, local id, data). We keep exactly that
//! order but pack the fields as tightly as one SparseCore's batch allows:
//!
//! ```text
//!  high ............................................................. 0
//! +--------+-------------+-------------------+------------------------+
//! | bucket |  partition  |     local id      |          data          |
//! |   6    |    nbits    |  local_bits (lb)  |     data_bits (db)     |
//! +--------+-------------+-------------------+------------------------+
//! ```
//!
//! `lb` is the bit width of the stack's largest local id, and `data` is the sample row relative
//! to the SparseCore's first row (unity weights) or the extraction index (weights), `db` bits
//! wide. When the whole key fits 32 bits it is stored as `u32`, halving the sort's memory
//! traffic. [`encode_key`] / [`decode_key`] give the reference's own layout, for tests.

use crate::spec::{DATA_BITS, DATA_MASK};

/// Bits of the minibatching bucket.
pub const BUCKET_BITS: u32 = 6;

/// Most bits of a key's top that the sort splits off into chunks (4096 chunks): the chunks'
/// keys are then sorted as `u32` and walked while they are in cache (see `group::sort`). Keys
/// wider than `32 + MAX_CHUNK_BITS` are sorted whole, as `u64`.
pub const MAX_CHUNK_BITS: u32 = 12;

/// How one SparseCore packs (bucket, column, data) into a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyLayout {
    /// log2 N: bits of the partition.
    pub nbits: u32,
    /// Bits of the local embedding id (`col >> nbits`).
    pub local_bits: u32,
    /// Bits of the payload.
    pub data_bits: u32,
    /// Whether keys carry minibatching bucket bits. The pipeline's bucketed pass works on
    /// merged entries rather than re-keyed ids, so it never sets this; it keeps the layout able
    /// to express the reference's full key (see the tests).
    pub buckets: bool,
    /// Weighted stacks whose key fits 32 bits: each `u64` element is `key << 32 | gain bits`,
    /// with the sample row (not the extraction index) as payload, so the sort carries the gain
    /// along and the walk needs no per-index lookups. A stable sort keeps a sample's repeated
    /// ids in extraction order, which is the order their gains are summed in.
    pub packed: bool,
}

/// Bits needed to hold every value in `0..=max`.
#[inline]
pub fn bits_for(max: u64) -> u32 {
    64 - max.leading_zeros()
}

impl KeyLayout {
    /// Local-id bits for a stack: all `32 - nbits` when ids are not range-checked (any 32-bit
    /// column may occur), else just enough for its padded vocabulary.
    pub fn local_bits_for(nbits: u32, stack_vocab_size: u64, ids_checked: bool) -> u32 {
        if !ids_checked {
            return 32 - nbits;
        }
        bits_for(stack_vocab_size.saturating_sub(1) >> nbits).min(32 - nbits)
    }

    /// Bits `[data_bits, data_bits + col_bits)` hold the column.
    #[inline]
    pub fn col_bits(&self) -> u32 {
        self.nbits + self.local_bits
    }

    /// Position of the bucket field.
    #[inline]
    pub fn bucket_shift(&self) -> u32 {
        self.data_bits + self.col_bits()
    }

    /// Total key width.
    #[inline]
    pub fn width(&self) -> u32 {
        self.bucket_shift() + if self.buckets { BUCKET_BITS } else { 0 }
    }

    /// Whether extraction stores the keys as `u32` (they fit 32 bits, and carry no gain).
    #[inline]
    pub fn narrow(&self) -> bool {
        !self.packed && self.width() <= 32
    }

    /// Whether the sort splits the keys into chunks by their top bits, sorting and walking
    /// each chunk's low 32 bits (as `u32`, or beside the gain when packed): keys wider than 32
    /// bits, up to `32 + MAX_CHUNK_BITS`. The value is the fewest chunk bits that leave 32
    /// (0 for unpacked keys that fit already).
    #[inline]
    pub fn min_chunk_bits(&self) -> Option<u32> {
        let c = self.width().saturating_sub(32);
        // Packed keys of up to 32 bits sit whole in the high half of their element.
        (c <= MAX_CHUNK_BITS && !(self.packed && c == 0)).then_some(c)
    }

    /// Packed keys too wide for the high half of a `u64` beside their gain: extraction keeps
    /// keys and gains apart, and the sort's split joins each chunk's low 32 key bits with the
    /// gain.
    #[inline]
    pub fn packed_wide(&self) -> bool {
        self.packed && self.width() > 32
    }

    /// Bit position of the key inside a stored element (32 when packed with a gain).
    #[inline]
    pub fn element_shift(&self) -> u32 {
        if self.packed {
            32
        } else {
            0
        }
    }

    /// Builds a key from a bucket (< 64), a column id and a payload (< 2^data_bits).
    #[inline(always)]
    pub fn encode(&self, bucket: u32, col: u32, data: u32) -> u64 {
        let mask = (1u32 << self.nbits).wrapping_sub(1);
        let partition = (col & mask) as u64;
        let local = (col >> self.nbits) as u64;
        ((bucket as u64) << self.bucket_shift())
            | (partition << (self.data_bits + self.local_bits))
            | (local << self.data_bits)
            | data as u64
    }

    /// The column bits (bucket, partition, local id) of a key: equal for equal columns.
    #[inline(always)]
    pub fn col_field(&self, key: u64) -> u64 {
        key >> self.data_bits
    }

    /// The partition of a key.
    #[inline(always)]
    pub fn partition(&self, key: u64) -> usize {
        ((key >> (self.data_bits + self.local_bits)) & ((1u64 << self.nbits) - 1)) as usize
    }

    /// The payload of a key.
    #[inline(always)]
    pub fn data(&self, key: u64) -> u32 {
        (key & ((1u64 << self.data_bits) - 1)) as u32
    }

    /// Splits a key into (bucket, column id, payload).
    #[inline(always)]
    pub fn decode(&self, key: u64) -> (u32, u32, u32) {
        let bucket = (key >> self.bucket_shift()) as u32;
        let colbits = key >> self.data_bits;
        let local = (colbits & ((1u64 << self.local_bits) - 1)) as u32;
        let partition = self.partition(key) as u32;
        ((bucket), (local << self.nbits) | partition, self.data(key))
    }
}

/// The reference's key (SPEC 3.6), for documentation and tests.
#[inline(always)]
pub fn encode_key(bucket: u32, col: u32, data: u32, nbits: u32) -> u64 {
    ((bucket as u64) << 58) | ((col.rotate_right(nbits) as u64) << DATA_BITS) | data as u64
}

/// Decodes a key of the reference's layout.
#[inline(always)]
pub fn decode_key(key: u64, nbits: u32) -> (u32, u32, u32) {
    let bucket = (key >> 58) as u32;
    let col = ((key >> DATA_BITS) as u32).rotate_left(nbits);
    (bucket, col, (key & DATA_MASK) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_worked_example() {
        // SPEC 3.6: N = 8, col 156 -> partition 4, local 19; data 5.
        let key = encode_key(0, 156, 5, 3);
        assert_eq!(key, 0x0200_0000_4C00_0005);
        assert_eq!(encode_key(50, 156, 5, 3), 0xCA00_0000_4C00_0005);
        assert_eq!(decode_key(0xCA00_0000_4C00_0005, 3), (50, 156, 5));
    }

    #[test]
    fn full_width_layout_is_the_reference_key() {
        for nbits in [0, 1, 2, 3, 5, 9] {
            let l = KeyLayout { nbits, local_bits: 32 - nbits, data_bits: DATA_BITS, buckets: true, packed: false };
            for col in [0u32, 1, 7, 156, 1000, 123_456_789, i32::MAX as u32] {
                for data in [0u32, 5, DATA_MASK as u32] {
                    assert_eq!(l.encode(13, col, data), encode_key(13, col, data, nbits));
                    assert_eq!(l.decode(l.encode(13, col, data)), (13, col, data));
                }
            }
        }
    }

    #[test]
    fn compact_layout_keeps_the_reference_order() {
        let nbits = 3;
        let lb = KeyLayout::local_bits_for(nbits, 8 * 1000, true);
        assert_eq!(lb, 10); // local ids 0..=999
        let l = KeyLayout { nbits, local_bits: lb, data_bits: bits_for(999), buckets: false, packed: false };
        assert!(!l.narrow() || l.width() <= 32);
        let mut cols: Vec<(u32, u32)> = Vec::new();
        for col in (0..8000u32).step_by(37) {
            for data in [0u32, 3, 999] {
                cols.push((col, data));
            }
        }
        let mut a: Vec<u64> = cols.iter().map(|&(c, d)| encode_key(0, c, d, nbits)).collect();
        let mut b: Vec<u64> = cols.iter().map(|&(c, d)| l.encode(0, c, d)).collect();
        a.sort_unstable();
        b.sort_unstable();
        let da: Vec<_> = a.iter().map(|&k| decode_key(k, nbits)).collect();
        let db: Vec<_> = b.iter().map(|&k| l.decode(k)).collect();
        assert_eq!(da, db);
    }

    #[test]
    fn narrow_only_when_it_fits() {
        let l = KeyLayout { nbits: 2, local_bits: 18, data_bits: 11, buckets: false, packed: false };
        assert!(l.narrow());
        assert_eq!(l.min_chunk_bits(), Some(0));
        assert_eq!(KeyLayout { buckets: true, ..l }.min_chunk_bits(), Some(5));
        assert!(!KeyLayout { buckets: true, ..l }.narrow());
        assert_eq!(KeyLayout { packed: true, ..l }.min_chunk_bits(), None);
        assert_eq!(KeyLayout { packed: true, buckets: true, ..l }.min_chunk_bits(), Some(5));
        assert!(KeyLayout { packed: true, buckets: true, ..l }.packed_wide());
        assert!(!KeyLayout { packed: true, ..l }.narrow());
        assert_eq!(KeyLayout { nbits: 9, local_bits: 23, data_bits: 26, buckets: true, packed: false }.min_chunk_bits(), None);
        let l = KeyLayout { nbits: 0, local_bits: 0, data_bits: 0, buckets: false, packed: false };
        assert_eq!(l.decode(l.encode(0, 0, 0)), (0, 0, 0));
    }
}
