//! Key hashing: raw keys (strings, byte strings, arbitrary int64s) to table ids.
//!
//! Real data rarely arrives as zero-based ids: Criteo's categorical values are hex strings, user
//! ids are sparse int64s. A feature that declares `"hash": {"seed": N}` in its config may carry
//! such keys; each key is mapped to
//!
//! ```text
//! key  = xxh3_64(encoding(value), seed)        (XXH3, 64-bit, seeded: XXH3_64bits_withSeed)
//! id   = key mod vocabulary_size               (the feature's table)
//! ```
//!
//! where `encoding` is, per Arrow value type:
//!
//! | column | bytes hashed |
//! |---|---|
//! | `List<Utf8>`, `List<LargeUtf8>` | the string's UTF-8 bytes, no terminator, no length prefix |
//! | `List<Binary>`, `List<LargeBinary>` | the raw bytes |
//! | `List<Int64>` | the value's 8 little-endian two's-complement bytes |
//! | `List<Int32>` | the value widened to int64, then 8 little-endian bytes (so `5` hashes alike in both) |
//!
//! XXH3 is a published, frozen algorithm (xxHash 0.8), so the id of a key never changes between
//! versions of this crate; `tests/pipeline/hash.rs` pins it with vectors computed by the reference
//! implementation (Python's `xxhash.xxh3_64_intdigest`). The full 64-bit `key` is what dynamic
//! tables (`sparsecore_kernel::dynamic`) are keyed by; static tables use `key mod vocabulary_size`.
//!
//! Hashed ids are necessarily materialised: they are written into a buffer owned by the input
//! view ([`super::ArrowListInput`]) instead of being borrowed from Arrow. [`HashBuffers`] lets a
//! reader recycle those buffers from one batch to the next, so that steady-state hashing
//! allocates nothing.

use arrow_array::{
    Array, BinaryArray, Int32Array, Int64Array, LargeBinaryArray, LargeStringArray, StringArray,
};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{ConfigItem, Error, Result};

/// The algorithm's name, as written in documentation and benchmark reports.
pub const HASH_ALGORITHM: &str = "xxh3-64";

/// The 64-bit key of a string or byte-string value (its bytes, hashed as they are).
#[inline]
pub fn hash_bytes(bytes: &[u8], seed: u64) -> u64 {
    xxh3_64_with_seed(bytes, seed)
}

/// The 64-bit key of an integer value (its 8 little-endian bytes).
#[inline]
pub fn hash_i64(value: i64, seed: u64) -> u64 {
    xxh3_64_with_seed(&value.to_le_bytes(), seed)
}

/// The table id of a key: `key mod vocabulary_size`. A zero vocabulary has no ids.
#[inline]
pub fn key_to_id(key: u64, vocabulary_size: u64) -> Option<u64> {
    key.checked_rem(vocabulary_size)
}

/// Arrow value types a hashed feature accepts, for error messages.
pub(crate) const RAW_KEY_TYPES: &str =
    "List/LargeList of Utf8, LargeUtf8, Binary, LargeBinary, Int64 or Int32 (the feature declares \"hash\")";

/// Calls `f(index, key)` for every value of `values[lo..hi]`, hashing it by its type's encoding
/// (see the module docs). Errors name the feature and column when the type is not a key type.
pub(crate) fn for_each_key(
    feature: &str,
    column: &str,
    values: &dyn Array,
    (lo, hi): (usize, usize),
    seed: u64,
    mut f: impl FnMut(usize, u64),
) -> Result<()> {
    fn offsets_bytes<O: Copy + TryInto<usize>>(
        offs: &[O],
        data: &[u8],
        lo: usize,
        hi: usize,
        seed: u64,
        f: &mut impl FnMut(usize, u64),
    ) {
        let at = |i: usize| offs[i].try_into().unwrap_or(0);
        for i in lo..hi {
            f(i, hash_bytes(&data[at(i)..at(i + 1)], seed));
        }
    }
    let any = values.as_any();
    if hi > values.len() || lo > hi {
        return Err(Error::input(
            feature,
            format!(
                "column `{column}`: list offsets [{lo}, {hi}) outside the {} values",
                values.len()
            ),
        ));
    }
    if let Some(a) = any.downcast_ref::<StringArray>() {
        offsets_bytes(a.value_offsets(), a.value_data(), lo, hi, seed, &mut f);
    } else if let Some(a) = any.downcast_ref::<LargeStringArray>() {
        offsets_bytes(a.value_offsets(), a.value_data(), lo, hi, seed, &mut f);
    } else if let Some(a) = any.downcast_ref::<BinaryArray>() {
        offsets_bytes(a.value_offsets(), a.value_data(), lo, hi, seed, &mut f);
    } else if let Some(a) = any.downcast_ref::<LargeBinaryArray>() {
        offsets_bytes(a.value_offsets(), a.value_data(), lo, hi, seed, &mut f);
    } else if let Some(a) = any.downcast_ref::<Int64Array>() {
        for (i, &v) in a.values()[lo..hi].iter().enumerate() {
            f(lo + i, hash_i64(v, seed));
        }
    } else if let Some(a) = any.downcast_ref::<Int32Array>() {
        for (i, &v) in a.values()[lo..hi].iter().enumerate() {
            f(lo + i, hash_i64(v as i64, seed));
        }
    } else {
        return Err(Error::ColumnType {
            feature: feature.to_string(),
            column: column.to_string(),
            expected: RAW_KEY_TYPES,
            found: format!("list of {}", values.data_type()),
        });
    }
    Ok(())
}

