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

use crate::error::{BatchCount, Error, Result};
use crate::extracted::Extracted;
use crate::gain::{flush_subnormal, unity_gain, weighted_divisor, weighted_gain};
use crate::input::{DenseIds, FeatureView, Ids, Offsets, SampleSource};
use crate::key::{Gains, KeyFormat, KeySetShape, KeyStorage, KeyWord};
use crate::reuse::reserve_to;
use crate::spec::{Combiner, DeviceLayout, FeaturePlan, DATA_MASK};

/// Extraction's own reused memory, beside the [`Extracted`] keys it writes.
#[derive(Debug, Default, Clone)]
pub struct ExtractScratch {
    /// Where short rows end, for the running payload of `ragged_unity_into`.
    row_marks: Vec<u32>,
    /// A copy of a dense row that is not contiguous in memory, and its weights.
    row_ids: Vec<i64>,
    row_weights: Vec<f32>,
    /// Weights of 1.0, for rows without weights in a weighted stack.
    ones: Vec<f32>,
    /// Largest payload so far, to tell whether payloads stayed sorted.
    last_payload: u32,
}

impl ExtractScratch {
    /// Grows the buffers to at least `other`'s capacity.
    pub fn reserve_like(&mut self, other: &ExtractScratch) {
        reserve_to(&mut self.row_marks, other.row_marks.capacity());
        reserve_to(&mut self.row_ids, other.row_ids.capacity());
        reserve_to(&mut self.row_weights, other.row_weights.capacity());
        reserve_to(&mut self.ones, other.ones.capacity());
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
    /// Local-id bits of the stack's keys (see [`KeyFormat::local_bits_for`]).
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
#[allow(clippy::too_many_arguments)]
pub fn extract_sc(
    ctx: &StackCtx<'_>,
    features: &[FeaturePlan],
    members: &[usize],
    inputs: &[&dyn SampleSource],
    device: usize,
    sc: usize,
    out: &mut Extracted,
    scratch: &mut ExtractScratch,
) -> Result<()> {
    let layout = &ctx.layout;
    let s = layout.sc_per_device;
    let first_row = sc * ctx.batch_per_sc;

    // Rows this SparseCore can reference: [first_row, row_end).
    let mut row_end = first_row;
    for &f in members {
        let nsps = samples_per_sc(layout, inputs[f].num_samples());
        row_end = row_end.max(row_base(ctx, &features[f], sc) + nsps);
    }
    if row_end as u64 > DATA_MASK + 1 {
        return Err(Error::BatchTooLarge {
            stack: ctx.name.to_string(),
            what: BatchCount::Samples,
            count: row_end as u64,
            limit: DATA_MASK,
        });
    }
    let row_span = row_end - first_row;
    // The reference's payload is the extraction index: more than 2^26 weighted ids in one
    // SparseCore corrupt its keys, so they are an error here whichever payload we use.
    let weighted_ids = if ctx.weighted {
        let mut total = 0usize;
        for &f in members {
            let nsps = samples_per_sc(layout, inputs[f].num_samples());
            let start = (device * s + sc) * nsps;
            total += slice_ids(&inputs[f].view(), start..start + nsps)
                .ok_or_else(|| {
                    Error::input(&features[f].name, format!("the input's offsets or indices are inconsistent in samples {start}..{} (device {device}, SparseCore {sc})", start + nsps))
                })?;
        }
        if total as u64 > DATA_MASK + 1 {
            return Err(Error::BatchTooLarge {
                stack: ctx.name.to_string(),
                what: BatchCount::WeightedIds,
                count: total as u64,
                limit: DATA_MASK,
            });
        }
        total
    } else {
        0
    };
    let shape = KeySetShape {
        nbits: layout.partition_bits(),
        local_bits: ctx.local_bits,
        row_span,
        weighted: ctx.weighted,
        combiner: ctx.combiner,
    };
    out.reset(
        KeyFormat::for_sparsecore(shape, || weighted_ids),
        first_row as u32,
        row_span as u32,
    );
    scratch.last_payload = 0;

    for &f in members {
        let source = inputs[f];
        let plan = &features[f];
        let nsps = samples_per_sc(layout, source.num_samples());
        let start = (device * s + sc) * nsps;
        let mut extractor = SliceExtractor {
            out: &mut *out,
            scratch: &mut *scratch,
            ctx,
            plan,
            mask: (layout.num_partitions() - 1) as u32,
            row_base: row_base(ctx, plan, sc) as u32,
            start,
            share: (device * s + sc, layout.local_scs()),
            samples: source.num_samples(),
        };
        extractor.feature(source.view(), start..start + nsps)?;
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
        FeatureView::Dense {
            ids: DenseIds::I32(a),
            ..
        } => (rows.end <= a.nrows()).then(|| rows.len() * a.ncols()),
        FeatureView::Dense {
            ids: DenseIds::I64(a),
            ..
        } => (rows.end <= a.nrows()).then(|| rows.len() * a.ncols()),
        FeatureView::Coo { indices, ids } => {
            let nnz = ids.len();
            if indices.len() != 2 * nnz {
                return None;
            }
            Some(
                coo_first_row_at_least(indices, nnz, rows.end)
                    .saturating_sub(coo_first_row_at_least(indices, nnz, rows.start)),
            )
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
    Error::input(
        feature,
        format!("{what} offsets of sample row {r} are out of bounds or decreasing"),
    )
}

/// Where the fast path writes keys, resolved once per slice.
trait KeyWriter {
    /// Appends the keys of one row's ids (all with payload `data`) and returns whether any id
    /// is at or above `enc.vocab`.
    fn write_row<T: InputInt>(&mut self, ids: &[T], enc: RowEncoder, data: u32) -> bool;
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
    format: KeyFormat,
}

impl RowEncoder {
    #[inline(always)]
    fn key(self, id: u64, data: u32) -> u64 {
        self.format
            .encode(col_of(id as u32, self.shift, self.mask, self.offset), data)
    }
}

/// Writes one weighted row's [`KeyStorage::GainBelowKey`] elements (`key << 32 | gain bits`)
/// into `slots` (as long as `ids` and `weights`); true if an id is out of range.
#[inline(always)]
fn write_gain_below_key<T: InputInt>(
    slots: &mut [std::mem::MaybeUninit<u64>],
    ids: &[T],
    weights: &[f32],
    enc: RowEncoder,
    data: u32,
    gain: impl Fn(f32) -> f32,
) -> bool {
    let mut bad = false;
    for ((slot, &id), &w) in slots.iter_mut().zip(ids).zip(weights) {
        let id = id.to_i64() as u64;
        bad |= id >= enc.vocab;
        slot.write((enc.key(id, data) << 32) | gain(w).to_bits() as u64);
    }
    bad
}

/// Keys appended to `narrow_keys` (`u32`) or `wide_keys` (`u64`).
struct KeyVec<'a, E>(&'a mut Vec<E>);

impl<E: KeyWord> KeyWriter for KeyVec<'_, E> {
    #[inline(always)]
    fn write_row<T: InputInt>(&mut self, ids: &[T], enc: RowEncoder, data: u32) -> bool {
        write_keys(self.0, ids, enc, std::iter::repeat(data))
    }
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn or_payload(&mut self, range: Range<usize>, data: u32) -> bool {
        self.0
            .get_mut(range)
            .map(|keys| keys.iter_mut().for_each(|k| *k |= E::from_u64(data as u64)))
            .is_some()
    }
    #[inline(always)]
    fn or_running_payload(&mut self, base: usize, marks: &[u32], first: u32) {
        let mut data = first;
        for (k, &m) in self.0[base..].iter_mut().zip(marks) {
            data += m;
            *k |= E::from_u64(data as u64);
        }
    }
}

/// Keys of `ids`, with payloads from `payloads` (one row's, or running extraction indices),
/// appended to `v` in a loop with no branch and no call; returns whether any id is at or above
/// `enc.vocab` (validation is one flag, the offending id is looked up only on error).
#[inline(always)]
#[allow(unsafe_code)]
fn write_keys<E: KeyWord, T: InputInt>(
    v: &mut Vec<E>,
    ids: &[T],
    enc: RowEncoder,
    payloads: impl Iterator<Item = u32>,
) -> bool {
    v.reserve(ids.len());
    let len = v.len();
    let mut bad = false;
    for ((slot, &id), data) in v.spare_capacity_mut()[..ids.len()]
        .iter_mut()
        .zip(ids)
        .zip(payloads)
    {
        let id = id.to_i64() as u64;
        bad |= id >= enc.vocab;
        slot.write(E::from_u64(enc.key(id, data)));
    }
    // SAFETY: after `reserve`, the spare capacity holds at least `ids.len()` slots, and the
    // loop above initialised the first `ids.len()` of them (the payloads never run out: both
    // callers pass unbounded ones).
    unsafe { v.set_len(len + ids.len()) };
    bad
}

/// An id or row offset of an input view: `i32` or `i64` (balancing's counting reads the same
/// views).
pub(crate) trait InputInt: Copy {
    fn to_i64(self) -> i64;
    fn to_usize(self) -> usize;
}
impl InputInt for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as usize
    }
}
impl InputInt for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as usize
    }
}

