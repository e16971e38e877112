//! An oracle: a deliberately simple, slow re-implementation of SPEC Part 2, sections 3.3–3.9
//! (the non-minibatching path), written from the SPEC text alone.
//!
//! Nothing here is shared with `src/` beyond public types: the stacking layout (SPEC 2.7, the
//! row offsets, column offsets and shifts, and each stack's limits and suggested size) is taken
//! from [`sparsecore_prep::Plan`], because planning is not what this model checks. Everything
//! from 3.3 on is its own: row slicing, column ids, combiner gains, the 64-bit sort key and a
//! full `sort`, the grouping walk with de-duplication, limits and drops, buffer filling with
//! alignment padding, and the statistics. It uses plain `Vec`s and `BTreeMap`s and favours
//! obviousness over speed.
//!
//! The tests (`tests/reference/oracle.rs`), the fuzz targets and the soak command use it as
//! `sparsecore_testkit::model`. It depends only on `sparsecore_prep` and std.
//!
//! Where SPEC Part 2 is silent, the model follows SPEC Part 1 (our contract):
//! * ids outside `[0, vocabulary_size)` are errors (with `validate_ids`, the default);
//!   non-finite weights and weight rows whose length differs from their id row are errors;
//! * the unspecified tail of each SparseCore segment holds the padding triple;
//! * in a stack where some features have weights, the features without weights count as
//!   weight 1.0 per id (the reference mishandles such mixes, SPEC 10.17);
//! * when a batch has several problems, the crate's documented order decides which one is
//!   reported: planning, then per stack the batch checks of 3.3, then (over every stack,
//!   device and SparseCore in order) bad weights and ids, row by row, and last the limits,
//!   stack by stack (max ids before max unique ids), naming the first (device, SparseCore,
//!   partition) where the largest count was observed.
//!
//! Minibatching (SPEC 5) is out of scope: configs with `enable_minibatching` give
//! [`ModelError::Unsupported`]. `batch_number` only matters to minibatching and is ignored.

#![allow(dead_code)]

use std::collections::BTreeMap;

use sparsecore_prep::input::{FeatureView, Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::spec::{Combiner, Plan};
use sparsecore_prep::{Config, Error, LimitKind, Output, Preprocessor};

/// Padding value of embedding and sample ids (`INT_MAX`).
pub const PAD: i32 = i32::MAX;
/// Bit pattern of the padding gain (a quiet NaN).
pub const PAD_GAIN_BITS: u32 = 0x7fc0_0000;
/// Width of the sort key's payload field.
const DATA_BITS: u32 = 26;
/// Largest payload.
const DATA_MASK: u64 = (1 << DATA_BITS) - 1;
/// Alignment unit of partitions inside a segment.
const ALIGN: usize = 8;

/// One feature's local batch: a list of ids per sample, and optionally a weight per id.
///
/// Weight rows past the end of `weights` count as empty rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Feature {
    /// Feature name (as in the config, for error messages).
    pub name: String,
    /// Ids of each sample.
    pub rows: Vec<Vec<i64>>,
    /// Weights of each sample, one per id.
    pub weights: Option<Vec<Vec<f32>>>,
}

/// One local batch: `features[i]` is the data of config feature `i`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch {
    /// Per config feature, in config order.
    pub features: Vec<Feature>,
}

/// What the model computes for one stack: the four buffers, flattened device-major as the
/// crate's [`sparsecore_prep::StackOutput`], plus the statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct StackResult {
    /// Stack name.
    pub name: String,
    /// RP = max(N, 8) * S.
    pub row_pointers_per_device: usize,
    /// C: COO slots per device.
    pub coo_buffer_size_per_device: usize,
    /// `[L * RP]`.
    pub row_pointers: Vec<i32>,
    /// `[L * C]`, padding `PAD`.
    pub embedding_ids: Vec<i32>,
    /// `[L * C]`, padding `PAD`.
    pub sample_ids: Vec<i32>,
    /// `[L * C]`, padding NaN `0x7fc00000`.
    pub gains: Vec<f32>,
    /// Per (device, SparseCore), device-major: the flat `[start, end)` slots up to the final
    /// aligned cursor, where the reference writes (the rest of each segment is its
    /// uninitialised tail).
    pub valid_ranges: Vec<(usize, usize)>,
    /// `[L * N]`.
    pub max_ids_per_partition: Vec<i32>,
    /// `[L * N]`.
    pub max_unique_ids_per_partition: Vec<i32>,
    /// `[L * S]`.
    pub required_buffer_size_per_sc: Vec<i32>,
    /// Limit drops (raw occurrences) plus buffer-overflow drops (merged entries).
    pub dropped_id_count: u64,
    /// Of `dropped_id_count`, the entries that did not fit the buffer (for test statistics;
    /// the crate does not report it separately).
    pub overflowed_id_count: u64,
}

