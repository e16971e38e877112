//! Stage 2: which samples go to which SparseCore, their column ids and gains, as sort keys.
//!
//! For one (stack, local device d, local SparseCore s) this walks every member feature's slice of
//! samples ("split then stack", SPEC 3.3), maps each id to its stacked column id (3.4), computes
//! the combiner gain (3.5), and appends one 64-bit key per id (3.6):
//!
//! ```text
//!  63      58 57                              26 25                  0
//! +----------+----------------------------------+---------------------+
//! |  bucket  |   rotr32(col_id, log2 N)         |  row (unity) or     |
//! | (0 here) |  = partition << (32-nbits) | local|  extraction index   |
//! +----------+----------------------------------+---------------------+
//! ```
//!
//! With unity weights the payload is the sample row and the gain is a per-row value kept in
//! `row_gains`; with weights it is the extraction index, and row and gain are kept per index.
//! Gains use the reference's exact float order: divisors are summed left to right in f32, and
//! sqrtn's squares are summed in f64 with one f32 rounding per step.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::input::{DenseIds, FeatureView, Ids, Offsets, SampleSource};
use crate::group::{bits_for, KeyLayout};
use crate::spec::{Combiner, DeviceLayout, FeaturePlan, DATA_MASK};

/// Per-SparseCore extraction output, reused from batch to batch.
#[derive(Debug, Default, Clone)]
pub struct Extracted {
    /// How this SparseCore's keys are packed.
    pub layout: KeyLayout,
    /// One sort key (or packed key and gain) per extracted id, in extraction order, when the
    /// layout is not [`KeyLayout::narrow`].
    pub keys: Vec<u64>,
    /// Otherwise the keys themselves, as `u32`, in extraction order.
    pub narrow: Vec<u32>,
    /// With [`KeyLayout::packed_wide`]: the gain of each key in `keys`.
    pub packed_gains: Vec<f32>,
    /// Weighted stacks with index payloads: (sample row, gain) of each extraction index, kept
    /// together so that the walk's random lookup touches one cache line.
    pub rows: Vec<(u32, f32)>,
    /// Unity-weight stacks: the gain of each sample row, indexed by the payload `row - row_lo`.
    pub row_gains: Vec<f32>,
    /// First row of this SparseCore (`s * bsps`).
    pub row_lo: u32,
    /// Rows this SparseCore's keys can reference, from `row_lo` on: unity payloads are below it.
    pub row_span: u32,
    /// Where short rows end, for extraction's running payload.
    row_marks: Vec<u32>,
    /// Whether the payload is an extraction index (weighted) or a row (unity).
    pub weighted: bool,
    /// Unity weights with the sum combiner: every gain is 1.0 and `row_gains` is not kept.
    pub unit_gains: bool,
    /// Whether payloads never decrease in extraction order (lets the sort skip them).
    pub data_sorted: bool,
    /// Largest payload so far.
    last_data: u32,
}

impl Extracted {
    /// Grows every buffer to at least `other`'s capacity, so that whatever `other` held fits
    /// here without allocating (see the per-worker workspaces of `Preprocessor`).
    pub fn reserve_like(&mut self, other: &Extracted) {
        reserve_to(&mut self.keys, other.keys.capacity());
        reserve_to(&mut self.rows, other.rows.capacity());
        reserve_to(&mut self.row_gains, other.row_gains.capacity());
        reserve_to(&mut self.narrow, other.narrow.capacity());
        reserve_to(&mut self.packed_gains, other.packed_gains.capacity());
        reserve_to(&mut self.row_marks, other.row_marks.capacity());
    }

    /// Keys extracted.
    pub fn len(&self) -> usize {
        if self.layout.narrow() {
            self.narrow.len()
        } else {
            self.keys.len()
        }
    }

    /// Whether nothing was extracted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline(always)]
    fn push_key(&mut self, key: u64) {
        if self.layout.narrow() {
            self.narrow.push(key as u32);
        } else {
            self.keys.push(key);
        }
    }

    /// Sets the layout and empties the key storage.
    fn reset_keys(&mut self, layout: KeyLayout) {
        self.layout = layout;
        self.keys.clear();
        self.narrow.clear();
        self.packed_gains.clear();
    }
}

/// Stack-wide constants of one extraction.
#[derive(Debug, Clone, Copy)]
pub struct StackCtx<'a> {
    /// Stack name, for errors.
    pub name: &'a str,
    /// Device layout.
    pub layout: DeviceLayout,
    /// Combiner of the stack.
    pub combiner: Combiner,
    /// Whether any member feature has weights.
    pub weighted: bool,
    /// Whether ids are range-checked.
    pub validate_ids: bool,
    /// Per-device stacked batch divided by S.
    pub batch_per_sc: usize,
    /// Local-id bits of the stack's keys (see [`KeyLayout::local_bits_for`]).
    pub local_bits: u32,
}

