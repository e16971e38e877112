//! The swap pass after the greedy placement (see [`improve`]), and [`Refinement`], how far the
//! search goes.

use super::samples::SampleCounts;

/// How far balancing searches once the worst cell is as low as it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Refinement {
    /// The worst cell (relative to its stack's limit), then the worst buffer. The stacks that
    /// do not hold the worst cell stay about where the greedy placed them.
    #[default]
    WorstCell,
    /// Then also every stack's own worst cell, from the stack nearest its limit, with no
    /// stack's buffer rising: each stack's tuned `max_ids_per_partition` and buffer fall
    /// further, and the worst cell comes nearer its lower bound where stacks compete for the
    /// same samples (criteo-like data), for more balancing work (BENCHMARKS.md measures both).
    EveryStack,
    /// Everything [`Refinement::EveryStack`] does, then each stack's worst
    /// `max_unique_ids_per_partition` cell, with no stack's `max_ids` cell passing its worst
    /// (or its 8-aligned value, what a tuned limit is rounded to) and no buffer its worst.
    /// Unique ids depend on which samples share a slice, so this pass reads the columns of the
    /// slices it needs, within a budget of reads and checks proportional to the window: the
    /// costliest refinement (BENCHMARKS.md measures it).
    UniqueIds,
}

/// Pair checks [`improve`] may spend per sample of the window on the worst cell, then on each
/// stack's own worst cell (a stack round also pays one per member whose share it works out),
/// and then on the worst buffer. The caps bound a window's cost by a fixed multiple of its
/// samples; BENCHMARKS.md has what larger ones gain and cost.
const SWAPS_CHECKED_PER_SAMPLE: usize = 8;
const STACK_SWAPS_CHECKED_PER_SAMPLE: usize = 8;
/// Other slices a stack round tries, those with the most room in its cell first.
const STACK_SLICES_TRIED: usize = 3;
const BUFFER_SWAPS_CHECKED_PER_SAMPLE: usize = 4;

/// What a round of [`improve`] lowers.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The worst cell: ids / the stack's `max_ids_per_partition`.
    Peak,
    /// The worst (slice, stack) buffer: S × Σ over partitions of ids rounded up to 8 / the
    /// stack's buffer per device, with no cell above `peak` (the first objective's result).
    Buffer { peak: f64 },
    /// One stack's worst cell, with every cell held at its `caps` and every stack's buffer at
    /// its `buffer_caps`.
    Stack { stack: usize },
}

/// Lowers the greedy's result by swapping samples between slices, first its worst cell, then
/// its worst buffer. While the worst value can be brought below itself by swapping one of its
/// slice's samples with one of another slice, such that no cell or buffer the swap touches
/// reaches that value (and, for the buffer, no cell passes the peak reached first), swap. The
/// greedy places each sample once, so a sample placed early can end up beside the samples that
/// fill its slice last; a swap undoes that. Values tied at the worst are fixed one at a time, so
/// the worst falls once all of them are. With [`Refinement::EveryStack`] (or
/// [`Refinement::UniqueIds`]), then each stack's own worst cell ([`every_stack`]). Deterministic (fixed visiting orders); the checks are capped
/// per sample, so a window costs at most a fixed multiple of its samples.
pub(super) fn improve(
    counts: &SampleCounts,
    members: &mut [Vec<usize>],
    load: &mut [u32],
    cells: usize,
    weights: &Weights<'_>,
    refinement: Refinement,
    memory: &mut SwapMemory,
) {
    let members_len = members.len();
    // Every row a round reads is filled first (`ready`), so the memory need not be cleared.
    let mut bounds = std::mem::take(&mut memory.bounds);
    bounds.resize(counts.refs.len() * (weights.inv_buffer.len() + 1), 0);
    let mut swaps = Swaps {
        counts,
        members,
        load,
        cells,
        w: weights,
        delta: vec![0i64; cells],
        marked: Vec::new(),
        mark: vec![false; cells],
        sums: Vec::new(),
        changed: Vec::new(),
        stacks: weights.inv_buffer.len(),
        bounds,
        ready: vec![false; members_len],
        budget: SWAPS_CHECKED_PER_SAMPLE * counts.refs.len(),
        scratch: std::mem::take(&mut memory.scratch),
        slice_worst: Vec::new(),
        caps: Vec::new(),
        buffer_caps: Vec::new(),
        stack_max: Vec::new(),
    };
    while swaps.round(Target::Peak) {}
    let peak = swaps.worst_cell().0;
    swaps.budget = BUFFER_SWAPS_CHECKED_PER_SAMPLE * counts.refs.len();
    let p = weights.partitions;
    swaps.sums = swaps
        .load
        .chunks(p)
        .map(|part| part.iter().map(|&k| padded(k as i64)).sum())
        .collect();
    while swaps.round(Target::Buffer { peak }) {}
    if refinement != Refinement::WorstCell {
        every_stack(&mut swaps, weights, counts.refs.len());
    }
    memory.bounds = swaps.bounds;
    memory.scratch = swaps.scratch;
}