/// The errors the crate can return for a [`Batch`] on the non-minibatching path, one variant
/// per kind, with the fields a caller relies on.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelError {
    /// The model does not cover this config (minibatching).
    Unsupported(String),
    /// Planning failed; the text is the planner's message (planning is not modelled).
    Plan(String),
    /// The batch does not have one input per config feature.
    InputCount {
        /// Config features.
        expected: usize,
        /// Inputs.
        got: usize,
    },
    /// A per-device stacked batch (or a SparseCore's weighted ids) exceeds the 26-bit payload.
    BatchTooLarge {
        /// Stack name.
        stack: String,
    },
    /// The per-device stacked batch is not a multiple of S.
    BatchNotDivisible {
        /// Stack name.
        stack: String,
        /// First feature of the stack (by row offset).
        feature: String,
        /// The per-device stacked batch.
        batch: usize,
    },
    /// The per-device stacked batch is below S times the stack's features.
    BatchTooSmall {
        /// Stack name.
        stack: String,
        /// The per-device stacked batch.
        batch: usize,
    },
    /// An id outside `[0, vocabulary_size)`.
    IdOutOfRange {
        /// Feature name.
        feature: String,
        /// Sample row in the feature's local batch.
        row: usize,
        /// The id.
        id: i64,
    },
    /// A NaN or infinite weight.
    InvalidWeight {
        /// Feature name.
        feature: String,
        /// Sample row.
        row: usize,
    },
    /// A weight row whose length differs from its id row.
    WeightsShape {
        /// Feature name.
        feature: String,
        /// Sample row.
        row: usize,
        /// Ids in the row.
        ids: usize,
        /// Weights in the row.
        weights: usize,
    },
    /// A limit was exceeded without `allow_id_dropping`.
    LimitExceeded {
        /// Stack name.
        stack: String,
        /// Which limit.
        kind: LimitKind,
        /// Largest count observed over the stack.
        observed: u32,
        /// The limit.
        limit: u32,
        /// Local device of the first place the largest count was observed.
        device: usize,
        /// Local SparseCore of that place.
        sc: usize,
        /// Partition of that place.
        partition: usize,
    },
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Plans the batch (global batch = local * G / L, as the crate's default) and runs the model.
pub fn preprocess(
    config: &Config,
    batch: &Batch,
    batch_number: u64,
) -> Result<Vec<StackResult>, ModelError> {
    let _ = batch_number; // only minibatching uses it
    if config.config.enable_minibatching {
        return Err(ModelError::Unsupported(
            "minibatching (SPEC 5) is not modelled".into(),
        ));
    }
    if batch.features.len() != config.features.len() {
        return Err(ModelError::InputCount {
            expected: config.features.len(),
            got: batch.features.len(),
        });
    }
    let sizes: Vec<usize> = batch.features.iter().map(|f| f.rows.len()).collect();
    let plan =
        Plan::for_local_batches(config, &sizes).map_err(|e| ModelError::Plan(e.to_string()))?;
    preprocess_with_plan(&plan, batch)
}

/// Runs the model with a given plan (for cases whose global batch sizes are fixed).
pub fn preprocess_with_plan(plan: &Plan, batch: &Batch) -> Result<Vec<StackResult>, ModelError> {
    if plan.enable_minibatching {
        return Err(ModelError::Unsupported(
            "minibatching (SPEC 5) is not modelled".into(),
        ));
    }
    if batch.features.len() != plan.features.len() {
        return Err(ModelError::InputCount {
            expected: plan.features.len(),
            got: batch.features.len(),
        });
    }
    let l = plan.layout.local_devices;
    let g = plan.layout.global_devices;
    let s = plan.layout.sc_per_device;
    let n = g * s;

    // Per stack: members sorted by row offset, and the per-SparseCore batch (SPEC 3.3).
    let mut stacks: Vec<StackInfo> = Vec::new();
    for stack in &plan.stacks {
        let mut members = stack.features.clone();
        members.sort_by_key(|&f| plan.features[f].row_offset);
        let bsd: usize = members
            .iter()
            .map(|&f| batch.features[f].rows.len() / l)
            .sum();
        if bsd as u64 > DATA_MASK {
            return Err(ModelError::BatchTooLarge {
                stack: stack.name.clone(),
            });
        }
        if !bsd.is_multiple_of(s) {
            return Err(ModelError::BatchNotDivisible {
                stack: stack.name.clone(),
                feature: plan.features[members[0]].name.clone(),
                batch: bsd,
            });
        }
        if bsd < s * members.len() {
            return Err(ModelError::BatchTooSmall {
                stack: stack.name.clone(),
                batch: bsd,
            });
        }
        let weighted = members.iter().any(|&f| batch.features[f].weights.is_some());
        stacks.push(StackInfo {
            members,
            bsps: bsd / s,
            weighted,
        });
    }

    // Stage A for every (stack, device, SparseCore) first: bad ids and weights come before
    // exceeded limits.
    let mut extracted: Vec<Vec<Vec<Extracted>>> = Vec::new();
    for (stack, info) in plan.stacks.iter().zip(&stacks) {
        let combiner = stack.combiner;
        let mut per_device = Vec::new();
        for d in 0..l {
            let mut per_sc = Vec::new();
            for sc in 0..s {
                per_sc.push(extract(plan, batch, info, combiner, d, sc)?);
            }
            per_device.push(per_sc);
        }
        extracted.push(per_device);
    }

    let mut results = Vec::new();
    let mut limit_error: Option<ModelError> = None;
    for ((stack, info), ex) in plan.stacks.iter().zip(&stacks).zip(&extracted) {
        let rpb = n.max(ALIGN);
        let rp_per_device = rpb * s;
        let c = coo_buffer_size(
            stack.max_ids_per_partition,
            stack.suggested_coo_buffer_size_per_device,
            s,
            n,
        );
        let cs = c / s;
        let mut res = StackResult {
            name: stack.name.clone(),
            row_pointers_per_device: rp_per_device,
            coo_buffer_size_per_device: c,
            row_pointers: vec![0; l * rp_per_device],
            embedding_ids: vec![PAD; l * c],
            sample_ids: vec![PAD; l * c],
            gains: vec![f32::from_bits(PAD_GAIN_BITS); l * c],
            valid_ranges: Vec::new(),
            max_ids_per_partition: vec![0; l * n],
            max_unique_ids_per_partition: vec![0; l * n],
            required_buffer_size_per_sc: vec![0; l * s],
            dropped_id_count: 0,
            overflowed_id_count: 0,
        };
        let drop = plan.allow_id_dropping;
        let limits = (
            stack.max_ids_per_partition,
            stack.max_unique_ids_per_partition,
        );
        // (observed, device, sc, partition) of each limit's largest count on the first
        // SparseCore (device-major) that exceeds a limit: the reference checks SparseCore by
        // SparseCore, ids before unique ids.
        let mut first_over: Option<(Worst, Worst)> = None;
        for (d, ex_d) in ex.iter().enumerate() {
            for (sc, ex_sc) in ex_d.iter().enumerate() {
                let grouped = group(ex_sc, n, drop, limits);
                // Statistics (SPEC 3.7): counted after merging, before dropping.
                let mut required = 0usize;
                // This SparseCore's first largest count per limit: (observed, device, sc, partition).
                let mut worst_ids = (0u32, d, sc, 0usize);
                let mut worst_unique = (0u32, d, sc, 0usize);
                for p in 0..n {
                    let ids = grouped.observed_ids[p];
                    let uniq = grouped.observed_unique[p];
                    let m = &mut res.max_ids_per_partition[d * n + p];
                    *m = (*m).max(ids as i32);
                    let m = &mut res.max_unique_ids_per_partition[d * n + p];
                    *m = (*m).max(uniq as i32);
                    required += round_up(ids as usize, ALIGN);
                    if ids > worst_ids.0 {
                        worst_ids = (ids, d, sc, p);
                    }
                    if uniq > worst_unique.0 {
                        worst_unique = (uniq, d, sc, p);
                    }
                }
                if first_over.is_none() && (worst_ids.0 > limits.0 || worst_unique.0 > limits.1) {
                    first_over = Some((worst_ids, worst_unique));
                }
                res.required_buffer_size_per_sc[d * s + sc] =
                    required.min(i32::MAX as usize) as i32;
                res.dropped_id_count += grouped.dropped;

                // Stage D (SPEC 3.8): this SparseCore's segment.
                let seg = d * c + sc * cs;
                let rp = d * rp_per_device + sc * rpb;
                let filled = fill(&grouped.entries, n, cs, info.bsps);
                res.row_pointers[rp..rp + rpb].copy_from_slice(&filled.row_pointers);
                for (k, slot) in filled.slots.iter().enumerate() {
                    if let Some((emb, smp, gain)) = *slot {
                        res.embedding_ids[seg + k] = emb;
                        res.sample_ids[seg + k] = smp;
                        res.gains[seg + k] = gain;
                    }
                }
                res.valid_ranges.push((seg, seg + filled.cursor));
                res.dropped_id_count += filled.overflow;
                res.overflowed_id_count += filled.overflow;
            }
        }
        if let (false, None, Some((worst_ids, worst_unique))) = (drop, &limit_error, first_over) {
            let (max_ids, max_unique) = limits;
            if worst_ids.0 > max_ids {
                let (observed, device, sc, partition) = worst_ids;
                limit_error = Some(ModelError::LimitExceeded {
                    stack: stack.name.clone(),
                    kind: LimitKind::MaxIds,
                    observed,
                    limit: max_ids,
                    device,
                    sc,
                    partition,
                });
            } else if worst_unique.0 > max_unique {
                let (observed, device, sc, partition) = worst_unique;
                limit_error = Some(ModelError::LimitExceeded {
                    stack: stack.name.clone(),
                    kind: LimitKind::MaxUniqueIds,
                    observed,
                    limit: max_unique,
                    device,
                    sc,
                    partition,
                });
            }
        }
        results.push(res);
    }
    match limit_error {
        Some(e) => Err(e),
        None => Ok(results),
    }
}

/// A limit's largest count on one SparseCore: (observed, device, SparseCore, partition).
type Worst = (u32, usize, usize, usize);

/// What the model needs per stack beyond the plan.
struct StackInfo {
    /// Member features, sorted by row offset.
    members: Vec<usize>,
    /// Per-SparseCore stacked batch.
    bsps: usize,
    /// Whether any member feature carries weights.
    weighted: bool,
}

/// One extracted id: device-level sample row, stacked column id, gain.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Entry {
    row: u32,
    col: u32,
    gain: f32,
}

