//! Minibatching (SPEC 5, Part 3): when some SparseCore would exceed a limit, the batch is split
//! into up to 64 minibatches by hashing columns into buckets, instead of dropping ids.
//!
//! Pass 1 (the ordinary pass, never dropping) has already run when [`finish`] is called: its
//! statistics are the ones reported and its merged entries sit in the tasks. If no SparseCore of
//! any stack exceeded a limit (agreed across hosts under key `2·batch`), the entries are written
//! as one minibatch (M = 1). Otherwise each SparseCore's entries are counted per (partition, bucket),
//! dropped per bucket if allowed, the split bits are OR-ed everywhere (key `2·batch + 1`), and
//! the buffers are written SparseCore-major, minibatch-minor, with absolute row pointers.

use std::sync::Arc;

use rayon::prelude::*;

use super::checks::check_limits;
use super::task::{for_each_stack, Schedule, Task};
use crate::allreduce::{AllReduce, LocalAllReduce};
use crate::error::Result;
use crate::fill::{fill_tail, Segment, SegmentWriter, TailFill};
use crate::group::bucket::{minibatch_ranges, BucketFn, BUCKETS};
use crate::group::{bucket_pass, EntrySink, Limits};
use crate::output::{Output, StackOutput};
use crate::spec::{Plan, StackPlan};

/// Minibatching settings of a preprocessor.
#[derive(Clone, Default)]
pub(super) struct Settings {
    pub all_reduce: Option<Arc<dyn AllReduce>>,
    pub bucket_fn: BucketFn,
    pub batch_number: u64,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("batch_number", &self.batch_number)
            .finish_non_exhaustive()
    }
}

/// Decides, buckets if needed, and fills. `out`'s stats already hold pass 1's.
pub(super) fn finish(
    plan: &Plan,
    batch_per_sc: &[usize],
    out: &mut Output,
    tasks: &mut [Vec<Task>],
    settings: &Settings,
    schedule: Schedule,
) -> Result<()> {
    let local = LocalAllReduce;
    let all_reduce: &dyn AllReduce = settings.all_reduce.as_deref().unwrap_or(&local);
    let key = settings.batch_number.wrapping_mul(2);

    // Pass 1: does any SparseCore of any stack exceed a limit?
    let required = plan.stacks.iter().zip(tasks.iter()).any(|(stack, st)| {
        st.iter().any(|t| {
            t.stats.max_ids().0 > stack.max_ids_per_partition
                || t.stats.max_unique().0 > stack.max_unique_ids_per_partition
        })
    });
    let required = all_reduce.all_reduce_or_bool(key, required)?;
    for so in &mut out.stacks {
        so.stats.dropped_id_count = 0;
    }
    if !required {
        out.num_minibatches = 1;
        for_each_stack(schedule, out, tasks, batch_per_sc, |_, so, st, bsps| {
            fill_one_minibatch(plan, so, st, bsps as u32)
        });
        return Ok(());
    }

    // Pass 2, per SparseCore: counters per (partition, bucket), drops, split bits.
    let nbits = plan.layout.partition_bits();
    let bucket = |(stack, st): (&StackPlan, &mut Vec<Task>)| {
        let limits = Limits {
            max_ids: stack.max_ids_per_partition,
            max_unique: stack.max_unique_ids_per_partition,
            drop: plan.allow_id_dropping,
        };
        let one = |t: &mut Task| {
            bucket_pass(
                &t.pass1,
                nbits,
                &settings.bucket_fn,
                limits,
                &mut t.bucketed,
            )
        };
        match schedule {
            Schedule::Parallel => st.par_iter_mut().for_each(one),
            Schedule::InOrder => st.iter_mut().for_each(one),
        }
    };
    match schedule {
        Schedule::Parallel => plan
            .stacks
            .par_iter()
            .zip(tasks.par_iter_mut())
            .for_each(bucket),
        Schedule::InOrder => plan.stacks.iter().zip(tasks.iter_mut()).for_each(bucket),
    }
    if !plan.allow_id_dropping {
        let s = plan.layout.sc_per_device;
        for (stack, st) in plan.stacks.iter().zip(tasks.iter()) {
            for (i, t) in st.iter().enumerate() {
                let ((ids, pi), (uniq, pu)) = t.bucketed.max_counts();
                check_limits(stack, (ids, i / s, i % s, pi), (uniq, i / s, i % s, pu))?;
            }
        }
    }
    let split = tasks
        .iter()
        .flatten()
        .fold(0u64, |acc, t| acc | t.bucketed.split);
    let split = all_reduce.all_reduce_or_u64(key.wrapping_add(1), split)?;
    let ranges = minibatch_ranges(split);
    out.num_minibatches = ranges.len();
    for_each_stack(schedule, out, tasks, batch_per_sc, |_, so, st, bsps| {
        fill_minibatches(plan, so, st, bsps as u32, &ranges)
    });
    Ok(())
}

/// One device's share of a stack's output: its row pointers, its three COO buffers, and the
/// tail extents of its SparseCore segments (see `Output`).
struct Device<'a> {
    rp: &'a mut [i32],
    emb: &'a mut [i32],
    smp: &'a mut [i32],
    gains: &'a mut [f32],
    tail_extents: &'a mut [u32],
    tail_fill: TailFill,
}

