//! The CPU forward pass: `forward(preprocess(x))` equals a naive `embedding_lookup_sparse` (a
//! plain loop over samples: combiner-weighted sum of table rows), for every feature, stacking
//! mode, layout and combiner, with and without weights and minibatching; and stacked tables read
//! back exactly.

use ndarray::Array2;
use sparsecore_kernel::{
    feature_activations, sparse_dense_matmul, KernelError, PlanItem, StackedTable, Subject,
};
use sparsecore_prep::input::{FeatureView, Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::spec::Combiner;
use sparsecore_prep::{Config, Output, Preprocessor};

/// Deterministic table values in [-1, 1).
fn table_values(rows: usize, dim: usize, seed: u64) -> Array2<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    Array2::from_shape_fn((rows, dim), |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}

/// Row `r` of a ragged view: (ids, weights).
fn row(view: &FeatureView<'_>, r: usize) -> (Vec<i64>, Option<Vec<f32>>) {
    let FeatureView::Ragged {
        ids,
        offsets,
        weights,
    } = view
    else {
        panic!("ragged input expected")
    };
    let (a, b) = offsets.range(r);
    let ids = match ids {
        Ids::I32(v) => v[a..b].iter().map(|&x| x as i64).collect(),
        Ids::I64(v) => v[a..b].to_vec(),
    };
    let w = weights.map(|(w, o): (&[f32], Offsets<'_>)| {
        let (a, b) = o.range(r);
        w[a..b].to_vec()
    });
    (ids, w)
}

/// A small random workload: 3 tables (vocabularies 40..300, dims 4..16), 4 features (two on
/// table 0), rows of 0..=6 ids; with `hot`, half the ids come from 8 hot ones.
fn workload(
    layout: (usize, usize, usize),
    batch: usize,
    weights: bool,
    stacking: &str,
    seed: u64,
    hot: bool,
) -> Workload {
    let (l, g, s) = layout;
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let vocab = [300u64, 40, 120];
    let dims = [16u64, 4, 8];
    let config = Config::from_json(&format!(
        r#"{{"config": {{"local_device_count": {l}, "global_device_count": {g}, "num_sc_per_device": {s},
                        "stacking": "{stacking}", "stack_limits": {{"max_ids_per_partition": 4096, "max_unique_ids_per_partition": 4096}}}},
            "tables": [{{"name": "ta", "vocabulary_size": 300, "embedding_dim": 16, "max_ids_per_partition": 4096, "max_unique_ids_per_partition": 4096}},
                       {{"name": "tb", "vocabulary_size": 40, "embedding_dim": 4, "max_ids_per_partition": 4096, "max_unique_ids_per_partition": 4096}},
                       {{"name": "tc", "vocabulary_size": 120, "embedding_dim": 8, "max_ids_per_partition": 4096, "max_unique_ids_per_partition": 4096}}],
            "features": [{{"name": "f0", "table": "ta"}}, {{"name": "f1", "table": "tb"}},
                         {{"name": "f2", "table": "ta"}}, {{"name": "f3", "table": "tc"}}]}}"#
    ))
    .unwrap();
    let _ = dims;
    let mut feats = Vec::new();
    for f in 0..4 {
        let t = [0usize, 1, 0, 2][f];
        let mut values = Vec::new();
        let mut splits = vec![0i64];
        let mut w = Vec::new();
        for _ in 0..batch {
            let n = next(7);
            for _ in 0..n {
                // Half the ids from a hot set of 8.
                let id = if hot && next(2) == 0 {
                    next(8)
                } else {
                    next(vocab[t])
                };
                values.push(id as i64);
                w.push((next(64) + 1) as f32 / 16.0);
            }
            splits.push(values.len() as i64);
        }
        feats.push((values, splits, weights.then_some(w)));
    }
    Workload { config, feats }
}

/// One feature's ragged batch: ids, row splits, weights.
type RaggedFeature = (Vec<i64>, Vec<i64>, Option<Vec<f32>>);

struct Workload {
    config: Config,
    feats: Vec<RaggedFeature>,
}

