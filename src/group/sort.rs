//! Sorting the keys of one SparseCore.
//!
//! Keys are either unique or identical only when they denote the same (row, column) with the
//! same gain, so any correct sort gives the reference's order.
//!
//! Extraction emits keys whose payload never decreases (samples are visited in row order and
//! weighted payloads are running indices), so a *stable* sort by the column bits alone yields
//! the full key order. That is an LSD radix sort over the few column bits a stack uses,
//! far cheaper than a comparison sort. When the payload is not monotone (only possible with
//! hand-made inconsistent row offsets) we fall back to `sort_unstable`.
//!
//! A SparseCore's keys outgrow the core's caches (hundreds of thousands of keys in real
//! batches), and every radix pass over them would then stream through memory. So [`split`]
//! first scatters them by their top bits into chunks of a few thousand keys, once, and each
//! chunk is then radix-sorted on its remaining column bits and walked by the grouping stage
//! while it is still in cache. The split is itself a stable counting sort, so chunk by chunk
//! the order is the same.

use crate::key::{Gains, KeyFormat, KeyWord, MAX_CHUNK_BITS};
use crate::reuse::reserve_to;

/// Largest radix digit, in bits.
const MAX_DIGIT_BITS: u32 = 12;

/// Below this many keys a comparison sort is as fast and needs no histogram.
const SMALL: usize = 256;

/// Reused memory of the radix sort: the second key buffer and the digit histograms (sized to
/// the digits in use, so that small sorts do not clear 16 KiB tables).
#[derive(Debug, Default)]
pub struct RadixScratch<K> {
    keys: Vec<K>,
    counts: Vec<u32>,
}

impl<K> RadixScratch<K> {
    /// Grows both buffers to at least `other`'s capacity.
    pub fn reserve_like(&mut self, other: &RadixScratch<K>) {
        reserve_to(&mut self.keys, other.keys.capacity());
        reserve_to(&mut self.counts, other.counts.capacity());
    }
}

/// Sorts `keys` ascending. `data_sorted` says the payloads are non-decreasing in input order.
/// `scratch` is reused memory.
pub fn sort_keys<K: KeyWord>(
    keys: &mut [K],
    scratch: &mut RadixScratch<K>,
    format: KeyFormat,
    data_sorted: bool,
) {
    if !data_sorted || keys.len() < SMALL {
        if format.gains == Gains::InKey {
            // The payload here is the row, but the reference orders a column's entries by
            // extraction index (SPEC 3.6): a stable sort by the column bits alone keeps exactly
            // that order, whether or not rows arrived in order, and keeps repeated ids in the
            // order their gains are summed in.
            let shift = format.element_shift() + format.data_bits;
            keys.sort_by_key(|e| e.to_u64() >> shift);
        } else {
            keys.sort_unstable();
        }
        return;
    }
    let lo = format.element_shift() + format.data_bits;
    let hi = format.element_shift() + format.width();
    radix_by_bits(keys, scratch, lo, hi);
}

/// Sorts one chunk of 32-bit keys by bits `[lo, hi)` (the column bits the chunk does not
/// share), or wholly when the payloads are not known to be sorted.
pub fn sort_chunk(
    keys: &mut [u32],
    scratch: &mut RadixScratch<u32>,
    lo: u32,
    hi: u32,
    data_sorted: bool,
) {
    if !data_sorted || keys.len() < SMALL {
        // Equal keys of one chunk are equal keys, so an unstable sort is exact.
        keys.sort_unstable();
        return;
    }
    radix_by_bits(keys, scratch, lo, hi);
}

/// Up to this many keys wider than 32 bits are radix-sorted whole, as `u64`, rather than
/// split into chunks: both key buffers (512 KiB) stay in L2 anyway, and for small sets the
/// split pass and each chunk's own digit histograms cost more than the wider keys (Criteo-like
/// SparseCores, with 4-12 thousand keys each, are such sets; BENCHMARKS.md has the numbers).
const WHOLE_SORT_MAX: usize = 1 << 15;

