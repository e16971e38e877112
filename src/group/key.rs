//! The 64-bit sort key.
//!
//! The reference's key (SPEC 3.6) is `bucket:6 | rotr32(col, log2 N):32 | data:26`: rotating
//! the column puts its partition (`col mod N`) above its local embedding id (`col / N`), so one
//! integer sort orders entries by (bucket, partition, local id, data). We keep that order but
//! squeeze out the local-id bits no id of the stack can set:
//!
//! ```text
//!  63    58 57 ........ 26+nbits+lb  26+lb ...... 26 25 ........ 0
//! +--------+-----------+------------+-------------+--------------+
//! | bucket |   zero    | partition  |  local id   |     data     |
//! +--------+-----------+------------+-------------+--------------+
//! ```
//!
//! where `lb` is the bit width of the stack's largest local id. With `lb = 32 - nbits` this is
//! exactly the reference's key; narrower, the same order with fewer bits for the radix sort to
//! visit. `data` is the sample row (unity weights) or the extraction index (weights).

use crate::spec::{DATA_BITS, DATA_MASK};

/// Bit position of the minibatching bucket.
pub const BUCKET_SHIFT: u32 = 58;

/// How one stack packs (bucket, column, data) into a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLayout {
    /// log2 N: bits of the partition.
    pub nbits: u32,
    /// Bits of the local embedding id (`col >> nbits`).
    pub local_bits: u32,
}

impl KeyLayout {
    /// The reference's layout: all `32 - nbits` local bits.
    pub fn reference(nbits: u32) -> Self {
        KeyLayout { nbits, local_bits: 32 - nbits }
    }

    /// The compact layout for a stack whose column ids are all below `stack_vocab_size`.
    /// Only valid when ids are range-checked; otherwise use [`KeyLayout::reference`].
    pub fn for_vocab(nbits: u32, stack_vocab_size: u64) -> Self {
        let max_local = (stack_vocab_size.saturating_sub(1) >> nbits).min(u32::MAX as u64);
        let local_bits = (64 - max_local.leading_zeros()).min(32 - nbits);
        KeyLayout { nbits, local_bits }
    }

    /// Bits `[DATA_BITS, sort_hi)` hold the column; a stable sort by them keeps data order.
    #[inline]
    pub fn col_bits(&self) -> u32 {
        self.nbits + self.local_bits
    }

    /// Builds a key from a minibatching bucket (< 64), a column id and a 26-bit payload.
    #[inline(always)]
    pub fn encode(&self, bucket: u32, col: u32, data: u32) -> u64 {
        let mask = (1u32 << self.nbits).wrapping_sub(1);
        let partition = (col & mask) as u64;
        let local = (col >> self.nbits) as u64;
        ((bucket as u64) << BUCKET_SHIFT)
            | (partition << (DATA_BITS + self.local_bits))
            | (local << DATA_BITS)
            | data as u64
    }

    /// Splits a key into (bucket, column id, payload).
    #[inline(always)]
    pub fn decode(&self, key: u64) -> (u32, u32, u32) {
        let bucket = (key >> BUCKET_SHIFT) as u32;
        let colbits = key >> DATA_BITS;
        let local = (colbits & ((1u64 << self.local_bits) - 1)) as u32;
        let partition = ((colbits >> self.local_bits) & ((1u64 << self.nbits) - 1)) as u32;
        let col = (local << self.nbits) | partition;
        let data = (key & DATA_MASK) as u32;
        (bucket, col, data)
    }
}

/// The reference's key (SPEC 3.6), for documentation and tests.
#[inline(always)]
pub fn encode_key(bucket: u32, col: u32, data: u32, nbits: u32) -> u64 {
    ((bucket as u64) << BUCKET_SHIFT) | ((col.rotate_right(nbits) as u64) << DATA_BITS) | data as u64
}

/// Decodes a key of the reference's layout.
#[inline(always)]
pub fn decode_key(key: u64, nbits: u32) -> (u32, u32, u32) {
    KeyLayout::reference(nbits).decode(key)
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
    fn reference_layout_is_the_reference_key() {
        for nbits in [0, 1, 2, 3, 5, 9] {
            let l = KeyLayout::reference(nbits);
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
        let l = KeyLayout::for_vocab(nbits, 8 * 1000);
        assert_eq!(l.local_bits, 10); // local ids 0..=999
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
    fn single_partition_and_tiny_vocab() {
        let l = KeyLayout::for_vocab(0, 1);
        assert_eq!(l.local_bits, 0);
        assert_eq!(l.decode(l.encode(0, 0, 7)), (0, 0, 7));
        let l = KeyLayout::for_vocab(0, 12345);
        assert_eq!(l.decode(l.encode(0, 12344, 7)), (0, 12344, 7));
    }
}