/// [`Refinement::EveryStack`]'s rounds, after the worst cell and the worst buffer.
fn every_stack(swaps: &mut Swaps<'_>, weights: &Weights<'_>, samples: usize) {
    let (cells, p) = (swaps.cells, weights.partitions);
    // Then every stack's own worst cell: each stack's limit is tuned from its own worst cell,
    // and the first objective leaves every stack but the one at the peak wherever the greedy
    // put it. The stack nearest its limit among those not yet settled is lowered while a swap
    // can, with the settled stacks held at their worst and the others at its level (relative
    // to their limits), then settled: each step lowers the sorted levels lexicographically.
    // Every stack's buffer is held at its worst, so no tuned buffer rises.
    let stacks = weights.inv_buffer.len();
    let limits: Vec<f64> = (0..stacks)
        .map(|st| (1.0 / weights.inv_limit[st * p]).round())
        .collect();
    swaps.buffer_caps = (0..stacks)
        .map(|st| {
            swaps
                .sums
                .iter()
                .skip(st)
                .step_by(stacks.max(1))
                .copied()
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut settled = vec![false; stacks];
    let mut worst = vec![0u32; stacks];
    swaps.caps.resize(cells, 0);
    swaps.keep_stack_max();
    swaps.budget = STACK_SWAPS_CHECKED_PER_SAMPLE * samples;
    loop {
        for (st, w) in worst.iter_mut().enumerate() {
            *w = swaps.stack_worst(st).0;
        }
        let next = (0..stacks)
            .filter(|&st| !settled[st])
            .map(|st| (worst[st] as f64 / limits[st], st))
            .min_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        let Some((level, stack)) = next else { break };
        for st in 0..stacks {
            let cap = if st == stack {
                worst[st].saturating_sub(1)
            } else if settled[st] {
                worst[st]
            } else {
                worst[st].max((level * limits[st] + 1e-9).floor() as u32)
            };
            swaps.caps[st * p..(st + 1) * p].fill(cap);
        }
        if !swaps.round(Target::Stack { stack }) {
            settled[stack] = true;
        }
    }
}

/// What [`improve`] keeps from window to window for its memory.
#[derive(Debug, Default)]
pub(super) struct SwapMemory {
    bounds: Vec<usize>,
    scratch: RoundScratch,
}

/// Where sample `i`'s stacks start in `counts.cells` (see [`Swaps::bounds`]), into `row` (one
/// per stack and one past the last): one pass over its entries, where finding a stack by
/// bisection on every look-up cost several times that (a round looks up hundreds of samples,
/// and a checked swap both samples' stacks).
fn sample_bounds(counts: &SampleCounts, i: usize, partitions: usize, row: &mut [usize]) {
    // Partitions are a power of two (the layout's SparseCores).
    let shift = partitions.trailing_zeros().min(63);
    let (from, to) = (counts.start[i], counts.start[i + 1]);
    // First each stack's end where the sample has entries in it (`row[stack + 1]`, from its
    // last entry), then every other bound from the one before it: a stack without entries
    // starts and ends where the one before it ends.
    row.fill(from);
    for (k, &(c, _)) in counts
        .cells
        .get(from..to)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        if let Some(end) = row.get_mut((c as u64 >> shift) as usize + 1) {
            *end = from + k + 1;
        }
    }
    let mut bound = from;
    for b in row.iter_mut() {
        bound = bound.max(*b);
        *b = bound;
    }
}

/// Per cell, 1 / the stack's `max_ids_per_partition`; per stack, S / its buffer per device.
pub(super) struct Weights<'a> {
    pub(super) inv_limit: &'a [f64],
    pub(super) inv_buffer: &'a [f64],
    pub(super) partitions: usize,
}

