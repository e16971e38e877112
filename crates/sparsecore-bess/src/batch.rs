//! Batch samplers (besskge's `RandomShardedBatchSampler` and `RigidShardedBatchSampler`;
//! SPEC section 4): every step takes the same number of triples from every partition.

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;

/// Steps of at least this many draws reduce them on all threads.
const PARALLEL_MIN: usize = 1 << 15;

use crate::error::{BessError, Result};
use crate::negative::{Corruption, NegativeSampler};
use crate::partition::{PartitionMode, PartitionedTriples};
use crate::rng::{FastMod, Fill, Mod63, NumpyRng};

/// Batch geometry (SPEC 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Shards `n`.
    pub n_shard: usize,
    /// Partition mode.
    pub mode: PartitionMode,
    /// Positive triples per shard per batch, as asked.
    pub shard_bs: usize,
    /// Batches per step (per call).
    pub batches_per_step: usize,
    /// Triples per partition block per batch (besskge's `positive_per_partition`, `ppp`).
    pub positive_per_partition: usize,
    /// `bps * ppp` (besskge's `partition_sample_size`, `pss`).
    pub partition_sample_size: usize,
    /// Last-axis length after duplication (besskge's `q`): `2 * ppp` with `duplicate_batch`,
    /// else `ppp`.
    pub block_len: usize,
    /// Whether each block is followed by a copy of itself.
    pub duplicate_batch: bool,
}

impl Geometry {
    /// ppp = ceil(shard_bs / n) (shard pairs) or shard_bs; halved for `duplicate_batch`;
    /// rounded down to even for "ht" corruption. Zero triples per block is an error.
    pub fn new(
        part: &PartitionedTriples,
        shard_bs: usize,
        batches_per_step: usize,
        duplicate_batch: bool,
        corruption: Corruption,
    ) -> Result<Self> {
        let n = part.n_shard();
        if batches_per_step == 0 {
            return Err(BessError::param(
                "batches_per_step",
                0,
                "must be at least 1",
            ));
        }
        let ppp_of = |bs: usize| {
            let mut p = if part.mode == PartitionMode::HtShardPair {
                bs.div_ceil(n)
            } else {
                bs
            };
            if duplicate_batch {
                p /= 2;
            }
            if corruption == Corruption::Ht {
                p = p / 2 * 2;
            }
            p
        };
        if shard_bs > i32::MAX as usize {
            return Err(BessError::param("shard_bs", shard_bs, "must fit in int32"));
        }
        let ppp = ppp_of(shard_bs);
        if ppp == 0 {
            let mut minimum = shard_bs.max(1);
            while ppp_of(minimum) == 0 {
                minimum += 1;
            }
            return Err(BessError::ZeroTriplesPerBlock {
                shard_bs,
                positive_per_partition: ppp,
                n_shard: n,
                duplicate_batch,
                corruption: corruption.as_str(),
                minimum,
            });
        }
        let pss = batches_per_step
            .checked_mul(ppp)
            .ok_or_else(|| BessError::param("batches_per_step", batches_per_step, "too large"))?;
        Ok(Geometry {
            n_shard: n,
            mode: part.mode,
            shard_bs,
            batches_per_step,
            positive_per_partition: ppp,
            partition_sample_size: pss,
            block_len: if duplicate_batch { 2 * ppp } else { ppp },
            duplicate_batch,
        })
    }

    /// The block shape: `[n, n]` for shard pairs, `[n]` otherwise.
    #[must_use]
    pub fn blk(&self) -> Vec<usize> {
        match self.mode {
            PartitionMode::HtShardPair => vec![self.n_shard, self.n_shard],
            _ => vec![self.n_shard],
        }
    }

    /// Number of partitions `P`.
    #[must_use]
    pub fn partitions(&self) -> usize {
        self.mode.partitions(self.n_shard)
    }
}

