//! The sort key and how one SparseCore packs it: a contract shared by extraction (which writes
//! keys), the sort and the grouping walk (which read them).
//!
//! The reference's key (SPEC 3.6) is `bucket:6 | rotr32(col, log2 N):32 | data:26`: rotating
//! the column puts its partition (`col mod N`) above its local embedding id (`col / N`), so one
//! integer sort orders entries by (bucket, partition, local id, data). We keep exactly that
//! order but pack the fields as tightly as one SparseCore's batch allows:
//!
//! ```text
//!  high ............................................ 0
//! +-------------+-------------------+------------------------+
//! |  partition  |     local id      |          data          |
//! |    nbits    |  local_bits (lb)  |     data_bits (db)     |
//! +-------------+-------------------+------------------------+
//! ```
//!
//! The bucket field is absent: minibatching's bucketed pass works on merged entries, never on
//! re-keyed ids. `lb` is the bit width of the stack's largest local id, and `data` (the payload)
//! is what [`Gains`] says: the sample row relative to the SparseCore's first row, or the
//! extraction index. [`encode_key`] / [`decode_key`] give the reference's own format, for tests.

use crate::spec::Combiner;
#[cfg(test)]
use crate::spec::{DATA_BITS, DATA_MASK};

/// Most bits of a key's top that the sort splits off into chunks (4096 chunks): the chunks'
/// keys are then sorted as `u32` and walked while they are in cache. Keys wider than
/// `32 + MAX_CHUNK_BITS` are sorted whole, as `u64`.
pub const MAX_CHUNK_BITS: u32 = 12;

/// Where the gain of each key lives, which also fixes what its payload is. One SparseCore's keys
/// all share one variant, chosen by [`KeyFormat::for_sparsecore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Gains {
    /// No weights and the sum combiner: every gain is 1.0. Payload: the row.
    #[default]
    Unit,
    /// No weights, mean or sqrtn: one gain per sample row, kept beside the keys. Payload: the row.
    PerRow,
    /// Weights, key and row narrow enough to travel with the gain: the sort carries the gain
    /// along and the walk needs no lookup. Payload: the row. A stable sort keeps a sample's
    /// repeated ids in extraction order, which is the order their gains are summed in.
    InKey,
    /// Weights, too wide to travel with the gain. Payload: the extraction index, with
    /// (row, gain) kept per index.
    PerIndex,
}

/// How the keys of one SparseCore are stored: fixed by the key width and [`Gains`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStorage {
    /// Keys of up to 32 bits, without gains: `u32`, half the sort's memory traffic.
    Narrow,
    /// Wider keys without gains: `u64`.
    Wide,
    /// [`Gains::InKey`] with keys of up to 32 bits: each `u64` is `key << 32 | gain bits`.
    GainBelowKey,
    /// [`Gains::InKey`] with wider keys: `u64` keys, and their gains in a parallel array that
    /// the sort's split joins to each chunk's low 32 key bits.
    GainBesideKey,
}

/// How one SparseCore packs (column, data) into a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyFormat {
    /// log2 N: bits of the partition.
    pub nbits: u32,
    /// Bits of the local embedding id (`col >> nbits`).
    pub local_bits: u32,
    /// Bits of the payload.
    pub data_bits: u32,
    /// Where gains live (and so what the payload is).
    pub gains: Gains,
}

/// A stored key word: `u32` for [`KeyStorage::Narrow`] keys, else `u64`. Extraction writes
/// them, the sort orders them and the walk reads them.
pub trait KeyWord: Copy + Ord + Default + Send + Sync + std::ops::BitOrAssign + 'static {
    /// Widens to `u64`.
    fn to_u64(self) -> u64;
    /// Narrows from `u64` (the value must fit).
    fn from_u64(v: u64) -> Self;
}

impl KeyWord for u32 {
    #[inline(always)]
    fn to_u64(self) -> u64 {
        self as u64
    }
    #[inline(always)]
    fn from_u64(v: u64) -> Self {
        v as u32
    }
}

impl KeyWord for u64 {
    #[inline(always)]
    fn to_u64(self) -> u64 {
        self
    }
    #[inline(always)]
    fn from_u64(v: u64) -> Self {
        v
    }
}

/// Bits needed to hold every value in `0..=max`.
#[inline]
pub fn bits_for(max: u64) -> u32 {
    64 - max.leading_zeros()
}