impl Device<'_> {
    /// Pads `[from, ..)` of the device's COO buffer (only up to where the last batch wrote: the
    /// rest holds the padding already) and sets its unwritten row pointers (from `rp_from`) to
    /// the final cursor, so that the output is a pure function of the input. Records `from` as
    /// the device's new tail extent.
    fn pad_tail(&mut self, rp_from: usize, from: usize) {
        // Minibatching fills the device buffer as one run from offset 0, so what the last batch
        // wrote ends at the furthest segment extent (a segment with extent 0 is all padding).
        let cs = self.emb.len() / self.tail_extents.len().max(1);
        let written = (self.tail_extents.iter().enumerate())
            .filter(|&(_, &e)| e > 0)
            .map(|(s, &e)| s * cs + e as usize)
            .max()
            .unwrap_or(0);
        if from < written {
            fill_tail(
                &mut self.emb[from..written],
                &mut self.smp[from..written],
                &mut self.gains[from..written],
                self.tail_fill,
            );
        }
        self.rp[rp_from..].fill(from as i32);
        for (s, e) in self.tail_extents.iter_mut().enumerate() {
            *e = from.saturating_sub(s * cs).min(cs) as u32;
        }
    }
}

/// Splits a stack's buffers per device.
fn per_device(so: &mut StackOutput) -> impl Iterator<Item = Device<'_>> {
    let rp = so.row_pointers_per_device();
    let c = so.coo_buffer_size_per_device();
    let s = so.tail_extents.len() / so.local_devices().max(1);
    let tail_fill = so.tail_fill;
    so.row_pointers
        .chunks_mut(rp)
        .zip(so.embedding_ids.chunks_mut(c))
        .zip(so.sample_ids.chunks_mut(c))
        .zip(so.gains.chunks_mut(c))
        .zip(so.tail_extents.chunks_mut(s.max(1)))
        .map(move |((((rp, emb), smp), gains), tail_extents)| Device {
            rp,
            emb,
            smp,
            gains,
            tail_extents,
            tail_fill,
        })
}

/// One minibatch (M = 1): SparseCore s starts at `min(Σ_{s'<s} required[s'], C)` (SPEC 5.7).
fn fill_one_minibatch(plan: &Plan, so: &mut StackOutput, tasks: &mut [Task], bsps: u32) {
    let layout = plan.layout;
    let (s_count, n, rpb) = (
        layout.sc_per_device,
        layout.num_partitions(),
        layout.row_pointers_per_segment(),
    );
    let c = so.coo_buffer_size_per_device();
    let mut dropped = 0u64;
    let StackOutput { stats, .. } = so;
    let required = std::mem::take(&mut stats.required_buffer_size_per_sc);
    for (d, mut device) in per_device(so).enumerate() {
        let Device {
            rp,
            emb,
            smp,
            gains,
            ..
        } = &mut device;
        let mut start = 0usize;
        for s in 0..s_count {
            let task = &tasks[d * s_count + s];
            let begin = start.min(c);
            let need = required[d * s_count + s].max(0) as usize;
            let end = (start + need).min(c);
            let seg = Segment {
                row_pointers: &mut rp[s * rpb..(s + 1) * rpb],
                embedding_ids: &mut emb[begin..end],
                sample_ids: &mut smp[begin..end],
                gains: &mut gains[begin..end],
            };
            let mut w = SegmentWriter::new(seg, n, bsps, (s as u32) * bsps).with_base(begin);
            for ce in &task.pass1 {
                w.push(ce.entry);
            }
            dropped += w.finish();
            start += need;
        }
        let end = start.min(c);
        device.pad_tail(s_count * rpb, end);
    }
    so.stats.required_buffer_size_per_sc = required;
    so.stats.dropped_id_count = dropped;
}

/// M > 1 minibatches: segments (s, m) SparseCore-major, minibatch-minor, filled one after
/// another from offset 0; each partition lists its buckets' entries in bucket order.
fn fill_minibatches(
    plan: &Plan,
    so: &mut StackOutput,
    tasks: &mut [Task],
    bsps: u32,
    ranges: &[(usize, usize)],
) {
    let layout = plan.layout;
    let (s_count, n, rpb) = (
        layout.sc_per_device,
        layout.num_partitions(),
        layout.row_pointers_per_segment(),
    );
    let m_count = ranges.len();
    let c = so.coo_buffer_size_per_device();
    let mut dropped: u64 = tasks.iter().map(|t| t.bucketed.dropped).sum();
    for (d, mut device) in per_device(so).enumerate() {
        let Device {
            rp,
            emb,
            smp,
            gains,
            ..
        } = &mut device;
        let mut cursor = 0usize;
        for s in 0..s_count {
            let b = &tasks[d * s_count + s].bucketed;
            for (m, &(lo, hi)) in ranges.iter().enumerate() {
                let k = s * m_count + m;
                let seg = Segment {
                    row_pointers: &mut rp[k * rpb..(k + 1) * rpb],
                    embedding_ids: &mut emb[cursor..c],
                    sample_ids: &mut smp[cursor..c],
                    gains: &mut gains[cursor..c],
                };
                let mut w = SegmentWriter::new(seg, n, bsps, (s as u32) * bsps)
                    .with_base(cursor)
                    .without_tail();
                for g in 0..n {
                    let (a, z) = (
                        b.starts[g * BUCKETS + lo] as usize,
                        b.starts[g * BUCKETS + hi] as usize,
                    );
                    for &e in &b.entries[a..z] {
                        w.push(e);
                    }
                }
                let (lost, end) = w.finish_at();
                dropped += lost;
                cursor += end;
            }
        }
        device.pad_tail(s_count * m_count * rpb, cursor.min(c));
    }
    so.stats.dropped_id_count = dropped;
}
