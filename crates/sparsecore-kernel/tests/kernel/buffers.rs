//! The borrowed, parallel passes (`sparse_dense_matmul_into`, `apply_gradients_into`) equal the
//! owned, sequential ones (`sparse_dense_matmul`, `apply_gradients`, each checked against a
//! naive lookup or step in the `kernel` and `optimizer` modules) bitwise, for every optimizer,
//! with and without minibatching, on one and several threads; `embedding_var_limits` clip the
//! table (not the slots); bad inputs are errors that leave the table unchanged.

use ndarray::{concatenate, Array2, Axis};
use sparsecore_kernel::{
    apply_gradients, apply_gradients_into, sparse_dense_matmul, sparse_dense_matmul_into,
    Optimizer, Slots, StackBuffers, StackedTable,
};
use sparsecore_prep::input::{RaggedInput, SampleSource};
use sparsecore_prep::{Config, Output, Plan, Preprocessor};

fn lcg(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    move |m| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    }
}

/// Two tables stacked into one, three features; without minibatching, hot ids (rows touched
/// from several devices and SparseCores).
fn prepared(
    layout: (usize, usize, usize),
    minibatching: bool,
    limit: u32,
    seed: u64,
) -> Option<(Plan, Output)> {
    let (l, g, s) = layout;
    let config = Config::from_json(&format!(
        r#"{{"config": {{"local_device_count": {l}, "global_device_count": {g}, "num_sc_per_device": {s}, "stacking": "auto",
                        "enable_minibatching": {minibatching},
                        "stack_limits": {{"max_ids_per_partition": {limit}, "max_unique_ids_per_partition": {limit}}}}},
            "tables": [{{"name": "ta", "vocabulary_size": 60, "embedding_dim": 8, "combiner": "mean"}},
                       {{"name": "tb", "vocabulary_size": 30, "embedding_dim": 8, "combiner": "mean"}}],
            "features": [{{"name": "f0", "table": "ta"}}, {{"name": "f1", "table": "tb"}}, {{"name": "f2", "table": "ta"}}]}}"#
    ))
    .unwrap();
    let mut next = lcg(seed);
    let feats: Vec<(Vec<i64>, Vec<i64>, Vec<f32>)> = (0..3)
        .map(|f| {
            let vocab = if f == 1 { 30 } else { 60 };
            let (mut v, mut sp, mut w) = (Vec::new(), vec![0i64], Vec::new());
            // Minibatching with tight limits needs ids spread out (a hot id would overflow its
            // bucket), so hot ids only without it.
            for _ in 0..if minibatching { 32 } else { 64 } {
                for _ in 0..next(if minibatching { 5 } else { 6 }) {
                    v.push(if !minibatching && next(2) == 0 {
                        next(4)
                    } else {
                        next(vocab)
                    } as i64);
                    w.push((next(32) + 1) as f32 / 8.0);
                }
                sp.push(v.len() as i64);
            }
            (v, sp, w)
        })
        .collect();
    let inputs: Vec<RaggedInput<'_>> = feats
        .iter()
        .zip(&config.features)
        .map(|((v, sp, w), f)| {
            RaggedInput::from_i64(&f.name, v, sp)
                .unwrap()
                .with_weights(&f.name, w)
                .unwrap()
        })
        .collect();
    let refs: Vec<&dyn SampleSource> = inputs.iter().map(|i| i as &dyn SampleSource).collect();
    let mut prep = Preprocessor::new(config).unwrap();
    let mut out = Output::new();
    match prep.run(&refs, &mut out) {
        Ok(()) => Some((prep.plan().unwrap().clone(), out)),
        Err(sparsecore_prep::Error::LimitExceeded { .. }) if minibatching => None,
        Err(e) => panic!("{e}"),
    }
}

