//! Host tables split across R replicas by rows (Token) or columns (Encoding): lookups equal the
//! unsplit table's, and one optimizer step equals the independent f64 reference's (tests/reference)
//! and is the same to the bit for every split, for R in 1..=4, including R not dividing the dim.

use crate::reference;

use std::collections::BTreeMap;

use ndarray::{Array1, Array2};
use sparsecore_kernel::{Optimizer, Partition, PartitionedTable, Slots, StackedTable};

fn values(rows: usize, dim: usize, seed: u64) -> Array2<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    Array2::from_shape_fn((rows, dim), |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 400) as f32 / 100.0 - 2.0
    })
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
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 0,
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
            step: Some(1),
        },
    ]
}

#[test]
fn partitioned_lookup_and_update_equal_the_unsplit_table_and_the_reference_step() {
    for dim in [8usize, 6] {
        let rows = 37;
        let dense = values(rows, dim, dim as u64);
        let grads: BTreeMap<usize, Array1<f32>> = [0usize, 3, 4, 17, 36]
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, values(1, dim, 100 + i as u64).row(0).to_owned()))
            .collect();
        for opt in optimizers() {
            // The f64 reference's step on every row with a gradient, from the reference's slots.
            let mut want: Vec<Vec<f64>> = dense
                .rows()
                .into_iter()
                .map(|r| r.iter().map(|&x| f64::from(x)).collect())
                .collect();
            let mut want_slots: Vec<Vec<Vec<f64>>> = (0..rows)
                .map(|_| reference::initial_slots(&opt, dim))
                .collect();
            let mut scales: BTreeMap<usize, Vec<Vec<f64>>> = BTreeMap::new();
            for (&r, g) in &grads {
                let g: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
                scales.insert(
                    r,
                    reference::step(&opt, &g, &mut want[r], &mut want_slots[r]),
                );
            }
            let stacked = StackedTable {
                stack: "s".into(),
                num_shards: 1,
                rows_per_shard: rows,
                dim,
                data: dense.clone(),
            };
            // The first split's result; every other split must give the same bits.
            let mut first: Option<Vec<Array2<f32>>> = None;
            for partition in [Partition::Token, Partition::Encoding] {
                for replicas in 1..=4 {
                    let slots = Slots::new(&stacked, &opt);
                    let mut t =
                        PartitionedTable::new(dense.view(), &slots, partition, replicas).unwrap();
                    assert_eq!(t.replicas(), replicas);
                    for r in 0..rows {
                        assert_eq!(
                            t.row(r).unwrap(),
                            dense.row(r),
                            "{partition:?} R={replicas} lookup of row {r}"
                        );
                    }
                    t.apply_gradients(&grads, &opt).unwrap();
                    let got: Vec<Array2<f32>> = (0..=slots.values.len())
                        .map(|k| t.to_dense(k).unwrap())
                        .collect();
                    assert_eq!(got.len(), 1 + want_slots[0].len(), "{opt:?}: slot count");
                    for r in 0..rows {
                        for c in 0..dim {
                            let values = std::iter::once(want[r][c])
                                .chain(want_slots[r].iter().map(|s| s[c]));
                            for (k, want) in values.enumerate() {
                                let g = got[k][[r, c]];
                                let what = format!(
                                    "{opt:?} {partition:?} R={replicas} value {k} [{r}, {c}]"
                                );
                                if let Some(scale) = scales.get(&r) {
                                    // Relative 1e-5 of the scale (a few f32 roundings; Adam's f32
                                    // bias correction loses 3e-6 of its step), absolute 1e-9 at 0.
                                    assert!(
                                        reference::near_scaled(g, want, scale[k][c], 1e-5, 1e-9),
                                        "{what}: {g} vs {want}"
                                    );
                                } else {
                                    assert_eq!(
                                        g.to_bits(),
                                        (want as f32).to_bits(),
                                        "{what}: untouched"
                                    );
                                }
                            }
                        }
                    }
                    match &first {
                        None => first = Some(got),
                        Some(first) => {
                            for (k, (a, b)) in got.iter().zip(first).enumerate() {
                                let same = a
                                    .iter()
                                    .zip(b.iter())
                                    .all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(same, "{opt:?} {partition:?} R={replicas} dim={dim}: value {k} differs from the Token R=1 split's");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn strided_gradients_update_as_contiguous_ones() {
    let dense = values(7, 4, 2);
    let stacked = StackedTable {
        stack: "s".into(),
        num_shards: 1,
        rows_per_shard: 7,
        dim: 4,
        data: dense.clone(),
    };
    let opt = Optimizer::Sgd { lr: 0.5 };
    let slots = Slots::new(&stacked, &opt);
    // A column of a row-major array: a view with stride 3.
    let wide = values(4, 3, 9);
    let strided: BTreeMap<usize, Array1<f32>> =
        [(2usize, wide.column(1).to_owned())].into_iter().collect();
    let column = wide.column(1);
    assert_ne!(column.strides(), [1]);
    let contiguous: BTreeMap<usize, Array1<f32>> = [(2usize, Array1::from(column.to_vec()))]
        .into_iter()
        .collect();
    for partition in [Partition::Token, Partition::Encoding] {
        let mut a = PartitionedTable::new(dense.view(), &slots, partition, 2).unwrap();
        let mut b = PartitionedTable::new(dense.view(), &slots, partition, 2).unwrap();
        a.apply_gradients(&strided, &opt).unwrap();
        b.apply_gradients(&contiguous, &opt).unwrap();
        assert_eq!(a.to_dense(0).unwrap(), b.to_dense(0).unwrap());
        assert_ne!(a.to_dense(0).unwrap(), dense);
    }
}

#[test]
fn bad_rows_and_replicas_are_errors() {
    let dense = values(5, 4, 1);
    let stacked = StackedTable {
        stack: "s".into(),
        num_shards: 1,
        rows_per_shard: 5,
        dim: 4,
        data: dense.clone(),
    };
    let slots = Slots::new(&stacked, &Optimizer::Sgd { lr: 0.1 });
    assert!(PartitionedTable::new(dense.view(), &slots, Partition::Token, 0).is_err());
    let t = PartitionedTable::new(dense.view(), &slots, Partition::Encoding, 3).unwrap();
    let e = t.row(5).unwrap_err();
    assert!(e.to_string().contains("row 5"), "{e}");
}

#[test]
fn device_operands_are_their_shards_sparsecore_major() {
    // 4 shards of 3 rows, S = 2: device 1 holds shards 2 and 3.
    let data = Array2::from_shape_fn((12, 2), |(r, c)| (r * 10 + c) as f32);
    let t = StackedTable {
        stack: "s".into(),
        num_shards: 4,
        rows_per_shard: 3,
        dim: 2,
        data,
    };
    let dev1 = t.device(1, 2).unwrap();
    assert_eq!(dev1.nrows(), 6);
    assert_eq!(dev1.row(0), t.shard(2).unwrap().row(0));
    assert_eq!(dev1.row(5), t.shard(3).unwrap().row(2));
    assert_eq!(dev1.row(5).to_vec(), [110.0, 111.0]);
    assert_eq!(t.shard(3).unwrap().row(2).to_vec(), [110.0, 111.0]);
}

// Regression: an out-of-range device, shard or array panicked (ndarray's slice or index
// bounds) where every other entry point returns an error.
#[test]
fn out_of_range_devices_shards_and_arrays_are_errors() {
    use sparsecore_kernel::KernelError;
    // 4 shards of 3 rows.
    let data = Array2::from_shape_fn((12, 2), |(r, c)| (r * 10 + c) as f32);
    let t = StackedTable {
        stack: "s".into(),
        num_shards: 4,
        rows_per_shard: 3,
        dim: 2,
        data,
    };
    let e = t.device(1, 4).unwrap_err();
    assert!(
        matches!(&e, KernelError::Parameter { name: "device", value, .. } if value == "1"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "invalid option `device` = 1: must be below the 1 devices of stack `s` (4 shards, 4 per device)");
    let e = t.device(2, 2).unwrap_err();
    assert_eq!(e.to_string(), "invalid option `device` = 2: must be below the 2 devices of stack `s` (4 shards, 2 per device)");
    let e = t.device(0, 3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid option `sc_per_device` = 3: must divide the 4 shards of stack `s` (N = G · S)"
    );
    let e = t.device(0, 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid option `sc_per_device` = 0: must divide the 4 shards of stack `s` (N = G · S)"
    );
    let e = t.shard(4).unwrap_err();
    assert!(
        matches!(&e, KernelError::Parameter { name: "shard", value, .. } if value == "4"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "invalid option `shard` = 4: must be below the 4 shards of stack `s`"
    );
    assert_eq!(t.device(3, 1).unwrap().row(2).to_vec(), [110.0, 111.0]);
    // Public fields set by hand: data of 8 rows where 4 shards of 3 need 12.
    let short = StackedTable {
        data: Array2::zeros((8, 2)),
        ..t.clone()
    };
    assert_eq!(short.shard(1).unwrap().nrows(), 3);
    let e = short.shard(2).unwrap_err();
    assert_eq!(e.to_string(), "stack `s`: invalid input: stacked table data of 8 rows, fewer than N · R = 4 · 3 (shards 2..3)");
    let e = short.device(1, 2).unwrap_err();
    assert_eq!(e.to_string(), "stack `s`: invalid input: stacked table data of 8 rows, fewer than N · R = 4 · 3 (shards 2..4)");

    // A table split without slot variables holds array 0 only; with Adagrad's, arrays 0 and 1.
    let dense = Array2::from_shape_fn((3, 2), |(r, c)| (r * 10 + c) as f32);
    let stacked = StackedTable {
        stack: "s".into(),
        num_shards: 1,
        rows_per_shard: 3,
        dim: 2,
        data: dense.clone(),
    };
    let cases = [
        (Optimizer::Sgd { lr: 0.1 }, 1usize, "invalid option `array` = 1: must be 0 (the table): the table was split without slot variables"),
        (Optimizer::Adagrad { lr: 0.1 }, 2, "invalid option `array` = 2: must be below 2: 0 is the table, 1..=1 its slot variables"),
    ];
    for (opt, arrays, message) in cases {
        let slots = Slots::new(&stacked, &opt);
        for partition in [Partition::Token, Partition::Encoding] {
            let p = PartitionedTable::new(dense.view(), &slots, partition, 2).unwrap();
            assert_eq!(p.to_dense(0).unwrap().row(2).to_vec(), [20.0, 21.0]);
            let e = p.to_dense(arrays).unwrap_err();
            assert!(
                matches!(&e, KernelError::Parameter { name: "array", .. }),
                "{e:?}"
            );
            assert_eq!(e.to_string(), message, "{partition:?}");
        }
    }
}

#[test]
fn missing_slots_and_bad_gradients_are_errors_that_change_nothing() {
    let dense = values(5, 4, 2);
    let stacked = StackedTable {
        stack: "s".into(),
        num_shards: 1,
        rows_per_shard: 5,
        dim: 4,
        data: dense.clone(),
    };
    // Split with SGD's slots (none), then stepped with Adagrad (needs its accumulator): an
    // error, not an index panic.
    let sgd_slots = Slots::new(&stacked, &Optimizer::Sgd { lr: 0.1 });
    for partition in [Partition::Token, Partition::Encoding] {
        let mut t = PartitionedTable::new(dense.view(), &sgd_slots, partition, 2).unwrap();
        let before = t.clone();
        let grads: BTreeMap<usize, Array1<f32>> = [(1, Array1::ones(4))].into();
        let e = t
            .apply_gradients(&grads, &Optimizer::Adagrad { lr: 0.1 })
            .unwrap_err();
        assert!(
            e.to_string().contains("host table") && e.to_string().contains("accumulator"),
            "{e}"
        );
        let e = t
            .apply_gradients(&grads, &Optimizer::Sgd { lr: f32::NAN })
            .unwrap_err();
        assert!(e.to_string().contains("lr = NaN"), "{e}");
        // A bad row after a good one: nothing is applied, not even the good row.
        let bad: BTreeMap<usize, Array1<f32>> = [(1, Array1::ones(4)), (7, Array1::ones(4))].into();
        let e = t
            .apply_gradients(&bad, &Optimizer::Sgd { lr: 0.1 })
            .unwrap_err();
        assert!(e.to_string().contains("row 7"), "{e}");
        let short: BTreeMap<usize, Array1<f32>> =
            [(0, Array1::ones(4)), (2, Array1::ones(3))].into();
        let e = t
            .apply_gradients(&short, &Optimizer::Sgd { lr: 0.1 })
            .unwrap_err();
        assert!(e.to_string().contains("length 3"), "{e}");
        assert_eq!(t, before);
        t.apply_gradients(&grads, &Optimizer::Sgd { lr: 0.5 })
            .unwrap();
        assert_eq!(t.row(1).unwrap(), &dense.row(1) - 0.5);
    }
}
