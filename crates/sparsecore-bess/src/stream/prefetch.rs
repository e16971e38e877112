//! A software prefetch: a hint to the CPU, issued through an intrinsic in an `unsafe` block
//! (its SAFETY note below says why that is sound).
//!
//! Why: the stream's random reads of the triple table miss every cache (preprocessing evicts
//! the table between steps), and a loop that copies each triple into three columns keeps only
//! a few of those misses in flight. A hint issued a few dozen triples ahead overlaps them. A
//! load-only read-ahead loop would need no `unsafe`, but a load cannot retire before its line
//! arrives, so the out-of-order window fills behind the first misses, while a prefetch retires
//! at once: that is why the stream issues hints.

/// Asks the CPU to start loading the cache line that holds `*r` (a no-op on other targets).
#[inline(always)]
#[allow(unsafe_code)]
pub(super) fn prefetch<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and changes no memory, the address comes
    // from a live reference, and SSE (which provides it) is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(r).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}
