//! The backward pass with each optimizer: one step through the buffers equals a dense per-row
//! step of the independent f64 reference (tests/reference) on a gradient accumulated naively
//! from the input samples (SPEC 6.3), table and slots; untouched rows never change; each
//! optimizer's formula on literal values derived by hand; bad hyper-parameters are errors.

use crate::reference;

use std::collections::BTreeMap;

use ndarray::{Array2, ShapeBuilder};
use sparsecore_kernel::{apply_gradients, Optimizer, Slots, StackedTable};
use sparsecore_kernel::{KernelError, PlanItem, Subject};
use sparsecore_prep::input::{RaggedInput, SampleSource};
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
fn case_with(
    layout: (usize, usize, usize),
    combiner: &str,
    seed: u64,
    minibatching: bool,
    limit: u32,
) -> Case {
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
        .map(|((v, sp, w), f)| {
            RaggedInput::from_i64(&f.name, v, sp)
                .unwrap()
                .with_weights(&f.name, w)
                .unwrap()
        })
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
    assert_eq!(
        plan.stacks.len(),
        1,
        "auto stacking puts both tables in one stack"
    );
    let stack = &plan.stacks[0];
    let so = &out.stacks[0];
    let layout = plan.layout;
    let (l, s, n) = (
        layout.local_devices,
        layout.sc_per_device,
        layout.num_partitions(),
    );
    let mut next = lcg(seed);
    let tables: Vec<Array2<f32>> = c
        .config
        .tables
        .iter()
        .map(|t| {
            Array2::from_shape_fn((t.vocabulary_size as usize, 8), |_| {
                next(200) as f32 / 100.0 - 1.0
            })
        })
        .collect();
    let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
    let mut table = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
    let before = table.clone();
    let bsd = (stack.total_sample_count / layout.global_devices as u64) as usize;
    // Multiples of 1/16: with the sum combiner (weights k/8) every gradient sum is exact, so
    // summation order cannot matter even for scale-invariant steps (Adam, LaProp).
    let dact: Vec<Array2<f32>> = (0..l)
        .map(|_| Array2::from_shape_fn((bsd, 8), |_| (next(32) as f32 - 16.0) / 16.0))
        .collect();
    let dviews: Vec<_> = dact.iter().map(|a| a.view()).collect();
    let mut slots = Slots::new(&table, &optimizer);
    apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &dviews,
        &optimizer,
        &mut table,
        &mut slots,
    )
    .unwrap();

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
                        let row = physical(
                            n,
                            table.rows_per_shard,
                            fp.shard_rotation as usize,
                            fp.row_offset_in_shard as usize,
                            id as usize,
                        );
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
    assert_eq!(
        slots.values.len(),
        inits.len(),
        "{optimizer:?}: slot variables"
    );
    for row in 0..table.data.nrows() {
        let Some(g) = grad.get(&row) else {
            for k in 0..8 {
                assert_eq!(
                    table.data[[row, k]].to_bits(),
                    before.data[[row, k]].to_bits(),
                    "untouched row {row} changed"
                );
                for (i, s) in slots.values.iter().enumerate() {
                    assert_eq!(
                        s[[row, k]].to_bits(),
                        inits[i].to_bits(),
                        "{optimizer:?} slot {i} of untouched row {row}: {}",
                        s[[row, k]]
                    );
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
        Optimizer::AdagradMomentum {
            lr: 0.1,
            momentum: 0.9,
            beta2: 1.0,
            epsilon: 1e-10,
            exponent: 2.0,
            use_nesterov: false,
        },
        Optimizer::AdagradMomentum {
            lr: 0.1,
            momentum: 0.9,
            beta2: 0.99,
            epsilon: 1e-10,
            exponent: 2.0,
            use_nesterov: true,
        },
        Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 3,
        },
        Optimizer::Ftrl {
            lr: 0.01,
            lr_power: -0.5,
            l1: 0.0,
            l2: 0.0,
            beta: 0.0,
            multiply_linear_by_lr: false,
        },
        Optimizer::Ftrl {
            lr: 0.05,
            lr_power: -0.5,
            l1: 0.01,
            l2: 0.1,
            beta: 0.1,
            multiply_linear_by_lr: true,
        },
        Optimizer::Laprop {
            lr: 0.01,
            b1: 0.9,
            b2: 0.95,
            eps: 1e-30,
            step: Some(2),
        },
        Optimizer::Laprop {
            lr: 0.01,
            b1: 0.9,
            b2: 0.95,
            eps: 1e-30,
            step: None,
        },
    ]
}

#[test]
fn one_step_equals_dense_per_row_step() {
    for (i, (layout, combiner)) in [
        ((1, 1, 4), "sum"),
        ((2, 2, 2), "mean"),
        ((1, 2, 4), "sqrtn"),
    ]
    .into_iter()
    .enumerate()
    {
        let c = case(layout, combiner, 11 + i as u64);
        // As in the property test below: Adam and LaProp compare on exact (sum) gradients only.
        let exact = case(layout, "sum", 11 + i as u64);
        for opt in optimizers() {
            let scale_invariant = matches!(opt, Optimizer::Adam { .. } | Optimizer::Laprop { .. });
            assert_eq!(
                run(if scale_invariant { &exact } else { &c }, opt, 5 + i as u64),
                Some(1)
            );
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
        // Only tight minibatching limits may overflow (`None`); every other case is checked.
        let checked = run(&c, opt, seed ^ 0xABCD);
        proptest::prop_assert!(minibatching || checked.is_some());
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
    assert!(
        split >= 5,
        "only {split} of 20 batches were split into minibatches"
    );
}

/// The case's batch preprocessed (ids only): its plan and output.
fn preprocess(c: &Case) -> (sparsecore_prep::Plan, Output) {
    let inputs: Vec<RaggedInput<'_>> = c
        .feats
        .iter()
        .zip(&c.config.features)
        .map(|((v, sp, _), f)| RaggedInput::from_i64(&f.name, v, sp).unwrap())
        .collect();
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
    let tables: Vec<Array2<f32>> = c
        .config
        .tables
        .iter()
        .map(|t| Array2::zeros((t.vocabulary_size as usize, 8)))
        .collect();
    let views: Vec<_> = stack.tables.iter().map(|&t| tables[t].view()).collect();
    let table = StackedTable::from_tables(&plan, &stack.name, &views).unwrap();
    assert!(sparsecore_kernel::sparse_dense_matmul(
        &plan,
        &out.stacks[0],
        out.num_minibatches,
        &table
    )
    .is_ok());
    let e =
        sparsecore_kernel::sparse_dense_matmul(&plan, &out.stacks[0], 1 << 40, &table).unwrap_err();
    assert!(
        matches!(
            &e,
            KernelError::InvalidInput {
                subject: Subject::Argument("num_minibatches"),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("1099511627776 minibatches: preprocessing makes at most 64"),
        "{e}"
    );
}

/// One step's results: the f32 row and slots (`Optimizer::apply`), the f64 row and slots (the
/// reference).
type Step = (Vec<f32>, Vec<Vec<f32>>, Vec<f64>, Vec<Vec<f64>>);

/// Steps the f32 row `w`, from fresh slots (a row of `Slots::new`'s values), once per
/// `(optimizer, gradient)` in `steps` with `Optimizer::apply`, and an f64 copy from the
/// reference's initial slots with the reference; returns both after each step.
fn literal_steps(w: &[f32], steps: &[(Optimizer, &[f32])]) -> Vec<Step> {
    let opt = steps[0].0;
    let table = StackedTable {
        stack: "s".into(),
        num_shards: 1,
        rows_per_shard: 1,
        dim: w.len(),
        data: Array2::zeros((1, w.len())),
    };
    let mut slots: Vec<Vec<f32>> = Slots::new(&table, &opt)
        .values
        .iter()
        .map(|s| s.row(0).to_vec())
        .collect();
    let mut w = w.to_vec();
    let mut rw: Vec<f64> = w.iter().map(|&x| f64::from(x)).collect();
    let mut rslots = reference::initial_slots(&opt, w.len());
    let mut out = Vec::new();
    for (opt, g) in steps {
        let mut rows: Vec<&mut [f32]> = slots.iter_mut().map(|s| &mut s[..]).collect();
        opt.apply(g, &mut w, &mut rows);
        let g64: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        reference::step(opt, &g64, &mut rw, &mut rslots);
        out.push((w.clone(), slots.clone(), rw.clone(), rslots.clone()));
    }
    out
}

/// The literals are exact results (to 12 digits, computed with plain Python floats) for the
/// f32 inputs and hyper-parameters the kernel is given: 0.1f32 = 0.100000001490, 0.9f32 =
/// 0.899999976158, 0.999f32 = 0.999000012875 (so 1 − β₂ = 0.000999987125), 0.95f32 =
/// 0.949999988079, 0.2f32 = 0.200000002980. The f32 step must be within a few f32 roundings
/// (2⁻²⁴ ≈ 6e-8 each) of them, relative (the largest here, 6e-7, where Nesterov's momentum
/// cancels and in Adam's f32 1 − β₂²); the f64 reference computes from the same values, so it
/// must agree to the literals' own rounding. Zeros are exact on both.
const LIT_RTOL: f64 = 2e-6;
const REF_RTOL: f64 = 1e-10;

/// Checks one step's row or slot (`what`) against literals, f32 and f64 reference both.
fn check_literals(what: &str, got: &[f32], ref64: &[f64], want: &[f64]) {
    assert_eq!((got.len(), ref64.len()), (want.len(), want.len()), "{what}");
    for (i, ((&g, &r), &w)) in got.iter().zip(ref64).zip(want).enumerate() {
        assert!(
            reference::near(g, w, LIT_RTOL, 0.0),
            "{what}[{i}]: kernel {g} vs literal {w}"
        );
        assert!(
            (r - w).abs() <= REF_RTOL * w.abs(),
            "{what}[{i}]: reference {r} vs literal {w}"
        );
    }
}

/// Checks every step's row and slots against literals: `want[step] = (row, slots)`.
fn check_steps(name: &str, steps: &[Step], want: &[(&[f64], &[&[f64]])]) {
    assert_eq!(steps.len(), want.len());
    for (t, ((w, s, rw, rs), (ww, ws))) in steps.iter().zip(want).enumerate() {
        check_literals(&format!("{name} step {} row", t + 1), w, rw, ww);
        assert_eq!(
            (s.len(), rs.len()),
            (ws.len(), ws.len()),
            "{name}: slot count"
        );
        for (k, ((s, rs), ws)) in s.iter().zip(rs).zip(ws.iter()).enumerate() {
            check_literals(&format!("{name} step {} slot {k}", t + 1), s, rs, ws);
        }
    }
}

#[test]
fn sgd_on_literal_values() {
    // w' = w − λ·g = [1 − 0.5·2, −2 − 0.5·4, 0.5 + 0.5·1] = [0, −4, 1]; exact in f32.
    let steps = literal_steps(
        &[1.0, -2.0, 0.5],
        &[(Optimizer::Sgd { lr: 0.5 }, &[2.0, 4.0, -1.0])],
    );
    assert_eq!(steps[0].0, [0.0, -4.0, 1.0]);
    check_steps("sgd", &steps, &[(&[0.0, -4.0, 1.0], &[])]);
}

#[test]
fn adagrad_on_literal_values() {
    // λ = 0.1, A₀ = 0.1. Step 1, g = [3, −4, 0]: A = [0.1 + 9, 0.1 + 16, 0.1] = [9.1, 16.1, 0.1];
    //   w = [1 − 0.1·3/√9.1, −1 + 0.1·4/√16.1, 0.5] = [0.900550967, −0.900311041, 0.5].
    // Step 2, g = [1, 2, 0.5]: A = [10.1, 20.1, 0.35];
    //   w = [0.900550967 − 0.1/√10.1, −0.900311041 − 0.2/√20.1, 0.5 − 0.05/√0.35] = [0.869085128, −0.944921016, 0.415484573].
    let opt = Optimizer::Adagrad { lr: 0.1 };
    let steps = literal_steps(
        &[1.0, -1.0, 0.5],
        &[(opt, &[3.0, -4.0, 0.0]), (opt, &[1.0, 2.0, 0.5])],
    );
    check_steps(
        "adagrad",
        &steps,
        &[
            (
                &[0.900550966906, -0.900311041263, 0.5],
                &[&[9.10000000149, 16.1000000015, 0.10000000149]],
            ),
            (
                &[0.869085127664, -0.944921015601, 0.415484573448],
                &[&[10.1000000015, 20.1000000015, 0.35000000149]],
            ),
        ],
    );
}

#[test]
fn adagrad_momentum_on_literal_values() {
    // λ = 0.1, μ = 0.9, β₂ = 1 (plain sum), ε = 1e-10, k = 2, no Nesterov; A₀ = 0.1, m₀ = 0.
    // Step 1, g = [3, −4]: A = [9.1, 16.1]; s = g/√(A + ε) = [3/√9.1, −4/√16.1] = [0.994490316, −0.996889573];
    //   m = 0.9·0 + s = s; w = [1, −1] − 0.1·m = [0.900550967, −0.900311041].
    // Step 2, g = [1, 2]: A = [10.1, 20.1]; s = [1/√10.1, 2/√20.1] = [0.314658388, 0.446099737];
    //   m = 0.9·m + s = [1.209699649, −0.451100855]; w −= 0.1·m: [0.779581000, −0.855200955].
    let plain = Optimizer::AdagradMomentum {
        lr: 0.1,
        momentum: 0.9,
        beta2: 1.0,
        epsilon: 1e-10,
        exponent: 2.0,
        use_nesterov: false,
    };
    let steps = literal_steps(&[1.0, -1.0], &[(plain, &[3.0, -4.0]), (plain, &[1.0, 2.0])]);
    check_steps(
        "adagrad momentum",
        &steps,
        &[
            (
                &[0.900550966907, -0.900311041264],
                &[
                    &[9.10000000149, 16.1000000015],
                    &[0.994490316111, -0.996889572509],
                ],
            ),
            (
                &[0.779581000252, -0.855200955115],
                &[
                    &[10.1000000015, 20.1000000015],
                    &[1.20969964853, -0.451100854763],
                ],
            ),
        ],
    );
    // λ = 0.1, μ = 0.5, β₂ = 0.5, ε = 0.01, k = 4 (fourth root), Nesterov; A₀ = 0.1, m₀ = 0.
    // Step 1, g = [3, −4]: A = 0.5·0.1 + 0.5·g² = [4.55, 8.05]; s = (A + 0.01)^(−1/4)·g
    //   = [3/4.56^¼, −4/8.06^¼] = [2.052957903, −2.373975490]; m = s;
    //   u = μ·m + s = 1.5·s = [3.079436855, −3.560963236]; w = [1, −1] − 0.1·u = [0.692056310, −0.643903671].
    // Step 2, g = [1, 2]: A = 0.5·A + 0.5·g² = [2.775, 6.025]; s = [1/2.785^¼, 2/6.035^¼] = [0.774093998, 1.276029389];
    //   m = 0.5·m + s = [1.800572950, 0.089041644]; u = 0.5·m + s = [1.674380473, 1.320550211];
    //   w −= 0.1·u: [0.524618260, −0.775958694].
    let nesterov = Optimizer::AdagradMomentum {
        lr: 0.1,
        momentum: 0.5,
        beta2: 0.5,
        epsilon: 0.01,
        exponent: 4.0,
        use_nesterov: true,
    };
    let steps = literal_steps(
        &[1.0, -1.0],
        &[(nesterov, &[3.0, -4.0]), (nesterov, &[1.0, 2.0])],
    );
    check_steps(
        "adagrad momentum nesterov",
        &steps,
        &[
            (
                &[0.692056309947, -0.643903671127],
                &[
                    &[4.55000000075, 8.05000000075],
                    &[2.05295790309, -2.37397549044],
                ],
            ),
            (
                &[0.524618260179, -0.775958694208],
                &[
                    &[2.77500000037, 6.02500000037],
                    &[1.80057294952, 0.0890416439406],
                ],
            ),
        ],
    );
}

#[test]
fn adam_on_literal_values() {
    // λ = 0.1, β₁ = 0.9, β₂ = 0.999, ε = 1e-8 (as f32: 1 − β₁ = 0.100000024, 1 − β₂ = 0.000999987125); m₀ = v₀ = 0.
    // Step 0 (t = 1), g = [2, −0.5, 0]: c = √(1 − β₂) = 0.0316225730; α = 0.1·c/(1 − β₁) = 0.0316225660;
    //   ε̂ = 1e-8·c = 3.2e-10; m = (1 − β₁)·g = [0.200000048, −0.050000012, 0];
    //   v = (1 − β₂)·g² = [0.00399994850, 0.000249996781, 0]; m/√v = ±(1 − β₁)/√(1 − β₂) = ±3.16228 for g ≠ 0,
    //   so w = [1, −1, 0.5] − α·m/(√v + ε̂) = [0.899999999, −0.900000001, 0.5] (a step of λ·sign(g), less 1e-9
    //   and 5e-10 from ε̂); the zero gradient leaves its entry alone (0/(0 + ε̂) = 0).
    // Step 1 (t = 2), g = [1, 1, 1]: c = √(1 − β₂²) = 0.0447098901; α = 0.1·c/(1 − β₁²) = 0.0235315162;
    //   m = β₁·m + (1 − β₁)·g = [0.280000062, 0.055000014, 0.100000024];
    //   v = β₂·v + (1 − β₂)·g² = [0.00499593573, 0.00124973391, 0.000999987125];
    //   w −= α·m/√v: [0.9 − 0.0235315162·0.280000062/√0.00499593573, ...] = [0.806782035, −0.936610355, 0.425586316].
    let adam = |step| Optimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step,
    };
    let steps = literal_steps(
        &[1.0, -1.0, 0.5],
        &[(adam(0), &[2.0, -0.5, 0.0]), (adam(1), &[1.0, 1.0, 1.0])],
    );
    assert_eq!(
        steps[0].0[2], 0.5,
        "a zero gradient from zero moments leaves its entry exactly"
    );
    check_steps(
        "adam",
        &steps,
        &[
            (
                &[0.89999999901, -0.90000000051, 0.5],
                &[
                    &[0.200000047684, -0.0500000119209, 0.0],
                    &[0.00399994850159, 0.000249996781349, 0.0],
                ],
            ),
            (
                &[0.806782034927, -0.93661035462, 0.425586316413],
                &[
                    &[0.280000061989, 0.0550000143051, 0.100000023842],
                    &[0.00499593572998, 0.00124973391318, 0.000999987125397],
                ],
            ),
        ],
    );
    // A large ε = 0.01, to see it scaled: step 0, g = [2, −0.5], w = [1, −1]: ε̂ = 0.01·0.0316225730 = 0.000316225723;
    //   m and v as above, √v = [0.0632451461, 0.0158112865];
    //   w = [1 − 0.0316225660·0.200000048/(0.0632451461 + 0.000316225723), −1 + 0.0316225660·0.050000012/(0.0158112865 + 0.000316225723)]
    //     = [0.900497511, −0.901960783] (an unscaled ε would give 0.913652780).
    let eps = Optimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 0.01,
        step: 0,
    };
    let steps = literal_steps(&[1.0, -1.0], &[(eps, &[2.0, -0.5])]);
    check_steps(
        "adam with a large epsilon",
        &steps,
        &[(
            &[0.900497510944, -0.90196078281],
            &[
                &[0.200000047684, -0.0500000119209],
                &[0.00399994850159, 0.000249996781349],
            ],
        )],
    );
}

#[test]
fn ftrl_on_literal_values() {
    // λ = 0.1, k = −0.5, γ₁ = γ₂ = β = 0; A₀ = 0.1, L₀ = 0; p = A^0.5.
    // Step 1, g = [3, −4], w = [1, −1]: A' = [9.1, 16.1]; p = √0.1 = 0.316227768,
    //   p' = [√9.1, √16.1] = [3.016620626, 4.012480530];
    //   L = g − (p' − p)/λ·w = [3 − 27.003928, −4 + 36.962527] = [−24.003928174, 32.962527063];
    //   w = −L/(p'/λ) = [24.003928174/30.166205811, −32.962527063/40.124804699] = [0.795722482, −0.821500000].
    // Step 2, g = [1, 2]: A' = [10.1, 20.1]; p' = [3.178049717, 4.483302354];
    //   L = [−24.003928174 + 1 − 1.614290906·0.795722482, 32.962527063 + 2 + 4.708218249·0.821500000]
    //     = [−24.288455722, 38.830328296]; w = −L·λ/p' = [0.764256643, −0.866109974].
    let plain = Optimizer::Ftrl {
        lr: 0.1,
        lr_power: -0.5,
        l1: 0.0,
        l2: 0.0,
        beta: 0.0,
        multiply_linear_by_lr: false,
    };
    let steps = literal_steps(&[1.0, -1.0], &[(plain, &[3.0, -4.0]), (plain, &[1.0, 2.0])]);
    check_steps(
        "ftrl",
        &steps,
        &[
            (
                &[0.795722482462, -0.821500000056],
                &[
                    &[9.10000000149, 16.1000000015],
                    &[-24.0039281743, 32.9625270628],
                ],
            ),
            (
                &[0.764256643219, -0.866109974393],
                &[
                    &[10.1000000015, 20.1000000015],
                    &[-24.2884557224, 38.8303282956],
                ],
            ),
        ],
    );
    // λ = 0.5, k = −0.5, γ₁ = 0.5, γ₂ = 0.25, β = 1, linear not multiplied by λ; one step,
    // g = [3, −4, 0.1], w = [1, −1, 0.2]: A' = [9.1, 16.1, 0.11]; p' = [3.016620626, 4.012480530, 0.331662482];
    //   L = g − (p' − 0.316227768)/0.5·w = [−2.400785715, 3.392505523, 0.093826116];
    //   num = clip(L, −0.5, 0.5) − L = [−0.5 + 2.400785715, 0.5 − 3.392505523, 0] (|L| ≤ γ₁ gives 0);
    //   den = (p' + 1)/0.5 + 2·0.25 = [8.533241252, 10.524961060, 3.163324963];
    //   w = num/den = [0.222750730, −0.274823394, 0].
    let l1 = Optimizer::Ftrl {
        lr: 0.5,
        lr_power: -0.5,
        l1: 0.5,
        l2: 0.25,
        beta: 1.0,
        multiply_linear_by_lr: false,
    };
    let steps = literal_steps(&[1.0, -1.0, 0.2], &[(l1, &[3.0, -4.0, 0.1])]);
    assert_eq!(
        steps[0].0[2], 0.0,
        "|L| within γ₁ zeroes the weight exactly"
    );
    check_steps(
        "ftrl l1",
        &steps,
        &[(
            &[0.222750729669, -0.274823394251, 0.0],
            &[
                &[9.10000000149, 16.1000000015, 0.110000001788],
                &[-2.40078571535, 3.39250552272, 0.0938261160548],
            ],
        )],
    );
    // λ = 0.5, k = −0.25 (p = A^¼), γ₁ = 0.5, γ₂ = 0.25, β = 1, linear multiplied by λ; one step,
    // g = [3, −4, 0.1], w = [1, −1, 0.2]: p = 0.1^¼ = 0.562341327;
    //   p' = [9.1^¼, 16.1^¼, 0.11^¼] = [1.736842142, 2.003117702, 0.575901451];
    //   L = λ·g − (p' − p)·w = [1.5 − 1.174500815, −2 + 1.440776375, 0.05 − 0.002712025] = [0.325499185, −0.559223625, 0.047287976];
    //   num = clip(L, −γ₁λ, γ₁λ) − L with γ₁λ = 0.25: [0.25 − 0.325499185, −0.25 + 0.559223625, 0];
    //   den = p' + 2·λ·γ₂ + β = p' + 1.25 = [2.986842142, 3.253117702, 1.825901451]; w = [−0.025277260, 0.095054546, 0].
    let mult = Optimizer::Ftrl {
        lr: 0.5,
        lr_power: -0.25,
        l1: 0.5,
        l2: 0.25,
        beta: 1.0,
        multiply_linear_by_lr: true,
    };
    let steps = literal_steps(&[1.0, -1.0, 0.2], &[(mult, &[3.0, -4.0, 0.1])]);
    assert_eq!(
        steps[0].0[2], 0.0,
        "|L| within γ₁·λ zeroes the weight exactly"
    );
    check_steps(
        "ftrl multiply_linear_by_lr",
        &steps,
        &[(
            &[-0.0252772599786, 0.0950545455639, 0.0],
            &[
                &[9.10000000149, 16.1000000015, 0.110000001788],
                &[0.325499185337, -0.559223624869, 0.0472879758805],
            ],
        )],
    );
}

#[test]
fn laprop_on_literal_values() {
    // λ = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-30; μ₀ = ν₀ = 0; √(1 − b1²) = 0.435889943 (b1 as f32).
    // Step Some(0), g = [2, −0.5, 0]: decay = 0.95·(1 − 1)/(1 − 0.95) = 0; ν = g² + eps = [4, 0.25, 1e-30];
    //   μ = √(1 − b1²)·g/√ν = [0.435889944, −0.435889944, 0]; w = [1, −1, 0.5] − 0.1·μ = [0.956411005, −0.956411005, 0.5].
    // Step Some(1), g = [1, 1, 1]: decay = 0.95·(1 − 0.95)/(1 − 0.9025) = 0.487179484;
    //   ν = decay·ν + (1 − decay)·(1 + eps) = [2.461538452, 0.634615387, 0.512820516];
    //   μ = 0.9·μ + 0.435889944/√ν = [0.670127355, 0.154868145, 0.608687179]; w −= 0.1·μ: [0.889398268, −0.971897820, 0.439131281].
    let laprop = |step| Optimizer::Laprop {
        lr: 0.1,
        b1: 0.9,
        b2: 0.95,
        eps: 1e-30,
        step,
    };
    let steps = literal_steps(
        &[1.0, -1.0, 0.5],
        &[
            (laprop(Some(0)), &[2.0, -0.5, 0.0]),
            (laprop(Some(1)), &[1.0, 1.0, 1.0]),
        ],
    );
    check_steps(
        "laprop",
        &steps,
        &[
            (
                &[0.956411004992, -0.956411004992, 0.5],
                &[
                    &[0.435889943581, -0.435889943581, 0.0],
                    &[4.0, 0.25, 1.00000000317e-30],
                ],
            ),
            (
                &[0.889398268456, -0.971897819687, 0.439131281231],
                &[
                    &[0.670127355374, 0.154868144642, 0.608687178623],
                    &[2.46153845213, 0.634615386967, 0.512820515956],
                ],
            ),
        ],
    );
    // No step: decay = b2 = 0.95 (0.949999988 as f32). g = [2, −0.5]: ν = (1 − b2)·g² = [0.200000048, 0.012500003];
    //   μ = √(1 − b1²)·g/√ν = ±0.435889944/√0.050000012 = ±1.949358857; w = [1, −1] − 0.1·μ = [0.805064111, −0.805064111].
    let steps = literal_steps(&[1.0, -1.0], &[(laprop(None), &[2.0, -0.5])]);
    check_steps(
        "laprop without a step",
        &steps,
        &[(
            &[0.805064111422, -0.805064111422],
            &[
                &[1.94935885673, -1.94935885673],
                &[0.200000047684, 0.0125000029802],
            ],
        )],
    );
}

/// Python passes any step below 2^32. Past 2^31 a step used to wrap to a negative power (and
/// 2^31 − 1 overflowed the `+ 1`); there β^t is 0 in f32 and f64 alike, so Adam's bias correction
/// is 1 and LaProp's decay is b2, its value without a step.
#[test]
fn steps_past_two_to_the_31_are_the_limit_of_the_bias_correction() {
    // Adam from zero moments, g = [2, −0.5]: m = (1 − β₁)·g = [0.200000048, −0.050000012],
    //   v = (1 − β₂)·g² = [0.0039999485, 0.000249996781]; w = [1, −1] − 0.1·m/(√v + 1e-8) = [0.683770168, −0.683770318].
    let adam = |step| Optimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step,
    };
    for step in [(1 << 31) - 2, (1 << 31) - 1, 1 << 31, u32::MAX] {
        let steps = literal_steps(&[1.0, -1.0], &[(adam(step), &[2.0, -0.5])]);
        check_steps(
            &format!("adam at step {step}"),
            &steps,
            &[(
                &[0.683770168203, -0.683770318205],
                &[
                    &[0.200000047684, -0.0500000119209],
                    &[0.00399994850159, 0.000249996781349],
                ],
            )],
        );
    }
    // LaProp: the same row as `laprop_on_literal_values` without a step.
    let laprop = |step| Optimizer::Laprop {
        lr: 0.1,
        b1: 0.9,
        b2: 0.95,
        eps: 1e-30,
        step,
    };
    for step in [(1 << 31) - 1, 1 << 31, u32::MAX] {
        let steps = literal_steps(&[1.0, -1.0], &[(laprop(Some(step)), &[2.0, -0.5])]);
        check_steps(
            &format!("laprop at step {step}"),
            &steps,
            &[(
                &[0.805064111422, -0.805064111422],
                &[
                    &[1.94935885673, -1.94935885673],
                    &[0.200000047684, 0.0125000029802],
                ],
            )],
        );
    }
}

#[test]
fn nan_hyper_parameters_are_errors() {
    for bad in [
        Optimizer::Sgd { lr: f32::NAN },
        Optimizer::Adam {
            lr: 0.1,
            beta1: f32::INFINITY,
            beta2: 0.9,
            epsilon: 1e-8,
            step: 0,
        },
    ] {
        let e = bad.validate().unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::Parameter {
                    name: "optimizer",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("finite"), "{e}");
    }
    let e = Optimizer::Ftrl {
        lr: 0.0,
        lr_power: -0.5,
        l1: 0.0,
        l2: 0.0,
        beta: 0.0,
        multiply_linear_by_lr: false,
    }
    .validate()
    .unwrap_err();
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
        KernelError::Plan {
            kind: PlanItem::Stack,
            name: n,
            ..
        } => n == name,
        KernelError::InvalidInput {
            subject: Subject::Stack(n),
            ..
        } => n == name,
        _ => false,
    };

    // Missing slot variables for the chosen optimizer (SGD's none for Adagrad's accumulator).
    let mut none = Slots::new(&table, &Optimizer::Sgd { lr: 0.1 });
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut table,
        &mut none,
    )
    .unwrap_err();
    assert!(
        stack_named(&e, "ta") && e.to_string().contains("accumulator"),
        "{e}"
    );
    let adam = Optimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step: 0,
    };
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adam,
        &mut table,
        &mut slots,
    )
    .unwrap_err();
    assert!(
        stack_named(&e, "ta") && e.to_string().contains("m, v"),
        "{e}"
    );
    // Slots of the wrong shape (another table's).
    let mut wrong = Slots::new(&other, &adagrad);
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut table,
        &mut wrong,
    )
    .unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");
    // A column-major table (or slot) has no row slices to update: an error, not a panic.
    let mut fortran = table.clone();
    fortran.data = Array2::from_shape_vec(
        table.data.dim().f(),
        table.data.t().iter().copied().collect(),
    )
    .unwrap();
    assert_eq!(fortran.data, table.data);
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut fortran,
        &mut slots,
    )
    .unwrap_err();
    assert!(
        stack_named(&e, "ta") && e.to_string().contains("row-major"),
        "{e}"
    );

    // NaN and infinite hyper-parameters name the hyper-parameter.
    for (bad, what) in [
        (Optimizer::Adagrad { lr: f32::NAN }, "lr = NaN"),
        (
            Optimizer::Adam {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: f32::INFINITY,
                step: 0,
            },
            "epsilon = inf",
        ),
        (
            Optimizer::Ftrl {
                lr: 0.1,
                lr_power: f32::NAN,
                l1: 0.0,
                l2: 0.0,
                beta: 0.0,
                multiply_linear_by_lr: false,
            },
            "lr_power = NaN",
        ),
    ] {
        let mut s = Slots::new(&table, &bad);
        let e = apply_gradients(
            &plan,
            so,
            out.num_minibatches,
            &[dact.view()],
            &bad,
            &mut table,
            &mut s,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::Parameter {
                    name: "optimizer",
                    ..
                }
            ) && e.to_string().contains(what),
            "{e}"
        );
    }

    // Activation gradients: one per local device, each exactly the activations' [bsd, D].
    for grads in [vec![], vec![dact.view(), dact.view()]] {
        let e = apply_gradients(
            &plan,
            so,
            out.num_minibatches,
            &grads,
            &adagrad,
            &mut table,
            &mut slots,
        )
        .unwrap_err();
        assert!(
            stack_named(&e, "ta") && e.to_string().contains("1 local devices"),
            "{e}"
        );
    }
    for shape in [(bsd + 1, 8), (bsd - 1, 8), (bsd, 4), (bsd, 16)] {
        let g = Array2::<f32>::ones(shape);
        let e = apply_gradients(
            &plan,
            so,
            out.num_minibatches,
            &[g.view()],
            &adagrad,
            &mut table,
            &mut slots,
        )
        .unwrap_err();
        assert!(
            stack_named(&e, "ta") && e.to_string().contains(&format!("[{bsd}, 8]")),
            "{shape:?}: {e}"
        );
    }

    // Tables that do not match the plan: another stack's, or hand-made fields of the wrong shape.
    let mut wrong_stack = other.clone();
    let mut other_slots = Slots::new(&other, &adagrad);
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut wrong_stack,
        &mut other_slots,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("ta") && e.to_string().contains("tb"),
        "{e}"
    );
    let mut short = table.clone();
    short.data = Array2::zeros((8, 8));
    let e =
        sparsecore_kernel::sparse_dense_matmul(&plan, so, out.num_minibatches, &short).unwrap_err();
    assert!(
        stack_named(&e, "ta") && e.to_string().contains("rows per shard"),
        "{e}"
    );
    let mut short_slots = Slots::new(&short, &adagrad);
    let e = apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut short,
        &mut short_slots,
    )
    .unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");
    let mut lying = table.clone();
    lying.rows_per_shard += 1;
    let e =
        sparsecore_kernel::sparse_dense_matmul(&plan, so, out.num_minibatches, &lying).unwrap_err();
    assert!(stack_named(&e, "ta"), "{e}");

    // Nothing changed, and the right call still works.
    assert_eq!((&table, &slots), (&table0, &slots0));
    apply_gradients(
        &plan,
        so,
        out.num_minibatches,
        &[dact.view()],
        &adagrad,
        &mut table,
        &mut slots,
    )
    .unwrap();
    assert_ne!(table, table0);
}
