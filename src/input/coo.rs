//! Sparse COO input: `indices [nnz, 2]`, `values [nnz]`, `dense_shape [batch, width]`.

use super::{FeatureView, Ids, SampleSource};
use crate::error::{Error, Result};

/// A sparse COO batch (the reference's `preprocess_sparse_dense_matmul_input_from_sparse_tensor`).
///
/// Column 0 of `indices` is the sample row; column 1 (the position in the row) is ignored, as in
/// the reference, so gaps in it change nothing. Rows without entries are empty samples. COO
/// input carries no weights.
#[derive(Debug, Clone)]
pub struct CooInput<'a> {
    indices: &'a [i64],
    ids: Ids<'a>,
    batch: usize,
}

impl<'a> CooInput<'a> {
    /// Wraps flattened row-major `indices` (`2 * nnz` values), the `nnz` ids and the batch size
    /// (`dense_shape[0]`).
    ///
    /// Rows must be non-decreasing and inside `0..batch`: the reference only checks this in debug
    /// builds and otherwise reads the wrong samples.
    pub fn new(name: &str, indices: &'a [i64], ids: Ids<'a>, batch: usize) -> Result<Self> {
        if indices.len() != 2 * ids.len() {
            return Err(Error::input(
                name,
                format!(
                    "indices hold {} values, expected 2 * nnz = {}",
                    indices.len(),
                    2 * ids.len()
                ),
            ));
        }
        let mut prev = 0i64;
        for (k, pair) in indices.chunks_exact(2).enumerate() {
            let row = pair[0];
            if row < 0 || row as u64 >= batch as u64 {
                return Err(Error::input(
                    name,
                    format!(
                        "indices[{k}] has row {row}, outside the batch of {batch} (dense_shape[0])"
                    ),
                ));
            }
            if row < prev {
                return Err(Error::input(
                    name,
                    format!(
                        "indices are not sorted by row: entry {k} has row {row} after row {prev}"
                    ),
                ));
            }
            prev = row;
        }
        Ok(CooInput {
            indices,
            ids,
            batch,
        })
    }
}

impl SampleSource for CooInput<'_> {
    fn num_samples(&self) -> usize {
        self.batch
    }
    fn has_weights(&self) -> bool {
        false
    }
    fn view(&self) -> FeatureView<'_> {
        FeatureView::Coo {
            indices: self.indices,
            ids: self.ids,
        }
    }
}