/// How many top bits [`split`] cuts `n` keys of `format` by: just enough to leave 32 bits
/// (`None`: the keys are sorted whole, see [`KeyFormat::min_chunk_bits`] and
/// [`WHOLE_SORT_MAX`]).
///
/// Splitting more finely keeps chunks in cache, but the split is a pass over the keys of its
/// own, which smaller chunks do not win back: with few column bits (one radix pass) it doubles
/// the passes (BENCHMARKS.md, "sort and split tuning").
pub fn chunk_bits_for(n: usize, format: &KeyFormat) -> Option<u32> {
    match format.min_chunk_bits() {
        // (Packed keys keep their gains apart when wide, and only the split joins them.)
        Some(c) if c > 0 && format.gains != Gains::InKey && n <= WHOLE_SORT_MAX => None,
        other => other,
    }
}

/// Most chunk bits one scatter pass fans out to; past this [`split`] goes in two passes.
///
/// A fan-out of `2^11` streams keeps one open cache line per chunk (128 KiB, in L2) and one
/// page per chunk (within the second-level TLB of current x86 cores), so one pass beats two
/// up to there. A machine with a smaller TLB may favour a lower bound (BENCHMARKS.md, "sort
/// and split tuning", has the measurements behind this value).
const MAX_FAN_BITS: u32 = 11;

/// Splits `keys` (each below `2^width`) into `2^c` chunks by their top `c` bits, keeping each
/// key's low `width - c` bits, in a stable counting sort: chunk `b` is
/// `out[starts[b]..starts[b + 1]]`. `out`, `starts`, `cursors` and `tmp` are reused memory.
///
/// Past `MAX_FAN_BITS` bits it takes two scatters, through `tmp`: by the top bits into at
/// most `2^MAX_FAN_BITS` ranges, then each range (in cache) by the rest.
pub fn split(
    keys: &[u64],
    width: u32,
    c: u32,
    out: &mut Vec<u32>,
    starts: &mut Vec<u32>,
    cursors: &mut Vec<u32>,
    tmp: &mut RadixScratch<u64>,
) {
    crate::dispatch_v3!(<> (keys: &[u64], width: u32, c: u32, out: &mut Vec<u32>, starts: &mut Vec<u32>, cursors: &mut Vec<u32>, tmp: &mut RadixScratch<u64>) -> () {
        assert!(width - c <= 32 && c <= MAX_CHUNK_BITS && keys.len() < u32::MAX as usize);
        let n = keys.len();
        let shift = width - c;
        let mask = ((1usize << c) - 1) as u64;
        chunk_starts(keys, shift, c, starts, cursors);
        // Every slot is written before it is read; only grow, never re-zero.
        if out.len() < n {
            out.resize(n, 0);
        }
        let out = &mut out[..n];
        if c <= MAX_FAN_BITS {
            scatter_low(keys.iter().copied(), out, cursors, shift, mask);
            return;
        }
        // Two passes: by the top c1 bits into `tmp`, then each of those ranges by the next c2.
        let c2 = c / 2;
        let c1 = c - c2;
        let tmp = &mut tmp.keys;
        if tmp.len() < n {
            tmp.resize(n, 0);
        }
        let tmp = &mut tmp[..n];
        // The first pass fans out to at most 2^ceil(MAX_CHUNK_BITS / 2) ranges.
        let mut top = [0u32; 1 << (MAX_CHUNK_BITS - MAX_CHUNK_BITS / 2)];
        for (j, t) in top.iter_mut().enumerate().take(1 << c1) {
            *t = starts[j << c2];
        }
        scatter(keys, tmp, &mut top[..1 << c1], shift + c2, (1u64 << c1) - 1);
        for j in 0..1usize << c1 {
            let (lo, hi) = (starts[j << c2] as usize, starts[(j + 1) << c2] as usize);
            let range = &tmp[lo..hi];
            scatter_low(range.iter().copied(), out, &mut cursors[j << c2..(j + 1) << c2], shift, (1u64 << c2) - 1);
        }
    })
}

