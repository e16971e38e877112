//! Where BESS shards sit on SparseCores, and which shard-pair blocks each SparseCore slice takes.
//!
//! **Shards are the global SparseCores**: `n = N = G·S`. The preprocessing pipeline sends an id
//! to partition `col & (N−1)`, with `col = ((id + shift) & (N−1)) + (id & !(N−1)) + col_offset`
//! (SPEC of the main project, 3.4; `shift` and `col_offset` are the feature's `col_shift` and
//! `col_offset` in [`sparsecore_prep::spec::FeaturePlan`]). BESS entity (shard `s`, local id `i`)
//! therefore gets the physical id
//!
//! ```text
//! id(s, i) = i·N + ((s − shift) mod N)
//! ```
//!
//! whose partition is `s` and whose row on that SparseCore is `i + col_offset / N`: shard `s` of
//! the BESS sharding *is* SparseCore `s`'s slice of the (mod-sharded, rotated) entity table.
//! The table's vocabulary is `N·M` rows (`M = ceil(E / N)`); the ids of padding slots are never
//! looked up.
//!
//! **Slices.** In step `t`, global SparseCore `g` takes block `(i, (i + g + t) mod n)` for every
//! head shard `i`: heads from every shard once, tails from every shard once (`i ↦ i + g + t` is a
//! bijection), so every (SparseCore, partition) cell receives exactly `ppp` heads and `ppp`
//! tails; and over the `n` SparseCores every one of the `n²` shard pairs is used exactly once
//! per step (`j − i = g + t` differs between SparseCores). The `+ t` rotates which SparseCore
//! sees which pair from step to step.

use sparsecore_prep::spec::{DeviceLayout, Plan};

use crate::error::{BessError, Result};

/// The SparseCore layout of a BESS sharding: `N` shards = `N` SparseCores, the rotation of the
/// entity table's stack, and which global SparseCores this host feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseCoreLayout {
    /// L: local devices.
    pub local_devices: usize,
    /// G: global devices.
    pub global_devices: usize,
    /// S: SparseCores per device.
    pub sc_per_device: usize,
    /// Which host this is (`0 .. G / L`): it feeds global devices `host·L .. (host+1)·L`.
    pub host: usize,
    /// The entity features' `col_shift` (`shard_rotation` of the entity table in its stack).
    pub col_shift: u32,
}

impl SparseCoreLayout {
    /// A layout for `L`, `G`, `S` (validated as the pipeline validates them) and host `host`.
    pub fn new(
        local_devices: usize,
        global_devices: usize,
        sc_per_device: usize,
        host: usize,
    ) -> Result<Self> {
        let d = DeviceLayout::new(local_devices, global_devices, sc_per_device)?;
        if !global_devices.is_multiple_of(local_devices) {
            return Err(BessError::param("local_device_count", local_devices, format!("must divide global_device_count {global_devices} (every host feeds as many devices)")));
        }
        if host >= global_devices / local_devices {
            return Err(BessError::param(
                "host",
                host,
                format!("must be below G / L = {}", global_devices / local_devices),
            ));
        }
        Ok(SparseCoreLayout {
            local_devices: d.local_devices,
            global_devices: d.global_devices,
            sc_per_device: d.sc_per_device,
            host,
            col_shift: 0,
        })
    }

    /// The same layout with the entity features' `col_shift` (from a plan that stacks the
    /// entity table behind others).
    #[must_use]
    pub fn with_col_shift(mut self, col_shift: u32) -> Self {
        self.col_shift = col_shift;
        self
    }

    /// Reads `col_shift` of feature `feature` from a plan (all entity features of one table
    /// share it).
    pub fn with_plan(self, plan: &Plan, feature: &str) -> Result<Self> {
        let f = plan
            .features
            .iter()
            .find(|f| f.name == feature)
            .ok_or_else(|| BessError::param("feature", feature, "not in the plan"))?;
        Ok(self.with_col_shift(f.col_shift))
    }

    /// N = G·S: global SparseCores, and BESS shards.
    #[must_use]
    pub fn num_sparsecores(&self) -> usize {
        self.global_devices * self.sc_per_device
    }

    /// SparseCores this host feeds, `L·S`.
    #[must_use]
    pub fn local_sparsecores(&self) -> usize {
        self.local_devices * self.sc_per_device
    }

