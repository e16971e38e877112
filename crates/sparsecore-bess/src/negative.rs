//! Negative samplers (besskge's `RandomShardedNegativeSampler`,
//! `TypeBasedShardedNegativeSampler` and `TripleBasedShardedNegativeSampler`; SPEC section 5).
//!
//! Why per shard: every processing shard draws the same number of negatives from every shard
//! (`n` blocks of `k`), so the gather of negative rows is as balanced as the positives.

use ndarray::{Array2, ArrayD, IxDyn};

use crate::error::{BessError, Result};
use crate::partition::{PartitionMode, PartitionedTriples};
use crate::rng::{FastMod, Fill, NumpyRng};

/// Which side of a triple negatives replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Corruption {
    /// Heads.
    H,
    /// Tails.
    T,
    /// Heads for the first half of each block, tails for the second.
    Ht,
}

impl Corruption {
    /// besskge's name: `h`, `t` or `ht`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Corruption::H => "h",
            Corruption::T => "t",
            Corruption::Ht => "ht",
        }
    }

    /// Parses `h`, `t` or `ht`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "h" => Ok(Corruption::H),
            "t" => Ok(Corruption::T),
            "ht" => Ok(Corruption::Ht),
            _ => Err(BessError::param(
                "corruption_scheme",
                name,
                "must be h, t or ht",
            )),
        }
    }
}

/// What a negative sampler adds to a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegativeOutput {
    /// `negative` (int32 local ids on the shard of axis 1); shapes in SPEC 5.
    pub negative: ArrayD<i32>,
    /// `negative_mask` (TripleBased only).
    pub mask: Option<ArrayD<bool>>,
    /// `negative_sort_idx` (TripleBased with `return_sort_idx` only).
    pub sort_idx: Option<ArrayD<i32>>,
}

/// Uniform negatives from every shard (`RandomShardedNegativeSampler`).
#[derive(Debug, Clone)]
pub struct RandomNegative {
    /// Negatives per shard block, `k`.
    pub n_negative: usize,
    /// Corruption scheme.
    pub corruption: Corruption,
    /// Whether negatives are used on the shard they live on (changes no value, only how a model
    /// reads the axes).
    pub local_sampling: bool,
    /// One list per batch block (`B = 1`, or 2 for `ht`) instead of one per triple.
    pub flat_negative_format: bool,
    rng: NumpyRng,
    fast: ShardMods,
}

/// Negatives of the same entity type as the corrupted side (`TypeBasedShardedNegativeSampler`).
#[derive(Debug, Clone)]
pub struct TypeBasedNegative {
    /// Negatives per shard block, `k`.
    pub n_negative: usize,
    /// Corruption scheme.
    pub corruption: Corruption,
    /// Whether the type comes from the triples processed on the sampling shard (true) or on the
    /// shard that uses the negatives (false).
    pub local_sampling: bool,
    rng: NumpyRng,
    fast: ShardMods,
}

/// `x mod shard_counts[a]` reducers, rebuilt only when the counts change (each costs a 128-bit
/// division).
#[derive(Debug, Clone, Default)]
struct ShardMods {
    counts: Vec<i64>,
    mods: Vec<FastMod>,
    /// [`draw_mod_shard_into`]'s draws before their reduction, kept between calls (zeroed
    /// only when it grows).
    draws: Vec<u32>,
}

impl ShardMods {
    fn for_counts(&mut self, counts: &[i64]) -> &[FastMod] {
        if self.counts != counts {
            self.counts = counts.to_vec();
            self.mods = counts.iter().map(|&c| FastMod::new(c as u64)).collect();
        }
        &self.mods
    }
}

/// One list's padded tables (SPEC 5.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedNegatives {
    /// `[N_, k]` positions of each row sorted by shard (stable).
    pub sort_idx: Array2<i32>,
    /// `[N_, n, L]` local ids, cyclically padded per shard.
    pub padded: ndarray::Array3<i64>,
    /// `[N_, n, L]` which entries are real.
    pub mask: ndarray::Array3<bool>,
}