/// The bounds of [`split`]'s `2^c` chunks of `keys` (chunk = the bits from `shift` up) in
/// `starts` (`2^c + 1` entries), and `cursors` set to each chunk's first slot.
#[inline(always)]
fn chunk_starts(keys: &[u64], shift: u32, c: u32, starts: &mut Vec<u32>, cursors: &mut Vec<u32>) {
    let chunks = 1usize << c;
    let mask = (chunks - 1) as u64;
    starts.clear();
    starts.resize(chunks + 1, 0);
    {
        let counts = &mut starts[1..];
        for &k in keys {
            counts[((k >> shift) & mask) as usize] += 1;
        }
    }
    for b in 0..chunks {
        starts[b + 1] += starts[b];
    }
    cursors.clear();
    cursors.extend_from_slice(&starts[..chunks]);
}

/// [`split`] for packed keys kept apart from their gains: chunk elements are
/// `(key's low width - c bits) << 32 | gain bits`, so that each chunk sorts and walks like
/// keys packed whole. One scatter pass (weighted stacks this wide are rare).
#[allow(unsafe_code)]
pub fn split_packed(
    keys: &[u64],
    gains: &[f32],
    width: u32,
    c: u32,
    out: &mut Vec<u64>,
    starts: &mut Vec<u32>,
    cursors: &mut Vec<u32>,
) {
    assert!(
        width - c <= 32
            && c <= MAX_CHUNK_BITS
            && keys.len() < u32::MAX as usize
            && keys.len() == gains.len()
    );
    let n = keys.len();
    let shift = width - c;
    let (mask, low) = (((1usize << c) - 1) as u64, (1u64 << shift) - 1);
    chunk_starts(keys, shift, c, starts, cursors);
    if out.len() < n {
        out.resize(n, 0);
    }
    let out = &mut out[..n];
    for (&k, &g) in keys.iter().zip(gains) {
        let d = ((k >> shift) & mask) as usize;
        // SAFETY: d <= mask < cursors.len() == chunks.
        let slot = unsafe { cursors.get_unchecked_mut(d) };
        let pos = *slot as usize;
        *slot += 1;
        out[pos] = ((k & low) << 32) | g.to_bits() as u64;
    }
}

/// Sorts one chunk of packed elements (key bits in the high half) by their column bits, from
/// bit `lo` up, stably: equal columns keep extraction order, in which their gains are summed.
pub fn sort_packed_chunk(
    keys: &mut [u64],
    scratch: &mut RadixScratch<u64>,
    lo: u32,
    data_sorted: bool,
) {
    if !data_sorted || keys.len() < SMALL {
        keys.sort_by_key(|e| e >> lo);
        return;
    }
    radix_by_bits(keys, scratch, lo, 64);
}

/// The scatter of [`split`]: `key & low bits` to `out[cursors[(key >> shift) & mask]++]`, where
/// `cursors` were set from the counts of these very keys.
#[allow(unsafe_code)]
#[inline(always)]
fn scatter_low(
    keys: impl Iterator<Item = u64>,
    out: &mut [u32],
    cursors: &mut [u32],
    shift: u32,
    mask: u64,
) {
    assert!(mask as usize <= cursors.len().wrapping_sub(1));
    let low = (1u64 << shift) - 1;
    for k in keys {
        let d = ((k >> shift) & mask) as usize;
        // SAFETY: d <= mask < cursors.len() (asserted). (Each cursor hands out exactly the
        // slots its digit's keys were counted for; the store is bounds-checked anyway.)
        let slot = unsafe { cursors.get_unchecked_mut(d) };
        let pos = *slot as usize;
        *slot += 1;
        out[pos] = (k & low) as u32;
    }
}

/// Passes whose histograms are gathered in one read of the keys.
const FUSED_PASSES: usize = 3;

/// Stable LSD radix sort of `keys` by bits `[lo, hi)`.
///
/// The histograms of all passes come from one read of the keys (a permutation leaves every
/// digit's histogram unchanged), and the scatter indexes without bounds checks: this loop is
/// where the pipeline spends most of its time, and its indices are in range by construction.
/// Compiled twice (see [`crate::isa`]).
fn radix_by_bits<K: KeyWord>(keys: &mut [K], scratch: &mut RadixScratch<K>, lo: u32, hi: u32) {
    crate::dispatch_v3!(<K: KeyWord> (keys: &mut [K], scratch: &mut RadixScratch<K>, lo: u32, hi: u32) -> () {
        // Ranges of up to FUSED_PASSES digits (only keys wider than 36 column bits, never the
        // 32-bit halves, take more than one), lowest first.
        let mut from = lo;
        while from < hi {
            let to = hi.min(from + FUSED_PASSES as u32 * MAX_DIGIT_BITS);
            radix_range(keys, scratch, from, to);
            from = to;
        }
    })
}