/// Stage A's output for one SparseCore: the entries in extraction order, and whether the
/// stack is weighted (which decides the key payload).
struct Extracted {
    entries: Vec<Entry>,
    weighted: bool,
}

/// SPEC 3.2: the COO buffer size per device.
fn coo_buffer_size(max_ids: u32, suggested: Option<u64>, s: usize, n: usize) -> usize {
    let theoretical = round_up(max_ids as usize, ALIGN) * s * n;
    match suggested {
        None => theoretical,
        Some(x) => round_up(x as usize, ALIGN * s),
    }
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// SPEC 3.3–3.5: the ids SparseCore `sc` of local device `d` receives, in extraction order.
fn extract(
    plan: &Plan,
    batch: &Batch,
    info: &StackInfo,
    combiner: Combiner,
    d: usize,
    sc: usize,
) -> Result<Extracted, ModelError> {
    let l = plan.layout.local_devices;
    let g = plan.layout.global_devices;
    let s = plan.layout.sc_per_device;
    let n = g * s;
    let stack_name = || {
        plan.stacks[plan.features[info.members[0]].stack]
            .name
            .clone()
    };
    // Payloads must fit 26 bits (SPEC Part 1, 1.3): the rows this SparseCore can reference
    // (a feature's base row counts even when it sends no rows here), and for weighted stacks
    // the extraction indices. Checked before any row is read.
    let slice = |f: usize| -> (usize, usize) {
        let nsps = batch.features[f].rows.len() / (l * s);
        let start = (d * s + sc) * nsps;
        (start, batch.features[f].rows.len().min(start + nsps))
    };
    let base =
        |f: usize| sc as u64 * info.bsps as u64 + plan.features[f].row_offset / (g * s) as u64;
    let row_hi = info
        .members
        .iter()
        .map(|&f| base(f) + (batch.features[f].rows.len() / (l * s)) as u64)
        .max()
        .unwrap_or(0);
    if row_hi.max((sc * info.bsps) as u64) > DATA_MASK + 1 {
        return Err(ModelError::BatchTooLarge {
            stack: stack_name(),
        });
    }
    if info.weighted {
        let total: usize = info
            .members
            .iter()
            .map(|&f| {
                let (start, end) = slice(f);
                batch.features[f].rows[start..end]
                    .iter()
                    .map(Vec::len)
                    .sum::<usize>()
            })
            .sum();
        if total as u64 > DATA_MASK + 1 {
            return Err(ModelError::BatchTooLarge {
                stack: stack_name(),
            });
        }
    }
    let mut entries = Vec::new();
    for &f in &info.members {
        let fp = &plan.features[f];
        let feature = &batch.features[f];
        let (start, end) = slice(f);
        let base = base(f) as usize;
        for r in start..end {
            let ids = &feature.rows[r];
            let row_id = base + (r - start);
            let gains: Vec<f32> = if info.weighted {
                let weights: Vec<f32> = match &feature.weights {
                    Some(w) => w.get(r).cloned().unwrap_or_default(),
                    None => vec![1.0; ids.len()],
                };
                if weights.len() != ids.len() {
                    return Err(ModelError::WeightsShape {
                        feature: fp.name.clone(),
                        row: r,
                        ids: ids.len(),
                        weights: weights.len(),
                    });
                }
                if weights.iter().any(|w| !w.is_finite()) {
                    return Err(ModelError::InvalidWeight {
                        feature: fp.name.clone(),
                        row: r,
                    });
                }
                weighted_gains(combiner, &weights)
            } else {
                vec![unity_gain(combiner, ids.len()); ids.len()]
            };
            for (&id, &gain) in ids.iter().zip(&gains) {
                if plan.validate_ids && (id < 0 || id as u64 >= fp.vocabulary_size) {
                    return Err(ModelError::IdOutOfRange {
                        feature: fp.name.clone(),
                        row: r,
                        id,
                    });
                }
                let col = col_id(id as u32, fp.col_shift, fp.col_offset, n as u32);
                entries.push(Entry {
                    row: row_id as u32,
                    col,
                    gain,
                });
            }
        }
    }
    Ok(Extracted {
        entries,
        weighted: info.weighted,
    })
}

/// SPEC 3.4: `((id + shift) & (N-1)) + (id & !(N-1)) + col_offset`, in 32-bit arithmetic.
fn col_id(id: u32, shift: u32, offset: u32, n: u32) -> u32 {
    let mask = n - 1;
    (id.wrapping_add(shift) & mask)
        .wrapping_add(id & !mask)
        .wrapping_add(offset)
}

/// SPEC 3.5, unity weights: the gain of each of a sample's `count` ids.
fn unity_gain(combiner: Combiner, count: usize) -> f32 {
    match combiner {
        Combiner::Sum => 1.0,
        Combiner::Mean => 1.0f32 / count as f32,
        Combiner::Sqrtn => 1.0f32 / (count as f32).sqrt(),
    }
}

/// The reference's worker threads run with denormals-are-zero and flush-to-zero (observed in
/// its dumps, not in SPEC): a subnormal float read or produced by an operation is a zero of the
/// same sign.
fn ftz(x: f32) -> f32 {
    if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
        if x.is_sign_negative() {
            -0.0
        } else {
            0.0
        }
    } else {
        x
    }
}

