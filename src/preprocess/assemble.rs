//! Merging the tasks' results into each stack's output, in a fixed order.

use super::checks::check_limits;
use super::task::{Mode, Task};
use crate::error::Result;
use crate::output::Output;
use crate::spec::Plan;

/// Merges task results into the per-stack statistics, in a fixed order, and reports the first
/// error (by stack, device, SparseCore). A limit is checked SparseCore by SparseCore, max ids
/// before max unique ids, as the reference checks them: when one SparseCore passes only the
/// unique limit and a later one only the ids limit, the error names the unique limit, as the
/// reference's abort does (with one thread; with several, its SparseCores race).
pub(super) fn assemble(
    plan: &Plan,
    tasks: &mut [Vec<Task>],
    out: &mut Output,
    mode: Mode,
) -> Result<()> {
    for stack_tasks in tasks.iter_mut() {
        if let Some(e) = stack_tasks.iter_mut().find_map(|t| t.error.take()) {
            return Err(e);
        }
    }
    let layout = &plan.layout;
    let n = layout.num_partitions();
    let s = layout.sc_per_device;
    for ((stack, so), stack_tasks) in plan
        .stacks
        .iter()
        .zip(out.stacks.iter_mut())
        .zip(tasks.iter())
    {
        let stats = &mut so.stats;
        // (Pass 1 of minibatching never fails on limits; the bucketed pass may.) Every task's
        // statistics are merged before the first SparseCore's limit error is returned.
        let check = !plan.allow_id_dropping && mode == Mode::Buffers;
        let mut first_error = None;
        for (i, task) in stack_tasks.iter().enumerate() {
            let d = i / s;
            let row = &mut stats.max_ids_per_partition[d * n..(d + 1) * n];
            for (m, &v) in row.iter_mut().zip(&task.stats.id_counts) {
                *m = (*m).max(v as i32);
            }
            let row = &mut stats.max_unique_ids_per_partition[d * n..(d + 1) * n];
            for (m, &v) in row.iter_mut().zip(&task.stats.unique_counts) {
                *m = (*m).max(v as i32);
            }
            stats.required_buffer_size_per_sc[i] =
                task.stats.required().min(i32::MAX as u64) as i32;
            stats.dropped_id_count += task.stats.dropped + task.overflow;
            if check && first_error.is_none() {
                let ((ids, pi), (uniq, pu)) = (task.stats.max_ids(), task.stats.max_unique());
                first_error = check_limits(stack, (ids, d, i % s, pi), (uniq, d, i % s, pu)).err();
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    Ok(())
}
