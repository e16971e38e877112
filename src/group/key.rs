//! The 64-bit sort key: `bucket:6 | rotr32(col, log2 N):32 | data:26` (SPEC 3.6).
//!
//! Rotating the column right by log2 N puts the destination partition (`col mod N`) in the high
//! bits and the local embedding id (`col / N`) below it, so one integer sort orders entries by
//! bucket, partition, local id and finally row (or extraction index).

use crate::spec::{DATA_BITS, DATA_MASK};

/// Bit position of the minibatching bucket.
pub const BUCKET_SHIFT: u32 = 58;

/// Builds a key from a minibatching bucket (< 64), a column id and a 26-bit payload.
#[inline(always)]
pub fn encode_key(bucket: u32, col: u32, data: u32, nbits: u32) -> u64 {
    ((bucket as u64) << BUCKET_SHIFT) | ((col.rotate_right(nbits) as u64) << DATA_BITS) | data as u64
}

/// Splits a key into (bucket, column id, payload).
#[inline(always)]
pub fn decode_key(key: u64, nbits: u32) -> (u32, u32, u32) {
    let bucket = (key >> BUCKET_SHIFT) as u32;
    let col = ((key >> DATA_BITS) as u32).rotate_left(nbits);
    let data = (key & DATA_MASK) as u32;
    (bucket, col, data)
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
    fn single_partition_is_identity_rotation() {
        assert_eq!(decode_key(encode_key(0, 12345, 7, 0), 0), (0, 12345, 7));
        assert_eq!(encode_key(0, 12345, 7, 0), (12345u64 << 26) | 7);
    }
}