fn optimizers() -> Vec<Optimizer> {
    vec![
        Optimizer::Sgd { lr: 0.1 },
        Optimizer::Adagrad { lr: 0.1 },
        Optimizer::AdagradMomentum {
            lr: 0.1,
            momentum: 0.9,
            beta2: 0.99,
            epsilon: 1e-10,
            exponent: 2.0,
            use_nesterov: true,
        },
        Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 3,
        },
        Optimizer::Ftrl {
            lr: 0.1,
            lr_power: -0.5,
            l1: 0.01,
            l2: 0.01,
            beta: 0.1,
            multiply_linear_by_lr: false,
        },
        Optimizer::Laprop {
            lr: 0.1,
            b1: 0.9,
            b2: 0.95,
            eps: 1e-30,
            step: Some(2),
        },
    ]
}

#[test]
fn borrowed_parallel_passes_equal_the_owned_ones_bitwise() {
    let (mut checked, mut split) = (0, 0);
    for (layout, minibatching, limit) in [
        ((1, 1, 4), false, 4096),
        ((2, 2, 2), false, 4096),
        ((1, 1, 4), true, 5),
        ((2, 2, 2), true, 5),
        ((2, 4, 2), false, 4096),
    ] {
        for seed in 1..6 {
            let Some((plan, out)) = prepared(layout, minibatching, limit, seed) else {
                continue;
            };
            split += usize::from(out.num_minibatches > 1);
            let (sp, so) = (&plan.stacks[0], &out.stacks[0]);
            let l = plan.layout.local_devices;
            let mut next = lcg(seed + 100);
            let tables: Vec<Array2<f32>> = [60usize, 30]
                .iter()
                .map(|&v| Array2::from_shape_fn((v, 8), |_| next(200) as f32 / 100.0 - 1.0))
                .collect();
            let views: Vec<_> = sp.tables.iter().map(|&t| tables[t].view()).collect();
            let table = StackedTable::from_tables(&plan, &sp.name, &views).unwrap();
            let want: Vec<Array2<f32>> =
                sparse_dense_matmul(&plan, so, out.num_minibatches, &table).unwrap();
            let want_views: Vec<_> = want.iter().map(|a| a.view()).collect();
            let bsd = want[0].nrows();
            let dact = Array2::from_shape_fn((l * bsd, 8), |_| next(1000) as f32 / 250.0 - 2.0);
            let dact_views: Vec<_> = (0..l)
                .map(|d| dact.slice(ndarray::s![d * bsd..(d + 1) * bsd, ..]))
                .collect();
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut got = Array2::from_elem((l * bsd, 8), f32::NAN);
                pool.install(|| {
                    sparse_dense_matmul_into(
                        &plan,
                        &StackBuffers::from(so),
                        out.num_minibatches,
                        table.data.view(),
                        got.view_mut(),
                    )
                })
                .unwrap();
                assert_eq!(
                    got,
                    concatenate(Axis(0), &want_views).unwrap(),
                    "forward, layout {layout:?}"
                );
                for opt in optimizers() {
                    let (mut t_want, mut t_got) = (table.clone(), table.clone());
                    let mut s_want = Slots::new(&t_want, &opt);
                    let mut s_got = s_want.clone();
                    apply_gradients(
                        &plan,
                        so,
                        out.num_minibatches,
                        &dact_views,
                        &opt,
                        &mut t_want,
                        &mut s_want,
                    )
                    .unwrap();
                    let mut slot_views: Vec<_> =
                        s_got.values.iter_mut().map(|s| s.view_mut()).collect();
                    pool.install(|| {
                        apply_gradients_into(
                            &plan,
                            &StackBuffers::from(so),
                            out.num_minibatches,
                            dact.view(),
                            &opt,
                            (f32::NEG_INFINITY, f32::INFINITY),
                            t_got.data.view_mut(),
                            &mut slot_views,
                        )
                    })
                    .unwrap();
                    assert_eq!(t_got, t_want, "{opt:?}, layout {layout:?}");
                    assert_eq!(s_got, s_want, "{opt:?} slots, layout {layout:?}");
                    assert_ne!(t_got, table, "the step changed rows");
                    checked += 1;
                }
            }
        }
    }
    assert!(
        checked >= 6 * 2 * 6 && split > 0,
        "{checked} cases, {split} minibatched"
    );
}