/// Samples of feature `f` that each local SparseCore takes: `floor(size / (L * S))`.
#[inline]
pub fn samples_per_sc(layout: &DeviceLayout, size: usize) -> usize {
    size / layout.local_scs()
}

/// Extracts SparseCore `sc` of local device `device` into `out`.
///
/// `members` are the stack's features (indices into `features` and `inputs`) in row-offset
/// order.
pub fn extract_sc(
    ctx: &StackCtx<'_>,
    features: &[FeaturePlan],
    members: &[usize],
    inputs: &[&dyn SampleSource],
    device: usize,
    sc: usize,
    out: &mut Extracted,
) -> Result<()> {
    let layout = &ctx.layout;
    let s = layout.sc_per_device;
    out.rows.clear();
    out.weighted = ctx.weighted;
    out.unit_gains = !ctx.weighted && ctx.combiner == Combiner::Sum;
    out.data_sorted = true;
    out.last_data = 0;
    let row_lo = sc * ctx.batch_per_sc;
    out.row_lo = row_lo as u32;

    // Rows this SparseCore can reference: [row_lo, row_hi).
    let mut row_hi = row_lo;
    for &f in members {
        let nsps = samples_per_sc(layout, inputs[f].num_samples());
        row_hi = row_hi.max(row_base(ctx, &features[f], sc) + nsps);
    }
    if row_hi as u64 > DATA_MASK + 1 {
        return Err(Error::BatchTooLarge {
            stack: ctx.name.to_string(),
            what: "samples",
            count: row_hi as u64,
            limit: DATA_MASK,
        });
    }
    let span = row_hi - row_lo;
    out.row_span = span as u32;
    let nbits = layout.partition_bits();
    let row_bits = bits_for(span.saturating_sub(1) as u64);
    // Weighted keys carry their gain when the row fits as payload (beside the key in one `u64`
    // up to 32 key bits, split into 32-bit chunks by the sort up to `32 + MAX_CHUNK_BITS`).
    let packed = ctx.weighted && nbits + ctx.local_bits + row_bits <= 32 + crate::group::MAX_CHUNK_BITS;
    let data_bits = if ctx.weighted {
        // The reference's payload is the extraction index: more than 2^26 weighted ids in one
        // SparseCore corrupt its keys, so they are an error here whichever payload we use.
        let mut total = 0usize;
        for &f in members {
            let nsps = samples_per_sc(layout, inputs[f].num_samples());
            let start = (device * s + sc) * nsps;
            total += slice_ids(&inputs[f].view(), start..start + nsps)
                .ok_or_else(|| Error::input(&features[f].name, "the input's offsets or indices are inconsistent"))?;
        }
        if total as u64 > DATA_MASK + 1 {
            return Err(Error::BatchTooLarge {
                stack: ctx.name.to_string(),
                what: "weighted ids in one SparseCore",
                count: total as u64,
                limit: DATA_MASK,
            });
        }
        if packed {
            row_bits
        } else {
            bits_for(total.saturating_sub(1) as u64)
        }
    } else {
        if !out.unit_gains {
            out.row_gains.clear();
            out.row_gains.resize(span, 0.0);
        }
        row_bits
    };
    out.reset_keys(KeyLayout { nbits, local_bits: ctx.local_bits, data_bits, buckets: false, packed });

    for &f in members {
        let source = inputs[f];
        let plan = &features[f];
        let nsps = samples_per_sc(layout, source.num_samples());
        let start = (device * s + sc) * nsps;
        let mut sink = Sink {
            out: &mut *out,
            ctx,
            plan,
            mask: (layout.num_partitions() - 1) as u32,
            row_base: row_base(ctx, plan, sc) as u32,
            start,
            share: (device * s + sc, layout.local_scs()),
            samples: source.num_samples(),
        };
        sink.feature(source.view(), start..start + nsps)?;
    }
    Ok(())
}

/// Device-level sample index of the feature's first row in SparseCore `sc`:
/// `sc * bsps + row_offset / (G * S)`.
#[inline]
fn row_base(ctx: &StackCtx<'_>, plan: &FeaturePlan, sc: usize) -> usize {
    sc * ctx.batch_per_sc + (plan.row_offset / ctx.layout.num_partitions() as u64) as usize
}

/// Ids in rows `rows` of a view, or `None` if the view is inconsistent (custom sources only).
fn slice_ids(view: &FeatureView<'_>, rows: Range<usize>) -> Option<usize> {
    if rows.is_empty() {
        return Some(0);
    }
    match view {
        FeatureView::Ragged { offsets, .. } => {
            let at = |r: usize| -> Option<i64> {
                match offsets {
                    Offsets::I32(o) => o.get(r).map(|&v| v as i64),
                    Offsets::I64(o) => o.get(r).copied(),
                }
            };
            let (a, b) = (at(rows.start)?, at(rows.end)?);
            (b >= a && a >= 0).then(|| (b - a) as usize)
        }
        FeatureView::Dense { ids: DenseIds::I32(a), .. } => (rows.end <= a.nrows()).then(|| rows.len() * a.ncols()),
        FeatureView::Dense { ids: DenseIds::I64(a), .. } => (rows.end <= a.nrows()).then(|| rows.len() * a.ncols()),
        FeatureView::Coo { indices, ids } => {
            let nnz = ids.len();
            if indices.len() != 2 * nnz {
                return None;
            }
            Some(coo_first_row_at_least(indices, nnz, rows.end).saturating_sub(coo_first_row_at_least(indices, nnz, rows.start)))
        }
    }
}

