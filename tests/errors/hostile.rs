//! Hostile inputs: extreme ids, non-finite and extreme weights, malformed structure, batches at
//! and past every size limit, impossible configs. (`tests/errors/errors.rs` covers every error path
//! once; this file pushes each of them with the values an attacker or a broken loader would
//! send, and checks what the caller is left with.)
//!
//! Every rejected case asserts the exact `Error` variant with its fields and message, and that
//! **no output** was produced. "No output" means, for the caller's reusable [`Output`]:
//!
//! - errors from [`Preprocessor::run`] / `run_stats` / `run_record_batch`: the `Output` is
//!   empty (`stacks` is empty, `num_minibatches == 0`, equal to `Output::new()`), both when it
//!   was fresh and when it held an earlier successful batch (`expect_run_error` checks both,
//!   with one and two worker threads, and that the next good batch is byte-identical to the
//!   same batch on a fresh preprocessor);
//! - errors from input constructors (`RaggedInput::new`, `CooInput::new`, ...) and from
//!   `Preprocessor::new`: there is no input or no preprocessor, so no call can write anything.
//!   For each such structural check, a hand-written `SampleSource` carrying the same malformed
//!   view is also pushed through `run`, which must reject it the same way.
//!
//! Inputs the reference accepts (finite negative / zero-sum / overflowing weights, a batch
//! whose trailing rows no SparseCore reads) are not errors: their outputs are compared bit for
//! bit with the reference's (`testdata/hostile_cases`, made by `make_hostile.py` there and
//! `../shared/peer/run_peer.py --dump`).

use crate::common;
use crate::one_table;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow_array::types::{Float32Type, Int32Type, Int64Type};
use arrow_array::{ArrayRef, LargeListArray, ListArray, RecordBatch};
use ndarray::{Array2, ArrayView2};
use serde_json::{json, Value};

use sparsecore_prep::input::{
    ArrowListInput, CooInput, DenseIds, DenseInput, FeatureView, Ids, Offsets, RaggedInput,
    SampleSource,
};
use sparsecore_prep::spec::{Plan, PAD_GAIN_BITS, PAD_ID};
use sparsecore_prep::{AllReduce, BatchCount, Config, ConfigItem, Error, Output, Preprocessor};
use sparsecore_testkit::case::Case;

use one_table::{
    assert_msg, assert_same_output, base, config, config_with, err, good_rows, prep, ragged,
    record_batch, some_rows, Custom,
};

// ---------------------------------------------------------------------------------------------
// Allocation tracking (per thread, so that tests running in parallel do not see each other)
// ---------------------------------------------------------------------------------------------

struct Tracking;

thread_local! {
    /// Largest successful allocation on this thread since the last `track` started.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    /// Successful allocations on this thread since the last `track` started.
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            note(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            note(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            note(new_size);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Runs `f`; returns its result, the largest allocation and the number of allocations it made
/// on this thread (the thread that sizes the `Output` and plans).
fn track<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    LARGEST.with(|l| l.set(0));
    COUNT.with(|c| c.set(0));
    let r = f();
    (r, LARGEST.with(Cell::get), COUNT.with(Cell::get))
}

const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Helpers (the ones shared with tests/errors/errors.rs are in tests/one_table)
// ---------------------------------------------------------------------------------------------

/// "No output": what every failed call must leave in the caller's `Output`.
#[track_caller]
fn assert_no_output(out: &Output) {
    assert!(
        out.stacks.is_empty(),
        "a failed call left {} stacks in the output",
        out.stacks.len()
    );
    assert_eq!(
        out.num_minibatches, 0,
        "a failed call left num_minibatches set"
    );
    assert!(out.stack("t0").is_none());
    assert_eq!(*out, Output::new());
}

/// The error-state contract for one hostile batch. With one and with two worker threads:
/// the bad batch fails on a fresh `Output` and leaves no output; a good batch then succeeds;
/// the bad batch fails again on that `Output` and leaves no output; and the good batch after
/// it is byte-identical to the good batch on a fresh preprocessor. `check` asserts the error
/// (it sees all four errors, which must therefore agree). `run` runs one batch into an `Output`.
fn expect_error_state<B: ?Sized>(
    cfg: &Config,
    good: &B,
    bad: &B,
    run: impl Fn(&mut Preprocessor, &B, &mut Output) -> Result<(), Error>,
    check: impl Fn(&Error),
) {
    let mut expected = Output::new();
    run(&mut prep(cfg.clone()), good, &mut expected).expect("the good batch runs");
    for threads in [1, 2] {
        let mut p = Preprocessor::builder(cfg.clone())
            .threads(threads)
            .small_batch_ids(0)
            .build()
            .unwrap();
        let mut out = Output::new();
        for _ in 0..2 {
            check(&err(run(&mut p, bad, &mut out)));
            assert_no_output(&out);
            run(&mut p, good, &mut out).unwrap();
            assert_same_output(&out, &expected);
        }
    }
}

/// `expect_error_state` for `Preprocessor::run`.
fn expect_run_error(
    cfg: &Config,
    good: &[&dyn SampleSource],
    bad: &[&dyn SampleSource],
    check: impl Fn(&Error),
) {
    expect_error_state(cfg, good, bad, |p, batch, out| p.run(batch, out), check)
}

/// `expect_error_state` for Arrow record batches.
fn expect_record_batch_error(
    cfg: &Config,
    good: &RecordBatch,
    bad: &RecordBatch,
    check: impl Fn(&Error),
) {
    expect_error_state(
        cfg,
        good,
        bad,
        |p, batch, out| p.run_record_batch(batch, out),
        check,
    )
}

fn list_i32(rows: &[Vec<i32>]) -> ArrayRef {
    Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
        some_rows(rows),
    ))
}

fn large_list_i32(rows: &[Vec<i32>]) -> ArrayRef {
    Arc::new(LargeListArray::from_iter_primitive::<Int32Type, _, _>(
        some_rows(rows),
    ))
}

fn list_i64(rows: &[Vec<i64>]) -> ArrayRef {
    Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
        some_rows(rows),
    ))
}

fn large_list_i64(rows: &[Vec<i64>]) -> ArrayRef {
    Arc::new(LargeListArray::from_iter_primitive::<Int64Type, _, _>(
        some_rows(rows),
    ))
}

fn list_f32(rows: &[Vec<f32>]) -> ArrayRef {
    Arc::new(ListArray::from_iter_primitive::<Float32Type, _, _>(
        some_rows(rows),
    ))
}

// ---------------------------------------------------------------------------------------------
// The good batch, checked against hand-derived values once (SPEC 3.4, 3.8)
// ---------------------------------------------------------------------------------------------

