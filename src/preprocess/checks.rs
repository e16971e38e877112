//! The driver's checks: per-stack batch checks before the tasks run, and the limits after.

use crate::error::{BatchCount, Error, LimitKind, Result};
use crate::input::SampleSource;
use crate::spec::{Plan, StackPlan, DATA_MASK};

/// Per-stack batch checks of SPEC 3.1 (check 8) and 3.3; writes each stack's `bsps`.
pub(super) fn check_batches(
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    batch_per_sc: &mut Vec<usize>,
) -> Result<()> {
    let layout = &plan.layout;
    let s = layout.sc_per_device;
    batch_per_sc.clear();
    for stack in &plan.stacks {
        let bsps = {
            // Saturating: a custom source may report any count (the plan only bounds them when
            // it derives global sizes from local ones, not with fixed `global_batch_sizes`).
            let bsd: u64 = stack.features.iter().fold(0u64, |sum, &f| {
                sum.saturating_add((inputs[f].num_samples() / layout.local_devices) as u64)
            });
            if bsd > DATA_MASK {
                return Err(Error::BatchTooLarge {
                    stack: stack.name.clone(),
                    what: BatchCount::Samples,
                    count: bsd,
                    limit: DATA_MASK,
                });
            }
            let bsd = bsd as usize;
            if !bsd.is_multiple_of(s) {
                return Err(Error::BatchNotDivisible {
                    stack: stack.name.clone(),
                    feature: plan.features[stack.features[0]].name.clone(),
                    batch: bsd,
                    sc_per_device: s,
                });
            }
            if bsd < s * stack.features.len() {
                return Err(Error::BatchTooSmall {
                    stack: stack.name.clone(),
                    batch: bsd,
                    sc_per_device: s,
                    features: stack.features.len(),
                });
            }
            bsd / s
        };
        batch_per_sc.push(bsps);
    }
    Ok(())
}

/// The largest count seen for a limit: (observed, device, SparseCore, partition).
pub(super) type Worst = (u32, usize, usize, usize);

/// `Error::LimitExceeded` for the first of the stack's two limits that `ids` / `unique` exceed.
pub(super) fn check_limits(stack: &StackPlan, ids: Worst, unique: Worst) -> Result<()> {
    for (kind, (observed, device, sc, partition), limit) in [
        (LimitKind::MaxIds, ids, stack.max_ids_per_partition),
        (
            LimitKind::MaxUniqueIds,
            unique,
            stack.max_unique_ids_per_partition,
        ),
    ] {
        if observed > limit {
            return Err(Error::LimitExceeded {
                stack: stack.name.clone(),
                kind,
                observed,
                limit,
                device,
                sparsecore: sc,
                partition,
            });
        }
    }
    Ok(())
}
