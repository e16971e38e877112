//! The tasks: one per (stack, local device, local SparseCore), each running extract → group →
//! fill into its own slice of the output, in parallel.

use rayon::prelude::*;

use super::workspace::{Workspace, Workspaces};
use crate::error::Error;
use crate::extract::{extract_sc, StackCtx};
use crate::fill::{Segment, SegmentWriter, TailFill};
use crate::group::{sort_and_walk, Bucketed, CountedEntry, Entry, EntrySink, Limits, ScStats};
use crate::input::SampleSource;
use crate::key::KeyFormat;
use crate::output::{Output, StackOutput};
use crate::spec::{Plan, StackPlan};

/// What one (stack, local SparseCore) task leaves for the merge.
#[derive(Debug, Default)]
pub(super) struct Task {
    /// Minibatching: the pass-1 entries, and the bucketed pass over them.
    pub pass1: Vec<CountedEntry>,
    pub bucketed: Bucketed,
    pub stats: ScStats,
    pub overflow: u64,
    pub error: Option<Error>,
}

/// A sink that keeps nothing (stats-only runs).
struct Discard;

impl EntrySink for Discard {
    #[inline(always)]
    fn push(&mut self, _: Entry) {}
    #[inline(always)]
    fn add_to_last(&mut self, _: f32) {}
}

/// How a batch's tasks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Schedule {
    /// As rayon tasks on the current pool.
    Parallel,
    /// One after another on the calling thread: with one worker, handing the batch to a pool
    /// thread and waking the caller afterwards cost more than a small batch's whole work.
    InOrder,
}

/// What a run produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Buffers and stats; exceeded limits are errors unless dropping is allowed.
    Buffers,
    /// Stats only.
    StatsOnly,
    /// Minibatching's first pass: stats, and the merged entries kept for a later fill.
    Pass1,
}

/// Runs every (stack, device, SparseCore) task; errors are parked in the tasks.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_stacks(
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    batch_per_sc: &[usize],
    out: &mut Output,
    tasks: &mut [Vec<Task>],
    workspaces: &Workspaces,
    mode: Mode,
    schedule: Schedule,
) {
    for_each_stack(
        schedule,
        out,
        tasks,
        batch_per_sc,
        |i, so, stack_tasks, bsps| {
            run_stack(
                plan,
                inputs,
                workspaces,
                mode,
                schedule,
                so,
                stack_tasks,
                &plan.stacks[i],
                bsps,
            )
        },
    );
}

/// Calls `f(stack index, its output, its tasks, its stacked batch per SparseCore)` for every
/// stack, by `schedule`: the one walk over stacks that the tasks and minibatching's fills share.
pub(super) fn for_each_stack(
    schedule: Schedule,
    out: &mut Output,
    tasks: &mut [Vec<Task>],
    batch_per_sc: &[usize],
    f: impl Fn(usize, &mut StackOutput, &mut [Task], usize) + Sync + Send,
) {
    let each = |(i, ((so, st), &bsps)): (usize, ((&mut StackOutput, &mut Vec<Task>), &usize))| {
        f(i, so, st, bsps)
    };
    match schedule {
        Schedule::Parallel => out
            .stacks
            .par_iter_mut()
            .zip(tasks.par_iter_mut())
            .zip(batch_per_sc.par_iter())
            .enumerate()
            .for_each(each),
        Schedule::InOrder => out
            .stacks
            .iter_mut()
            .zip(tasks.iter_mut())
            .zip(batch_per_sc)
            .enumerate()
            .for_each(each),
    }
}

/// Each SparseCore's slice of a stack's four buffers (`rpb` row pointers, `cs` COO slots) and
/// its tail extent beside its task, by `$chunks` (`chunks_mut` or rayon's `par_chunks_mut`) and
/// `$iter` (`iter_mut` or `par_iter_mut`): one chain for every schedule.
macro_rules! segments {
    ($so:expr, $tasks:expr, $rpb:expr, $cs:expr, $chunks:ident, $iter:ident) => {
        $so.row_pointers
            .$chunks($rpb)
            .zip($so.embedding_ids.$chunks($cs))
            .zip($so.sample_ids.$chunks($cs))
            .zip($so.gains.$chunks($cs))
            .zip($so.tail_extents.$iter())
            .zip($tasks.$iter())
            .enumerate()
    };
}

/// One SparseCore's slices of a stack's buffers (row pointers, embedding ids, sample ids, gains)
/// and its tail extent,
/// zipped with its task.
type SegmentParts<'a> = (
    (
        (
            ((&'a mut [i32], &'a mut [i32]), &'a mut [i32]),
            &'a mut [f32],
        ),
        &'a mut u32,
    ),
    &'a mut Task,
);

