//! Regressions found by code review: each reproduces a defect that is now fixed.

use sparsecore_prep::input::{FeatureView, Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::{Config, Error, Output, Preprocessor};

/// A hand-written source whose view and `has_weights()` can disagree.
struct Custom<'a> {
    samples: usize,
    weighted: bool,
    ids: &'a [i32],
    splits: &'a [i32],
    w: Option<&'a [f32]>,
}

impl SampleSource for Custom<'_> {
    fn num_samples(&self) -> usize {
        self.samples
    }
    fn has_weights(&self) -> bool {
        self.weighted
    }
    fn view(&self) -> FeatureView<'_> {
        FeatureView::Ragged {
            ids: Ids::I32(self.ids),
            offsets: Offsets::I32(self.splits),
            weights: self.w.map(|w| (w, Offsets::I32(self.splits))),
        }
    }
}

fn cfg(combiner: &str, validate: bool, two: bool) -> Config {
    let feats = if two {
        r#"[{"name":"a","table":"t0"},{"name":"b","table":"t0"}]"#
    } else {
        r#"[{"name":"f0","table":"t0"}]"#
    };
    Config::from_json(&format!(
        r#"{{"config":{{"local_device_count":1,"global_device_count":1,"num_sc_per_device":1,"validate_ids":{validate}}},
      "tables":[{{"name":"t0","vocabulary_size":64,"embedding_dim":8,"combiner":"{combiner}","max_ids_per_partition":64,"max_unique_ids_per_partition":64}}],
      "features":{feats}}}"#
    ))
    .unwrap()
}

#[test]
fn a_view_with_weights_must_say_so() {
    let (ids, splits, w) = ([1, 2, 3, 4], [0, 4, 4, 4], [1.0f32; 4]);
    for comb in ["sum", "mean"] {
        let bad = Custom {
            samples: 3,
            weighted: false,
            ids: &ids,
            splits: &splits,
            w: Some(&w),
        };
        let mut p = Preprocessor::builder(cfg(comb, true, false))
            .threads(1)
            .build()
            .unwrap();
        let e = p.run_new(&[&bad]).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
        assert!(e.to_string().contains("has_weights"), "{e}");
    }
}

#[test]
fn packed_weighted_keys_keep_extraction_order_when_rows_do_not() {
    // Global sizes [1, 4] make feature b's rows overlap feature a's: rows arrive out of order.
    // The packed layout (ids checked) must order a column's entries by extraction index, like
    // the reference's index payload (ids unchecked).
    let (ai, asp, aw) = (vec![5i32], vec![0i32, 0, 0, 0, 1], vec![2.0f32]);
    let (bi, bsp, bw) = (vec![5i32], vec![0i32, 1, 1, 1, 1], vec![3.0f32]);
    let a = RaggedInput::from_i32("a", &ai, &asp)
        .unwrap()
        .with_weights("a", &aw)
        .unwrap();
    let b = RaggedInput::from_i32("b", &bi, &bsp)
        .unwrap()
        .with_weights("b", &bw)
        .unwrap();
    let mut outs = vec![];
    for validate in [true, false] {
        let mut p = Preprocessor::builder(cfg("sum", validate, true))
            .global_batch_sizes(vec![1, 4])
            .threads(1)
            .build()
            .unwrap();
        let o = p.run_new(&[&a, &b]).unwrap();
        let s = &o.stacks[0];
        outs.push((
            s.sample_ids.clone(),
            s.gains.iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
        ));
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(
        &outs[0].0[..2],
        &[3, 1],
        "extraction order: a's row 3 first, then b's row 1"
    );
}

#[test]
fn stats_only_outputs_have_empty_buffers_not_panics() {
    let ids: Vec<i32> = (0..8).collect();
    let splits: Vec<i32> = (0..=8).collect();
    let f = RaggedInput::from_i32("f0", &ids, &splits).unwrap();
    let mut p = Preprocessor::builder(cfg("sum", true, false))
        .threads(1)
        .build()
        .unwrap();
    let mut out = Output::new();
    p.run_stats(&[&f], &mut out).unwrap();
    let s = &out.stacks[0];
    assert_eq!(s.coo_buffer_size_per_device(), 0);
    assert_eq!(s.row_pointers_2d().len(), 0);
    assert_eq!(s.embedding_ids_2d().len(), 0);
    let plan = p.plan().unwrap().clone();
    let t = ndarray::Array2::<f32>::zeros((64, 8));
    let table = sparsecore_kernel::StackedTable::from_tables(&plan, "t0", &[t.view()]).unwrap();
    let e = sparsecore_kernel::sparse_dense_matmul(&plan, s, 1, &table).unwrap_err();
    assert!(e.to_string().contains("stats-only"), "{e}");
}

#[test]
fn huge_batch_numbers_wrap_their_sync_keys() {
    let c = Config::from_json(
        r#"{"config":{"local_device_count":1,"global_device_count":1,"num_sc_per_device":1,"enable_minibatching":true},
      "tables":[{"name":"t0","vocabulary_size":64,"embedding_dim":8,"max_ids_per_partition":4,"max_unique_ids_per_partition":4}],
      "features":[{"name":"f0","table":"t0"}]}"#,
    )
    .unwrap();
    let ids: Vec<i32> = (0..8).collect();
    let splits: Vec<i32> = vec![0, 8, 8, 8, 8];
    let f = RaggedInput::from_i32("f0", &ids, &splits).unwrap();
    let mut p = Preprocessor::builder(c).threads(1).build().unwrap();
    p.set_batch_number(u64::MAX / 2 + 1);
    let out = p.run_new(&[&f]).unwrap();
    assert!(out.num_minibatches > 1);
}

#[test]
fn npy_shapes_that_overflow_are_errors() {
    let mut header = String::from(
        "{'descr': '<i8', 'fortran_order': False, 'shape': (4611686018427387904, 8), }",
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0u8; 64]);
    let e = sparsecore_prep::fdo::npz::decode_npy(&b, "x.npy").unwrap_err();
    assert!(
        e.to_string().contains("x.npy") && e.to_string().contains("too large"),
        "{e}"
    );
}