/// Extracts one feature's slice of samples for one SparseCore into its [`Extracted`] keys.
struct SliceExtractor<'o, 'c> {
    out: &'o mut Extracted,
    scratch: &'o mut ExtractScratch,
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

impl SliceExtractor<'_, '_> {
    fn feature(&mut self, view: FeatureView<'_>, rows: Range<usize>) -> Result<()> {
        // `SampleSource` is public, so a view may disagree with its own `num_samples`; the
        // built-in inputs never do, but a malformed custom one must give an error, not a panic.
        let available = match &view {
            FeatureView::Ragged { offsets, .. } => offsets.rows(),
            FeatureView::Dense {
                ids: DenseIds::I32(a),
                ..
            } => a.nrows(),
            FeatureView::Dense {
                ids: DenseIds::I64(a),
                ..
            } => a.nrows(),
            FeatureView::Coo { .. } => usize::MAX,
        };
        let view_weighted = matches!(
            view,
            FeatureView::Ragged {
                weights: Some(_),
                ..
            } | FeatureView::Dense {
                weights: Some(_),
                ..
            }
        );
        if view_weighted && !self.ctx.weighted {
            return Err(Error::input(
                &self.plan.name,
                "the input's view carries weights but has_weights() is false",
            ));
        }
        if rows.end > available {
            return Err(Error::input(
                &self.plan.name,
                format!(
                    "the input reports more samples than its data holds ({} > {available})",
                    rows.end
                ),
            ));
        }
        match view {
            // The hot path: unweighted ragged rows in an unweighted stack.
            FeatureView::Ragged {
                ids,
                offsets,
                weights: None,
            } if !self.ctx.weighted => match (ids, offsets) {
                (Ids::I32(v), Offsets::I32(o)) => self.ragged_unity(v, o, rows),
                (Ids::I32(v), Offsets::I64(o)) => self.ragged_unity(v, o, rows),
                (Ids::I64(v), Offsets::I32(o)) => self.ragged_unity(v, o, rows),
                (Ids::I64(v), Offsets::I64(o)) => self.ragged_unity(v, o, rows),
            },
            FeatureView::Ragged {
                ids: Ids::I32(v),
                offsets,
                weights,
            } => self.ragged(v, offsets, weights, rows),
            FeatureView::Ragged {
                ids: Ids::I64(v),
                offsets,
                weights,
            } => self.ragged(v, offsets, weights, rows),
            FeatureView::Dense {
                ids: DenseIds::I32(a),
                weights,
            } => self.dense(a, weights, rows),
            FeatureView::Dense {
                ids: DenseIds::I64(a),
                weights,
            } => self.dense(a, weights, rows),
            FeatureView::Coo {
                indices,
                ids: Ids::I32(v),
            } => self.coo(indices, v, rows),
            FeatureView::Coo {
                indices,
                ids: Ids::I64(v),
            } => self.coo(indices, v, rows),
        }
    }

