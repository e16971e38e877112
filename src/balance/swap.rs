//! The swap pass after the greedy placement (see [`improve`]).

use super::SampleCounts;

/// Pair checks [`improve`] may spend per sample of the window on the worst cell (more found
/// swaps only on large-vocab, each worth under 0.1% of its worst cell), and then on the worst
/// buffer (whose checks cost more and gain less: under 1.5% of the tuned buffer on the test
/// kit's profiles, but fewer left criteo's tuned buffer above its input's).
const SWAPS_CHECKED_PER_SAMPLE: usize = 8;
const BUFFER_SWAPS_CHECKED_PER_SAMPLE: usize = 4;

/// What a round of [`improve`] lowers.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The worst cell: ids / the stack's `max_ids_per_partition`.
    Peak,
    /// The worst (slice, stack) buffer: S × Σ over partitions of ids rounded up to 8 / the
    /// stack's buffer per device, with no cell above `peak` (the first objective's result).
    Buffer { peak: f64 },
}

/// Lowers the greedy's result by swapping samples between slices, first its worst cell, then
/// its worst buffer. While the worst value can be brought below itself by swapping one of its
/// slice's samples with one of another slice, such that no cell or buffer the swap touches
/// reaches that value (and, for the buffer, no cell passes the peak reached first), swap. The
/// greedy places each sample once, so a sample placed early can end up beside the samples that
/// fill its slice last; a swap undoes that. Values tied at the worst are fixed one at a time, so
/// the worst falls once all of them are. Deterministic (fixed visiting orders); the checks are
/// capped per sample, so a window costs at most a fixed multiple of its samples.
pub(super) fn improve(counts: &SampleCounts, members: &mut [Vec<usize>], load: &mut [u32], cells: usize, weights: &Weights<'_>) {
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
        stack_change: vec![0; 2 * weights.inv_buffer.len()],
        budget: SWAPS_CHECKED_PER_SAMPLE * counts.refs.len(),
    };
    while swaps.round(Target::Peak) {}
    let peak = swaps.worst_cell().0;
    swaps.budget = BUFFER_SWAPS_CHECKED_PER_SAMPLE * counts.refs.len();
    let p = weights.partitions;
    swaps.sums = swaps.load.chunks(p).map(|part| part.iter().map(|&k| padded(k as i64)).sum()).collect();
    while swaps.round(Target::Buffer { peak }) {}
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
    /// rounds on); per stack, a swap's change of it in A, then in B.
    sums: Vec<i64>,
    stack_change: Vec<i64>,
    budget: usize,
}

/// A count rounded up to the alignment buffers are padded to.
fn padded(ids: i64) -> i64 {
    (ids + 7).div_euclid(8) * 8
}

