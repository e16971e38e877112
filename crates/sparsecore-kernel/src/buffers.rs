//! The forward pass and the fused backward pass over *borrowed* buffers and tables, in parallel.
//!
//! [`crate::sparse_dense_matmul`] and [`crate::apply_gradients`] take a [`StackOutput`] and a
//! [`crate::StackedTable`] the caller owns. A caller whose buffers and tables live elsewhere (numpy
//! arrays handed over by the Python bindings, `python/src/kernels.rs`) would have to copy both
//! into those types on every step, and the table copy alone costs more than the matmul. These
//! functions read the same buffers through [`StackBuffers`] (slices) and the table through an
//! [`ArrayView2`], and write into caller-provided arrays.
//!
//! They run on the current rayon pool: the forward pass splits by (device, SparseCore), whose
//! activation rows are disjoint; the backward pass splits by shard, whose table rows are
//! disjoint, so no row is ever shared between threads and no locking is needed. The result is
//! bitwise the sequential one: each activation row, and each table row's gradient, is summed in
//! the slot order of the buffers (device, SparseCore, minibatch, slot), as the sequential
//! [`crate::row_gradients`] sums it.

use ndarray::{ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

use super::Optimizer;
use sparsecore_prep::spec::{Plan, StackPlan};
use sparsecore_prep::StackOutput;

use crate::error::{KernelError, PlanItem, Result, Subject};
use crate::segments::for_each_segment;

/// One stack's four buffers, borrowed: each `[L · RP]` or `[L · C]`, device-major, exactly as
/// [`StackOutput`] holds them (and the Python drop-in returns them).
#[derive(Debug, Clone, Copy)]
pub struct StackBuffers<'a> {
    /// The stack's name (a stack of the plan).
    pub stack: &'a str,
    /// `[L · RP]`.
    pub row_pointers: &'a [i32],
    /// `[L · C]`.
    pub embedding_ids: &'a [i32],
    /// `[L · C]`.
    pub sample_ids: &'a [i32],
    /// `[L · C]`.
    pub gains: &'a [f32],
}

impl<'a> From<&'a StackOutput> for StackBuffers<'a> {
    fn from(out: &'a StackOutput) -> Self {
        StackBuffers {
            stack: &out.name,
            row_pointers: &out.row_pointers,
            embedding_ids: &out.embedding_ids,
            sample_ids: &out.sample_ids,
            gains: &out.gains,
        }
    }
}

/// A run of slots of one (device, SparseCore, partition): `embedding_ids[lo..hi]` (absolute
/// indices into the `[L · C]` arrays) all address shard `partition`.
#[derive(Debug, Clone, Copy)]
struct Segment {
    device: usize,
    sc: usize,
    partition: usize,
    lo: usize,
    hi: usize,
}

/// What the loops need to know about one stack.
struct Geometry<'p> {
    sp: &'p StackPlan,
    /// Samples per SparseCore.
    bsps: usize,
    /// Samples per device (`S · bsps`).
    bsd: usize,
    /// Rows per shard.
    rows: usize,
    dim: usize,
    segments: Vec<Segment>,
}

/// Checks the buffers against the plan and walks the row pointers into segments, in buffer
/// order (device, SparseCore, minibatch, partition), as [`crate::sparse_dense_matmul`] reads
/// them; padding slots belong to no segment.
fn geometry<'p>(
    plan: &'p Plan,
    b: &StackBuffers<'_>,
    num_minibatches: usize,
    table_dim: (usize, usize),
) -> Result<Geometry<'p>> {
    let sp = plan
        .stack(b.stack)
        .ok_or_else(|| KernelError::plan(PlanItem::Stack, b.stack, "not in the plan"))?;
    let layout = plan.layout;
    let (n, s_count, l) = (
        layout.num_partitions(),
        layout.sc_per_device,
        layout.local_devices,
    );
    let rows = sp.stack_vocab_size as usize / n;
    let dim = sp.stack_embedding_dim as usize;
    if table_dim != (n * rows, dim) {
        return Err(KernelError::plan(
            PlanItem::Stack,
            &sp.name,
            format!("table of shape {table_dim:?}, expected [N · R, D] = [{}, {dim}] ({n} shards of {rows} rows)", n * rows),
        ));
    }
    let (rp_len, c) = (sp.row_pointers_per_device, sp.coo_buffer_size_per_device);
    if c == 0
        || b.row_pointers.len() != l * rp_len
        || [b.embedding_ids.len(), b.sample_ids.len(), b.gains.len()]
            .iter()
            .any(|&x| x != l * c)
    {
        return Err(KernelError::input(
            Subject::Stack(sp.name.clone()),
            format!(
                "buffers of {} row pointers and {}/{}/{} ids/samples/gains, expected {} and {} ({l} devices)",
                b.row_pointers.len(),
                b.embedding_ids.len(),
                b.sample_ids.len(),
                b.gains.len(),
                l * rp_len,
                l * c
            ),
        ));
    }
    let bsd = (sp.total_sample_count / layout.global_devices as u64) as usize;
    let bsps = bsd / s_count;
    let mut segments = Vec::with_capacity(l * s_count * n);
    for d in 0..l {
        for_each_segment(
            plan,
            num_minibatches,
            &b.row_pointers[d * rp_len..(d + 1) * rp_len],
            c,
            |sc, partition, start, end| {
                if start < end {
                    segments.push(Segment {
                        device: d,
                        sc,
                        partition,
                        lo: d * c + start,
                        hi: d * c + end,
                    });
                }
                Ok(())
            },
        )?;
    }
    Ok(Geometry {
        sp,
        bsps,
        bsd,
        rows,
        dim,
        segments,
    })
}