/// Index of the first of `nnz` COO entries whose row (`indices[2k]`) is at least `row`; rows are
/// sorted (checked by `CooInput`; a custom view that lies gets an error later, not a panic).
fn coo_first_row_at_least(indices: &[i64], nnz: usize, row: usize) -> usize {
    let (mut lo, mut hi) = (0usize, nnz);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if (indices[2 * mid] as u64) < row as u64 {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

fn bad_row(feature: &str, what: &str, r: usize) -> Error {
    Error::input(feature, format!("{what} offsets of sample row {r} are out of bounds or decreasing"))
}

/// The reference computes gains with the x86 flush-to-zero and denormals-are-zero modes on
/// (its worker threads run that way, as its outputs show): a subnormal weight reads as a zero
/// of its sign, and a subnormal result (a quotient, a divisor, a merged sum) becomes one. This
/// applies both, so that every gain op here and in the merge gives the reference's bits
/// (checked by the `finite_hostile_weights` and `subnormal` reference cases in
/// tests/hostile.rs). Normal values, zeros, infinities and NaNs pass unchanged.
#[inline(always)]
pub(crate) fn flush_subnormal(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits(if bits & 0x7f80_0000 == 0 { bits & 0x8000_0000 } else { bits })
}

/// The divisor of a weighted row's gains, from its (already flushed) weights, accumulated
/// exactly as the reference does: sums in f32 left to right, sqrtn's squares summed in f64
/// with one f32 rounding per step, subnormal sums flushed as on its threads.
#[inline(always)]
fn weighted_divisor(combiner: Combiner, weights: impl Iterator<Item = f32>) -> f32 {
    match combiner {
        Combiner::Sum => 1.0f32,
        Combiner::Mean => weights.fold(0.0f32, |acc, w| flush_subnormal(acc + w)),
        Combiner::Sqrtn => weights.fold(0.0f32, |acc, w| flush_subnormal((acc as f64 + (w as f64) * (w as f64)) as f32)).sqrt(),
    }
}

/// Unity-weight gain of a sample with `n` ids.
#[inline(always)]
fn unity_gain(combiner: Combiner, n: usize) -> f32 {
    match combiner {
        Combiner::Sum => 1.0,
        Combiner::Mean => 1.0f32 / n as f32,
        Combiner::Sqrtn => 1.0f32 / (n as f32).sqrt(),
    }
}

/// Where the fast path writes keys, resolved once per slice.
trait KeySink {
    /// Appends the keys of one row's ids (all with payload `data`) and returns whether any id
    /// is at or above `enc.vocab`.
    fn write_row<T: IdValue>(&mut self, ids: &[T], enc: RowEncoder, data: u32) -> bool;
    /// Keys held.
    fn len(&self) -> usize;
    /// ORs `data` into the keys at `range` (written with payload 0); false if out of bounds.
    fn or_payload(&mut self, range: Range<usize>, data: u32) -> bool;
    /// ORs into key `base + k` the payload `first + marks[0] + ... + marks[k]`.
    fn or_running_payload(&mut self, base: usize, marks: &[u32], first: u32);
}

/// Rows shorter than this on average are extracted with a running payload (see
/// `ragged_unity_into`).
const SHORT_ROWS: usize = 8;

/// A feature's id-to-key arithmetic, passed by value so that the row loop keeps it in
/// registers (read through `self`, every field is reloaded per id: the key stores could alias
/// it for all the compiler knows).
#[derive(Clone, Copy)]
struct RowEncoder {
    /// Ids at or above this are out of range.
    vocab: u64,
    shift: u32,
    mask: u32,
    offset: u32,
    layout: KeyLayout,
}

impl RowEncoder {
    #[inline(always)]
    fn key(self, id: u64, data: u32) -> u64 {
        self.layout.encode(0, col_of(id as u32, self.shift, self.mask, self.offset), data)
    }
}

/// A stored key: `u32` when the layout is narrow, else `u64`.
trait KeyWord: Copy + std::ops::BitOrAssign {
    /// A key (which fits this width).
    fn from_key(key: u64) -> Self;
    /// A payload, to OR into a key written with payload 0.
    fn from_payload(data: u32) -> Self;
}
impl KeyWord for u32 {
    #[inline(always)]
    fn from_key(key: u64) -> Self {
        key as u32
    }
    #[inline(always)]
    fn from_payload(data: u32) -> Self {
        data
    }
}
impl KeyWord for u64 {
    #[inline(always)]
    fn from_key(key: u64) -> Self {
        key
    }
    #[inline(always)]
    fn from_payload(data: u32) -> Self {
        data as u64
    }
}

/// Keys appended to `ex.narrow` (`u32`) or `ex.keys` (`u64`).
struct Keys<'a, E>(&'a mut Vec<E>);

impl<E: KeyWord> KeySink for Keys<'_, E> {
    #[inline(always)]
    fn write_row<T: IdValue>(&mut self, ids: &[T], enc: RowEncoder, data: u32) -> bool {
        write_keys(self.0, ids, enc, std::iter::repeat(data))
    }
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn or_payload(&mut self, range: Range<usize>, data: u32) -> bool {
        self.0.get_mut(range).map(|keys| keys.iter_mut().for_each(|k| *k |= E::from_payload(data))).is_some()
    }
    #[inline(always)]
    fn or_running_payload(&mut self, base: usize, marks: &[u32], first: u32) {
        let mut data = first;
        for (k, &m) in self.0[base..].iter_mut().zip(marks) {
            data += m;
            *k |= E::from_payload(data);
        }
    }
}