/// SPEC 3.5, variable weights: per id, its weight over the row's divisor, accumulated in the
/// reference's float order, under the reference's flush-to-zero mode ([`ftz`]).
fn weighted_gains(combiner: Combiner, weights: &[f32]) -> Vec<f32> {
    let weights: Vec<f32> = weights.iter().map(|&w| ftz(w)).collect();
    match combiner {
        Combiner::Sum => weights,
        Combiner::Mean => {
            let mut sum = 0.0f32;
            for &w in &weights {
                sum = ftz(sum + w);
            }
            weights.iter().map(|&w| ftz(w / sum)).collect()
        }
        Combiner::Sqrtn => {
            let mut q = 0.0f32;
            for &w in &weights {
                q = ftz((q as f64 + (w as f64) * (w as f64)) as f32);
            }
            let root = q.sqrt();
            weights.iter().map(|&w| ftz(w / root)).collect()
        }
    }
}

/// SPEC 3.7's output for one SparseCore.
struct Grouped {
    /// Kept entries, merged, in key order.
    entries: Vec<Entry>,
    /// De-duplicated ids per partition, before dropping.
    observed_ids: Vec<u32>,
    /// Distinct ids per partition, before dropping.
    observed_unique: Vec<u32>,
    /// Ids dropped by the limits (every raw occurrence).
    dropped: u64,
}