/// Ids hashed from raw keys, owned by an input view. 32-bit when the vocabulary allows it (the
/// extract stage reads them without a narrowing check), 64-bit otherwise.
#[derive(Debug, Clone)]
pub(crate) enum OwnedIds {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

/// Recycled buffers for hashed ids. Pass the same `HashBuffers` to
/// [`super::features_from_record_batch_reusing`] for every batch and hand the inputs back with
/// [`HashBuffers::recycle`] when done: once the buffers have grown to the largest batch, hashing
/// allocates nothing.
#[derive(Debug, Default)]
pub struct HashBuffers {
    free32: Vec<Vec<i32>>,
    free64: Vec<Vec<i64>>,
}

impl HashBuffers {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes back one input's hashed-id buffer, for the next [`HashBuffers::hash`].
    pub(crate) fn give_back(&mut self, ids: OwnedIds) {
        match ids {
            OwnedIds::I32(v) => self.free32.push(v),
            OwnedIds::I64(v) => self.free64.push(v),
        }
    }

    /// Hashes `values[lo..hi]` into a recycled buffer of `hi` ids (entries below `lo` are 0 and
    /// never read: list offsets index the child array directly).
    pub(crate) fn hash(
        &mut self,
        feature: &str,
        column: &str,
        values: &dyn Array,
        range: (usize, usize),
        seed: u64,
        vocabulary_size: u64,
    ) -> Result<OwnedIds> {
        if vocabulary_size == 0 {
            return Err(Error::config(
                ConfigItem::Feature,
                feature,
                "hashed into a table of vocabulary_size 0",
            ));
        }
        let hi = range.1;
        if vocabulary_size <= 1 << 31 {
            let mut buf = self.free32.pop().unwrap_or_default();
            buf.clear();
            buf.resize(hi, 0);
            // key % vocabulary_size < 2^31: the cast is exact.
            for_each_key(feature, column, values, range, seed, |i, k| {
                buf[i] = (k % vocabulary_size) as i32
            })?;
            Ok(OwnedIds::I32(buf))
        } else {
            if vocabulary_size > i64::MAX as u64 {
                return Err(Error::config(
                    ConfigItem::Feature,
                    feature,
                    format!(
                        "hashed into a vocabulary_size of {vocabulary_size} > {}",
                        i64::MAX
                    ),
                ));
            }
            let mut buf = self.free64.pop().unwrap_or_default();
            buf.clear();
            buf.resize(hi, 0);
            for_each_key(feature, column, values, range, seed, |i, k| {
                buf[i] = (k % vocabulary_size) as i64
            })?;
            Ok(OwnedIds::I64(buf))
        }
    }
}

/// The full 64-bit keys of one ragged feature column, for dynamic tables: `keys[offsets[r]..
/// offsets[r + 1]]` are row `r`'s keys. Accepts the same value types as hashed features.
pub fn hash_keys(
    feature: &str,
    column: &str,
    values: &dyn Array,
    seed: u64,
    keys: &mut Vec<u64>,
) -> Result<()> {
    keys.clear();
    keys.resize(values.len(), 0);
    for_each_key(feature, column, values, (0, values.len()), seed, |i, k| {
        keys[i] = k
    })
}
