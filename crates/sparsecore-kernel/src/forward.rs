//! The forward pass over a stack's buffers (SPEC 6.2): for every valid slot of every segment,
//! `act[s · bsps + sample_id] += gain · shard_p[embedding_id]`.

use ndarray::{s, Array2, ArrayView2};

use super::StackedTable;
use crate::error::{KernelError, PlanItem, Result, Subject};
use sparsecore_prep::spec::Plan;
use sparsecore_prep::StackOutput;

use crate::segments::for_each_segment;

/// Calls `f(device, activation_row, partition, embedding_id, gain)` for every valid slot of a
/// stack's buffers, every segment and minibatch included, checking ids against the shard and
/// the batch. Padding slots are never visited.
pub(crate) fn for_each_slot(
    plan: &Plan,
    out: &StackOutput,
    num_minibatches: usize,
    table: &StackedTable,
    mut f: impl FnMut(usize, usize, usize, usize, f32) -> Result<()>,
) -> Result<()> {
    let sp = plan
        .stack(&out.name)
        .ok_or_else(|| KernelError::plan(PlanItem::Stack, &out.name, "not in the plan"))?;
    let layout = plan.layout;
    let (n, s_count) = (layout.num_partitions(), layout.sc_per_device);
    if table.num_shards != n
        || table.dim != sp.stack_embedding_dim as usize
        || table.stack != sp.name
    {
        return Err(KernelError::plan(
            PlanItem::Stack,
            &sp.name,
            format!(
                "table has {} shards of dim {} for stack `{}`, expected {n} shards of dim {}",
                table.num_shards, table.dim, table.stack, sp.stack_embedding_dim
            ),
        ));
    }
    check_table_shape(sp, n, table)?;
    let bsd = (sp.total_sample_count / layout.global_devices as u64) as usize;
    let bsps = bsd / s_count;
    let c = out.coo_buffer_size_per_device();
    let l = layout.local_devices;
    let rp_len = out.row_pointers_per_device();
    if c == 0
        || out.row_pointers.len() != l * rp_len
        || [
            out.embedding_ids.len(),
            out.sample_ids.len(),
            out.gains.len(),
        ]
        .iter()
        .any(|&n| n != l * c)
    {
        return Err(KernelError::input(
            Subject::Stack(sp.name.clone()),
            "the output has no buffers of the plan's sizes (a stats-only run?)",
        ));
    }
    for d in 0..layout.local_devices {
        let emb = &out.embedding_ids[d * c..(d + 1) * c];
        let smp = &out.sample_ids[d * c..(d + 1) * c];
        let gains = &out.gains[d * c..(d + 1) * c];
        for_each_segment(
            plan,
            num_minibatches,
            &out.row_pointers[d * rp_len..(d + 1) * rp_len],
            c,
            |sc, p, start, end| {
                for i in start..end {
                    let (e, smp_id) = (emb[i], smp[i]);
                    if e < 0 || e as usize >= table.rows_per_shard {
                        return Err(KernelError::input(
                        Subject::Stack(sp.name.clone()),
                        format!("embedding id {e} at device {d} slot {i} is outside the shard of {} rows", table.rows_per_shard),
                    ));
                    }
                    if smp_id < 0 || smp_id as usize >= bsps {
                        return Err(KernelError::input(Subject::Stack(sp.name.clone()), format!("sample id {smp_id} at device {d} slot {i} is outside the {bsps} samples")));
                    }
                    f(d, sc * bsps + smp_id as usize, p, e as usize, gains[i])?;
                }
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// A table whose public fields were set by hand must still be the plan's `[N · R, D]`, with
/// `R = stack_vocab_size / N`: otherwise reading a shard would slice out of bounds.
pub(crate) fn check_table_shape(
    sp: &sparsecore_prep::spec::StackPlan,
    n: usize,
    table: &StackedTable,
) -> Result<()> {
    let r = sp.stack_vocab_size as usize / n;
    let d = sp.stack_embedding_dim as usize;
    if table.rows_per_shard != r || table.data.dim() != (n * r, d) {
        return Err(KernelError::plan(
            PlanItem::Stack,
            &sp.name,
            format!(
                "table of {} rows per shard and data of shape {:?}, expected {r} rows per shard and [N · R, D] = [{}, {d}]",
                table.rows_per_shard,
                table.data.dim(),
                n * r
            ),
        ));
    }
    Ok(())
}

/// Activations of one stack, one `[bsd, D]` array per local device (`bsd` = S · bsps, the
/// per-device stacked batch), summed over all minibatches:
/// `act[s · bsps + sample_id] += gain · shard_p[embedding_id]` for every valid slot.
///
/// `num_minibatches` is [`Output::num_minibatches`](sparsecore_prep::Output::num_minibatches); with minibatching enabled the row
/// pointers are absolute and segments are (SparseCore, minibatch) pairs.
pub fn sparse_dense_matmul(
    plan: &Plan,
    out: &StackOutput,
    num_minibatches: usize,
    table: &StackedTable,
) -> Result<Vec<Array2<f32>>> {
    let sp = plan
        .stack(&out.name)
        .ok_or_else(|| KernelError::plan(PlanItem::Stack, &out.name, "not in the plan"))?;
    let bsd = (sp.total_sample_count / plan.layout.global_devices as u64) as usize;
    let mut acts: Vec<Array2<f32>> = (0..plan.layout.local_devices)
        .map(|_| Array2::zeros((bsd, table.dim)))
        .collect();
    for_each_slot(plan, out, num_minibatches, table, |d, row, p, e, gain| {
        acts[d]
            .row_mut(row)
            .scaled_add(gain, &table.shard(p)?.row(e));
        Ok(())
    })?;
    Ok(acts)
}

/// One feature's activations from a device's stacked activations (the reference's
/// `_get_activation_for_feature`): for each SparseCore, the feature's rows of its slice, and
/// the table's own columns. Returns `[S · rows, dim]`.
pub fn feature_activations(
    plan: &Plan,
    feature: usize,
    device_act: ArrayView2<'_, f32>,
) -> Result<Array2<f32>> {
    let f = plan.features.get(feature).ok_or_else(|| {
        KernelError::plan(PlanItem::Feature, feature.to_string(), "no such feature")
    })?;
    let layout = plan.layout;
    let s_count = layout.sc_per_device;
    let per_sc = device_act.nrows() / s_count;
    let base = (f.row_offset / layout.num_partitions() as u64) as usize;
    let rows = f.global_batch_size / layout.num_partitions();
    let dim = f.embedding_dim as usize;
    if base + rows > per_sc || dim > device_act.ncols() {
        return Err(KernelError::plan(
            PlanItem::Feature,
            &f.name,
            "activations do not cover this feature",
        ));
    }
    let mut out = Array2::<f32>::zeros((s_count * rows, dim));
    for sc in 0..s_count {
        out.slice_mut(s![sc * rows..(sc + 1) * rows, ..])
            .assign(&device_act.slice(s![sc * per_sc + base..sc * per_sc + base + rows, ..dim]));
    }
    Ok(out)
}

/// The adjoint of [`feature_activations`]: one device's per-feature activation gradients,
/// stacked back into the device's `[bsd, D]` activation layout of stack `stack` (the layout
/// [`sparse_dense_matmul`] returns and [`crate::apply_gradients`] consumes, one array per local
/// device).
///
/// `feature_grads` pairs a feature index (into [`Plan::features`]) with its gradient, shaped as
/// [`feature_activations`] returns it: `[S · rows, embedding_dim]`, SparseCore-major, where
/// `rows = global_batch_size / N`. Each gradient is added into the rows and leading columns
/// that [`feature_activations`] reads; every other entry (padding columns of the stack's dim,
/// features not given) is 0; a feature given twice has its gradients summed. So for any device
/// activations `A` of the stack and gradients `G_f`,
/// `Σ_f ⟨feature_activations(A, f), G_f⟩ = ⟨A, stack_feature_gradients(G)⟩`: the chain rule
/// from per-feature gradients (a dense head's) back to the table rows.
///
/// Errors name the stack or the feature: a stack not in the plan, a feature index out of
/// range or of another stack, a gradient of the wrong shape.
pub fn stack_feature_gradients(
    plan: &Plan,
    stack: &str,
    feature_grads: &[(usize, ArrayView2<'_, f32>)],
) -> Result<Array2<f32>> {
    let sp = plan
        .stack(stack)
        .ok_or_else(|| KernelError::plan(PlanItem::Stack, stack, "not in the plan"))?;
    let layout = plan.layout;
    let s_count = layout.sc_per_device;
    let n = layout.num_partitions();
    let bsd = (sp.total_sample_count / layout.global_devices as u64) as usize;
    let per_sc = bsd / s_count;
    let stack_dim = sp.stack_embedding_dim as usize;
    let mut out = Array2::<f32>::zeros((bsd, stack_dim));
    for (feature, grad) in feature_grads {
        let f = plan.features.get(*feature).ok_or_else(|| {
            KernelError::plan(PlanItem::Feature, feature.to_string(), "no such feature")
        })?;
        if !sp.features.contains(feature) {
            let other = plan.stacks.get(f.stack).map_or("?", |s| s.name.as_str());
            return Err(KernelError::plan(
                PlanItem::Feature,
                &f.name,
                format!("belongs to stack `{other}`, not `{stack}`"),
            ));
        }
        let base = (f.row_offset / n as u64) as usize;
        let rows = f.global_batch_size / n;
        let dim = f.embedding_dim as usize;
        if grad.dim() != (s_count * rows, dim) {
            return Err(KernelError::input(
                Subject::Feature(f.name.clone()),
                format!("activation gradient of shape {:?}, expected [S · rows, embedding_dim] = [{}, {dim}]", grad.dim(), s_count * rows),
            ));
        }
        if base + rows > per_sc || dim > stack_dim {
            return Err(KernelError::plan(
                PlanItem::Feature,
                &f.name,
                format!("does not fit the activations of stack `{stack}`"),
            ));
        }
        for sc in 0..s_count {
            let mut dst = out.slice_mut(s![sc * per_sc + base..sc * per_sc + base + rows, ..dim]);
            dst += &grad.slice(s![sc * rows..(sc + 1) * rows, ..]);
        }
    }
    Ok(out)
}