/// What a SparseCore's key set is made of, which decides its format.
#[derive(Debug, Clone, Copy)]
pub struct KeySetShape {
    /// log2 N.
    pub nbits: u32,
    /// Local-id bits of the stack (see [`KeyFormat::local_bits_for`]).
    pub local_bits: u32,
    /// Rows the keys can reference, from the SparseCore's first row on.
    pub row_span: usize,
    /// Whether any feature of the stack has weights.
    pub weighted: bool,
    /// The stack's combiner: without weights, only the sum's gains are all 1.0.
    pub combiner: Combiner,
}

impl KeyFormat {
    /// The format of one SparseCore's keys. `weighted_ids` (only read for weighted stacks whose
    /// rows do not fit beside the gain) gives the number of ids, whose indices are then the
    /// payload.
    pub fn for_sparsecore(shape: KeySetShape, weighted_ids: impl FnOnce() -> usize) -> Self {
        let row_bits = bits_for(shape.row_span.saturating_sub(1) as u64);
        let (gains, data_bits) = if !shape.weighted {
            (
                if shape.combiner == Combiner::Sum {
                    Gains::Unit
                } else {
                    Gains::PerRow
                },
                row_bits,
            )
        } else if shape.nbits + shape.local_bits + row_bits <= 32 + MAX_CHUNK_BITS {
            // The key and row fit beside the gain (in one `u64` up to 32 key bits, split into
            // 32-bit chunks by the sort up to `32 + MAX_CHUNK_BITS`).
            (Gains::InKey, row_bits)
        } else {
            (
                Gains::PerIndex,
                bits_for(weighted_ids().saturating_sub(1) as u64),
            )
        };
        KeyFormat {
            nbits: shape.nbits,
            local_bits: shape.local_bits,
            data_bits,
            gains,
        }
    }

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

    /// Total key width.
    #[inline]
    pub fn width(&self) -> u32 {
        self.data_bits + self.col_bits()
    }

    /// How extraction stores these keys.
    #[inline]
    pub fn storage(&self) -> KeyStorage {
        match (self.gains == Gains::InKey, self.width() <= 32) {
            (false, true) => KeyStorage::Narrow,
            (false, false) => KeyStorage::Wide,
            (true, true) => KeyStorage::GainBelowKey,
            (true, false) => KeyStorage::GainBesideKey,
        }
    }

    /// Whether the sort splits the keys into chunks by their top bits, sorting and walking
    /// each chunk's low 32 bits (as `u32`, or beside the gain): keys wider than 32 bits, up to
    /// `32 + MAX_CHUNK_BITS`. The value is the fewest chunk bits that leave 32 (0 for keys
    /// without gains that fit already).
    #[inline]
    pub fn min_chunk_bits(&self) -> Option<u32> {
        let c = self.width().saturating_sub(32);
        // Keys of up to 32 bits with their gain sit whole in the high half of their element.
        (c <= MAX_CHUNK_BITS && !(self.gains == Gains::InKey && c == 0)).then_some(c)
    }

    /// Bit position of the key inside a stored element (32 when the gain sits below it).
    #[inline]
    pub fn element_shift(&self) -> u32 {
        if self.gains == Gains::InKey {
            32
        } else {
            0
        }
    }

    /// Builds a key from a column id and a payload (< 2^data_bits).
    #[inline(always)]
    pub fn encode(&self, col: u32, data: u32) -> u64 {
        let mask = (1u32 << self.nbits).wrapping_sub(1);
        let partition = (col & mask) as u64;
        let local = (col >> self.nbits) as u64;
        (partition << (self.data_bits + self.local_bits)) | (local << self.data_bits) | data as u64
    }

    /// The column bits (partition, local id) of a key: equal for equal columns.
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

    /// Splits a key into (column id, payload).
    #[inline(always)]
    pub fn decode(&self, key: u64) -> (u32, u32) {
        let colbits = key >> self.data_bits;
        let local = (colbits & ((1u64 << self.local_bits) - 1)) as u32;
        let partition = self.partition(key) as u32;
        ((local << self.nbits) | partition, self.data(key))
    }
}

/// The reference's key (SPEC 3.6), for documentation and tests.
#[inline(always)]
#[cfg(test)]
pub fn encode_key(bucket: u32, col: u32, data: u32, nbits: u32) -> u64 {
    ((bucket as u64) << 58) | ((col.rotate_right(nbits) as u64) << DATA_BITS) | data as u64
}

