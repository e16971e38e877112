//! The backward pass with each optimizer: one step through the buffers equals a dense per-row
//! step of the independent f64 reference (tests/reference) on a gradient accumulated naively
//! from the input samples (SPEC 6.3), table and slots; untouched rows never change; bad
//! hyper-parameters are errors.

mod reference;

use std::collections::BTreeMap;

use ndarray::{Array2, ShapeBuilder};
use sparsecore_prep::input::{RaggedInput, SampleSource};
use sparsecore_kernel::{apply_gradients, Optimizer, Slots, StackedTable};
use sparsecore_kernel::KernelError;
use sparsecore_prep::{Config, Error, Output, Preprocessor};

fn lcg(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    move |m| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    }
}

struct Case {
    config: Config,
    feats: Vec<(Vec<i64>, Vec<i64>, Vec<f32>)>,
}

fn case(layout: (usize, usize, usize), combiner: &str, seed: u64) -> Case {
    case_with(layout, combiner, seed, false, 4096)
}

/// `limit` applies to the stack; with minibatching a small one splits the batch.
fn case_with(layout: (usize, usize, usize), combiner: &str, seed: u64, minibatching: bool, limit: u32) -> Case {
    let (l, g, s) = layout;
    let config = Config::from_json(&format!(
        r#"{{"config": {{"local_device_count": {l}, "global_device_count": {g}, "num_sc_per_device": {s}, "stacking": "auto",
                        "enable_minibatching": {minibatching},
                        "stack_limits": {{"max_ids_per_partition": {limit}, "max_unique_ids_per_partition": {limit}}}}},
            "tables": [{{"name": "ta", "vocabulary_size": 60, "embedding_dim": 8, "combiner": "{combiner}"}},
                       {{"name": "tb", "vocabulary_size": 30, "embedding_dim": 8, "combiner": "{combiner}"}}],
            "features": [{{"name": "f0", "table": "ta"}}, {{"name": "f1", "table": "tb"}}, {{"name": "f2", "table": "ta"}}]}}"#
    ))
    .unwrap();
    let mut next = lcg(seed);
    let feats = (0..3)
        .map(|f| {
            let vocab = if f == 1 { 30 } else { 60 };
            let (mut v, mut sp, mut w) = (Vec::new(), vec![0i64], Vec::new());
            for _ in 0..32 {
                for _ in 0..next(5) {
                    v.push(next(vocab) as i64);
                    w.push((next(32) + 1) as f32 / 8.0);
                }
                sp.push(v.len() as i64);
            }
            (v, sp, w)
        })
        .collect();
    Case { config, feats }
}

/// The physical row of vocabulary row `v` of a member table.
fn physical(n: usize, r: usize, rotation: usize, offset: usize, v: usize) -> usize {
    ((v % n + rotation) % n) * r + v / n + offset
}

/// The tolerance of an f32 step against the f64 reference, relative to the scale each value was
/// computed at (`reference::step`'s: the sum of the magnitudes of its terms, at least the
/// value's own). Seen up to 1.5e-5: the kernel's f32 gradient sums (mean and sqrtn gains, summed
/// in another order) carry relative errors of ~1e-5 into the slots of small gradients, and
/// Adam's f32 bias correction 1 − β₂ᵗ loses 3e-6. The absolute floor covers a gradient that
/// cancels to 0 in f64 and to a residual of a few ulps in f32.
const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-7;