/// A SparseCore's [`SegmentParts`] as the destination its task writes, and the task.
fn segment_destination(
    parts: SegmentParts<'_>,
    tail_fill: TailFill,
) -> (Destination<'_>, &mut Task) {
    let (((((row_pointers, embedding_ids), sample_ids), gains), tail_extent), task) = parts;
    let seg = Segment {
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
    };
    (Destination::Segment(seg, tail_extent, tail_fill), task)
}

/// Runs one stack's tasks, one per local SparseCore.
#[allow(clippy::too_many_arguments)]
fn run_stack(
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    workspaces: &Workspaces,
    mode: Mode,
    schedule: Schedule,
    so: &mut StackOutput,
    stack_tasks: &mut [Task],
    stack: &StackPlan,
    bsps: usize,
) {
    let layout = plan.layout;
    let rpb = layout.row_pointers_per_segment();
    let cs = stack.coo_buffer_size_per_sc(&layout);
    let (ctx, limits) = stack_setup(plan, inputs, stack, bsps);
    let job = StackJob {
        plan,
        stack,
        ctx: &ctx,
        limits,
        inputs,
        workspaces,
    };
    let s = layout.sc_per_device;
    let so_tail_fill = so.tail_fill;
    let into_segment = |(i, parts): (usize, SegmentParts<'_>)| {
        let (destination, task) = segment_destination(parts, so_tail_fill);
        run_task(&job, i / s, i % s, destination, task);
    };
    let elsewhere = |(i, task): (usize, &mut Task)| {
        let destination = if mode == Mode::StatsOnly {
            Destination::Stats
        } else {
            Destination::Entries
        };
        run_task(&job, i / s, i % s, destination, task);
    };
    match (mode, schedule) {
        (Mode::Buffers, Schedule::Parallel) => {
            segments!(so, stack_tasks, rpb, cs, par_chunks_mut, par_iter_mut).for_each(into_segment)
        }
        (Mode::Buffers, Schedule::InOrder) => {
            segments!(so, stack_tasks, rpb, cs, chunks_mut, iter_mut).for_each(into_segment)
        }
        (Mode::StatsOnly | Mode::Pass1, Schedule::Parallel) => {
            stack_tasks.par_iter_mut().enumerate().for_each(elsewhere)
        }
        (Mode::StatsOnly | Mode::Pass1, Schedule::InOrder) => {
            stack_tasks.iter_mut().enumerate().for_each(elsewhere)
        }
    }
}

/// A stack's extraction context and limits, the same for each of its tasks.
fn stack_setup<'a>(
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    stack: &'a StackPlan,
    bsps: usize,
) -> (StackCtx<'a>, Limits) {
    let layout = plan.layout;
    let weighted = stack.features.iter().any(|&f| inputs[f].has_weights());
    let ctx = StackCtx {
        name: &stack.name,
        layout,
        combiner: stack.combiner,
        weighted,
        validate_ids: plan.validate_ids,
        batch_per_sc: bsps,
        local_bits: KeyFormat::local_bits_for(
            layout.partition_bits(),
            stack.stack_vocab_size,
            plan.validate_ids,
        ),
    };
    let limits = Limits {
        max_ids: stack.max_ids_per_partition,
        max_unique: stack.max_unique_ids_per_partition,
        // Pass 1 of minibatching never drops (SPEC 5.4); only its bucketed pass may.
        drop: plan.allow_id_dropping && !plan.enable_minibatching,
    };
    (ctx, limits)
}

/// One (stack, local SparseCore) task of a helped run: where it writes, and its record.
type HelpedTask<'a> = (usize, usize, Destination<'a>, &'a mut Task);

