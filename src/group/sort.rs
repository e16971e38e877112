//! Sorting the keys of one SparseCore.
//!
//! Keys are either unique or identical only when they denote the same (row, column) with the
//! same gain, so any correct sort gives the reference's order.
//!
//! Extraction emits keys whose 26-bit payload never decreases (samples are visited in row
//! order and weighted payloads are running indices), so a *stable* sort by the column bits alone
//! yields the full key order. That is an LSD radix sort over the few column bits a stack uses
//! (typically 2 passes), far cheaper than a comparison sort. When the payload is not monotone
//! (only possible with hand-made inconsistent row offsets) we fall back to `sort_unstable`.

use super::key::{KeyLayout, BUCKET_SHIFT};
use crate::spec::DATA_BITS;

/// Largest radix digit, in bits (4096 counters: fits L1 with room to spare).
const MAX_DIGIT_BITS: u32 = 12;

/// Below this many keys a comparison sort is as fast and needs no histogram.
const SMALL: usize = 256;

/// Sorts `keys` ascending. `data_sorted` says the payloads are non-decreasing in input order;
/// `buckets` says the minibatching bucket bits may be non-zero. `scratch` is reused memory.
pub fn sort_keys(keys: &mut Vec<u64>, scratch: &mut Vec<u64>, layout: KeyLayout, data_sorted: bool, buckets: bool) {
    if !data_sorted || keys.len() < SMALL {
        keys.sort_unstable();
        return;
    }
    let col_bits = layout.col_bits();
    radix_by_bits(keys, scratch, DATA_BITS, DATA_BITS + col_bits);
    if buckets {
        radix_by_bits(keys, scratch, BUCKET_SHIFT, 64);
    }
}

/// Stable LSD radix sort of `keys` by bits `[lo, hi)`.
fn radix_by_bits(keys: &mut Vec<u64>, scratch: &mut Vec<u64>, lo: u32, hi: u32) {
    if hi <= lo {
        return;
    }
    let span = hi - lo;
    let passes = span.div_ceil(MAX_DIGIT_BITS);
    let digit = span.div_ceil(passes);
    let mut counts = [0u32; 1 << MAX_DIGIT_BITS];
    // Every slot is written before it is read; only grow, never re-zero.
    if scratch.len() < keys.len() {
        scratch.resize(keys.len(), 0);
    }
    let mut shift = lo;
    while shift < hi {
        let bits = digit.min(hi - shift);
        let mask = (1u64 << bits) - 1;
        let radix = 1usize << bits;
        let counts = &mut counts[..radix];
        counts.fill(0);
        for &k in keys.iter() {
            counts[((k >> shift) & mask) as usize] += 1;
        }
        // A digit every key shares moves nothing.
        if counts.iter().any(|&c| c as usize == keys.len()) {
            shift += bits;
            continue;
        }
        let mut sum = 0u32;
        for c in counts.iter_mut() {
            let n = *c;
            *c = sum;
            sum += n;
        }
        for &k in keys.iter() {
            let d = ((k >> shift) & mask) as usize;
            let pos = counts[d];
            counts[d] = pos + 1;
            scratch[pos as usize] = k;
        }
        std::mem::swap(keys, scratch);
        let n = scratch.len();
        keys.truncate(n);
        shift += bits;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(layout: KeyLayout, cols: &[u32], buckets: bool) {
        // Payload non-decreasing in input order, as extraction produces.
        let mut keys: Vec<u64> = cols
            .iter()
            .enumerate()
            .map(|(i, &c)| layout.encode(if buckets { c.wrapping_mul(7) % 64 } else { 0 }, c, (i / 3) as u32))
            .collect();
        let mut want = keys.clone();
        want.sort_unstable();
        let mut scratch = Vec::new();
        sort_keys(&mut keys, &mut scratch, layout, true, buckets);
        assert_eq!(keys, want);
    }

    #[test]
    fn radix_equals_comparison_sort() {
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (nbits, vocab) in [(0u32, 33u64), (2, 1_000_000), (4, 100_000_000), (9, 1 << 31), (3, 8)] {
            let layout = KeyLayout::for_vocab(nbits, vocab);
            let cols: Vec<u32> = (0..5000).map(|_| (next() % vocab) as u32).collect();
            check(layout, &cols, false);
            check(layout, &cols, true);
            check(KeyLayout::reference(nbits), &cols, false);
        }
    }

    #[test]
    fn unsorted_payload_falls_back() {
        let layout = KeyLayout::for_vocab(2, 1000);
        let mut keys: Vec<u64> = (0..1000u32).rev().map(|i| layout.encode(0, i % 17, i)).collect();
        let mut want = keys.clone();
        want.sort_unstable();
        sort_keys(&mut keys, &mut Vec::new(), layout, false, false);
        assert_eq!(keys, want);
    }
}
