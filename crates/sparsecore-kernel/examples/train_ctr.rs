//! Trains a small CTR model end to end on the CPU backend, and checks that it learns.
//!
//! ```sh
//! cargo run --release -p sparsecore-kernel --example train_ctr
//! ```
//!
//! **Data.** The test kit's `criteo` workload (`sparsecore_testkit::workload::generate`): its
//! first [`Settings::features`] features (Zipf-skewed ids over the profile's smallest
//! vocabularies, 1 000 to ~13 000 rows, dim 16, sum combiner, one table each), plus a `label`
//! column drawn from a *planted* logistic model over embeddings: every id of every table has a
//! fixed random embedding `e*`, a fixed random `w*` scores it `z*(id) = ⟨e*(id), w*⟩`, and
//! `label ~ Bernoulli(sigmoid(α · (Σ_features Σ_ids z*(id) − μ)))`, with `α` and `μ` chosen so
//! that the planted logit has mean 0 and standard deviation [`Settings::logit_std`]. A correct
//! trainer can therefore learn it; the last [`Settings::heldout_batches`] batches are held out.
//!
//! **Model and step.** One embedding table per feature (initialised small and random) and a
//! logistic-regression head over the pooled features: `logit = Σ_f ⟨a_f, v_f⟩ + b`. Each step
//! streams one Arrow batch through `Preprocessor::run_record_batch`, `sparse_dense_matmul` per
//! stack, `feature_activations` per feature, the head and the log loss; the activation gradients
//! `(p − y) · v_f` go back through `stack_feature_gradients` (the adjoint of
//! `feature_activations`) into `apply_gradients` with Adagrad. The head takes the same Adagrad
//! step (`Optimizer::apply` on its weights).
//!
//! It prints, per epoch, the mean training log loss and the held-out log loss and AUC, and exits
//! non-zero unless the training loss fell by at least 10% from the first epoch to the last and
//! the final held-out AUC is at least 0.70. `tests/kernel/train_ctr.rs` runs a smaller
//! configuration of the same code.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::{Array, ArrayRef, Float32Array, Int64Array, ListArray, RecordBatch};
use ndarray::{Array1, Array2, ArrayView2, Axis};
use sparsecore_kernel::{
    apply_gradients, feature_activations, sparse_dense_matmul, stack_feature_gradients,
    KernelError, Optimizer, Result, Slots, StackedTable, Subject,
};
use sparsecore_prep::spec::Plan;
use sparsecore_prep::{Config, Error, Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

/// What to generate and how to train.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Samples per batch (a multiple of 4: layout 1/1/4).
    pub batch_size: usize,
    /// Training batches per epoch.
    pub train_batches: usize,
    /// Held-out batches.
    pub heldout_batches: usize,
    /// Epochs over the training batches.
    pub epochs: usize,
    /// The first this many criteo features (and their tables) are used.
    pub features: usize,
    /// Standard deviation of the planted logit.
    pub logit_std: f64,
    /// Adagrad learning rate of the embedding tables.
    pub embedding_lr: f32,
    /// Adagrad learning rate of the head.
    pub head_lr: f32,
    /// Seed of the data, the planted model and the initialisation.
    pub seed: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            batch_size: 1024,
            train_batches: 96,
            heldout_batches: 16,
            epochs: 6,
            features: 8,
            logit_std: 3.0,
            embedding_lr: 0.05,
            head_lr: 0.02,
            seed: 20240611,
        }
    }
}

/// One epoch's numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochReport {
    /// 1-based epoch.
    pub epoch: usize,
    /// Mean log loss over the epoch's training steps (before each step's update).
    pub train_loss: f64,
    /// Mean log loss on the held-out batches after the epoch.
    pub heldout_loss: f64,
    /// AUC on the held-out batches after the epoch.
    pub heldout_auc: f64,
}

/// The generated data set.
pub struct Dataset {
    /// The config (the first `features` criteo features and their tables).
    pub config: Config,
    /// Training batches, each with a `label` column.
    pub train: Vec<RecordBatch>,
    /// Held-out batches, each with a `label` column.
    pub heldout: Vec<RecordBatch>,
    /// Fraction of positive labels over all batches.
    pub positive_rate: f64,
    /// The AUC of the planted logits themselves on the held-out labels: the ceiling a learned
    /// model approaches.
    pub planted_heldout_auc: f64,
}

