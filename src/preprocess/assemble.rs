//! Merging the tasks' results into each stack's output, in a fixed order.

use super::checks::check_limits;
use super::task::Task;
use super::Mode;
use crate::error::Result;
use crate::output::Output;
use crate::spec::Plan;

/// Merges task results into the per-stack statistics, in a fixed order, and reports the first
/// error (by stack, device, SparseCore).
pub(super) fn assemble(plan: &Plan, tasks: &mut [Vec<Task>], out: &mut Output, mode: Mode) -> Result<()> {
    for stack_tasks in tasks.iter_mut() {
        if let Some(e) = stack_tasks.iter_mut().find_map(|t| t.error.take()) {
            return Err(e);
        }
    }
    let layout = &plan.layout;
    let n = layout.num_partitions();
    let s = layout.sc_per_device;
    for ((stack, so), stack_tasks) in plan.stacks.iter().zip(out.stacks.iter_mut()).zip(tasks.iter()) {
        let stats = &mut so.stats;
        // (observed, device, sc, partition) of the largest count per limit.
        let mut worst_ids = (0u32, 0, 0, 0);
        let mut worst_unique = (0u32, 0, 0, 0);
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
            stats.required_buffer_size_per_sc[i] = task.stats.required().min(i32::MAX as u64) as i32;
            stats.dropped_id_count += task.stats.dropped + task.overflow;
            let (ids, p) = task.stats.max_ids();
            if ids > worst_ids.0 {
                worst_ids = (ids, d, i % s, p);
            }
            let (uniq, p) = task.stats.max_unique();
            if uniq > worst_unique.0 {
                worst_unique = (uniq, d, i % s, p);
            }
        }
        if !plan.allow_id_dropping && mode == Mode::Buffers {
            // (Pass 1 of minibatching never fails on limits; the bucketed pass may.)
            check_limits(stack, worst_ids, worst_unique)?;
        }
    }
    Ok(())
}