    /// Unweighted ragged rows: one pass, keys written straight into the right-width vector.
    /// Compiled twice (see [`crate::isa`]).
    fn ragged_unity<T: InputInt, O: InputInt>(
        &mut self,
        ids: &[T],
        offsets: &[O],
        rows: Range<usize>,
    ) -> Result<()> {
        let extractor = self;
        crate::dispatch_v3!(<T: InputInt, O: InputInt> (extractor: &mut SliceExtractor<'_, '_>, ids: &[T], offsets: &[O], rows: Range<usize>) -> Result<()> {
            extractor.ragged_unity_body(ids, offsets, rows)
        })
    }

    #[inline(always)]
    fn ragged_unity_body<T: InputInt, O: InputInt>(
        &mut self,
        ids: &[T],
        offsets: &[O],
        rows: Range<usize>,
    ) -> Result<()> {
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
        let first = self.row_base - self.out.first_row;
        self.note_payloads(first, first + (rows.len() - 1) as u32);
        if self.out.format.storage() == KeyStorage::Narrow {
            let mut keys = std::mem::take(&mut self.out.narrow_keys);
            keys.reserve(total);
            let r = self.ragged_unity_into(&mut KeyVec(&mut keys), ids, offsets, rows);
            self.out.narrow_keys = keys;
            r
        } else {
            let mut keys = std::mem::take(&mut self.out.wide_keys);
            keys.reserve(total);
            let r = self.ragged_unity_into(&mut KeyVec(&mut keys), ids, offsets, rows);
            self.out.wide_keys = keys;
            r
        }
    }