/// Which batch sampler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SamplerKind {
    /// Uniform with replacement inside every partition, from `default_rng(seed)` (seed words).
    Random {
        /// The seed's little-endian 32-bit words.
        seed_words: Vec<u32>,
    },
    /// Every partition read cyclically at the same positions, padded to the longest one, with
    /// a mask. `shuffle = None` is besskge's `shuffle=False`, exactly. `Some(seed words)`
    /// shuffles the positions of each epoch with **our** generator: epoch `e` uses the `e`-th
    /// uniformly random permutation of the `len` positions drawn from `default_rng(seed)`'s
    /// 64-bit outputs, by Fisher–Yates from the top index down with Lemire's bounded draws
    /// (index `i` swapped with `⌊x·(i+1) / 2^64⌋`, `x` drawn again while
    /// `x·(i+1) mod 2^64 < 2^64 mod (i+1)`), the same for every thread count; every partition
    /// reads position `π(q) mod count` at its `q`-th position. besskge draws its permutation
    /// from torch's global RNG, which we do not reproduce (SPEC section 0).
    Rigid {
        /// Seed words of the per-epoch position shuffle, or `None` for sequential positions.
        shuffle: Option<Vec<u32>>,
    },
}

/// One step's arrays (SPEC 4.2). Shapes: `(bps, *blk, q)` for the triple arrays; `tail` is
/// transposed to `(bps, t_shard, h_shard, q)` for shard pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Head ids (local for `ht_shardpair` / `h_shard`).
    pub head: ArrayD<i32>,
    /// Relation ids.
    pub relation: ArrayD<i32>,
    /// Tail ids (local for `ht_shardpair` / `t_shard`), transposed for shard pairs.
    pub tail: ArrayD<i32>,
    /// Rigid only: which entries are real triples (false = cyclic padding).
    pub triple_mask: Option<ArrayD<bool>>,
    /// Negatives, when a negative sampler is attached.
    pub negative: Option<ArrayD<i32>>,
    /// TripleBased only.
    pub negative_mask: Option<ArrayD<bool>>,
    /// TripleBased with `return_sort_idx` only.
    pub negative_sort_idx: Option<ArrayD<i32>>,
    /// The indices into the sorted triples, when `return_triple_idx` is set.
    pub triple_idx: Option<ArrayD<i64>>,
    /// The indices into the sorted triples, always (what `triple_idx` returns).
    pub sample_idx: ArrayD<i64>,
}

#[derive(Debug, Clone)]
enum State {
    Random(NumpyRng),
    Rigid {
        shuffle: Option<(Vec<u32>, NumpyRng, usize, Vec<usize>)>,
    },
}

/// Rigid shuffle's order of one epoch: Fisher–Yates from the top index down over `0..len` (as
/// numpy's `permutation`), index `i` swapped with `j = ⌊x·(i+1) / 2^64⌋` for the generator's next
/// 64-bit output `x`, drawn again while `x·(i+1) mod 2^64 < 2^64 mod (i+1)` (Lemire's nearly
/// divisionless method: exactly uniform, one multiply per index, a division only for the few
/// low products).
///
/// Why not numpy's `permutation`: besskge draws this order from torch, which is not reproduced
/// anyway, and numpy's masked rejection on 32-bit half outputs takes about three times the
/// instructions (a step of Rigid shuffle at n = 4 pays 1/64 of an order of its 64 positions).
pub(crate) fn shuffled_positions(rng: &mut NumpyRng, len: usize) -> Vec<usize> {
    let mut a: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let bound = i as u64 + 1;
        let mut m = u128::from(rng.next_u64()) * u128::from(bound);
        if (m as u64) < bound {
            let threshold = bound.wrapping_neg() % bound;
            while (m as u64) < threshold {
                m = u128::from(rng.next_u64()) * u128::from(bound);
            }
        }
        a.swap(i, (m >> 64) as usize);
    }
    a
}