impl Geometry<'_> {
    /// The error for slot `i` of a segment whose id or sample is out of range.
    fn bad_slot(&self, b: &StackBuffers<'_>, s: &Segment, i: usize) -> KernelError {
        let c = self.sp.coo_buffer_size_per_device;
        let (e, smp) = (b.embedding_ids[i], b.sample_ids[i]);
        if e < 0 || e as usize >= self.rows {
            KernelError::input(
                Subject::Stack(self.sp.name.clone()),
                format!(
                    "embedding id {e} at device {} slot {} is outside the shard of {} rows",
                    s.device,
                    i - s.device * c,
                    self.rows
                ),
            )
        } else {
            KernelError::input(
                Subject::Stack(self.sp.name.clone()),
                format!(
                    "sample id {smp} at device {} slot {} is outside the {} samples",
                    s.device,
                    i - s.device * c,
                    self.bsps
                ),
            )
        }
    }
}

/// How many slots ahead the forward pass prefetches table rows.
const PREFETCH_SLOTS: usize = 16;

/// Hints the CPU to bring row `e` of `shard` (`dim` wide) into the cache. Only a hint: an id
/// outside the shard (caught when its slot is reached) prefetches nothing useful, and is never
/// read.
#[inline(always)]
fn prefetch_row(shard: &[f32], e: usize, dim: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let base = shard.as_ptr().wrapping_add(e.wrapping_mul(dim));
        let mut k = 0;
        while k < dim {
            // SAFETY: PREFETCHT0 is a hint that never faults and reads nothing into the program,
            // whatever the address; SSE, which it needs, is part of the x86_64 baseline.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    base.wrapping_add(k) as *const i8,
                )
            };
            k += 16; // one 64-byte cache line of f32s
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (shard, e, dim);
}

/// `y += a · x` elementwise. The common dims get a loop of known length, which the compiler
/// unrolls into whole vector operations with no remainder; the per-slot loop of both passes is
/// this call, and at dim 16 the loop overhead is a visible part of it. Same operations in the
/// same order for every dim, so the same bits.
#[inline(always)]
fn axpy(y: &mut [f32], x: &[f32], a: f32) {
    match y.len() {
        8 => axpy_n::<8>(y, x, a),
        16 => axpy_n::<16>(y, x, a),
        32 => axpy_n::<32>(y, x, a),
        64 => axpy_n::<64>(y, x, a),
        128 => axpy_n::<128>(y, x, a),
        _ => axpy_any(y, x, a),
    }
}

#[inline(always)]
fn axpy_n<const N: usize>(y: &mut [f32], x: &[f32], a: f32) {
    match (<&mut [f32; N]>::try_from(&mut *y), <&[f32; N]>::try_from(x)) {
        (Ok(y), Ok(x)) => {
            for j in 0..N {
                y[j] += a * x[j];
            }
        }
        _ => axpy_any(y, x, a),
    }
}

#[inline(always)]
fn axpy_any(y: &mut [f32], x: &[f32], a: f32) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn contiguous<'a>(what: &str, stack: &str, a: &'a ArrayView2<'_, f32>) -> Result<&'a [f32]> {
    a.as_slice().ok_or_else(|| {
        KernelError::input(
            Subject::Stack(stack.to_string()),
            format!("{what} must be a C-contiguous (row-major) array"),
        )
    })
}