    /// Two passes, so that short rows (one or two ids, as in Criteo) cost little each: one
    /// loop over all the SparseCore's ids writes their keys with payload 0, then each row ORs
    /// its payload into its own keys.
    #[inline(always)]
    fn ragged_unity_into<K: KeyWriter, T: InputInt, O: InputInt>(
        &mut self,
        keys: &mut K,
        ids: &[T],
        offsets: &[O],
        rows: Range<usize>,
    ) -> Result<()> {
        let combiner = self.ctx.combiner;
        let (vocab, check) = (self.plan.vocabulary_size, self.ctx.validate_ids);
        let enc = self.encoder();
        // The caller checked offsets[start] <= offsets[end] <= ids.len().
        let lo = offsets[rows.start].to_usize();
        let flat = &ids[lo..offsets[rows.end].to_usize()];
        let base = keys.len();
        // (Unchecked, `vocab` is u64::MAX, which only the id -1 reaches.)
        let bad = keys.write_row(flat, enc, 0) && check;
        // The first out-of-range id, and the row that holds it, are looked up only on error.
        let first_bad = || flat.iter().position(|v| v.to_i64() as u64 >= vocab);
        let (first_row, last_row) = (rows.start, rows.end);
        let first_data = self.row_base - self.out.first_row;
        // The first row whose offsets are broken, and where it starts.
        let mut broken = None;
        if flat.len() < SHORT_ROWS * rows.len() {
            // Short rows: mark where each row ends, and let one running sum over the ids give
            // every key its row, instead of a loop per row.
            let mut marks = std::mem::take(&mut self.scratch.row_marks);
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
            self.scratch.row_marks = marks;
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
            if let Some(k) =
                if bad { first_bad() } else { None }.filter(|&k| k < a.saturating_sub(lo))
            {
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
    fn bad_id_at<T: InputInt, O: InputInt>(
        &self,
        starts: &[O],
        first_row: usize,
        k: usize,
        ids: &[T],
    ) -> Error {
        // The last row starting at or before k (rows before it are empty or end before k).
        let r = first_row
            + starts
                .partition_point(|o| o.to_usize() <= k)
                .saturating_sub(1);
        self.out_of_range(r, ids[k].to_i64())
    }

    /// Ragged rows with weights, or in a weighted stack. Compiled twice (see [`crate::isa`]):
    /// the per-id loops of [`SliceExtractor::weighted_row`] are most of a weighted batch's
    /// extraction.
    fn ragged<T: InputInt>(
        &mut self,
        ids: &[T],
        offsets: Offsets<'_>,
        weights: Option<(&[f32], Offsets<'_>)>,
        rows: Range<usize>,
    ) -> Result<()> {
        let extractor = self;
        crate::dispatch_v3!(<T: InputInt> (extractor: &mut SliceExtractor<'_, '_>, ids: &[T], offsets: Offsets<'_>, weights: Option<(&[f32], Offsets<'_>)>, rows: Range<usize>) -> Result<()> {
            extractor.ragged_body(ids, offsets, weights, rows)
        })
    }

    #[inline(always)]
    fn ragged_body<T: InputInt>(
        &mut self,
        ids: &[T],
        offsets: Offsets<'_>,
        weights: Option<(&[f32], Offsets<'_>)>,
        rows: Range<usize>,
    ) -> Result<()> {
        if let Some((_, woff)) = weights {
            if woff.rows() < rows.end {
                return Err(Error::input(
                    &self.plan.name,
                    format!("weights have {} rows, ids {}", woff.rows(), offsets.rows()),
                ));
            }
        }
        for r in rows {
            let (a, b) = offsets.range(r);
            let row_ids = ids
                .get(a..b)
                .ok_or_else(|| bad_row(&self.plan.name, "ids", r))?;
            match weights {
                Some((w, woff)) => {
                    let (wa, wb) = woff.range(r);
                    let wrow = w
                        .get(wa..wb)
                        .ok_or_else(|| bad_row(&self.plan.name, "weights", r))?;
                    self.weighted_row(r, row_ids, wrow)?
                }
                None => self.row(r, row_ids)?,
            }
        }
        Ok(())
    }

    fn dense<T: InputInt>(
        &mut self,
        ids: ndarray::ArrayView2<'_, T>,
        weights: Option<ndarray::ArrayView2<'_, f32>>,
        rows: Range<usize>,
    ) -> Result<()> {
        if let Some(w) = &weights {
            if w.dim() != ids.dim() {
                return Err(Error::input(
                    &self.plan.name,
                    format!(
                        "weights shape {:?} differs from ids shape {:?}",
                        w.dim(),
                        ids.dim()
                    ),
                ));
            }
        }
        for r in rows {
            let id_row = ids.row(r);
            let weight_row = weights.as_ref().map(|w| w.row(r));
            match (id_row.as_slice(), weight_row.as_ref().map(|w| w.as_slice())) {
                (Some(row_ids), None) => self.row(r, row_ids)?,
                (Some(row_ids), Some(Some(row_weights))) => {
                    self.weighted_row(r, row_ids, row_weights)?
                }
                // Rows that are not contiguous (a strided view) are copied into scratch first.
                _ => {
                    let mut row_ids = std::mem::take(&mut self.scratch.row_ids);
                    row_ids.clear();
                    row_ids.extend(id_row.iter().map(|v| v.to_i64()));
                    let result = match &weight_row {
                        Some(w) => {
                            let mut row_weights = std::mem::take(&mut self.scratch.row_weights);
                            row_weights.clear();
                            row_weights.extend(w.iter().copied());
                            let result = self.weighted_row(r, &row_ids, &row_weights);
                            self.scratch.row_weights = row_weights;
                            result
                        }
                        None => self.row(r, &row_ids),
                    };
                    self.scratch.row_ids = row_ids;
                    result?
                }
            }
        }
        Ok(())
    }

    fn coo<T: InputInt>(&mut self, indices: &[i64], ids: &[T], rows: Range<usize>) -> Result<()> {
        let nnz = ids.len();
        if indices.len() != 2 * nnz {
            return Err(Error::input(
                &self.plan.name,
                format!("indices hold {} values for {nnz} ids", indices.len()),
            ));
        }
        self.check_coo_share(indices, nnz)?;
        let mut k = coo_first_row_at_least(indices, nnz, rows.start);
        while k < nnz {
            let r = indices[2 * k] as usize;
            if r >= rows.end {
                break;
            }
            if r < rows.start {
                return Err(Error::input(
                    &self.plan.name,
                    format!("indices are not sorted by row at entry {k}"),
                ));
            }
            let mut e = k + 1;
            while e < nnz && indices[2 * e] as usize == r {
                e += 1;
            }
            self.row(r, &ids[k..e])?;
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
                    format!(
                        "indices[{k}] has row {row}, outside the batch of {}",
                        self.samples
                    ),
                ));
            }
            if row < prev {
                return Err(Error::input(
                    &self.plan.name,
                    format!(
                        "indices are not sorted by row: entry {k} has row {row} after row {prev}"
                    ),
                ));
            }
            prev = row;
        }
        Ok(())
    }

    /// A row without weights: unity gains, or weights of 1.0 in a weighted stack.
    #[inline]
    fn row<T: InputInt>(&mut self, r: usize, ids: &[T]) -> Result<()> {
        let n = ids.len();
        if self.ctx.weighted {
            let mut ones = std::mem::take(&mut self.scratch.ones);
            if ones.len() < n {
                ones.resize(n, 1.0);
            }
            let result = self.weighted_row(r, ids, &ones[..n]);
            self.scratch.ones = ones;
            return result;
        }
        if n == 0 {
            return Ok(());
        }
        let row_id = self.row_base + (r - self.start) as u32;
        let data = row_id - self.out.first_row;
        if self.out.format.gains == Gains::PerRow {
            self.out.row_gains[data as usize] = unity_gain(self.ctx.combiner, n);
        }
        self.note_payloads(data, data);
        let layout = self.out.format;
        for &id in ids {
            let col = self.col_id(r, id.to_i64())?;
            self.out.push_key(layout.encode(col, data));
        }
        Ok(())
    }

    /// Records that the keys just written carry payloads `first..=last`, in order; a payload
    /// below an earlier one means the sort cannot rely on them (see `group::sort`).
    #[inline(always)]
    fn note_payloads(&mut self, first: u32, last: u32) {
        if first < self.scratch.last_payload {
            self.out.payloads_sorted = false;
        }
        self.scratch.last_payload = last;
    }

    /// This feature's id-to-key arithmetic, for the row loops.
    #[inline(always)]
    fn encoder(&self) -> RowEncoder {
        RowEncoder {
            vocab: if self.ctx.validate_ids {
                self.plan.vocabulary_size
            } else {
                u64::MAX
            },
            shift: self.plan.col_shift,
            mask: self.mask,
            offset: self.plan.col_offset,
            format: self.out.format,
        }
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

    /// A row with weights (or weights of 1.0, see [`SliceExtractor::row`]), in loops whose state
    /// the compiler keeps in registers.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn weighted_row<T: InputInt>(&mut self, r: usize, ids: &[T], weights: &[f32]) -> Result<()> {
        let n = ids.len();
        if weights.len() != n {
            return Err(Error::WeightsShape {
                feature: self.plan.name.clone(),
                row: r,
                ids: n,
                weights: weights.len(),
            });
        }
        if let Some(&w) = weights.iter().find(|w| !w.is_finite()) {
            return Err(Error::InvalidWeight {
                feature: self.plan.name.clone(),
                row: r,
                value: w,
            });
        }
        let combiner = self.ctx.combiner;
        // Weights are flushed on the way in, sums and quotients on the way out.
        let divisor = weighted_divisor(combiner, weights.iter().map(|&w| flush_subnormal(w)));
        let gain = move |w: f32| weighted_gain(combiner, flush_subnormal(w), divisor);
        let (vocab, check) = (self.plan.vocabulary_size, self.ctx.validate_ids);
        let enc = self.encoder();
        let row_id = self.row_base + (r - self.start) as u32;
        let storage = enc.format.storage();
        let bad = if enc.format.gains == Gains::InKey {
            let data = row_id - self.out.first_row;
            self.note_payloads(data, data);
            if storage == KeyStorage::GainBesideKey {
                self.out.key_gains.extend(weights.iter().map(|&w| gain(w)));
                write_keys(&mut self.out.wide_keys, ids, enc, std::iter::repeat(data))
            } else {
                let keys = &mut self.out.wide_keys;
                keys.reserve(n);
                let len = keys.len();
                let slots = &mut keys.spare_capacity_mut()[..n];
                // The sum's gain is the flushed weight: its own loop, free of the combiner test.
                let bad = if combiner == Combiner::Sum {
                    write_gain_below_key(slots, ids, weights, enc, data, flush_subnormal)
                } else {
                    write_gain_below_key(slots, ids, weights, enc, data, gain)
                };
                // SAFETY: after `reserve`, the spare capacity holds at least n slots, and
                // `write_gain_below_key` initialised all n of them (ids and weights are n long).
                unsafe { keys.set_len(len + n) };
                bad
            }
        } else {
            let first = self.out.index_rows.len();
            if (first + n) as u64 > 1u64 << enc.format.data_bits {
                // The ids counted up front (which sized the payload) disagree with the rows read.
                return Err(Error::input(
                    &self.plan.name,
                    format!("the input's offsets or indices are inconsistent: {} ids read, past the {} counted up front", first + n, 1u64 << enc.format.data_bits),
                ));
            }
            self.out
                .index_rows
                .extend(weights.iter().map(|&w| (row_id, gain(w))));
            // The payload is the extraction index.
            if storage == KeyStorage::Narrow {
                write_keys(&mut self.out.narrow_keys, ids, enc, first as u32..)
            } else {
                write_keys(&mut self.out.wide_keys, ids, enc, first as u32..)
            }
        };
        if bad && check {
            let id = ids
                .iter()
                .map(|v| v.to_i64())
                .find(|&id| id as u64 >= vocab)
                .unwrap_or_default();
            return Err(self.out_of_range(r, id));
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
        Ok(col_of(
            id as u32,
            self.plan.col_shift,
            self.mask,
            self.plan.col_offset,
        ))
    }
}

/// SPEC 3.4's column of a (validated) id: shard rotation within the low bits, then the stacking
/// offset, in 32-bit wrapping arithmetic.
#[inline(always)]
pub(crate) fn col_of(id: u32, shift: u32, mask: u32, offset: u32) -> u32 {
    ((id.wrapping_add(shift) & mask) | (id & !mask)).wrapping_add(offset)
}