/// The permutation of the epoch of `step` (`steps` per epoch) over `len` positions, drawn
/// when that epoch differs from the one held (going back replays the generator from its seed).
fn epoch_permutation(
    shuffle: &mut (Vec<u32>, NumpyRng, usize, Vec<usize>),
    step: usize,
    steps: usize,
    len: usize,
) -> &[usize] {
    let (words, rng, epoch, perm) = shuffle;
    let want = step / steps.max(1);
    if *epoch != usize::MAX && want < *epoch {
        *rng = NumpyRng::from_words(words);
        *epoch = usize::MAX;
    }
    while *epoch == usize::MAX || *epoch < want {
        *perm = shuffled_positions(rng, len);
        *epoch = if *epoch == usize::MAX { 0 } else { *epoch + 1 };
    }
    perm
}

/// Random's rows of a step ([`BatchSampler::sample_rows_into`]): `raw` (one output per
/// position, partition by partition) from one bulk run of the generator (`integers(1 << 63)`
/// is its output >> 1), then each partition's outputs reduced by its size straight into the
/// place of its block, `block_of(p)` (if a block takes it).
///
/// Why in partition order: the outputs and the partitions' entries are then read front to
/// back, with no bounds to check per block, and a block's bookkeeping is one lookup of its
/// place.
///
/// Why two copies: the draws and their reduction are most of the Random sampler's own cost;
/// a copy compiled for x86-64-v3 makes the outputs in AVX2 lanes ([`Fill`] for
/// [`V3`](sparsecore_prep::isa::V3)) and reduces them with `mulx` and shifts by a register, and
/// runs when the CPU has it ([`sparsecore_prep::dispatch_v3!`]). Both copies compute the same
/// rows.
fn random_rows(
    rng: &mut NumpyRng,
    parts: &[PartRows],
    ppp: usize,
    raw: &mut [u64],
    out: &mut [u32],
    block_of: impl Fn(usize) -> Option<usize>,
) {
    sparsecore_prep::dispatch_v3!((
        rng: &mut NumpyRng,
        parts: &[PartRows],
        ppp: usize,
        raw: &mut [u64],
        out: &mut [u32],
        block_of: impl Fn(usize) -> Option<usize>,
    ) -> () |isa| {
        random_rows_body(isa, rng, parts, ppp, raw, out, block_of)
    });
}

#[inline(always)]
fn random_rows_body(
    gen: impl Fill,
    rng: &mut NumpyRng,
    parts: &[PartRows],
    ppp: usize,
    raw: &mut [u64],
    out: &mut [u32],
    block_of: impl Fn(usize) -> Option<usize>,
) {
    rng.fill_raw_63_with(gen, raw);
    for (p, (pr, r)) in parts.iter().zip(raw.chunks_exact(ppp)).enumerate() {
        let Some(o) = block_of(p).and_then(|b| out.get_mut(b * ppp..(b + 1) * ppp)) else {
            continue;
        };
        for (o, &v) in o.iter_mut().zip(r) {
            *o = pr.offset + pr.m.reduce(v >> 1) as u32;
        }
    }
}

/// A sharded batch sampler with its negative sampler (besskge's `ShardedBatchSampler`).
#[derive(Debug, Clone)]
pub struct BatchSampler {
    part: Arc<PartitionedTriples>,
    geometry: Geometry,
    negative: Option<NegativeSampler>,
    return_triple_idx: bool,
    state: State,
    /// `x mod triple_counts[p]` for every partition (set up once: each costs a 128-bit division).
    fast: Vec<FastMod>,
    /// [`Self::len`], fixed at construction (every step reads it; it scans all partitions).
    len: usize,
    /// Random: the raw generator outputs of a step (reused by [`Self::sample_rows_into`]).
    raw: Vec<u64>,
    /// Per partition: its first row, its count and its count's reducer, when no partition is
    /// empty and the rows fit in `u32` (what [`Self::sample_rows_into`] reads), else empty.
    rows: Vec<PartRows>,
}

/// A partition as [`BatchSampler::sample_rows_into`] reads it: 32 bytes in one place, where the
/// offsets, counts and [`FastMod`]s it comes from take 80 in three (4096 partitions at n = 64).
#[derive(Debug, Clone, Copy)]
struct PartRows {
    m: Mod63,
    offset: u32,
    count: u32,
}