/// [`radix_by_bits`] for at most `FUSED_PASSES` digits.
#[inline(always)]
fn radix_range<K: KeyWord>(keys: &mut [K], scratch: &mut RadixScratch<K>, lo: u32, hi: u32) {
    let span = hi - lo;
    let passes = span.div_ceil(MAX_DIGIT_BITS);
    let digit = span.div_ceil(passes);
    match passes {
        1 => radix_passes::<K, 1>(keys, scratch, lo, digit),
        2 => radix_passes::<K, 2>(keys, scratch, lo, digit),
        _ => radix_passes::<K, FUSED_PASSES>(keys, scratch, lo, digit),
    }
}

/// `P` passes of `digit` bits from bit `lo` up.
#[inline(always)]
fn radix_passes<K: KeyWord, const P: usize>(
    keys: &mut [K],
    scratch: &mut RadixScratch<K>,
    lo: u32,
    digit: u32,
) {
    let radix = 1usize << digit;
    let mask = (radix - 1) as u64;
    let RadixScratch {
        keys: scratch,
        counts,
    } = scratch;
    counts.clear();
    counts.resize(P * radix, 0);
    let mut parts = counts.chunks_exact_mut(radix);
    let mut counts: [&mut [u32]; P] = std::array::from_fn(|_| parts.next().unwrap_or_default());
    histograms(keys, &mut counts, lo, digit, mask);
    // Every slot is written before it is read; only grow, never re-zero.
    if scratch.len() < keys.len() {
        scratch.resize(keys.len(), K::default());
    }
    let n = keys.len();
    let first = keys.first().map_or(0, |k| k.to_u64() >> lo);
    let mut in_scratch = false;
    for (p, c) in counts.iter_mut().enumerate() {
        // A digit every key shares moves nothing (then the first key's digit has them all).
        if c.get(((first >> (p as u32 * digit)) & mask) as usize)
            .is_some_and(|&x| x as usize == n)
        {
            continue;
        }
        let mut sum = 0u32;
        for x in c.iter_mut() {
            let v = *x;
            *x = sum;
            sum += v;
        }
        let shift = lo + p as u32 * digit;
        // Ping-pong between the two buffers without swapping the `Vec`s themselves: each
        // buffer keeps its own capacity, which the per-worker workspaces rely on to stay
        // allocation-free (a swap would move capacities between a stack's chunks).
        if in_scratch {
            scatter(&scratch[..n], &mut keys[..n], c, shift, mask);
        } else {
            scatter(&keys[..n], &mut scratch[..n], c, shift, mask);
        }
        in_scratch = !in_scratch;
    }
    if in_scratch {
        keys.copy_from_slice(&scratch[..n]);
    }
}

/// The digit histograms of all passes, in one read of the keys.
#[allow(unsafe_code)]
#[inline(always)]
fn histograms<K: KeyWord, const P: usize>(
    keys: &[K],
    counts: &mut [&mut [u32]; P],
    lo: u32,
    digit: u32,
    mask: u64,
) {
    assert!(counts.iter().all(|c| c.len() > mask as usize));
    for &k in keys {
        let k = k.to_u64() >> lo;
        for (p, c) in counts.iter_mut().enumerate() {
            let d = ((k >> (p as u32 * digit)) & mask) as usize;
            // SAFETY: d <= mask < c.len() (asserted above).
            unsafe { *c.get_unchecked_mut(d) += 1 };
        }
    }
}

