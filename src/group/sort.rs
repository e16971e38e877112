//! Sorting the keys of one SparseCore.
//!
//! Keys are either unique or identical only when they denote the same (row, column) with the
//! same gain, so any correct sort gives the reference's order; no stability is needed.

/// Sorts keys ascending.
#[inline]
pub fn sort_keys(keys: &mut [u64]) {
    keys.sort_unstable();
}
