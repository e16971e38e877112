//! The third objective of balancing: lowering each stack's worst distinct-columns cell (see
//! [`lower`]).

use arrow_array::RecordBatch;

use super::count::next_generation;
use super::samples::{SampleCounts, Shape};
use crate::error::Result;
use crate::extract::col_of;
use crate::input::{features_from_record_batch, FeatureView, Ids, Offsets, SampleSource};
use crate::spec::{Config, Plan};

/// Ids the pass may read per id of the window, counting the stacks' slices and the swap
/// checks' samples: columns are not kept between reads (a map of every sample's columns would
/// outgrow the caches on large windows), so each read walks a list again.
const READS_PER_ID: usize = 4;

/// Partner slices a round counts (the least loaded in the worst cell's partition).
const PARTNERS: usize = 3;

/// Pair checks per sample of the window, as the swap pass budgets its own.
const CHECKS_PER_SAMPLE: usize = 4;

/// A stack whose busiest cell holds this many times its columns per partition has every
/// column in nearly every cell: its distinct columns cannot fall by moving whole samples.
const SATURATED: u64 = 4;

/// What is known of a (slice, stack)'s distinct columns per partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Nothing: only its ids bound them.
    Unknown,
    /// Counted, and exact since.
    Exact,
    /// At most the values held (samples moved in or out since the count).
    Bound,
}

/// One feature of one batch, as the pass reads its columns.
struct View<'a> {
    ids: Ids<'a>,
    offsets: Offsets<'a>,
    shift: u32,
    offset: u32,
}

