//! Stage 1: borrowed, zero-copy views of one feature's ids (and weights) for one local batch.
//!
//! Four layouts arrive in practice: dense 2-D arrays (fixed valency), ragged row splits + values
//! (TF/PyTorch style), sparse COO (`indices`/`values`/`dense_shape`), and Arrow list columns.
//! Each implements [`SampleSource`], which hands the pipeline a [`FeatureView`]: a small enum of
//! borrowed slices that the extract stage matches once per (feature, SparseCore) slice, so the
//! per-id loops are monomorphic and nothing is copied.
//!
//! The one exception is hashed features (raw string/int64 keys, [`hash`]): their ids are
//! computed, so the view owns them.
//!
//! Constructors check structure (offsets monotone and in bounds, weights of the ids' shape, COO
//! rows sorted and inside the batch); values (id ranges, finite weights) are checked during
//! extraction, where each id is read anyway.

pub(crate) mod arrow;
mod coo;
mod dense;
pub mod hash;
mod ragged;

pub use self::arrow::{
    features_from_record_batch, features_from_record_batch_reusing, ArrowListInput, RawKeyRows,
};
pub use coo::CooInput;
pub use dense::DenseInput;
pub use hash::HashBuffers;
pub use ragged::RaggedInput;

use ndarray::ArrayView2;

use crate::error::{Error, Result};

/// A column of ids, 32- or 64-bit. 64-bit ids are range-checked before they are narrowed.
#[derive(Debug, Clone, Copy)]
pub enum Ids<'a> {
    /// 32-bit ids.
    I32(&'a [i32]),
    /// 64-bit ids.
    I64(&'a [i64]),
}

impl Ids<'_> {
    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            Ids::I32(v) => v.len(),
            Ids::I64(v) => v.len(),
        }
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Row offsets into a flat values column: row `r` is `values[offsets[r]..offsets[r + 1]]`.
#[derive(Debug, Clone, Copy)]
pub enum Offsets<'a> {
    /// 32-bit offsets (Arrow `List`, TF `row_splits` of int32).
    I32(&'a [i32]),
    /// 64-bit offsets (Arrow `LargeList`, TF `row_splits` of int64).
    I64(&'a [i64]),
}

impl Offsets<'_> {
    /// Number of rows described (one less than the number of offsets).
    pub fn rows(&self) -> usize {
        match self {
            Offsets::I32(o) => o.len().saturating_sub(1),
            Offsets::I64(o) => o.len().saturating_sub(1),
        }
    }

    /// The `[start, end)` range of row `r`. Valid after [`Offsets::validate`].
    #[inline(always)]
    pub fn range(&self, r: usize) -> (usize, usize) {
        match self {
            Offsets::I32(o) => (o[r] as usize, o[r + 1] as usize),
            Offsets::I64(o) => (o[r] as usize, o[r + 1] as usize),
        }
    }

    /// Checks that offsets are non-empty, non-negative, non-decreasing and end within `len`
    /// values, so that [`Offsets::range`] can never index out of bounds.
    pub fn validate(&self, feature: &str, what: &str, len: usize) -> Result<()> {
        fn check<T: Copy + Into<i64> + PartialOrd>(
            o: &[T],
            feature: &str,
            what: &str,
            len: usize,
        ) -> Result<()> {
            if o.is_empty() {
                return Err(Error::input(
                    feature,
                    format!("{what} cannot be empty (need rows + 1 offsets)"),
                ));
            }
            let mut prev: i64 = o[0].into();
            if prev < 0 {
                return Err(Error::input(
                    feature,
                    format!("{what}[0] = {prev} is negative"),
                ));
            }
            // One branch-free pass first (it vectorises: a batch's offsets are checked on the
            // calling thread before the parallel work starts, so this loop is serial time);
            // the row of a decrease is looked up only when there is one.
            let sorted = o
                .iter()
                .zip(&o[1..])
                .fold(true, |ok, (&a, &b)| ok & (a <= b));
            if !sorted {
                for (i, &v) in o.iter().enumerate().skip(1) {
                    let v: i64 = v.into();
                    if v < prev {
                        return Err(Error::input(
                            feature,
                            format!("{what} decrease at row {}: {prev} then {v}", i - 1),
                        ));
                    }
                    prev = v;
                }
            }
            let prev: i64 = o[o.len() - 1].into();
            if prev as u64 > len as u64 {
                return Err(Error::input(
                    feature,
                    format!("{what} end at {prev}, past the {len} values"),
                ));
            }
            Ok(())
        }
        match self {
            Offsets::I32(o) => check(o, feature, what, len),
            Offsets::I64(o) => check(o, feature, what, len),
        }
    }
}

/// Dense ids of fixed valency, `[batch, valency]`, read through their strides.
#[derive(Debug, Clone)]
pub enum DenseIds<'a> {
    /// 32-bit ids.
    I32(ArrayView2<'a, i32>),
    /// 64-bit ids.
    I64(ArrayView2<'a, i64>),
}

/// What the extract stage sees of one feature: borrowed slices, never copies.
#[derive(Debug, Clone)]
pub enum FeatureView<'a> {
    /// Ragged rows: `ids[offsets[r]..offsets[r + 1]]`, weights with their own offsets (which must
    /// give every row as many weights as ids).
    Ragged {
        /// Flat ids.
        ids: Ids<'a>,
        /// Row offsets into `ids`.
        offsets: Offsets<'a>,
        /// Flat weights and their row offsets.
        weights: Option<(&'a [f32], Offsets<'a>)>,
    },
    /// A dense `[batch, valency]` array; every cell is an id.
    Dense {
        /// The ids.
        ids: DenseIds<'a>,
        /// Weights of the same shape.
        weights: Option<ArrayView2<'a, f32>>,
    },
    /// Sparse COO: entry `k` is id `ids[k]` of sample `rows[2k]` (`indices` flattened; the
    /// position column `rows[2k + 1]` is ignored, as in the reference).
    Coo {
        /// Flattened `[nnz, 2]` indices, sorted by row.
        indices: &'a [i64],
        /// The nnz ids.
        ids: Ids<'a>,
    },
}

/// One feature's local batch, in any layout. The pipeline treats every implementation alike.
pub trait SampleSource: Sync {
    /// Samples (rows) in the local batch.
    fn num_samples(&self) -> usize;
    /// Whether the source carries per-id weights. A stack with any weighted feature sorts by
    /// extraction index and combines with weights (SPEC 3.5, 3.6).
    fn has_weights(&self) -> bool;
    /// Borrowed view of the data.
    fn view(&self) -> FeatureView<'_>;
}

impl FeatureView<'_> {
    /// Number of ids in the batch (counting duplicates), for throughput reporting.
    pub fn num_ids(&self) -> usize {
        match self {
            FeatureView::Ragged { offsets, .. } => {
                let rows = offsets.rows();
                if rows == 0 {
                    0
                } else {
                    offsets.range(0).0.abs_diff(offsets.range(rows - 1).1)
                }
            }
            FeatureView::Dense {
                ids: DenseIds::I32(a),
                ..
            } => a.len(),
            FeatureView::Dense {
                ids: DenseIds::I64(a),
                ..
            } => a.len(),
            FeatureView::Coo { ids, .. } => ids.len(),
        }
    }
}

impl<T: SampleSource + ?Sized> SampleSource for &T {
    fn num_samples(&self) -> usize {
        (**self).num_samples()
    }
    fn has_weights(&self) -> bool {
        (**self).has_weights()
    }
    fn view(&self) -> FeatureView<'_> {
        (**self).view()
    }
}