/// Returns the number of minibatches, or `None` when tight limits overflowed one bucket.
fn run(c: &Case, optimizer: Optimizer, seed: u64) -> Option<usize> {
    let inputs: Vec<RaggedInput<'_>> = c
        .feats
        .iter()
        .zip(&c.config.features)
        .map(|((v, sp, w), f)| RaggedInput::from_i64(&f.name, v, sp).unwrap().with_weights(&f.name, w).unwrap())
        .collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|i| i as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(c.config.clone()).unwrap();
    let mut out = Output::new();
    match prep.run(&refs, &mut out) {
        Ok(()) => {}
        Err(Error::LimitExceeded { .. }) if c.config.config.enable_minibatching => return None,
        Err(e) => panic!("{e}"),
    }
    let plan = prep.plan().unwrap().clone();
    assert_eq!(plan.stacks.len(), 1, "auto stacking puts both tables in one stack");
    let stack = &plan.stacks[0];
    let so = &out.stacks[0];
    let layout = plan.layout;
    let (l, s, n) = (layout.local_devices, layout.sc_per_device, layout.num_partitions());
    let mut next = lcg(seed);
    let tables: Vec<Array2<f32>> =
        c.config.tables.iter().map(|t| Array2::from_shape_fn((t.vocabulary_size as usize, 8), |_| next(200) as f32 / 100.0 - 1.0)).collect();
    let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
    let mut table = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
    let before = table.clone();
    let bsd = (stack.total_sample_count / layout.global_devices as u64) as usize;
    // Multiples of 1/16: with the sum combiner (weights k/8) every gradient sum is exact, so
    // summation order cannot matter even for scale-invariant steps (Adam, LaProp).
    let dact: Vec<Array2<f32>> = (0..l).map(|_| Array2::from_shape_fn((bsd, 8), |_| (next(32) as f32 - 16.0) / 16.0)).collect();
    let dviews: Vec<_> = dact.iter().map(|a| a.view()).collect();
    let mut slots = Slots::new(&table, &optimizer);
    apply_gradients(&plan, so, out.num_minibatches, &dviews, &optimizer, &mut table, &mut slots).unwrap();

    // Naive gradient, in f64: every (sample, id) of every feature, with its combiner gain.
    let bsps = bsd / s;
    let mut grad: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for &f in &stack.features {
        let fp = &plan.features[f];
        let (v, sp, w) = &c.feats[f];
        let nsps = (sp.len() - 1) / (l * s);
        let base = (fp.row_offset / n as u64) as usize;
        let combiner = &c.config.tables[fp.table_index].combiner;
        for (d, dact_d) in dact.iter().enumerate().take(l) {
            for sc in 0..s {
                for j in 0..nsps {
                    let r = (d * s + sc) * nsps + j;
                    let (a, b) = (sp[r] as usize, sp[r + 1] as usize);
                    let ws: Vec<f64> = w[a..b].iter().map(|&x| f64::from(x)).collect();
                    let norm = match combiner.as_str() {
                        "mean" => ws.iter().sum::<f64>(),
                        "sqrtn" => ws.iter().map(|x| x * x).sum::<f64>().sqrt(),
                        _ => 1.0,
                    };
                    for (&id, &wi) in v[a..b].iter().zip(&ws) {
                        let row = physical(n, table.rows_per_shard, fp.shard_rotation as usize, fp.row_offset_in_shard as usize, id as usize);
                        let acc = grad.entry(row).or_insert_with(|| vec![0.0; 8]);
                        for k in 0..8 {
                            acc[k] += wi / norm * f64::from(dact_d[[sc * bsps + base + j, k]]);
                        }
                    }
                }
            }
        }
    }
    // Dense per-row step of the f64 reference on the naive gradient, from the reference's own
    // initial slots: table and every slot variable compared, touched rows within the tolerance
    // of f32 arithmetic, untouched rows (and their slots) unchanged to the bit.
    let inits = reference::initial_slot_values(&optimizer);
    assert_eq!(slots.values.len(), inits.len(), "{optimizer:?}: slot variables");
    for row in 0..table.data.nrows() {
        let Some(g) = grad.get(&row) else {
            for k in 0..8 {
                assert_eq!(table.data[[row, k]].to_bits(), before.data[[row, k]].to_bits(), "untouched row {row} changed");
                for (i, s) in slots.values.iter().enumerate() {
                    assert_eq!(s[[row, k]].to_bits(), inits[i].to_bits(), "{optimizer:?} slot {i} of untouched row {row}: {}", s[[row, k]]);
                }
            }
            continue;
        };
        let mut want: Vec<f64> = before.data.row(row).iter().map(|&x| f64::from(x)).collect();
        let mut want_slots = reference::initial_slots(&optimizer, 8);
        let scales = reference::step(&optimizer, g, &mut want, &mut want_slots);
        for k in 0..8 {
            let got = table.data[[row, k]];
            let (want, scale) = (want[k], scales[0][k]);
            assert!(
                reference::near_scaled(got, want, scale, RTOL, ATOL),
                "{optimizer:?} row {row} col {k}: {got} vs {want} (scale {scale}, g {})",
                g[k]
            );
            for (i, s) in slots.values.iter().enumerate() {
                let got = s[[row, k]];
                let (want, scale) = (want_slots[i][k], scales[i + 1][k]);
                assert!(
                    reference::near_scaled(got, want, scale, RTOL, ATOL),
                    "{optimizer:?} slot {i} row {row} col {k}: {got} vs {want} (scale {scale}, g {})",
                    g[k]
                );
            }
        }
    }
    assert!(!grad.is_empty());
    Some(out.num_minibatches)
}

