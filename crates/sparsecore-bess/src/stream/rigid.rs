//! Rigid's positives without shuffle, made without the sampler's index arrays.
//!
//! Why: a block of a step is the cyclic run of `ppp` consecutive positions of its partition
//! that starts at `window·ppp` (besskge's `shuffle=False`), so its triples are contiguous rows
//! of the triple table (stored in partition order) and their mask is a prefix. Either every
//! step's columns are laid out once per stream in the host's row order ([`RigidSlices`], then a
//! step only slices reference-counted Arrow buffers), or, when that table would be too large,
//! each block is copied as one or a few contiguous runs of the packed triple table, and the
//! step's rows are then decoded slot by slot.

use arrow_buffer::{BooleanBuffer, Buffer, ScalarBuffer};

use super::table::{
    decode_slots, with_rows, Decode, Row, RowBuffers, Table, SLICES_MAX_BYTES,
    SLICES_MAX_ROWS_PER_TRIPLE,
};
use crate::layout::SparseCoreLayout;
use crate::partition::PartitionedTriples;
use crate::rng::{FastMod, Mod63};

/// About how many rows ahead of the one it copies the run copy prefetches (whole blocks).
const PREFETCH_ROWS: usize = 32;

/// A Rigid sampler without shuffle, as the stream reads it.
#[derive(Debug, Clone)]
pub(super) struct Rigid {
    /// Per partition: its rows of the triple table.
    parts: Vec<Run>,
    /// The same, column by column, for the run copy (`None` for tables of `2^31` rows or more,
    /// which copy through `parts`).
    columns: Option<RunColumns>,
    /// The smallest partition: a window whose positions all lie below it has no padding.
    min_count: usize,
    positive_per_partition: usize,
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

/// Per partition, what the run copy reads for every block, one column each: at n = 64 a step
/// reads one entry of each of its 4096 partitions, and 4 bytes each (16 KiB a column) stay in
/// the caches where a [`Run`] of 112 bytes would not (preprocessing runs between steps).
/// Every row index fits in 31 bits, so a cursor plus its step stays below `2^32`.
#[derive(Debug, Clone)]
struct RunColumns {
    /// The partition's first row of the table.
    offset: Vec<u32>,
    count: Vec<u32>,
    /// `ppp mod count`: how far the window moves in the partition from one step to the next.
    advance: Vec<u32>,
    /// `count`'s reducer, for a window that does not follow the cursor's.
    count_mod: Vec<Mod63>,
}

/// Where the run copy's current window starts in every partition (`first mod count`), kept
/// between steps: drawn in sequence, the next window moves each cursor by `ppp mod count`, one
/// addition and one conditional subtraction, where a reduction per partition would cost more
/// (the window lies past most partitions of a skewed graph). Any other window is reduced.
#[derive(Debug, Clone, Default)]
pub(super) struct Cursor {
    /// The first position of the window `at` is for.
    first: Option<usize>,
    at: Vec<u32>,
    /// Per partition, the window's block (see [`RunColumns::seek`]).
    start: Vec<u64>,
    /// The step's rows of the triple table in the columns' row order, before they are decoded
    staged: RowBuffers,
}

/// In a [`Cursor::start`]: the window's rows wrap around the partition's end.
const WRAPS: u64 = 1 << 31;
/// In a [`Cursor::start`]: the bits of the first row in the table.
const ROW: u64 = WRAPS - 1;

impl RunColumns {
    /// The columns of `parts` over a table of `rows` rows (`None` from `2^31` rows on).
    fn new(parts: &[Run], rows: usize, ppp: usize) -> Option<Self> {
        if rows >= 1 << 31 {
            return None;
        }
        let col =
            |f: &dyn Fn(&Run) -> usize| parts.iter().map(|p| f(p) as u32).collect::<Vec<u32>>();
        Some(RunColumns {
            offset: col(&|p| p.offset),
            count: col(&|p| p.count),
            advance: col(&|p| if p.count == 0 { 0 } else { ppp % p.count }),
            count_mod: parts.iter().map(|p| p.count_mod.u63()).collect(),
        })
    }

