//! FDO statistics of one batch, per stack (SPEC 3.9).
//!
//! These are what users feed back into their configs: the largest per-partition id counts
//! (after de-duplication, before dropping) tell them which limits would have dropped nothing,
//! and the per-SparseCore required sizes tell them how small the COO buffer can be.

use serde::{Deserialize, Serialize};

/// Statistics of one stack over one batch, in the reference's layout and dtypes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StackStats {
    /// `[L * N]`, device-major: for local device d and partition g, the largest de-duplicated
    /// id count any of d's SparseCores sends to g.
    pub max_ids_per_partition: Vec<i32>,
    /// `[L * N]`: the same for distinct ids.
    pub max_unique_ids_per_partition: Vec<i32>,
    /// `[L * S]`: buffer slots each local SparseCore needs (partitions aligned to 8).
    pub required_buffer_size_per_sc: Vec<i32>,
    /// Ids dropped by limits (every raw occurrence) plus ids that did not fit the buffer
    /// (de-duplicated entries), over all local devices.
    pub dropped_id_count: u64,
}

impl StackStats {
    /// Resets to zeros for `local_devices * num_partitions` partitions and
    /// `local_devices * sc_per_device` SparseCores, keeping the allocations.
    pub(crate) fn reset(&mut self, partitions: usize, scs: usize) {
        for v in [
            &mut self.max_ids_per_partition,
            &mut self.max_unique_ids_per_partition,
        ] {
            v.clear();
            v.resize(partitions, 0);
        }
        self.required_buffer_size_per_sc.clear();
        self.required_buffer_size_per_sc.resize(scs, 0);
        self.dropped_id_count = 0;
    }

    /// The buffer size per device that would have held this batch without overflow:
    /// `max(required_buffer_size_per_sc) * S` (the reference's `get_required_buffer_size_per_device`).
    pub fn required_buffer_size_per_device(&self, sc_per_device: usize) -> u64 {
        self.required_buffer_size_per_sc
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(0) as u64
            * sc_per_device as u64
    }

    /// Largest value of `max_ids_per_partition`.
    pub fn max_ids(&self) -> i32 {
        self.max_ids_per_partition
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Largest value of `max_unique_ids_per_partition`.
    pub fn max_unique_ids(&self) -> i32 {
        self.max_unique_ids_per_partition
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }
}