fn optimizers() -> Vec<Optimizer> {
    vec![
        Optimizer::Sgd { lr: 0.1 },
        Optimizer::Adagrad { lr: 0.1 },
        Optimizer::AdagradMomentum { lr: 0.1, momentum: 0.9, beta2: 1.0, epsilon: 1e-10, exponent: 2.0, use_nesterov: false },
        Optimizer::AdagradMomentum { lr: 0.1, momentum: 0.9, beta2: 0.99, epsilon: 1e-10, exponent: 2.0, use_nesterov: true },
        Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 3 },
        Optimizer::Ftrl { lr: 0.01, lr_power: -0.5, l1: 0.0, l2: 0.0, beta: 0.0, multiply_linear_by_lr: false },
        Optimizer::Ftrl { lr: 0.05, lr_power: -0.5, l1: 0.01, l2: 0.1, beta: 0.1, multiply_linear_by_lr: true },
        Optimizer::Laprop { lr: 0.01, b1: 0.9, b2: 0.95, eps: 1e-30, step: Some(2) },
        Optimizer::Laprop { lr: 0.01, b1: 0.9, b2: 0.95, eps: 1e-30, step: None },
    ]
}

#[test]
fn one_step_equals_dense_per_row_step() {
    for (i, (layout, combiner)) in [((1, 1, 4), "sum"), ((2, 2, 2), "mean"), ((1, 2, 4), "sqrtn")].into_iter().enumerate() {
        let c = case(layout, combiner, 11 + i as u64);
        for opt in optimizers() {
            assert_eq!(run(&c, opt, 5 + i as u64), Some(1));
        }
    }
}

proptest::proptest! {
    // A fixed seed keeps CI deterministic.
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 48,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x0b71_5eed),
        ..Default::default()
    })]

    /// Random inputs, layouts, combiners and optimizers; with minibatching the update equals
    /// the single-pass one (the gradient of a row gathers every minibatch's slots).
    #[test]
    fn random_steps_equal_dense_steps(
        seed in 0u64..1_000_000,
        layout in proptest::sample::select(vec![(1usize, 1usize, 4usize), (2, 2, 2), (1, 2, 4), (4, 4, 1), (1, 1, 1)]),
        combiner in proptest::sample::select(vec!["sum", "mean", "sqrtn"]),
        opt in proptest::sample::select(optimizers()),
        minibatching in proptest::bool::ANY,
    ) {
        // Multi-host minibatching needs an all-reduce; these layouts run single-host only.
        let minibatching = minibatching && layout.0 == layout.1;
        // Adam and LaProp normalise the gradient, so a near-zero row gradient (summed in another
        // order) flips the step; only the exact (sum combiner) gradients compare for them.
        let scale_invariant = matches!(opt, Optimizer::Adam { .. } | Optimizer::Laprop { .. });
        let combiner = if scale_invariant { "sum" } else { combiner };
        let c = case_with(layout, combiner, seed, minibatching, if minibatching { 6 } else { 4096 });
        let _ = run(&c, opt, seed ^ 0xABCD);
    }
}

#[test]
fn minibatched_updates_equal_single_pass_updates() {
    let mut split = 0;
    for seed in 0..20 {
        let c = case_with((1, 1, 4), "mean", seed, true, 5);
        if let Some(m) = run(&c, Optimizer::Adagrad { lr: 0.1 }, seed) {
            split += (m > 1) as usize;
        }
    }
    assert!(split >= 5, "only {split} of 20 batches were split into minibatches");
}

/// The case's batch preprocessed (ids only): its plan and output.
fn preprocess(c: &Case) -> (sparsecore_prep::Plan, Output) {
    let inputs: Vec<RaggedInput<'_>> =
        c.feats.iter().zip(&c.config.features).map(|((v, sp, _), f)| RaggedInput::from_i64(&f.name, v, sp).unwrap()).collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|i| i as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(c.config.clone()).unwrap();
    let mut out = Output::new();
    prep.run(&refs, &mut out).unwrap();
    (prep.plan().unwrap().clone(), out)
}