/// SPEC 3.6–3.7: the 64-bit keys, a full sort, and the grouping walk.
fn group(ex: &Extracted, n: usize, drop: bool, (max_ids, max_unique): (u32, u32)) -> Grouped {
    let nbits = n.trailing_zeros();
    // Unity stacks look gains up by row: the payload is the row.
    let mut row_gain: BTreeMap<u32, f32> = BTreeMap::new();
    let mut keys: Vec<u64> = Vec::with_capacity(ex.entries.len());
    for (k, e) in ex.entries.iter().enumerate() {
        let data = if ex.weighted { k as u64 } else { e.row as u64 };
        if !ex.weighted {
            row_gain.insert(e.row, e.gain);
        }
        // Bucket 0: bits 63..58 stay clear.
        keys.push(((e.col.rotate_right(nbits) as u64) << DATA_BITS) | data);
    }
    keys.sort();

    let mut out: Vec<Entry> = Vec::new();
    // Index in `out` of the last appended entry.
    let mut last: Option<usize> = None;
    // (row, col) of the last entry that was not merged.
    let mut prev: Option<(u32, u32)> = None;
    let mut dropping_current_col = false;
    let mut observed_ids = vec![0u32; n];
    let mut observed_unique = vec![0u32; n];
    let mut kept_ids = vec![0u32; n];
    let mut kept_unique = vec![0u32; n];
    let mut dropped = 0u64;
    for key in keys {
        let col = ((key >> DATA_BITS) as u32).rotate_left(nbits);
        let data = key & DATA_MASK;
        let (row, gain) = if ex.weighted {
            let e = ex.entries[data as usize];
            (e.row, e.gain)
        } else {
            (data as u32, row_gain[&(data as u32)])
        };
        let p = (col as usize) & (n - 1);
        if let Some(i) = last {
            if out[i].row == row && out[i].col == col {
                out[i].gain = ftz(out[i].gain + gain);
                continue;
            }
        }
        if drop && prev == Some((row, col)) {
            dropped += 1;
            continue;
        }
        let new_col = prev.is_none_or(|(_, c)| c != col);
        observed_ids[p] += 1;
        if new_col {
            observed_unique[p] += 1;
        }
        if !drop {
            out.push(Entry { row, col, gain });
            last = Some(out.len() - 1);
        } else {
            let exceeds = kept_ids[p] + 1 > max_ids;
            if new_col {
                dropping_current_col = kept_unique[p] + 1 > max_unique;
            }
            if exceeds || dropping_current_col {
                dropped += 1;
            } else {
                out.push(Entry { row, col, gain });
                last = Some(out.len() - 1);
            }
            kept_ids[p] += 1;
            if new_col {
                kept_unique[p] += 1;
            }
        }
        prev = Some((row, col));
    }
    Grouped {
        entries: out,
        observed_ids,
        observed_unique,
        dropped,
    }
}