/// Decodes a key of the reference's format.
#[inline(always)]
#[cfg(test)]
pub fn decode_key(key: u64, nbits: u32) -> (u32, u32, u32) {
    let bucket = (key >> 58) as u32;
    let col = ((key >> DATA_BITS) as u32).rotate_left(nbits);
    (bucket, col, (key & DATA_MASK) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(nbits: u32, local_bits: u32, data_bits: u32, gains: Gains) -> KeyFormat {
        KeyFormat {
            nbits,
            local_bits,
            data_bits,
            gains,
        }
    }

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
        // With lb = 32 - log2 N and db = 26 the packing is the reference's key below its bucket.
        for nbits in [0, 1, 2, 3, 5, 9] {
            let l = format(nbits, 32 - nbits, DATA_BITS, Gains::Unit);
            for col in [0u32, 1, 7, 156, 1000, 123_456_789, i32::MAX as u32] {
                for data in [0u32, 5, DATA_MASK as u32] {
                    assert_eq!(l.encode(col, data), encode_key(0, col, data, nbits));
                    assert_eq!(l.decode(l.encode(col, data)), (col, data));
                }
            }
        }
    }

    #[test]
    fn compact_layout_keeps_the_reference_order() {
        let nbits = 3;
        let lb = KeyFormat::local_bits_for(nbits, 8 * 1000, true);
        assert_eq!(lb, 10); // local ids 0..=999
        let l = format(nbits, lb, bits_for(999), Gains::Unit);
        assert_eq!(l.storage(), KeyStorage::Narrow);
        let mut cols: Vec<(u32, u32)> = Vec::new();
        for col in (0..8000u32).step_by(37) {
            for data in [0u32, 3, 999] {
                cols.push((col, data));
            }
        }
        let mut a: Vec<u64> = cols
            .iter()
            .map(|&(c, d)| encode_key(0, c, d, nbits))
            .collect();
        let mut b: Vec<u64> = cols.iter().map(|&(c, d)| l.encode(c, d)).collect();
        a.sort_unstable();
        b.sort_unstable();
        let da: Vec<_> = a
            .iter()
            .map(|&k| decode_key(k, nbits))
            .map(|(_, c, d)| (c, d))
            .collect();
        let db: Vec<_> = b.iter().map(|&k| l.decode(k)).collect();
        assert_eq!(da, db);
    }

    #[test]
    fn storage_follows_width_and_gains() {
        let l = format(2, 18, 11, Gains::Unit);
        assert_eq!(l.storage(), KeyStorage::Narrow);
        assert_eq!(l.min_chunk_bits(), Some(0));
        assert_eq!(format(2, 18, 16, Gains::PerRow).min_chunk_bits(), Some(4));
        assert_eq!(format(2, 18, 16, Gains::PerRow).storage(), KeyStorage::Wide);
        assert_eq!(format(2, 18, 11, Gains::InKey).min_chunk_bits(), None);
        assert_eq!(
            format(2, 18, 11, Gains::InKey).storage(),
            KeyStorage::GainBelowKey
        );
        assert_eq!(format(2, 18, 16, Gains::InKey).min_chunk_bits(), Some(4));
        assert_eq!(
            format(2, 18, 16, Gains::InKey).storage(),
            KeyStorage::GainBesideKey
        );
        assert_eq!(format(9, 23, 26, Gains::Unit).min_chunk_bits(), None);
        let l = format(0, 0, 0, Gains::Unit);
        assert_eq!(l.decode(l.encode(0, 0)), (0, 0));
    }

    #[test]
    fn layout_decision() {
        let shape = KeySetShape {
            nbits: 2,
            local_bits: 18,
            row_span: 1024,
            weighted: false,
            combiner: Combiner::Sum,
        };
        assert_eq!(
            KeyFormat::for_sparsecore(shape, || unreachable!()),
            format(2, 18, 10, Gains::Unit)
        );
        let mean = KeySetShape {
            combiner: Combiner::Mean,
            ..shape
        };
        assert_eq!(
            KeyFormat::for_sparsecore(mean, || unreachable!()).gains,
            Gains::PerRow
        );
        let weighted = KeySetShape {
            weighted: true,
            ..shape
        };
        assert_eq!(
            KeyFormat::for_sparsecore(weighted, || unreachable!()),
            format(2, 18, 10, Gains::InKey)
        );
        // 2 + 30 + 13 bits exceed 32 + MAX_CHUNK_BITS: the extraction index is the payload.
        let wide = KeySetShape {
            local_bits: 30,
            row_span: 8192,
            ..weighted
        };
        assert_eq!(
            KeyFormat::for_sparsecore(wide, || 100),
            format(2, 30, 7, Gains::PerIndex)
        );
    }
}
