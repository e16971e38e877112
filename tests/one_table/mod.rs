//! The brief's one-table config and the helpers the error tests share
//! (`tests/errors/errors.rs`, `tests/errors/hostile.rs`): building it, asserting an error and
//! its message, the good ragged batch, byte equality of two outputs, a hand-written
//! `SampleSource`, and Arrow record batches.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

use arrow_array::{ArrayRef, RecordBatch};
use serde_json::{json, Value};

use sparsecore_prep::input::{DenseIds, FeatureView, SampleSource};
use sparsecore_prep::{Config, Error, Output, Preprocessor};

/// The brief's config: L = 1, G = 1, S = 4 (N = 4), one table `t0` (vocab 1000, limits 16) and
/// one feature `f0`.
pub fn base() -> Value {
    json!({
        "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4,
                   "allow_id_dropping": false, "stacking": "feature"},
        "tables": [{"name": "t0", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "sum",
                    "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16,
                    "suggested_coo_buffer_size_per_device": null}],
        "features": [{"name": "f0", "table": "t0"}]
    })
}

/// The base config, patched by `f`.
pub fn config_with(f: impl FnOnce(&mut Value)) -> Config {
    let mut v = base();
    f(&mut v);
    Config::from_json(&v.to_string()).expect("test config parses")
}

pub fn config() -> Config {
    config_with(|_| {})
}

pub fn prep(cfg: Config) -> Preprocessor {
    Preprocessor::new(cfg).unwrap_or_else(|e| panic!("building the preprocessor failed: {e}"))
}

/// The error of a `Result` whose `Ok` type need not be `Debug`.
#[track_caller]
pub fn err<T>(r: Result<T, Error>) -> Error {
    match r {
        Ok(_) => panic!("expected an error, got Ok"),
        Err(e) => e,
    }
}

/// Asserts that `e`'s Display message contains every part.
#[track_caller]
pub fn assert_msg(e: &Error, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not contain {p:?}");
    }
}

/// Flat values and row splits of ragged rows.
pub fn ragged(rows: &[Vec<i32>]) -> (Vec<i32>, Vec<i32>) {
    let mut splits = vec![0i32];
    for r in rows {
        splits.push(splits.last().unwrap() + r.len() as i32);
    }
    (rows.concat(), splits)
}

/// The brief's valid batch: 8 samples, sample r holds ids [r, r + 100].
pub fn good_rows() -> Vec<Vec<i32>> {
    (0..8).map(|r| vec![r, r + 100]).collect()
}

/// Asserts two outputs are identical, comparing gains by bits (padding gains are NaN, so
/// `Output: PartialEq` never holds for a filled output).
#[track_caller]
pub fn assert_same_output(a: &Output, b: &Output) {
    assert_eq!(a.num_minibatches, b.num_minibatches);
    assert_eq!(a.stacks.len(), b.stacks.len());
    for (x, y) in a.stacks.iter().zip(&b.stacks) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.row_pointers, y.row_pointers, "{}: row_pointers", x.name);
        assert_eq!(
            x.embedding_ids, y.embedding_ids,
            "{}: embedding_ids",
            x.name
        );
        assert_eq!(x.sample_ids, y.sample_ids, "{}: sample_ids", x.name);
        let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.gains), bits(&y.gains), "{}: gains", x.name);
        assert_eq!(x.stats, y.stats, "{}: stats", x.name);
        assert_eq!(
            x.coo_buffer_size_per_device(),
            y.coo_buffer_size_per_device()
        );
        assert_eq!(x.row_pointers_per_device(), y.row_pointers_per_device());
    }
}

/// A hand-written `SampleSource` that hands out whatever view it was given, bypassing the
/// constructors' checks, and counts how often its view was asked for.
pub struct Custom<'a> {
    pub samples: usize,
    pub weighted: bool,
    pub view: FeatureView<'a>,
    pub views: AtomicUsize,
}

impl<'a> Custom<'a> {
    pub fn new(samples: usize, weighted: bool, view: FeatureView<'a>) -> Self {
        Custom {
            samples,
            weighted,
            view,
            views: AtomicUsize::new(0),
        }
    }
}

impl SampleSource for Custom<'_> {
    fn num_samples(&self) -> usize {
        self.samples
    }
    fn has_weights(&self) -> bool {
        self.weighted
    }
    fn view(&self) -> FeatureView<'_> {
        self.views.fetch_add(1, Ordering::Relaxed);
        // `FeatureView` is invariant in its lifetime: rebuild it from its covariant parts.
        match &self.view {
            FeatureView::Ragged {
                ids,
                offsets,
                weights,
            } => FeatureView::Ragged {
                ids: *ids,
                offsets: *offsets,
                weights: *weights,
            },
            FeatureView::Dense { ids, weights } => FeatureView::Dense {
                ids: match ids {
                    DenseIds::I32(a) => DenseIds::I32(a.view()),
                    DenseIds::I64(a) => DenseIds::I64(a.view()),
                },
                weights: weights.as_ref().map(|w| w.view()),
            },
            FeatureView::Coo { indices, ids } => FeatureView::Coo { indices, ids: *ids },
        }
    }
}

/// Rows as the all-valid nested options Arrow's list builders take.
pub fn some_rows<T: Copy>(rows: &[Vec<T>]) -> Vec<Option<Vec<Option<T>>>> {
    rows.iter()
        .map(|r| Some(r.iter().map(|&v| Some(v)).collect()))
        .collect()
}

pub fn record_batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    RecordBatch::try_from_iter(columns).expect("record batch")
}
