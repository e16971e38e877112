//! Balanced batches for ordinary CTR data: reorder the samples of a window of record batches so
//! that every (local SparseCore slice, partition) cell gets an even share of ids.
//!
//! Limits and COO buffers are sized by the busiest cell of any batch. The S slices of a local
//! batch belong to one training step, so moving a sample (with every column of its row) from one
//! slice to another changes no gradient sum or mean, but it can lower the busiest cell. Pooling a
//! window of W batches and handing the samples back out as W batches of the same sizes lowers it
//! further.
//!
//! The balancer counts each sample's ids per (stack, partition) after the per-sample merge of
//! duplicate ids, exactly as the pipeline counts them (a sample's repeated id in one feature is
//! one id; the same id in two features of a stack is two, since their stacked rows differ). It
//! then places samples greedily: in decreasing order of their largest count relative to the
//! stack's `max_ids_per_partition`, each into the slice (with room left) where the new peak is
//! lowest. Finally it runs the real pipeline's statistics on both orders and keeps the input
//! order unless every output batch is at least as good, by its worst `max_ids` relative to the
//! limit, then `max_unique_ids`, then required buffer, as its input batch (W = 1) or as the
//! window's worst input batch (W > 1, where batches trade samples): balancing never makes a
//! batch worse than what it was, or was pooled from.
//!
//! Everything runs on one thread in a fixed order, so the result does not depend on the thread
//! count.

use arrow_array::{RecordBatch, UInt32Array};

use crate::error::{Error, Result};
use crate::input::{features_from_record_batch, FeatureView, Ids, SampleSource};
use crate::output::Output;
use crate::preprocess::Preprocessor;
use crate::spec::{Config, Plan};

/// Where one output row comes from: input batch `batch`, row `row` (both within the window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SampleRef {
    /// Index of the input batch in the window.
    pub batch: usize,
    /// Row within that batch.
    pub row: usize,
}

/// The worst cells of one stack over a window's batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StackLoad {
    /// Largest `max_ids_per_partition` of any batch.
    pub max_ids_per_partition: i32,
    /// Largest `max_unique_ids_per_partition` of any batch.
    pub max_unique_ids_per_partition: i32,
    /// Largest per-device required buffer of any batch.
    pub required_buffer: u64,
}

/// What balancing a window did, per stack (in plan order).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct BalanceReport {
    /// Batches in the window.
    pub batches: usize,
    /// Stack names.
    pub stacks: Vec<String>,
    /// Worst cells in the input order.
    pub before: Vec<StackLoad>,
    /// Worst cells in the returned order (equal to `before` when the input order was kept).
    pub after: Vec<StackLoad>,
    /// Whether the balanced order was kept (false: it would have made some batch worse, or
    /// there was nothing to move).
    pub reordered: bool,
}

/// A balanced window: the batches in their new order, the permutation and the report.
#[derive(Debug, Clone)]
pub struct Balanced {
    /// The same rows, reordered; each batch keeps its input size and schema.
    pub batches: Vec<RecordBatch>,
    /// `permutation[k][i]`: where row i of output batch k comes from.
    pub permutation: Vec<Vec<SampleRef>>,
    /// Before and after.
    pub report: BalanceReport,
}

/// One sample's ids per (stack, partition) cell, after the per-sample, per-feature merge.
struct SampleLoad {
    /// (cell, ids) pairs, cells ascending.
    cells: Vec<(u32, u32)>,
    /// Largest ids / limit over the cells.
    peak: f64,
}