    /// Moves `cur` to the window that starts at position `first` and sets in `cur.start`, per
    /// partition, the window's block: its first row in the table (bits 0..31), [`WRAPS`] if
    /// its rows wrap around the partition's end, and above bit 32 how many of them are real
    /// triples.
    fn seek(&self, cur: &mut Cursor, first: usize, ppp: usize) {
        let parts = self.count.len();
        if cur.at.len() != parts {
            cur.at.clear();
            cur.at.resize(parts, 0);
            cur.first = None;
        }
        let next = match cur.first {
            Some(f) if f == first => false,
            _ if first == 0 => {
                cur.at.fill(0);
                false
            }
            Some(f) if f.checked_add(ppp) == Some(first) => true,
            _ => {
                for ((x, m), &c) in cur.at.iter_mut().zip(&self.count_mod).zip(&self.count) {
                    *x = if first < c as usize {
                        first as u32
                    } else {
                        m.reduce(first as u64) as u32
                    };
                }
                false
            }
        };
        cur.first = Some(first);
        cur.start.resize(parts, 0);
        // In 32-bit lanes (every count is below 2^31, so is `ppp`, and `first` saturates).
        let (ppp, first) = (
            ppp.min(ROW as usize) as u32,
            first.min(u32::MAX as usize) as u32,
        );
        block_words(
            &mut cur.at,
            &mut cur.start,
            next.then_some(&self.advance[..]),
            (&self.offset, &self.count),
            ppp,
            first,
        );
    }
}

/// Moves the cursors `at` by `advance` (the window after theirs), if given, and writes each
/// partition's block word to `start` (see [`RunColumns::seek`]) for the window at `first`.
///
/// Why two copies: these are a few operations per partition on 32-bit lanes, unsigned
/// minimums and comparisons that SSE2 lacks (it emulates them with sign flips) and AVX2 has,
/// eight lanes wide; a copy compiled for x86-64-v3 runs when the CPU has it
/// ([`sparsecore_prep::dispatch_v3!`]). Both copies compute the same words.
fn block_words(
    at: &mut [u32],
    start: &mut [u64],
    advance: Option<&[u32]>,
    parts: (&[u32], &[u32]),
    ppp: u32,
    first: u32,
) {
    sparsecore_prep::dispatch_v3!((
        at: &mut [u32],
        start: &mut [u64],
        advance: Option<&[u32]>,
        parts: (&[u32], &[u32]),
        ppp: u32,
        first: u32,
    ) -> () {
        block_words_body(at, start, advance, parts, ppp, first)
    });
}

#[inline(always)]
fn block_words_body(
    at: &mut [u32],
    start: &mut [u64],
    advance: Option<&[u32]>,
    (offset, count): (&[u32], &[u32]),
    ppp: u32,
    first: u32,
) {
    // Counts and cursors are below 2^31, so are the sums.
    let word = |x: u32, o: u32, c: u32| {
        let row = (o + x) | (u32::from(c - x < ppp) << 31);
        let valid = c.saturating_sub(first).min(ppp);
        u64::from(row) | (u64::from(valid) << 32)
    };
    match advance {
        // The minimum is the difference when it does not wrap.
        Some(adv) => {
            for ((((s, x), &a), &o), &c) in start
                .iter_mut()
                .zip(at.iter_mut())
                .zip(adv)
                .zip(offset)
                .zip(count)
            {
                let y = *x + a;
                *x = y.min(y.wrapping_sub(c));
                *s = word(*x, o, c);
            }
        }
        None => {
            for (((s, &x), &o), &c) in start.iter_mut().zip(at.iter()).zip(offset).zip(count) {
                *s = word(x, o, c);
            }
        }
    }
}

impl Run {
    /// The partition's rows and where position `first` falls in them (cyclically).
    fn at<'a, R: Row>(&self, phys: &'a [R], first: usize) -> Option<(&'a [R], usize)> {
        let rows = phys
            .get(self.offset..self.offset + self.count)
            .filter(|r| !r.is_empty())?;
        Some((
            rows,
            if first < self.count {
                first
            } else {
                self.count_mod.reduce_u63(first as u64) as usize
            },
        ))
    }

