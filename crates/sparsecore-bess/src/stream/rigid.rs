//! Rigid's positives without shuffle, made without the sampler's index arrays.
//!
//! Why: a block of a step is the cyclic run of `ppp` consecutive positions of its partition
//! that starts at `window·ppp` (besskge's `shuffle=False`), so its triples are contiguous rows
//! of the triple table (stored in partition order) and their mask is a prefix. Either every
//! step's columns are laid out once per stream in the host's row order ([`RigidSlices`], then a
//! step only slices reference-counted Arrow buffers), or, when that table would be too large,
//! each block is copied as one or a few contiguous runs of the triple table.

use arrow_buffer::{BooleanBuffer, ScalarBuffer};

use super::table::{with_rows, Decode, Row, Table};
use crate::layout::SparseCoreLayout;
use crate::partition::PartitionedTriples;
use crate::rng::FastMod;

/// The most rows a [`RigidSlices`] may hold per triple of the graph (so at most 240 bytes per
/// triple, against the triple table's 4 to 12). Each row costs 20 bytes (two `Int64` ids and an
/// `Int32` relation), and a table holds every padded position about twice (see [`Order`]):
/// uniform graphs, which pad little, need 2–3 rows per triple at any `n`, the power-law graph
/// of MEASUREMENTS.md about 11 at n = 16 (5.5 positions per triple); at n = 64 its blocks are
/// padded to the hub pair's size (55 positions per triple) and it copies runs instead.
const SLICES_MAX_ROWS_PER_TRIPLE: usize = 12;

/// The most bytes a [`RigidSlices`] may take, whatever the graph's size.
const SLICES_MAX_BYTES: usize = 1 << 30;

/// About how many rows ahead of the one it copies the run copy prefetches (whole blocks).
const PREFETCH_ROWS: usize = 32;

/// A Rigid sampler without shuffle, as the stream reads it.
#[derive(Debug, Clone)]
pub(super) struct Rigid {
    /// Per partition: its rows of the triple table.
    parts: Vec<Run>,
    /// The smallest partition: a window whose positions all lie below it has no padding.
    min_count: usize,
    ppp: usize,
    windows: usize,
    /// Every step's columns, when small enough.
    pub(super) slices: Option<RigidSlices>,
}

/// One partition's rows of the triple table (never empty: the stream refuses empty
/// partitions), with its count's reducer (a division per block per step would cost more than
/// copying the block).
#[derive(Debug, Clone, Copy)]
struct Run {
    offset: usize,
    count: usize,
    count_mod: FastMod,
    /// The first physical ids of its head and tail shards.
    offsets: (i64, i64),
}

impl Run {
    /// The partition's rows and where position `first` falls in them (cyclically).
    fn at<'a, R: Row>(&self, phys: &'a [R], first: usize) -> Option<(&'a [R], usize)> {
        let rows = phys.get(self.offset..self.offset + self.count).filter(|r| !r.is_empty())?;
        Some((rows, if first < self.count { first } else { self.count_mod.reduce_u63(first as u64) as usize }))
    }

    /// The rows of one block: the triples at positions `first .. first + ppp` (cyclically),
    /// written to `h`, `t` and `rel` (`ppp` each). Returns how many are real triples (the rest
    /// are cyclic padding): a prefix.
    #[inline(always)]
    fn copy<R: Row>(&self, phys: &[R], decode: Decode, first: usize, h: &mut [i64], t: &mut [i64], rel: &mut [i32]) -> usize {
        let ppp = h.len();
        let Some((rows, mut r)) = self.at(phys, first) else { return 0 };
        // Most blocks are one run: one loop, no remainder bookkeeping.
        if let (Some(run), true) = (rows.get(r..r + ppp), t.len() == ppp && rel.len() == ppp) {
            for q in 0..ppp {
                (h[q], rel[q], t[q]) = decode.row(run[q], self.offsets);
            }
            return self.count.saturating_sub(first).min(ppp);
        }
        let mut done = 0;
        while done < ppp {
            let len = (self.count - r).min(ppp - done);
            let run = &rows[r..r + len];
            for (((hv, tv), rv), &row) in h[done..done + len].iter_mut().zip(&mut t[done..done + len]).zip(&mut rel[done..done + len]).zip(run) {
                (*hv, *rv, *tv) = decode.row(row, self.offsets);
            }
            done += len;
            r = 0;
        }
        self.count.saturating_sub(first).min(ppp)
    }

    /// Prefetches the rows of the block at `first`, one per cache line and the end of the last (the
    /// run copy asks for the blocks a few ahead of the one it copies: the triple table is cold,
    /// since preprocessing evicts it between steps).
    fn prefetch<R: Row>(&self, phys: &[R], first: usize, ppp: usize) {
        let Some((rows, r0)) = self.at(phys, first) else { return };
        let len = ppp.min(self.count);
        let row = |q: usize| {
            let x = r0 + q;
            &rows[if x >= self.count { x - self.count } else { x }]
        };
        let per_line = (64 / std::mem::size_of::<R>()).max(1);
        for q in (0..len).step_by(per_line) {
            row(q).prefetch();
        }
        row(len - 1).prefetch();
    }
}