/// Returns whether the batch was checked (tight limits may make a single bucket overflow).
fn check(w: &Workload, combiner: Combiner, minibatching: bool, tight: bool) -> bool {
    let mut config = w.config.clone();
    for t in &mut config.tables {
        t.combiner = combiner.as_str().to_string();
    }
    config.config.enable_minibatching = minibatching;
    let inputs_owned: Vec<RaggedInput<'_>> = w
        .feats
        .iter()
        .zip(&config.features)
        .map(|((v, sp, wt), f)| {
            let r = RaggedInput::from_i64(&f.name, v, sp).unwrap();
            match wt {
                Some(wt) => r.with_weights(&f.name, wt).unwrap(),
                None => r,
            }
        })
        .collect();
    let inputs: Vec<&dyn SampleSource> = inputs_owned
        .iter()
        .map(|f| f as &dyn SampleSource)
        .collect();
    if tight {
        // Measure, then set the limits to a quarter of what the batch needs: minibatching
        // must split (and, with dropping allowed, may drop within buckets).
        let mut probe = Preprocessor::new(config.clone()).unwrap();
        let mut o = Output::new();
        probe.run_stats(&inputs, &mut o).unwrap();
        let plan = probe.plan().unwrap().clone();
        for (stack, so) in plan.stacks.iter().zip(&o.stacks) {
            for &t in &stack.tables {
                config.tables[t].max_ids_per_partition = (so.stats.max_ids() as u64 / 4).max(1);
                config.tables[t].max_unique_ids_per_partition =
                    (so.stats.max_unique_ids() as u64 / 4).max(1);
            }
        }
        config.config.stack_limits = None;
    }
    let mut prep = Preprocessor::new(config.clone()).unwrap();
    let mut out = Output::new();
    match prep.run(&inputs, &mut out) {
        Ok(()) => {}
        // A single bucket over a limit without dropping is an error by design; such draws
        // are not what this test is about.
        Err(sparsecore_prep::Error::LimitExceeded { .. }) if tight => return false,
        Err(e) => panic!("{e}"),
    }
    let plan = prep.plan().unwrap().clone();
    if tight {
        assert!(out.num_minibatches > 1, "tight limits must split");
    }
    let tables: Vec<Array2<f32>> = config
        .tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            table_values(
                t.vocabulary_size as usize,
                t.embedding_dim as usize,
                i as u64 + 1,
            )
        })
        .collect();
    let (l, _, s) = (
        config.config.local_device_count,
        0,
        config.config.num_sc_per_device,
    );
    let mut checked = 0usize;
    for (stack, so) in plan.stacks.iter().zip(&out.stacks) {
        let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
        let stacked = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
        for &t in &stack.tables {
            assert_eq!(
                stacked.table(&plan, t).unwrap(),
                tables[t],
                "table {t} reads back exactly"
            );
        }
        let acts = sparse_dense_matmul(&plan, so, out.num_minibatches, &stacked).unwrap();
        for &f in &stack.features {
            let fp = &plan.features[f];
            let table = &tables[fp.table_index];
            let view = inputs[f].view();
            let rows_per_device = inputs[f].num_samples() / l / s * s;
            for (d, act) in acts.iter().enumerate() {
                let got = feature_activations(&plan, f, act.view()).unwrap();
                assert_eq!(got.nrows(), rows_per_device);
                for i in 0..rows_per_device {
                    let (ids, weights) = row(&view, d * rows_per_device + i);
                    let w: Vec<f32> = weights.unwrap_or_else(|| vec![1.0; ids.len()]);
                    let norm = match combiner {
                        Combiner::Sum => 1.0,
                        Combiner::Mean => w.iter().sum::<f32>(),
                        Combiner::Sqrtn => w.iter().map(|x| x * x).sum::<f32>().sqrt(),
                    };
                    for c in 0..got.ncols() {
                        let want: f32 = ids
                            .iter()
                            .zip(&w)
                            .map(|(&id, &wi)| wi / norm * table[[id as usize, c]])
                            .sum();
                        let g = got[[i, c]];
                        assert!(
                            (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "stack {} feature {} device {d} sample {i} col {c}: {g} vs {want}",
                            stack.name,
                            fp.name
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 0);
    true
}

#[test]
fn forward_equals_naive_lookup() {
    for combiner in [Combiner::Sum, Combiner::Mean, Combiner::Sqrtn] {
        for (layout, weights, stacking) in [
            ((1, 1, 4), true, "feature"),
            ((2, 2, 2), false, "feature"),
            ((2, 4, 2), true, "auto"),
            ((1, 2, 1), false, "auto"),
        ] {
            let w = workload(layout, 64, weights, stacking, 7, true);
            assert!(check(&w, combiner, false, false));
        }
    }
}

#[test]
fn forward_with_minibatching_equals_naive_lookup() {
    let mut split = 0;
    for seed in 1..6 {
        for (layout, weights, stacking) in [
            ((1, 1, 4), false, "feature"),
            ((2, 2, 2), true, "feature"),
            ((4, 4, 1), true, "auto"),
        ] {
            let w = workload(layout, 256, weights, stacking, seed, false);
            assert!(check(&w, Combiner::Mean, true, false));
            split += check(&w, Combiner::Sum, true, true) as usize;
        }
    }
    assert!(split >= 5, "only {split} of 15 tight draws could be split");
}

#[test]
fn table_shape_mismatch_is_an_error() {
    let w = workload((1, 1, 4), 16, false, "feature", 3, true);
    let inputs: Vec<RaggedInput<'_>> = w
        .feats
        .iter()
        .map(|(v, s, _)| RaggedInput::from_i64("f", v, s).unwrap())
        .collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|f| f as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(w.config.clone()).unwrap();
    prep.run(&refs, &mut Output::new()).unwrap();
    let plan = prep.plan().unwrap();
    let wrong = Array2::<f32>::zeros((3, 16));
    let e = StackedTable::from_tables(plan, "ta", &[wrong.view()]).unwrap_err();
    assert!(
        e.to_string().contains("ta") && e.to_string().contains("[300, 16]"),
        "{e}"
    );
}

#[test]
fn sum_with_unit_weights_is_exact_and_bad_ids_are_errors() {
    let w = workload((2, 2, 2), 64, false, "feature", 9, true);
    let inputs: Vec<RaggedInput<'_>> = w
        .feats
        .iter()
        .zip(&w.config.features)
        .map(|((v, s, _), f)| RaggedInput::from_i64(&f.name, v, s).unwrap())
        .collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|f| f as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(w.config.clone()).unwrap();
    let mut out = Output::new();
    prep.run(&refs, &mut out).unwrap();
    let plan = prep.plan().unwrap().clone();
    // Integer-valued tables: every sum is exact in f32, so the result must be bit for bit.
    let tables: Vec<Array2<f32>> = w
        .config
        .tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            Array2::from_shape_fn(
                (t.vocabulary_size as usize, t.embedding_dim as usize),
                |(r, c)| ((r * 7 + c * 3 + i) % 11) as f32 - 5.0,
            )
        })
        .collect();
    let (l, s) = (2usize, 2usize);
    for (stack, so) in plan.stacks.iter().zip(&out.stacks) {
        let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
        let stacked = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
        let acts = sparse_dense_matmul(&plan, so, out.num_minibatches, &stacked).unwrap();
        for &f in &stack.features {
            let table = &tables[plan.features[f].table_index];
            let view = refs[f].view();
            let rows = refs[f].num_samples() / l / s * s;
            for (d, act) in acts.iter().enumerate() {
                let got = feature_activations(&plan, f, act.view()).unwrap();
                for i in 0..rows {
                    let (ids, _) = row(&view, d * rows + i);
                    for c in 0..got.ncols() {
                        let want: f32 = ids.iter().map(|&id| table[[id as usize, c]]).sum();
                        assert_eq!(
                            got[[i, c]],
                            want,
                            "feature {f} device {d} sample {i} col {c}"
                        );
                    }
                }
            }
        }
        // An embedding id outside the shard is an error, not a panic.
        let mut bad = so.clone();
        if let Some(slot) = bad.embedding_ids.iter().position(|&e| e != i32::MAX) {
            bad.embedding_ids[slot] = stacked.rows_per_shard as i32;
            let e = sparse_dense_matmul(&plan, &bad, out.num_minibatches, &stacked).unwrap_err();
            assert!(e.to_string().contains("outside the shard"), "{e}");
        }
    }
}

/// Small-integer values in -3..=3 from a seed (products and sums stay exact in f32).
fn small_ints(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    Array2::from_shape_fn((rows, cols), |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 7) as f32 - 3.0
    })
}

#[test]
fn stack_feature_gradients_is_the_exact_adjoint_of_feature_activations() {
    use sparsecore_kernel::stack_feature_gradients;
    let mut stacks_with_several = 0;
    for (layout, stacking) in [
        ((1, 1, 4), "feature"),
        ((1, 1, 4), "auto"),
        ((2, 2, 2), "auto"),
        ((2, 4, 2), "auto"),
        ((1, 2, 1), "feature"),
    ] {
        let w = workload(layout, 32, false, stacking, 5, false);
        let inputs: Vec<RaggedInput<'_>> = w
            .feats
            .iter()
            .zip(&w.config.features)
            .map(|((v, s, _), f)| RaggedInput::from_i64(&f.name, v, s).unwrap())
            .collect();
        let refs: Vec<&dyn SampleSource> = inputs.iter().map(|f| f as &dyn SampleSource).collect();
        let mut prep = Preprocessor::new(w.config.clone()).unwrap();
        let mut out = Output::new();
        prep.run(&refs, &mut out).unwrap();
        let plan = prep.plan().unwrap().clone();
        for (si, stack) in plan.stacks.iter().enumerate() {
            stacks_with_several += (stack.features.len() > 1) as usize;
            let bsd = (stack.total_sample_count / plan.layout.global_devices as u64) as usize;
            let a = small_ints(bsd, stack.stack_embedding_dim as usize, 100 + si as u64);
            let fas: Vec<Array2<f32>> = stack
                .features
                .iter()
                .map(|&f| feature_activations(&plan, f, a.view()).unwrap())
                .collect();
            let gs: Vec<Array2<f32>> = fas
                .iter()
                .enumerate()
                .map(|(i, fa)| small_ints(fa.nrows(), fa.ncols(), 200 + 10 * si as u64 + i as u64))
                .collect();
            let pairs: Vec<(usize, ndarray::ArrayView2<'_, f32>)> = stack
                .features
                .iter()
                .zip(&gs)
                .map(|(&f, g)| (f, g.view()))
                .collect();
            let stacked = stack_feature_gradients(&plan, &stack.name, &pairs).unwrap();
            assert_eq!(stacked.dim(), a.dim());
            // <feature_activations(A), G> == <A, stack(G)>, exactly.
            let lhs: f32 = fas.iter().zip(&gs).map(|(fa, g)| (fa * g).sum()).sum();
            let rhs: f32 = (&a * &stacked).sum();
            assert_eq!(
                lhs, rhs,
                "stack {} layout {layout:?} {stacking}",
                stack.name
            );
            // And entry by entry: stacking the activations' own pieces gives back A on the
            // features' rows and columns and 0 elsewhere, so that un-stacking again is the identity.
            let own: Vec<(usize, ndarray::ArrayView2<'_, f32>)> = stack
                .features
                .iter()
                .zip(&fas)
                .map(|(&f, fa)| (f, fa.view()))
                .collect();
            let restacked = stack_feature_gradients(&plan, &stack.name, &own).unwrap();
            for (&f, fa) in stack.features.iter().zip(&fas) {
                assert_eq!(feature_activations(&plan, f, restacked.view()).unwrap(), fa);
            }
            let covered: f32 = fas
                .iter()
                .map(|fa| fa.iter().filter(|&&x| x != 0.0).count() as f32)
                .sum();
            assert_eq!(
                restacked.iter().filter(|&&x| x != 0.0).count() as f32,
                covered
            );
            // A feature given twice has its gradients summed (linearity).
            let f0 = stack.features[0];
            let twice = stack_feature_gradients(
                &plan,
                &stack.name,
                &[(f0, gs[0].view()), (f0, gs[0].view())],
            )
            .unwrap();
            let once = stack_feature_gradients(&plan, &stack.name, &[(f0, gs[0].view())]).unwrap();
            assert_eq!(twice, &once * 2.0);
        }
    }
    assert!(
        stacks_with_several > 0,
        "auto stacking should put several features in one stack"
    );
}

#[test]
fn stack_feature_gradients_errors_name_the_stack_or_feature() {
    use sparsecore_kernel::stack_feature_gradients;
    let w = workload((1, 1, 4), 16, false, "feature", 3, true);
    let inputs: Vec<RaggedInput<'_>> = w
        .feats
        .iter()
        .zip(&w.config.features)
        .map(|((v, s, _), f)| RaggedInput::from_i64(&f.name, v, s).unwrap())
        .collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|f| f as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(w.config.clone()).unwrap();
    prep.run(&refs, &mut Output::new()).unwrap();
    let plan = prep.plan().unwrap().clone();
    // Feature stacking: stack `ta` holds f0 and f2 (dim 16), `tb` holds f1 (dim 4).
    let g16 = Array2::<f32>::ones((16, 16));
    let e = stack_feature_gradients(&plan, "nope", &[(0, g16.view())]).unwrap_err();
    assert!(
        matches!(&e, KernelError::Plan { kind: PlanItem::Stack, name, .. } if name == "nope"),
        "{e:?}"
    );
    let e = stack_feature_gradients(&plan, "ta", &[(9, g16.view())]).unwrap_err();
    assert!(
        matches!(&e, KernelError::Plan { kind: PlanItem::Feature, name, .. } if name == "9"),
        "{e:?}"
    );
    let e = stack_feature_gradients(&plan, "ta", &[(1, g16.view())]).unwrap_err();
    assert!(
        matches!(&e, KernelError::Plan { kind: PlanItem::Feature, name, .. } if name == "f1"),
        "{e:?}"
    );
    assert!(e.to_string().contains("tb"), "{e}");
    let wrong = Array2::<f32>::ones((16, 4));
    let e = stack_feature_gradients(&plan, "ta", &[(2, wrong.view())]).unwrap_err();
    assert!(
        matches!(&e, KernelError::InvalidInput { subject: Subject::Feature(f), .. } if f == "f2"),
        "{e:?}"
    );
    assert!(e.to_string().contains("[16, 16]"), "{e}");
    // The right shape is accepted.
    assert_eq!(
        stack_feature_gradients(&plan, "ta", &[(2, g16.view())])
            .unwrap()
            .sum(),
        256.0
    );
}

/// A config whose stacked table is larger than memory: an error naming the stack, not an
/// abort in the allocator.
#[test]
fn a_stacked_table_past_memory_is_an_error() {
    let config = sparsecore_prep::Config::from_json(
        r#"{"config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
            "tables": [{"name": "huge", "vocabulary_size": 2000000000, "embedding_dim": 200000, "combiner": "sum"}],
            "features": [{"name": "f", "table": "huge"}]}"#,
    )
    .unwrap();
    let mut prep = Preprocessor::new(config).unwrap();
    let plan = prep.plan_for(&[8]).unwrap().clone();
    // The member array of that shape, every element one float (zero strides).
    use ndarray::ShapeBuilder;
    let one = [0.5f32];
    let view =
        ndarray::ArrayView2::from_shape((2_000_000_000, 200_000).strides((0, 0)), &one).unwrap();
    let e = StackedTable::from_tables(&plan, &plan.stacks[0].name, &[view]).unwrap_err();
    assert!(
        e.to_string()
            .contains("x 200000 floats does not fit in memory")
            && e.to_string().contains(&plan.stacks[0].name),
        "{e}"
    );
}