/// Options of a [`BatchSampler`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct BatchOptions {
    /// Positive triples per shard per batch.
    pub shard_bs: usize,
    /// Batches per call.
    pub batches_per_step: usize,
    /// Append a copy of every block (for "ht" at inference).
    pub duplicate_batch: bool,
    /// Add `triple_idx`.
    pub return_triple_idx: bool,
    /// Random or Rigid.
    pub kind: SamplerKind,
}

impl BatchSampler {
    /// A sampler over `part`. The negative sampler's corruption scheme decides the "ht"
    /// rounding; without one, "h" is assumed (no rounding) and batches carry no negatives.
    pub fn new(
        part: Arc<PartitionedTriples>,
        options: BatchOptions,
        negative: Option<NegativeSampler>,
    ) -> Result<Self> {
        if let Some(NegativeSampler::TripleBased(tb)) = &negative {
            tb.check_set(&part)?;
        }
        let corruption = negative
            .as_ref()
            .map_or(Corruption::H, NegativeSampler::corruption);
        Self::build(part, options, negative, corruption)
    }

    /// A sampler of positives only, with the geometry a negative sampler of `corruption` would
    /// give (callers that draw negatives themselves, such as the SparseCore stream).
    pub fn positives_only(
        part: Arc<PartitionedTriples>,
        options: BatchOptions,
        corruption: Corruption,
    ) -> Result<Self> {
        Self::build(part, options, None, corruption)
    }

    fn build(
        part: Arc<PartitionedTriples>,
        options: BatchOptions,
        negative: Option<NegativeSampler>,
        corruption: Corruption,
    ) -> Result<Self> {
        let geometry = Geometry::new(
            &part,
            options.shard_bs,
            options.batches_per_step,
            options.duplicate_batch,
            corruption,
        )?;
        let state = match options.kind {
            SamplerKind::Random { seed_words } => {
                if let Some(p) = part.triple_counts.iter().position(|&c| c == 0) {
                    return Err(BessError::EmptyPartition {
                        sampler: "random batch sampler",
                        partition: part.partition_name(p),
                    });
                }
                State::Random(NumpyRng::from_words(&seed_words))
            }
            SamplerKind::Rigid { shuffle } => State::Rigid {
                shuffle: shuffle.map(|w| {
                    let rng = NumpyRng::from_words(&w);
                    (w, rng, usize::MAX, Vec::new())
                }),
            },
        };
        let fast: Vec<FastMod> = part
            .triple_counts
            .iter()
            .map(|&c| FastMod::new(c as u64))
            .collect();
        let (counts, offsets) = (&part.triple_counts, &part.triple_offsets);
        let fits = u32::try_from(part.len()).is_ok() && counts.iter().all(|&c| c > 0);
        let rows = if fits {
            counts
                .iter()
                .zip(offsets)
                .zip(&fast)
                .map(|((&c, &o), f)| PartRows {
                    m: f.u63(),
                    offset: o as u32,
                    count: c as u32,
                })
                .collect()
        } else {
            Vec::new()
        };
        let max = part.triple_counts.iter().copied().max().unwrap_or(0).max(0) as usize;
        let steps = max.div_ceil(geometry.partition_sample_size);
        let len = match state {
            State::Random(_) => steps,
            State::Rigid { .. } => steps * geometry.partition_sample_size,
        };
        Ok(BatchSampler {
            part,
            geometry,
            negative,
            return_triple_idx: options.return_triple_idx,
            state,
            fast,
            len,
            raw: Vec::new(),
            rows,
        })
    }

    /// The geometry.
    #[must_use]
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The partitioned triples.
    #[must_use]
    pub fn partitioned(&self) -> &Arc<PartitionedTriples> {
        &self.part
    }