/// Given negatives per triple or shared (`TripleBasedShardedNegativeSampler`), regrouped by
/// shard and padded to the same length on every shard.
#[derive(Debug, Clone)]
pub struct TripleBasedNegative {
    /// Corruption scheme.
    pub corruption: Corruption,
    /// Give the mask in the layout of `negative` (true) or `(bps, n_a, F, n_sn, L)` (false).
    pub mask_on_gather: bool,
    /// Add `negative_sort_idx`.
    pub return_sort_idx: bool,
    /// Whether one shared list (`N_ == 1`) is used for every triple.
    pub flat_negative_format: bool,
    /// Negatives per list, `k`.
    pub n_negative: usize,
    /// Padded length per shard, `L`.
    pub padded_shard_length: usize,
    /// Heads' tables ("h" and "ht").
    pub heads: Option<PaddedNegatives>,
    /// Tails' tables ("t" and "ht").
    pub tails: Option<PaddedNegatives>,
}

/// A negative sampler.
#[derive(Debug, Clone)]
pub enum NegativeSampler {
    /// Uniform over each shard.
    Random(RandomNegative),
    /// Uniform over each shard's entities of the corrupted side's type.
    TypeBased(TypeBasedNegative),
    /// Given lists (boxed: its padded tables make it much larger than the others).
    TripleBased(Box<TripleBasedNegative>),
}

fn seed_rng(seed_words: &[u32]) -> NumpyRng {
    NumpyRng::from_words(seed_words)
}

impl RandomNegative {
    /// `RandomShardedNegativeSampler(n_negative, seed, corruption_scheme, local_sampling,
    /// flat_negative_format)`, with the seed's 32-bit words.
    pub fn new(
        n_negative: usize,
        seed_words: &[u32],
        corruption: Corruption,
        local_sampling: bool,
        flat_negative_format: bool,
    ) -> Result<Self> {
        if n_negative == 0 || n_negative > i32::MAX as usize {
            return Err(BessError::param(
                "n_negative",
                n_negative,
                "must be in 1 ..= 2^31 - 1",
            ));
        }
        Ok(RandomNegative {
            n_negative,
            corruption,
            local_sampling,
            flat_negative_format,
            rng: seed_rng(seed_words),
            fast: ShardMods::default(),
        })
    }

    /// Lists per (drawn-from shard, using shard): `B = 2` (flat "ht"), 1 (flat) or `f`.
    #[must_use]
    pub fn lists(&self, f: usize) -> usize {
        match (self.flat_negative_format, self.corruption) {
            (true, Corruption::Ht) => 2,
            (true, _) => 1,
            (false, _) => f,
        }
    }

    /// The negatives of one call for `bps` batches whose blocks hold `f` triples per shard:
    /// what [`NegativeSampler::sample`] returns, without needing the sampled triples (uniform
    /// negatives do not depend on them), so a caller may draw them alongside the positives.
    pub fn draw(
        &mut self,
        part: &PartitionedTriples,
        bps: usize,
        f: usize,
    ) -> Result<NegativeOutput> {
        let n = part.n_shard();
        let b = self.lists(f);
        let mut v = Vec::new();
        self.draw_into(part, bps, f, &mut v)?;
        let negative = ArrayD::from_shape_vec(IxDyn(&[bps, n, n, b, self.n_negative]), v)
            .expect("shape matches the draws");
        Ok(NegativeOutput {
            negative,
            mask: None,
            sort_idx: None,
        })
    }

    /// [`Self::draw`]'s values laid out by the caller: block (call, drawn-from shard `x`,
    /// using shard `g`) of `B·k` values goes to `out[place(call, x, g)..]` (dropped if
    /// `None`: still drawn, so the generator's stream is unchanged) as `map(x)(local id)`.
    pub fn draw_placed<T: Copy + Default, F: Fn(u32) -> T>(
        &mut self,
        part: &PartitionedTriples,
        (bps, f): (usize, usize),
        out: &mut [T],
        place: impl Fn(usize, usize, usize) -> Option<usize>,
        map: impl Fn(usize) -> F,
    ) -> Result<()> {
        let b = self.lists(f);
        draw_mod_shard_into(
            &mut self.rng,
            &mut self.fast,
            part,
            (bps, b, self.n_negative),
            "random negative sampler",
            Placed { out, place, map },
        )
    }