/// SplitMix64: the deterministic stream behind the planted model, the labels and the init.
fn splitmix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) from the key.
fn unit(key: u64) -> f64 {
    (splitmix(key) >> 11) as f64 / (1u64 << 53) as f64
}

/// A uniform draw in [-1, 1) from the key.
fn sym(key: u64) -> f64 {
    unit(key) * 2.0 - 1.0
}

fn key(seed: u64, a: u64, b: u64, c: u64) -> u64 {
    splitmix(splitmix(splitmix(seed ^ a) ^ b) ^ c)
}

/// The ids of sample `row` of a `List<Int64>` (or `List<Int32>`) column.
fn list_ids(column: &ListArray, row: usize) -> Vec<i64> {
    let values = column.value(row);
    if let Some(v) = values.as_any().downcast_ref::<Int64Array>() {
        v.values().to_vec()
    } else {
        let v = values
            .as_any()
            .downcast_ref::<arrow_array::Int32Array>()
            .expect("Int32 or Int64 ids");
        v.values().iter().map(|&x| x as i64).collect()
    }
}

/// Generates the workload and its planted labels.
pub fn dataset(settings: &Settings) -> Result<Dataset> {
    let mut spec = WorkloadSpec::new(Profile::Criteo);
    spec.batch_size = settings.batch_size;
    spec.num_batches = settings.train_batches + settings.heldout_batches;
    spec.seed = settings.seed;
    let workload = generate(&spec)?;
    let mut config = workload.config.clone();
    if settings.features == 0 || settings.features > config.features.len() {
        return Err(KernelError::parameter(
            "features",
            settings.features,
            format!("between 1 and {}", config.features.len()),
        ));
    }
    // Criteo's feature i reads table i: keep the first `features` of both.
    config.features.truncate(settings.features);
    config.tables.truncate(settings.features);
    let dim = config.tables[0].embedding_dim as usize;
    // The planted model: z*(t, id) = ⟨e*(t, id), w*⟩, e* and w* uniform with unit variance.
    let w_star: Vec<f64> = (0..dim)
        .map(|c| sym(key(settings.seed, 1, 0, c as u64)) * 3f64.sqrt())
        .collect();
    let z_star: Vec<Vec<f64>> = config
        .tables
        .iter()
        .enumerate()
        .map(|(t, table)| {
            (0..table.vocabulary_size)
                .map(|id| {
                    let salt = key(settings.seed, 2, t as u64, id);
                    (0..dim)
                        .map(|c| sym(splitmix(salt ^ c as u64)) * 3f64.sqrt() * w_star[c])
                        .sum::<f64>()
                        / (dim as f64).sqrt()
                })
                .collect()
        })
        .collect();
    // Raw planted logits of every sample.
    let raw: Vec<Vec<f64>> = workload
        .batches
        .iter()
        .map(|batch| {
            let columns: Vec<&ListArray> = config
                .features
                .iter()
                .map(|f| {
                    batch
                        .column_by_name(f.column_name())
                        .and_then(|c| c.as_any().downcast_ref::<ListArray>())
                        .expect("list column")
                })
                .collect();
            (0..batch.num_rows())
                .map(|r| {
                    columns
                        .iter()
                        .enumerate()
                        .map(|(t, col)| {
                            list_ids(col, r)
                                .iter()
                                .map(|&id| z_star[t][id as usize])
                                .sum::<f64>()
                        })
                        .sum()
                })
                .collect()
        })
        .collect();
    let all: Vec<f64> = raw.iter().flatten().copied().collect();
    let mean = all.iter().sum::<f64>() / all.len() as f64;
    let std = (all.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / all.len() as f64)
        .sqrt()
        .max(1e-12);
    let alpha = settings.logit_std / std;
    let mut positives = 0usize;
    let mut batches = Vec::with_capacity(workload.batches.len());
    for (b, (batch, logits)) in workload.batches.iter().zip(&raw).enumerate() {
        let labels: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(r, &x)| {
                let p = 1.0 / (1.0 + (-alpha * (x - mean)).exp());
                (unit(key(settings.seed, 3, b as u64, r as u64)) < p) as u8 as f32
            })
            .collect();
        positives += labels.iter().filter(|&&y| y == 1.0).count();
        let mut columns: Vec<(String, ArrayRef)> = batch
            .schema()
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(f, c)| (f.name().clone(), c.clone()))
            .collect();
        columns.push(("label".to_string(), Arc::new(Float32Array::from(labels))));
        batches.push(
            RecordBatch::try_from_iter(columns).map_err(|source| Error::Arrow {
                context: "adding the label column".into(),
                source,
            })?,
        );
    }
    let heldout = batches.split_off(settings.train_batches);
    let planted: Vec<f32> = raw[settings.train_batches..]
        .iter()
        .flatten()
        .map(|&x| x as f32)
        .collect();
    let heldout_labels: Vec<f32> = heldout
        .iter()
        .map(|b| labels(b).map(|y| y.to_vec()))
        .collect::<Result<Vec<_>>>()?
        .concat();
    let planted_heldout_auc = auc(&planted, &heldout_labels);
    Ok(Dataset {
        config,
        train: batches,
        heldout,
        positive_rate: positives as f64 / all.len() as f64,
        planted_heldout_auc,
    })
}

