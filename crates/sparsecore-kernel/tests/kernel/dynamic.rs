//! Dynamic tables, in-memory backend, and the training path over them: lazy deterministic
//! initialisation (pinned), optimizer slots beside each row, atomic exactly-once updates under
//! concurrent threads (checked against a sequential replay), export/import, and raw keys →
//! unique keys → rows → activations (and back), cross-checked against the SparseCore path.

use crate::reference;

use std::sync::Arc;

use arrow_array::builder::{Float32Builder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use ndarray::{array, Array2};

use sparsecore_kernel::dynamic::{
    dynamic_backward, dynamic_forward, splitmix64, Applied, DynamicTable, DynamicTableSpec, Entry,
    Initializer, KeyBatch, LoadStream, MemoryTable, Snapshot,
};
use sparsecore_kernel::KernelError;
use sparsecore_kernel::{feature_activations, sparse_dense_matmul, Optimizer, StackedTable};
use sparsecore_prep::input::hash::hash_bytes;
use sparsecore_prep::spec::Combiner;
use sparsecore_prep::{Config, Output, Preprocessor};

const ADAGRAD: Optimizer = Optimizer::Adagrad { lr: 0.05 };
const UNIFORM: Initializer = Initializer::Uniform {
    scale: 0.5,
    seed: 42,
};

fn table(dim: usize, optimizer: &Optimizer) -> MemoryTable {
    MemoryTable::new(DynamicTableSpec::new("emb", dim, optimizer, UNIFORM).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The initializer's formula, transcribed independently in Python (plain integers and
/// `struct.pack('<f')` for the one f32 rounding) from its documentation; SplitMix64 itself
/// checked against `java.util.SplittableRandom(0).nextLong()`.
#[test]
fn initializer_is_pinned() {
    assert_eq!(splitmix64(0), 0xe220a8397b1dcdaf);
    let cases: [(u64, u64, f32, [u32; 4]); 3] = [
        (
            0x0123456789abcdef,
            42,
            0.5,
            [0x3d036b00, 0x3d2c2500, 0xbe25e0a8, 0x3e22d434],
        ),
        (0, 0, 1.0, [0x3e9c1b74, 0xbf2ace16, 0x3ca1db80, 0x3f737e22]),
        (
            u64::MAX,
            7,
            0.05,
            [0x3cc14257, 0x3d1757bf, 0x3cf89ae7, 0x3bbc2af3],
        ),
    ];
    for (key, seed, scale, want) in cases {
        let mut row = [0f32; 4];
        Initializer::Uniform { scale, seed }.init_row(key, &mut row);
        assert_eq!(bits(&row), want, "key {key:#x} seed {seed}");
    }
    let mut row = [0f32; 3];
    Initializer::Constant(0.25).init_row(9, &mut row);
    assert_eq!(row, [0.25; 3]);
}

#[test]
fn rows_are_created_lazily_and_deterministically_with_their_slots() {
    let a = table(4, &ADAGRAD);
    let b = table(4, &ADAGRAD);
    assert!(a.is_empty());
    let keys = [0x0123456789abcdef, 5, 5, 77];
    let rows = a.lookup(&keys).unwrap();
    assert_eq!(a.len(), 3, "a repeated key is created once");
    assert_eq!(
        bits(rows.row(0).as_slice().unwrap()),
        [0x3d036b00, 0x3d2c2500, 0xbe25e0a8, 0x3e22d434]
    );
    assert_eq!(rows.row(1), rows.row(2));
    assert_ne!(rows.row(1), rows.row(3));
    assert!(rows.iter().all(|v| v.abs() <= 0.5));
    // Another table, keys in another order: the same rows.
    let again = b.lookup(&[77, 5, 0x0123456789abcdef]).unwrap();
    assert_eq!(again.row(0), rows.row(3));
    assert_eq!(again.row(2), rows.row(0));
    // A second lookup returns the stored row, not a new one.
    assert_eq!(a.lookup(&[5]).unwrap().row(0), rows.row(1));
    // Slots start at the optimizer's initial values.
    let snap = a.export().unwrap();
    assert_eq!(snap.entries[&5].slots, vec![vec![0.1f32; 4]]);
    let adam = table(
        2,
        &Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 0,
        },
    );
    adam.lookup(&[1]).unwrap();
    assert_eq!(
        adam.export().unwrap().entries[&1].slots,
        vec![vec![0.0; 2], vec![0.0; 2]]
    );
    assert_eq!(adam.spec().slot_names, ["m", "v"]);
}

#[test]
fn sgd_step_by_hand() {
    let t = MemoryTable::new(
        DynamicTableSpec::new(
            "t",
            2,
            &Optimizer::Sgd { lr: 0.5 },
            Initializer::Constant(1.0),
        )
        .unwrap(),
    );
    // Key 3 is created by the update itself.
    t.apply_gradients(
        &[3, 4],
        &[0.25, -0.5, 1.0, 0.0],
        &Optimizer::Sgd { lr: 0.5 },
    )
    .unwrap();
    let snap = t.export().unwrap();
    assert_eq!(snap.entries[&3].row, [0.875, 1.25]);
    assert_eq!(snap.entries[&4].row, [0.5, 1.0]);
}

/// Each optimizer's two steps on dynamic rows (one made by a lookup, two by the update itself)
/// equal two steps of the independent f64 reference (tests/reference) from the pinned initial
/// row and the reference's initial slots, row and every slot within the tolerance of f32
/// arithmetic: the slots are stored beside each row, read back and updated once per key.
#[test]
fn every_optimizer_updates_row_and_slots_once_per_key() {
    let optimizers = [
        Optimizer::Sgd { lr: 0.1 },
        Optimizer::Adagrad { lr: 0.1 },
        Optimizer::AdagradMomentum {
            lr: 0.1,
            momentum: 0.9,
            beta2: 1.0,
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
            l2: 0.02,
            beta: 0.0,
            multiply_linear_by_lr: false,
        },
        Optimizer::Laprop {
            lr: 0.1,
            b1: 0.9,
            b2: 0.95,
            eps: 1e-30,
            step: Some(2),
        },
    ];
    let dim = 3;
    for opt in optimizers {
        let t = table(dim, &opt);
        let keys = [11u64, 22, 33];
        let grads: Vec<f32> = (0..9).map(|i| (i as f32 - 4.0) / 8.0).collect();
        t.get_or_init(&keys[..1], &mut [0.0; 3]).unwrap();
        for _ in 0..2 {
            t.apply_gradients(&keys, &grads, &opt).unwrap();
        }
        let snap = t.export().unwrap();
        for (i, &k) in keys.iter().enumerate() {
            // The initializer's row (not what this test checks: `initializer_is_pinned` pins its
            // values on other keys), then two reference steps.
            let mut row = [0f32; 3];
            UNIFORM.init_row(k, &mut row);
            let mut w: Vec<f64> = row.iter().map(|&x| f64::from(x)).collect();
            let mut slots = reference::initial_slots(&opt, dim);
            let g: Vec<f64> = grads[i * dim..(i + 1) * dim]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            // The larger of the two steps' scales (each value's terms' magnitudes).
            let mut scales = reference::step(&opt, &g, &mut w, &mut slots);
            for (a, b) in scales.iter_mut().flatten().zip(
                reference::step(&opt, &g, &mut w, &mut slots)
                    .iter()
                    .flatten(),
            ) {
                *a = a.max(*b);
            }
            let got = &snap.entries[&k];
            assert_eq!(got.slots.len(), slots.len(), "{opt:?} key {k}: slot count");
            let pairs = std::iter::once((&got.row, &w)).chain(got.slots.iter().zip(&slots));
            for (v, ((got, want), scale)) in pairs.zip(&scales).enumerate() {
                for c in 0..dim {
                    // Relative 1e-5 of the scale (a few f32 roundings per step; Adam's f32 bias
                    // correction loses 3e-6 of its step), absolute 1e-9 at 0.
                    let what = format!("{opt:?} key {k} value {v} col {c}");
                    assert!(
                        reference::near_scaled(got[c], want[c], scale[c], 1e-5, 1e-9),
                        "{what}: {} vs {} (scale {})",
                        got[c],
                        want[c],
                        scale[c]
                    );
                }
            }
        }
    }
}

#[test]
fn tagged_updates_apply_exactly_once_in_journal_order() {
    let t = table(2, &ADAGRAD);
    assert_eq!(
        t.apply_update(Some(7), &[1, 2], &[0.5; 4], &ADAGRAD)
            .unwrap(),
        Applied::Now
    );
    let after_one = t.export().unwrap();
    assert_eq!(
        t.apply_update(Some(7), &[1, 2], &[0.5; 4], &ADAGRAD)
            .unwrap(),
        Applied::Already
    );
    assert!(
        t.export().unwrap().bits_eq(&after_one),
        "a replayed update changes nothing"
    );
    t.apply_update(Some(3), &[2], &[0.5; 2], &ADAGRAD).unwrap();
    t.apply_update(None, &[2], &[0.5; 2], &ADAGRAD).unwrap();
    assert_eq!(t.applied_updates().unwrap(), [7, 3]);
    t.clear().unwrap();
    assert!(t.is_empty() && t.applied_updates().unwrap().is_empty());
}

#[test]
fn bad_updates_are_errors_that_name_the_table() {
    let t = table(2, &ADAGRAD);
    let e = t.apply_gradients(&[1, 1], &[0.0; 4], &ADAGRAD).unwrap_err();
    assert!(
        matches!(e, KernelError::InvalidInput { .. })
            && e.to_string().contains("emb")
            && e.to_string().contains("twice"),
        "{e}"
    );
    let e = t.apply_gradients(&[1, 2], &[0.0; 3], &ADAGRAD).unwrap_err();
    assert!(
        e.to_string()
            .contains("3 gradient values for 2 keys of dim 2"),
        "{e}"
    );
    let e = t
        .apply_gradients(&[1], &[0.0; 2], &Optimizer::Sgd { lr: 0.1 })
        .unwrap_err();
    assert!(
        e.to_string().contains("emb") && e.to_string().contains("accumulator"),
        "{e}"
    );
    let e = t
        .apply_gradients(&[1], &[0.0; 2], &Optimizer::Adagrad { lr: f32::NAN })
        .unwrap_err();
    assert!(e.to_string().contains("lr"), "{e}");
    assert!(t.is_empty(), "failed updates create nothing");
    let e = t.get_or_init(&[1, 2], &mut [0.0; 3]).unwrap_err();
    assert!(e.to_string().contains("3 values for 2 keys"), "{e}");
    for name in ["", "a:b", "a b", "t*"] {
        assert!(
            DynamicTableSpec::new(name, 2, &ADAGRAD, UNIFORM).is_err(),
            "{name:?}"
        );
    }
    assert!(DynamicTableSpec::new("t", 0, &ADAGRAD, UNIFORM).is_err());
    assert!(DynamicTableSpec::new("t", 2, &ADAGRAD, Initializer::Constant(f32::INFINITY)).is_err());
    let mut bad = Snapshot::default();
    bad.entries.insert(
        1,
        Entry {
            row: vec![0.0; 2],
            slots: vec![],
        },
    );
    assert!(t.import(&bad).unwrap_err().to_string().contains("0 slots"));
}

#[test]
fn export_import_round_trips() {
    let t = table(3, &ADAGRAD);
    let s = LoadStream {
        seed: 1,
        keys_per_batch: 20,
        key_space: 50,
        lookups_per_batch: 5,
        dim: 3,
    };
    for id in 0..5 {
        t.get_or_init(&s.lookups(id), &mut [0.0; 15]).unwrap();
        let (keys, grads) = s.update(id);
        t.apply_gradients(&keys, &grads, &ADAGRAD).unwrap();
    }
    let snap = t.export().unwrap();
    let copy = table(3, &ADAGRAD);
    copy.import(&snap).unwrap();
    assert!(copy.export().unwrap().bits_eq(&snap));
    assert_eq!(copy.len(), snap.entries.len());
}

/// Sequential replay of a journal on a fresh in-memory table.
fn replay(stream: &LoadStream, journal: &[u64], opt: &Optimizer) -> Snapshot {
    let t = table(stream.dim, opt);
    for &id in journal {
        let lookups = stream.lookups(id);
        t.get_or_init(&lookups, &mut vec![0.0; lookups.len() * stream.dim])
            .unwrap();
        let (keys, grads) = stream.update(id);
        assert_eq!(
            t.apply_update(Some(id), &keys, &grads, opt).unwrap(),
            Applied::Now
        );
    }
    t.export().unwrap()
}

/// Four threads update overlapping keys at once; the table equals a sequential replay of its
/// journal, which holds every update exactly once.
#[test]
fn concurrent_threads_equal_sequential_replay() {
    let stream = LoadStream {
        seed: 9,
        keys_per_batch: 32,
        key_space: 64,
        lookups_per_batch: 16,
        dim: 4,
    };
    let t = Arc::new(table(4, &ADAGRAD));
    std::thread::scope(|scope| {
        for w in 0..4u64 {
            let t = t.clone();
            scope.spawn(move || {
                for i in 0..50u64 {
                    let id = w << 32 | i;
                    let lookups = stream.lookups(id);
                    t.get_or_init(&lookups, &mut vec![0.0; lookups.len() * 4])
                        .unwrap();
                    let (keys, grads) = stream.update(id);
                    t.apply_update(Some(id), &keys, &grads, &ADAGRAD).unwrap();
                }
            });
        }
    });
    let journal = t.applied_updates().unwrap();
    let mut sorted = journal.clone();
    sorted.sort_unstable();
    let all: Vec<u64> = (0..4u64)
        .flat_map(|w| (0..50).map(move |i| w << 32 | i))
        .collect();
    assert_eq!(sorted, all, "every update exactly once");
    let want = replay(&stream, &journal, &ADAGRAD);
    let got = t.export().unwrap();
    assert!(
        got.bits_eq(&want),
        "first difference at key {:?}",
        got.first_difference(&want)
    );
}

/// A hand-computed forward and backward pass: mean combiner with weights, a repeated key.
#[test]
fn forward_and_backward_by_hand() {
    let sgd = Optimizer::Sgd { lr: 1.0 };
    let t =
        MemoryTable::new(DynamicTableSpec::new("t", 2, &sgd, Initializer::Constant(0.0)).unwrap());
    let mut snap = Snapshot::default();
    snap.entries.insert(
        10,
        Entry {
            row: vec![1.0, 2.0],
            slots: vec![],
        },
    );
    snap.entries.insert(
        20,
        Entry {
            row: vec![-4.0, 0.5],
            slots: vec![],
        },
    );
    t.import(&snap).unwrap();
    // Sample 0: keys 10 (w 1), 20 (w 3); sample 1: key 10 twice (w 2, 2); sample 2: empty;
    // sample 3: new key 30 (w 1).
    let keys = [10u64, 20, 10, 10, 30];
    let batch = KeyBatch::new(
        "f",
        &keys,
        &[0, 2, 4, 4, 5],
        Some(&[1.0, 3.0, 2.0, 2.0, 1.0]),
        Combiner::Mean,
    )
    .unwrap();
    assert_eq!(batch.unique, [10, 20, 30]);
    assert_eq!(batch.index, [0, 1, 0, 0, 2]);
    assert_eq!(batch.gains, [0.25, 0.75, 0.5, 0.5, 1.0]);
    let act = dynamic_forward(&t, &batch).unwrap();
    assert_eq!(
        act,
        array![
            [0.25 - 3.0, 0.5 + 0.375],
            [1.0, 2.0],
            [0.0, 0.0],
            [0.0, 0.0]
        ]
    );
    let dact = array![[1.0f32, 2.0], [4.0, -8.0], [100.0, 100.0], [0.5, 0.5]];
    assert_eq!(
        dynamic_backward(&t, &batch, dact.view(), &sgd, Some(1)).unwrap(),
        Applied::Now
    );
    let snap = t.export().unwrap();
    // Key 10: 0.25·[1, 2] + 0.5·[4, −8] + 0.5·[4, −8] = [4.25, −7.5].
    assert_eq!(snap.entries[&10].row, [1.0 - 4.25, 2.0 + 7.5]);
    assert_eq!(snap.entries[&20].row, [-4.0 - 0.75, 0.5 - 1.5]);
    assert_eq!(snap.entries[&30].row, [-0.5, -0.5]);
    // sqrtn and sum gains, unweighted.
    let b = KeyBatch::new("f", &keys, &[0, 2, 4, 4, 5], None, Combiner::Sqrtn).unwrap();
    assert_eq!(b.gains[0], 1.0 / 2f32.sqrt());
    assert_eq!(
        KeyBatch::new("f", &keys, &[0, 5], None, Combiner::Sum)
            .unwrap()
            .gains,
        [1.0; 5]
    );
    assert!(KeyBatch::new("f", &keys, &[0, 6], None, Combiner::Sum).is_err());
    assert!(KeyBatch::new(
        "f",
        &keys,
        &[0, 5],
        Some(&[1.0, f32::NAN, 1.0, 1.0, 1.0]),
        Combiner::Sum
    )
    .is_err());
    let e = dynamic_backward(&t, &batch, Array2::zeros((3, 2)).view(), &sgd, None).unwrap_err();
    assert!(e.to_string().contains("[4, 2]"), "{e}");
    // A batch assembled by hand is checked, not trusted.
    let mut bad = batch.clone();
    bad.index[4] = 3;
    let e = dynamic_forward(&t, &bad).unwrap_err();
    assert!(
        e.to_string()
            .contains("index 3 is outside its 3 unique keys"),
        "{e}"
    );
    let mut bad = batch.clone();
    bad.gains.pop();
    assert!(dynamic_backward(&t, &bad, dact.view(), &sgd, None)
        .unwrap_err()
        .to_string()
        .contains("4 gains for 5 ids"));
}

fn string_batch(rows: &[&[(&str, f32)]]) -> RecordBatch {
    let mut k = ListBuilder::new(StringBuilder::new());
    let mut w = ListBuilder::new(Float32Builder::new());
    for row in rows {
        for &(key, weight) in *row {
            k.values().append_value(key);
            w.values().append_value(weight);
        }
        k.append(true);
        w.append(true);
    }
    RecordBatch::try_from_iter([
        ("f0", Arc::new(k.finish()) as ArrayRef),
        ("f0_w", Arc::new(w.finish()) as ArrayRef),
    ])
    .unwrap()
}

/// Raw string keys through the dynamic path give the activations the SparseCore path gives for
/// the same rows placed at the hashed ids (`key mod vocabulary_size`) of a static table.
#[test]
fn raw_keys_forward_equals_the_sparsecore_path() {
    const V: u64 = 1 << 14;
    let rows: Vec<Vec<(String, f32)>> = (0..16)
        .map(|r| {
            (0..(r % 5))
                .map(|j| {
                    (
                        format!("{:08x}", (r * 7 + j * 3) % 23),
                        (1 + (r + j) % 4) as f32 * 0.5,
                    )
                })
                .collect()
        })
        .collect();
    let refs: Vec<Vec<(&str, f32)>> = rows
        .iter()
        .map(|r| r.iter().map(|(k, w)| (k.as_str(), *w)).collect())
        .collect();
    let slices: Vec<&[(&str, f32)]> = refs.iter().map(|r| r.as_slice()).collect();
    let batch = string_batch(&slices);
    for combiner in [Combiner::Sum, Combiner::Mean, Combiner::Sqrtn] {
        let t = table(8, &ADAGRAD);
        let kb = KeyBatch::from_arrow(
            "f0",
            "f0",
            batch.column(0).as_ref(),
            Some(("f0_w", batch.column(1).as_ref())),
            2024,
            combiner,
        )
        .unwrap();
        let distinct: std::collections::BTreeSet<&str> =
            rows.iter().flatten().map(|(k, _)| k.as_str()).collect();
        assert_eq!(kb.unique.len(), distinct.len());
        assert_eq!(
            kb.unique[0],
            hash_bytes(format!("{:08x}", 7).as_bytes(), 2024),
            "sample 1's first key"
        );
        let act = dynamic_forward(&t, &kb).unwrap();

        let config = Config::from_json(&format!(
            r#"{{"config": {{"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4}},
                "tables": [{{"name": "t0", "vocabulary_size": {V}, "embedding_dim": 8, "combiner": "{}",
                            "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64}}],
                "features": [{{"name": "f0", "table": "t0", "weights_column": "f0_w", "hash": {{"seed": 2024}}}}]}}"#,
            combiner.as_str()
        ))
        .unwrap();
        let mut static_table = Array2::<f32>::zeros((V as usize, 8));
        let snap = t.export().unwrap();
        let mut ids: Vec<u64> = snap.entries.keys().map(|k| k % V).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            snap.entries.len(),
            "no collisions at this vocabulary"
        );
        for (k, e) in &snap.entries {
            static_table
                .row_mut((k % V) as usize)
                .assign(&ndarray::ArrayView1::from(&e.row));
        }
        let mut prep = Preprocessor::new(config).unwrap();
        let mut out = Output::new();
        prep.run_record_batch(&batch, &mut out).unwrap();
        let plan = prep.plan().unwrap().clone();
        let stacked = StackedTable::from_tables(&plan, "t0", &[static_table.view()]).unwrap();
        let acts =
            sparse_dense_matmul(&plan, &out.stacks[0], out.num_minibatches, &stacked).unwrap();
        let want = feature_activations(&plan, 0, acts[0].view()).unwrap();
        assert_eq!(want.dim(), act.dim());
        for ((i, c), &g) in act.indexed_iter() {
            let w = want[[i, c]];
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{combiner:?} sample {i} col {c}: {g} vs {w}"
            );
        }
    }
}