    /// besskge's `len`: steps per epoch (Random) or the padded partition length (Rigid).
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `len` is 0 (never for a built set).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Steps in one epoch: `len` for Random, `len / pss` for Rigid.
    #[must_use]
    pub fn steps_per_epoch(&self) -> usize {
        match self.state {
            State::Random(_) => self.len(),
            State::Rigid { .. } => self.len() / self.geometry.partition_sample_size,
        }
    }

    /// Fraction of Rigid's positions that are padding (mask false), over one epoch: its
    /// overhead compared with reading every triple once.
    #[must_use]
    pub fn rigid_padding_fraction(&self) -> f64 {
        let len = self.len() as f64 * self.geometry.partitions() as f64;
        let real: i64 = self.part.triple_counts.iter().sum();
        if len == 0.0 {
            0.0
        } else {
            1.0 - real as f64 / len
        }
    }

    /// Step `step`'s sample indices, row-major over `(bps, P, ppp)` (before duplication), and
    /// Rigid's mask: the draws of [`Self::sample`] without building its output arrays.
    pub fn sample_indices(&mut self, step: usize) -> Result<(Vec<i64>, Option<Vec<bool>>)> {
        let (mut idx, mut mask) = (Vec::new(), Vec::new());
        let rigid = self.sample_indices_into(step, &mut idx, &mut mask)?;
        Ok((idx, rigid.then_some(mask)))
    }

    /// [`Self::sample_indices`] into reused buffers (cleared first). Returns whether `mask` was
    /// written (Rigid); Random leaves it empty.
    pub fn sample_indices_into(
        &mut self,
        step: usize,
        idx: &mut Vec<i64>,
        mask: &mut Vec<bool>,
    ) -> Result<bool> {
        let g = self.geometry;
        let p_count = g.partitions();
        let (counts, offsets) = (&self.part.triple_counts, &self.part.triple_offsets);
        let total = g.batches_per_step * p_count * g.positive_per_partition;
        idx.clear();
        mask.clear();
        idx.reserve(total);
        let len = self.len();
        let steps = self.steps_per_epoch();
        match &mut self.state {
            State::Random(rng) => {
                // All draws first (one bulk run of the generator), then each block reduced by
                // its partition's size; large steps take the reductions on every thread.
                idx.resize(total, 0);
                rng.fill_integers_63(idx, |v| v as i64);
                let fast = &self.fast;
                let reduce = |p: usize, x: &mut [i64]| {
                    let (off, c) = (offsets[p], fast[p]);
                    for v in x {
                        *v = off + c.reduce_u63(*v as u64) as i64;
                    }
                };
                if total >= PARALLEL_MIN {
                    idx.par_chunks_mut(g.positive_per_partition)
                        .enumerate()
                        .for_each(|(block, x)| reduce(block % p_count, x));
                } else {
                    // Partitions in turn, counted rather than divided (a division per block
                    // costs more than reducing a small block).
                    for (x, p) in idx
                        .chunks_mut(g.positive_per_partition)
                        .zip((0..p_count).cycle())
                    {
                        reduce(p, x);
                    }
                }
                Ok(false)
            }
            State::Rigid { shuffle } => {
                let n_rows = self.part.len() as i64;
                let epoch_step = step % steps.max(1);
                let window = epoch_step * g.partition_sample_size
                    ..(epoch_step + 1) * g.partition_sample_size;
                let shuffled = shuffle
                    .as_mut()
                    .map(|sh| &epoch_permutation(sh, step, steps, len)[window.clone()]);
                // Written into slices (no capacity check per value): block by block, the
                // `ppp` positions of one partition.
                idx.resize(total, 0);
                mask.resize(total, false);
                let last = n_rows - 1;
                let blocks = idx
                    .chunks_exact_mut(g.positive_per_partition)
                    .zip(mask.chunks_exact_mut(g.positive_per_partition));
                // (batch, partition) of each block, counted rather than divided.
                let mut at = (0, 0);
                for (ix, mk) in blocks {
                    let (s, p) = at;
                    at = if p + 1 == p_count {
                        (s + 1, 0)
                    } else {
                        (s, p + 1)
                    };
                    let (c, off) = (counts[p], offsets[p]);
                    if c == 0 {
                        ix.fill(off.min(last));
                        mk.fill(false);
                        continue;
                    }
                    match shuffled {
                        // Sequential positions: the remainder steps by one and wraps.
                        None => {
                            let first = window.start + s * g.positive_per_partition;
                            let mut r = self.fast[p].reduce_u63(first as u64) as i64;
                            for (j, (o, m)) in ix.iter_mut().zip(mk.iter_mut()).enumerate() {
                                *o = (off + r).min(last);
                                *m = ((first + j) as i64) < c;
                                r += 1;
                                if r == c {
                                    r = 0;
                                }
                            }
                        }
                        Some(w) => {
                            let f = self.fast[p];
                            let block =
                                s * g.positive_per_partition..(s + 1) * g.positive_per_partition;
                            for ((o, m), &gpos) in ix.iter_mut().zip(mk.iter_mut()).zip(&w[block]) {
                                *o = (off + f.reduce_u63(gpos as u64) as i64).min(last);
                                *m = (gpos as i64) < c;
                            }
                        }
                    }
                }
                Ok(true)
            }
        }
    }