impl Rigid {
    /// The reader of a Rigid sampler without shuffle over `part` (one batch per step, `ppp`
    /// positions per block, `windows` steps per epoch), with its [`RigidSlices`] when they
    /// fit the bounds above.
    pub(super) fn new(part: &PartitionedTriples, table: &Table, lay: &SparseCoreLayout, ppp: usize, windows: usize) -> Self {
        let parts: Vec<Run> = part
            .triple_offsets
            .iter()
            .zip(&part.triple_counts)
            .enumerate()
            .map(|(p, (&o, &c))| Run {
                offset: o.max(0) as usize,
                count: c.max(0) as usize,
                count_mod: FastMod::new(c.max(0) as u64),
                offsets: table.offsets(p),
            })
            .collect();
        let min_count = parts.iter().map(|p| p.count).min().unwrap_or(0);
        let mut rigid = Rigid { parts, min_count, ppp, windows: windows.max(1), slices: None };
        rigid.slices = with_rows!(table, rows => RigidSlices::build(&rigid, rows, table.decode, lay));
        rigid
    }

    /// The first position of step `step`'s window in every partition.
    fn first(&self, step: usize) -> usize {
        (step % self.windows) * self.ppp
    }

    /// Whether some block of step `step` holds padding.
    pub(super) fn padded(&self, step: usize) -> bool {
        self.first(step) + self.ppp > self.min_count
    }

    /// Writes step `step`'s positives in the host's row order: `head`, `tail` and, if `mask`
    /// is given, which rows are real triples (`T` per local SparseCore), and `relation` (`R`
    /// per local SparseCore, the rows past `T` untouched).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_step(
        &self,
        table: &Table,
        lay: &SparseCoreLayout,
        step: usize,
        (t, r): (usize, usize),
        head: &mut [i64],
        tail: &mut [i64],
        relation: &mut [i32],
        mut mask: Option<&mut [bool]>,
    ) {
        let (n, ppp) = (lay.num_sparsecores(), self.ppp);
        let first_sc = lay.global_sparsecore(0);
        let first = self.first(step);
        let local = lay.local_sparsecores();
        // In row order (SparseCore slot by slot, head shard by head shard: slot `s` takes block
        // (i, (g + i + step) mod n) with g = first_sc + s), so the columns are written front to
        // back, with the blocks `ahead` further on prefetched. N is a power of two: no
        // divisions.
        let (shift, mask_n) = (n.trailing_zeros(), n - 1);
        let part_of = |b: usize| -> usize {
            let (slot, i) = (b >> shift, b & mask_n);
            (i << shift) | ((first_sc + slot + i + step) & mask_n)
        };
        let blocks = local * n;
        let ahead = (PREFETCH_ROWS / ppp).max(1);
        let decode = table.decode;
        with_rows!(table, phys => {
            for b in 0..ahead.min(blocks) {
                self.parts[part_of(b)].prefetch(phys, first, ppp);
            }
            for b in 0..blocks {
                if b + ahead < blocks {
                    self.parts[part_of(b + ahead)].prefetch(phys, first, ppp);
                }
                let (slot, i) = (b >> shift, b & mask_n);
                let dst = slot * t + i * ppp;
                let row = slot * r + i * ppp;
                let (hs, ts, rs) = (&mut head[dst..dst + ppp], &mut tail[dst..dst + ppp], &mut relation[row..row + ppp]);
                let valid = self.parts[part_of(b)].copy(phys, decode, first, hs, ts, rs);
                if let Some(m) = mask.as_deref_mut() {
                    // A loop, not two `fill`s: those call `memset` for a few bytes.
                    m[dst..dst + ppp].iter_mut().enumerate().for_each(|(q, x)| *x = q < valid);
                }
            }
        });
    }
}