    /// [`Self::draw`]'s values, row-major over `(bps, n, n, B, k)`, into a reused buffer.
    pub fn draw_into(
        &mut self,
        part: &PartitionedTriples,
        bps: usize,
        f: usize,
        out: &mut Vec<i32>,
    ) -> Result<()> {
        let b = self.lists(f);
        draw_mod_shard(
            &mut self.rng,
            &mut self.fast,
            part,
            bps,
            b,
            self.n_negative,
            "random negative sampler",
            out,
        )
    }
}

impl TypeBasedNegative {
    /// `TypeBasedShardedNegativeSampler(triple_types, n_negative, seed, corruption_scheme,
    /// local_sampling)`; the types come from the partitioned set at sampling time.
    pub fn new(
        n_negative: usize,
        seed_words: &[u32],
        corruption: Corruption,
        local_sampling: bool,
    ) -> Result<Self> {
        if n_negative == 0 || n_negative > i32::MAX as usize {
            return Err(BessError::param(
                "n_negative",
                n_negative,
                "must be in 1 ..= 2^31 - 1",
            ));
        }
        Ok(TypeBasedNegative {
            n_negative,
            corruption,
            local_sampling,
            rng: seed_rng(seed_words),
            fast: ShardMods::default(),
        })
    }
}

/// One negative list regrouped by shard: per row the stable sort by shard, the local ids in
/// that order, and the count and offset of each shard; plus the largest count.
struct Grouped {
    sort: Array2<i32>,
    locals: Vec<Vec<i64>>,
    counts: Vec<Vec<usize>>,
    offsets: Vec<Vec<usize>>,
    max_count: usize,
}

fn pad_list(part: &PartitionedTriples, list: &Array2<i64>) -> Grouped {
    let sh = &part.sharding;
    let n = sh.n_shard;
    let (rows, k) = list.dim();
    let mut sort = Array2::<i32>::zeros((rows, k));
    let mut locals = Vec::with_capacity(rows);
    let mut counts = Vec::with_capacity(rows);
    let mut offsets = Vec::with_capacity(rows);
    let mut max_cnt = 0;
    for r in 0..rows {
        let mut cnt = vec![0usize; n];
        for c in 0..k {
            cnt[sh.entity_to_shard[list[[r, c]] as usize] as usize] += 1;
        }
        let mut off = vec![0usize; n];
        for s in 1..n {
            off[s] = off[s - 1] + cnt[s - 1];
        }
        let mut cur = off.clone();
        let mut loc = vec![0i64; k];
        for c in 0..k {
            let e = list[[r, c]] as usize;
            let s = sh.entity_to_shard[e] as usize;
            sort[[r, cur[s]]] = c as i32;
            loc[cur[s]] = sh.entity_to_idx[e];
            cur[s] += 1;
        }
        max_cnt = max_cnt.max(cnt.iter().copied().max().unwrap_or(0));
        locals.push(loc);
        counts.push(cnt);
        offsets.push(off);
    }
    Grouped {
        sort,
        locals,
        counts,
        offsets,
        max_count: max_cnt,
    }
}

fn build_padded(n: usize, l: usize, k: usize, g: Grouped) -> PaddedNegatives {
    let Grouped {
        sort,
        locals,
        counts,
        offsets,
        ..
    } = g;
    let rows = locals.len();
    let mut padded = ndarray::Array3::<i64>::zeros((rows, n, l));
    let mut mask = ndarray::Array3::<bool>::from_elem((rows, n, l), false);
    for r in 0..rows {
        for s in 0..n {
            let (c, o) = (counts[r][s], offsets[r][s]);
            for i in 0..l {
                let pos = (o + if c == 0 { 0 } else { i % c }).min(k - 1);
                padded[[r, s, i]] = locals[r][pos];
                mask[[r, s, i]] = i < c;
            }
        }
    }
    PaddedNegatives {
        sort_idx: sort,
        padded,
        mask,
    }
}