/// The model: one stacked table (and Adagrad slots) per stack, and the head.
struct Model {
    tables: Vec<StackedTable>,
    slots: Vec<Slots>,
    /// Per feature, `v_f` (`[embedding_dim]`).
    head: Vec<Array1<f32>>,
    head_acc: Vec<Array1<f32>>,
    bias: f32,
    bias_acc: f32,
}

impl Model {
    fn new(plan: &Plan, config: &Config, optimizer: &Optimizer, seed: u64) -> Result<Self> {
        let mut tables = Vec::new();
        let mut slots = Vec::new();
        for stack in &plan.stacks {
            let members: Vec<Array2<f32>> = stack
                .tables
                .iter()
                .map(|&t| {
                    let tc = &config.tables[t];
                    Array2::from_shape_fn(
                        (tc.vocabulary_size as usize, tc.embedding_dim as usize),
                        |(r, c)| 0.05 * sym(key(seed, 4, t as u64, (r * 1024 + c) as u64)) as f32,
                    )
                })
                .collect();
            let views: Vec<ArrayView2<'_, f32>> = members.iter().map(|m| m.view()).collect();
            let table = StackedTable::from_tables(plan, &stack.name, &views)?;
            slots.push(Slots::new(&table, optimizer));
            tables.push(table);
        }
        let head = plan
            .features
            .iter()
            .enumerate()
            .map(|(f, fp)| {
                Array1::from_shape_fn(fp.embedding_dim as usize, |c| {
                    0.1 * sym(key(seed, 5, f as u64, c as u64)) as f32
                })
            })
            .collect::<Vec<_>>();
        let head_acc = head
            .iter()
            .map(|h| Array1::from_elem(h.len(), optimizer.slot_inits()[0]))
            .collect();
        Ok(Model {
            tables,
            slots,
            head,
            head_acc,
            bias: 0.0,
            bias_acc: optimizer.slot_inits()[0],
        })
    }

    /// Forward pass: per feature its activations `[B, dim]` (layout 1/1/S: device 0, rows in
    /// sample order), and the logits.
    fn forward(&self, plan: &Plan, out: &Output) -> Result<(Vec<Array2<f32>>, Array1<f32>)> {
        let mut acts: Vec<Option<Array2<f32>>> = vec![None; plan.features.len()];
        for ((stack, so), table) in plan.stacks.iter().zip(&out.stacks).zip(&self.tables) {
            let device = sparse_dense_matmul(plan, so, out.num_minibatches, table)?;
            for &f in &stack.features {
                acts[f] = Some(feature_activations(plan, f, device[0].view())?);
            }
        }
        let acts: Vec<Array2<f32>> = acts
            .into_iter()
            .map(|a| a.expect("every feature is in a stack"))
            .collect();
        let mut logits = Array1::from_elem(acts[0].nrows(), self.bias);
        for (a, v) in acts.iter().zip(&self.head) {
            logits += &a.dot(v);
        }
        Ok((acts, logits))
    }
}