/// Balances a window of record batches for `config` (see the module docs). The batches must
/// share one schema; each output batch keeps the size of the input batch at its position.
pub fn balance(config: &Config, window: &[RecordBatch]) -> Result<Balanced> {
    let Some(first) = window.first() else {
        return Ok(Balanced { batches: Vec::new(), permutation: Vec::new(), report: BalanceReport::default() });
    };
    for (k, b) in window.iter().enumerate().skip(1) {
        if b.schema() != first.schema() {
            return Err(Error::input(
                "balance",
                format!("batch {k} of the window has another schema than batch 0 ({} vs {} columns, or other types)", b.num_columns(), first.num_columns()),
            ));
        }
    }
    let mut prep = Preprocessor::builder(config.clone()).threads(1).build()?;
    let identity: Vec<Vec<SampleRef>> =
        window.iter().enumerate().map(|(b, rb)| (0..rb.num_rows()).map(|row| SampleRef { batch: b, row }).collect()).collect();
    let before = window_loads(&mut prep, window)?;
    let stacks: Vec<String> = prep.plan().map(|p| p.stacks.iter().map(|s| s.name.clone()).collect()).unwrap_or_default();
    let keep = |before: Vec<Vec<StackLoad>>| -> Result<Balanced> {
        let worst = worst_per_stack(&before);
        Ok(Balanced {
            batches: window.to_vec(),
            permutation: identity.clone(),
            report: BalanceReport { batches: window.len(), stacks: stacks.clone(), before: worst.clone(), after: worst, reordered: false },
        })
    };

    // Per-sample loads, and the slices each batch is cut into.
    let mut samples: Vec<(SampleRef, SampleLoad)> = Vec::new();
    let mut slice_rows: Vec<usize> = Vec::new(); // rows per slice, per batch (0: not balanceable)
    for (b, rb) in window.iter().enumerate() {
        let features = features_from_record_batch(config, rb)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
        let sizes: Vec<usize> = inputs.iter().map(|i| i.num_samples()).collect();
        let plan = prep.plan_for(&sizes)?.clone();
        let slices = plan.layout.local_scs();
        let rows = rb.num_rows();
        // Every feature of a record batch has its rows; a batch that does not split evenly
        // over the slices is left alone (the pipeline would reject it anyway).
        if rows == 0 || !rows.is_multiple_of(slices) || sizes.iter().any(|&s| s != rows) {
            return keep(before);
        }
        slice_rows.push(rows / slices);
        for row in 0..rows {
            samples.push((SampleRef { batch: b, row }, sample_load(&plan, &inputs, row)?));
        }
    }
    let slices_per_batch = prep.plan().map(|p| p.layout.local_scs()).unwrap_or(1);
    let cells = prep.plan().map(|p| p.stacks.len() * p.layout.num_partitions()).unwrap_or(0);
    let limits: Vec<f64> = prep
        .plan()
        .map(|p| {
            p.stacks
                .iter()
                .flat_map(|s| std::iter::repeat_n(s.max_ids_per_partition.max(1) as f64, p.layout.num_partitions()))
                .collect()
        })
        .unwrap_or_default();

    // Greedy placement: heaviest samples first, each where the new peak is lowest (ties: the
    // slice with the least load so far, then the lowest index), so the order is deterministic.
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by(|&a, &b| samples[b].1.peak.total_cmp(&samples[a].1.peak).then(a.cmp(&b)));
    let nslices = window.len() * slices_per_batch;
    let capacity: Vec<usize> = (0..nslices).map(|s| slice_rows[s / slices_per_batch]).collect();
    let mut load = vec![0u32; nslices * cells];
    let mut peak = vec![0f64; nslices];
    let mut total = vec![0u64; nslices];
    let mut members: Vec<Vec<SampleRef>> = vec![Vec::new(); nslices];
    for &i in &order {
        let (sample, sl) = &samples[i];
        let mut best: Option<(f64, u64, usize)> = None;
        for s in 0..nslices {
            if members[s].len() >= capacity[s] {
                continue;
            }
            let row = &load[s * cells..(s + 1) * cells];
            let new_peak = sl.cells.iter().fold(peak[s], |m, &(c, n)| m.max((row[c as usize] + n) as f64 / limits[c as usize]));
            let candidate = (new_peak, total[s], s);
            if best.is_none_or(|b| candidate.0 < b.0 || (candidate.0 == b.0 && (candidate.1, candidate.2) < (b.1, b.2))) {
                best = Some(candidate);
            }
        }
        let (new_peak, _, s) = best.expect("the slices hold exactly the window's rows");
        for &(c, n) in &sl.cells {
            load[s * cells + c as usize] += n;
            total[s] += n as u64;
        }
        peak[s] = new_peak;
        members[s].push(*sample);
    }
    let permutation: Vec<Vec<SampleRef>> = (0..window.len())
        .map(|b| {
            (0..slices_per_batch)
                .flat_map(|j| {
                    let mut m = std::mem::take(&mut members[b * slices_per_batch + j]);
                    m.sort();
                    m
                })
                .collect()
        })
        .collect();
    let batches = apply(window, &permutation)?;
    let after = window_loads(&mut prep, &batches)?;
    // Never worse: every output batch must be at least as good as its input batch, compared by
    // (worst max_ids relative to its limit, then max_unique, then buffer) over the stacks.
    let plan = prep.plan().cloned();
    let score = |loads: &[StackLoad]| -> (f64, f64, u64) {
        let Some(plan) = &plan else { return (0.0, 0.0, 0) };
        let mut s = (0.0f64, 0.0f64, 0u64);
        for (l, st) in loads.iter().zip(&plan.stacks) {
            s.0 = s.0.max(l.max_ids_per_partition as f64 / st.max_ids_per_partition.max(1) as f64);
            s.1 = s.1.max(l.max_unique_ids_per_partition as f64 / st.max_unique_ids_per_partition.max(1) as f64);
            s.2 += l.required_buffer;
        }
        s
    };
    let worse_than = |a: (f64, f64, u64), b: (f64, f64, u64)| a.0 > b.0 || (a.0 == b.0 && (a.1 > b.1 || (a.1 == b.1 && a.2 > b.2)));
    // With one batch, the output is that batch reordered, compared with itself. With a pooled
    // window the batches trade samples, so each output batch is held to the window's worst
    // input batch, the bound its samples came from.
    let window_bound = before.iter().map(|b| score(b)).fold((0.0, 0.0, 0), |m, s| if worse_than(s, m) { s } else { m });
    let worse = before.iter().zip(&after).any(|(b, a)| worse_than(score(a), if window.len() == 1 { score(b) } else { window_bound }));
    if worse || permutation == identity {
        return keep(before);
    }
    Ok(Balanced {
        batches,
        permutation,
        report: BalanceReport {
            batches: window.len(),
            stacks,
            before: worst_per_stack(&before),
            after: worst_per_stack(&after),
            reordered: true,
        },
    })
}