impl TripleBasedNegative {
    /// `TripleBasedShardedNegativeSampler(neg_heads, neg_tails, corruption_scheme,
    /// mask_on_gather, return_sort_idx)`, reading the partitioned set's `neg_heads` /
    /// `neg_tails`. "h" needs heads, "t" tails, "ht" both of one shape.
    pub fn new(
        part: &PartitionedTriples,
        corruption: Corruption,
        mask_on_gather: bool,
        return_sort_idx: bool,
    ) -> Result<Self> {
        let need = |which: &'static str, a: &Option<Array2<i64>>| -> Result<Array2<i64>> {
            a.clone().ok_or_else(|| {
                BessError::param(
                    which,
                    "missing",
                    format!("corruption `{}` needs {which}", corruption.as_str()),
                )
            })
        };
        let (h, t) = match corruption {
            Corruption::H => (Some(need("neg_heads", &part.neg_heads)?), None),
            Corruption::T => (None, Some(need("neg_tails", &part.neg_tails)?)),
            Corruption::Ht => {
                let (h, t) = (
                    need("neg_heads", &part.neg_heads)?,
                    need("neg_tails", &part.neg_tails)?,
                );
                if h.dim() != t.dim() {
                    return Err(BessError::param(
                        "neg_tails",
                        format!("shape {:?}", t.dim()),
                        format!("must equal neg_heads' shape {:?} for `ht`", h.dim()),
                    ));
                }
                (Some(h), Some(t))
            }
        };
        let rows = h.as_ref().or(t.as_ref()).map(|a| a.nrows()).unwrap_or(1);
        let k = h.as_ref().or(t.as_ref()).map(|a| a.ncols()).unwrap_or(0);
        if rows != 1 && rows != part.len() {
            return Err(BessError::LengthMismatch {
                column: "negative lists".into(),
                got: rows,
                other: "sorted triples".into(),
                expected: part.len(),
            });
        }
        let n = part.n_shard();
        let ph = h.as_ref().map(|a| pad_list(part, a));
        let pt = t.as_ref().map(|a| pad_list(part, a));
        let l = ph
            .as_ref()
            .map_or(0, |p| p.max_count)
            .max(pt.as_ref().map_or(0, |p| p.max_count));
        let mk = |p: Option<Grouped>| p.map(|g| build_padded(n, l, k, g));
        Ok(TripleBasedNegative {
            corruption,
            mask_on_gather,
            return_sort_idx,
            flat_negative_format: rows == 1,
            n_negative: k,
            padded_shard_length: l,
            heads: mk(ph),
            tails: mk(pt),
        })
    }
}

/// Shape facts of a `sample_idx` array `(bps, *blk, q)`.
struct Dims {
    bps: usize,
    n: usize,
    f: usize,
    q: usize,
}

/// The shape facts of `sample_idx`, once it is known to be `(bps, n[, n], q)` (as `part`'s
/// mode says) with no empty axis and rows of `part` only: the samplers index by its axes and
/// values, and a caller may hand in any array (the batch sampler's are always right).
fn dims(part: &PartitionedTriples, sample_idx: &ArrayD<i64>) -> Result<Dims> {
    let n = part.n_shard();
    let sh = sample_idx.shape();
    let want = if part.mode == PartitionMode::HtShardPair {
        4
    } else {
        3
    };
    if sh.len() != want || sh[1] != n || (want == 4 && sh[2] != n) || sh.contains(&0) {
        let blk = if want == 4 {
            format!("{n}, {n}")
        } else {
            n.to_string()
        };
        return Err(BessError::param(
            "sample_idx",
            format!("shape {sh:?}"),
            format!("must be (batches_per_step, {blk}, q) with no empty axis"),
        ));
    }
    if let Some(&bad) = sample_idx
        .iter()
        .find(|&&i| i < 0 || i as usize >= part.len())
    {
        return Err(BessError::param(
            "sample_idx",
            bad,
            format!(
                "indices must be rows of the {} partitioned triples",
                part.len()
            ),
        ));
    }
    Ok(Dims {
        bps: sh[0],
        n,
        f: sh[2..].iter().product(),
        q: sh[want - 1],
    })
}

/// The shortest block [`draw_mod_shard_into`] reduces and maps straight into place; shorter
/// ones go through a few shards' rows at a time and are then copied into place.
const DIRECT_BLOCK: usize = 64;

/// Values [`draw_mod_shard_into`] draws per run (16 KiB of `u32`, in the L1 cache); a block
/// longer than that is a run of its own.
const GROUP_VALUES: usize = 4096;

