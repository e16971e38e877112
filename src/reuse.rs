//! Buffers reused from batch to batch. After each batch the driver grows every worker's
//! workspace to the largest capacities any of them reached, so that whichever worker runs
//! whichever task next, nothing allocates.

/// Grows `v`'s capacity to at least `cap` (keeping its contents).
pub(crate) fn reserve_to<T>(v: &mut Vec<T>, cap: usize) {
    if v.capacity() < cap {
        v.reserve_exact(cap - v.len());
    }
}
