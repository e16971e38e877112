//! Trains TransE end to end on BESS batches that run through the SparseCore pipeline.
//!
//! The graph has planted structure: every entity and relation has a hidden vector, and the
//! tail of `(h, r)` is the entity nearest to `hidden(h) + hidden(r)` (so it can be learned).
//! 10% of the triples are held out. Batches and negatives come from [`BessStream`] (Random
//! sampler, flat tail negatives: every SparseCore scores its triples against `k` negatives from
//! every shard); the entity embeddings live in a `StackedTable` on the CPU backend and are
//! looked up through `Preprocessor` + `sparse_dense_matmul` + `feature_activations`, and
//! updated with `apply_gradients` (Adagrad); relation embeddings are a small host matrix.
//! Loss: sampled softmax over the positive tail and the slice's negatives, with TransE scores
//! `-||h + r - t||²`. It prints the loss per epoch and the filtered MRR and Hits@10 of tail
//! prediction on the held-out triples, before and after training.
//!
//! `cargo run --release -p sparsecore-bess --example train_kge`

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use ndarray::{s, Array2, ArrayView2};
use sparsecore_bess::{BessStream, Corruption, NumpyRng, Triples};
use sparsecore_kernel::{
    apply_gradients, feature_activations, sparse_dense_matmul, Optimizer, Slots, StackedTable,
};
use sparsecore_prep::{Output, Preprocessor};

const E: usize = 1000;
const R: usize = 8;
const D: usize = 32;
const HIDDEN: usize = 8;
const EPOCHS: usize = 40;
const SHARD_BS: usize = 64;
const K: usize = 16;

fn normal(rng: &mut NumpyRng) -> f32 {
    // Box-Muller on two 53-bit uniforms.
    let u = |rng: &mut NumpyRng| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (a, b) = (u(rng), u(rng));
    ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
}

/// Planted triples: for every (h, r), the tail nearest to hidden(h) + hidden(r), h excluded.
fn planted_graph(seed: u64) -> Vec<[i64; 3]> {
    let mut rng = NumpyRng::new(u128::from(seed));
    let ent = Array2::from_shape_fn((E, HIDDEN), |_| normal(&mut rng));
    let rel = Array2::from_shape_fn((R, HIDDEN), |_| 0.8 * normal(&mut rng));
    let mut out = Vec::with_capacity(E * R);
    for h in 0..E {
        for r in 0..R {
            let q = &ent.row(h) + &rel.row(r);
            let best = (0..E)
                .filter(|&e| e != h)
                .map(|e| (e, (&q - &ent.row(e)).mapv(|x| x * x).sum()))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(e, _)| e)
                .expect("entities");
            out.push([h as i64, r as i64, best as i64]);
        }
    }
    out
}

