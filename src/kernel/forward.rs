//! The forward pass over a stack's buffers (SPEC 6.2): for every valid slot of every segment,
//! `act[s · bsps + sample_id] += gain · shard_p[embedding_id]`.

use ndarray::{s, Array2, ArrayView2};

use super::StackedTable;
use crate::error::{Error, Result};
use crate::output::StackOutput;
use crate::spec::{Plan, ALIGNMENT};

/// Activations of one stack, one `[bsd, D]` array per local device (`bsd` = S · bsps, the
/// per-device stacked batch), summed over all minibatches.
///
/// `num_minibatches` is [`crate::Output::num_minibatches`]; with minibatching enabled the row
/// pointers are absolute and segments are (SparseCore, minibatch) pairs.
pub fn sparse_dense_matmul(plan: &Plan, out: &StackOutput, num_minibatches: usize, table: &StackedTable) -> Result<Vec<Array2<f32>>> {
    let sp = plan.stack(&out.name).ok_or_else(|| Error::config("stack", &out.name, "not in the plan"))?;
    let layout = plan.layout;
    let (n, s_count, rpb) = (layout.num_partitions(), layout.sc_per_device, layout.row_pointers_per_segment());
    if table.num_shards != n || table.dim != sp.stack_embedding_dim as usize || table.stack != sp.name {
        return Err(Error::config(
            "stack",
            &sp.name,
            format!(
                "table has {} shards of dim {} for stack `{}`, expected {n} shards of dim {}",
                table.num_shards, table.dim, table.stack, sp.stack_embedding_dim
            ),
        ));
    }
    let bsd = (sp.total_sample_count / layout.global_devices as u64) as usize;
    let bsps = bsd / s_count;
    let c = out.coo_buffer_size_per_device();
    let cs = c / s_count;
    let m_count = if plan.enable_minibatching { num_minibatches.max(1) } else { 1 };
    let mut acts = Vec::with_capacity(layout.local_devices);
    for d in 0..layout.local_devices {
        let rp = &out.row_pointers[d * out.row_pointers_per_device()..(d + 1) * out.row_pointers_per_device()];
        let emb = &out.embedding_ids[d * c..(d + 1) * c];
        let smp = &out.sample_ids[d * c..(d + 1) * c];
        let gains = &out.gains[d * c..(d + 1) * c];
        let mut act = Array2::<f32>::zeros((bsd, table.dim));
        let mut prev_end = 0usize;
        for sc in 0..s_count {
            for m in 0..m_count {
                let k = sc * m_count + m;
                // Segment-relative pointers (no minibatching) or absolute ones.
                let (base, mut start) = if plan.enable_minibatching { (0, prev_end) } else { (sc * cs, sc * cs) };
                for p in 0..n {
                    let end = base + rp[k * rpb + p].max(0) as usize;
                    if p > 0 {
                        start = start.next_multiple_of(ALIGNMENT);
                    }
                    let end = end.min(c);
                    let shard = table.shard(p);
                    for i in start.min(end)..end {
                        let (e, smp_id, g) = (emb[i], smp[i], gains[i]);
                        if e < 0 || e as usize >= table.rows_per_shard {
                            return Err(Error::input(
                                &sp.name,
                                format!("embedding id {e} at device {d} slot {i} is outside the shard of {} rows", table.rows_per_shard),
                            ));
                        }
                        if smp_id < 0 || smp_id as usize >= bsps {
                            return Err(Error::input(&sp.name, format!("sample id {smp_id} at device {d} slot {i} is outside the {bsps} samples")));
                        }
                        let mut row = act.row_mut(sc * bsps + smp_id as usize);
                        row.scaled_add(g, &shard.row(e as usize));
                    }
                    start = end;
                }
                prev_end = start.next_multiple_of(ALIGNMENT).min(c);
            }
        }
        acts.push(act);
    }
    Ok(acts)
}

/// One feature's activations from a device's stacked activations (the reference's
/// `_get_activation_for_feature`): for each SparseCore, the feature's rows of its slice, and
/// the table's own columns. Returns `[S · rows, dim]`.
pub fn feature_activations(plan: &Plan, feature: usize, device_act: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
    let f = plan.features.get(feature).ok_or_else(|| Error::config("feature", feature.to_string(), "no such feature"))?;
    let layout = plan.layout;
    let s_count = layout.sc_per_device;
    let per_sc = device_act.nrows() / s_count;
    let base = (f.row_offset / layout.num_partitions() as u64) as usize;
    let rows = f.global_batch_size / layout.num_partitions();
    let dim = f.embedding_dim as usize;
    if base + rows > per_sc || dim > device_act.ncols() {
        return Err(Error::config("feature", &f.name, "activations do not cover this feature"));
    }
    let mut out = Array2::<f32>::zeros((s_count * rows, dim));
    for sc in 0..s_count {
        out.slice_mut(s![sc * rows..(sc + 1) * rows, ..])
            .assign(&device_act.slice(s![sc * per_sc + base..sc * per_sc + base + rows, ..dim]));
    }
    Ok(out)
}