/// Labels of a batch.
fn labels(batch: &RecordBatch) -> Result<Array1<f32>> {
    let col = batch
        .column_by_name("label")
        .and_then(|c| c.as_any().downcast_ref::<Float32Array>())
        .ok_or_else(|| KernelError::input(Subject::Column("label".into()), "no Float32 column"))?;
    Ok(Array1::from(col.values().to_vec()))
}

/// Mean log loss of logits `z` against labels `y`, computed stably.
fn log_loss(z: &Array1<f32>, y: &Array1<f32>) -> f64 {
    z.iter()
        .zip(y)
        .map(|(&z, &y)| {
            let z = z as f64;
            // −[y log σ(z) + (1 − y) log(1 − σ(z))] = softplus(z) − y·z
            z.max(0.0) + (-z.abs()).exp().ln_1p() - y as f64 * z
        })
        .sum::<f64>()
        / z.len() as f64
}

/// The AUC of `scores` against binary `labels`: the Mann-Whitney statistic, ties counting half.
pub fn auc(scores: &[f32], labels: &[f32]) -> f64 {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut pos) = (0.0f64, 0usize);
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j < idx.len() && scores[idx[j]] == scores[idx[i]] {
            j += 1;
        }
        // Ranks i+1..=j share their mean.
        let mean_rank = (i + 1 + j) as f64 / 2.0;
        for &k in &idx[i..j] {
            if labels[k] == 1.0 {
                rank_sum += mean_rank;
                pos += 1;
            }
        }
        i = j;
    }
    let neg = scores.len() - pos;
    if pos == 0 || neg == 0 {
        return 0.5;
    }
    (rank_sum - (pos * (pos + 1)) as f64 / 2.0) / (pos as f64 * neg as f64)
}