#[test]
fn the_good_batch_is_laid_out_as_the_spec_says() {
    let (v, s) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &v, &s).unwrap();
    let out = prep(config()).run_new(&[&good]).unwrap();
    let t0 = out.stack("t0").unwrap();
    // SparseCore 0 holds samples 0 and 1: ids 0, 100 (partition 0) and 1, 101 (partition 1);
    // partition 1 starts at the next multiple of 8.
    assert_eq!(&t0.row_pointers[..8], &[2, 10, 16, 16, 16, 16, 16, 16]);
    assert_eq!(&t0.embedding_ids[..2], &[0, 25]);
    assert_eq!(&t0.sample_ids[..2], &[0, 0]);
    assert_eq!(&t0.embedding_ids[8..10], &[0, 25]);
    assert_eq!(&t0.sample_ids[8..10], &[1, 1]);
    assert_eq!(out.num_minibatches, 1);
}

// ---------------------------------------------------------------------------------------------
// Ids: i64::MAX, negative, and values that narrow to valid i32 ids, through every input kind
// ---------------------------------------------------------------------------------------------

#[track_caller]
fn assert_bad_id(e: &Error, id: i64) {
    match e {
        Error::IdOutOfRange {
            feature,
            table,
            row: 5,
            id: got,
            vocabulary_size: 1000,
        } => {
            assert_eq!(feature, "f0");
            assert_eq!(table, "t0");
            assert_eq!(*got, id);
        }
        other => panic!("id {id}: expected IdOutOfRange at row 5, got {other:?}"),
    }
    assert_msg(
        e,
        &[
            "feature `f0`",
            "table `t0`",
            "sample row 5",
            &format!("id {id} "),
            "vocabulary_size 1000",
        ],
    );
}

/// i64 ids that no table can hold. `1 << 32` and `(1 << 32) + 7` narrow to the valid ids 0 and
/// 7 if truncated, as the reference does: they must be rejected, not aliased.
const BAD_I64: [i64; 6] = [
    i64::MAX,
    -1,
    i64::MIN,
    i32::MIN as i64,
    1 << 32,
    (1 << 32) + 7,
];
/// i32 ids outside the vocabulary.
const BAD_I32: [i32; 4] = [i32::MAX, -1, i32::MIN, 1000];

/// Good rows with the second id of sample 5 replaced by `bad`.
fn rows_with<T: Copy + From<i32>>(bad: T) -> Vec<Vec<T>> {
    let mut rows: Vec<Vec<T>> = good_rows()
        .iter()
        .map(|r| r.iter().map(|&v| T::from(v)).collect())
        .collect();
    rows[5][1] = bad;
    rows
}

#[test]
fn hostile_ids_through_ragged_inputs() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    for bad in BAD_I64 {
        let rows = rows_with(bad);
        let values: Vec<i64> = rows.concat();
        let splits64: Vec<i64> = (0..=8).map(|r| 2 * r).collect();
        let splits32: Vec<i32> = (0..=8).map(|r| 2 * r).collect();
        let a = RaggedInput::from_i64("f0", &values, &splits64).unwrap();
        expect_run_error(&config(), &[&good], &[&a], |e| assert_bad_id(e, bad));
        let b = RaggedInput::new("f0", Ids::I64(&values), Offsets::I32(&splits32)).unwrap();
        expect_run_error(&config(), &[&good], &[&b], |e| assert_bad_id(e, bad));
    }
    for bad in BAD_I32 {
        let (values, splits) = ragged(&rows_with(bad));
        let a = RaggedInput::from_i32("f0", &values, &splits).unwrap();
        expect_run_error(&config(), &[&good], &[&a], |e| assert_bad_id(e, bad as i64));
        let splits64: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        let b = RaggedInput::new("f0", Ids::I32(&values), Offsets::I64(&splits64)).unwrap();
        expect_run_error(&config(), &[&good], &[&b], |e| assert_bad_id(e, bad as i64));
    }
}

#[test]
fn hostile_ids_through_dense_inputs() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    for bad in BAD_I64 {
        let mut ids = Array2::<i64>::from_shape_fn((8, 2), |(r, c)| r as i64 + 100 * c as i64);
        ids[[5, 1]] = bad;
        let dense = DenseInput::from_i64(ids.view());
        expect_run_error(&config(), &[&good], &[&dense], |e| assert_bad_id(e, bad));
        // Through a non-contiguous (transposed) view too.
        let t = ids.t().to_owned();
        let dense = DenseInput::from_i64(t.t());
        expect_run_error(&config(), &[&good], &[&dense], |e| assert_bad_id(e, bad));
    }
    for bad in BAD_I32 {
        let mut ids = Array2::<i32>::from_shape_fn((8, 2), |(r, c)| r as i32 + 100 * c as i32);
        ids[[5, 1]] = bad;
        let dense = DenseInput::from_i32(ids.view());
        expect_run_error(&config(), &[&good], &[&dense], |e| {
            assert_bad_id(e, bad as i64)
        });
    }
}

#[test]
fn hostile_ids_through_coo_inputs() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let indices: Vec<i64> = (0..8).flat_map(|r| [r, 0, r, 1]).collect();
    for bad in BAD_I64 {
        let values: Vec<i64> = rows_with(bad).concat();
        let coo = CooInput::new("f0", &indices, Ids::I64(&values), 8).unwrap();
        expect_run_error(&config(), &[&good], &[&coo], |e| assert_bad_id(e, bad));
    }
    for bad in BAD_I32 {
        let values: Vec<i32> = rows_with(bad).concat();
        let coo = CooInput::new("f0", &indices, Ids::I32(&values), 8).unwrap();
        expect_run_error(&config(), &[&good], &[&coo], |e| {
            assert_bad_id(e, bad as i64)
        });
    }
}

#[test]
fn hostile_ids_through_arrow_list_columns() {
    let good = record_batch(vec![("f0", list_i32(&good_rows()))]);
    for bad in BAD_I64 {
        for column in [list_i64(&rows_with(bad)), large_list_i64(&rows_with(bad))] {
            let batch = record_batch(vec![("f0", column)]);
            expect_record_batch_error(&config(), &good, &batch, |e| assert_bad_id(e, bad));
        }
    }
    for bad in BAD_I32 {
        for column in [list_i32(&rows_with(bad)), large_list_i32(&rows_with(bad))] {
            let batch = record_batch(vec![("f0", column)]);
            expect_record_batch_error(&config(), &good, &batch, |e| assert_bad_id(e, bad as i64));
        }
    }
}