/// Which (window, rotation) a [`RigidSlices`] entry holds, and so which entries a step
/// starts at. A SparseCore slice depends on the window and on `h = (g + step) mod n` (its
/// blocks are `(i, (i + h) mod n)`), so a step's `L` local slices are the entries of `h =
/// first + step .. first + step + L` (mod n) of its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Per window, the slices of every `h` and then again the first `L − 1` (so that a step's
    /// run never wraps): `n + L − 1` entries per window, about twice the positions.
    PerWindow,
    /// Per step of the period `lcm(windows, n)` after which (window, rotation) repeat, its `L`
    /// slices: `L` entries per step, as few as the positions when `n` divides the windows.
    PerStep { period: usize },
}

/// Every step's positive columns for this host, laid out once per stream in their row order
/// so that a step's columns are slices of shared buffers (no copy).
#[derive(Debug, Clone)]
pub(super) struct RigidSlices {
    order: Order,
    /// `T` rows per entry.
    pub(super) head: ScalarBuffer<i64>,
    pub(super) tail: ScalarBuffer<i64>,
    pub(super) relation: ScalarBuffer<i32>,
    pub(super) mask: BooleanBuffer,
    /// Per entry, how many entries before it hold padding (length `entries + 1`): a step's
    /// range holds padding iff the count changes across it.
    padded_before: Vec<usize>,
    n: usize,
    local: usize,
    first_sc: usize,
    windows: usize,
}

impl RigidSlices {
    fn build<R: Row>(rigid: &Rigid, phys: &[R], decode: Decode, lay: &SparseCoreLayout) -> Option<Self> {
        let (n, local, first_sc, ppp) = (lay.num_sparsecores(), lay.local_sparsecores(), lay.global_sparsecore(0), rigid.ppp);
        let t = n * ppp;
        let windows = rigid.windows;
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let period = windows / gcd(windows, n) * n;
        let per_step = period.checked_mul(local)?;
        let per_window = windows.checked_mul(n + local - 1)?;
        let (order, entries) = if per_step <= per_window { (Order::PerStep { period }, per_step) } else { (Order::PerWindow, per_window) };
        let rows = entries.checked_mul(t)?;
        if rows > SLICES_MAX_ROWS_PER_TRIPLE * phys.len() || rows.checked_mul(20)? > SLICES_MAX_BYTES {
            return None;
        }
        let (mut head, mut tail, mut relation) = (vec![0i64; rows], vec![0i64; rows], vec![0i32; rows]);
        let mut mask = Vec::with_capacity(rows);
        let mut padded_before = Vec::with_capacity(entries + 1);
        padded_before.push(0);
        for e in 0..entries {
            let (w, h) = match order {
                Order::PerWindow => (e / (n + local - 1), e % (n + local - 1) % n),
                Order::PerStep { .. } => {
                    let (q, slot) = (e / local, e % local);
                    (q % windows, (first_sc + slot + q) % n)
                }
            };
            let first = w * ppp;
            let mut padded = false;
            for i in 0..n {
                let p = i * n + ((i + h) & (n - 1));
                let at = e * t + i * ppp;
                let (hs, ts, rs) = (&mut head[at..at + ppp], &mut tail[at..at + ppp], &mut relation[at..at + ppp]);
                let valid = rigid.parts[p].copy(phys, decode, first, hs, ts, rs);
                padded |= valid < ppp;
                mask.extend((0..ppp).map(|q| q < valid));
            }
            padded_before.push(padded_before[e] + usize::from(padded));
        }
        Some(RigidSlices {
            order,
            head: head.into(),
            tail: tail.into(),
            relation: relation.into(),
            mask: BooleanBuffer::from(mask),
            padded_before,
            n,
            local,
            first_sc,
            windows,
        })
    }

    /// The first entry of step `step`'s `L` consecutive entries.
    pub(super) fn start(&self, step: usize) -> usize {
        match self.order {
            Order::PerWindow => (step % self.windows) * (self.n + self.local - 1) + (self.first_sc + step) % self.n,
            Order::PerStep { period } => (step % period) * self.local,
        }
    }

    /// Whether step `step`'s entries hold padding.
    pub(super) fn padded(&self, step: usize) -> bool {
        let s = self.start(step);
        self.padded_before[s + self.local] != self.padded_before[s]
    }
}