#[test]
fn limits_clip_the_table_and_errors_leave_it_unchanged() {
    let (plan, out) = prepared((1, 1, 2), false, 4096, 5).unwrap();
    let (sp, so) = (&plan.stacks[0], &out.stacks[0]);
    let t = [
        Array2::from_elem((60, 8), 0.5f32),
        Array2::from_elem((30, 8), 0.5f32),
    ];
    let views: Vec<_> = sp.tables.iter().map(|&i| t[i].view()).collect();
    let table = StackedTable::from_tables(&plan, &sp.name, &views).unwrap();
    let bsd = (sp.total_sample_count / plan.layout.global_devices as u64) as usize;
    // Gradient −100 everywhere: SGD with lr 1 moves every touched entry to 0.5 + 100·gain·…;
    // clipped at 0.75.
    let dact = Array2::from_elem((bsd, 8), -100.0f32);
    let opt = Optimizer::Sgd { lr: 1.0 };
    let b = StackBuffers::from(so);
    let mut clipped = table.clone();
    apply_gradients_into(
        &plan,
        &b,
        out.num_minibatches,
        dact.view(),
        &opt,
        (-0.25, 0.75),
        clipped.data.view_mut(),
        &mut [],
    )
    .unwrap();
    let touched = clipped.data.iter().filter(|&&x| x == 0.75).count();
    assert!(
        touched > 0
            && clipped
                .data
                .iter()
                .all(|&x| x == 0.75 || x == 0.5 || x == 0.0),
        "clipped to 0.75 or untouched"
    );

    let mut t2 = table.clone();
    let bad_lr = Optimizer::Adagrad { lr: f32::NAN };
    let mut acc = Array2::from_elem(t2.data.dim(), 0.1f32);
    let e = apply_gradients_into(
        &plan,
        &b,
        1,
        dact.view(),
        &bad_lr,
        (f32::NEG_INFINITY, f32::INFINITY),
        t2.data.view_mut(),
        &mut [acc.view_mut()],
    )
    .unwrap_err();
    assert!(e.to_string().contains("lr = NaN"), "{e}");
    let e = apply_gradients_into(
        &plan,
        &b,
        1,
        dact.view(),
        &Optimizer::Adagrad { lr: 0.1 },
        (f32::NEG_INFINITY, f32::INFINITY),
        t2.data.view_mut(),
        &mut [],
    )
    .unwrap_err();
    assert!(e.to_string().contains("accumulator"), "{e}");
    let short = Array2::zeros((bsd - 1, 8));
    let e = apply_gradients_into(
        &plan,
        &b,
        1,
        short.view(),
        &opt,
        (f32::NEG_INFINITY, f32::INFINITY),
        t2.data.view_mut(),
        &mut [],
    )
    .unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "expected the activations' [L · bsd, D] = [{bsd}, 8]"
        )),
        "{e}"
    );
    let e = apply_gradients_into(
        &plan,
        &b,
        1,
        dact.view(),
        &opt,
        (1.0, 0.0),
        t2.data.view_mut(),
        &mut [],
    )
    .unwrap_err();
    assert!(e.to_string().contains("embedding_var_limits"), "{e}");
    let mut bad_ids = so.embedding_ids.clone();
    bad_ids[0] = 1_000_000;
    let bb = StackBuffers {
        embedding_ids: &bad_ids,
        ..b
    };
    let e = apply_gradients_into(
        &plan,
        &bb,
        1,
        dact.view(),
        &opt,
        (f32::NEG_INFINITY, f32::INFINITY),
        t2.data.view_mut(),
        &mut [],
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("embedding id 1000000 at device 0 slot 0"),
        "{e}"
    );
    assert_eq!(t2, table, "errors leave the table unchanged");
}