/// Keys of `ids`, with payloads from `payloads` (one row's, or running extraction indices),
/// appended to `v` in a loop with no branch and no call; returns whether any id is at or above
/// `enc.vocab` (validation is one flag, the offending id is looked up only on error).
#[inline(always)]
#[allow(unsafe_code)]
fn write_keys<E: KeyWord, T: IdValue>(v: &mut Vec<E>, ids: &[T], enc: RowEncoder, payloads: impl Iterator<Item = u32>) -> bool {
    v.reserve(ids.len());
    let len = v.len();
    let mut bad = false;
    for ((slot, &id), data) in v.spare_capacity_mut()[..ids.len()].iter_mut().zip(ids).zip(payloads) {
        let id = id.to_i64() as u64;
        bad |= id >= enc.vocab;
        slot.write(E::from_key(enc.key(id, data)));
    }
    // SAFETY: after `reserve`, the spare capacity holds at least `ids.len()` slots, and the
    // loop above initialised the first `ids.len()` of them (the payloads never run out: both
    // callers pass unbounded ones).
    unsafe { v.set_len(len + ids.len()) };
    bad
}

/// A row offset.
trait OffsetValue: Copy {
    fn to_usize(self) -> usize;
}
impl OffsetValue for i32 {
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as usize
    }
}
impl OffsetValue for i64 {
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as usize
    }
}

/// A value that can be an id.
trait IdValue: Copy {
    fn to_i64(self) -> i64;
}
impl IdValue for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
}
impl IdValue for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
}

struct Sink<'o, 'c> {
    out: &'o mut Extracted,
    ctx: &'c StackCtx<'c>,
    plan: &'c FeaturePlan,
    mask: u32,
    /// Device-level sample index of input row `start`.
    row_base: u32,
    start: usize,
    /// This task's index among the stack's tasks and their number: which share of a COO
    /// view's entries it checks.
    share: (usize, usize),
    /// The source's sample count.
    samples: usize,
}

impl Sink<'_, '_> {
    fn feature(&mut self, view: FeatureView<'_>, rows: Range<usize>) -> Result<()> {
        // `SampleSource` is public, so a view may disagree with its own `num_samples`; the
        // built-in inputs never do, but a malformed custom one must give an error, not a panic.
        let available = match &view {
            FeatureView::Ragged { offsets, .. } => offsets.rows(),
            FeatureView::Dense { ids: DenseIds::I32(a), .. } => a.nrows(),
            FeatureView::Dense { ids: DenseIds::I64(a), .. } => a.nrows(),
            FeatureView::Coo { .. } => usize::MAX,
        };
        let view_weighted = matches!(view, FeatureView::Ragged { weights: Some(_), .. } | FeatureView::Dense { weights: Some(_), .. });
        if view_weighted && !self.ctx.weighted {
            return Err(Error::input(&self.plan.name, "the input's view carries weights but has_weights() is false"));
        }
        if rows.end > available {
            return Err(Error::input(
                &self.plan.name,
                format!("the input reports more samples than its data holds ({} > {available})", rows.end),
            ));
        }
        match view {
            // The hot path: unweighted ragged rows in an unweighted stack.
            FeatureView::Ragged { ids, offsets, weights: None } if !self.ctx.weighted => match (ids, offsets) {
                (Ids::I32(v), Offsets::I32(o)) => self.ragged_unity(v, o, rows),
                (Ids::I32(v), Offsets::I64(o)) => self.ragged_unity(v, o, rows),
                (Ids::I64(v), Offsets::I32(o)) => self.ragged_unity(v, o, rows),
                (Ids::I64(v), Offsets::I64(o)) => self.ragged_unity(v, o, rows),
            },
            FeatureView::Ragged { ids: Ids::I32(v), offsets, weights } => self.ragged(v, offsets, weights, rows),
            FeatureView::Ragged { ids: Ids::I64(v), offsets, weights } => self.ragged(v, offsets, weights, rows),
            FeatureView::Dense { ids: DenseIds::I32(a), weights } => self.dense(a, weights, rows),
            FeatureView::Dense { ids: DenseIds::I64(a), weights } => self.dense(a, weights, rows),
            FeatureView::Coo { indices, ids: Ids::I32(v) } => self.coo(indices, v, rows),
            FeatureView::Coo { indices, ids: Ids::I64(v) } => self.coo(indices, v, rows),
        }
    }

