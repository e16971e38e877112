//! The gain rules: a contract shared by extraction (which computes each id's gain) and every
//! consumer that merges duplicates (the grouping walk's entry lists, the fill stage's writer).
//! Gains must equal the reference's bit for bit, so each operation's float order is fixed here.

use crate::spec::Combiner;

/// The reference computes gains with the x86 flush-to-zero and denormals-are-zero modes on
/// (its worker threads run that way, as its outputs show): a subnormal weight reads as a zero
/// of its sign, and a subnormal result (a quotient, a divisor, a merged sum) becomes one. This
/// applies both, so that every gain op here and in the merge gives the reference's bits
/// (checked by the `finite_hostile_weights` and `subnormal` reference cases in
/// `tests/errors/hostile.rs`). Normal values, zeros, infinities and NaNs pass unchanged.
#[inline(always)]
pub(crate) fn flush_subnormal(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits(if bits & 0x7f80_0000 == 0 {
        bits & 0x8000_0000
    } else {
        bits
    })
}

/// The gain of a duplicate (row, column) pair merged into the entry before it: one f32 add,
/// flushed as on the reference's threads.
#[inline(always)]
pub(crate) fn merge(acc: f32, gain: f32) -> f32 {
    flush_subnormal(acc + gain)
}

/// The divisor of a weighted row's gains, from its (already flushed) weights, accumulated
/// exactly as the reference does: sums in f32 left to right, sqrtn's squares summed in f64
/// with one f32 rounding per step, subnormal sums flushed as on its threads.
#[inline(always)]
pub(crate) fn weighted_divisor(combiner: Combiner, weights: impl Iterator<Item = f32>) -> f32 {
    match combiner {
        Combiner::Sum => 1.0f32,
        Combiner::Mean => weights.fold(0.0f32, |acc, w| flush_subnormal(acc + w)),
        Combiner::Sqrtn => weights
            .fold(0.0f32, |acc, w| {
                flush_subnormal((acc as f64 + (w as f64) * (w as f64)) as f32)
            })
            .sqrt(),
    }
}

/// The gain of one (already flushed) weight of a row whose divisor is `divisor`.
#[inline(always)]
pub(crate) fn weighted_gain(combiner: Combiner, weight: f32, divisor: f32) -> f32 {
    match combiner {
        Combiner::Sum => weight,
        _ => flush_subnormal(weight / divisor),
    }
}

/// Unity-weight gain of a sample with `n` ids.
#[inline(always)]
pub(crate) fn unity_gain(combiner: Combiner, n: usize) -> f32 {
    match combiner {
        Combiner::Sum => 1.0,
        Combiner::Mean => 1.0f32 / n as f32,
        Combiner::Sqrtn => 1.0f32 / (n as f32).sqrt(),
    }
}