/// Applies a permutation to a window: output batch k takes `permutation[k]`'s rows, every
/// column moving together (Arrow `take`).
pub fn apply(window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Result<Vec<RecordBatch>> {
    let arrow = |source| Error::Arrow { context: "reordering a window of batches".into(), source };
    let Some(first) = window.first() else { return Ok(Vec::new()) };
    let pooled = arrow_select::concat::concat_batches(&first.schema(), window).map_err(arrow)?;
    let mut starts = vec![0usize; window.len() + 1];
    for (b, rb) in window.iter().enumerate() {
        starts[b + 1] = starts[b] + rb.num_rows();
    }
    permutation
        .iter()
        .map(|rows| {
            let mut index = Vec::with_capacity(rows.len());
            for r in rows {
                if r.batch >= window.len() || r.row >= window[r.batch].num_rows() {
                    return Err(Error::input("balance", format!("permutation names row {} of batch {}, which does not exist", r.row, r.batch)));
                }
                index.push(u32::try_from(starts[r.batch] + r.row).map_err(|_| Error::input("balance", "window of more than 2^32 rows"))?);
            }
            arrow_select::take::take_record_batch(&pooled, &UInt32Array::from(index)).map_err(arrow)
        })
        .collect()
}

/// One sample's ids per (stack, partition), merged per feature as the pipeline merges them.
fn sample_load(plan: &Plan, inputs: &[&dyn SampleSource], row: usize) -> Result<SampleLoad> {
    let n = plan.layout.num_partitions();
    let mask = (n - 1) as u32;
    let mut cells: Vec<(u32, u32)> = Vec::new();
    let mut cols: Vec<u32> = Vec::new();
    for (f, fp) in plan.features.iter().enumerate() {
        cols.clear();
        match inputs[f].view() {
            FeatureView::Ragged { ids, offsets, .. } => {
                if row >= offsets.rows() {
                    return Err(Error::input(&fp.name, format!("row {row} is outside the batch of {}", offsets.rows())));
                }
                let (a, b) = offsets.range(row);
                let col = |id: i64| {
                    let id = id as u32;
                    ((id.wrapping_add(fp.col_shift) & mask) | (id & !mask)).wrapping_add(fp.col_offset)
                };
                match ids {
                    Ids::I32(v) => cols.extend(v.get(a..b).unwrap_or_default().iter().map(|&i| col(i as i64))),
                    Ids::I64(v) => cols.extend(v.get(a..b).unwrap_or_default().iter().map(|&i| col(i))),
                }
            }
            _ => return Err(Error::input(&fp.name, "balancing reads record batches, whose features are ragged lists")),
        }
        cols.sort_unstable();
        cols.dedup();
        for &c in &cols {
            cells.push(((fp.stack * n) as u32 + (c & mask), 1));
        }
    }
    cells.sort_unstable();
    let mut merged: Vec<(u32, u32)> = Vec::with_capacity(cells.len());
    for (c, k) in cells {
        match merged.last_mut() {
            Some(last) if last.0 == c => last.1 += k,
            _ => merged.push((c, k)),
        }
    }
    let peak = merged
        .iter()
        .map(|&(c, k)| k as f64 / plan.stacks[c as usize / n].max_ids_per_partition.max(1) as f64)
        .fold(0.0, f64::max);
    Ok(SampleLoad { cells: merged, peak })
}

/// Each batch's per-stack worst cells, from the pipeline's own statistics.
fn window_loads(prep: &mut Preprocessor, batches: &[RecordBatch]) -> Result<Vec<Vec<StackLoad>>> {
    let mut out = Output::new();
    let mut loads = Vec::with_capacity(batches.len());
    // (A copy: the batch's views borrow the config while `prep` runs mutably.)
    let config = prep.config().clone();
    for rb in batches {
        let features = features_from_record_batch(&config, rb)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
        prep.run_stats(&inputs, &mut out)?;
        let s = prep.plan().map(|p| p.layout.sc_per_device).unwrap_or(1);
        loads.push(
            out.stacks
                .iter()
                .map(|so| StackLoad {
                    max_ids_per_partition: so.stats.max_ids(),
                    max_unique_ids_per_partition: so.stats.max_unique_ids(),
                    required_buffer: so.stats.required_buffer_size_per_device(s),
                })
                .collect(),
        );
    }
    Ok(loads)
}

fn worst_per_stack(loads: &[Vec<StackLoad>]) -> Vec<StackLoad> {
    let mut worst: Vec<StackLoad> = Vec::new();
    for batch in loads {
        worst.resize(worst.len().max(batch.len()), StackLoad::default());
        for (w, l) in worst.iter_mut().zip(batch) {
            w.max_ids_per_partition = w.max_ids_per_partition.max(l.max_ids_per_partition);
            w.max_unique_ids_per_partition = w.max_unique_ids_per_partition.max(l.max_unique_ids_per_partition);
            w.required_buffer = w.required_buffer.max(l.required_buffer);
        }
    }
    worst
}

/// A lower bound on any order's worst `max_ids_per_partition`, per stack: the ids a window sends
/// to partition p must land in one of its W·L·S slices, so some slice gets at least
/// ⌈ids to p / (W·L·S)⌉ of them. (Per device the pipeline reports the largest over its S
/// SparseCores, so the bound holds for every device's statistic too.)
pub fn lower_bound(config: &Config, window: &[RecordBatch]) -> Result<Vec<u32>> {
    let mut prep = Preprocessor::builder(config.clone()).threads(1).build()?;
    let mut totals: Vec<u64> = Vec::new();
    let mut slices = 0usize;
    let mut plan_shape = (0usize, 1usize);
    for rb in window {
        let features = features_from_record_batch(config, rb)?;
        let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
        let sizes: Vec<usize> = inputs.iter().map(|i| i.num_samples()).collect();
        let plan = prep.plan_for(&sizes)?.clone();
        let n = plan.layout.num_partitions();
        plan_shape = (plan.stacks.len(), n);
        totals.resize(plan.stacks.len() * n, 0);
        slices += plan.layout.local_scs();
        for row in 0..rb.num_rows() {
            for (cell, k) in sample_load(&plan, &inputs, row)?.cells {
                totals[cell as usize] += k as u64;
            }
        }
    }
    let (stacks, n) = plan_shape;
    Ok((0..stacks)
        .map(|s| totals[s * n..(s + 1) * n].iter().map(|&t| t.div_ceil(slices.max(1) as u64) as u32).max().unwrap_or(0))
        .collect())
}
