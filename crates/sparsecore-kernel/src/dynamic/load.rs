//! A deterministic stream of lookups and updates, for load tests, benchmarks and replays.

use std::collections::HashSet;

use super::splitmix64;
use crate::error::{KernelError, Result};
use sparsecore_prep::input::hash::hash_i64;

/// Batch `id` of a synthetic key stream: `keys_per_batch` distinct update keys drawn uniformly
/// from `key_space` raw ints, `lookups_per_batch` lookup-only keys from a disjoint range of the
/// same size, and small gradients, all pure functions of `(seed, id)`. Any process can
/// regenerate any batch from its id, which is what a sequential replay of a concurrent run
/// needs. Raw ints become keys by [`hash_i64`] with `seed`, as a hashed int64 feature's would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadStream {
    /// Seed of every draw and of the key hash.
    pub seed: u64,
    /// Distinct keys updated per batch (at most `key_space`).
    pub keys_per_batch: usize,
    /// Raw ints the update keys are drawn from; overlapping batches share keys.
    pub key_space: u64,
    /// Extra keys looked up (and so created) but never updated, per batch.
    pub lookups_per_batch: usize,
    /// Row width of the gradients.
    pub dim: usize,
}

impl LoadStream {
    /// Checks that a batch can hold `keys_per_batch` distinct keys.
    pub fn validate(&self) -> Result<()> {
        if self.keys_per_batch as u64 > self.key_space || self.key_space > 1 << 62 || self.dim == 0
        {
            return Err(KernelError::parameter(
                "keys-per-batch",
                self.keys_per_batch,
                format!(
                    "needs 0 < dim (got {}) and keys per batch <= key space (got {}) <= 2^62",
                    self.dim, self.key_space
                ),
            ));
        }
        Ok(())
    }

    fn draw(&self, id: u64, stream: u64, j: u64) -> u64 {
        splitmix64(
            splitmix64(self.seed ^ splitmix64(id))
                ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03).wrapping_add(j),
        )
    }

    /// Batch `id`'s update keys (distinct) and their `[keys, dim]` gradients in `[-0.05, 0.05)`.
    pub fn update(&self, id: u64) -> (Vec<u64>, Vec<f32>) {
        let mut seen = HashSet::with_capacity(self.keys_per_batch);
        let mut keys = Vec::with_capacity(self.keys_per_batch);
        let mut j = 0u64;
        while keys.len() < self.keys_per_batch {
            let raw = self.draw(id, 1, j) % self.key_space;
            j += 1;
            if seen.insert(raw) {
                keys.push(hash_i64(raw as i64, self.seed));
            }
        }
        let grads = (0..(keys.len() * self.dim) as u64)
            .map(|j| ((self.draw(id, 2, j) >> 40) as f32 * (1.0 / 16_777_216.0) - 0.5) * 0.1)
            .collect();
        (keys, grads)
    }

    /// Batch `id`'s lookup-only keys (raw ints in `[key_space, 2 · key_space)`; may repeat).
    pub fn lookups(&self, id: u64) -> Vec<u64> {
        (0..self.lookups_per_batch as u64)
            .map(|j| {
                hash_i64(
                    (self.key_space + self.draw(id, 3, j) % self.key_space) as i64,
                    self.seed,
                )
            })
            .collect()
    }
}