/// SPEC 3.8's output for one SparseCore segment.
struct Filled {
    /// The segment's `max(N, 8)` row pointers.
    row_pointers: Vec<i32>,
    /// The segment's `Cs` slots: `None` is padding.
    slots: Vec<Option<(i32, i32, f32)>>,
    /// Final aligned cursor (end of the written region).
    cursor: usize,
    /// Entries that did not fit.
    overflow: u64,
}

/// SPEC 3.8: partitions one after another, each ending at its row pointer and the next one
/// starting at the following multiple of 8; entries past the segment are dropped.
fn fill(entries: &[Entry], n: usize, cs: usize, bsps: usize) -> Filled {
    let nbits = n.trailing_zeros();
    let rpb = n.max(ALIGN);
    // Row pointers not written (after an overflow) equal the segment size.
    let mut row_pointers = vec![cs as i32; rpb];
    let mut slots = vec![None; cs];
    let mut i = 0usize;
    let mut p = 0usize;
    let mut overflow = 0u64;
    for e in entries {
        let t = (e.col as usize) & (n - 1);
        while p < t {
            row_pointers[p] = i as i32;
            i = round_up(i, ALIGN);
            p += 1;
        }
        if i >= cs {
            overflow += 1;
            continue;
        }
        slots[i] = Some((
            (e.col >> nbits) as i32,
            (e.row as usize % bsps) as i32,
            e.gain,
        ));
        i += 1;
    }
    while p < n {
        row_pointers[p] = i as i32;
        i = round_up(i, ALIGN);
        p += 1;
    }
    for rp in &mut row_pointers[n..] {
        *rp = i as i32;
    }
    Filled {
        row_pointers,
        slots,
        cursor: i,
        overflow,
    }
}

// ---------------------------------------------------------------------------------------------
// Running the crate on a Batch, and comparing
// ---------------------------------------------------------------------------------------------

/// A batch flattened into the crate's ragged layout (values + row splits), owned, so that
/// views can borrow it.
#[derive(Debug, Clone, Default)]
pub struct FlatBatch {
    features: Vec<FlatFeature>,
}

#[derive(Debug, Clone, Default)]
struct FlatFeature {
    name: String,
    values: Vec<i64>,
    splits: Vec<i64>,
    /// Flat weights and their own row splits (one weight row per id row).
    weights: Option<(Vec<f32>, Vec<i64>)>,
}

/// A ragged view whose weights have their own row splits, for batches whose weight rows do
/// not match their id rows (which [`RaggedInput`] cannot express).
struct SplitWeights<'a>(&'a FlatFeature);

impl SampleSource for SplitWeights<'_> {
    fn num_samples(&self) -> usize {
        self.0.splits.len() - 1
    }
    fn has_weights(&self) -> bool {
        true
    }
    fn view(&self) -> FeatureView<'_> {
        let (w, ws) = self.0.weights.as_ref().expect("SplitWeights has weights");
        FeatureView::Ragged {
            ids: Ids::I64(&self.0.values),
            offsets: Offsets::I64(&self.0.splits),
            weights: Some((w, Offsets::I64(ws))),
        }
    }
}