/// The forward pass of one stack into `activations` (`[L · bsd, D]`, device-major, overwritten):
/// the same values as [`crate::sparse_dense_matmul`]'s per-device arrays, stacked.
///
/// `table` is the stack's `[N · R, D]` table ([`crate::StackedTable::data`]'s layout), row-major.
/// Errors name the stack: buffers or arrays of the wrong sizes, ids outside the shard, samples
/// outside the SparseCore's batch.
pub fn sparse_dense_matmul_into(
    plan: &Plan,
    buffers: &StackBuffers<'_>,
    num_minibatches: usize,
    table: ArrayView2<'_, f32>,
    mut activations: ArrayViewMut2<'_, f32>,
) -> Result<()> {
    let geo = geometry(plan, buffers, num_minibatches, table.dim())?;
    let (l, s_count, dim, bsps) = (
        plan.layout.local_devices,
        plan.layout.sc_per_device,
        geo.dim,
        geo.bsps,
    );
    if activations.dim() != (l * geo.bsd, dim) {
        return Err(KernelError::input(
            Subject::Stack(geo.sp.name.clone()),
            format!(
                "activations of shape {:?}, expected [L · bsd, D] = [{}, {dim}]",
                activations.dim(),
                l * geo.bsd
            ),
        ));
    }
    let t = contiguous("the table", &geo.sp.name, &table)?;
    let out = activations.as_slice_mut().ok_or_else(|| {
        KernelError::input(
            Subject::Stack(geo.sp.name.clone()),
            "activations must be C-contiguous",
        )
    })?;
    if dim == 0 || bsps == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let rows = geo.rows;
    // One chunk per (device, SparseCore): `bsps` activation rows that no other chunk writes.
    out.par_chunks_mut(bsps * dim)
        .enumerate()
        .try_for_each(|(unit, chunk)| {
            let (d, sc) = (unit / s_count, unit % s_count);
            // Zeroed here, by the thread that accumulates into it next.
            chunk.fill(0.0);
            for s in geo.segments.iter().filter(|s| s.device == d && s.sc == sc) {
                let shard = &t[s.partition * rows * dim..(s.partition + 1) * rows * dim];
                for i in s.lo..s.hi {
                    // The table rows are the random reads of this loop (ids are sorted within a
                    // partition, but sparse over a large table): ask for a row a few slots ahead,
                    // so that several misses are in flight instead of one.
                    if let Some(&ahead) = buffers
                        .embedding_ids
                        .get(i + PREFETCH_SLOTS)
                        .filter(|_| i + PREFETCH_SLOTS < s.hi)
                    {
                        prefetch_row(shard, ahead as usize, dim);
                    }
                    let (e, smp, gain) = (
                        buffers.embedding_ids[i],
                        buffers.sample_ids[i],
                        buffers.gains[i],
                    );
                    if e < 0 || e as usize >= rows || smp < 0 || smp as usize >= bsps {
                        return Err(geo.bad_slot(buffers, s, i));
                    }
                    let src = &shard[e as usize * dim..(e as usize + 1) * dim];
                    let dst = &mut chunk[smp as usize * dim..(smp as usize + 1) * dim];
                    axpy(dst, src, gain);
                }
            }
            Ok(())
        })
}

/// One referenced slot of a shard: the in-shard row, the activation-gradient row, the gain.
#[derive(Clone, Copy)]
struct Touch {
    row: u32,
    act_row: u32,
    gain: f32,
}