/// The state [`improve`] swaps in.
struct Swaps<'a> {
    counts: &'a SampleCounts,
    members: &'a mut [Vec<usize>],
    load: &'a mut [u32],
    cells: usize,
    w: &'a Weights<'a>,
    /// Per cell: a swap's change to slice A (b in, a out), cleared after each check.
    delta: Vec<i64>,
    /// The cells `delta` holds, listed and flagged.
    marked: Vec<usize>,
    mark: Vec<bool>,
    /// Per (slice, stack): Σ over partitions of ids rounded up to 8 (kept from the buffer
    /// rounds on).
    sums: Vec<i64>,
    /// Per stack a checked swap touches (buffer rounds): its padded sum's change in A and in B.
    changed: Vec<(usize, i64, i64)>,
    stacks: usize,
    /// Sample i's entries of stack st are `counts.cells[bounds[i * (stacks + 1) + st]..bounds[i * (stacks + 1) + st + 1]]`,
    /// filled for the members of a slice when a round first looks at it (`ready`): a window
    /// whose rounds look at few slices fills few. Swaps trade samples between ready slices, so
    /// every member of a ready slice has its bounds.
    bounds: Vec<usize>,
    ready: Vec<bool>,
    budget: usize,
    scratch: RoundScratch,
    /// Per slice, its worst cell (see [`Swaps::worst_cell`]); empty until first asked.
    slice_worst: Vec<(f64, usize)>,
    /// Per cell, the most ids a stack round may leave in it in any slice: its stack's worst
    /// cell, one less for the stack it lowers, or that stack's level for stacks not yet settled.
    caps: Vec<u32>,
    /// Per stack, the largest padded sum a stack round may leave in any slice.
    buffer_caps: Vec<i64>,
    /// Per (slice, stack), its worst cell's ids (from the second objective on).
    stack_max: Vec<u32>,
}

/// A round's lists, kept from round to round for their memory.
#[derive(Debug, Default)]
struct RoundScratch {
    outgoing: Vec<(u32, usize)>,
    others: Vec<(f64, usize)>,
    shares: Vec<Vec<u32>>,
}

/// A count rounded up to the alignment buffers are padded to.
fn padded(ids: i64) -> i64 {
    (ids + 7).div_euclid(8) * 8
}