/// Filtered MRR and Hits@10 of tail prediction: the true tail's rank among all entities, other
/// known true tails of (h, r) removed.
fn evaluate(
    entity: &Array2<f32>,
    relation: &Array2<f32>,
    test: &[[i64; 3]],
    known: &HashMap<(i64, i64), HashSet<i64>>,
) -> (f64, f64) {
    let (mut mrr, mut hits) = (0.0, 0.0);
    for &[h, r, t] in test {
        let q = &entity.row(h as usize) + &relation.row(r as usize);
        let score = |e: usize| -> f32 { -(&q - &entity.row(e)).mapv(|x| x * x).sum() };
        let st = score(t as usize);
        let filtered = &known[&(h, r)];
        let better = (0..E)
            .filter(|&e| e as i64 != t && !filtered.contains(&(e as i64)) && score(e) > st)
            .count();
        let rank = better + 1;
        mrr += 1.0 / rank as f64;
        hits += f64::from(u8::from(rank <= 10));
    }
    (mrr / test.len() as f64, hits / test.len() as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let mut all = planted_graph(2024);
    let mut rng = NumpyRng::new(7);
    let perm = rng.permutation(all.len());
    all = perm.iter().map(|&i| all[i]).collect();
    let n_test = all.len() / 10;
    let (test, train) = all.split_at(n_test);
    let distinct_tails: HashSet<i64> = all.iter().map(|t| t[2]).collect();
    let mut known: HashMap<(i64, i64), HashSet<i64>> = HashMap::new();
    for &[h, r, t] in &all {
        known.entry((h, r)).or_default().insert(t);
    }
    println!("TransE on a planted graph: {E} entities, {R} relations, {} train / {} held-out triples, {} distinct tails", train.len(), test.len(), distinct_tails.len());

    let mut stream = BessStream::builder()
        .triples(Triples::from_rows(train))
        .n_entity(E)
        .n_relation(R)
        .devices(1, 1, 4)
        .embedding_dim(D)
        .shard_batch_size(SHARD_BS)
        .negatives(K)
        .corruption(Corruption::T)
        .flat_negatives(true)
        .seeds(1, 2, 3)
        .build()?;
    let counts = *stream.counts();
    let steps_per_epoch = stream.steps();
    let lay = *stream.layout();
    let (n, s_per_dev) = (lay.num_sparsecores(), lay.sc_per_device);
    println!(
        "n = N = {n} SparseCores; {} triples and {} negatives per SparseCore per step; limits {} ids per (SparseCore, partition); {steps_per_epoch} steps per epoch",
        counts.triples_per_sparsecore,
        counts.negative_ids_per_partition * n,
        counts.max_ids_per_partition
    );
    let config = stream.config().clone();
    let mut prep = Preprocessor::new(config.clone())?;
    let mut out = Output::new();

    // Plan once (every batch has the same shape).
    let first = stream.draw(0)?;
    prep.run_record_batch(&first.record_batch, &mut out)?;
    let plan = prep.plan().expect("planned").clone();
    let fidx = |name: &str| {
        plan.features
            .iter()
            .position(|f| f.name == name)
            .expect("feature")
    };
    let (fh, ft, fneg) = (fidx("head"), fidx("tail"), fidx("negative"));
    let vocab = config.tables[0].vocabulary_size as usize;
    let mut init_rng = NumpyRng::new(11);
    let init = Array2::from_shape_fn((vocab, D), |_| 0.1 * normal(&mut init_rng));
    let mut table = StackedTable::from_tables(&plan, "entities", &[init.view()])?;
    let optimizer = Optimizer::Adagrad { lr: 0.2 };
    let mut slots = Slots::new(&table, &optimizer);
    let mut relation = Array2::from_shape_fn((R, D), |_| 0.1 * normal(&mut init_rng));
    let mut rel_acc = Array2::<f32>::from_elem((R, D), 0.1);

    let phys: Vec<usize> = (0..E as i64)
        .map(|e| stream.physical_id_of_entity(e).map(|p| p as usize))
        .collect::<Result<_, _>>()?;
    let entity_matrix =
        |table: &StackedTable| -> Result<Array2<f32>, sparsecore_kernel::KernelError> {
            let t = table.table(&plan, 0)?;
            Ok(Array2::from_shape_fn((E, D), |(e, d)| t[[phys[e], d]]))
        };
    let (mrr0, hits0) = evaluate(&entity_matrix(&table)?, &relation, test, &known);
    println!("untrained: filtered MRR {mrr0:.4}, Hits@10 {hits0:.4}");

    let r_rows = counts.rows_per_sparsecore;
    let t_rows = counts.triples_per_sparsecore;
    let neg_rows = counts.negative_ids_per_partition * n;
    let mut step = 1;
    let mut pending = Some(first);
    for epoch in 0..EPOCHS {
        let (mut loss_sum, mut loss_n) = (0.0f64, 0usize);
        for _ in 0..steps_per_epoch {
            let batch = match pending.take() {
                Some(b) => b,
                None => {
                    step += 1;
                    stream.draw(step)?
                }
            };
            prep.run_record_batch(&batch.record_batch, &mut out)?;
            let so = out.stack("entities").expect("stack");
            assert_eq!(so.stats.dropped_id_count, 0);
            let acts = sparse_dense_matmul(&plan, so, out.num_minibatches, &table)?;
            let rel_col = batch
                .record_batch
                .column_by_name("relation")
                .expect("relation");
            let rel_ids = rel_col
                .as_any()
                .downcast_ref::<arrow_array::Int32Array>()
                .expect("Int32");
            let mut grads: Vec<Array2<f32>> = Vec::with_capacity(acts.len());
            let mut rel_grad = Array2::<f32>::zeros((R, D));
            for (d, act) in acts.iter().enumerate() {
                let ah = feature_activations(&plan, fh, act.view())?;
                let at = feature_activations(&plan, ft, act.view())?;
                let an = feature_activations(&plan, fneg, act.view())?;
                let (mut gh, mut gt, mut gn) = (
                    Array2::<f32>::zeros(ah.dim()),
                    Array2::<f32>::zeros(at.dim()),
                    Array2::<f32>::zeros(an.dim()),
                );
                for sc in 0..s_per_dev {
                    let base = sc * r_rows;
                    let negs: ArrayView2<f32> = an.slice(s![base..base + neg_rows, ..]);
                    for row in base..base + t_rows {
                        let rel = rel_ids.value((d * s_per_dev) * r_rows + row) as usize;
                        let u = &ah.row(row) + &relation.row(rel);
                        // Logits: the true tail, then every negative of the slice.
                        let diff_t = &u - &at.row(row);
                        let mut logits = Vec::with_capacity(neg_rows + 1);
                        logits.push(-diff_t.dot(&diff_t));
                        for nr in negs.outer_iter() {
                            let dn = &u - &nr;
                            logits.push(-dn.dot(&dn));
                        }
                        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let z: f32 = logits.iter().map(|&l| (l - m).exp()).sum();
                        loss_sum += f64::from(m + z.ln() - logits[0]);
                        loss_n += 1;
                        // dL/ds_i = p_i - [i = 0]; s_i = -|u - c_i|^2.
                        let mut gu = ndarray::Array1::<f32>::zeros(D);
                        for (i, &l) in logits.iter().enumerate() {
                            let coef = (l - m).exp() / z - f32::from(u8::from(i == 0));
                            let c = if i == 0 { at.row(row) } else { negs.row(i - 1) };
                            let diff = &u - &c;
                            gu.scaled_add(-2.0 * coef, &diff);
                            if i == 0 {
                                gt.row_mut(row).scaled_add(2.0 * coef, &diff);
                            } else {
                                gn.row_mut(base + i - 1).scaled_add(2.0 * coef, &diff);
                            }
                        }
                        gh.row_mut(row).scaled_add(1.0, &gu);
                        rel_grad.row_mut(rel).scaled_add(1.0, &gu);
                    }
                }
                // Back into the device's stacked activation layout (the inverse of
                // feature_activations): SparseCore sc, feature f, row r -> sc * per_sc + base_f + r.
                let per_sc = act.nrows() / s_per_dev;
                let mut g = Array2::<f32>::zeros(act.dim());
                for (f, gf) in [(fh, &gh), (ft, &gt), (fneg, &gn)] {
                    let base_f = (plan.features[f].row_offset / n as u64) as usize;
                    for sc in 0..s_per_dev {
                        g.slice_mut(s![sc * per_sc + base_f..sc * per_sc + base_f + r_rows, ..])
                            .assign(&gf.slice(s![sc * r_rows..(sc + 1) * r_rows, ..]));
                    }
                }
                grads.push(g);
            }
            let views: Vec<ArrayView2<f32>> = grads.iter().map(|g| g.view()).collect();
            apply_gradients(
                &plan,
                so,
                out.num_minibatches,
                &views,
                &optimizer,
                &mut table,
                &mut slots,
            )?;
            // Adagrad on the relation matrix, as the kernel does for table rows.
            let Optimizer::Adagrad { lr } = optimizer else {
                unreachable!()
            };
            rel_acc.zip_mut_with(&rel_grad, |a, &g| *a += g * g);
            ndarray::Zip::from(&mut relation)
                .and(&rel_grad)
                .and(&rel_acc)
                .for_each(|w, &g, &a| *w -= lr * g / a.sqrt());
        }
        if epoch % 5 == 4 || epoch == 0 {
            let (mrr, hits) = evaluate(&entity_matrix(&table)?, &relation, test, &known);
            println!(
                "epoch {:>3}: loss {:.4}  held-out filtered MRR {mrr:.4}  Hits@10 {hits:.4}",
                epoch + 1,
                loss_sum / loss_n as f64
            );
        } else {
            println!(
                "epoch {:>3}: loss {:.4}",
                epoch + 1,
                loss_sum / loss_n as f64
            );
        }
    }
    let (mrr, hits) = evaluate(&entity_matrix(&table)?, &relation, test, &known);
    println!(
        "trained:   filtered MRR {mrr:.4}, Hits@10 {hits:.4} ({:.1}x the untrained MRR)",
        mrr / mrr0
    );
    println!("elapsed {:.1} s", start.elapsed().as_secs_f64());
    if mrr < 0.3 || mrr < 10.0 * mrr0 {
        return Err(format!(
            "filtered MRR {mrr:.4} is below 0.3 or below 10x the untrained {mrr0:.4}"
        )
        .into());
    }
    Ok(())
}