    /// Unweighted ragged rows: one pass, keys written straight into the right-width vector.
    /// Compiled twice (see [`crate::isa`]).
    fn ragged_unity<T: IdValue, O: OffsetValue>(&mut self, ids: &[T], offsets: &[O], rows: Range<usize>) -> Result<()> {
        let sink = self;
        crate::isa::dispatch_v3!(<T: IdValue, O: OffsetValue> (sink: &mut Sink<'_, '_>, ids: &[T], offsets: &[O], rows: Range<usize>) -> Result<()> {
            sink.ragged_unity_body(ids, offsets, rows)
        })
    }

    #[inline(always)]
    fn ragged_unity_body<T: IdValue, O: OffsetValue>(&mut self, ids: &[T], offsets: &[O], rows: Range<usize>) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let total = match (offsets.get(rows.start), offsets.get(rows.end)) {
            // Bounded by the ids too: a hand-written view's last offset may lie, and the
            // difference sizes a reservation.
            (Some(a), Some(b)) if b.to_usize() >= a.to_usize() && b.to_usize() <= ids.len() => {
                b.to_usize() - a.to_usize()
            }
            _ => return Err(bad_row(&self.plan.name, "ids", rows.start)),
        };
        let first = self.row_base - self.out.row_lo;
        if first < self.out.last_data {
            self.out.data_sorted = false;
        }
        self.out.last_data = first + (rows.len() - 1) as u32;
        if self.out.layout.narrow() {
            let mut keys = std::mem::take(&mut self.out.narrow);
            keys.reserve(total);
            let r = self.ragged_unity_into(&mut Keys(&mut keys), ids, offsets, rows);
            self.out.narrow = keys;
            r
        } else {
            let mut keys = std::mem::take(&mut self.out.keys);
            keys.reserve(total);
            let r = self.ragged_unity_into(&mut Keys(&mut keys), ids, offsets, rows);
            self.out.keys = keys;
            r
        }
    }

    /// Two passes, so that short rows (one or two ids, as in Criteo) cost little each: one
    /// loop over all the SparseCore's ids writes their keys with payload 0, then each row ORs
    /// its payload into its own keys.
    #[inline(always)]
    fn ragged_unity_into<K: KeySink, T: IdValue, O: OffsetValue>(
        &mut self,
        keys: &mut K,
        ids: &[T],
        offsets: &[O],
        rows: Range<usize>,
    ) -> Result<()> {
        let combiner = self.ctx.combiner;
        let (vocab, check) = (self.plan.vocabulary_size, self.ctx.validate_ids);
        let enc = RowEncoder {
            vocab: if check { vocab } else { u64::MAX },
            shift: self.plan.col_shift,
            mask: self.mask,
            offset: self.plan.col_offset,
            layout: self.out.layout,
        };
        // The caller checked offsets[start] <= offsets[end] <= ids.len().
        let lo = offsets[rows.start].to_usize();
        let flat = &ids[lo..offsets[rows.end].to_usize()];
        let base = keys.len();
        // (Unchecked, `vocab` is u64::MAX, which only the id -1 reaches.)
        let bad = keys.write_row(flat, enc, 0) && check;
        // The first out-of-range id, and the row that holds it, are looked up only on error.
        let first_bad = || flat.iter().position(|v| v.to_i64() as u64 >= vocab);
        let (first_row, last_row) = (rows.start, rows.end);
        let first_data = self.row_base - self.out.row_lo;
        // The first row whose offsets are broken, and where it starts.
        let mut broken = None;
        if flat.len() < SHORT_ROWS * rows.len() {
            // Short rows: mark where each row ends, and let one running sum over the ids give
            // every key its row, instead of a loop per row.
            let mut marks = std::mem::take(&mut self.out.row_marks);
            marks.clear();
            marks.resize(flat.len() + 1, 0);
            let hi = lo + flat.len();
            let mut prev = lo;
            for (data, r) in (first_data..).zip(rows) {
                let b = offsets[r + 1].to_usize();
                if b < prev || b > hi {
                    broken = Some((r, prev));
                    break;
                }
                marks[b - lo] += 1;
                if combiner != Combiner::Sum && b > prev {
                    self.out.row_gains[data as usize] = unity_gain(combiner, b - prev);
                }
                prev = b;
            }
            if broken.is_none() {
                keys.or_running_payload(base, &marks[..flat.len()], first_data);
            }
            self.out.row_marks = marks;
        } else {
            for (data, r) in (first_data..).zip(rows) {
                let (a, b) = (offsets[r].to_usize(), offsets[r + 1].to_usize());
                if !(a <= b && a >= lo && keys.or_payload(base + (a - lo)..base + (b - lo), data)) {
                    broken = Some((r, a));
                    break;
                }
                if combiner != Combiner::Sum && b > a {
                    self.out.row_gains[data as usize] = unity_gain(combiner, b - a);
                }
            }
        }
        if let Some((r, a)) = broken {
            // An earlier row's bad id comes first, as it would row by row.
            if let Some(k) = if bad { first_bad() } else { None }.filter(|&k| k < a.saturating_sub(lo)) {
                return Err(self.bad_id_at(&offsets[first_row..r], first_row, lo + k, ids));
            }
            return Err(bad_row(&self.plan.name, "ids", r));
        }
        // (Looked up only when some id is bad: the scan is not free.)
        if let Some(k) = if bad { first_bad() } else { None } {
            return Err(self.bad_id_at(&offsets[first_row..last_row], first_row, lo + k, ids));
        }
        Ok(())
    }

    /// `IdOutOfRange` for the id at `ids[k]`, naming the row that holds it: `starts` are the
    /// (checked, non-decreasing) first offsets of rows `first_row..`.
    #[cold]
    fn bad_id_at<T: IdValue, O: OffsetValue>(&self, starts: &[O], first_row: usize, k: usize, ids: &[T]) -> Error {
        // The last row starting at or before k (rows before it are empty or end before k).
        let r = first_row + starts.partition_point(|o| o.to_usize() <= k).saturating_sub(1);
        self.out_of_range(r, ids[k].to_i64())
    }

    fn ragged<T: IdValue>(
        &mut self,
        ids: &[T],
        offsets: Offsets<'_>,
        weights: Option<(&[f32], Offsets<'_>)>,
        rows: Range<usize>,
    ) -> Result<()> {
        if let Some((_, woff)) = weights {
            if woff.rows() < rows.end {
                return Err(Error::input(&self.plan.name, format!("weights have {} rows, ids {}", woff.rows(), offsets.rows())));
            }
        }
        for r in rows {
            let (a, b) = offsets.range(r);
            let row_ids = ids.get(a..b).ok_or_else(|| bad_row(&self.plan.name, "ids", r))?.iter().map(|v| v.to_i64());
            match weights {
                Some((w, woff)) => {
                    let (wa, wb) = woff.range(r);
                    let wrow = w.get(wa..wb).ok_or_else(|| bad_row(&self.plan.name, "weights", r))?;
                    let row_ids = ids.get(a..b).unwrap_or_default();
                    self.weighted_row_slices(r, row_ids, wrow)?
                }
                None => self.row(r, row_ids)?,
            }
        }
        Ok(())
    }

    fn dense<T: IdValue>(
        &mut self,
        ids: ndarray::ArrayView2<'_, T>,
        weights: Option<ndarray::ArrayView2<'_, f32>>,
        rows: Range<usize>,
    ) -> Result<()> {
        if let Some(w) = &weights {
            if w.dim() != ids.dim() {
                return Err(Error::input(
                    &self.plan.name,
                    format!("weights shape {:?} differs from ids shape {:?}", w.dim(), ids.dim()),
                ));
            }
        }
        for r in rows {
            let id_row = ids.row(r);
            let row_ids = id_row.iter().map(|v| v.to_i64());
            match &weights {
                Some(w) => {
                    let w_row = w.row(r);
                    self.weighted_row(r, row_ids, w_row.iter().copied())?
                }
                None => self.row(r, row_ids)?,
            }
        }
        Ok(())
    }

    fn coo<T: IdValue>(&mut self, indices: &[i64], ids: &[T], rows: Range<usize>) -> Result<()> {
        let nnz = ids.len();
        if indices.len() != 2 * nnz {
            return Err(Error::input(&self.plan.name, format!("indices hold {} values for {nnz} ids", indices.len())));
        }
        self.check_coo_share(indices, nnz)?;
        let mut k = coo_first_row_at_least(indices, nnz, rows.start);
        while k < nnz {
            let r = indices[2 * k] as usize;
            if r >= rows.end {
                break;
            }
            if r < rows.start {
                return Err(Error::input(&self.plan.name, format!("indices are not sorted by row at entry {k}")));
            }
            let mut e = k + 1;
            while e < nnz && indices[2 * e] as usize == r {
                e += 1;
            }
            self.row(r, ids[k..e].iter().map(|v| v.to_i64()))?;
            k = e;
        }
        Ok(())
    }

    /// Checks this task's share of a COO view's entries: rows non-decreasing (from the entry
    /// before the share) and inside the batch. Each SparseCore finds its rows by binary search,
    /// which silently skips entries of unsorted rows, and a hand-written view is not checked by
    /// `CooInput::new`; the stack's tasks split the entries between them, so together they
    /// check every entry once.
    fn check_coo_share(&self, indices: &[i64], nnz: usize) -> Result<()> {
        let (part, parts) = self.share;
        let at = |p: usize| (nnz as u128 * p as u128 / parts.max(1) as u128) as usize;
        let (lo, hi) = (at(part), at(part + 1));
        let mut prev = if lo > 0 { indices[2 * (lo - 1)] } else { 0 };
        for k in lo..hi {
            let row = indices[2 * k];
            if row as u64 >= self.samples as u64 {
                return Err(Error::input(
                    &self.plan.name,
                    format!("indices[{k}] has row {row}, outside the batch of {}", self.samples),
                ));
            }
            if row < prev {
                return Err(Error::input(
                    &self.plan.name,
                    format!("indices are not sorted by row: entry {k} has row {row} after row {prev}"),
                ));
            }
            prev = row;
        }
        Ok(())
    }

    /// A row without weights: unity gains, or weights of 1.0 in a weighted stack.
    #[inline]
    fn row<I>(&mut self, r: usize, ids: I) -> Result<()>
    where
        I: ExactSizeIterator<Item = i64> + Clone,
    {
        if self.ctx.weighted {
            let n = ids.len();
            return self.weighted_row(r, ids, std::iter::repeat_n(1.0f32, n));
        }
        let n = ids.len();
        if n == 0 {
            return Ok(());
        }
        let row_id = self.row_base + (r - self.start) as u32;
        let data = row_id - self.out.row_lo;
        if self.ctx.combiner != Combiner::Sum {
            self.out.row_gains[data as usize] = unity_gain(self.ctx.combiner, n);
        }
        if data < self.out.last_data {
            self.out.data_sorted = false;
        }
        self.out.last_data = data;
        let layout = self.out.layout;
        for id in ids {
            let col = self.col_id(r, id)?;
            self.out.push_key(layout.encode(0, col, data));
        }
        Ok(())
    }

    #[cold]
    fn out_of_range(&self, r: usize, id: i64) -> Error {
        Error::IdOutOfRange {
            feature: self.plan.name.clone(),
            table: self.plan.table.clone(),
            row: r,
            id,
            vocabulary_size: self.plan.vocabulary_size,
        }
    }

    /// [`Sink::weighted_row`] over slices (weighted ragged rows, the common weighted input):
    /// the same checks and arithmetic, in loops whose state the compiler keeps in registers.
    #[inline]
    #[allow(unsafe_code)]
    fn weighted_row_slices<T: IdValue>(&mut self, r: usize, ids: &[T], weights: &[f32]) -> Result<()> {
        let n = ids.len();
        if weights.len() != n {
            return Err(Error::WeightsShape { feature: self.plan.name.clone(), row: r, ids: n, weights: weights.len() });
        }
        if let Some(&w) = weights.iter().find(|w| !w.is_finite()) {
            return Err(Error::InvalidWeight { feature: self.plan.name.clone(), row: r, value: w });
        }
        let combiner = self.ctx.combiner;
        // Exactly as `weighted_row`: weights flushed on the way in, sums and quotients out.
        let divisor = weighted_divisor(combiner, weights.iter().map(|&w| flush_subnormal(w)));
        let sum = combiner == Combiner::Sum;
        let gain = move |w: f32| {
            let w = flush_subnormal(w);
            if sum {
                w
            } else {
                flush_subnormal(w / divisor)
            }
        };
        let (vocab, check) = (self.plan.vocabulary_size, self.ctx.validate_ids);
        let enc = RowEncoder {
            vocab: if check { vocab } else { u64::MAX },
            shift: self.plan.col_shift,
            mask: self.mask,
            offset: self.plan.col_offset,
            layout: self.out.layout,
        };
        let row_id = self.row_base + (r - self.start) as u32;
        let mut bad = false;
        if enc.layout.packed {
            let data = row_id - self.out.row_lo;
            if data < self.out.last_data {
                self.out.data_sorted = false;
            }
            self.out.last_data = data;
            if enc.layout.packed_wide() {
                bad = write_keys(&mut self.out.keys, ids, enc, std::iter::repeat(data));
                self.out.packed_gains.extend(weights.iter().map(|&w| gain(w)));
            } else {
                let keys = &mut self.out.keys;
                keys.reserve(n);
                let len = keys.len();
                for ((slot, &id), &w) in keys.spare_capacity_mut()[..n].iter_mut().zip(ids).zip(weights) {
                    let id = id.to_i64() as u64;
                    bad |= id >= enc.vocab;
                    slot.write((enc.key(id, data) << 32) | gain(w).to_bits() as u64);
                }
                // SAFETY: after `reserve`, the spare capacity holds at least n slots, and the
                // loop initialised the first n of them.
                unsafe { keys.set_len(len + n) };
            }
        } else {
            let first = self.out.rows.len();
            if (first + n) as u64 > 1u64 << enc.layout.data_bits {
                // The ids counted up front (which sized the payload) disagree with the rows read.
                return Err(Error::input(&self.plan.name, "the input's offsets or indices are inconsistent"));
            }
            // The payload is the extraction index.
            bad = if enc.layout.narrow() {
                write_keys(&mut self.out.narrow, ids, enc, first as u32..)
            } else {
                write_keys(&mut self.out.keys, ids, enc, first as u32..)
            };
            self.out.rows.extend(weights.iter().map(|&w| (row_id, gain(w))));
        }
        if bad && check {
            let id = ids.iter().map(|v| v.to_i64()).find(|&id| id as u64 >= vocab).unwrap_or_default();
            return Err(self.out_of_range(r, id));
        }
        Ok(())
    }

    #[inline]
    fn weighted_row<I, W>(&mut self, r: usize, ids: I, weights: W) -> Result<()>
    where
        I: ExactSizeIterator<Item = i64> + Clone,
        W: ExactSizeIterator<Item = f32> + Clone,
    {
        let n = ids.len();
        if weights.len() != n {
            return Err(Error::WeightsShape { feature: self.plan.name.clone(), row: r, ids: n, weights: weights.len() });
        }
        for w in weights.clone() {
            if !w.is_finite() {
                return Err(Error::InvalidWeight { feature: self.plan.name.clone(), row: r, value: w });
            }
        }
        // The divisor, accumulated exactly as the reference does, subnormals flushed as on
        // its threads (weights are flushed on the way in, sums and quotients on the way out).
        let weights = weights.map(flush_subnormal);
        let divisor = weighted_divisor(self.ctx.combiner, weights.clone());
        let row_id = self.row_base + (r - self.start) as u32;
        if self.out.layout.packed {
            let data = row_id - self.out.row_lo;
            if data < self.out.last_data {
                self.out.data_sorted = false;
            }
            self.out.last_data = data;
            let layout = self.out.layout;
            let (vocab, check) = (self.plan.vocabulary_size, self.ctx.validate_ids);
            let (shift, mask, offset) = (self.plan.col_shift, self.mask, self.plan.col_offset);
            let sum = self.ctx.combiner == Combiner::Sum;
            // Branch-free like the unweighted path: validation is one flag per row.
            let mut bad = false;
            let wide = layout.packed_wide();
            let Extracted { keys, packed_gains, .. } = &mut *self.out;
            for (id, w) in ids.clone().zip(weights) {
                bad |= check & (id as u64 >= vocab);
                let gain = if sum { w } else { flush_subnormal(w / divisor) };
                let key = layout.encode(0, col_of(id as u32, shift, mask, offset), data);
                if wide {
                    keys.push(key);
                    packed_gains.push(gain);
                } else {
                    keys.push((key << 32) | gain.to_bits() as u64);
                }
            }
            if bad {
                let id = ids.into_iter().find(|&id| id as u64 >= vocab).unwrap_or_default();
                return Err(self.out_of_range(r, id));
            }
            return Ok(());
        }
        let first = self.out.rows.len();
        if (first + n) as u64 > 1u64 << self.out.layout.data_bits {
            // The ids counted up front (which sized the payload) disagree with the rows read.
            return Err(Error::input(&self.plan.name, "the input's offsets or indices are inconsistent"));
        }
        for (k, (id, w)) in ids.zip(weights).enumerate() {
            let col = self.col_id(r, id)?;
            let gain = match self.ctx.combiner {
                Combiner::Sum => w,
                _ => flush_subnormal(w / divisor),
            };
            let key = self.out.layout.encode(0, col, (first + k) as u32);
            self.out.push_key(key);
            self.out.rows.push((row_id, gain));
        }
        Ok(())
    }

    /// SPEC 3.4: `((id + shift) & (N-1)) + (id & !(N-1)) + col_offset`, in 32-bit wrapping
    /// arithmetic like the reference (only reachable with out-of-range ids when validation is
    /// off).
    #[inline(always)]
    fn col_id(&self, r: usize, id: i64) -> Result<u32> {
        // One unsigned compare: a negative id wraps far above any vocabulary.
        if self.ctx.validate_ids && id as u64 >= self.plan.vocabulary_size {
            return Err(self.out_of_range(r, id));
        }
        Ok(col_of(id as u32, self.plan.col_shift, self.mask, self.plan.col_offset))
    }
}

/// SPEC 3.4's column of a (validated) id: shard rotation within the low bits, then the stacking
/// offset, in 32-bit wrapping arithmetic.
#[inline(always)]
fn col_of(id: u32, shift: u32, mask: u32, offset: u32) -> u32 {
    ((id.wrapping_add(shift) & mask) | (id & !mask)).wrapping_add(offset)
}

/// Grows `v`'s capacity to at least `cap` (keeping its contents).
pub(crate) fn reserve_to<T>(v: &mut Vec<T>, cap: usize) {
    if v.capacity() < cap {
        v.reserve_exact(cap - v.len());
    }
}