/// The backward pass and one optimizer step of one stack, in place, in parallel over shards:
/// the values [`crate::apply_gradients`] computes, followed by clipping the updated table rows
/// to `limits` (`(min, max)`, the reference's `embedding_var_limits`; ±∞ for none). Slots are
/// not clipped, as in the reference.
///
/// `activation_grads` is `[L · bsd, D]`, the layout [`sparse_dense_matmul_into`] writes;
/// `table` and every slot are `[N · R, D]`, row-major. Everything is checked before any row
/// changes: on error (non-finite hyper-parameters or limits, slots that are not the
/// optimizer's, arrays of the wrong shape, ids out of range) the table and slots are unchanged.
#[allow(clippy::too_many_arguments)]
pub fn apply_gradients_into(
    plan: &Plan,
    buffers: &StackBuffers<'_>,
    num_minibatches: usize,
    activation_grads: ArrayView2<'_, f32>,
    optimizer: &Optimizer,
    limits: (f32, f32),
    mut table: ArrayViewMut2<'_, f32>,
    slots: &mut [ArrayViewMut2<'_, f32>],
) -> Result<()> {
    optimizer.validate()?;
    let geo = geometry(plan, buffers, num_minibatches, table.dim())?;
    let stack = geo.sp.name.as_str();
    let (lo, hi) = limits;
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(KernelError::parameter(
            "embedding_var_limits",
            format!("({lo}, {hi})"),
            format!("stack `{stack}`: need min <= max, not NaN"),
        ));
    }
    let names = optimizer.slot_names();
    if slots.len() != names.len() || slots.iter().any(|s| s.dim() != table.dim()) {
        let got: Vec<_> = slots.iter().map(|s| s.dim()).collect();
        return Err(KernelError::plan(
            PlanItem::Stack,
            stack,
            format!(
                "the optimizer needs {} slot variables ({}) of the table's shape {:?}, got {} of shapes {got:?}",
                names.len(),
                if names.is_empty() { "none".to_string() } else { names.join(", ") },
                table.dim(),
                slots.len()
            ),
        ));
    }
    let (l, dim, rows) = (plan.layout.local_devices, geo.dim, geo.rows);
    if activation_grads.dim() != (l * geo.bsd, dim) {
        return Err(KernelError::input(
            Subject::Stack(stack.to_string()),
            format!("activation gradients of shape {:?}, expected the activations' [L · bsd, D] = [{}, {dim}]", activation_grads.dim(), l * geo.bsd),
        ));
    }
    let dact = contiguous("the activation gradients", stack, &activation_grads)?;
    let n = plan.layout.num_partitions();
    if dim == 0 || rows == 0 {
        return Ok(());
    }
    // Phase 1, read-only: every shard's touches, in buffer order; any bad slot fails the call
    // before a row changes.
    let touches: Vec<Vec<Touch>> = (0..n)
        .into_par_iter()
        .map(|p| {
            let mut v = Vec::new();
            for s in geo.segments.iter().filter(|s| s.partition == p) {
                for i in s.lo..s.hi {
                    let (e, smp) = (buffers.embedding_ids[i], buffers.sample_ids[i]);
                    if e < 0 || e as usize >= rows || smp < 0 || smp as usize >= geo.bsps {
                        return Err(geo.bad_slot(buffers, s, i));
                    }
                    let act_row = s.device * geo.bsd + s.sc * geo.bsps + smp as usize;
                    v.push(Touch {
                        row: e as u32,
                        act_row: act_row as u32,
                        gain: buffers.gains[i],
                    });
                }
            }
            // Stable: a row's touches stay in buffer order, so its gradient sums as the
            // sequential pass sums it.
            v.sort_by_key(|t| t.row);
            Ok(v)
        })
        .collect::<Result<_>>()?;
    // Phase 2: per shard, each touched row's gradient, then the optimizer step.
    let w = table.as_slice_mut().ok_or_else(|| {
        KernelError::input(
            Subject::Stack(stack.to_string()),
            "the table must be C-contiguous",
        )
    })?;
    let mut slot_slices = Vec::with_capacity(slots.len());
    for s in slots.iter_mut() {
        slot_slices.push(s.as_slice_mut().ok_or_else(|| {
            KernelError::input(
                Subject::Stack(stack.to_string()),
                "slot variables must be C-contiguous",
            )
        })?);
    }
    let shard_len = rows * dim;
    let mut slot_shards: Vec<Vec<&mut [f32]>> = (0..n)
        .map(|_| Vec::with_capacity(slot_slices.len()))
        .collect();
    for s in slot_slices {
        for (p, chunk) in s.chunks_mut(shard_len).enumerate() {
            slot_shards[p].push(chunk);
        }
    }
    w.par_chunks_mut(shard_len)
        .zip(slot_shards.into_par_iter())
        .zip(touches.into_par_iter())
        .for_each(|((w, mut slot_shard), touches)| {
            let mut g = vec![0f32; dim];
            let mut k = 0;
            while k < touches.len() {
                let row = touches[k].row as usize;
                g.fill(0.0);
                while k < touches.len() && touches[k].row as usize == row {
                    let t = touches[k];
                    let src = &dact[t.act_row as usize * dim..(t.act_row as usize + 1) * dim];
                    axpy(&mut g, src, t.gain);
                    k += 1;
                }
                let range = row * dim..(row + 1) * dim;
                let w_row = &mut w[range.clone()];
                // No optimizer has more than two slots (checked against `slot_names` above); a
                // match instead of a Vec spares an allocation per row.
                match slot_shard.as_mut_slice() {
                    [] => optimizer.apply(&g, w_row, &mut []),
                    [a] => optimizer.apply(&g, w_row, &mut [&mut a[range]]),
                    [a, b] => {
                        optimizer.apply(&g, w_row, &mut [&mut a[range.clone()], &mut b[range]])
                    }
                    more => {
                        let mut rows: Vec<&mut [f32]> =
                            more.iter_mut().map(|s| &mut s[range.clone()]).collect();
                        optimizer.apply(&g, w_row, &mut rows)
                    }
                }
                if lo > f32::NEG_INFINITY || hi < f32::INFINITY {
                    for x in w_row.iter_mut() {
                        *x = x.clamp(lo, hi);
                    }
                }
            }
        });
    Ok(())
}
