//! The training path over a dynamic table: raw keys → unique keys → rows → activations, and the
//! backward pass with one optimizer step per unique key.

use std::collections::HashMap;

use arrow_array::Array;
use ndarray::{Array2, ArrayView2};

use super::{Applied, DynamicTable};
use crate::error::{KernelError, Result, Subject};
use crate::Optimizer;
use sparsecore_prep::input::RawKeyRows;
use sparsecore_prep::spec::Combiner;

/// One feature's batch of keys, deduplicated so that each distinct key is looked up and updated
/// once: sample `r` holds ids `offsets[r]..offsets[r + 1]`, id `i` is key `unique[index[i]]`
/// with gain `gains[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyBatch {
    /// Distinct keys, in first-seen order.
    pub unique: Vec<u64>,
    /// Per id, its key's position in `unique`.
    pub index: Vec<u32>,
    /// Sample offsets into `index` and `gains` (samples + 1 entries).
    pub offsets: Vec<usize>,
    /// Per id, its combiner gain (SPEC 3.5: `w`, `w / Σw` or `w / √Σw²`, accumulated in the
    /// reference's float order; without weights `1`, `1/n` or `1/√n`).
    pub gains: Vec<f32>,
}

impl KeyBatch {
    /// A batch from flat keys, sample offsets (`samples + 1`, non-decreasing, ending at
    /// `keys.len()`) and optional per-key weights. `feature` labels errors.
    pub fn new(
        feature: &str,
        keys: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        combiner: Combiner,
    ) -> Result<Self> {
        if offsets.first() != Some(&0)
            || offsets.last() != Some(&keys.len())
            || offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(KernelError::input(
                Subject::Feature(feature.to_string()),
                format!("offsets must rise from 0 to the {} keys", keys.len()),
            ));
        }
        if keys.len() > u32::MAX as usize {
            return Err(KernelError::input(
                Subject::Feature(feature.to_string()),
                format!(
                    "{} keys in one batch; at most {} are supported",
                    keys.len(),
                    u32::MAX
                ),
            ));
        }
        if let Some(w) = weights {
            if w.len() != keys.len() {
                return Err(KernelError::input(
                    Subject::Feature(feature.to_string()),
                    format!("{} weights for {} keys", w.len(), keys.len()),
                ));
            }
        }
        let mut positions: HashMap<u64, u32> = HashMap::with_capacity(keys.len());
        let mut unique = Vec::new();
        let mut index = Vec::with_capacity(keys.len());
        for &k in keys {
            let next = unique.len() as u32;
            let i = *positions.entry(k).or_insert_with(|| {
                unique.push(k);
                next
            });
            index.push(i);
        }
        let mut gains = Vec::with_capacity(keys.len());
        for (r, w) in offsets.windows(2).enumerate() {
            let n = w[1] - w[0];
            match weights {
                None => {
                    let g = match combiner {
                        Combiner::Sum => 1.0,
                        Combiner::Mean => 1.0f32 / n as f32,
                        Combiner::Sqrtn => 1.0f32 / (n as f32).sqrt(),
                    };
                    gains.extend(std::iter::repeat_n(g, n));
                }
                Some(ws) => {
                    let ws = &ws[w[0]..w[1]];
                    if let Some(&v) = ws.iter().find(|v| !v.is_finite()) {
                        return Err(KernelError::InvalidWeight {
                            feature: feature.to_string(),
                            row: r,
                            value: v,
                        });
                    }
                    let divisor = match combiner {
                        Combiner::Sum => 1.0f32,
                        Combiner::Mean => ws.iter().fold(0.0f32, |acc, &w| acc + w),
                        Combiner::Sqrtn => ws
                            .iter()
                            .fold(0.0f32, |acc, &w| {
                                (acc as f64 + (w as f64) * (w as f64)) as f32
                            })
                            .sqrt(),
                    };
                    gains.extend(ws.iter().map(|&w| {
                        if combiner == Combiner::Sum {
                            w
                        } else {
                            w / divisor
                        }
                    }));
                }
            }
        }
        Ok(KeyBatch {
            unique,
            index,
            offsets: offsets.to_vec(),
            gains,
        })
    }

    /// A batch from an Arrow list column of raw keys (hashed to full 64-bit keys with `seed`,
    /// as [`sparsecore_prep::input::hash`] documents) and an optional `List<Float32>` weights column.
    pub fn from_arrow(
        feature: &str,
        column: &str,
        keys: &dyn Array,
        weights: Option<(&str, &dyn Array)>,
        seed: u64,
        combiner: Combiner,
    ) -> Result<Self> {
        let rows = RawKeyRows::from_arrow(feature, column, keys, weights, seed)?;
        Self::new(
            feature,
            &rows.keys,
            &rows.offsets,
            rows.weights.as_deref(),
            combiner,
        )
    }

    /// Samples in the batch.
    pub fn num_samples(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Checks the fields' consistency (they are public, so a batch may be built by hand):
    /// offsets rise from 0 to the number of ids, one gain per id, every index names a key.
    pub fn validate(&self, table: &str) -> Result<()> {
        let n = self.index.len();
        if self.offsets.first() != Some(&0)
            || self.offsets.last() != Some(&n)
            || self.offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(KernelError::input(
                Subject::DynamicTable(table.to_string()),
                format!("key batch offsets must rise from 0 to its {n} ids"),
            ));
        }
        if self.gains.len() != n {
            return Err(KernelError::input(
                Subject::DynamicTable(table.to_string()),
                format!("key batch has {} gains for {n} ids", self.gains.len()),
            ));
        }
        if let Some(&i) = self
            .index
            .iter()
            .find(|&&i| i as usize >= self.unique.len())
        {
            return Err(KernelError::input(
                Subject::DynamicTable(table.to_string()),
                format!(
                    "key batch index {i} is outside its {} unique keys",
                    self.unique.len()
                ),
            ));
        }
        Ok(())
    }
}

