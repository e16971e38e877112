//! Dense input: a `[batch, valency]` array where every cell is an id.

use ndarray::ArrayView2;

use super::{DenseIds, FeatureView, SampleSource};
use crate::error::{Error, Result};

/// A dense batch of fixed valency. Any strides are fine (the array is read in place).
///
/// There is no "empty" marker: as in the reference, every cell, including `-1`, is an id, so
/// ragged data should use [`super::RaggedInput`] instead.
#[derive(Debug, Clone)]
pub struct DenseInput<'a> {
    ids: DenseIds<'a>,
    weights: Option<ArrayView2<'a, f32>>,
}

impl<'a> DenseInput<'a> {
    /// Wraps 32-bit ids.
    pub fn from_i32(ids: ArrayView2<'a, i32>) -> Self {
        DenseInput {
            ids: DenseIds::I32(ids),
            weights: None,
        }
    }

    /// Wraps 64-bit ids.
    pub fn from_i64(ids: ArrayView2<'a, i64>) -> Self {
        DenseInput {
            ids: DenseIds::I64(ids),
            weights: None,
        }
    }

    /// Attaches weights of exactly the ids' shape. The reference checks only the batch
    /// dimension and reads out of bounds on a narrower array; we require the full shape.
    pub fn with_weights(mut self, name: &str, weights: ArrayView2<'a, f32>) -> Result<Self> {
        if weights.dim() != self.dim() {
            return Err(Error::input(
                name,
                format!(
                    "weights shape {:?} differs from ids shape {:?}",
                    weights.dim(),
                    self.dim()
                ),
            ));
        }
        self.weights = Some(weights);
        Ok(self)
    }

    fn dim(&self) -> (usize, usize) {
        match &self.ids {
            DenseIds::I32(a) => a.dim(),
            DenseIds::I64(a) => a.dim(),
        }
    }
}

impl SampleSource for DenseInput<'_> {
    fn num_samples(&self) -> usize {
        self.dim().0
    }
    fn has_weights(&self) -> bool {
        self.weights.is_some()
    }
    fn view(&self) -> FeatureView<'_> {
        let ids = match &self.ids {
            DenseIds::I32(a) => DenseIds::I32(a.view()),
            DenseIds::I64(a) => DenseIds::I64(a.view()),
        };
        FeatureView::Dense {
            ids,
            weights: self.weights.as_ref().map(|w| w.view()),
        }
    }
}