/// Lowers each stack's worst `max_unique_ids_per_partition` cell (distinct columns per (slice,
/// partition)) by swapping samples between slices, after the swap pass lowered `max_ids` and the
/// buffer; the two earlier objectives stay where they are: no cell of any stack passes its
/// stack's worst `max_ids` of the window, no (slice, stack) buffer its stack's worst buffer.
///
/// Distinct columns depend on which samples share a slice, so they are counted from the columns
/// themselves, a (slice, stack) at a time, cheapest stacks first and, within a stack, its
/// busiest slices first (a slice whose ids are no more than the distinct columns already found
/// cannot hold the worst cell), within a budget of reads proportional to the window's ids. Then
/// per counted stack, rounds: take its worst counted cell (slice s, partition p), count s's
/// columns with their multiplicities, and swap a sample a of s whose columns in p are private
/// to it (moving it out frees them) with a sample b of another slice that brings fewer new
/// columns to p, such that no other cell of the stack reaches the old worst, no cell of another
/// stack rises above that stack's worst known distinct cell rounded up to 8, what a tuned limit
/// is rounded to (checked against upper bounds: a cell gains at most the ids of the sample
/// moved in, and never holds more than its ids, nor, with checked ids, more than its stack's
/// columns per partition), and
/// the `max_ids` and buffer levels above hold. Only the worst slice's columns are counted
/// exactly; cells of other slices are held to bounds. Stacks that are not lowered are held
/// too: one whose cells hold at most one id to that (its ids are its distinct columns), a
/// saturated one (every column in nearly every cell) to its columns per partition, which it
/// then nearly always holds already; only a stack the read budget left uncounted blocks every
/// swap touching it. Deterministic: fixed visiting orders, one thread.
#[allow(clippy::too_many_arguments)]
pub(super) fn lower(
    config: &Config,
    plan: &Plan,
    window: &[RecordBatch],
    counts: &SampleCounts,
    members: &mut [Vec<usize>],
    load: &mut [u32],
    shape: Shape,
) -> Result<()> {
    let (n, cells, stacks, nslices) =
        (shape.partitions, shape.cells(), shape.stacks, members.len());
    if n == 0
        || !n.is_power_of_two()
        || nslices < 2
        || stacks != plan.stacks.len()
        || load.len() != nslices * cells
    {
        return Ok(());
    }
    let mut cap_ids = vec![0u32; stacks];
    let mut sums = vec![0i64; nslices * stacks];
    for s in 0..nslices {
        for (st, cap) in cap_ids.iter_mut().enumerate() {
            let row = &load[s * cells + st * n..][..n];
            *cap = (*cap).max(row.iter().copied().max().unwrap_or(0));
            sums[s * stacks + st] = row.iter().map(|&k| padded(k as i64)).sum();
        }
    }
    let cap_buf: Vec<i64> = (0..stacks)
        .map(|st| {
            (0..nslices)
                .map(|s| sums[s * stacks + st])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let candidate: Vec<bool> = plan
        .stacks
        .iter()
        .enumerate()
        .map(|(st, stack)| {
            let columns = stack.stack_vocab_size.div_ceil(n as u64);
            cap_ids[st] > 1
                && !(plan.validate_ids && cap_ids[st] as u64 >= SATURATED.saturating_mul(columns))
        })
        .collect();
    if !candidate.contains(&true) {
        return Ok(());
    }
    // Checked ids lie below the stack's vocabulary, split evenly over the partitions.
    let most: Vec<u32> = plan
        .stacks
        .iter()
        .map(|stack| {
            if plan.validate_ids {
                stack
                    .stack_vocab_size
                    .div_ceil(n as u64)
                    .min(u32::MAX as u64) as u32
            } else {
                u32::MAX
            }
        })
        .collect();
    // How high other stacks' swaps may take a stack that is not lowered (see the docs above;
    // 0 blocks every swap touching it), from its cells' ids before they may rise.
    let uncounted: Vec<u32> = (0..stacks)
        .map(|st| {
            if candidate[st] {
                0
            } else if cap_ids[st] <= 1 {
                cap_ids[st]
            } else if most[st] < u32::MAX {
                most[st]
            } else {
                0
            }
        })
        .collect();
    // A stack's cells may rise to the next multiple of 8 (what a tuned limit is rounded to),
    // but never past the window's worst cell of any stack nor past the peak relative to the
    // limits that the swap pass reached (so the kept order's checks see the same levels).
    let inv: Vec<f64> = plan
        .stacks
        .iter()
        .map(|s| 1.0 / s.max_ids_per_partition.max(1) as f64)
        .collect();
    let peak = cap_ids
        .iter()
        .zip(&inv)
        .map(|(&c, &i)| c as f64 * i)
        .fold(0.0, f64::max);
    let worst_ids = cap_ids.iter().copied().max().unwrap_or(0);
    if peak <= 1.0 {
        for (cap, &i) in cap_ids.iter_mut().zip(&inv) {
            let mut v = cap.div_ceil(8).saturating_mul(8).min(worst_ids);
            while v > *cap && v as f64 * i > peak {
                v -= 1;
            }
            *cap = v.max(*cap);
        }
    }
    let features = window
        .iter()
        .map(|rb| features_from_record_batch(config, rb))
        .collect::<Result<Vec<_>>>()?;
    let mut views: Vec<Vec<View<'_>>> = Vec::with_capacity(features.len());
    for fs in &features {
        let mut batch = Vec::with_capacity(fs.len());
        for (f, fp) in fs.iter().zip(&plan.features) {
            match f.view() {
                FeatureView::Ragged { ids, offsets, .. } => batch.push(View {
                    ids,
                    offsets,
                    shift: fp.col_shift,
                    offset: fp.col_offset,
                }),
                // Only record batches are balanced, whose features are ragged lists.
                _ => return Ok(()),
            }
        }
        views.push(batch);
    }
    let total: u64 = load.iter().map(|&k| k as u64).sum();
    let mut pass = Pass {
        plan,
        counts,
        views: &views,
        mask: (n - 1) as u32,
        n,
        cells,
        stacks,
        members,
        load,
        sums,
        cap_ids,
        cap_buf,
        distinct: vec![0; nslices * cells],
        known: vec![Known::Unknown; nslices * stacks],
        floor: vec![0; stacks],
        slack: vec![0; stacks],
        most,
        reads: (total as usize).saturating_mul(READS_PER_ID),
        checks: CHECKS_PER_SAMPLE * counts.refs.len(),
        map: Multiset::default(),
        map_of: None,
        scratch: Multiset::default(),
        cols: Vec::new(),
        a_cols: Vec::new(),
        b_cols: Vec::new(),
        marked: Vec::new(),
        a_ids: vec![0; cells],
        b_ids: vec![0; cells],
        touched: Vec::new(),
        sum_s: vec![0; stacks],
        sum_x: vec![0; stacks],
        stack_mark: vec![false; stacks],
        change: Vec::new(),
    };
    // Cheapest stacks first: a window's budget then counts as many stacks as it can.
    let mut order: Vec<usize> = (0..stacks).filter(|&st| candidate[st]).collect();
    let stack_ids =
        |p: &Pass<'_, '_>, st: usize| -> u64 { (0..nslices).map(|s| p.ids_of(s, st)).sum() };
    order.sort_by_key(|&st| (stack_ids(&pass, st), st));
    for &st in &order {
        pass.count_stack(st);
    }
    // Another stack's cells may rise to the next multiple of 8 above its worst (what a tuned
    // limit is rounded to), within its configured limit. A stack that is not lowered: as the
    // function's docs say (0 blocks every swap touching it).
    pass.slack = (0..stacks)
        .map(|st| {
            let (f, stack) = (pass.floor[st], &plan.stacks[st]);
            if candidate[st] {
                f.div_ceil(8)
                    .saturating_mul(8)
                    .min(stack.max_unique_ids_per_partition)
                    .max(f)
            } else {
                uncounted[st]
            }
        })
        .collect();
    for &st in &order {
        if pass.floor[st] > 0 {
            while pass.round(st) {}
            pass.floor[st] = pass.worst(st).map_or(0, |w| w.2);
            pass.slack[st] = pass.slack[st]
                .min(pass.floor[st].div_ceil(8).saturating_mul(8))
                .max(pass.floor[st]);
        }
    }
    Ok(())
}

/// A count rounded up to the alignment buffers are padded to.
fn padded(ids: i64) -> i64 {
    (ids + 7).div_euclid(8) * 8
}

/// Columns with their multiplicities by open addressing, emptied in O(1) (a slot is taken when
/// its stamp is the current generation).
#[derive(Debug, Default)]
struct Multiset {
    keys: Vec<u32>,
    counts: Vec<u32>,
    stamps: Vec<u32>,
    generation: u32,
    size: usize,
    len: usize,
}

impl Multiset {
    fn start(&mut self, columns: usize) {
        let size = (2 * columns).next_power_of_two().max(16);
        if next_generation(&mut self.stamps, &mut self.generation, size) {
            self.keys = vec![0; size];
            self.counts = vec![0; size];
        }
        self.size = size;
        self.len = 0;
    }

    /// Whether `more` new columns keep the table at most three quarters full (probing then
    /// always ends).
    fn room(&self, more: usize) -> bool {
        4 * (self.len + more) <= 3 * self.size
    }

    /// The slot of `c`, taken (with count 0) if it was free.
    #[inline]
    fn slot(&mut self, c: u32) -> usize {
        let shift = 64 - self.size.trailing_zeros();
        let mut i = ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize;
        loop {
            if self.stamps[i] != self.generation {
                self.stamps[i] = self.generation;
                self.keys[i] = c;
                self.counts[i] = 0;
                self.len += 1;
                return i;
            }
            if self.keys[i] == c {
                return i;
            }
            i = (i + 1) & (self.size - 1);
        }
    }

    #[inline]
    fn get(&self, c: u32) -> u32 {
        let shift = 64 - self.size.trailing_zeros();
        let mut i = ((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize;
        loop {
            if self.stamps[i] != self.generation {
                return 0;
            }
            if self.keys[i] == c {
                return self.counts[i];
            }
            i = (i + 1) & (self.size - 1);
        }
    }
}

/// Sorted columns with their occurrences, from `cols` (sorted in place).
fn runs(cols: &mut [u32], out: &mut Vec<(u32, u32)>) {
    cols.sort_unstable();
    out.clear();
    for &c in cols.iter() {
        match out.last_mut() {
            Some(last) if last.0 == c => last.1 += 1,
            _ => out.push((c, 1)),
        }
    }
}

/// Occurrences of `c` in sorted runs.
fn occurrences(runs: &[(u32, u32)], c: u32) -> u32 {
    runs.binary_search_by_key(&c, |r| r.0)
        .map_or(0, |k| runs[k].1)
}

struct Pass<'a, 'v> {
    plan: &'a Plan,
    counts: &'a SampleCounts,
    views: &'a [Vec<View<'v>>],
    mask: u32,
    n: usize,
    cells: usize,
    stacks: usize,
    members: &'a mut [Vec<usize>],
    load: &'a mut [u32],
    /// Per (slice, stack): Σ over partitions of ids rounded up to 8.
    sums: Vec<i64>,
    /// Per stack: the highest a cell's ids and a slice's padded sum may go.
    cap_ids: Vec<u32>,
    cap_buf: Vec<i64>,
    /// Per (slice, cell): distinct columns, as `known` says.
    distinct: Vec<u32>,
    known: Vec<Known>,
    /// Per stack: no cell may rise above this (its worst counted cell; 0 for a stack not
    /// counted).
    floor: Vec<u32>,
    /// Per stack: how high another stack's swaps may take its cells (`floor` rounded up; see
    /// [`lower`] for the stacks that are not lowered); 0: no swap may touch it.
    slack: Vec<u32>,
    /// Per stack: the most distinct columns a cell can hold (its columns per partition where
    /// ids are checked).
    most: Vec<u32>,
    /// Ids left to read, pair checks left.
    reads: usize,
    checks: usize,
    /// The columns of one (slice, stack), `map_of`, with multiplicities.
    map: Multiset,
    map_of: Option<(usize, usize)>,
    /// Counts partner slices without losing `map`.
    scratch: Multiset,
    cols: Vec<u32>,
    a_cols: Vec<(u32, u32)>,
    b_cols: Vec<(u32, u32)>,
    /// Scratch of one check: the cells a or b send ids to (`marked`) and their ids there; the
    /// stacks touched and their padded sums' change in s and x; per partition of the target
    /// stack in s, its distinct columns' change. All zero between checks.
    marked: Vec<usize>,
    a_ids: Vec<u32>,
    b_ids: Vec<u32>,
    touched: Vec<usize>,
    sum_s: Vec<i64>,
    sum_x: Vec<i64>,
    stack_mark: Vec<bool>,
    change: Vec<i64>,
}

impl Pass<'_, '_> {
    /// Ids of a (slice, stack), after the per-sample merge.
    fn ids_of(&self, s: usize, st: usize) -> u64 {
        self.load[s * self.cells + st * self.n..][..self.n]
            .iter()
            .map(|&k| k as u64)
            .sum()
    }

    /// Appends sample `i`'s columns in stack `st` (every occurrence) to `self.cols`.
    fn read(&mut self, i: usize, st: usize) {
        let (counts, plan, views) = (self.counts, self.plan, self.views);
        let (Some(r), Some(stack)) = (counts.refs.get(i), plan.stacks.get(st)) else {
            return;
        };
        let Some(batch) = views.get(r.batch) else {
            return;
        };
        let mask = self.mask;
        let before = self.cols.len();
        for &f in &stack.features {
            let Some(v) = batch.get(f) else { continue };
            let range = match v.offsets {
                Offsets::I32(o) => o
                    .get(r.row)
                    .zip(o.get(r.row + 1))
                    .map(|(&a, &b)| a as usize..b as usize),
                Offsets::I64(o) => o
                    .get(r.row)
                    .zip(o.get(r.row + 1))
                    .map(|(&a, &b)| a as usize..b as usize),
            };
            let Some(range) = range else { continue };
            let (shift, offset) = (v.shift, v.offset);
            match v.ids {
                Ids::I32(x) => self.cols.extend(
                    x.get(range)
                        .unwrap_or_default()
                        .iter()
                        .map(|&id| col_of(id as u32, shift, mask, offset)),
                ),
                Ids::I64(x) => self.cols.extend(
                    x.get(range)
                        .unwrap_or_default()
                        .iter()
                        .map(|&id| col_of(id as u32, shift, mask, offset)),
                ),
            }
        }
        self.reads = self.reads.saturating_sub(self.cols.len() - before);
    }

    /// Counts slice `s`'s columns of stack `st` into the map, and its distinct columns per
    /// partition (exact from then on).
    fn count_slice(&mut self, s: usize, st: usize) {
        self.count_into(s, st, true);
    }

    /// [`Pass::count_slice`], into the map (`keep`: it then holds this slice) or into scratch.
    fn count_into(&mut self, s: usize, st: usize, keep: bool) {
        self.cols.clear();
        for k in 0..self.members[s].len() {
            let i = self.members[s][k];
            self.read(i, st);
        }
        let map = if keep {
            &mut self.map
        } else {
            &mut self.scratch
        };
        map.start(self.cols.len());
        let (n, base) = (self.n, s * self.cells + st * self.n);
        self.distinct[base..base + n].fill(0);
        for &c in &self.cols {
            let slot = map.slot(c);
            if map.counts[slot] == 0 {
                self.distinct[base + (c & self.mask) as usize] += 1;
            }
            map.counts[slot] += 1;
        }
        self.known[s * self.stacks + st] = Known::Exact;
        if keep {
            self.map_of = Some((s, st));
        }
    }

    /// Counts the stack's slices, busiest first, until no other slice can hold a busier cell
    /// or the reads run out; sets the stack's floor.
    fn count_stack(&mut self, st: usize) {
        let (n, cells) = (self.n, self.cells);
        let most = |p: &Self, s: usize| {
            p.load[s * cells + st * n..][..n]
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
        };
        let mut slices: Vec<(u32, usize)> = (0..self.members.len())
            .map(|s| (most(self, s), s))
            .collect();
        slices.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        for (ids, s) in slices {
            if ids <= self.floor[st] {
                break;
            }
            if self.ids_of(s, st) as usize > self.reads {
                // A stack left partly counted keeps the floor found: still a bound for the
                // swaps of other stacks, and its own rounds lower what they can see.
                break;
            }
            self.count_slice(s, st);
            let found = self.distinct[s * cells + st * n..][..n]
                .iter()
                .copied()
                .max()
                .unwrap_or(0);
            self.floor[st] = self.floor[st].max(found);
        }
    }

    /// The stack's worst known cell: (slice, partition, distinct), first in slice order.
    fn worst(&self, st: usize) -> Option<(usize, usize, u32)> {
        let mut worst: Option<(usize, usize, u32)> = None;
        for s in 0..self.members.len() {
            if self.known[s * self.stacks + st] == Known::Unknown {
                continue;
            }
            for p in 0..self.n {
                let d = self.distinct[s * self.cells + st * self.n + p];
                if worst.is_none_or(|w| d > w.2) {
                    worst = Some((s, p, d));
                }
            }
        }
        worst
    }

    /// One swap that lowers the stack's worst known cell; false when none does (or the budget
    /// is spent).
    fn round(&mut self, st: usize) -> bool {
        // The worst cell, counted exactly (a bound found too high is recounted first).
        let (s, p, top) = loop {
            let Some((s, p, d)) = self.worst(st) else {
                return false;
            };
            if d == 0 {
                return false;
            }
            if self.known[s * self.stacks + st] == Known::Exact && self.map_of == Some((s, st)) {
                break (s, p, d);
            }
            if self.ids_of(s, st) as usize > self.reads {
                return false;
            }
            self.count_slice(s, st);
        };
        let (n, cells, mask) = (self.n, self.cells, self.mask);
        let cell = st * n + p;
        // Samples of s by their ids in p, most first (their private columns are counted when
        // visited: reading every sample of s each round would cost a count of s).
        let mut outgoing: Vec<(u32, usize)> = (0..self.members[s].len())
            .map(|k| (self.share(self.members[s][k], cell), k))
            .filter(|x| x.0 > 0)
            .collect();
        outgoing.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        // Other slices by their distinct columns (or ids, where not counted) in p, fewest first.
        let level = |sw: &Self, x: usize| match sw.known[x * sw.stacks + st] {
            Known::Unknown => sw.load[x * cells + cell],
            _ => sw.distinct[x * cells + cell],
        };
        let mut others: Vec<(u32, usize)> = (0..self.members.len())
            .filter(|&x| x != s)
            .map(|x| (level(self, x), x))
            .collect();
        others.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.cmp(&y.1)));
        // The least loaded partners are counted (once) where the reads allow: a slice known
        // only by its ids can rarely take a sample without reaching the old worst.
        // Every counted stack of s and of the partners too, so that the other stacks' cells are
        // held to their counts rather than to their ids.
        let count_all = |sw: &mut Self, x: usize| {
            for st2 in 0..sw.stacks {
                if sw.floor[st2] > 0
                    && sw.known[x * sw.stacks + st2] == Known::Unknown
                    && sw.ids_of(x, st2) as usize <= sw.reads
                {
                    sw.count_into(x, st2, false);
                }
            }
        };
        count_all(self, s);
        for k in 0..others.len().min(PARTNERS) {
            let x = others[k].1;
            count_all(self, x);
            others[k].0 = level(self, x);
        }
        others.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.cmp(&y.1)));
        let lowest = others.first().map_or(u32::MAX, |o| o.0);
        for &(a_share, ka) in &outgoing {
            // No partner can take a's ids in p without reaching the old worst.
            if lowest.saturating_add(a_share) >= top {
                continue;
            }
            if self.checks == 0 || self.reads == 0 {
                return false;
            }
            let a = self.members[s][ka];
            // A sample with ids in a stack that was not counted cannot leave (nor could any
            // sample take its place there).
            let entries = &self.counts.cells[self.counts.start[a]..self.counts.start[a + 1]];
            if entries.iter().any(|e| self.slack[e.0 as usize / n] == 0) {
                continue;
            }
            self.cols.clear();
            self.read(a, st);
            let mut cols = std::mem::take(&mut self.cols);
            runs(&mut cols, &mut self.a_cols);
            self.cols = cols;
            let freed = self
                .a_cols
                .iter()
                .filter(|&&(c, k)| (c & mask) as usize == p && self.map.get(c) == k)
                .count() as u32;
            if freed == 0 {
                continue;
            }
            for &(_, x) in &others {
                // x takes a's ids in p: a slice already within them of the old worst cannot.
                if level(self, x) + a_share >= top {
                    break;
                }
                for kb in 0..self.members[x].len() {
                    if self.checks == 0 || self.reads == 0 {
                        return false;
                    }
                    self.checks -= 1;
                    if self.try_swap(st, (s, p), ka, x, kb, top) {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Sample `i`'s ids in `cell`.
    fn share(&self, i: usize, cell: usize) -> u32 {
        let entries = &self.counts.cells[self.counts.start[i]..self.counts.start[i + 1]];
        entries
            .iter()
            .filter(|e| e.0 as usize == cell)
            .map(|e| e.1)
            .sum()
    }

    /// Swaps sample `ka` of s (whose columns are in `a_cols`) with `kb` of x if that brings
    /// every partition of s's target stack below `top` and every check of [`lower`] holds. The
    /// levels first (the samples' per-cell ids), b's columns only for a swap they allow.
    fn try_swap(
        &mut self,
        st: usize,
        (s, p): (usize, usize),
        ka: usize,
        x: usize,
        kb: usize,
        top: u32,
    ) -> bool {
        let (a, b) = (self.members[s][ka], self.members[x][kb]);
        let counts = self.counts;
        self.marked.clear();
        for &(c, k) in &counts.cells[counts.start[a]..counts.start[a + 1]] {
            let c = c as usize;
            if self.a_ids[c] == 0 && self.b_ids[c] == 0 {
                self.marked.push(c);
            }
            self.a_ids[c] += k;
        }
        for &(c, k) in &counts.cells[counts.start[b]..counts.start[b + 1]] {
            let c = c as usize;
            if self.a_ids[c] == 0 && self.b_ids[c] == 0 {
                self.marked.push(c);
            }
            self.b_ids[c] += k;
        }
        let ok = self.levels_fit(st, s, x, top) && self.target_fits(st, (s, p), b, top);
        if ok {
            self.commit(st, s, ka, x, kb);
        }
        for k in 0..self.marked.len() {
            let c = self.marked[k];
            self.a_ids[c] = 0;
            self.b_ids[c] = 0;
        }
        for k in 0..self.touched.len() {
            let stack = self.touched[k];
            self.stack_mark[stack] = false;
            self.sum_s[stack] = 0;
            self.sum_x[stack] = 0;
        }
        self.touched.clear();
        ok
    }

    /// The `max_ids` and buffer levels, and the bounds on distinct columns outside the target
    /// cell's slice, after swapping the samples whose ids `a_ids` and `b_ids` hold.
    fn levels_fit(&mut self, st: usize, s: usize, x: usize, top: u32) -> bool {
        let (n, cells, stacks) = (self.n, self.cells, self.stacks);
        // A cell gains at most the ids of the sample moved in, and never holds more than its ids
        // or its stack's columns per partition.
        for &c in &self.marked {
            let stack = c / n;
            let most = self.most[stack];
            let bound = |known: Known, distinct: u32, gain: u32, ids: u32| match known {
                Known::Unknown => ids.min(most),
                _ => (distinct + gain).min(ids).min(most),
            };
            let (a_k, b_k) = (self.a_ids[c], self.b_ids[c]);
            let (ls, lx) = (
                self.load[s * cells + c] + b_k,
                self.load[x * cells + c] + a_k,
            );
            let (Some(ls), Some(lx)) = (ls.checked_sub(a_k), lx.checked_sub(b_k)) else {
                return false;
            };
            let cap = self.cap_ids[stack];
            if ls > cap || lx > cap {
                return false;
            }
            let bx = bound(
                self.known[x * stacks + stack],
                self.distinct[x * cells + c],
                a_k,
                lx,
            );
            if stack == st {
                // The target stack's other slice must stay below the old worst.
                if bx >= top {
                    return false;
                }
            } else {
                let bs = bound(
                    self.known[s * stacks + stack],
                    self.distinct[s * cells + c],
                    b_k,
                    ls,
                );
                let held = self.slack[stack];
                if bs > held || bx > held {
                    return false;
                }
            }
            let (old_s, old_x) = (
                self.load[s * cells + c] as i64,
                self.load[x * cells + c] as i64,
            );
            if !std::mem::replace(&mut self.stack_mark[stack], true) {
                self.touched.push(stack);
            }
            self.sum_s[stack] += padded(ls as i64) - padded(old_s);
            self.sum_x[stack] += padded(lx as i64) - padded(old_x);
        }
        self.touched.iter().all(|&stack| {
            let cap = self.cap_buf[stack];
            self.sums[s * stacks + stack] + self.sum_s[stack] <= cap
                && self.sums[x * stacks + stack] + self.sum_x[stack] <= cap
        })
    }

    /// The target stack in s, exactly: partition p below `top` once a's private columns leave
    /// and b's new ones come in, every other partition below it or not rising (cells tied at
    /// the worst are lowered one round at a time); b's columns into `b_cols`, for the map.
    fn target_fits(&mut self, st: usize, (s, p): (usize, usize), b: usize, top: u32) -> bool {
        let (n, cells) = (self.n, self.cells);
        let row = s * cells + st * n;
        self.cols.clear();
        self.read(b, st);
        let mut cols = std::mem::take(&mut self.cols);
        runs(&mut cols, &mut self.b_cols);
        self.cols = cols;
        self.change.clear();
        self.change.resize(n, 0);
        let mask = self.mask;
        for &(c, k) in &self.a_cols {
            if self.map.get(c) == k && self.b_cols.binary_search_by_key(&c, |r| r.0).is_err() {
                self.change[(c & mask) as usize] -= 1;
            }
        }
        for &(c, _) in &self.b_cols {
            if self.map.get(c) == 0 && occurrences(&self.a_cols, c) == 0 {
                self.change[(c & mask) as usize] += 1;
            }
        }
        (0..n).all(|q| {
            let new = self.distinct[row + q] as i64 + self.change[q];
            new < top as i64 || (q != p && self.change[q] <= 0)
        })
    }

    /// Applies an accepted swap: loads, buffers, distinct columns (exact in s's target stack,
    /// bounds elsewhere), the map and the members.
    fn commit(&mut self, st: usize, s: usize, ka: usize, x: usize, kb: usize) {
        let (n, cells, stacks) = (self.n, self.cells, self.stacks);
        let (a, b) = (self.members[s][ka], self.members[x][kb]);
        for &c in &self.marked {
            let (a_k, b_k) = (self.a_ids[c], self.b_ids[c]);
            self.load[s * cells + c] = self.load[s * cells + c] + b_k - a_k;
            self.load[x * cells + c] = self.load[x * cells + c] + a_k - b_k;
            let stack = c / n;
            if stack != st && self.known[s * stacks + stack] != Known::Unknown {
                self.distinct[s * cells + c] = (self.distinct[s * cells + c] + b_k)
                    .min(self.load[s * cells + c])
                    .min(self.most[stack]);
                self.known[s * stacks + stack] = Known::Bound;
            }
            if self.known[x * stacks + stack] != Known::Unknown {
                self.distinct[x * cells + c] = (self.distinct[x * cells + c] + a_k)
                    .min(self.load[x * cells + c])
                    .min(self.most[stack]);
                self.known[x * stacks + stack] = Known::Bound;
            }
        }
        for &stack in &self.touched {
            self.sums[s * stacks + stack] += self.sum_s[stack];
            self.sums[x * stacks + stack] += self.sum_x[stack];
        }
        for q in 0..n {
            let d = &mut self.distinct[s * cells + st * n + q];
            *d = (*d as i64 + self.change[q]).max(0) as u32;
        }
        if self.map.room(self.b_cols.len()) {
            for &(c, k) in &self.a_cols {
                let slot = self.map.slot(c);
                self.map.counts[slot] -= k.min(self.map.counts[slot]);
            }
            for &(c, k) in &self.b_cols {
                let slot = self.map.slot(c);
                self.map.counts[slot] += k;
            }
        } else {
            // Counted again when next needed.
            self.map_of = None;
        }
        self.members[s][ka] = b;
        self.members[x][kb] = a;
    }
}