/// Where [`draw_mod_shard_into`] writes its draws, and as what.
struct Placed<'a, T, P, M> {
    out: &'a mut [T],
    /// The start in `out` of block (call, drawn-from shard, using shard), `None` to drop it.
    place: P,
    /// Per drawn-from shard, the value stored for a local id drawn from it (a closure made
    /// once per block, holding its constants by value, so the inner loop reloads nothing).
    map: M,
}

/// `bps·n·n` blocks of `b·k` uniform local ids: block (call `c`, shard `x`, using shard `g`)
/// holds draws modulo shard `x`'s size, all of one call's shard `x` drawn in a row
/// (besskge's order; the draws are numpy-exact).
///
/// Why fused: the caller's layout and id mapping are applied to the values as they are
/// reduced, into its output, so the ids are written once rather than stored and laid out again
/// (the stream's largest steps draw millions of negatives); only the raw draws pass through a
/// buffer, which stays in the L1 cache unless one block is longer than [`GROUP_VALUES`].
///
/// Why two copies: the draws, their reduction and the mapping are most of the cost of
/// per-triple negatives, and they vectorize twice as wide with AVX2; a copy compiled for
/// x86-64-v3, with the generator's AVX2 lanes ([`Fill`] for [`V3`](sparsecore_prep::isa::V3)),
/// runs when the CPU has it ([`sparsecore_prep::dispatch_v3!`]). Its callees are
/// `#[inline(always)]` so that they are compiled into it; both copies compute the same draws.
fn draw_mod_shard_into<
    T: Copy + Default,
    P: Fn(usize, usize, usize) -> Option<usize>,
    F: Fn(u32) -> T,
    M: Fn(usize) -> F,
>(
    rng: &mut NumpyRng,
    fast: &mut ShardMods,
    part: &PartitionedTriples,
    dims: (usize, usize, usize),
    sampler: &'static str,
    to: Placed<'_, T, P, M>,
) -> Result<()> {
    sparsecore_prep::dispatch_v3!(<
        T: Copy,
        P: Fn(usize, usize, usize) -> Option<usize>,
        F: Fn(u32) -> T,
        M: Fn(usize) -> F,
    > (
        rng: &mut NumpyRng,
        fast: &mut ShardMods,
        part: &PartitionedTriples,
        dims: (usize, usize, usize),
        sampler: &'static str,
        to: Placed<'_, T, P, M>,
    ) -> Result<()> where T: Default |isa| {
        draw_mod_shard_body(isa, rng, fast, part, dims, sampler, to)
    })
}

#[inline(always)]
fn draw_mod_shard_body<
    T: Copy + Default,
    P: Fn(usize, usize, usize) -> Option<usize>,
    F: Fn(u32) -> T,
    M: Fn(usize) -> F,