impl Swaps<'_> {
    fn sample(&self, i: usize) -> &[(u32, u32)] {
        &self.counts.cells[self.counts.start[i]..self.counts.start[i + 1]]
    }

    /// The worst cell: (ids / limit, slice, cell), first in (slice, cell) order.
    fn worst_cell(&self) -> (f64, usize, usize) {
        let mut worst = (0f64, 0, 0);
        for (k, &n) in self.load.iter().enumerate() {
            let v = n as f64 * self.w.inv_limit[k % self.cells];
            if v > worst.0 {
                worst = (v, k / self.cells, k % self.cells);
            }
        }
        worst
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

    /// A sample's ids in what the target measures: its cell, or its stack's cells.
    fn share(&self, i: usize, target: Target, key: usize) -> u32 {
        let p = self.w.partitions;
        self.sample(i)
            .iter()
            .filter(|&&(c, _)| match target {
                Target::Peak => c as usize == key,
                Target::Buffer { .. } => c as usize / p == key,
            })
            .map(|x| x.1)
            .sum()
    }

    /// One swap that lowers the worst value of `target`; false when none does (or the budget
    /// is spent).
    fn round(&mut self, target: Target) -> bool {
        let (top, a_slice, key) = match target {
            Target::Peak => self.worst_cell(),
            Target::Buffer { .. } => self.worst_buffer(),
        };
        if top == 0.0 || self.budget == 0 {
            return false;
        }
        let nslices = self.members.len();
        // Samples of A by their share of the key, largest first.
        let mut outgoing: Vec<(u32, usize)> =
            (0..self.members[a_slice].len()).map(|k| (self.share(self.members[a_slice][k], target, key), k)).filter(|x| x.0 > 0).collect();
        outgoing.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        // Other slices, least loaded in the key first.
        let level = |sw: &Self, s: usize| match target {
            Target::Peak => sw.load[s * sw.cells + key] as f64 * sw.w.inv_limit[key],
            Target::Buffer { .. } => sw.buffer(s, key, 0),
        };
        let mut others: Vec<(f64, usize)> = (0..nslices).filter(|&s| s != a_slice).map(|s| (level(self, s), s)).collect();
        others.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        // Each other slice's members' shares of the key, worked out when first visited.
        let mut shares: Vec<Vec<u32>> = vec![Vec::new(); nslices];
        for &(out_share, ka) in &outgoing {
            for &(b_level, b_slice) in &others {
                // B's key gains (the sample it gives up has less of it); the slices come least
                // loaded first, so no later one can take it either.
                let floor = match target {
                    Target::Peak => (self.load[b_slice * self.cells + key] + 1) as f64 * self.w.inv_limit[key],
                    Target::Buffer { .. } => b_level,
                };
                if floor >= top {
                    break;
                }
                if shares[b_slice].is_empty() {
                    shares[b_slice] = self.members[b_slice].iter().map(|&b| self.share(b, target, key)).collect();
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
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Entries `range` of `counts.cells` (one sample's) into `delta` with `sign`, listing their
    /// cells in `marked`.
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

    /// Where sample `i`'s entries of `stack` lie in `counts.cells` (a sample's entries come
    /// stack by stack, in stack order).
    fn stack_entries(&self, i: usize, stack: usize) -> std::ops::Range<usize> {
        let (from, to) = (self.counts.start[i], self.counts.start[i + 1]);
        let p = self.w.partitions;
        let entries = &self.counts.cells[from..to];
        let lo = entries.partition_point(|e| (e.0 as usize) / p < stack);
        let hi = entries.partition_point(|e| (e.0 as usize) / p <= stack);
        from + lo..from + hi
    }

    /// Swaps sample `ka` of A with `kb` of B if every cell (and, for the buffer, every stack)
    /// the two touch stays below `top` in both slices; `key` is the round's cell or stack.
    #[allow(clippy::too_many_arguments)]
    fn try_swap(&mut self, a_slice: usize, ka: usize, b_slice: usize, kb: usize, top: f64, target: Target, key: usize) -> bool {
        let (a, b) = (self.members[a_slice][ka], self.members[b_slice][kb]);
        let cells = self.cells;
        let p = self.w.partitions;
        self.marked.clear();
        let buffer_round = matches!(target, Target::Buffer { .. });
        // The entries already added: the key stack's in a buffer round, none (an empty range at
        // the sample's start) in a peak round.
        let nothing = |i: usize| self.counts.start[i]..self.counts.start[i];
        let (a_key, b_key) = if buffer_round { (self.stack_entries(a, key), self.stack_entries(b, key)) } else { (nothing(a), nothing(b)) };
        if buffer_round {
            // The key stack first: most candidates fail there, and a check that adds only its
            // cells costs a few of a sample's entries instead of all of both samples'.
            self.add_entries(a_key.clone(), -1);
            self.add_entries(b_key.clone(), 1);
            let (mut change_a, mut change_b) = (0i64, 0i64);
            for &x in &self.marked {
                let d = self.delta[x];
                let (la, lb) = (self.load[a_slice * cells + x] as i64, self.load[b_slice * cells + x] as i64);
                change_a += padded(la + d) - padded(la);
                change_b += padded(lb - d) - padded(lb);
            }
            if !(self.buffer(a_slice, key, change_a) < top && self.buffer(b_slice, key, change_b) < top) {
                for &x in &self.marked {
                    self.mark[x] = false;
                    self.delta[x] = 0;
                }
                return false;
            }
        }
        for (i, sign, done) in [(a, -1, a_key), (b, 1, b_key)] {
            self.add_entries(self.counts.start[i]..done.start, sign);
            self.add_entries(done.end..self.counts.start[i + 1], sign);
        }
        let cap = match target {
            Target::Peak => top,
            Target::Buffer { peak } => peak,
        };
        // Cells: below the top (peak), or at most the first objective's peak (buffer).
        let cells_fit = self.marked.iter().all(|&x| {
            [(a_slice, 1i64), (b_slice, -1)].iter().all(|&(s, sign)| {
                let v = (self.load[s * cells + x] as i64 + sign * self.delta[x]) as f64 * self.w.inv_limit[x];
                match target {
                    Target::Peak => v < cap,
                    Target::Buffer { .. } => v <= cap,
                }
            })
        });
        let fits = cells_fit
            && match target {
                Target::Peak => true,
                Target::Buffer { .. } => {
                    // Per touched stack, the change of each slice's padded sum.
                    let stacks = self.w.inv_buffer.len();
                    for &x in &self.marked {
                        let st = x / p;
                        let d = self.delta[x];
                        let (la, lb) = (self.load[a_slice * cells + x] as i64, self.load[b_slice * cells + x] as i64);
                        self.stack_change[st] += padded(la + d) - padded(la);
                        self.stack_change[stacks + st] += padded(lb - d) - padded(lb);
                    }
                    // The key stack first: most candidates fail there.
                    let below =
                        |sw: &Self, st: usize| sw.buffer(a_slice, st, sw.stack_change[st]) < top && sw.buffer(b_slice, st, sw.stack_change[stacks + st]) < top;
                    let ok = below(self, key) && self.marked.iter().all(|&x| below(self, x / p));
                    for &x in &self.marked {
                        let st = x / p;
                        if ok {
                            self.sums[a_slice * stacks + st] += self.stack_change[st];
                            self.sums[b_slice * stacks + st] += self.stack_change[stacks + st];
                        }
                        self.stack_change[st] = 0;
                        self.stack_change[stacks + st] = 0;
                    }
                    ok
                }
            };
        for &x in &self.marked {
            self.mark[x] = false;
            let d = std::mem::take(&mut self.delta[x]);
            if fits {
                self.load[a_slice * cells + x] = (self.load[a_slice * cells + x] as i64 + d) as u32;
                self.load[b_slice * cells + x] = (self.load[b_slice * cells + x] as i64 - d) as u32;
            }
        }
        if fits {
            self.members[a_slice][ka] = b;
            self.members[b_slice][kb] = a;
        }
        fits
    }
}