    /// Global SparseCore of this host's `k`-th local SparseCore (device-major, as the pipeline
    /// slices rows).
    #[must_use]
    pub fn global_sparsecore(&self, k: usize) -> usize {
        self.host * self.local_sparsecores() + k
    }

    /// Checks `n_shard == N`.
    pub fn check_shards(&self, n_shard: usize) -> Result<()> {
        if n_shard != self.num_sparsecores() {
            return Err(BessError::ShardCountMismatch {
                n_shard,
                num_sparsecores: self.num_sparsecores(),
                global_devices: self.global_devices,
                sc_per_device: self.sc_per_device,
            });
        }
        Ok(())
    }

    /// The physical id of BESS entity (shard, local id): `local·N + ((shard − shift) mod N)`.
    #[must_use]
    pub fn physical_id(&self, shard: usize, local: i64) -> i64 {
        let n = self.num_sparsecores() as i64;
        let shift = i64::from(self.col_shift) % n;
        local * n + (shard as i64 - shift).rem_euclid(n)
    }

    /// The partition (SparseCore) the pipeline sends physical id `id` to.
    #[must_use]
    pub fn partition_of(&self, id: i64) -> usize {
        let n = self.num_sparsecores() as i64;
        ((id + i64::from(self.col_shift)) & (n - 1)) as usize
    }

    /// BESS (shard, local id) of a physical id.
    #[must_use]
    pub fn shard_and_local(&self, id: i64) -> (usize, i64) {
        (self.partition_of(id), id / self.num_sparsecores() as i64)
    }

    /// The tail shard of the block global SparseCore `g` takes from head shard `i` in step `t`:
    /// `(i + g + t) mod n`.
    #[must_use]
    pub fn tail_shard(&self, g: usize, i: usize, step: usize) -> usize {
        let n = self.num_sparsecores();
        // N is a power of two (the pipeline checks it), so `mod n` is a mask.
        (i + g + step) & (n - 1)
    }
}

/// Ids after merging per (local SparseCore, partition) cell of one stack's output, read from
/// its row pointers (partition `p` of a segment starts at `roundup(rp[p−1], 8)` and ends at
/// `rp[p]`): `[L·S][N]`. The pipeline's own stats only keep the maximum over a device's
/// SparseCores; this is every cell, for measuring balance.
#[must_use]
pub fn cell_loads(
    out: &sparsecore_prep::StackOutput,
    sc_per_device: usize,
    num_sparsecores: usize,
) -> Vec<Vec<i32>> {
    let rpd = out.row_pointers_per_device();
    let rpb = rpd / sc_per_device.max(1);
    let mut cells = Vec::with_capacity(out.local_devices() * sc_per_device);
    for d in 0..out.local_devices() {
        for sc in 0..sc_per_device {
            let base = d * rpd + sc * rpb;
            let Some(seg) = out.row_pointers.get(base..base + num_sparsecores) else {
                continue;
            };
            let mut start = 0;
            let mut row = Vec::with_capacity(num_sparsecores);
            for &end in seg {
                row.push(end - start);
                start = (end + 7) / 8 * 8;
            }
            cells.push(row);
        }
    }
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn physical_ids_land_on_their_shard_under_any_rotation() {
        for shift in [0u32, 1, 4, 7] {
            let l = SparseCoreLayout::new(2, 2, 4, 0)
                .unwrap()
                .with_col_shift(shift);
            for s in 0..8 {
                for i in 0..5 {
                    let id = l.physical_id(s, i);
                    // The pipeline's column id formula (SPEC 3.4).
                    let n = 8i64;
                    let col = ((id + i64::from(shift)) & (n - 1)) + (id & !(n - 1));
                    assert_eq!(col & (n - 1), s as i64);
                    assert_eq!(col >> 3, i);
                    assert_eq!(l.shard_and_local(id), (s, i));
                }
            }
        }
    }

    #[test]
    fn every_pair_once_per_step() {
        let l = SparseCoreLayout::new(1, 1, 4, 0).unwrap();
        for t in 0..5 {
            let mut seen = [[0; 4]; 4];
            for g in 0..4 {
                let mut tails = [0; 4];
                for (i, row) in seen.iter_mut().enumerate() {
                    let j = l.tail_shard(g, i, t);
                    row[j] += 1;
                    tails[j] += 1;
                }
                assert_eq!(tails, [1; 4]);
            }
            assert_eq!(seen, [[1; 4]; 4]);
        }
    }
}
