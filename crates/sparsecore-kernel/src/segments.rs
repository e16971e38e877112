//! Where the valid slots of one device's COO buffer lie (SPEC 6.1): the forward pass over a
//! preprocessing output and the buffer-level kernels read the row pointers the same way.

use sparsecore_prep::spec::{Plan, ALIGNMENT, MAX_MINIBATCHING_BUCKETS};

use crate::error::{KernelError, Result, Subject};

/// Calls `f(sparsecore, partition, start, end)` for every (SparseCore, minibatch, partition)
/// segment of one device's buffer of `capacity` slots, in buffer order; slots `start..end`
/// (possibly empty) hold its ids, and padding lies between segments. Without minibatching the
/// pointers are relative to the SparseCore's equal share of the buffer; with it they are
/// absolute and each minibatch starts after the previous one's padding. Every partition starts
/// at a multiple of [`ALIGNMENT`], and a pointer past the buffer ends at its end.
pub(crate) fn for_each_segment(
    plan: &Plan,
    num_minibatches: usize,
    row_pointers: &[i32],
    capacity: usize,
    mut f: impl FnMut(usize, usize, usize, usize) -> Result<()>,
) -> Result<()> {
    if plan.enable_minibatching && num_minibatches > MAX_MINIBATCHING_BUCKETS {
        return Err(KernelError::input(
            Subject::Argument("num_minibatches"),
            format!("{num_minibatches} minibatches: preprocessing makes at most {MAX_MINIBATCHING_BUCKETS}"),
        ));
    }
    let layout = plan.layout;
    let (n, s_count, per_segment) = (
        layout.num_partitions(),
        layout.sc_per_device,
        layout.row_pointers_per_segment(),
    );
    let share = capacity / s_count;
    let m_count = if plan.enable_minibatching {
        num_minibatches.max(1)
    } else {
        1
    };
    let mut prev_end = 0usize;
    for sc in 0..s_count {
        for m in 0..m_count {
            let k = sc * m_count + m;
            let (base, mut start) = if plan.enable_minibatching {
                (0, prev_end)
            } else {
                (sc * share, sc * share)
            };
            for p in 0..n {
                if p > 0 {
                    start = start.next_multiple_of(ALIGNMENT);
                }
                let end = (base
                    + row_pointers
                        .get(k * per_segment + p)
                        .copied()
                        .unwrap_or(0)
                        .max(0) as usize)
                    .min(capacity);
                f(sc, p, start.min(end), end)?;
                start = end;
            }
            prev_end = start.next_multiple_of(ALIGNMENT).min(capacity);
        }
    }
    Ok(())
}