/// A count of minibatches past what preprocessing makes (it would have the kernels walk that
/// many empty segments) is an error naming it.
#[test]
fn more_minibatches_than_preprocessing_makes_are_an_error() {
    let c = case_with((1, 1, 4), "sum", 1, true, 4096);
    let (plan, out) = preprocess(&c);
    let stack = &plan.stacks[0];
    let tables: Vec<Array2<f32>> = c.config.tables.iter().map(|t| Array2::zeros((t.vocabulary_size as usize, 8))).collect();
    let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
    let table = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
    assert!(sparsecore_kernel::sparse_dense_matmul(&plan, &out.stacks[0], out.num_minibatches, &table).is_ok());
    let e = sparsecore_kernel::sparse_dense_matmul(&plan, &out.stacks[0], 1 << 40, &table).unwrap_err();
    assert!(matches!(&e, KernelError::InvalidInput { what, .. } if what == "num_minibatches"), "{e:?}");
    assert!(e.to_string().contains("1099511627776 minibatches: preprocessing makes at most 64"), "{e}");
}

#[test]
fn sgd_formula() {
    // w' = w - lr * g, checked on literal values.
    let mut w = [1.0f32, -2.0];
    Optimizer::Sgd { lr: 0.5 }.apply(&[2.0, 4.0], &mut w, &mut []);
    assert_eq!(w, [0.0, -4.0]);
    // Adagrad: a' = 0.1 + 9 = 9.1; w' = 1 - 0.1 * 3 / sqrt(9.1).
    let (mut w, mut a) = ([1.0f32], [0.1f32]);
    Optimizer::Adagrad { lr: 0.1 }.apply(&[3.0], &mut w, &mut [&mut a[..]]);
    assert_eq!(a[0], 0.1 + 9.0);
    assert_eq!(w[0], 1.0 - 0.1 * 3.0 / (0.1f32 + 9.0).sqrt());
}

#[test]
fn nan_hyper_parameters_are_errors() {
    for bad in [Optimizer::Sgd { lr: f32::NAN }, Optimizer::Adam { lr: 0.1, beta1: f32::INFINITY, beta2: 0.9, epsilon: 1e-8, step: 0 }] {
        let e = bad.validate().unwrap_err();
        assert!(matches!(e, KernelError::Parameter { name: "optimizer", .. }), "{e:?}");
        assert!(e.to_string().contains("finite"), "{e}");
    }
    let e = Optimizer::Ftrl { lr: 0.0, lr_power: -0.5, l1: 0.0, l2: 0.0, beta: 0.0, multiply_linear_by_lr: false }.validate().unwrap_err();
    assert!(e.to_string().contains("FTRL"), "{e}");
}

