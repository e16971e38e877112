//! Ragged input: TF-style `row_splits` + flat `values`.

use super::{FeatureView, Ids, Offsets, SampleSource};
use crate::error::{Error, Result};

/// A ragged batch: row `r` holds `values[row_splits[r]..row_splits[r + 1]]`.
///
/// Weights, when given, share the row splits (one weight per id).
#[derive(Debug, Clone)]
pub struct RaggedInput<'a> {
    ids: Ids<'a>,
    splits: Offsets<'a>,
    weights: Option<&'a [f32]>,
}

impl<'a> RaggedInput<'a> {
    /// Wraps 32-bit ids with 32- or 64-bit row splits. `name` labels errors.
    pub fn new(name: &str, values: Ids<'a>, row_splits: Offsets<'a>) -> Result<Self> {
        row_splits.validate(name, "row_splits", values.len())?;
        Ok(RaggedInput {
            ids: values,
            splits: row_splits,
            weights: None,
        })
    }

    /// Convenience constructor for `i32` values and `i32` row splits.
    pub fn from_i32(name: &str, values: &'a [i32], row_splits: &'a [i32]) -> Result<Self> {
        Self::new(name, Ids::I32(values), Offsets::I32(row_splits))
    }

    /// Convenience constructor for `i64` values and `i64` row splits.
    pub fn from_i64(name: &str, values: &'a [i64], row_splits: &'a [i64]) -> Result<Self> {
        Self::new(name, Ids::I64(values), Offsets::I64(row_splits))
    }

    /// Attaches one weight per id (same row splits as the ids).
    pub fn with_weights(mut self, name: &str, weights: &'a [f32]) -> Result<Self> {
        if weights.len() != self.ids.len() {
            return Err(Error::input(
                name,
                format!(
                    "{} weights for {} ids (ragged weights share the ids' row splits)",
                    weights.len(),
                    self.ids.len()
                ),
            ));
        }
        self.weights = Some(weights);
        Ok(self)
    }
}

impl SampleSource for RaggedInput<'_> {
    fn num_samples(&self) -> usize {
        self.splits.rows()
    }
    fn has_weights(&self) -> bool {
        self.weights.is_some()
    }
    fn view(&self) -> FeatureView<'_> {
        FeatureView::Ragged {
            ids: self.ids,
            offsets: self.splits,
            weights: self.weights.map(|w| (w, self.splits)),
        }
    }
}