/// [`run_stacks`] for [`Mode::Buffers`] and [`Mode::StatsOnly`] with the tasks of every stack in
/// one list, run by the calling thread and up to `helpers` of `pool`'s threads as they come
/// (see [`crate::parallel`]). Each task still writes only its own segment and record, so the
/// bytes are those of any other schedule. The list is built per batch (callers of this
/// schedule, the Python package, allocate their results per batch anyway).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_stacks_helped(
    pool: &rayon::ThreadPool,
    helpers: usize,
    plan: &Plan,
    inputs: &[&dyn SampleSource],
    batch_per_sc: &[usize],
    out: &mut Output,
    tasks: &mut [Vec<Task>],
    workspaces: &Workspaces,
    mode: Mode,
) {
    debug_assert!(
        mode != Mode::Pass1,
        "minibatching's pass 1 runs on the pool"
    );
    let layout = plan.layout;
    let s = layout.sc_per_device;
    let rpb = layout.row_pointers_per_segment();
    let setups: Vec<(StackCtx<'_>, Limits)> = plan
        .stacks
        .iter()
        .zip(batch_per_sc)
        .map(|(stack, &bsps)| stack_setup(plan, inputs, stack, bsps))
        .collect();
    let mut list: Vec<std::sync::Mutex<Option<HelpedTask<'_>>>> = Vec::new();
    for (i, (so, stack_tasks)) in out.stacks.iter_mut().zip(tasks.iter_mut()).enumerate() {
        if mode == Mode::StatsOnly {
            list.extend(
                stack_tasks
                    .iter_mut()
                    .enumerate()
                    .map(|(j, task)| std::sync::Mutex::new(Some((i, j, Destination::Stats, task)))),
            );
            continue;
        }
        let cs = plan.stacks[i].coo_buffer_size_per_sc(&layout);
        let tail_fill = so.tail_fill;
        list.extend(
            segments!(so, stack_tasks, rpb, cs, chunks_mut, iter_mut).map(|(j, parts)| {
                let (destination, task) = segment_destination(parts, tail_fill);
                std::sync::Mutex::new(Some((i, j, destination, task)))
            }),
        );
    }
    crate::parallel::run_helped(pool, helpers, list.len(), &|k| {
        let taken = list[k].lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((i, j, destination, task)) = taken else {
            return;
        };
        let (ctx, limits) = &setups[i];
        let job = StackJob {
            plan,
            stack: &plan.stacks[i],
            ctx,
            limits: *limits,
            inputs,
            workspaces,
        };
        run_task(&job, j / s, j % s, destination, task);
    });
}

/// What every task of one stack shares.
struct StackJob<'a> {
    plan: &'a Plan,
    stack: &'a StackPlan,
    ctx: &'a StackCtx<'a>,
    limits: Limits,
    inputs: &'a [&'a dyn SampleSource],
    workspaces: &'a Workspaces,
}

/// Where a task's grouped entries go.
enum Destination<'a> {
    /// Straight into the SparseCore's segment of the output buffers: no intermediate list. The
    /// segment's tail extent (see `Output`) is read before and updated after the write.
    Segment(Segment<'a>, &'a mut u32, TailFill),
    /// Into the task's entry list, for the fill that follows minibatching's first pass.
    Entries,
    /// Nowhere: only the statistics are kept.
    Stats,
}

/// Runs the task of SparseCore `sc` of local device `device`.
fn run_task(
    job: &StackJob<'_>,
    device: usize,
    sc: usize,
    destination: Destination<'_>,
    task: &mut Task,
) {
    task.error = None;
    task.overflow = 0;
    let StackJob {
        plan,
        stack,
        ctx,
        limits,
        inputs,
        workspaces,
    } = *job;
    // Our own code never calls back into rayon inside a task, but a user's
    // `SampleSource::view` may (a lazily decoded source, say): while it waits, rayon can run
    // another task on this thread, which then finds the workspace locked and takes a temporary
    // one instead (see `Workspaces::with`).
    workspaces.with(|ws| {
        let Workspace {
            extracted: ex,
            extract_scratch,
            sort_scratch,
        } = ws;
        if let Err(e) = extract_sc(
            ctx,
            &plan.features,
            &stack.features,
            inputs,
            device,
            sc,
            ex,
            extract_scratch,
        ) {
            task.error = Some(e);
            return;
        }
        match destination {
            Destination::Segment(seg, tail_extent, tail_fill) => {
                let writer = SegmentWriter::new(
                    seg,
                    plan.layout.num_partitions(),
                    ctx.batch_per_sc as u32,
                    ex.first_row,
                )
                .with_row_span(ex.row_span)
                .with_tail(*tail_extent as usize, tail_fill);
                let (overflow, cursor) =
                    sort_and_walk(ex, sort_scratch, limits, writer, &mut task.stats).finish_at();
                task.overflow = overflow;
                *tail_extent = cursor as u32;
            }
            Destination::Entries => {
                let mut kept = std::mem::take(&mut task.pass1);
                kept.clear();
                task.pass1 = sort_and_walk(ex, sort_scratch, limits, kept, &mut task.stats);
            }
            Destination::Stats => {
                sort_and_walk(ex, sort_scratch, limits, Discard, &mut task.stats);
            }
        }
    });
}