    /// Step `step`'s positions as rows of the triple table, for one batch per step, in the
    /// caller's block order: block `b < blocks` is partition `part_of(b)`'s `ppp` rows, written
    /// to `out[b·ppp..][..ppp]`, and Rigid's mask to `mask` at the same place; `block_of` is
    /// the inverse (the block that takes partition `p`, `None` if none does). A row is what
    /// [`Self::sample_indices_into`] gives (the sorted triples hold the partitions in order),
    /// as `u32`; the generators advance exactly as there (partitions no block takes are drawn
    /// all the same). Returns `None`, having drawn nothing, where this does not apply (several
    /// batches per step, an empty partition, more than `u32::MAX` triples, Rigid without
    /// shuffle), else whether `mask` was written (Rigid).
    ///
    /// Why: the stream lays a step's rows out SparseCore by SparseCore; written straight into
    /// that order, they need no second index array, and the copy that follows reads them front
    /// to back. Each block reads one compact entry per partition ([`PartRows`]).
    pub(crate) fn sample_rows_into(
        &mut self,
        step: usize,
        (blocks, part_of, block_of): (
            usize,
            impl Fn(usize) -> usize,
            impl Fn(usize) -> Option<usize>,
        ),
        out: &mut [u32],
        mask: &mut [bool],
    ) -> Option<bool> {
        let g = self.geometry;
        if g.batches_per_step != 1 || self.rows.is_empty() {
            return None;
        }
        let (p_count, ppp) = (g.partitions(), g.positive_per_partition);
        let (len, steps) = (self.len, self.steps_per_epoch());
        let parts = &self.rows;
        let out = &mut out[..blocks * ppp];
        // Random writes only the blocks `block_of` names: a wrong inverse would leave the
        // previous step's rows in place instead of failing.
        debug_assert!((0..blocks).all(|b| block_of(part_of(b)) == Some(b)));
        match &mut self.state {
            State::Random(rng) => {
                let raw = &mut self.raw;
                raw.resize(p_count * ppp, 0);
                random_rows(rng, parts, ppp, raw, out, block_of);
                Some(false)
            }
            State::Rigid { shuffle: Some(sh) } => {
                let epoch_step = step % steps.max(1);
                let window = &epoch_permutation(sh, step, steps, len)
                    [epoch_step * ppp..(epoch_step + 1) * ppp];
                for (b, (o, m)) in out
                    .chunks_exact_mut(ppp)
                    .zip(mask.chunks_exact_mut(ppp))
                    .enumerate()
                {
                    // Positions below the count are themselves, the rest wrap.
                    let pr = parts[part_of(b)];
                    for ((o, m), &gpos) in o.iter_mut().zip(m).zip(window) {
                        let real = gpos < pr.count as usize;
                        *o = pr.offset
                            + if real {
                                gpos as u32
                            } else {
                                pr.m.reduce(gpos as u64) as u32
                            };
                        *m = real;
                    }
                }
                Some(true)
            }
            State::Rigid { shuffle: None } => None,
        }
    }