#[test]
fn largest_valid_id_of_a_huge_vocabulary_is_placed_exactly() {
    // Vocabulary 2^30 (padded to 2^30 with 8 * N = 32): id 2^30 - 1 is valid. N = 4, no shard
    // rotation for a lone table, so (SPEC 3.4) its partition is (2^30 - 1) & 3 = 3 and its
    // shard-local row (2^30 - 1) >> 2 = 2^28 - 1.
    let cfg = config_with(|v| v["tables"][0]["vocabulary_size"] = json!(1u64 << 30));
    let top = (1i64 << 30) - 1;
    let values = [top, 0, 0, 0];
    let splits = [0i64, 1, 2, 3, 4];
    let input = RaggedInput::from_i64("f0", &values, &splits).unwrap();
    let out = prep(cfg.clone()).run_new(&[&input]).unwrap();
    let t0 = out.stack("t0").unwrap();
    // SparseCore 0 (sample 0): partitions 0-2 empty, partition 3 ends at 1, final cursor 8.
    assert_eq!(&t0.row_pointers[..8], &[0, 0, 0, 1, 8, 8, 8, 8]);
    assert_eq!(t0.embedding_ids[0], (1 << 28) - 1);
    assert_eq!(t0.sample_ids[0], 0);
    assert_eq!(t0.gains[0], 1.0);
    assert_eq!(t0.embedding_ids[1], PAD_ID);
    // One past it is rejected, naming the vocabulary.
    let values = [top + 1, 0, 0, 0];
    let bad = RaggedInput::from_i64("f0", &values, &splits).unwrap();
    let e = err(prep(cfg).run(&[&bad], &mut Output::new()));
    assert!(
        matches!(&e, Error::IdOutOfRange { row: 0, id, vocabulary_size: 1073741824, .. } if *id == top + 1),
        "{e:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

/// NaN and infinite weights are rejected (SPEC Part 1, 1.3), whatever the combiner; the
/// reference would turn them into NaN / infinite gains on the device.
#[test]
fn non_finite_weights_through_every_weighted_input_kind() {
    for combiner in ["sum", "mean", "sqrtn"] {
        let cfg = config_with(|v| v["tables"][0]["combiner"] = json!(combiner));
        let arrow_cfg = config_with(|v| {
            v["tables"][0]["combiner"] = json!(combiner);
            v["features"][0]["weights_column"] = json!("w0");
        });
        let (gv, gs) = ragged(&good_rows());
        let ones = vec![1.0f32; 16];
        let good = RaggedInput::from_i32("f0", &gv, &gs)
            .unwrap()
            .with_weights("f0", &ones)
            .unwrap();
        let good_batch = record_batch(vec![
            ("f0", list_i32(&good_rows())),
            ("w0", list_f32(&vec![vec![1.0; 2]; 8])),
        ]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            let check = |e: &Error| {
                match e {
                    Error::InvalidWeight {
                        feature,
                        row: 3,
                        value,
                    } => {
                        assert_eq!(feature, "f0");
                        assert_eq!(value.to_bits(), bad.to_bits(), "{combiner}");
                    }
                    other => panic!(
                        "{combiner}, weight {bad}: expected InvalidWeight at row 3, got {other:?}"
                    ),
                }
                assert_msg(e, &["feature `f0`", "sample row 3", "not finite"]);
            };
            // Ragged: weight of sample 3's second id.
            let mut w = ones.clone();
            w[7] = bad;
            let input = RaggedInput::from_i32("f0", &gv, &gs)
                .unwrap()
                .with_weights("f0", &w)
                .unwrap();
            expect_run_error(&cfg, &[&good], &[&input], check);
            // Dense.
            let ids = Array2::<i32>::from_shape_fn((8, 2), |(r, c)| r as i32 + 100 * c as i32);
            let mut wd = Array2::<f32>::ones((8, 2));
            wd[[3, 1]] = bad;
            let input = DenseInput::from_i32(ids.view())
                .with_weights("f0", wd.view())
                .unwrap();
            expect_run_error(&cfg, &[&good], &[&input], check);
            // Arrow.
            let mut wr = vec![vec![1.0f32; 2]; 8];
            wr[3][1] = bad;
            let batch = record_batch(vec![("f0", list_i32(&good_rows())), ("w0", list_f32(&wr))]);
            expect_record_batch_error(&arrow_cfg, &good_batch, &batch, check);
        }
    }
}

fn hostile_case_dir(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/hostile_cases")
        .join(name)
}

/// Runs a reference dump through the Arrow path and through its inline (ragged) data, each
/// after a failed batch on the same preprocessor and `Output`, and compares with the
/// reference's output.
fn check_reference_case(dir: &Path) {
    let config = Config::from_path(dir.join("config.json")).unwrap();
    let input = common::load_json(&dir.join("input.json"));
    let expected = common::load_json(&dir.join("expected.json"));
    let file = std::fs::File::open(dir.join("batch.arrow")).unwrap();
    let batch = arrow_ipc::reader::FileReader::try_new(file, None)
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    // A batch of the same columns with one id out of range: fails after the buffers are sized.
    let poisoned = {
        let mut columns: Vec<(String, ArrayRef)> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .zip(batch.columns().iter().cloned())
            .collect();
        let rows = batch.num_rows();
        let mut ids = vec![vec![1i32]; rows];
        ids[0] = vec![-7];
        columns[0].1 = list_i32(&ids);
        // Every other column: one valid id, or one weight of 1.
        for c in columns.iter_mut().skip(1) {
            c.1 = if c.1.data_type().to_string().contains("Float32") {
                list_f32(&vec![vec![1.0]; rows])
            } else {
                list_i32(&vec![vec![1]; rows])
            };
        }
        RecordBatch::try_from_iter(columns).unwrap()
    };
    let mut p = Preprocessor::builder(config).threads(2).build().unwrap();
    let mut out = Output::new();
    let e = err(p.run_record_batch(&poisoned, &mut out));
    assert!(
        matches!(&e, Error::IdOutOfRange { id: -7, row: 0, .. }),
        "{e:?}"
    );
    assert_no_output(&out);
    p.run_record_batch(&batch, &mut out).unwrap();
    common::check_output(&input, &expected, p.plan().unwrap(), &out)
        .unwrap_or_else(|m| panic!("{} (Arrow path): {m}", dir.display()));

    let case = Case::from_path(dir).unwrap();
    let sources = case.sources().unwrap();
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
    let mut p = Preprocessor::builder(case.config.clone())
        .global_batch_sizes(case.global_batch_sizes())
        .build()
        .unwrap();
    let e = err(p.run_record_batch(&poisoned, &mut out));
    assert!(matches!(&e, Error::IdOutOfRange { id: -7, .. }), "{e:?}");
    assert_no_output(&out);
    p.run(&inputs, &mut out).unwrap();
    common::check_output(&case.raw, &expected, p.plan().unwrap(), &out)
        .unwrap_or_else(|m| panic!("{} (inline ragged path): {m}", dir.display()));
}

/// Negative, all-zero, zero-sum, signed-zero, `f32::MAX` (sums overflow) and subnormal
/// (squares underflow) weights are finite, so the reference accepts them; its mean and sqrtn
/// then divide by 0 or infinity and produce ±inf, NaN (`0xffc00000`) and ±0 gains. We accept
/// them too and must produce exactly the reference's gains (checked inside `valid_ranges`).
#[test]
fn finite_hostile_weights_match_the_reference_bit_for_bit() {
    let dir = hostile_case_dir("finite_hostile_weights_l1g1s4");
    check_reference_case(&dir);
    // The case does exercise the non-finite results it claims to.
    let expected = common::load_json(&dir.join("expected.json"));
    let bits: Vec<u64> = expected["stacks"]["t_mean"]["gains_bits"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b.as_u64())
        .collect();
    for want in [0x7f80_0000u64, 0xff80_0000, 0xffc0_0000, 0x8000_0000] {
        assert!(bits.contains(&want), "t_mean gains lack {want:#x}");
    }
}

/// Subnormal weights, and normal weights whose quotients, divisors or merged sums are
/// subnormal. The reference computes gains on threads with flush-to-zero and
/// denormals-are-zero on: a subnormal weight reads as a signed zero (so mean and sqrtn give
/// 0 / 0 = NaN), and a subnormal result becomes one (sqrtn of a single 1e-20: Q = 1e-40 flushes
/// to 0 and the gain is +inf, not 1).
#[test]
fn subnormal_weights_and_gains_are_flushed_like_the_reference() {
    let dir = hostile_case_dir("subnormal_gains_l1g1s2");
    check_reference_case(&dir);
    let expected = common::load_json(&dir.join("expected.json"));
    let bits = |stack: &str| -> Vec<u64> {
        expected["stacks"][stack]["gains_bits"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b.as_u64())
            .collect()
    };
    // Sample 1 of SparseCore 0 under sqrtn: +inf. No stack holds a subnormal gain.
    assert!(bits("t_sqrtn").contains(&0x7f80_0000));
    for stack in ["t_sum", "t_mean", "t_sqrtn"] {
        assert!(
            bits(stack)
                .iter()
                .all(|&b| b & 0x7f80_0000 != 0 || b & 0x7fff_ffff == 0),
            "{stack} has a subnormal gain"
        );
    }
}

#[test]
fn weights_rows_of_a_different_length_than_the_ids() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    // Constructors: ragged weights share the ids' splits, so only the total can differ.
    for n in [0usize, 15, 17] {
        let w = vec![1.0f32; n];
        let e = err(RaggedInput::from_i32("f0", &gv, &gs)
            .unwrap()
            .with_weights("f0", &w));
        assert!(
            matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(&e, &["feature `f0`", &format!("{n} weights for 16 ids")]);
    }
    let ids = Array2::<i32>::zeros((8, 2));
    let narrow = Array2::<f32>::ones((8, 1));
    let e = err(DenseInput::from_i32(ids.view()).with_weights("f0", narrow.view()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "(8, 1)", "(8, 2)"]);

    // Through `run`: a view whose weights have their own offsets, same total (16), but sample 2
    // has 3 weights for its 2 ids and sample 3 has 1.
    let w = vec![1.0f32; 16];
    let wsplits = [0, 2, 4, 7, 8, 10, 12, 14, 16];
    let custom = Custom::new(
        8,
        true,
        FeatureView::Ragged {
            ids: Ids::I32(&gv),
            offsets: Offsets::I32(&gs),
            weights: Some((&w, Offsets::I32(&wsplits))),
        },
    );
    expect_run_error(&config(), &[&good], &[&custom], |e| {
        assert!(
            matches!(e, Error::WeightsShape { feature, row: 2, ids: 2, weights: 3 } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(e, &["feature `f0`", "sample row 2", "3 weights for 2 ids"]);
    });
    // A dense view with narrower weights.
    let dense_ids = Array2::<i32>::from_shape_fn((8, 2), |(r, c)| r as i32 + 100 * c as i32);
    let custom = Custom::new(
        8,
        true,
        FeatureView::Dense {
            ids: DenseIds::I32(dense_ids.view()),
            weights: Some(narrow.view()),
        },
    );
    expect_run_error(&config(), &[&good], &[&custom], |e| {
        assert!(
            matches!(e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(e, &["feature `f0`", "(8, 1)", "(8, 2)"]);
    });
    // Arrow: rows of different lengths, then a different row count.
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let good_batch = record_batch(vec![
        ("f0", list_i32(&good_rows())),
        ("w0", list_f32(&vec![vec![1.0; 2]; 8])),
    ]);
    let mut wr = vec![vec![1.0f32; 2]; 8];
    wr[6] = vec![1.0];
    wr[7] = vec![1.0; 3];
    let batch = record_batch(vec![("f0", list_i32(&good_rows())), ("w0", list_f32(&wr))]);
    expect_record_batch_error(&cfg, &good_batch, &batch, |e| {
        assert!(
            matches!(e, Error::WeightsShape { feature, row: 6, ids: 2, weights: 1 } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(e, &["feature `f0`", "sample row 6", "1 weights for 2 ids"]);
    });
    let ids = list_i32(&good_rows());
    let w7 = list_f32(&vec![vec![1.0, 1.0]; 7]);
    let e = err(ArrowListInput::new(
        "f0",
        "f0",
        ids.as_ref(),
        Some(("w0", w7.as_ref())),
    ));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "`w0` has 7 rows", "`f0` has 8"]);
}

// ---------------------------------------------------------------------------------------------
// Structure: row splits, COO order
// ---------------------------------------------------------------------------------------------

#[test]
fn row_splits_that_decrease_or_overrun_the_values() {
    let values: Vec<i32> = (0..16).collect();
    let values64: Vec<i64> = (0..16).collect();
    // (splits, message fragment)
    let cases: [(&[i32], &str); 4] = [
        (
            &[0, 2, 4, 3, 8, 10, 12, 14, 16],
            "decrease at row 2: 4 then 3",
        ),
        (
            &[0, 2, 4, 6, 8, 10, 12, 14, 17],
            "end at 17, past the 16 values",
        ),
        (
            &[0, 2, 4, 6, 8, 10, 12, 14, i32::MAX],
            "end at 2147483647, past the 16 values",
        ),
        (&[-2, 2, 4, 6, 8, 10, 12, 14, 16], "[0] = -2 is negative"),
    ];
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    for (splits, msg) in cases {
        let e = err(RaggedInput::from_i32("f0", &values, splits));
        assert!(
            matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(&e, &["feature `f0`", "row_splits", msg]);
        let splits64: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        let e = err(RaggedInput::from_i64("f0", &values64, &splits64));
        assert!(matches!(&e, Error::InvalidInput { .. }), "{e:?}");
        assert_msg(&e, &[msg]);
        // The same offsets in a hand-written view reach `run`, which rejects them too.
        let custom = Custom::new(
            8,
            false,
            FeatureView::Ragged {
                ids: Ids::I32(&values),
                offsets: Offsets::I32(splits),
                weights: None,
            },
        );
        expect_run_error(&config(), &[&good], &[&custom], |e| {
            assert!(
                matches!(e, Error::InvalidInput { feature, .. } if feature == "f0"),
                "{splits:?}: {e:?}"
            );
        });
    }
    // i64 offsets that would wrap when narrowed.
    let e = err(RaggedInput::from_i64("f0", &values64, &[0, 1 << 32, 16]));
    assert_msg(&e, &["decrease", "4294967296 then 16"]);
    let bad = [0i64, 2, 4, 6, 8, 10, 12, 14, i64::MAX];
    let custom = Custom::new(
        8,
        false,
        FeatureView::Ragged {
            ids: Ids::I64(&values64),
            offsets: Offsets::I64(&bad),
            weights: None,
        },
    );
    expect_run_error(&config(), &[&good], &[&custom], |e| {
        assert!(
            matches!(e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
    });
    // Weights offsets that overrun their values, in a weighted view.
    let w = vec![1.0f32; 16];
    let wsplits = [0, 2, 4, 6, 8, 10, 12, 14, 18];
    let custom = Custom::new(
        8,
        true,
        FeatureView::Ragged {
            ids: Ids::I32(&values),
            offsets: Offsets::I32(&gs),
            weights: Some((&w, Offsets::I32(&wsplits))),
        },
    );
    expect_run_error(&config(), &[&good], &[&custom], |e| {
        assert!(
            matches!(e, Error::InvalidInput { feature, .. } | Error::WeightsShape { feature, .. } if feature == "f0"),
            "{e:?}"
        );
    });
}

#[test]
fn coo_indices_not_sorted_by_row() {
    // Rows 0, 0, 1, 1, 3, 2, ...: entry 4 goes back from row 3 to row 2.
    let rows = [0i64, 0, 1, 1, 3, 2, 4, 5];
    let indices: Vec<i64> = rows
        .iter()
        .enumerate()
        .flat_map(|(k, &r)| [r, k as i64])
        .collect();
    let values: Vec<i32> = (0..8).collect();
    let e = err(CooInput::new("f0", &indices, Ids::I32(&values), 8));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "feature `f0`",
            "not sorted by row",
            "entry 5 has row 2 after row 3",
        ],
    );
    // The same entries in a hand-written view: rejected by `run`, never silently regrouped.
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let custom = Custom::new(
        8,
        false,
        FeatureView::Coo {
            indices: &indices,
            ids: Ids::I32(&values),
        },
    );
    expect_run_error(&config(), &[&good], &[&custom], |e| {
        assert!(
            matches!(e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
    });
    // Rows sorted but one past the batch, and a negative row.
    let past: Vec<i64> = (0..8)
        .flat_map(|k| [if k == 7 { 8 } else { k }, 0])
        .collect();
    let e = err(CooInput::new("f0", &past, Ids::I32(&values), 8));
    assert_msg(&e, &["feature `f0`", "indices[7] has row 8", "batch of 8"]);
    let negative: Vec<i64> = (0..8)
        .flat_map(|k| [if k == 0 { -1 } else { k }, 0])
        .collect();
    let e = err(CooInput::new("f0", &negative, Ids::I32(&values), 8));
    assert_msg(&e, &["feature `f0`", "indices[0] has row -1"]);
}

// ---------------------------------------------------------------------------------------------
// Batch sizes
// ---------------------------------------------------------------------------------------------

#[test]
fn batch_not_divisible_by_the_sparsecores_or_the_devices() {
    let (gv, gs) = ragged(&good_rows());
    let good8 = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    // S = 4: 6 samples.
    let (v, s) = ragged(&(0..6).map(|r| vec![r]).collect::<Vec<_>>());
    let six = RaggedInput::from_i32("f0", &v, &s).unwrap();
    expect_run_error(&config(), &[&good8], &[&six], |e| {
        assert!(
            matches!(e, Error::BatchNotDivisible { stack, feature, batch: 6, sc_per_device: 4 } if stack == "t0" && feature == "f0"),
            "{e:?}"
        );
        assert_msg(
            e,
            &[
                "stack `t0`",
                "feature `f0`",
                "batch_size_for_device (6)",
                "num_sc_per_device (4)",
            ],
        );
    });
    // L = G = 2, S = 4: 12 local samples give 6 per device.
    let cfg = config_with(|v| {
        v["config"]["local_device_count"] = json!(2);
        v["config"]["global_device_count"] = json!(2);
    });
    let rows16: Vec<Vec<i32>> = (0..16).map(|r| vec![r]).collect();
    let (v16, s16) = ragged(&rows16);
    let good16 = RaggedInput::from_i32("f0", &v16, &s16).unwrap();
    let (v, s) = ragged(&(0..12).map(|r| vec![r]).collect::<Vec<_>>());
    let twelve = RaggedInput::from_i32("f0", &v, &s).unwrap();
    expect_run_error(&cfg, &[&good16], &[&twelve], |e| {
        assert!(
            matches!(
                e,
                Error::BatchNotDivisible {
                    batch: 6,
                    sc_per_device: 4,
                    ..
                }
            ),
            "{e:?}"
        );
    });
    // 13 local samples over L = 2: floor(13 / 2) = 6 per device, still not divisible by 4.
    let (v, s) = ragged(&(0..13).map(|r| vec![r]).collect::<Vec<_>>());
    let thirteen = RaggedInput::from_i32("f0", &v, &s).unwrap();
    expect_run_error(&cfg, &[&good16], &[&thirteen], |e| {
        assert!(
            matches!(
                e,
                Error::BatchNotDivisible {
                    batch: 6,
                    sc_per_device: 4,
                    ..
                }
            ),
            "{e:?}"
        );
    });
}

/// 9 samples on L = 2 devices of S = 2: floor(9 / 2) = 4 per device divides by S, so the
/// reference accepts the batch and no SparseCore ever reads sample 8 (SPEC 1.5, last
/// paragraph). We match it: sample 8's ids (999, 998, 997) appear nowhere.
#[test]
fn batch_not_divisible_by_the_devices_drops_the_tail_like_the_reference() {
    let dir = hostile_case_dir("batch9_l2g2s2_row8_unread");
    check_reference_case(&dir);
    let case = Case::from_path(&dir).unwrap();
    let sources = case.sources().unwrap();
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
    let out = Preprocessor::builder(case.config.clone())
        .build()
        .unwrap()
        .run_new(&inputs)
        .unwrap();
    let t0 = out.stack("t0").unwrap();
    // N = 4: ids 997..999 would be rows 249 of partitions 1..3.
    assert!(
        !t0.embedding_ids.contains(&249),
        "an id of the unread sample 8 was placed"
    );
}

/// A synthetic source that claims a huge batch without holding any ids.
fn huge(samples: usize) -> Custom<'static> {
    Custom::new(
        samples,
        false,
        FeatureView::Ragged {
            ids: Ids::I32(&[]),
            offsets: Offsets::I32(&[0]),
            weights: None,
        },
    )
}

#[test]
fn batch_over_the_sort_key_limit_from_a_synthetic_source() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    // 2^26 samples on one device: one more than the 26-bit payload holds.
    let over = huge(1 << 26);
    let (_, largest, _) = track(|| {
        expect_run_error(&config(), &[&good], &[&over], |e| {
            assert!(
                matches!(e, Error::BatchTooLarge { stack, what: BatchCount::Samples, count: 67108864, limit: 67108863 } if stack == "t0"),
                "{e:?}"
            );
            assert_msg(
                e,
                &[
                    "stack `t0`",
                    "67108864 samples",
                    "CooFormat sorting key (67108863)",
                ],
            );
        })
    });
    assert_eq!(
        over.views.load(Ordering::Relaxed),
        0,
        "the oversized batch's ids were read"
    );
    assert!(
        largest < 16 * MIB,
        "an allocation of {largest} bytes for a rejected batch"
    );
    // Exactly 2^26 - 1 passes this check (and then fails on the view, which has no rows).
    let at_limit = huge((1 << 26) - 4);
    let e = err(prep(config()).run(&[&at_limit], &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );

    // L = 2: 2^27 local samples are 2^26 per device.
    let cfg = config_with(|v| {
        v["config"]["local_device_count"] = json!(2);
        v["config"]["global_device_count"] = json!(2);
    });
    let rows16: Vec<Vec<i32>> = (0..16).map(|r| vec![r]).collect();
    let (v16, s16) = ragged(&rows16);
    let good16 = RaggedInput::from_i32("f0", &v16, &s16).unwrap();
    expect_run_error(&cfg, &[&good16], &[&huge(1 << 27)], |e| {
        assert!(
            matches!(
                e,
                Error::BatchTooLarge {
                    what: BatchCount::Samples,
                    count: 67108864,
                    ..
                }
            ),
            "{e:?}"
        );
    });

    // usize::MAX samples: the planner refuses the global batch.
    expect_run_error(&config(), &[&good], &[&huge(usize::MAX)], |e| {
        assert!(
            matches!(
                e,
                Error::BatchTooLarge {
                    what: BatchCount::GlobalSamples,
                    count: u64::MAX,
                    ..
                }
            ),
            "{e:?}"
        );
    });
}

// Regression: with fixed `global_batch_sizes` the planner never sees the local sizes, and
// `check_batches` summed the stack's per-device samples in plain u64: two features of
// usize::MAX samples overflowed it ("attempt to add with overflow" in a debug build, a wrapped
// and wrong count in release).
#[test]
fn per_device_sample_count_overflow_is_an_error_not_a_panic() {
    let cfg = config_with(|v| {
        v["features"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "f1", "table": "t0"}))
    });
    let mut p = Preprocessor::builder(cfg)
        .global_batch_sizes(vec![8, 8])
        .build()
        .unwrap();
    let (a, b) = (huge(usize::MAX), huge(usize::MAX));
    let mut out = Output::new();
    let e = err(p.run(&[&a, &b], &mut out));
    assert!(
        matches!(&e, Error::BatchTooLarge { stack, what: BatchCount::Samples, count: u64::MAX, limit: 67108863 } if stack == "t0"),
        "{e:?}"
    );
    assert_no_output(&out);
}

#[test]
fn empty_batches() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    // No samples at all.
    let empty = RaggedInput::from_i32("f0", &[], &[0]).unwrap();
    expect_run_error(&config(), &[&good], &[&empty], |e| {
        assert!(
            matches!(e, Error::BatchTooSmall { stack, batch: 0, sc_per_device: 4, features: 1 } if stack == "t0"),
            "{e:?}"
        );
    });
    let good_batch = record_batch(vec![("f0", list_i32(&good_rows()))]);
    let no_rows = record_batch(vec![("f0", list_i32(&[]))]);
    expect_record_batch_error(&config(), &good_batch, &no_rows, |e| {
        assert!(matches!(e, Error::BatchTooSmall { batch: 0, .. }), "{e:?}");
    });
    // Eight samples without ids are a valid batch: every pointer 0, every slot padding.
    let nothing = RaggedInput::from_i32("f0", &[], &[0; 9]).unwrap();
    let out = prep(config()).run_new(&[&nothing]).unwrap();
    let t0 = out.stack("t0").unwrap();
    assert_eq!(t0.row_pointers, vec![0; 32]);
    assert!(t0.embedding_ids.iter().all(|&v| v == PAD_ID));
    assert!(t0.sample_ids.iter().all(|&v| v == PAD_ID));
    assert!(t0.gains.iter().all(|g| g.to_bits() == PAD_GAIN_BITS));
    assert_eq!(t0.stats.max_ids(), 0);
    assert_eq!(t0.stats.required_buffer_size_per_sc, vec![0; 4]);
}

#[test]
fn mismatched_batch_sizes_between_features() {
    let two = |v: &mut Value| {
        v["features"] = json!([{"name": "a", "table": "t0"}, {"name": "b", "table": "t0"}]);
    };
    let cfg = config_with(two);
    let (gv, gs) = ragged(&good_rows());
    let good_a = RaggedInput::from_i32("a", &gv, &gs).unwrap();
    let good_b = RaggedInput::from_i32("b", &gv, &gs).unwrap();
    // 8 + 6 = 14 stacked samples per device: not divisible by S = 4.
    let (v6, s6) = ragged(&(0..6).map(|r| vec![r]).collect::<Vec<_>>());
    let six = RaggedInput::from_i32("b", &v6, &s6).unwrap();
    expect_run_error(&cfg, &[&good_a, &good_b], &[&good_a, &six], |e| {
        assert!(
            matches!(e, Error::BatchNotDivisible { stack, feature, batch: 14, sc_per_device: 4 } if stack == "t0" && feature == "a"),
            "{e:?}"
        );
    });
    // 4 + 0: fewer stacked samples than S * features, so some SparseCore gets no sample of
    // some feature.
    let (v4, s4) = ragged(&(0..4).map(|r| vec![r]).collect::<Vec<_>>());
    let four = RaggedInput::from_i32("a", &v4, &s4).unwrap();
    let none = RaggedInput::from_i32("b", &[], &[0]).unwrap();
    expect_run_error(&cfg, &[&good_a, &good_b], &[&four, &none], |e| {
        assert!(
            matches!(
                e,
                Error::BatchTooSmall {
                    batch: 4,
                    sc_per_device: 4,
                    features: 2,
                    ..
                }
            ),
            "{e:?}"
        );
    });
    // Fewer inputs than features, and more.
    expect_run_error(&cfg, &[&good_a, &good_b], &[&good_a], |e| {
        assert!(
            matches!(
                e,
                Error::InputCount {
                    expected: 2,
                    got: 1
                }
            ),
            "{e:?}"
        );
    });
    expect_run_error(
        &cfg,
        &[&good_a, &good_b],
        &[&good_a, &good_b, &good_b],
        |e| {
            assert!(
                matches!(
                    e,
                    Error::InputCount {
                        expected: 2,
                        got: 3
                    }
                ),
                "{e:?}"
            );
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Configs: N not a power of two, zero limits, huge buffers, inconsistent tables and features
// ---------------------------------------------------------------------------------------------

#[test]
fn sparsecore_count_not_a_power_of_two() {
    for (g, s) in [
        (3usize, 1usize),
        (1, 3),
        (3, 4),
        (1, 6),
        (5, 2),
        (12, 4),
        (1, 1000),
    ] {
        let cfg = config_with(|v| {
            v["config"]["global_device_count"] = json!(g);
            v["config"]["num_sc_per_device"] = json!(s);
        });
        let check = |e: &Error| {
            match e {
                Error::NotPowerOfTwo {
                    global_devices,
                    sc_per_device,
                    num_scs,
                } => {
                    assert_eq!((*global_devices, *sc_per_device, *num_scs), (g, s, g * s));
                }
                other => panic!("G = {g}, S = {s}: expected NotPowerOfTwo, got {other:?}"),
            }
            assert_msg(
                e,
                &[
                    &format!("global_device_count {g}"),
                    &format!("num_sc_per_device {s}"),
                    &format!("= {})", g * s),
                    "must be a power of 2",
                ],
            );
        };
        check(&err(Preprocessor::new(cfg.clone())));
        check(&err(Plan::new(&cfg, &[8])));
    }
    // G * S overflowing usize is refused before it is multiplied.
    let cfg = config_with(|v| {
        v["config"]["global_device_count"] = json!(usize::MAX);
        v["config"]["num_sc_per_device"] = json!(2);
    });
    let e = err(Preprocessor::new(cfg));
    assert!(
        matches!(
            &e,
            Error::InvalidOption {
                option: "num_sc_per_device",
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["exceeds the 1073741824 SparseCores"]);
}

#[test]
fn limits_of_zero() {
    for key in ["max_ids_per_partition", "max_unique_ids_per_partition"] {
        let e = err(Preprocessor::new(config_with(|v| {
            v["tables"][0][key] = json!(0)
        })));
        assert!(
            matches!(&e, Error::InvalidLimit { what: ConfigItem::Table, name, limit, value: 0, .. } if name == "t0" && *limit == key),
            "{e:?}"
        );
        assert_msg(&e, &["table `t0`", &format!("{key} = 0"), "1..=2147483647"]);
        // Negative limits do not parse as a config at all.
        let mut v = base();
        v["tables"][0][key] = json!(-1);
        let e = err(Config::from_json(&v.to_string()));
        assert!(matches!(e, Error::Json { .. }), "{e:?}");
    }
}

/// A 10 GB suggestion (10^10 slots per device) is refused while planning, before anything is
/// sized: by the theoretical maximum when the limits are small, and by the 31-bit buffer range
/// when they are large enough to allow it. The largest allocation stays tiny.
#[test]
fn ten_gigabyte_suggested_coo_buffer_is_refused_without_allocating() {
    const TEN_GB: u64 = 10_000_000_000;
    let ((), largest, _) = track(|| {
        let e = err(Preprocessor::new(config_with(|v| {
            v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!(TEN_GB)
        })));
        assert!(
            matches!(&e, Error::SuggestedBufferTooLarge { stack, suggested: TEN_GB, rounded: TEN_GB, theoretical: 256, .. } if stack == "t0"),
            "{e:?}"
        );
        assert_msg(&e, &["stack `t0`", "10000000000", "theoretical max", "256"]);

        // max_ids 2^31 - 1: T = 2^31 * 4 * 4 = 2^35 > 10^10, so the range check refuses it.
        let e = err(Preprocessor::new(config_with(|v| {
            v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!(TEN_GB);
            v["tables"][0]["max_ids_per_partition"] = json!(i32::MAX);
        })));
        assert!(
            matches!(&e, Error::BufferSizeOutOfRange { stack, size: TEN_GB, .. } if stack == "t0"),
            "{e:?}"
        );
        assert_msg(&e, &["stack `t0`", "10000000000", "(0, 2147483647)"]);

        // The per-stack override, and u64::MAX (rounding saturates instead of wrapping).
        let e = err(Preprocessor::new(config_with(|v| {
            v["config"]["stack_suggested_coo_buffer_size_per_device"] = json!({"t0": TEN_GB})
        })));
        assert!(
            matches!(
                &e,
                Error::SuggestedBufferTooLarge {
                    suggested: TEN_GB,
                    ..
                }
            ),
            "{e:?}"
        );
        let e = err(Preprocessor::new(config_with(|v| {
            v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!(u64::MAX)
        })));
        assert!(
            matches!(
                &e,
                Error::SuggestedBufferTooLarge {
                    suggested: u64::MAX,
                    rounded: u64::MAX,
                    ..
                }
            ),
            "{e:?}"
        );
    });
    assert!(largest < MIB, "refusing a config allocated {largest} bytes");
}

/// A config can be valid and still need more memory than exists: L = G = 2^16 devices with
/// C = 2^31 - 8 slots each is 2^47 elements per array. The output's reservation fails before
/// anything is written and `run` returns an error, with no memory kept and the `Output` (which
/// held a batch of another config) empty.
#[test]
fn output_larger_than_the_machine_is_an_error_not_an_abort() {
    let cfg = config_with(|v| {
        v["config"]["local_device_count"] = json!(1 << 16);
        v["config"]["global_device_count"] = json!(1 << 16);
        v["config"]["num_sc_per_device"] = json!(1);
        v["tables"][0]["vocabulary_size"] = json!(8);
        v["tables"][0]["max_ids_per_partition"] = json!(1 << 16);
        v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!((1u64 << 31) - 8);
    });
    let mut p = prep(cfg);
    let empty: [i32; 0] = [];
    let ids = ArrayView2::from_shape((1usize << 16, 0), &empty[..]).unwrap();
    let input = DenseInput::from_i32(ids);

    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let mut out = prep(config()).run_new(&[&good]).unwrap();
    let (e, largest, _) = track(|| err(p.run(&[&input], &mut out)));
    match &e {
        Error::OutputTooLarge {
            stack,
            array: "embedding_ids",
            local_devices: 65536,
            elements,
        } => {
            assert_eq!(stack, "t0");
            assert_eq!(*elements, 65536 * ((1u64 << 31) - 8));
        }
        other => panic!("expected OutputTooLarge, got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "embedding_ids",
            "140737487831040 elements",
            "65536 local devices",
            "local_device_count",
        ],
    );
    assert!(
        largest < 64 * MIB,
        "a failed sizing allocated {largest} bytes"
    );
    assert_no_output(&out);
    // The same Output still works for its own config.
    let expected = prep(config()).run_new(&[&good]).unwrap();
    prep(config()).run(&[&good], &mut out).unwrap();
    assert_same_output(&out, &expected);
}

/// A change to the base config.
type Patch = Box<dyn Fn(&mut Value)>;

#[test]
fn inconsistent_tables_and_features() {
    // (patch, what, name, message fragment)
    let cases: Vec<(Patch, ConfigItem, &str, &str)> = vec![
        (
            Box::new(|v: &mut Value| {
                v["features"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "f0", "table": "t0"}))
            }),
            ConfigItem::Feature,
            "f0",
            "duplicate feature name",
        ),
        (
            Box::new(|v: &mut Value| v["features"][0]["table"] = json!("nope")),
            ConfigItem::Feature,
            "f0",
            "unknown table `nope`",
        ),
        (
            Box::new(|v: &mut Value| v["tables"][0]["embedding_dim"] = json!(0)),
            ConfigItem::Table,
            "t0",
            "embedding_dim 0",
        ),
        (
            Box::new(|v: &mut Value| v["tables"][0]["vocabulary_size"] = json!(0)),
            ConfigItem::Table,
            "t0",
            "vocabulary_size 0",
        ),
        (
            Box::new(|v: &mut Value| v["tables"][0]["vocabulary_size"] = json!(u64::MAX)),
            ConfigItem::Table,
            "t0",
            "18446744073709551615",
        ),
    ];
    for (patch, what, name, fragment) in cases {
        let e = err(Preprocessor::new(config_with(patch)));
        assert!(
            matches!(&e, Error::InvalidConfig { what: w, name: n, .. } if *w == what && n == name),
            "{fragment}: {e:?}"
        );
        assert_msg(&e, &[&format!("{what} `{name}`"), fragment]);
    }
    let e = err(Preprocessor::new(config_with(|v| {
        v["features"] = json!([])
    })));
    assert!(matches!(e, Error::NoFeatures), "{e:?}");
}

#[test]
fn missing_and_mistyped_arrow_columns_leave_no_output() {
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let good = record_batch(vec![
        ("f0", list_i32(&good_rows())),
        ("w0", list_f32(&vec![vec![1.0; 2]; 8])),
    ]);
    let no_weights = record_batch(vec![("f0", list_i32(&good_rows()))]);
    expect_record_batch_error(&cfg, &good, &no_weights, |e| {
        assert!(
            matches!(e, Error::MissingColumn { feature, column, available } if feature == "f0" && column == "w0" && available == "f0"),
            "{e:?}"
        );
    });
    let ids_as_weights = record_batch(vec![
        ("f0", list_i32(&good_rows())),
        ("w0", list_i32(&good_rows())),
    ]);
    expect_record_batch_error(&cfg, &good, &ids_as_weights, |e| {
        assert!(
            matches!(e, Error::ColumnType { feature, column, .. } if feature == "f0" && column == "w0"),
            "{e:?}"
        );
    });
}

// ---------------------------------------------------------------------------------------------
// Error state beyond `run`: stats-only runs, minibatching, a failing all-reduce, memory reuse
// ---------------------------------------------------------------------------------------------

#[test]
fn stats_only_errors_leave_no_output() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let (bv, bs) = ragged(&rows_with(-3));
    let bad = RaggedInput::from_i32("f0", &bv, &bs).unwrap();
    let mut p = prep(config());
    let mut out = Output::new();
    p.run_stats(&[&good], &mut out).unwrap();
    assert_eq!(out.stacks.len(), 1);
    let e = err(p.run_stats(&[&bad], &mut out));
    assert!(
        matches!(&e, Error::IdOutOfRange { id: -3, row: 5, .. }),
        "{e:?}"
    );
    assert_no_output(&out);
    // A buffers run after a stats run after an error.
    p.run(&[&good], &mut out).unwrap();
    assert_same_output(&out, &prep(config()).run_new(&[&good]).unwrap());
}

#[test]
fn minibatching_errors_leave_no_output() {
    let cfg = config_with(|v| v["config"]["enable_minibatching"] = json!(true));
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let (bv, bs) = ragged(&rows_with(5000));
    let bad = RaggedInput::from_i32("f0", &bv, &bs).unwrap();
    expect_run_error(&cfg, &[&good], &[&bad], |e| assert_bad_id(e, 5000));
}

/// An all-reduce that fails on demand (a peer host gone).
struct Flaky(AtomicBool);

impl AllReduce for Flaky {
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> sparsecore_prep::Result<bool> {
        if self.0.load(Ordering::Relaxed) {
            return Err(Error::AllReduce {
                key,
                reason: "peer host 1 (10.0.0.2:7000) did not answer".into(),
            });
        }
        Ok(value)
    }
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> sparsecore_prep::Result<u64> {
        if self.0.load(Ordering::Relaxed) {
            return Err(Error::AllReduce {
                key,
                reason: "peer host 1 (10.0.0.2:7000) did not answer".into(),
            });
        }
        Ok(value)
    }
}

/// The all-reduce runs after pass 1 has sized the buffers and written the statistics: its
/// failure must still leave no output.
#[test]
fn failing_all_reduce_leaves_no_output() {
    let cfg = config_with(|v| {
        v["config"]["enable_minibatching"] = json!(true);
        v["config"]["global_device_count"] = json!(2);
    });
    let flaky = Arc::new(Flaky(AtomicBool::new(false)));
    let mut p = Preprocessor::builder(cfg.clone())
        .all_reduce(flaky.clone())
        .build()
        .unwrap();
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let mut out = Output::new();
    p.set_batch_number(7);
    p.run(&[&good], &mut out).unwrap();
    let expected = out.clone();
    assert_eq!(expected.num_minibatches, 1);
    flaky.0.store(true, Ordering::Relaxed);
    let e = err(p.run(&[&good], &mut out));
    assert!(
        matches!(&e, Error::AllReduce { key: 14, reason } if reason.contains("10.0.0.2:7000")),
        "{e:?}"
    );
    assert_msg(&e, &["sync key 14", "did not answer"]);
    assert_no_output(&out);
    flaky.0.store(false, Ordering::Relaxed);
    p.run(&[&good], &mut out).unwrap();
    assert_same_output(&out, &expected);
}

/// The memory of a failed call's `Output` is kept: the next batch of the same shape, on the
/// same preprocessor, allocates nothing on the calling thread (where the `Output` is sized).
#[test]
fn an_error_does_not_cost_the_next_batch_its_buffers() {
    let (gv, gs) = ragged(&good_rows());
    let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
    let hot: Vec<Vec<i32>> = (0..8)
        .map(|r| {
            if r < 2 {
                (0..10).map(|i| 4 * i).collect()
            } else {
                vec![r]
            }
        })
        .collect();
    let (hv, hs) = ragged(&hot);
    let over_limit = RaggedInput::from_i32("f0", &hv, &hs).unwrap();
    let mut p = Preprocessor::builder(config()).threads(1).build().unwrap();
    let mut out = Output::new();
    p.run(&[&good], &mut out).unwrap();
    p.run(&[&good], &mut out).unwrap();
    let buffer = out.stacks[0].embedding_ids.as_ptr();
    // LimitExceeded is found after every buffer was written.
    let e = err(p.run(&[&over_limit], &mut out));
    assert!(
        matches!(
            &e,
            Error::LimitExceeded {
                observed: 20,
                limit: 16,
                ..
            }
        ),
        "{e:?}"
    );
    assert_no_output(&out);
    let (r, _, allocations) = track(|| p.run(&[&good], &mut out));
    r.unwrap();
    assert_eq!(
        allocations, 0,
        "the batch after an error reallocated its output"
    );
    assert_eq!(
        out.stacks[0].embedding_ids.as_ptr(),
        buffer,
        "the buffers were not reused"
    );
}