impl Swaps<'_> {
    /// The worst cell: (ids / limit, slice, cell), first in (slice, cell) order. Each slice's
    /// worst cell is kept (`slice_worst`) and redone only for the two slices of a swap: a
    /// round's full scan cost more than its checks on windows of many slices.
    fn worst_cell(&mut self) -> (f64, usize, usize) {
        let slices = self.load.len() / self.cells.max(1);
        if self.slice_worst.len() != slices {
            let all = (0..slices).map(|s| self.slice_worst_of(s)).collect();
            self.slice_worst = all;
        }
        let mut worst = (0f64, 0, 0);
        for (s, &(v, c)) in self.slice_worst.iter().enumerate() {
            if v > worst.0 {
                worst = (v, s, c);
            }
        }
        worst
    }

    /// A slice's worst cell: (ids / limit, cell), first in cell order.
    fn slice_worst_of(&self, s: usize) -> (f64, usize) {
        let mut worst = (0f64, 0);
        if let Some(row) = self.load.get(s * self.cells..(s + 1) * self.cells) {
            for (c, (&n, &inv)) in row.iter().zip(self.w.inv_limit).enumerate() {
                let v = n as f64 * inv;
                if v > worst.0 {
                    worst = (v, c);
                }
            }
        }
        worst
    }

    /// A stack's worst cell: (ids, slice, cell), first in (slice, cell) order, from the kept
    /// worst of every (slice, stack) (`stack_max`, filled by [`Self::keep_stack_max`]).
    fn stack_worst(&self, stack: usize) -> (u32, usize, usize) {
        let p = self.w.partitions;
        let mut worst = (0, 0);
        for (s, row) in self.stack_max.chunks_exact(self.stacks.max(1)).enumerate() {
            if let Some(&n) = row.get(stack).filter(|&&n| n > worst.0) {
                worst = (n, s);
            }
        }
        let (ids, slice) = worst;
        let cells = self
            .load
            .get(slice * self.cells + stack * p..slice * self.cells + (stack + 1) * p)
            .unwrap_or_default();
        (
            ids,
            slice,
            stack * p + cells.iter().position(|&n| n == ids).unwrap_or(0),
        )
    }

    /// Fills `stack_max` for every slice; [`Self::swapped`] keeps it from then on.
    fn keep_stack_max(&mut self) {
        let slices = self.load.len() / self.cells.max(1);
        self.stack_max.resize(slices * self.stacks, 0);
        for s in 0..slices {
            self.refresh_stack_max(s);
        }
    }

    fn refresh_stack_max(&mut self, s: usize) {
        let p = self.w.partitions.max(1);
        let (Some(row), Some(out)) = (
            self.load.get(s * self.cells..(s + 1) * self.cells),
            self.stack_max
                .get_mut(s * self.stacks..(s + 1) * self.stacks),
        ) else {
            return;
        };
        for (o, part) in out.iter_mut().zip(row.chunks_exact(p)) {
            *o = part.iter().copied().max().unwrap_or(0);
        }
    }

    /// Redoes the kept worst cells of two slices whose loads changed.
    fn swapped(&mut self, a_slice: usize, b_slice: usize) {
        for s in [a_slice, b_slice] {
            let worst = self.slice_worst_of(s);
            if let Some(w) = self.slice_worst.get_mut(s) {
                *w = worst;
            }
            if !self.stack_max.is_empty() {
                self.refresh_stack_max(s);
            }
        }
    }

    /// S × Σ over the stack's partitions of `slice`'s ids rounded up to 8 (plus `change`), /
    /// the stack's buffer.
    fn buffer(&self, slice: usize, stack: usize, change: i64) -> f64 {
        let stacks = self.w.inv_buffer.len();
        (self.sums[slice * stacks + stack] + change) as f64 * self.w.inv_buffer[stack]
    }

    /// The worst buffer: (value, slice, stack), first in (slice, stack) order.
    fn worst_buffer(&self) -> (f64, usize, usize) {
        let mut worst = (0f64, 0, 0);
        for s in 0..self.members.len() {
            for st in 0..self.w.inv_buffer.len() {
                let v = self.buffer(s, st, 0);
                if v > worst.0 {
                    worst = (v, s, st);
                }
            }
        }
        worst
    }

    /// A sample's ids in what the target measures: its cell, or its stack's cells (found by
    /// bisection, as a sample holds tens of entries and a round asks for hundreds of samples).
    #[inline(always)]
    fn share(&self, i: usize, target: Target, key: usize) -> u32 {
        let p = self.w.partitions;
        let stack = match target {
            Target::Peak | Target::Stack { .. } => key / p,
            Target::Buffer { .. } => key,
        };
        let entries = &self.counts.cells[self.stack_entries(i, stack)];
        match target {
            Target::Peak | Target::Stack { .. } => entries
                .iter()
                .filter(|&&(c, _)| c as usize == key)
                .map(|x| x.1)
                .sum(),
            Target::Buffer { .. } => entries.iter().map(|x| x.1).sum(),
        }
    }

    /// One swap that lowers the worst value of `target`; false when none does (or the budget
    /// is spent).
    fn round(&mut self, target: Target) -> bool {
        let mut scratch = std::mem::take(&mut self.scratch);
        let swapped = self.round_in(target, &mut scratch);
        self.scratch = scratch;
        swapped
    }

    fn round_in(&mut self, target: Target, scratch: &mut RoundScratch) -> bool {
        let (top, a_slice, key) = match target {
            Target::Peak => self.worst_cell(),
            Target::Stack { stack } => {
                let (ids, slice, cell) = self.stack_worst(stack);
                (ids as f64 * self.w.inv_limit[cell], slice, cell)
            }
            Target::Buffer { .. } => self.worst_buffer(),
        };
        if top == 0.0 || self.budget == 0 {
            return false;
        }
        let nslices = self.members.len();
        // A stack round also pays for the members' shares it works out: most of its rounds
        // each lower one of many cells tied at the worst by one id, so rounds, not checks, are
        // what a window of many slices spends.
        let charged = matches!(target, Target::Stack { .. });
        if charged {
            let Some(left) = self.budget.checked_sub(self.members[a_slice].len()) else {
                return false;
            };
            self.budget = left;
        }
        self.make_ready(a_slice);
        // Samples of A by their share of the key, largest first.
        let outgoing = &mut scratch.outgoing;
        outgoing.clear();
        outgoing.extend(
            (0..self.members[a_slice].len())
                .map(|k| (self.share(self.members[a_slice][k], target, key), k))
                .filter(|x| x.0 > 0),
        );
        outgoing.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        // Other slices, least loaded in the key first.
        let level = |sw: &Self, s: usize| match target {
            Target::Peak | Target::Stack { .. } => {
                sw.load[s * sw.cells + key] as f64 * sw.w.inv_limit[key]
            }
            Target::Buffer { .. } => sw.buffer(s, key, 0),
        };
        let others = &mut scratch.others;
        others.clear();
        others.extend(
            (0..nslices)
                .filter(|&s| s != a_slice)
                .map(|s| (level(self, s), s)),
        );
        others.sort_unstable_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        // Each other slice's members' shares of the key, worked out when first visited.
        let shares = &mut scratch.shares;
        shares.resize_with(nslices, Vec::new);
        shares.iter_mut().for_each(Vec::clear);
        for &(out_share, ka) in outgoing.iter() {
            // A stack round tries only the few slices with the most room in its cell: with the
            // other stacks held loosely, the first of them nearly always take a swap, and every
            // slice visited costs its members' shares.
            let visited = match target {
                Target::Stack { .. } => STACK_SLICES_TRIED,
                _ => usize::MAX,
            };
            for &(b_level, b_slice) in others.iter().take(visited) {
                // B's key gains (the sample it gives up has less of it); the slices come least
                // loaded first, so no later one can take it either.
                let floor = match target {
                    Target::Peak | Target::Stack { .. } => {
                        (self.load[b_slice * self.cells + key] + 1) as f64 * self.w.inv_limit[key]
                    }
                    Target::Buffer { .. } => b_level,
                };
                if floor >= top {
                    break;
                }
                if shares[b_slice].is_empty() {
                    if charged {
                        let Some(left) = self.budget.checked_sub(self.members[b_slice].len())
                        else {
                            return false;
                        };
                        self.budget = left;
                    }
                    self.make_ready(b_slice);
                    let members = &self.members[b_slice];
                    shares[b_slice].extend(members.iter().map(|&b| self.share(b, target, key)));
                }
                for (kb, &share) in shares[b_slice].iter().enumerate() {
                    if self.budget == 0 {
                        return false;
                    }
                    self.budget -= 1;
                    if share >= out_share {
                        continue;
                    }
                    if self.try_swap(a_slice, ka, b_slice, kb, top, target, key) {
                        self.swapped(a_slice, b_slice);
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Entries `range` of `counts.cells` (one sample's) into `delta` with `sign`, listing their
    /// cells in `marked`.
    #[inline(always)]
    fn add_entries(&mut self, range: std::ops::Range<usize>, sign: i64) {
        for k in range {
            let (x, n) = self.counts.cells[k];
            let x = x as usize;
            if !self.mark[x] {
                self.mark[x] = true;
                self.marked.push(x);
            }
            self.delta[x] += sign * n as i64;
        }
    }

    /// Fills the stack bounds of `slice`'s members, once.
    fn make_ready(&mut self, slice: usize) {
        if std::mem::replace(&mut self.ready[slice], true) {
            return;
        }
        let width = self.stacks + 1;
        for &i in self.members[slice].iter() {
            sample_bounds(
                self.counts,
                i,
                self.w.partitions,
                &mut self.bounds[i * width..(i + 1) * width],
            );
        }
    }

    /// Where sample `i`'s entries of `stack` lie in `counts.cells`.
    #[inline(always)]
    fn stack_entries(&self, i: usize, stack: usize) -> std::ops::Range<usize> {
        let row = &self.bounds[i * (self.stacks + 1)..][..self.stacks + 1];
        row[stack]..row[stack + 1]
    }

    /// Swaps sample `ka` of A with `kb` of B if every cell (and, for the buffer, every stack)
    /// the two touch stays below `top` in both slices; `key` is the round's cell or stack.
    /// Checked stack by stack, the key's first: most candidates fail early, and a failed check
    /// then costs a few of the samples' entries instead of all of both.
    #[allow(clippy::too_many_arguments)]
    fn try_swap(
        &mut self,
        a_slice: usize,
        ka: usize,
        b_slice: usize,
        kb: usize,
        top: f64,
        target: Target,
        key: usize,
    ) -> bool {
        let (a, b) = (self.members[a_slice][ka], self.members[b_slice][kb]);
        let p = self.w.partitions;
        self.marked.clear();
        self.changed.clear();
        let key_stack = match target {
            Target::Peak | Target::Stack { .. } => key / p,
            Target::Buffer { .. } => key,
        };
        if let Target::Peak = target {
            return self.try_peak_swap(a_slice, ka, b_slice, kb, top, key_stack);
        }
        let (a_key, b_key) = (
            self.stack_entries(a, key_stack),
            self.stack_entries(b, key_stack),
        );
        let mut fits = self.stack_fits(
            a_slice,
            b_slice,
            a_key.clone(),
            b_key.clone(),
            key_stack,
            top,
            target,
        );
        // The other stacks either sample sends ids to.
        for stack in 0..self.stacks {
            if !fits {
                break;
            }
            if stack == key_stack {
                continue;
            }
            let (a_entries, b_entries) =
                (self.stack_entries(a, stack), self.stack_entries(b, stack));
            if a_entries.is_empty() && b_entries.is_empty() {
                continue;
            }
            fits = self.stack_fits(a_slice, b_slice, a_entries, b_entries, stack, top, target);
        }
        let cells = self.cells;
        for &x in &self.marked {
            self.mark[x] = false;
            let d = std::mem::take(&mut self.delta[x]);
            if fits {
                self.load[a_slice * cells + x] = (self.load[a_slice * cells + x] as i64 + d) as u32;
                self.load[b_slice * cells + x] = (self.load[b_slice * cells + x] as i64 - d) as u32;
            }
        }
        if fits {
            let stacks = self.w.inv_buffer.len();
            for &(st, change_a, change_b) in &self.changed {
                self.sums[a_slice * stacks + st] += change_a;
                self.sums[b_slice * stacks + st] += change_b;
            }
            self.members[a_slice][ka] = b;
            self.members[b_slice][kb] = a;
        }
        fits
    }

    /// [`Self::try_swap`] for the worst cell, from the two samples' entries alone: a peak check
    /// needs no padded sums, and a stack's few entries are cheaper to pair up directly than
    /// through `delta` and `mark` (the verdict is the same: each cell is checked with the
    /// change of both samples' entries in it).
    fn try_peak_swap(
        &mut self,
        a_slice: usize,
        ka: usize,
        b_slice: usize,
        kb: usize,
        top: f64,
        key_stack: usize,
    ) -> bool {
        let (a, b) = (self.members[a_slice][ka], self.members[b_slice][kb]);
        let cells = self.cells;
        let (Some(la), Some(lb)) = (
            self.load.get(a_slice * cells..(a_slice + 1) * cells),
            self.load.get(b_slice * cells..(b_slice + 1) * cells),
        ) else {
            return false;
        };
        let inv_limit = &self.w.inv_limit[..cells.min(self.w.inv_limit.len())];
        let all = &self.counts.cells;
        // Cell x with A's ids changed by d and B's by -d.
        let cell_fits = |x: u32, d: i64| match (
            la.get(x as usize),
            lb.get(x as usize),
            inv_limit.get(x as usize),
        ) {
            (Some(&ka), Some(&kb), Some(&inv)) => {
                (ka as i64 + d) as f64 * inv < top && (kb as i64 - d) as f64 * inv < top
            }
            _ => false,
        };
        // One stack: every cell either sample sends ids to stays below `top` in both slices. A
        // cell named by several entries is checked once per entry, with the same change.
        let stack_fits =
            |a_entries: &[(u32, u32)], b_entries: &[(u32, u32)]| match (a_entries, b_entries) {
                // One entry each (every single-id feature's stack).
                (&[(xa, na)], &[(xb, nb)]) if xa == xb => cell_fits(xa, nb as i64 - na as i64),
                (&[(xa, na)], &[(xb, nb)]) => {
                    cell_fits(xa, -(na as i64)) && cell_fits(xb, nb as i64)
                }
                _ => {
                    let change = |x: u32| -> i64 {
                        let sum = |entries: &[(u32, u32)]| {
                            entries
                                .iter()
                                .filter(|e| e.0 == x)
                                .map(|e| e.1 as i64)
                                .sum::<i64>()
                        };
                        sum(b_entries) - sum(a_entries)
                    };
                    a_entries.iter().all(|e| cell_fits(e.0, change(e.0)))
                        && b_entries.iter().all(|e| cell_fits(e.0, change(e.0)))
                }
            };
        let entries =
            |i: usize, stack: usize| all.get(self.stack_entries(i, stack)).unwrap_or_default();
        let fits = stack_fits(entries(a, key_stack), entries(b, key_stack))
            && (0..self.stacks)
                .filter(|&st| st != key_stack)
                .all(|st| stack_fits(entries(a, st), entries(b, st)));
        if !fits {
            return false;
        }
        let width = self.stacks + 1;
        // Every stack's entries move: a's from A to B, b's from B to A.
        let span = |i: usize| self.bounds[i * width]..self.bounds[i * width + self.stacks];
        for (range, from, to) in [(span(a), a_slice, b_slice), (span(b), b_slice, a_slice)] {
            for &(x, n) in all.get(range).unwrap_or_default() {
                let x = x as usize;
                self.load[from * cells + x] = self.load[from * cells + x].wrapping_sub(n);
                self.load[to * cells + x] = self.load[to * cells + x].wrapping_add(n);
            }
        }
        self.members[a_slice][ka] = b;
        self.members[b_slice][kb] = a;
        true
    }

    /// Adds one stack's entries of a (`a_entries`, leaving A) and b (`b_entries`, leaving B)
    /// to `delta` and checks that stack's cells in both slices: below `top` (peak), at most the
    /// first objective's peak with the stack's buffer below `top` (buffer), or within their caps
    /// with the stack's padded sum within its cap (stack). A buffer or stack
    /// round notes the stack's change of each slice's padded sum in `changed`.
    #[allow(clippy::too_many_arguments)]
    fn stack_fits(
        &mut self,
        a_slice: usize,
        b_slice: usize,
        a_entries: std::ops::Range<usize>,
        b_entries: std::ops::Range<usize>,
        stack: usize,
        top: f64,
        target: Target,
    ) -> bool {
        let from = self.marked.len();
        self.add_entries(a_entries, -1);
        self.add_entries(b_entries, 1);
        let cells = self.cells;
        let level = |sw: &Self, s: usize, x: usize, d: i64| {
            (sw.load[s * cells + x] as i64 + d) as f64 * sw.w.inv_limit[x]
        };
        match target {
            Target::Peak => self.marked[from..].iter().all(|&x| {
                level(self, a_slice, x, self.delta[x]) < top
                    && level(self, b_slice, x, -self.delta[x]) < top
            }),
            Target::Buffer { peak } => {
                let (mut change_a, mut change_b) = (0i64, 0i64);
                for &x in &self.marked[from..] {
                    let d = self.delta[x];
                    let (la, lb) = (
                        self.load[a_slice * cells + x] as i64,
                        self.load[b_slice * cells + x] as i64,
                    );
                    change_a += padded(la + d) - padded(la);
                    change_b += padded(lb - d) - padded(lb);
                }
                let ok = self.buffer(a_slice, stack, change_a) < top
                    && self.buffer(b_slice, stack, change_b) < top
                    && self.marked[from..].iter().all(|&x| {
                        level(self, a_slice, x, self.delta[x]) <= peak
                            && level(self, b_slice, x, -self.delta[x]) <= peak
                    });
                if ok {
                    self.changed.push((stack, change_a, change_b));
                }
                ok
            }
            Target::Stack { .. } => {
                let (mut change_a, mut change_b) = (0i64, 0i64);
                let mut within = true;
                for &x in &self.marked[from..] {
                    let d = self.delta[x];
                    let (la, lb) = (
                        self.load[a_slice * cells + x] as i64,
                        self.load[b_slice * cells + x] as i64,
                    );
                    let cap = self.caps.get(x).map_or(0, |&c| c as i64);
                    within &= la + d <= cap && lb - d <= cap;
                    change_a += padded(la + d) - padded(la);
                    change_b += padded(lb - d) - padded(lb);
                }
                let stacks = self.stacks;
                let buffer_cap = self.buffer_caps.get(stack).copied().unwrap_or(0);
                let ok = within
                    && self.sums[a_slice * stacks + stack] + change_a <= buffer_cap
                    && self.sums[b_slice * stacks + stack] + change_b <= buffer_cap;
                if ok {
                    self.changed.push((stack, change_a, change_b));
                }
                ok
            }
        }
    }
}