/// Every mistake a caller can make with the backward pass is a typed error naming the stack
/// (or the hyper-parameter), never a panic, and leaves the table and its slots as they were.
#[test]
fn backward_errors_name_the_stack_and_change_nothing() {
    let mut c = case((1, 1, 4), "sum", 21);
    // Feature stacking: stacks `ta` (f0, f2) and `tb` (f1).
    c.config.config.stacking = sparsecore_prep::spec::Stacking::Feature;
    let (plan, out) = preprocess(&c);
    let names: Vec<&str> = plan.stacks.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["ta", "tb"]);
    let (so, stack) = (&out.stacks[0], &plan.stacks[0]);
    let ta = Array2::from_shape_fn((60, 8), |(r, c)| (r * 8 + c) as f32 / 100.0);
    let tb = Array2::from_shape_fn((30, 8), |(r, c)| (r + c) as f32 / 10.0);
    let mut table = StackedTable::from_tables(&plan, "ta", &[ta.view()]).unwrap();
    let other = StackedTable::from_tables(&plan, "tb", &[tb.view()]).unwrap();
    let bsd = stack.total_sample_count as usize;
    let dact = Array2::<f32>::ones((bsd, 8));
    let adagrad = Optimizer::Adagrad { lr: 0.1 };
    let mut slots = Slots::new(&table, &adagrad);
    let (table0, slots0) = (table.clone(), slots.clone());
    let stack_named = |e: &KernelError, name: &str| match e {
        KernelError::Plan { kind: "stack", name: n, .. } => n == name,
        KernelError::InvalidInput { what, .. } => what == name,
        _ => false,
    };

    // Missing slot variables for the chosen optimizer (SGD's none for Adagrad's accumulator).
    let mut none = Slots::new(&table, &Optimizer::Sgd { lr: 0.1 });
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut table, &mut none).unwrap_err();
    assert!(stack_named(&e, "ta") && e.to_string().contains("accumulator"), "{e}");
    let adam = Optimizer::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0 };
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adam, &mut table, &mut slots).unwrap_err();
    assert!(stack_named(&e, "ta") && e.to_string().contains("m, v"), "{e}");
    // Slots of the wrong shape (another table's).
    let mut wrong = Slots::new(&other, &adagrad);
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut table, &mut wrong).unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");
    // A column-major table (or slot) has no row slices to update: an error, not a panic.
    let mut fortran = table.clone();
    fortran.data = Array2::from_shape_vec(table.data.dim().f(), table.data.t().iter().copied().collect()).unwrap();
    assert_eq!(fortran.data, table.data);
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut fortran, &mut slots).unwrap_err();
    assert!(stack_named(&e, "ta") && e.to_string().contains("row-major"), "{e}");

    // NaN and infinite hyper-parameters name the hyper-parameter.
    for (bad, what) in [
        (Optimizer::Adagrad { lr: f32::NAN }, "lr = NaN"),
        (Optimizer::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, epsilon: f32::INFINITY, step: 0 }, "epsilon = inf"),
        (Optimizer::Ftrl { lr: 0.1, lr_power: f32::NAN, l1: 0.0, l2: 0.0, beta: 0.0, multiply_linear_by_lr: false }, "lr_power = NaN"),
    ] {
        let mut s = Slots::new(&table, &bad);
        let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &bad, &mut table, &mut s).unwrap_err();
        assert!(matches!(e, KernelError::Parameter { name: "optimizer", .. }) && e.to_string().contains(what), "{e}");
    }

    // Activation gradients: one per local device, each exactly the activations' [bsd, D].
    for grads in [vec![], vec![dact.view(), dact.view()]] {
        let e = apply_gradients(&plan, so, out.num_minibatches, &grads, &adagrad, &mut table, &mut slots).unwrap_err();
        assert!(stack_named(&e, "ta") && e.to_string().contains("1 local devices"), "{e}");
    }
    for shape in [(bsd + 1, 8), (bsd - 1, 8), (bsd, 4), (bsd, 16)] {
        let g = Array2::<f32>::ones(shape);
        let e = apply_gradients(&plan, so, out.num_minibatches, &[g.view()], &adagrad, &mut table, &mut slots).unwrap_err();
        assert!(stack_named(&e, "ta") && e.to_string().contains(&format!("[{bsd}, 8]")), "{shape:?}: {e}");
    }

    // Tables that do not match the plan: another stack's, or hand-made fields of the wrong shape.
    let mut wrong_stack = other.clone();
    let mut other_slots = Slots::new(&other, &adagrad);
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut wrong_stack, &mut other_slots).unwrap_err();
    assert!(e.to_string().contains("ta") && e.to_string().contains("tb"), "{e}");
    let mut short = table.clone();
    short.data = Array2::zeros((8, 8));
    let e = sparsecore_kernel::sparse_dense_matmul(&plan, so, out.num_minibatches, &short).unwrap_err();
    assert!(stack_named(&e, "ta") && e.to_string().contains("rows per shard"), "{e}");
    let mut short_slots = Slots::new(&short, &adagrad);
    let e = apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut short, &mut short_slots).unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");
    let mut lying = table.clone();
    lying.rows_per_shard += 1;
    let e = sparsecore_kernel::sparse_dense_matmul(&plan, so, out.num_minibatches, &lying).unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");

    // Nothing changed, and the right call still works.
    assert_eq!((&table, &slots), (&table0, &slots0));
    apply_gradients(&plan, so, out.num_minibatches, &[dact.view()], &adagrad, &mut table, &mut slots).unwrap();
    assert_ne!(table, table0);
}