    /// The rows of one block: the triples at positions `first .. first + ppp` (cyclically),
    /// written to `h`, `t` and `rel` (`ppp` each). Returns how many are real triples (the rest
    /// are cyclic padding): a prefix.
    #[inline(always)]
    fn copy<R: Row>(
        &self,
        phys: &[R],
        decode: Decode,
        first: usize,
        h: &mut [i64],
        t: &mut [i64],
        rel: &mut [i32],
    ) -> usize {
        let ppp = h.len();
        let Some((rows, mut r)) = self.at(phys, first) else {
            return 0;
        };
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
            for (((hv, tv), rv), &row) in h[done..done + len]
                .iter_mut()
                .zip(&mut t[done..done + len])
                .zip(&mut rel[done..done + len])
                .zip(run)
            {
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
        let Some((rows, r0)) = self.at(phys, first) else {
            return;
        };
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

/// Sets bits `at .. at + len` of `words` (bit `k` is bit `k mod 64` of word `k / 64`).
fn set_bits(words: &mut [u64], at: usize, len: usize) {
    let (mut at, end) = (at, at + len);
    while at < end {
        let (w, b) = (at >> 6, at & 63);
        let k = (64 - b).min(end - at);
        if let Some(x) = words.get_mut(w) {
            *x |= (u64::MAX >> (64 - k)) << b;
        }
        at += k;
    }
}

/// Where a host's blocks of a step go: `local` slots of `n` blocks of `ppp` rows (`t = n·ppp`
/// per slot), the host's first SparseCore `first_sc`.
#[derive(Debug, Clone, Copy)]
struct Blocks {
    n: usize,
    local: usize,
    first_sc: usize,
    step: usize,
    t: usize,
    positive_per_partition: usize,
}

/// Copies every block of the host, whose windows `start` gives (see [`RunColumns::seek`]),
/// from the table `phys` into `staged` in the columns' row order (block `i` of slot `s` from
/// partition `(i, (first_sc + s + i + step) mod n)`, `T` rows per slot), and sets its real
/// triples in `mask`. `wraps` are the partitions' offsets and counts, for the blocks that wrap
/// around their partition's end. `P` is `ppp` when it is known at compile time, else 0.
///
/// Why head shard by head shard, and in each the slots in order: the host's blocks of head
/// shard `i` are the partitions `(i, j)` from `j = first_sc + i + step` (mod n) on, so a
/// block's word is read at a running index, its staged rows are `T` further on than the
/// previous block's, and the host's `local` blocks are the first `local` slots: no
/// partition's slot to compute or check. The next head shard's blocks are prefetched before
/// a head shard's are copied (a slot's worth of rows ahead).
#[inline(never)]
fn stage_blocks<R: Row, const P: usize>(
    start: &[u64],
    (offset, count): (&[u32], &[u32]),
    phys: &[R],
    bl: Blocks,
    staged: &mut [R],
    mut mask: Option<&mut [u64]>,
) {
    let ppp = if P == 0 { bl.positive_per_partition } else { P };
    let (n, t) = (bl.n, bl.t);
    if ppp == 0 || n == 0 || t != n * ppp || start.len() != n * n {
        return;
    }
    // N is a power of two: no divisions.
    let mask_n = n - 1;
    let per_line = (64 / std::mem::size_of::<R>()).max(1);
    let prefetch = |s: u64| {
        let s = (s & ROW) as usize;
        if ppp > per_line {
            for q in (0..ppp).step_by(per_line) {
                if let Some(x) = phys.get(s + q) {
                    x.prefetch();
                }
            }
        } else if let Some(x) = phys.get(s) {
            x.prefetch();
        }
        if let Some(x) = phys.get(s + ppp - 1) {
            x.prefetch();
        }
    };
    let (base, local) = (bl.first_sc.wrapping_add(bl.step), bl.local.min(n));
    // The words of head shard `i`'s blocks, slot by slot.
    let blocks = |i: usize| {
        let words = start.get(i * n..(i + 1) * n).unwrap_or_default();
        let first = base.wrapping_add(i);
        (0..local).filter_map(move |slot| words.get(slot.wrapping_add(first) & mask_n).copied())
    };
    blocks(0).for_each(prefetch);
    for (i, words) in start.chunks_exact(n).enumerate() {
        blocks(i + 1).for_each(prefetch);
        let first = base.wrapping_add(i);
        let at = i * ppp;
        for (slot, rows) in staged.chunks_exact_mut(t).enumerate() {
            let j = slot.wrapping_add(first) & mask_n;
            let (Some(&s), Some(to)) = (words.get(j), rows.get_mut(at..at + ppp)) else {
                continue;
            };
            if let Some(m) = mask.as_deref_mut() {
                let valid = (s >> 32) as usize;
                if valid != 0 {
                    set_bits(m, slot * t + at, valid);
                }
            }
            // Most blocks are one run of the table.
            if s & WRAPS == 0 {
                let s = (s & ROW) as usize;
                if let Some(run) = phys.get(s..s + ppp) {
                    match (<&mut [R; P]>::try_from(&mut *to), <&[R; P]>::try_from(run)) {
                        (Ok(to), Ok(run)) if P != 0 => *to = *run,
                        _ => copy_rows(to, run),
                    }
                }
                continue;
            }
            let p = i * n + j;
            let (Some(&o), Some(&c)) = (offset.get(p), count.get(p)) else {
                continue;
            };
            let (o, c) = (o as usize, c as usize);
            let Some(rows) = phys.get(o..o + c) else {
                continue;
            };
            let mut x = ((s & ROW) as usize).saturating_sub(o);
            for v in to {
                if let Some(&row) = rows.get(x) {
                    *v = row;
                }
                x += 1;
                if x == c {
                    x = 0;
                }
            }
        }
    }
}

/// Copies `src` to `dst` (as long): in fixed chunks of four rows, which compile to a move or
/// two each (a block of 4 packed rows is one 16-byte move), where `copy_from_slice` of a few
/// rows calls `memcpy`.
#[inline(always)]
fn copy_rows<R: Copy>(dst: &mut [R], src: &[R]) {
    let ((d4, dr), (s4, sr)) = (dst.as_chunks_mut::<4>(), src.as_chunks::<4>());
    for (d, s) in d4.iter_mut().zip(s4) {
        *d = *s;
    }
    for (d, s) in dr.iter_mut().zip(sr) {
        *d = *s;
    }
}

impl Rigid {
    /// The reader of a Rigid sampler without shuffle over `part` (one batch per step, `ppp`
    /// positions per block, `windows` steps per epoch), with its [`RigidSlices`] when they
    /// fit the bounds above.
    pub(super) fn new(
        part: &PartitionedTriples,
        table: &Table,
        lay: &SparseCoreLayout,
        ppp: usize,
        windows: usize,
    ) -> Self {
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
        let columns = RunColumns::new(&parts, with_rows!(table, rows => rows.len()), ppp);
        let mut rigid = Rigid {
            parts,
            columns,
            min_count,
            positive_per_partition: ppp,
            windows: windows.max(1),
            slices: None,
        };
        rigid.slices =
            with_rows!(table, rows => RigidSlices::build(&rigid, rows, table.decode, lay));
        rigid
    }

    /// The first position of step `step`'s window in every partition.
    fn first(&self, step: usize) -> usize {
        (step % self.windows) * self.positive_per_partition
    }

    /// Whether some block of step `step` holds padding.
    pub(super) fn padded(&self, step: usize) -> bool {
        self.first(step) + self.positive_per_partition > self.min_count
    }

    /// Writes step `step`'s positives in the host's row order: `head` and `tail` (`T` per
    /// local SparseCore) and `relation` (`R` per local SparseCore, the rows past `T`
    /// untouched). With `padded`, returns which rows are real triples (`T` bits per local
    /// SparseCore). `cursor` carries the windows' positions from the previous step.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_step(
        &self,
        table: &Table,
        lay: &SparseCoreLayout,
        step: usize,
        (t, r): (usize, usize),
        cursor: &mut Cursor,
        head: &mut [i64],
        tail: &mut [i64],
        relation: &mut [i32],
        padded: bool,
    ) -> Option<BooleanBuffer> {
        if let Some(cols) = &self.columns {
            cols.seek(cursor, self.first(step), self.positive_per_partition);
            let bits = lay.local_sparsecores() * t;
            let mut words = vec![0u64; if padded { bits.div_ceil(64) } else { 0 }];
            let mask = padded.then_some(&mut words[..]);
            with_rows!(table, phys => self.copy_columns(cols, cursor, phys, table.decode, &table.shard_ids, lay, step, (t, r), head, tail, relation, mask));
            // Arrow's bit `k` is bit `k mod 8` of byte `k / 8`: the words' bits in
            // little-endian order.
            words.iter_mut().for_each(|w| *w = w.to_le());
            padded.then(|| BooleanBuffer::new(Buffer::from_vec(words), 0, bits))
        } else {
            let mut mask = vec![
                false;
                if padded {
                    lay.local_sparsecores() * t
                } else {
                    0
                }
            ];
            self.copy_runs(
                table,
                lay,
                step,
                (t, r),
                head,
                tail,
                relation,
                padded.then_some(&mut mask[..]),
            );
            padded.then(|| BooleanBuffer::from(mask))
        }
    }

    /// [`Self::copy_step`] from the [`RunColumns`], with the windows' blocks in `cur.start`
    /// (see [`RunColumns::seek`]): block `i` of slot `s` from partition `(i, (first + s + i +
    /// step) mod n)`, its `ppp` rows from its start on, cyclically; its real triples set in
    /// `mask` (`T` bits per slot), if given.
    ///
    /// Why two passes: each block's rows are first copied, still packed, into a staging buffer
    /// in the columns' row order (a few moves a block, and a loop with little else in it, so
    /// that the rows prefetched well ahead arrive in time), and then one pass over whole slots
    /// decodes them into the columns, vectorized ([`decode_slots`]). Decoding block by block
    /// cost as much per block as the rows themselves (the shards' offsets set up per block, a
    /// loop too short to vectorize).
    #[allow(clippy::too_many_arguments)]
    fn copy_columns<R: Row>(
        &self,
        cols: &RunColumns,
        cur: &mut Cursor,
        phys: &[R],
        decode: Decode,
        shard_ids: &[i64],
        lay: &SparseCoreLayout,
        step: usize,
        (t, r): (usize, usize),
        head: &mut [i64],
        tail: &mut [i64],
        relation: &mut [i32],
        mask: Option<&mut [u64]>,
    ) {
        let (n, ppp) = (lay.num_sparsecores(), self.positive_per_partition);
        let (local, first_sc) = (lay.local_sparsecores(), lay.global_sparsecore(0));
        let mut staged = std::mem::take(R::buffer(&mut cur.staged));
        staged.resize(local * t, R::default());
        let blocks = Blocks {
            n,
            local,
            first_sc,
            step,
            t,
            positive_per_partition: ppp,
        };
        let (start, wraps) = (&cur.start[..], (&cols.offset[..], &cols.count[..]));
        // A block's rows in fixed-size moves where its size is a small power of two.
        match ppp {
            1 => stage_blocks::<R, 1>(start, wraps, phys, blocks, &mut staged, mask),
            2 => stage_blocks::<R, 2>(start, wraps, phys, blocks, &mut staged, mask),
            4 => stage_blocks::<R, 4>(start, wraps, phys, blocks, &mut staged, mask),
            8 => stage_blocks::<R, 8>(start, wraps, phys, blocks, &mut staged, mask),
            _ => stage_blocks::<R, 0>(start, wraps, phys, blocks, &mut staged, mask),
        }
        decode_slots(
            &staged,
            decode,
            shard_ids,
            (n, ppp, r),
            (first_sc, step),
            (head, tail, relation),
        );
        *R::buffer(&mut cur.staged) = staged;
    }

    /// [`Self::copy_step`] through the [`Run`]s.
    #[allow(clippy::too_many_arguments)]
    fn copy_runs(
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
        let (n, ppp) = (lay.num_sparsecores(), self.positive_per_partition);
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
    fn build<R: Row>(
        rigid: &Rigid,
        phys: &[R],
        decode: Decode,
        lay: &SparseCoreLayout,
    ) -> Option<Self> {
        let (n, local, first_sc, ppp) = (
            lay.num_sparsecores(),
            lay.local_sparsecores(),
            lay.global_sparsecore(0),
            rigid.positive_per_partition,
        );
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
        let (order, entries) = if per_step <= per_window {
            (Order::PerStep { period }, per_step)
        } else {
            (Order::PerWindow, per_window)
        };
        let rows = entries.checked_mul(t)?;
        if rows > SLICES_MAX_ROWS_PER_TRIPLE * phys.len()
            || rows.checked_mul(20)? > SLICES_MAX_BYTES
        {
            return None;
        }
        let (mut head, mut tail, mut relation) =
            (vec![0i64; rows], vec![0i64; rows], vec![0i32; rows]);
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
                let (hs, ts, rs) = (
                    &mut head[at..at + ppp],
                    &mut tail[at..at + ppp],
                    &mut relation[at..at + ppp],
                );
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
            Order::PerWindow => {
                (step % self.windows) * (self.n + self.local - 1) + (self.first_sc + step) % self.n
            }
            Order::PerStep { period } => (step % period) * self.local,
        }
    }

    /// Whether step `step`'s entries hold padding.
    pub(super) fn padded(&self, step: usize) -> bool {
        let s = self.start(step);
        self.padded_before[s + self.local] != self.padded_before[s]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::partition::PartitionMode;
    use crate::sharding::Sharding;
    use crate::synth;

    /// Step `step`'s columns and mask by definition: slot `s`'s block `i` is partition
    /// `(i, (first_sc + s + i + step) mod n)` at positions `first + q` (cyclically), real while
    /// below the partition's count.
    fn expected(
        part: &PartitionedTriples,
        table: &Table,
        lay: &SparseCoreLayout,
        ppp: usize,
        first: usize,
        step: usize,
    ) -> (Vec<i64>, Vec<i64>, Vec<i32>, Vec<bool>) {
        let (n, local, first_sc) = (
            lay.num_sparsecores(),
            lay.local_sparsecores(),
            lay.global_sparsecore(0),
        );
        let (mut h, mut t, mut r, mut m) = (vec![], vec![], vec![], vec![]);
        for slot in 0..local {
            for i in 0..n {
                let p = i * n + (first_sc + slot + i + step) % n;
                let (off, cnt) = (
                    part.triple_offsets[p] as usize,
                    part.triple_counts[p] as usize,
                );
                for q in 0..ppp {
                    let row = off + (first + q) % cnt;
                    let (hv, rv, tv) =
                        with_rows!(table, rows => table.decode.row(rows[row], table.offsets(p)));
                    h.push(hv);
                    t.push(tv);
                    r.push(rv);
                    m.push(first + q < cnt);
                }
            }
        }
        (h, t, r, m)
    }

    /// The run copy, with its cursors and through the [`Run`]s, against the definition, in
    /// sequence across epochs (the last step of each included), backwards, repeated and
    /// jumping, on one host and on later hosts of two and four, for blocks of a fixed size (1,
    /// 2, 4, 8 rows) and of any other (3, 16, 40, longer than some partitions), with rows of
    /// 32, 64 and 96 bits, on a skewed graph (partitions of 4 to a few hundred triples, most
    /// blocks padding), a uniform one (partitions of 2 or more) and one whose pairs hold 1 to 5
    /// triples but one of 60.
    #[test]
    fn run_copy_matches_the_windows_in_any_step_order() {
        for (l, g, s, host) in [
            (1, 1, 4, 0),
            (1, 2, 2, 1),
            (2, 2, 4, 0),
            (1, 4, 4, 2),
            (1, 4, 4, 3),
        ] {
            let lay = SparseCoreLayout::new(l, g, s, host).unwrap();
            let n = lay.num_sparsecores();
            // Every shard pair non-empty.
            let graphs = match n {
                16 => [
                    ("power law", synth::power_law(1000, 4, 12000, 1.0, 5), 1000),
                    ("uniform", synth::uniform(600, 3, 2000, 7), 600),
                ],
                _ => [
                    ("power law", synth::power_law(300, 4, 3000, 1.0, 5), 300),
                    ("uniform", synth::uniform(200, 3, 400, 7), 200),
                ],
            };
            let tiny = ("tiny pairs", crate::Triples::default(), 20 * n);
            for (graph, triples, n_entity) in graphs.into_iter().chain([tiny]) {
                let sharding = Arc::new(Sharding::create(n_entity, n, &[9], None).unwrap());
                // Pair (i, j) holds 1 + (i + 2j) mod 5 triples (every pair 1 to 5, one pair 60).
                let triples = if triples.head.is_empty() {
                    let shard_of = &sharding.entity_to_shard;
                    let of = move |x: usize| {
                        (0..n_entity as i64).filter(move |&e| shard_of[e as usize] == x as i64)
                    };
                    let mut rows = vec![];
                    for (i, j) in (0..n).flat_map(|i| (0..n).map(move |j| (i, j))) {
                        let k = if (i, j) == (1, 0) {
                            60
                        } else {
                            1 + (i + 2 * j) % 5
                        };
                        rows.extend(
                            of(i)
                                .zip(of(j).cycle())
                                .cycle()
                                .take(k)
                                .enumerate()
                                .map(|(q, (h, t))| [h, (q % 3) as i64, t]),
                        );
                    }
                    crate::Triples::from_rows(&rows)
                } else {
                    triples
                };
                let part = PartitionedTriples::builder(sharding, PartitionMode::HtShardPair)
                    .build(&triples)
                    .unwrap();
                assert!(
                    part.triple_counts.iter().all(|&c| c > 0),
                    "{graph}: an empty partition"
                );
                let max = *part.triple_counts.iter().max().unwrap() as usize;
                for (ppp, row_bits) in [
                    (1, 32),
                    (2, 64),
                    (3, 32),
                    (4, 32),
                    (4, 64),
                    (4, 96),
                    (8, 96),
                    (16, 32),
                    (40, 64),
                ] {
                    let table = Table::with_widest(&part, &lay, row_bits).unwrap();
                    let windows = max.div_ceil(ppp);
                    let rigid = Rigid::new(&part, &table, &lay, ppp, windows);
                    assert!(rigid.columns.is_some());
                    let runs = Rigid {
                        columns: None,
                        ..rigid.clone()
                    };
                    let mut steps: Vec<usize> = (0..2 * windows + 3).collect();
                    steps.extend((0..windows + 2).rev());
                    steps.extend([
                        5,
                        5,
                        0,
                        0,
                        7,
                        1,
                        2,
                        3 * windows + 1,
                        3 * windows + 2,
                        windows - 1,
                        windows,
                        2,
                    ]);
                    let (local, t, r) = (lay.local_sparsecores(), n * ppp, n * ppp + 3);
                    for (name, rg) in [("cursors", &rigid), ("runs", &runs)] {
                        let mut cursor = Cursor::default();
                        for (k, &step) in steps.iter().enumerate() {
                            let (mut h, mut tl, mut rel) =
                                (vec![0; local * t], vec![0; local * t], vec![-7; local * r]);
                            let padded = k % 5 != 4;
                            let bits = rg.copy_step(
                                &table,
                                &lay,
                                step,
                                (t, r),
                                &mut cursor,
                                &mut h,
                                &mut tl,
                                &mut rel,
                                padded,
                            );
                            let (eh, et, er, em) =
                                expected(&part, &table, &lay, ppp, rg.first(step), step);
                            let what = format!("{graph}, {name}, devices ({l}, {g}, {s}) host {host}, ppp {ppp}, {row_bits}-bit rows, step {step} (#{k})");
                            assert_eq!(h, eh, "head: {what}");
                            assert_eq!(tl, et, "tail: {what}");
                            for slot in 0..local {
                                assert_eq!(
                                    rel[slot * r..slot * r + t],
                                    er[slot * t..(slot + 1) * t],
                                    "relation: {what}"
                                );
                                assert!(
                                    rel[slot * r + t..(slot + 1) * r].iter().all(|&x| x == -7),
                                    "relation past T: {what}"
                                );
                            }
                            match bits {
                                Some(b) => {
                                    assert_eq!(b.iter().collect::<Vec<bool>>(), em, "mask: {what}")
                                }
                                None => assert!(!padded, "no mask: {what}"),
                            }
                            assert!(rg.padded(step) || !em.contains(&false), "padded: {what}");
                        }
                    }
                }
            }
        }
    }

    /// The stream refuses empty shard pairs, but the run copy given one does not panic, and
    /// every other block is still its partition's.
    #[test]
    fn run_copy_of_empty_partitions_does_not_panic() {
        let lay = SparseCoreLayout::new(1, 1, 4, 0).unwrap();
        let sharding = Arc::new(Sharding::create(40, 4, &[9], None).unwrap());
        // Triples from entities of shard 0 only: the pairs (i, j) with i > 0 are empty.
        let rows: Vec<[i64; 3]> = (0..40)
            .filter(|&h| sharding.entity_to_shard[h as usize] == 0)
            .flat_map(|h| (0..40).step_by(7).map(move |t| [h, 1, t]))
            .collect();
        let part = PartitionedTriples::builder(sharding, PartitionMode::HtShardPair)
            .build(&crate::Triples::from_rows(&rows))
            .unwrap();
        assert!(part.triple_counts.contains(&0) && part.triple_counts.iter().any(|&c| c > 0));
        let table = Table::new(&part, &lay).unwrap();
        let (n, ppp) = (4, 4);
        let (t, r) = (n * ppp, n * ppp);
        let rigid = Rigid::new(&part, &table, &lay, ppp, 5);
        let mut cursor = Cursor::default();
        for step in [0, 1, 2, 3, 4, 5, 9, 0, 3] {
            let (mut h, mut tl, mut rel) = (vec![0; n * t], vec![0; n * t], vec![0; n * r]);
            rigid.copy_step(
                &table,
                &lay,
                step,
                (t, r),
                &mut cursor,
                &mut h,
                &mut tl,
                &mut rel,
                true,
            );
            for slot in 0..n {
                for i in 0..n {
                    let p = i * n + (slot + i + step) % n;
                    let (off, cnt) = (
                        part.triple_offsets[p] as usize,
                        part.triple_counts[p] as usize,
                    );
                    for q in (0..ppp).filter(|_| cnt > 0) {
                        let row = off + (rigid.first(step) + q) % cnt;
                        let (hv, rv, tv) = with_rows!(table, rows => table.decode.row(rows[row], table.offsets(p)));
                        let at = slot * t + i * ppp + q;
                        assert_eq!(
                            (h[at], rel[slot * r + i * ppp + q], tl[at]),
                            (hv, rv, tv),
                            "step {step}, slot {slot}, block {i}"
                        );
                    }
                }
            }
        }
    }
}