>(
    gen: impl Fill,
    rng: &mut NumpyRng,
    fast: &mut ShardMods,
    part: &PartitionedTriples,
    (bps, b, k): (usize, usize, usize),
    sampler: &'static str,
    to: Placed<'_, T, P, M>,
) -> Result<()> {
    let counts = &part.sharding.shard_counts;
    if let Some(a) = counts.iter().position(|&c| c == 0) {
        return Err(BessError::EmptyPartition {
            sampler,
            partition: format!("shard {a} (it holds no entities to draw negatives from)"),
        });
    }
    let n = counts.len();
    fast.for_counts(counts);
    let ShardMods { mods, draws, .. } = fast;
    let bk = b * k;
    let row = n * bk;
    // The draws go through `draws` in runs of up to `GROUP_VALUES` (small enough to stay in
    // the L1 cache; a longer block is a run of its own): each bulk draw sets up its generator
    // lanes, which costs a dozen draws or more, so one run covers many blocks, and the
    // reduction and mapping that follow run over whole rows (a loop the compiler vectorizes).
    // Short blocks: a few shards' rows at a time are reduced and mapped into `run` and then
    // copied into place using shard by using shard, so that the copies of consecutive shards
    // land next to each other in a layout that groups them (the stream's); copies strided by
    // a whole row would collide in the cache.
    if bk < DIRECT_BLOCK {
        let group = (GROUP_VALUES / row.max(1)).max(1);
        let mut run = Vec::new();
        for c in 0..bps {
            for xs in (0..n).step_by(group) {
                let xe = (xs + group).min(n);
                let drawn = draw_run(rng, gen, draws, (xe - xs) * row);
                run.clear();
                for (x, chunk) in (xs..xe).zip(drawn.chunks_exact(row)) {
                    let (map, m) = ((to.map)(x), mods[x]);
                    run.extend(chunk.iter().map(|&v| map(m.reduce_u31(v))));
                }
                for g in 0..n {
                    for x in xs..xe {
                        if let Some(at) = (to.place)(c, x, g) {
                            let from = (x - xs) * row + g * bk;
                            to.out[at..at + bk].copy_from_slice(&run[from..from + bk]);
                        }
                    }
                }
            }
        }
        return Ok(());
    }
    // Long blocks: as many whole blocks of one shard's row as fit in a run, each reduced and
    // mapped straight into place (a block no one takes is drawn all the same).
    let per_run = (GROUP_VALUES / bk).max(1);
    for c in 0..bps {
        for (x, &m) in mods.iter().enumerate() {
            let map = (to.map)(x);
            for gs in (0..n).step_by(per_run) {
                let ge = (gs + per_run).min(n);
                let drawn = draw_run(rng, gen, draws, (ge - gs) * bk);
                for (g, chunk) in (gs..ge).zip(drawn.chunks_exact(bk)) {
                    if let Some(at) = (to.place)(c, x, g) {
                        for (o, &v) in to.out[at..at + bk].iter_mut().zip(chunk) {
                            *o = map(m.reduce_u31(v));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The next `len` raw 31-bit draws, into the kept buffer `draws` (grown, never shrunk).
#[inline(always)]
fn draw_run<'a>(
    rng: &mut NumpyRng,
    gen: impl Fill,
    draws: &'a mut Vec<u32>,
    len: usize,
) -> &'a [u32] {
    if draws.len() < len {
        draws.resize(len, 0);
    }
    let drawn = &mut draws[..len];
    rng.fill_integers_31_with(gen, drawn, |v| v);
    drawn
}

/// [`draw_mod_shard_into`] row-major over `(bps, n, n, b, k)`, as `i32`.
#[allow(clippy::too_many_arguments)]
fn draw_mod_shard(
    rng: &mut NumpyRng,
    fast: &mut ShardMods,
    part: &PartitionedTriples,
    bps: usize,
    b: usize,
    k: usize,
    sampler: &'static str,
    out: &mut Vec<i32>,
) -> Result<()> {
    let n = part.sharding.shard_counts.len();
    let bk = b * k;
    out.clear();
    out.resize(bps * n * n * bk, 0);
    let place = |c: usize, x: usize, g: usize| Some(((c * n + x) * n + g) * bk);
    draw_mod_shard_into(
        rng,
        fast,
        part,
        (bps, b, k),
        sampler,
        Placed {
            out,
            place,
            map: |_| |v| v as i32,
        },
    )
}

impl NegativeSampler {
    /// The corruption scheme (it fixes the batch geometry's rounding, SPEC 4.1).
    #[must_use]
    pub fn corruption(&self) -> Corruption {
        match self {
            NegativeSampler::Random(s) => s.corruption,
            NegativeSampler::TypeBased(s) => s.corruption,
            NegativeSampler::TripleBased(s) => s.corruption,
        }
    }

    /// Negatives for the triples `sample_idx` of shape `(bps, *blk, q)` (indices into
    /// `part.triples`).
    pub fn sample(
        &mut self,
        part: &PartitionedTriples,
        sample_idx: &ArrayD<i64>,
    ) -> Result<NegativeOutput> {
        let d = dims(part, sample_idx)?;
        match self {
            NegativeSampler::Random(s) => s.draw(part, d.bps, d.f),
            NegativeSampler::TypeBased(s) => {
                let types = part.types.as_ref().ok_or_else(|| {
                    BessError::param(
                        "types",
                        "missing",
                        "the TypeBased sampler needs a typed partition (type_offsets)",
                    )
                })?;
                let sh = &part.sharding;
                let (tc, to) = match (&sh.entity_type_counts, &sh.entity_type_offsets) {
                    (Some(c), Some(o)) => (c, o),
                    _ => {
                        return Err(BessError::param(
                            "entity_type_counts",
                            "missing",
                            "the TypeBased sampler needs a typed sharding",
                        ))
                    }
                };
                // T[s][a][f]: the relevant type of each sampled triple.
                let flat = sample_idx
                    .as_slice()
                    .map(<[i64]>::to_vec)
                    .unwrap_or_else(|| sample_idx.iter().copied().collect());
                let tt: Vec<i64> = flat
                    .iter()
                    .enumerate()
                    .map(|(pos, &row)| {
                        let j = pos % d.q;
                        let col = match s.corruption {
                            Corruption::H => 0,
                            Corruption::T => 1,
                            Corruption::Ht => usize::from(j >= d.q / 2),
                        };
                        types[[row as usize, col]]
                    })
                    .collect();
                let k = s.n_negative;
                let mut raw = Vec::new();
                draw_mod_shard(
                    &mut s.rng,
                    &mut s.fast,
                    part,
                    d.bps,
                    d.f,
                    k,
                    "type-based negative sampler",
                    &mut raw,
                )?;
                let mut out = Vec::with_capacity(raw.len());
                for (idx, &v) in raw.iter().enumerate() {
                    let f = (idx / k) % d.f;
                    let b = (idx / (k * d.f)) % d.n;
                    let a = (idx / (k * d.f * d.n)) % d.n;
                    let st = idx / (k * d.f * d.n * d.n);
                    let src = if s.local_sampling { a } else { b };
                    let t = tt[(st * d.n + src) * d.f + f];
                    if t < 0 || t as usize >= tc.ncols() {
                        return Err(BessError::param(
                            "types",
                            t,
                            format!("outside the sharding's {} types", tc.ncols()),
                        ));
                    }
                    let cnt = tc[[a, t as usize]];
                    if cnt <= 0 {
                        return Err(BessError::EmptyPartition {
                            sampler: "type-based negative sampler",
                            partition: format!(
                                "shard {a}, type {t} (it holds no entities of that type)"
                            ),
                        });
                    }
                    out.push((i64::from(v) % cnt + to[[a, t as usize]]) as i32);
                }
                let negative = ArrayD::from_shape_vec(IxDyn(&[d.bps, d.n, d.n, d.f, k]), out)
                    .expect("shape matches the draws");
                Ok(NegativeOutput {
                    negative,
                    mask: None,
                    sort_idx: None,
                })
            }
            NegativeSampler::TripleBased(s) => {
                s.check_set(part)?;
                Ok(s.sample(sample_idx, &d))
            }
        }
    }
}

impl TripleBasedNegative {
    /// Refuses a set other than the one the sampler was built from: its tables have one row
    /// per triple of that set, and the rows of another would index past them or read the
    /// negatives of other triples.
    pub fn check_set(&self, part: &PartitionedTriples) -> Result<()> {
        let rows = self
            .heads
            .as_ref()
            .or(self.tails.as_ref())
            .map_or(0, |t| t.sort_idx.nrows());
        if !self.flat_negative_format && rows != part.len() {
            return Err(BessError::param(
                "partitioned",
                format!("{} triples", part.len()),
                format!("the TripleBased sampler was built for a set of {rows} triples"),
            ));
        }
        Ok(())
    }

    fn sample(&self, sample_idx: &ArrayD<i64>, d: &Dims) -> NegativeOutput {
        let n = d.n;
        let l = self.padded_shard_length;
        let rows: Vec<i64> = sample_idx.iter().copied().collect();
        // Which table serves position (s, a, f): heads or tails.
        let table = |f: usize, c_flat: Option<usize>| -> &PaddedNegatives {
            let use_heads = match self.corruption {
                Corruption::H => true,
                Corruption::T => false,
                Corruption::Ht => match c_flat {
                    Some(c) => c == 0,
                    None => f % d.q < d.q / 2,
                },
            };
            if use_heads {
                self.heads.as_ref().expect("heads built for h/ht")
            } else {
                self.tails.as_ref().expect("tails built for t/ht")
            }
        };
        let fo = if self.flat_negative_format {
            if self.corruption == Corruption::Ht {
                2
            } else {
                1
            }
        } else {
            d.f
        };
        let mut neg = Vec::with_capacity(d.bps * n * n * fo * l);
        let mut mask_g = Vec::with_capacity(neg.capacity());
        for st in 0..d.bps {
            for sn in 0..n {
                for a in 0..n {
                    for f in 0..fo {
                        let (tab, row) = if self.flat_negative_format {
                            (
                                table(
                                    f,
                                    Some(if self.corruption == Corruption::Ht {
                                        f
                                    } else {
                                        0
                                    }),
                                ),
                                0,
                            )
                        } else {
                            (table(f, None), rows[(st * n + a) * d.f + f] as usize)
                        };
                        for i in 0..l {
                            neg.push(tab.padded[[row, sn, i]] as i32);
                            mask_g.push(tab.mask[[row, sn, i]]);
                        }
                    }
                }
            }
        }
        let neg_shape = [d.bps, n, n, fo, l];
        let mask = if self.mask_on_gather {
            ArrayD::from_shape_vec(IxDyn(&neg_shape), mask_g).expect("shape")
        } else {
            // (bps, n_a, F', n_sn, L)
            let g = ArrayD::from_shape_vec(IxDyn(&neg_shape), mask_g).expect("shape");
            let mut p = g.permuted_axes(IxDyn(&[0, 2, 3, 1, 4]));
            p = p.as_standard_layout().into_owned();
            p
        };
        let sort_idx = self.return_sort_idx.then(|| {
            let k = self.n_negative;
            let mut v = Vec::with_capacity(d.bps * n * d.f * k);
            for st in 0..d.bps {
                for a in 0..n {
                    for f in 0..d.f {
                        let (tab, row) = if self.flat_negative_format {
                            let c = match self.corruption {
                                Corruption::Ht => usize::from(f >= d.f / 2),
                                _ => 0,
                            };
                            (
                                table(
                                    f,
                                    Some(if self.corruption == Corruption::Ht {
                                        c
                                    } else {
                                        0
                                    }),
                                ),
                                0,
                            )
                        } else {
                            (table(f, None), rows[(st * n + a) * d.f + f] as usize)
                        };
                        v.extend(tab.sort_idx.row(row).iter().copied());
                    }
                }
            }
            ArrayD::from_shape_vec(IxDyn(&[d.bps, n, d.f, k]), v).expect("shape")
        });
        NegativeOutput {
            negative: ArrayD::from_shape_vec(IxDyn(&neg_shape), neg).expect("shape"),
            mask: Some(mask),
            sort_idx,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{synth, Sharding};

    /// The fused draws (either instruction set's copy, as `SPARSECORE_PREP_ISA` picks) against
    /// one `integers(1 << 31) % count` at a time, for blocks short and long, odd and even, so
    /// that every buffer of `fill_integers_31` and the half word carried between calls are hit.
    #[test]
    fn uniform_draws_equal_single_draws() {
        for n in [1, 3, 4] {
            let part = PartitionedTriples::builder(
                Arc::new(Sharding::create(1000, n, &[7], None).unwrap()),
                PartitionMode::HtShardPair,
            )
            .build(&synth::uniform(1000, 5, 200, 1))
            .unwrap();
            let counts = part.sharding.shard_counts.clone();
            for (k, f) in [
                (1, 1),
                (3, 5),
                (1, 63),
                (1, 64),
                (7, 11),
                (1, 300),
                (1, 513),
                (5, 300),
                (1, 1031),
                (1, 5000),
                (3, 1667),
            ] {
                let mut neg = RandomNegative::new(k, &[5], Corruption::T, false, false).unwrap();
                let mut want = NumpyRng::from_words(&[5]);
                for bps in [1, 2] {
                    let got = neg.draw(&part, bps, f).unwrap().negative;
                    let mut expect = Vec::with_capacity(got.len());
                    for _ in 0..bps {
                        for &c in &counts {
                            expect.extend(
                                (0..n * f * k).map(|_| (i64::from(want.integers_31()) % c) as i32),
                            );
                        }
                    }
                    assert_eq!(
                        got.as_slice().unwrap(),
                        expect,
                        "n {n}, k {k}, f {f}, bps {bps}"
                    );
                }
            }
        }
    }
}