impl FlatBatch {
    /// Flattens `batch`.
    pub fn new(batch: &Batch) -> Self {
        let features = batch
            .features
            .iter()
            .map(|f| {
                let mut values = Vec::new();
                let mut splits = vec![0i64];
                for row in &f.rows {
                    values.extend_from_slice(row);
                    splits.push(values.len() as i64);
                }
                let weights = f.weights.as_ref().map(|w| {
                    let mut flat = Vec::new();
                    let mut ws = vec![0i64];
                    for r in 0..f.rows.len() {
                        if let Some(row) = w.get(r) {
                            flat.extend_from_slice(row);
                        }
                        ws.push(flat.len() as i64);
                    }
                    (flat, ws)
                });
                FlatFeature {
                    name: f.name.clone(),
                    values,
                    splits,
                    weights,
                }
            })
            .collect();
        FlatBatch { features }
    }

    /// Ids in the batch (duplicates included).
    pub fn num_ids(&self) -> usize {
        self.features.iter().map(|f| f.values.len()).sum()
    }

    /// One [`RaggedInput`] per feature (a view with separate weight splits where weight rows
    /// differ from id rows).
    pub fn sources(&self) -> Result<Vec<Box<dyn SampleSource + '_>>, Error> {
        self.features
            .iter()
            .map(|f| -> Result<Box<dyn SampleSource + '_>, Error> {
                let ids = RaggedInput::from_i64(&f.name, &f.values, &f.splits)?;
                Ok(match &f.weights {
                    None => Box::new(ids),
                    Some((w, ws)) if *ws == f.splits => Box::new(ids.with_weights(&f.name, w)?),
                    Some(_) => Box::new(SplitWeights(f)),
                })
            })
            .collect()
    }
}

/// Runs the crate itself on the same batch (RaggedInput views, `threads` workers, one fresh
/// Output).
pub fn run_crate(
    config: &Config,
    batch: &Batch,
    batch_number: u64,
    threads: usize,
) -> Result<Output, Error> {
    let flat = FlatBatch::new(batch);
    let sources = flat.sources()?;
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
    let mut prep = Preprocessor::builder(config.clone())
        .threads(threads)
        .build()?;
    prep.set_batch_number(batch_number);
    let mut out = Output::new();
    prep.run(&inputs, &mut out)?;
    Ok(out)
}

/// Ok(()) iff `ours` agrees with the model: same error kind on Err, and on Ok the same bytes
/// inside the written ranges (row pointers, ids, samples, gains bit-exact), same buffer sizes
/// and stats.
///
/// Outside the written ranges the crate must hold the padding triple (SPEC Part 1, 1.2), which
/// is what the model holds there too, so whole buffers are compared.
pub fn check(
    config: &Config,
    batch: &Batch,
    batch_number: u64,
    ours: Result<&Output, &Error>,
) -> Result<(), String> {
    compare(preprocess(config, batch, batch_number), ours)
}

/// Compares a model result with the crate's.
pub fn compare(
    model: Result<Vec<StackResult>, ModelError>,
    ours: Result<&Output, &Error>,
) -> Result<(), String> {
    match (model, ours) {
        (Ok(want), Ok(got)) => compare_outputs(&want, got),
        (Err(want), Err(got)) => compare_errors(&want, got.root()),
        (Ok(_), Err(got)) => Err(format!("the model succeeds, the crate fails: {got}")),
        (Err(want), Ok(_)) => Err(format!("the model fails with {want:?}, the crate succeeds")),
    }
}

/// Same error kind and the fields that identify it.
pub fn compare_errors(want: &ModelError, got: &Error) -> Result<(), String> {
    let same = match (want, got) {
        (ModelError::Unsupported(_), _) => {
            return Err(format!(
                "the model does not cover this config (crate: {got})"
            ))
        }
        (ModelError::Plan(m), e) => *m == e.to_string(),
        (
            ModelError::InputCount { expected, got: g },
            Error::InputCount {
                expected: e2,
                got: g2,
            },
        ) => expected == e2 && g == g2,
        (ModelError::BatchTooLarge { stack }, Error::BatchTooLarge { stack: s2, .. }) => {
            stack == s2
        }
        (
            ModelError::BatchNotDivisible {
                stack,
                feature,
                batch,
            },
            Error::BatchNotDivisible {
                stack: s2,
                feature: f2,
                batch: b2,
                ..
            },
        ) => stack == s2 && feature == f2 && batch == b2,
        (
            ModelError::BatchTooSmall { stack, batch },
            Error::BatchTooSmall {
                stack: s2,
                batch: b2,
                ..
            },
        ) => stack == s2 && batch == b2,
        (
            ModelError::IdOutOfRange { feature, row, id },
            Error::IdOutOfRange {
                feature: f2,
                row: r2,
                id: i2,
                ..
            },
        ) => feature == f2 && row == r2 && id == i2,
        (
            ModelError::InvalidWeight { feature, row },
            Error::InvalidWeight {
                feature: f2,
                row: r2,
                ..
            },
        ) => feature == f2 && row == r2,
        (
            ModelError::WeightsShape {
                feature,
                row,
                ids,
                weights,
            },
            Error::WeightsShape {
                feature: f2,
                row: r2,
                ids: i2,
                weights: w2,
            },
        ) => feature == f2 && row == r2 && ids == i2 && weights == w2,
        (
            ModelError::LimitExceeded {
                stack,
                kind,
                observed,
                limit,
                device,
                sc,
                partition,
            },
            Error::LimitExceeded {
                stack: s2,
                kind: k2,
                observed: o2,
                limit: l2,
                device: d2,
                sparsecore: c2,
                partition: p2,
            },
        ) => {
            stack == s2
                && kind == k2
                && observed == o2
                && limit == l2
                && device == d2
                && sc == c2
                && partition == p2
        }
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(format!("errors differ: model {want:?}, crate {got:?}"))
    }
}