/// One stable counting-sort scatter: `starts[d]` is the first slot of digit `d` in `out`.
#[allow(unsafe_code)]
#[inline(always)]
fn scatter<K: KeyWord>(keys: &[K], out: &mut [K], starts: &mut [u32], shift: u32, mask: u64) {
    assert!(mask as usize <= starts.len().wrapping_sub(1) && keys.len() == out.len());
    for &k in keys {
        let d = ((k.to_u64() >> shift) & mask) as usize;
        // SAFETY: d <= mask < starts.len() (asserted above).
        let slot = unsafe { starts.get_unchecked_mut(d) };
        let pos = *slot as usize;
        *slot += 1;
        // SAFETY: `starts` holds the exclusive prefix sums of the histogram of this digit over
        // these very keys, so every digit d hands out exactly the slots
        // [start(d), start(d) + count(d)), all below keys.len() == out.len().
        unsafe { *out.get_unchecked_mut(pos) = k };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<K: KeyWord>(format: KeyFormat, cols: &[u32]) {
        // Payload non-decreasing in input order, as extraction produces.
        let dmax = (1u64 << format.data_bits) - 1;
        let mut keys: Vec<K> = cols
            .iter()
            .enumerate()
            .map(|(i, &c)| K::from_u64(format.encode(c, ((i / 3) as u64).min(dmax) as u32)))
            .collect();
        let mut want = keys.clone();
        want.sort_unstable();
        let mut scratch = RadixScratch::default();
        sort_keys(&mut keys, &mut scratch, format, true);
        assert!(keys == want);
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
        for (nbits, vocab) in [
            (0u32, 33u64),
            (2, 1_000_000),
            (4, 100_000_000),
            (9, 1 << 31),
            (3, 8),
        ] {
            let cols: Vec<u32> = (0..5000).map(|_| (next() % vocab) as u32).collect();
            // (Unchecked ids with 26 data bits give the widest keys, 58 bits.)
            for (checked, data_bits) in [(true, 11), (true, 26), (false, 11), (false, 26)] {
                let local_bits = KeyFormat::local_bits_for(nbits, vocab, checked);
                let l = KeyFormat {
                    nbits,
                    local_bits,
                    data_bits,
                    gains: Gains::Unit,
                };
                check::<u64>(l, &cols);
                if l.width() <= 32 {
                    check::<u32>(l, &cols);
                }
            }
        }
    }

    #[test]
    fn split_is_a_stable_counting_sort_by_the_top_bits() {
        // One scatter up to MAX_FAN_BITS chunk bits, two past it: both must give each key's low
        // bits in the order a stable sort by the top bits gives.
        let mut x = 99u64;
        for (width, c) in [(36u32, 4u32), (43, 11), (44, 12), (40, 8), (38, 6), (39, 7)] {
            let keys: Vec<u64> = (0..20_000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x & ((1u64 << width) - 1)
                })
                .collect();
            let mut want = keys.clone();
            want.sort_by_key(|k| k >> (width - c));
            let (mut out, mut starts, mut cursors) = (Vec::new(), Vec::new(), Vec::new());
            split(
                &keys,
                width,
                c,
                &mut out,
                &mut starts,
                &mut cursors,
                &mut RadixScratch::default(),
            );
            assert_eq!(starts.len(), (1 << c) + 1, "width {width}, c {c}");
            // Chunk b holds the keys whose top bits are b, so chunks in order are `want`.
            let low = (1u64 << (width - c)) - 1;
            let lows: Vec<u32> = want.iter().map(|&k| (k & low) as u32).collect();
            assert_eq!(&out[..keys.len()], &lows[..], "width {width}, c {c}");
            let mut counts = vec![0u32; 1 << c];
            for &k in &keys {
                counts[(k >> (width - c)) as usize] += 1;
            }
            let sizes: Vec<u32> = starts.windows(2).map(|w| w[1] - w[0]).collect();
            assert_eq!(sizes, counts, "width {width}, c {c}");
        }
    }

    #[test]
    fn unsorted_payload_falls_back() {
        let format = KeyFormat {
            nbits: 2,
            local_bits: 8,
            data_bits: 10,
            gains: Gains::Unit,
        };
        let mut keys: Vec<u64> = (0..1000u32)
            .rev()
            .map(|i| format.encode(i % 17, i))
            .collect();
        let mut want = keys.clone();
        want.sort_unstable();
        sort_keys(&mut keys, &mut RadixScratch::default(), format, false);
        assert_eq!(keys, want);
    }
}
