//! Moving every column of a window's rows to their new places.

use arrow_array::RecordBatch;

use super::SampleRef;
use crate::error::{Error, Result};

/// Applies a permutation to a window: output batch k takes `permutation[k]`'s rows, every
/// column moving together (Arrow `take`).
pub fn apply(window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Result<Vec<RecordBatch>> {
    let arrow = |source| Error::Arrow { context: "reordering a window of batches".into(), source };
    let sources: Vec<&RecordBatch> = window.iter().collect();
    let mut index = Vec::new();
    permutation
        .iter()
        .map(|rows| {
            index.clear();
            for r in rows {
                if r.batch >= window.len() || r.row >= window[r.batch].num_rows() {
                    return Err(Error::input("balance", format!("permutation names row {} of batch {}, which does not exist", r.row, r.batch)));
                }
                index.push((r.batch, r.row));
            }
            arrow_select::interleave::interleave_record_batch(&sources, &index).map_err(arrow)
        })
        .collect()
}