/// Trains on `data`, calling `on_epoch` after each epoch.
pub fn train(
    settings: &Settings,
    data: &Dataset,
    mut on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    let mut prep = Preprocessor::new(data.config.clone())?;
    let plan = prep
        .plan_for(&vec![settings.batch_size; data.config.features.len()])?
        .clone();
    if plan.layout.local_devices != 1 || plan.layout.global_devices != 1 {
        return Err(KernelError::parameter(
            "layout",
            "L/G",
            "this example trains on one device",
        ));
    }
    let emb_opt = Optimizer::Adagrad {
        lr: settings.embedding_lr,
    };
    let head_opt = Optimizer::Adagrad {
        lr: settings.head_lr,
    };
    let mut model = Model::new(&plan, &data.config, &emb_opt, settings.seed)?;
    let mut out = Output::new();
    let mut reports = Vec::new();
    for epoch in 1..=settings.epochs {
        let mut loss_sum = 0.0;
        for batch in &data.train {
            prep.run_record_batch(batch, &mut out)?;
            let y = labels(batch)?;
            let (acts, logits) = model.forward(&plan, &out)?;
            loss_sum += log_loss(&logits, &y);
            // d(Σ loss)/d logit = σ(z) − y, per sample (the sum over the batch, so that a row's
            // gradient adds up over the samples that use it).
            let dz: Array1<f32> = logits
                .iter()
                .zip(&y)
                .map(|(&z, &y)| 1.0 / (1.0 + (-z).exp()) - y)
                .collect();
            let dz_col = dz.view().insert_axis(Axis(1));
            // Back through the head into every stack's device layout, then Adagrad on the rows.
            for (s, stack) in plan.stacks.iter().enumerate() {
                let grads: Vec<(usize, Array2<f32>)> = stack
                    .features
                    .iter()
                    .map(|&f| (f, &dz_col * &model.head[f].view().insert_axis(Axis(0))))
                    .collect();
                let views: Vec<(usize, ArrayView2<'_, f32>)> =
                    grads.iter().map(|(f, g)| (*f, g.view())).collect();
                let device_grad = stack_feature_gradients(&plan, &stack.name, &views)?;
                apply_gradients(
                    &plan,
                    &out.stacks[s],
                    out.num_minibatches,
                    &[device_grad.view()],
                    &emb_opt,
                    &mut model.tables[s],
                    &mut model.slots[s],
                )?;
            }
            // The head's own step, mean gradient over the batch.
            let n = y.len() as f32;
            for ((a, v), acc) in acts
                .iter()
                .zip(model.head.iter_mut())
                .zip(model.head_acc.iter_mut())
            {
                let g = a.t().dot(&dz) / n;
                head_opt.apply(
                    g.as_slice().expect("contiguous"),
                    v.as_slice_mut().expect("contiguous"),
                    &mut [acc.as_slice_mut().expect("contiguous")],
                );
            }
            let gb = [dz.sum() / n];
            head_opt.apply(
                &gb,
                std::slice::from_mut(&mut model.bias),
                &mut [std::slice::from_mut(&mut model.bias_acc)],
            );
        }
        // Held-out evaluation.
        let (mut scores, mut ys, mut heldout_loss) = (Vec::new(), Vec::new(), 0.0);
        for batch in &data.heldout {
            prep.run_record_batch(batch, &mut out)?;
            let y = labels(batch)?;
            let (_, logits) = model.forward(&plan, &out)?;
            heldout_loss += log_loss(&logits, &y);
            scores.extend(logits.iter().copied());
            ys.extend(y.iter().copied());
        }
        let report = EpochReport {
            epoch,
            train_loss: loss_sum / data.train.len().max(1) as f64,
            heldout_loss: heldout_loss / data.heldout.len().max(1) as f64,
            heldout_auc: auc(&scores, &ys),
        };
        on_epoch(&report);
        reports.push(report);
    }
    Ok(reports)
}

/// The example's acceptance check: the training loss fell by at least 10% from the first epoch
/// to the last, and the final held-out AUC is at least 0.70.
pub fn check(reports: &[EpochReport]) -> std::result::Result<(), String> {
    let (first, last) = match (reports.first(), reports.last()) {
        (Some(f), Some(l)) => (f, l),
        _ => return Err("no epochs".into()),
    };
    let fall = 1.0 - last.train_loss / first.train_loss;
    if fall.is_nan() || fall < 0.10 {
        return Err(format!(
            "training loss fell by {:.1}% (from {:.4} to {:.4}), expected at least 10%",
            100.0 * fall,
            first.train_loss,
            last.train_loss
        ));
    }
    if last.heldout_auc.is_nan() || last.heldout_auc < 0.70 {
        return Err(format!(
            "held-out AUC {:.4}, expected at least 0.70",
            last.heldout_auc
        ));
    }
    Ok(())
}

#[allow(dead_code)] // tests/kernel/train_ctr.rs includes this file as a module.
fn main() -> ExitCode {
    let settings = Settings::default();
    let start = Instant::now();
    let data = match dataset(&settings) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("train_ctr: generating the data: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "data: {} features, {} training + {} held-out batches of {} samples, {:.1}% positive, planted model's held-out AUC {:.4} (generated in {:.2?})",
        data.config.features.len(),
        data.train.len(),
        data.heldout.len(),
        settings.batch_size,
        100.0 * data.positive_rate,
        data.planted_heldout_auc,
        start.elapsed()
    );
    let train_start = Instant::now();
    let reports = match train(&settings, &data, |r| {
        println!(
            "epoch {}: train loss {:.4}  held-out loss {:.4}  held-out AUC {:.4}  ({:.2?})",
            r.epoch,
            r.train_loss,
            r.heldout_loss,
            r.heldout_auc,
            train_start.elapsed()
        )
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("train_ctr: training: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("total {:.2?}", start.elapsed());
    match check(&reports) {
        Ok(()) => {
            let (f, l) = (reports[0], reports[reports.len() - 1]);
            println!(
                "ok: training loss fell {:.1}%, held-out AUC {:.4}",
                100.0 * (1.0 - l.train_loss / f.train_loss),
                l.heldout_auc
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_ctr: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