/// Every stack's sizes, buffers (gains by bits) and statistics.
pub fn compare_outputs(want: &[StackResult], got: &Output) -> Result<(), String> {
    if got.num_minibatches != 1 {
        return Err(format!("num_minibatches {} (want 1)", got.num_minibatches));
    }
    if got.stacks.len() != want.len() {
        return Err(format!("{} stacks, want {}", got.stacks.len(), want.len()));
    }
    for (w, o) in want.iter().zip(&got.stacks) {
        let name = &w.name;
        if o.name != *name {
            return Err(format!(
                "stack {name}: the crate's stack here is {}",
                o.name
            ));
        }
        if o.row_pointers_per_device() != w.row_pointers_per_device
            || o.row_pointers.len() != w.row_pointers.len()
        {
            return Err(format!(
                "stack {name}: row pointers per device {} ({} in all), want {} ({})",
                o.row_pointers_per_device(),
                o.row_pointers.len(),
                w.row_pointers_per_device,
                w.row_pointers.len()
            ));
        }
        let c = w.coo_buffer_size_per_device;
        if o.coo_buffer_size_per_device() != c
            || o.embedding_ids.len() != w.embedding_ids.len()
            || o.sample_ids.len() != w.sample_ids.len()
            || o.gains.len() != w.gains.len()
        {
            return Err(format!(
                "stack {name}: C = {} ({}/{}/{} slots), want {c} ({})",
                o.coo_buffer_size_per_device(),
                o.embedding_ids.len(),
                o.sample_ids.len(),
                o.gains.len(),
                w.embedding_ids.len()
            ));
        }
        if let Some(i) = (0..w.row_pointers.len()).find(|&i| w.row_pointers[i] != o.row_pointers[i])
        {
            let rpd = w.row_pointers_per_device;
            return Err(format!(
                "stack {name}: row pointer {i} (device {}, index {}) is {}, want {}\n ours {:?}\n want {:?}",
                i / rpd,
                i % rpd,
                o.row_pointers[i],
                w.row_pointers[i],
                o.row_pointers,
                w.row_pointers
            ));
        }
        for i in 0..w.embedding_ids.len() {
            let ours = (o.embedding_ids[i], o.sample_ids[i], o.gains[i].to_bits());
            let model = (w.embedding_ids[i], w.sample_ids[i], w.gains[i].to_bits());
            if ours != model {
                let inside = w.valid_ranges.iter().any(|&(a, b)| a <= i && i < b);
                return Err(format!(
                    "stack {name}: slot {i} (device {}, offset {}; {} the written range) is (emb {}, sample {}, gain bits {:#x}), want ({}, {}, {:#x})",
                    i / c,
                    i % c,
                    if inside { "inside" } else { "outside" },
                    ours.0,
                    ours.1,
                    ours.2,
                    model.0,
                    model.1,
                    model.2
                ));
            }
        }
        let st = &o.stats;
        for (field, ours, model) in [
            (
                "max_ids_per_partition",
                &st.max_ids_per_partition,
                &w.max_ids_per_partition,
            ),
            (
                "max_unique_ids_per_partition",
                &st.max_unique_ids_per_partition,
                &w.max_unique_ids_per_partition,
            ),
            (
                "required_buffer_size_per_sc",
                &st.required_buffer_size_per_sc,
                &w.required_buffer_size_per_sc,
            ),
        ] {
            if ours != model {
                return Err(format!(
                    "stack {name}: stats.{field} {ours:?}, want {model:?}"
                ));
            }
        }
        if st.dropped_id_count != w.dropped_id_count {
            return Err(format!(
                "stack {name}: dropped_id_count {}, want {}",
                st.dropped_id_count, w.dropped_id_count
            ));
        }
    }
    Ok(())
}