    /// Rigid shuffle's order of the epoch of `step`, as [`Self::sample_rows_into`] reads it:
    /// the generator advances exactly as there. `None`, having drawn nothing, where that does
    /// not apply (other samplers, and where [`Self::sample_rows_into`] does not).
    pub(crate) fn epoch_order(&mut self, step: usize) -> Option<&[usize]> {
        if self.geometry.batches_per_step != 1 || self.rows.is_empty() {
            return None;
        }
        let (len, steps) = (self.len, self.steps_per_epoch());
        match &mut self.state {
            State::Rigid { shuffle: Some(sh) } => Some(epoch_permutation(sh, step, steps, len)),
            _ => None,
        }
    }

    /// One call of the sampler: besskge's `__getitem__`. Random ignores `step` (its stream
    /// continues from the previous call); Rigid takes the positions of step `step`
    /// (`step mod steps_per_epoch` within the epoch `step / steps_per_epoch`).
    pub fn sample(&mut self, step: usize) -> Result<Batch> {
        let g = self.geometry;
        let (idx, mask) = self.sample_indices(step)?;
        let mut shape = vec![g.batches_per_step];
        shape.extend(g.blk());
        let dup = |v: Vec<i64>| -> Vec<i64> {
            if !g.duplicate_batch {
                return v;
            }
            v.chunks(g.positive_per_partition)
                .flat_map(|c| c.iter().chain(c.iter()).copied())
                .collect()
        };
        let idx = dup(idx);
        let mask = mask.map(|m| {
            if g.duplicate_batch {
                m.chunks(g.positive_per_partition)
                    .flat_map(|c| c.iter().chain(c.iter()).copied())
                    .collect()
            } else {
                m
            }
        });
        shape.push(g.block_len);
        let t = &self.part.triples;
        let col =
            |c: usize| -> Vec<i32> { idx.iter().map(|&i| t[[i as usize, c]] as i32).collect() };
        let mk = |v: Vec<i32>| ArrayD::from_shape_vec(IxDyn(&shape), v).expect("shape matches");
        let head = mk(col(0));
        let relation = mk(col(1));
        let mut tail = mk(col(2));
        if g.mode == PartitionMode::HtShardPair {
            tail = tail
                .permuted_axes(IxDyn(&[0, 2, 1, 3]))
                .as_standard_layout()
                .into_owned();
        }
        let sample_idx = ArrayD::from_shape_vec(IxDyn(&shape), idx).expect("shape matches");
        let triple_mask =
            mask.map(|m| ArrayD::from_shape_vec(IxDyn(&shape), m).expect("shape matches"));
        let (negative, negative_mask, negative_sort_idx) = match &mut self.negative {
            Some(ns) => {
                let o = ns.sample(&self.part, &sample_idx)?;
                (Some(o.negative), o.mask, o.sort_idx)
            }
            None => (None, None, None),
        };
        Ok(Batch {
            head,
            relation,
            tail,
            triple_mask,
            negative,
            negative_mask,
            negative_sort_idx,
            triple_idx: self.return_triple_idx.then(|| sample_idx.clone()),
            sample_idx,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{random_rows, random_rows_body, shuffled_positions, PartRows};
    use sparsecore_prep::isa::{Baseline, V3};

    use crate::rng::{FastMod, NumpyRng};

    /// Random's rows from either copy (and from either way of making the outputs) are the
    /// single draws reduced by their partitions' sizes, and leave the generator where the
    /// single draws do: block lengths below, at and above the AVX2 lanes' 8 and the bulk
    /// fill's 32, partitions of one triple and of sizes about powers of two.
    #[test]
    fn random_rows_equal_single_draws() {
        type Run<'a> = &'a dyn Fn(&mut NumpyRng, &mut [u64], &mut [u32]);
        let sizes: Vec<u64> = [
            1u64,
            2,
            3,
            7,
            8,
            9,
            255,
            256,
            257,
            65535,
            65536,
            65537,
            (1 << 31) - 1,
            1 << 31,
            (1 << 31) + 1,
            (1 << 32) - 1,
        ]
        .into();
        let mut pick = NumpyRng::new(41);
        for seed in 0..6u128 {
            for p_count in [1usize, 2, 5, 16, 17] {
                for ppp in [1usize, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 64] {
                    let parts: Vec<PartRows> = (0..p_count)
                        .map(|p| {
                            let count = if p % 3 == 2 {
                                pick.next_u64() % 5000 + 1
                            } else {
                                sizes[(p + seed as usize * 7) % sizes.len()]
                            };
                            let offset = (pick.next_u64() % ((1 << 32) - count + 1)) as u32;
                            PartRows {
                                m: FastMod::new(count).u63(),
                                offset,
                                count: count as u32,
                            }
                        })
                        .collect();
                    // The partitions in a scrambled order, all or the first two thirds (another
                    // host's blocks are a subset).
                    let mut order: Vec<usize> = (0..p_count).collect();
                    for i in (1..p_count).rev() {
                        order.swap(i, (pick.next_u64() % (i as u64 + 1)) as usize);
                    }
                    let blocks = if seed % 2 == 0 {
                        p_count
                    } else {
                        p_count - p_count / 3
                    };
                    let part_of = |b: usize| order[b];
                    let block_of = |p: usize| order[..blocks].iter().position(|&q| q == p);
                    let mut want_rng = NumpyRng::new(seed);
                    let drawn: Vec<u32> = (0..p_count * ppp)
                        .map(|i| {
                            let pr = parts[i / ppp];
                            pr.offset + (want_rng.integers_63() % u64::from(pr.count)) as u32
                        })
                        .collect();
                    let want: Vec<u32> = (0..blocks)
                        .flat_map(|b| drawn[part_of(b) * ppp..][..ppp].iter().copied())
                        .collect();
                    let check = |name: &str, run: Run<'_>| {
                        let (mut rng, mut raw, mut out) = (
                            NumpyRng::new(seed),
                            vec![0u64; p_count * ppp],
                            vec![0u32; blocks * ppp],
                        );
                        run(&mut rng, &mut raw, &mut out);
                        assert_eq!(
                            out, want,
                            "{name}: seed {seed}, {p_count} partitions, ppp {ppp}"
                        );
                        assert_eq!(rng, want_rng, "{name}: the generator afterwards");
                    };
                    check("dispatch", &|rng, raw, out| {
                        random_rows(rng, &parts, ppp, raw, out, block_of)
                    });
                    check("scalar", &|rng, raw, out| {
                        random_rows_body(Baseline, rng, &parts, ppp, raw, out, block_of)
                    });
                    // The AVX2 lanes in baseline code (`dispatch` ran them in the x86-64-v3
                    // copy).
                    #[cfg(target_arch = "x86_64")]
                    if let Some(v3) = V3::detect() {
                        check("avx2", &|rng, raw, out| {
                            random_rows_body(v3, rng, &parts, ppp, raw, out, block_of)
                        });
                    }
                }
            }
        }
    }

    /// Every order of four positions about equally often (24 orders, 48,000 draws: 2,000
    /// each, standard deviation about 44), each a permutation.
    #[test]
    fn epoch_orders_are_uniform_permutations() {
        let mut rng = NumpyRng::new(17);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..48_000 {
            let p = shuffled_positions(&mut rng, 4);
            let mut sorted = p.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, [0, 1, 2, 3]);
            *counts.entry(p).or_insert(0usize) += 1;
        }
        assert_eq!(counts.len(), 24);
        for (p, &c) in &counts {
            assert!((1750..=2250).contains(&c), "{p:?} drawn {c} times");
        }
        assert_eq!(shuffled_positions(&mut rng, 0), Vec::<usize>::new());
        assert_eq!(shuffled_positions(&mut rng, 1), [0]);
    }
}