/// Forward pass: looks each distinct key up once (creating new keys) and combines them,
/// `act[r] = Σ gains[i] · row(key_i)` over sample `r`'s ids in order. Returns `[samples, dim]`.
pub fn dynamic_forward(table: &dyn DynamicTable, batch: &KeyBatch) -> Result<Array2<f32>> {
    batch.validate(&table.spec().name)?;
    let rows = table.lookup(&batch.unique)?;
    let mut act = Array2::<f32>::zeros((batch.num_samples(), table.spec().dim));
    for (r, w) in batch.offsets.windows(2).enumerate() {
        let mut out = act.row_mut(r);
        for i in w[0]..w[1] {
            out.scaled_add(batch.gains[i], &rows.row(batch.index[i] as usize));
        }
    }
    Ok(act)
}

/// Backward pass: each distinct key's gradient `Σ gains[i] · dact[r(i)]` (accumulated in id
/// order), then one atomic update of all of them with `optimizer` (tagged with `update_id` for
/// exactly-once retries). `activation_grads` is `[samples, dim]`.
pub fn dynamic_backward(
    table: &dyn DynamicTable,
    batch: &KeyBatch,
    activation_grads: ArrayView2<'_, f32>,
    optimizer: &Optimizer,
    update_id: Option<u64>,
) -> Result<Applied> {
    batch.validate(&table.spec().name)?;
    let dim = table.spec().dim;
    if activation_grads.dim() != (batch.num_samples(), dim) {
        return Err(KernelError::input(
            Subject::DynamicTable(table.spec().name.clone()),
            format!(
                "activation gradient is {:?}, expected [{}, {dim}]",
                activation_grads.dim(),
                batch.num_samples()
            ),
        ));
    }
    let mut grads = Array2::<f32>::zeros((batch.unique.len(), dim));
    for (r, w) in batch.offsets.windows(2).enumerate() {
        for i in w[0]..w[1] {
            grads
                .row_mut(batch.index[i] as usize)
                .scaled_add(batch.gains[i], &activation_grads.row(r));
        }
    }
    table.apply_update(
        update_id,
        &batch.unique,
        grads.as_slice().expect("a new array is contiguous"),
        optimizer,
    )
}
