//! One test per error path reachable from user input: the config and planner, the batch checks,
//! id and weight validation, input structure (ragged, dense, COO, Arrow), the per-partition
//! limits, golden-case loading, and recovery after an error.
//!
//! Every test asserts the exact variant (and its fields where they carry values) and that the
//! Display message names what a caller needs: the feature / table / stack / column, the observed
//! value and the limit.
//!
//! Tests marked `// Regression:` reproduce defects that were found and fixed (panics on user
//! input, a misleading message); they keep them fixed.

use crate::one_table;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arrow_array::builder::{
    Float32Builder, Float64Builder, Int32Builder, ListBuilder, StringBuilder,
};
use arrow_array::types::{Float32Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{ArrayRef, Int32Array, LargeListArray, ListArray};
use ndarray::{Array2, ArrayView2};
use serde_json::{json, Value};

use sparsecore_prep::input::{
    features_from_record_batch, ArrowListInput, CooInput, DenseIds, DenseInput, FeatureView, Ids,
    Offsets, RaggedInput,
};
use sparsecore_prep::spec::{DeviceLayout, Plan};
use sparsecore_prep::{BatchCount, Config, ConfigItem, Error, LimitKind, Output, Preprocessor};
use sparsecore_testkit::case::Case;

use one_table::{
    assert_msg, assert_same_output, base, config, config_with, err, good_rows, prep, ragged,
    record_batch, some_rows, Custom,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Config error at `Preprocessor::new`.
fn build_err(f: impl FnOnce(&mut Value)) -> Error {
    err(Preprocessor::new(config_with(f)))
}

/// Runs one ragged i32 feature through a fresh preprocessor of `cfg`.
fn run_ragged(cfg: Config, rows: &[Vec<i32>]) -> Result<Output, Error> {
    let (values, splits) = ragged(rows);
    let input = RaggedInput::from_i32("f0", &values, &splits)?;
    let mut p = prep(cfg);
    let mut out = Output::new();
    p.run(&[&input], &mut out)?;
    Ok(out)
}

/// Runs and converts a panic into `Err(panic message)`.
fn no_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "<non-string panic>".into())
    })
}

fn list_i32(rows: Vec<Option<Vec<Option<i32>>>>) -> ArrayRef {
    Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(rows))
}

fn list_f32(rows: Vec<Option<Vec<Option<f32>>>>) -> ArrayRef {
    Arc::new(ListArray::from_iter_primitive::<Float32Type, _, _>(rows))
}

// ---------------------------------------------------------------------------------------------
// Config and planner
// ---------------------------------------------------------------------------------------------

#[test]
fn local_device_count_zero() {
    let e = build_err(|v| v["config"]["local_device_count"] = json!(0));
    assert!(
        matches!(&e, Error::InvalidOption { option: "local_device_count", value, .. } if value == "0"),
        "{e:?}"
    );
    assert_msg(&e, &["local_device_count", "= 0", "must be greater than 0"]);
}

#[test]
fn global_device_count_zero() {
    let e = build_err(|v| v["config"]["global_device_count"] = json!(0));
    assert!(
        matches!(&e, Error::InvalidOption { option: "global_device_count", value, .. } if value == "0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["global_device_count", "= 0", "must be greater than 0"],
    );
}

#[test]
fn global_device_count_below_local() {
    let e = build_err(|v| {
        v["config"]["local_device_count"] = json!(2);
        v["config"]["global_device_count"] = json!(1);
    });
    assert!(
        matches!(&e, Error::InvalidOption { option: "global_device_count", value, .. } if value == "1"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "global_device_count",
            "= 1",
            "greater than or equal to local_device_count",
            "(2)",
        ],
    );
}

#[test]
fn num_sc_per_device_zero() {
    let e = build_err(|v| v["config"]["num_sc_per_device"] = json!(0));
    assert!(
        matches!(&e, Error::InvalidOption { option: "num_sc_per_device", value, .. } if value == "0"),
        "{e:?}"
    );
    assert_msg(&e, &["num_sc_per_device", "= 0", "must be greater than 0"]);
}

#[test]
fn sparsecore_count_not_power_of_two() {
    let e = build_err(|v| {
        v["config"]["local_device_count"] = json!(3);
        v["config"]["global_device_count"] = json!(3);
    });
    assert!(
        matches!(
            e,
            Error::NotPowerOfTwo {
                global_devices: 3,
                sc_per_device: 4,
                num_scs: 12
            }
        ),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "global_device_count 3",
            "num_sc_per_device 4",
            "= 12",
            "must be a power of 2",
        ],
    );
}

// N = G * S is capped at 2^30; a power of two above the cap must name the cap, not claim that
// it is not a power of two.
#[test]
fn sparsecore_count_power_of_two_above_cap_names_the_cap() {
    let e = err(DeviceLayout::new(1, 1, 1 << 31));
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                option: "num_sc_per_device",
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["2147483648", "1073741824"]);
}

#[test]
fn device_layout_checks_directly() {
    assert!(matches!(
        err(DeviceLayout::new(0, 1, 4)),
        Error::InvalidOption {
            option: "local_device_count",
            ..
        }
    ));
    assert!(matches!(
        err(DeviceLayout::new(1, 0, 4)),
        Error::InvalidOption {
            option: "global_device_count",
            ..
        }
    ));
    assert!(matches!(
        err(DeviceLayout::new(2, 1, 4)),
        Error::InvalidOption {
            option: "global_device_count",
            ..
        }
    ));
    assert!(matches!(
        err(DeviceLayout::new(1, 1, 0)),
        Error::InvalidOption {
            option: "num_sc_per_device",
            ..
        }
    ));
    assert!(matches!(
        err(DeviceLayout::new(3, 3, 4)),
        Error::NotPowerOfTwo { num_scs: 12, .. }
    ));
    // G * S overflowing usize must not panic.
    let e = err(DeviceLayout::new(1, usize::MAX, 2));
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                option: "num_sc_per_device",
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &[&usize::MAX.to_string(), "1073741824"]);
    assert!(DeviceLayout::new(2, 4, 2).is_ok());
}

#[test]
fn unknown_sharding_strategy() {
    let e = build_err(|v| v["config"]["sharding_strategy"] = json!("ROW"));
    assert!(
        matches!(&e, Error::InvalidOption { option: "sharding_strategy", value, .. } if value == "ROW"),
        "{e:?}"
    );
    assert_msg(&e, &["sharding_strategy", "ROW", "Only MOD is supported"]);
    // "mod" in any case is accepted.
    assert!(Preprocessor::new(config_with(
        |v| v["config"]["sharding_strategy"] = json!("mod")
    ))
    .is_ok());
    assert!(Preprocessor::new(config_with(
        |v| v["config"]["sharding_strategy"] = json!("MOD")
    ))
    .is_ok());
}

#[test]
fn no_features() {
    let e = build_err(|v| v["features"] = json!([]));
    assert!(matches!(e, Error::NoFeatures), "{e:?}");
    assert_msg(&e, &["input_batches cannot be empty", "no features"]);
}

#[test]
fn feature_with_unknown_table() {
    let e = build_err(|v| v["features"][0]["table"] = json!("nope"));
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Feature, name, .. } if name == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "unknown table `nope`", "t0"]);
}

#[test]
fn duplicate_table_name() {
    let e = build_err(|v| {
        let t = v["tables"][0].clone();
        v["tables"].as_array_mut().unwrap().push(t);
    });
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Table, name, .. } if name == "t0"),
        "{e:?}"
    );
    assert_msg(&e, &["table `t0`", "duplicate table name"]);
}

#[test]
fn duplicate_feature_name() {
    let e = build_err(|v| {
        v["features"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "f0", "table": "t0"}))
    });
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Feature, name, .. } if name == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "duplicate feature name"]);
}

#[test]
fn unknown_combiner() {
    for bad in ["avg", "Sum", ""] {
        let e = build_err(|v| v["tables"][0]["combiner"] = json!(bad));
        assert!(
            matches!(&e, Error::InvalidConfig { what: ConfigItem::Table, name, .. } if name == "t0"),
            "{e:?}"
        );
        assert_msg(
            &e,
            &[
                "table `t0`",
                "unknown combiner",
                &format!("{bad:?}"),
                "sum",
                "mean",
                "sqrtn",
            ],
        );
    }
}

#[test]
fn vocabulary_size_zero_or_too_large() {
    let e = build_err(|v| v["tables"][0]["vocabulary_size"] = json!(0));
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Table, name, .. } if name == "t0"),
        "{e:?}"
    );
    assert_msg(&e, &["table `t0`", "vocabulary_size 0", "1..=2147483647"]);

    let e = build_err(|v| v["tables"][0]["vocabulary_size"] = json!(1u64 << 31));
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Table, name, .. } if name == "t0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["table `t0`", "vocabulary_size 2147483648", "1..=2147483647"],
    );
}

#[test]
fn padded_stack_vocabulary_of_two_to_the_31_is_planned() {
    // 2^31 - 1 rounds up to 2^31 with 8 * N = 32. The reference plans it (its column ids are
    // ids of the one table, all below 2^31), so we do too: testdata/reference_cases holds its
    // output for such a table, and `tests/reference/golden.rs` compares ours with it.
    let prep = Preprocessor::new(config_with(|v| {
        v["tables"][0]["vocabulary_size"] = json!(i32::MAX)
    }))
    .expect("planned");
    let rows: Vec<Vec<i32>> = vec![vec![i32::MAX - 1], vec![0], vec![1 << 30], vec![]];
    let (values, splits) = ragged(&rows);
    let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
    let mut prep = prep;
    prep.run(&[&f0], &mut Output::new()).expect("preprocessed");
    assert_eq!(prep.plan().unwrap().stacks[0].stack_vocab_size, 1 << 31);
}

#[test]
fn table_past_the_32_bit_column_offset_is_refused() {
    // Auto stacking puts `big` (2^31 - 1 rows, padded to 2^31) first: `small` would start at
    // column 2^31, which the reference refuses (a C++ int) and so do we.
    let e = build_err(|v| {
        v["config"]["stacking"] = json!("auto");
        v["tables"] = json!([
            {"name": "big", "vocabulary_size": i32::MAX, "embedding_dim": 8, "combiner": "sum",
             "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16},
            {"name": "small", "vocabulary_size": 100, "embedding_dim": 8, "combiner": "sum",
             "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16}
        ]);
        v["features"] = json!([{"name": "f0", "table": "big"}, {"name": "f1", "table": "small"}]);
    });
    assert!(
        matches!(
            &e,
            Error::InvalidConfig {
                what: ConfigItem::Stack,
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "table `small` would start at column 2147483648",
            "2147483647",
        ],
    );
}

#[test]
fn embedding_dim_zero() {
    let e = build_err(|v| v["tables"][0]["embedding_dim"] = json!(0));
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Table, name, .. } if name == "t0"),
        "{e:?}"
    );
    assert_msg(&e, &["table `t0`", "embedding_dim 0", "1..=2147483647"]);
}

#[test]
fn table_limits_zero_or_too_large() {
    for (key, value) in [
        ("max_ids_per_partition", 0u64),
        ("max_unique_ids_per_partition", 0),
        ("max_ids_per_partition", 1 << 31),
        ("max_unique_ids_per_partition", 1 << 31),
    ] {
        let e = build_err(|v| v["tables"][0][key] = json!(value));
        match &e {
            Error::InvalidLimit {
                what: ConfigItem::Table,
                name,
                limit,
                value: got,
                ..
            } => {
                assert_eq!(name, "t0");
                assert_eq!(*limit, key);
                assert_eq!(*got, value);
            }
            other => panic!("{key} = {value}: expected InvalidLimit, got {other:?}"),
        }
        assert_msg(
            &e,
            &["table `t0`", &format!("{key} = {value}"), "1..=2147483647"],
        );
    }
}

#[test]
fn auto_stack_limits_zero() {
    // Two tables with the same padded dim and combiner are auto-stacked into `t0_t1`, which
    // takes the stack limits.
    for (key, limits) in [
        (
            "max_ids_per_partition",
            json!({"max_ids_per_partition": 0, "max_unique_ids_per_partition": 8}),
        ),
        (
            "max_unique_ids_per_partition",
            json!({"max_ids_per_partition": 8, "max_unique_ids_per_partition": 0}),
        ),
    ] {
        let e = build_err(|v| {
            v["config"]["stacking"] = json!("auto");
            v["config"]["stack_limits"] = limits;
            let mut t1 = v["tables"][0].clone();
            t1["name"] = json!("t1");
            v["tables"].as_array_mut().unwrap().push(t1);
            v["features"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "f1", "table": "t1"}));
        });
        match &e {
            Error::InvalidLimit {
                what: ConfigItem::Stack,
                name,
                limit,
                value: 0,
                ..
            } => {
                assert_eq!(name, "t0_t1");
                assert_eq!(*limit, key);
            }
            other => panic!("expected InvalidLimit for the stack, got {other:?}"),
        }
        assert_msg(&e, &["stack `t0_t1`", &format!("{key} = 0")]);
    }
}

#[test]
fn suggested_buffer_larger_than_theoretical_max() {
    // T = roundup(16, 8) * S * N = 16 * 4 * 4 = 256.
    let e = build_err(|v| v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!(1000));
    match &e {
        Error::SuggestedBufferTooLarge {
            stack,
            feature,
            suggested: 1000,
            rounded: 1024,
            theoretical: 256,
        } => {
            assert_eq!((stack.as_str(), feature.as_str()), ("t0", "f0"))
        }
        other => panic!("expected SuggestedBufferTooLarge, got {other:?}"),
    }
    // The reference's abort line, word for word (a golden case matches on its first 200
    // characters), then the suggestion as given.
    assert_msg(
        &e,
        &[
            "Check failed: suggested_value <= theoretical_max Suggested Coo Buffer Size is larger than the theoretical max for \
             table f0: 1024 vs 256. Adjust the suggested size or the max_ids_per_partition values.",
            "stack `t0`",
            "suggested_coo_buffer_size_per_device 1000",
        ],
    );
    // The spec's examples that are accepted: 48 -> 64, 96 -> 96, 256 -> 256.
    for ok in [48, 96, 256] {
        assert!(Preprocessor::new(config_with(|v| v["tables"][0]
            ["suggested_coo_buffer_size_per_device"] =
            json!(ok)))
        .is_ok());
    }
}

#[test]
fn suggested_buffer_zero() {
    let e = build_err(|v| v["tables"][0]["suggested_coo_buffer_size_per_device"] = json!(0));
    assert!(
        matches!(&e, Error::BufferSizeOutOfRange { stack, feature, size: 0 } if stack == "t0" && feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["stack `t0`", "size per device 0", "(0, 2147483647)"]);
}

#[test]
fn computed_buffer_size_over_31_bits() {
    // roundup(2^31 - 1, 8) * 4 * 4 = 2^35.
    let e = build_err(|v| v["tables"][0]["max_ids_per_partition"] = json!(i32::MAX));
    assert!(
        matches!(&e, Error::BufferSizeOutOfRange { stack, feature, size: 34359738368 } if stack == "t0" && feature == "f0"),
        "{e:?}"
    );
    // The reference's abort line, word for word.
    let line = "Check failed: computed_coo_buffer_size_per_device > 0 && computed_coo_buffer_size_per_device < INT_MAX Computed \
                Coo Buffer Size (34359738368) for table f0 is out of the valid range (0, INT_MAX).";
    assert_msg(
        &e,
        &["stack `t0`", line, "2147483647", "max_ids_per_partition"],
    );
}

// Regression: `size_buffers` (src/spec/plan.rs) computes `roundup(max_ids, 8) * S * N` in unchecked u64
// arithmetic. With S = 2^27 (N = 2^27, which passes the 2^30 cap and the 32-bit vocabulary
// check for a vocabulary of 8) and max_ids_per_partition = 2048 the product is 2^65: a debug
// build panics with "attempt to multiply with overflow" inside `Preprocessor::new`, and a
// release build wraps to 0 and reports `BufferSizeOutOfRange { size: 0 }`, the wrong size.
#[test]
fn theoretical_buffer_size_overflow_is_an_error_not_a_panic() {
    let cfg = config_with(|v| {
        v["config"]["num_sc_per_device"] = json!(1u64 << 27);
        v["tables"][0]["vocabulary_size"] = json!(8);
        v["tables"][0]["max_ids_per_partition"] = json!(2048);
    });
    let r = no_panic(|| Preprocessor::new(cfg).map(|_| ()));
    match r {
        Err(panic) => panic!("BUG: Preprocessor::new panicked on a config: {panic}"),
        Ok(Ok(())) => panic!("expected BufferSizeOutOfRange, got Ok"),
        Ok(Err(e)) => {
            assert!(
                matches!(&e, Error::BufferSizeOutOfRange { stack, size, .. } if stack == "t0" && *size >= i32::MAX as u64),
                "{e:?}"
            );
            assert_msg(&e, &["stack `t0`", "2147483647"]);
        }
    }
}

#[test]
fn stack_suggested_size_for_unknown_stack() {
    let e = build_err(|v| {
        v["config"]["stack_suggested_coo_buffer_size_per_device"] = json!({"nope": 64})
    });
    assert!(
        matches!(&e, Error::InvalidConfig { what: ConfigItem::Stack, name, .. } if name == "nope"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["stack `nope`", "stack_suggested_coo_buffer_size_per_device"],
    );
}

#[test]
fn stack_suggested_size_too_large_for_known_stack() {
    let e = build_err(|v| {
        v["config"]["stack_suggested_coo_buffer_size_per_device"] = json!({"t0": 4096})
    });
    assert!(
        matches!(&e, Error::SuggestedBufferTooLarge { stack, suggested: 4096, rounded: 4096, theoretical: 256, .. } if stack == "t0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "Suggested Coo Buffer Size is larger than the theoretical max",
            "t0",
            "4096",
            "256",
        ],
    );
}

#[test]
fn malformed_json_config() {
    let e = err(Config::from_json(
        "{\"config\": {\"local_device_count\": 1,",
    ));
    assert!(
        matches!(&e, Error::Json { context, .. } if context == "config"),
        "{e:?}"
    );
    assert_msg(&e, &["config"]);

    // Missing required key.
    let mut v = base();
    v.as_object_mut().unwrap().remove("tables");
    let e = err(Config::from_json(&v.to_string()));
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert_msg(&e, &["config", "tables"]);

    // Wrong types: a negative device count, an unknown stacking mode.
    let mut v = base();
    v["config"]["local_device_count"] = json!(-1);
    assert!(matches!(
        err(Config::from_json(&v.to_string())),
        Error::Json { .. }
    ));
    let mut v = base();
    v["config"]["stacking"] = json!("bogus");
    let e = err(Config::from_json(&v.to_string()));
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert_msg(&e, &["bogus"]);
}

#[test]
fn missing_and_malformed_config_files() {
    let dir = std::env::temp_dir().join(format!("sparsecore-prep-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("does-not-exist.json");
    let e = err(Config::from_path(&missing));
    assert!(
        matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{e:?}"
    );
    assert_msg(&e, &["does-not-exist.json"]);

    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{ not json").unwrap();
    let e = err(Config::from_path(&bad));
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert_msg(&e, &["bad.json"]);

    let good = dir.join("good.json");
    std::fs::write(&good, base().to_string()).unwrap();
    assert!(Config::from_path(&good).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn multi_host_minibatching_needs_an_all_reduce() {
    // One host of two: the split must be agreed across hosts (the reference's ValueError).
    let e = build_err(|v| {
        v["config"]["enable_minibatching"] = json!(true);
        v["config"]["global_device_count"] = json!(2);
    });
    assert!(
        matches!(&e, Error::InvalidOption { option: "enable_minibatching", value, .. } if value == "true"),
        "{e:?}"
    );
    assert_msg(&e, &["all_reduce_interface must be provided", "multi-host"]);
    // A single host needs none.
    let cfg = config_with(|v| v["config"]["enable_minibatching"] = json!(true));
    assert!(Preprocessor::new(cfg).is_ok());
}

#[test]
fn zero_threads() {
    let e = err(Preprocessor::builder(config()).threads(0).build());
    assert!(
        matches!(&e, Error::InvalidOption { option: "threads", value, .. } if value == "0"),
        "{e:?}"
    );
    assert_msg(&e, &["threads", "= 0", "at least 1"]);
}

#[test]
fn global_batch_sizes_of_wrong_length() {
    let e = err(Preprocessor::builder(config())
        .global_batch_sizes(vec![8, 8])
        .build());
    assert!(
        matches!(
            e,
            Error::InputCount {
                expected: 1,
                got: 2
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["expected 1", "got 2"]);

    let e = err(Plan::new(&config(), &[]));
    assert!(
        matches!(
            e,
            Error::InputCount {
                expected: 1,
                got: 0
            }
        ),
        "{e:?}"
    );
}

#[test]
fn plan_for_local_batches_with_zero_local_devices() {
    let mut cfg = config();
    cfg.config.local_device_count = 0;
    let e = err(Plan::for_local_batches(&cfg, &[8]));
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                option: "local_device_count",
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["local_device_count", "greater than 0"]);
}

// Regression: auto stacking's activation budget (`auto_groups` in src/spec/plan.rs) computes
// `roundup(dim, 8) * (global_batch / N) * 4` unchecked. A zero-valency dense view of 2^62 samples
// (no memory) plans a global batch of 2^62 and the product overflows u64: a debug build panics
// in `Preprocessor::run` instead of returning `BatchTooLarge` (the batch check runs only after
// planning).
#[test]
fn huge_batch_under_auto_stacking_is_an_error_not_a_panic() {
    let cfg = config_with(|v| v["config"]["stacking"] = json!("auto"));
    let empty: [i32; 0] = [];
    let ids = ArrayView2::from_shape((1usize << 62, 0), &empty[..]).unwrap();
    let input = DenseInput::from_i32(ids);
    let mut p = prep(cfg);
    let mut out = Output::new();
    let r = no_panic(|| p.run(&[&input], &mut out));
    match r {
        Err(panic) => panic!("BUG: run panicked on a huge batch: {panic}"),
        Ok(r) => {
            let e = err(r);
            assert!(matches!(e, Error::BatchTooLarge { .. }), "{e:?}");
        }
    }
}

// Regression: same root cause as above, in feature stacking: `plan_feature_stack` sums the member
// features' global batch sizes into the row offsets with an unchecked `u64 +=`. Two features of
// `usize::MAX` samples (given through `PreprocessorBuilder::global_batch_sizes`, or derived as
// local * G / L, which saturates) make `Preprocessor::build` panic with "attempt to add with
// overflow" instead of returning an error.
#[test]
fn huge_global_batch_sizes_are_an_error_not_a_panic() {
    let cfg = config_with(|v| {
        v["features"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "f1", "table": "t0"}))
    });
    let r = no_panic(|| {
        Preprocessor::builder(cfg)
            .global_batch_sizes(vec![usize::MAX, usize::MAX])
            .build()
            .map(|_| ())
    });
    match r {
        Err(panic) => panic!("BUG: build panicked on huge global batch sizes: {panic}"),
        Ok(r) => {
            let e = err(r);
            assert_msg(&e, &["t0"]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Batch checks
// ---------------------------------------------------------------------------------------------

#[test]
fn wrong_number_of_inputs() {
    let (values, splits) = ragged(&good_rows());
    let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
    let mut p = prep(config());
    let mut out = Output::new();

    let e = err(p.run(&[], &mut out));
    assert!(
        matches!(
            e,
            Error::InputCount {
                expected: 1,
                got: 0
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["expected 1 feature inputs", "got 0"]);

    let e = err(p.run(&[&f0, &f0], &mut out));
    assert!(
        matches!(
            e,
            Error::InputCount {
                expected: 1,
                got: 2
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["expected 1 feature inputs", "got 2"]);

    p.run(&[&f0], &mut out).unwrap();
}

#[test]
fn batch_not_divisible_by_sparsecores() {
    let rows: Vec<Vec<i32>> = (0..6).map(|r| vec![r]).collect();
    let e = err(run_ragged(config(), &rows));
    match &e {
        Error::BatchNotDivisible {
            stack,
            feature,
            batch: 6,
            sc_per_device: 4,
        } => {
            assert_eq!(stack, "t0");
            assert_eq!(feature, "f0");
        }
        other => panic!("expected BatchNotDivisible, got {other:?}"),
    }
    // The reference's abort line, word for word (a golden case matches on its first 200 characters).
    let line = "Check failed: batch_size_for_device % num_sc_per_device == 0 (2 vs. 0) batch_size_for_device (6) for stacked \
                table 'f0' must be divisible by num_sc_per_device (4).";
    assert_msg(&e, &["stack `t0`", line]);
}

#[test]
fn batch_not_divisible_names_first_feature_of_stack() {
    // Feature stacking sorts same-table features by name: `a` comes first in the stack.
    let cfg = config_with(|v| {
        v["features"] = json!([{"name": "b", "table": "t0"}, {"name": "a", "table": "t0"}]);
    });
    let (v1, s1) = ragged(&(0..4).map(|r| vec![r]).collect::<Vec<_>>());
    let (v2, s2) = ragged(&(0..3).map(|r| vec![r]).collect::<Vec<_>>());
    let b = RaggedInput::from_i32("b", &v1, &s1).unwrap();
    let a = RaggedInput::from_i32("a", &v2, &s2).unwrap();
    let e = err(prep(cfg).run(&[&b, &a], &mut Output::new()));
    assert!(
        matches!(&e, Error::BatchNotDivisible { stack, feature, batch: 7, sc_per_device: 4 } if stack == "t0" && feature == "a"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "(3 vs. 0) batch_size_for_device (7) for stacked table 'a' must be divisible",
        ],
    );
}

#[test]
fn batch_smaller_than_sparsecores_times_features() {
    let cfg = config_with(|v| {
        v["features"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "f1", "table": "t0"}))
    });
    let (values, splits) = ragged(&[vec![1], vec![2]]);
    let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
    let f1 = RaggedInput::from_i32("f1", &values, &splits).unwrap();
    let e = err(prep(cfg).run(&[&f0, &f1], &mut Output::new()));
    assert!(
        matches!(&e, Error::BatchTooSmall { stack, batch: 4, sc_per_device: 4, features: 2 } if stack == "t0"),
        "{e:?}"
    );
    // The reference's abort line, word for word, then the numbers in our words.
    let line = "Check failed: batch_size_for_device >= feature_slices_per_device * stacked_table_metadata.size() (4 vs. 8) Batch \
                size must be greater or equal to the number of features stacked together (per feature slice).";
    assert_msg(
        &e,
        &[
            "stack `t0`",
            line,
            "batch 4",
            "num_sc_per_device 4",
            "2 features",
        ],
    );
}

#[test]
fn empty_batch_is_too_small() {
    let e = err(run_ragged(config(), &[]));
    assert!(
        matches!(&e, Error::BatchTooSmall { stack, batch: 0, sc_per_device: 4, features: 1 } if stack == "t0"),
        "{e:?}"
    );
    assert_msg(&e, &["stack `t0`", "batch 0", "1 features"]);
}

#[test]
fn batch_over_sort_key_limit() {
    // A [2^26, 0] dense view: 2^26 samples without ids, no memory.
    let empty: [i32; 0] = [];
    let ids = ArrayView2::from_shape((1usize << 26, 0), &empty[..]).unwrap();
    let input = DenseInput::from_i32(ids);
    let mut p = prep(config());
    let e = err(p.run(&[&input], &mut Output::new()));
    match &e {
        Error::BatchTooLarge {
            stack,
            what: BatchCount::Samples,
            count: 67108864,
            limit: 67108863,
        } => assert_eq!(stack, "t0"),
        other => panic!("expected BatchTooLarge, got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "67108864 samples",
            "CooFormat sorting key",
            "67108863",
        ],
    );
    // (2^26 - 4 samples would pass this check, but extracting them takes ~1 min in a debug build.)
}

#[test]
fn stacked_rows_over_sort_key_limit_via_global_batch_sizes() {
    // f1's row offset is f0's global batch (2^28), so its rows start at 2^28 / N = 2^26 on each
    // SparseCore: past the 26-bit payload.
    let cfg = config_with(|v| {
        v["features"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "f1", "table": "t0"}))
    });
    let mut p = Preprocessor::builder(cfg)
        .global_batch_sizes(vec![1 << 28, 8])
        .build()
        .unwrap();
    let (values, splits) = ragged(&good_rows());
    let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
    let f1 = RaggedInput::from_i32("f1", &values, &splits).unwrap();
    let e = err(p.run(&[&f0, &f1], &mut Output::new()));
    match &e {
        Error::BatchTooLarge {
            stack,
            what: BatchCount::Samples,
            count,
            limit: 67108863,
        } => {
            assert_eq!(stack, "t0");
            assert!(*count > 67108864, "{count}");
        }
        other => panic!("expected BatchTooLarge, got {other:?}"),
    }
    assert_msg(&e, &["stack `t0`", "67108863"]);
}

#[test]
fn weighted_ids_over_sort_key_limit() {
    // One sample of 2^26 + 1 weighted ids on a single SparseCore: the extraction index no longer
    // fits the key. Broadcast views cost no memory.
    let cfg = config_with(|v| v["config"]["num_sc_per_device"] = json!(1));
    let one = Array2::<i32>::from_elem((1, 1), 1);
    let w = Array2::<f32>::from_elem((1, 1), 1.0);
    let n = (1usize << 26) + 1;
    let ids = one.broadcast((1, n)).unwrap();
    let weights = w.broadcast((1, n)).unwrap();
    let input = DenseInput::from_i32(ids)
        .with_weights("f0", weights)
        .unwrap();
    let e = err(prep(cfg).run(&[&input], &mut Output::new()));
    match &e {
        Error::BatchTooLarge {
            stack,
            what: BatchCount::WeightedIds,
            count: 67108865,
            limit: 67108863,
        } => {
            assert_eq!(stack, "t0");
        }
        other => panic!("expected BatchTooLarge, got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "67108865 weighted ids in one SparseCore",
            "67108863",
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// Id validation
// ---------------------------------------------------------------------------------------------

#[track_caller]
fn assert_id_out_of_range(e: &Error, row: usize, id: i64) {
    match e {
        Error::IdOutOfRange {
            feature,
            table,
            row: r,
            id: i,
            vocabulary_size: 1000,
        } => {
            assert_eq!(feature, "f0");
            assert_eq!(table, "t0");
            assert_eq!(*r, row);
            assert_eq!(*i, id);
        }
        other => panic!("expected IdOutOfRange, got {other:?}"),
    }
    assert_msg(
        e,
        &[
            "feature `f0`",
            "table `t0`",
            &format!("row {row}"),
            &format!("id {id}"),
            "1000",
        ],
    );
}

#[test]
fn negative_id() {
    let mut rows = good_rows();
    rows[5][1] = -1;
    assert_id_out_of_range(&err(run_ragged(config(), &rows)), 5, -1);
}

#[test]
fn id_equal_to_vocabulary_size() {
    let mut rows = good_rows();
    rows[2][0] = 1000;
    assert_id_out_of_range(&err(run_ragged(config(), &rows)), 2, 1000);
    // 999 is the last valid id.
    rows[2][0] = 999;
    assert!(run_ragged(config(), &rows).is_ok());
}

#[test]
fn i64_max_id() {
    let mut values: Vec<i64> = (0..8).flat_map(|r| [r, r + 100]).collect();
    values[13] = i64::MAX; // row 6
    let splits: Vec<i64> = (0..=8).map(|r| 2 * r).collect();
    let input = RaggedInput::from_i64("f0", &values, &splits).unwrap();
    let e = err(prep(config()).run(&[&input], &mut Output::new()));
    assert_id_out_of_range(&e, 6, i64::MAX);

    // i64 ids that would narrow to a valid i32 (2^32 + 1 -> 1) are rejected too.
    values[13] = (1i64 << 32) + 1;
    let input = RaggedInput::from_i64("f0", &values, &splits).unwrap();
    assert_id_out_of_range(
        &err(prep(config()).run(&[&input], &mut Output::new())),
        6,
        (1i64 << 32) + 1,
    );
}

#[test]
fn bad_ids_in_dense_and_coo_inputs() {
    // Dense i64: row 3 col 1.
    let mut ids = Array2::<i64>::from_shape_fn((8, 2), |(r, c)| (r as i64) + 100 * c as i64);
    ids[[3, 1]] = -7;
    let input = DenseInput::from_i64(ids.view());
    assert_id_out_of_range(
        &err(prep(config()).run(&[&input], &mut Output::new())),
        3,
        -7,
    );

    // COO: entry of row 4 has id 5000.
    let indices: Vec<i64> = (0..8).flat_map(|r| [r, 0]).collect();
    let mut values: Vec<i32> = (0..8).collect();
    values[4] = 5000;
    let input = CooInput::new("f0", &indices, Ids::I32(&values), 8).unwrap();
    assert_id_out_of_range(
        &err(prep(config()).run(&[&input], &mut Output::new())),
        4,
        5000,
    );
}

#[test]
fn bad_ids_without_validation_do_not_panic() {
    let cfg = config_with(|v| v["config"]["validate_ids"] = json!(false));
    let splits: Vec<i64> = (0..=8).map(|r| 2 * r).collect();
    for bad in [-1i64, 1000, i64::MAX, i64::MIN, -(1 << 40)] {
        let mut values: Vec<i64> = (0..8).flat_map(|r| [r, r + 100]).collect();
        values[5] = bad;
        let input = RaggedInput::from_i64("f0", &values, &splits).unwrap();
        let mut p = prep(cfg.clone());
        let mut out = Output::new();
        let r = no_panic(|| p.run(&[&input], &mut out));
        match r {
            Err(panic) => panic!("id {bad} with validate_ids = false panicked: {panic}"),
            Ok(Err(Error::IdOutOfRange { .. })) => {
                panic!("id {bad}: validate_ids = false still validated")
            }
            Ok(_) => {}
        }
    }
    // Dense too.
    let mut ids = Array2::<i32>::from_shape_fn((8, 2), |(r, c)| r as i32 + 100 * c as i32);
    ids[[1, 0]] = -5;
    ids[[2, 1]] = i32::MAX;
    let input = DenseInput::from_i32(ids.view());
    let r = no_panic(|| prep(cfg.clone()).run(&[&input], &mut Output::new()).is_ok());
    assert!(
        r.is_ok(),
        "dense with validate_ids = false panicked: {:?}",
        r.err()
    );
}

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

fn run_weighted(cfg: Config, weights: &[f32]) -> Result<Output, Error> {
    let (values, splits) = ragged(&good_rows());
    let input = RaggedInput::from_i32("f0", &values, &splits)?.with_weights("f0", weights)?;
    let mut out = Output::new();
    prep(cfg).run(&[&input], &mut out)?;
    Ok(out)
}

#[test]
fn nan_weight() {
    let mut w = vec![1.0f32; 16];
    w[7] = f32::NAN; // row 3
    let e = err(run_weighted(config(), &w));
    assert!(
        matches!(&e, Error::InvalidWeight { feature, row: 3, value } if feature == "f0" && value.is_nan()),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "row 3", "NaN", "not finite"]);
}

#[test]
fn infinite_weights() {
    for (inf, text) in [(f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
        let mut w = vec![1.0f32; 16];
        w[12] = inf; // row 6
        let e = err(run_weighted(config(), &w));
        assert!(
            matches!(&e, Error::InvalidWeight { feature, row: 6, value } if feature == "f0" && *value == inf),
            "{e:?}"
        );
        assert_msg(&e, &["feature `f0`", "row 6", text, "not finite"]);
    }
}

#[test]
fn negative_and_zero_weights_are_accepted() {
    let w: Vec<f32> = (0..16)
        .map(|i| {
            if i % 3 == 0 {
                -0.5
            } else if i % 3 == 1 {
                0.0
            } else {
                -0.0
            }
        })
        .collect();
    for combiner in ["sum", "mean", "sqrtn"] {
        let cfg = config_with(|v| v["tables"][0]["combiner"] = json!(combiner));
        let r = run_weighted(cfg, &w);
        assert!(r.is_ok(), "{combiner}: {:?}", r.err());
    }
}

#[test]
fn ragged_weights_of_different_length() {
    let (values, splits) = ragged(&good_rows());
    let w = vec![1.0f32; 15];
    let e = err(RaggedInput::from_i32("f0", &values, &splits)
        .unwrap()
        .with_weights("f0", &w));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "15 weights for 16 ids"]);
}

#[test]
fn dense_weights_of_another_shape() {
    let ids = Array2::<i32>::zeros((8, 2));
    for shape in [(8, 3), (8, 1), (4, 2), (2, 8)] {
        let w = Array2::<f32>::ones(shape);
        let e = err(DenseInput::from_i32(ids.view()).with_weights("f0", w.view()));
        assert!(
            matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
            "{e:?}"
        );
        assert_msg(&e, &["feature `f0`", &format!("{shape:?}"), "(8, 2)"]);
    }
}

#[test]
fn custom_dense_source_with_narrower_weights() {
    // A user-written source whose weights have fewer columns than its ids.
    let ids = Array2::<i32>::from_shape_fn((8, 2), |(r, c)| r as i32 + 100 * c as i32);
    let w = Array2::<f32>::ones((8, 1));
    let input = Custom::new(
        8,
        true,
        FeatureView::Dense {
            ids: DenseIds::I32(ids.view()),
            weights: Some(w.view()),
        },
    );
    let e = err(prep(config()).run(&[&input], &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "(8, 1)", "(8, 2)"]);
}

#[test]
fn arrow_weights_rows_of_different_length() {
    let ids = list_i32(some_rows(&[vec![1, 2], vec![3], vec![4, 5], vec![6]]));
    // Same total length (6), same row count, but row 0 has 1 weight for 2 ids.
    let weights = list_f32(some_rows(&[
        vec![1.0],
        vec![1.0, 1.0],
        vec![1.0, 1.0],
        vec![1.0],
    ]));
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let batch = record_batch(vec![("f0", ids), ("w0", weights)]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::WeightsShape { feature, row: 0, ids: 2, weights: 1 } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "row 0", "1 weights for 2 ids"]);
}

#[test]
fn arrow_weights_with_different_row_count() {
    let ids = list_i32(some_rows(&[vec![1], vec![2], vec![3], vec![4]]));
    let weights = list_f32(some_rows(&[vec![1.0], vec![1.0], vec![1.0, 1.0]]));
    let e = err(ArrowListInput::new(
        "f0",
        "f0",
        ids.as_ref(),
        Some(("w0", weights.as_ref())),
    ));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "`w0`", "3 rows", "`f0`", "4"]);
}

// ---------------------------------------------------------------------------------------------
// Input structure
// ---------------------------------------------------------------------------------------------

#[test]
fn row_splits_that_decrease() {
    let values = [1, 2, 3, 4];
    let e = err(RaggedInput::from_i32("f0", &values, &[0, 2, 1, 4]));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["feature `f0`", "row_splits decrease at row 1", "2 then 1"],
    );

    let values64 = [1i64, 2, 3, 4];
    let e = err(RaggedInput::from_i64("f0", &values64, &[0, 3, 2, 4]));
    assert!(matches!(e, Error::InvalidInput { .. }), "{e:?}");
    assert_msg(&e, &["decrease", "3 then 2"]);
}

#[test]
fn row_splits_that_overrun_the_values() {
    let values = [1, 2, 3, 4];
    let e = err(RaggedInput::from_i32("f0", &values, &[0, 2, 5]));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "row_splits end at 5", "4 values"]);

    let values64 = [1i64, 2];
    let e = err(RaggedInput::from_i64("f0", &values64, &[0, 1, i64::MAX]));
    assert!(matches!(e, Error::InvalidInput { .. }), "{e:?}");
    assert_msg(&e, &["9223372036854775807", "2 values"]);
}

#[test]
fn row_splits_empty_or_negative() {
    let values = [1, 2];
    let e = err(RaggedInput::from_i32("f0", &values, &[]));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "row_splits cannot be empty"]);

    let e = err(RaggedInput::from_i32("f0", &values, &[-1, 2]));
    assert!(matches!(e, Error::InvalidInput { .. }), "{e:?}");
    assert_msg(&e, &["feature `f0`", "row_splits[0] = -1", "negative"]);
}

#[test]
fn coo_indices_unsorted_by_row() {
    let indices = [0i64, 0, 2, 0, 1, 0];
    let values = [1i32, 2, 3];
    let e = err(CooInput::new("f0", &indices, Ids::I32(&values), 4));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "feature `f0`",
            "not sorted by row",
            "entry 2",
            "row 1 after row 2",
        ],
    );
}

#[test]
fn coo_row_outside_batch() {
    let values = [1i32, 2];
    let e = err(CooInput::new("f0", &[0, 0, 4, 0], Ids::I32(&values), 4));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "indices[1] has row 4", "batch of 4"]);

    let e = err(CooInput::new("f0", &[-1, 0, 0, 0], Ids::I32(&values), 4));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "indices[0] has row -1", "batch of 4"]);

    let e = err(CooInput::new(
        "f0",
        &[i64::MIN, 0, 0, 0],
        Ids::I32(&values),
        4,
    ));
    assert!(matches!(e, Error::InvalidInput { .. }), "{e:?}");
}

#[test]
fn coo_indices_length_mismatch() {
    let values = [1i64, 2, 3];
    let e = err(CooInput::new("f0", &[0, 0, 1, 0], Ids::I64(&values), 4));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["feature `f0`", "indices hold 4 values", "2 * nnz = 6"],
    );

    let e = err(CooInput::new("f0", &[0, 0, 1], Ids::I64(&values[..1]), 4));
    assert!(matches!(e, Error::InvalidInput { .. }), "{e:?}");
    assert_msg(&e, &["indices hold 3 values", "2 * nnz = 2"]);
}

// Regression: `SampleSource` and `FeatureView` are public, but the extract stage trusts a view's
// invariants (offsets monotone and in bounds, `num_samples()` equal to the view's rows) that only
// the crate's own constructors establish. A user-written source whose `num_samples()` is larger
// than its view's rows makes `Offsets::range` index out of bounds: `run` panics on user data.
#[test]
fn custom_source_with_inconsistent_sample_count_is_an_error_not_a_panic() {
    let (values, splits) = ragged(&good_rows()); // 8 rows
    let input = Custom::new(
        16,
        false,
        FeatureView::Ragged {
            ids: Ids::I32(&values),
            offsets: Offsets::I32(&splits),
            weights: None,
        },
    );
    let mut p = prep(config());
    let mut out = Output::new();
    let r = no_panic(|| p.run(&[&input], &mut out));
    match r {
        Err(panic) => panic!("BUG: run panicked on a custom SampleSource: {panic}"),
        Ok(r) => {
            let e = err(r);
            assert!(
                matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
                "{e:?}"
            );
        }
    }
}

// Regression: same root cause: a custom `FeatureView::Ragged` with decreasing offsets (which
// `RaggedInput::new` would reject) reaches `ids[a..b]` with a > b and panics instead of returning
// `InvalidInput`.
#[test]
fn custom_source_with_unvalidated_offsets_is_an_error_not_a_panic() {
    let values: Vec<i32> = (0..16).collect();
    let bad_splits: Vec<i32> = vec![0, 2, 1, 6, 8, 10, 12, 14, 40];
    let input = Custom::new(
        8,
        false,
        FeatureView::Ragged {
            ids: Ids::I32(&values),
            offsets: Offsets::I32(&bad_splits),
            weights: None,
        },
    );
    let mut p = prep(config());
    let mut out = Output::new();
    let r = no_panic(|| p.run(&[&input], &mut out));
    match r {
        Err(panic) => {
            panic!("BUG: run panicked on unvalidated offsets from a custom SampleSource: {panic}")
        }
        Ok(r) => {
            let e = err(r);
            assert!(
                matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
                "{e:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Arrow
// ---------------------------------------------------------------------------------------------

fn good_arrow_ids() -> ArrayRef {
    list_i32(some_rows(&good_rows()))
}

#[test]
fn arrow_missing_ids_column() {
    let batch = record_batch(vec![("other", good_arrow_ids()), ("x", good_arrow_ids())]);
    let cfg = config();
    let e = err(features_from_record_batch(&cfg, &batch));
    match &e {
        Error::MissingColumn {
            feature,
            column,
            available,
        } => {
            assert_eq!(feature, "f0");
            assert_eq!(column, "f0");
            assert_eq!(available, "other, x");
        }
        other => panic!("expected MissingColumn, got {other:?}"),
    }
    assert_msg(&e, &["feature `f0`", "column `f0`", "other, x"]);

    // Through the preprocessor, with an explicit column name.
    let cfg = config_with(|v| v["features"][0]["column"] = json!("ids_col"));
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::MissingColumn { column, .. } if column == "ids_col"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "`ids_col`", "other, x"]);
}

#[test]
fn arrow_missing_weights_column() {
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let batch = record_batch(vec![("f0", good_arrow_ids())]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::MissingColumn { feature, column, available } if feature == "f0" && column == "w0" && available == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "column `w0`", "(columns: f0)"]);
}

#[test]
fn arrow_ids_column_of_list_utf8() {
    let mut b = ListBuilder::new(StringBuilder::new());
    for _ in 0..8 {
        b.values().append_value("a");
        b.append(true);
    }
    let batch = record_batch(vec![("f0", Arc::new(b.finish()) as ArrayRef)]);
    let e = err(prep(config()).run_record_batch(&batch, &mut Output::new()));
    match &e {
        Error::ColumnType {
            feature,
            column,
            expected,
            found,
        } => {
            assert_eq!(feature, "f0");
            assert_eq!(column, "f0");
            assert!(expected.contains("List<Int32>"), "{expected}");
            assert!(found.contains("Utf8"), "{found}");
        }
        other => panic!("expected ColumnType, got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "feature `f0`",
            "column `f0`",
            "Utf8",
            "List<Int32>",
            "List<Int64>",
        ],
    );
}

#[test]
fn arrow_ids_column_of_int32() {
    let batch = record_batch(vec![(
        "f0",
        Arc::new(Int32Array::from((0..8).collect::<Vec<i32>>())) as ArrayRef,
    )]);
    let e = err(prep(config()).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::ColumnType { feature, column, found, .. } if feature == "f0" && column == "f0" && found == "Int32"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &["feature `f0`", "column `f0`", "type Int32", "List<Int32>"],
    );
}

#[test]
fn arrow_weights_column_of_list_float64() {
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let weights: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Float64Type, _, _>(
        some_rows(&(0..8).map(|_| vec![1.0f64, 1.0]).collect::<Vec<_>>()),
    ));
    let batch = record_batch(vec![("f0", good_arrow_ids()), ("w0", weights)]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    match &e {
        Error::ColumnType {
            feature,
            column,
            expected,
            found,
        } => {
            assert_eq!(feature, "f0");
            assert_eq!(column, "w0");
            assert!(expected.contains("List<Float32>"), "{expected}");
            assert!(found.contains("Float64"), "{found}");
        }
        other => panic!("expected ColumnType, got {other:?}"),
    }
    assert_msg(
        &e,
        &["feature `f0`", "column `w0`", "Float64", "List<Float32>"],
    );

    // A weights column that is not a list at all.
    let mut fb = Float64Builder::new();
    fb.append_slice(&[1.0; 8]);
    let batch = record_batch(vec![
        ("f0", good_arrow_ids()),
        ("w0", Arc::new(fb.finish()) as ArrayRef),
    ]);
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::ColumnType { column, found, .. } if column == "w0" && found == "Float64"),
        "{e:?}"
    );
}

#[test]
fn arrow_null_list() {
    let mut rows = some_rows(&good_rows());
    rows[3] = None;
    let batch = record_batch(vec![("f0", list_i32(rows))]);
    let e = err(prep(config()).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "column `f0`", "1 null lists"]);

    // Null weights lists too.
    let mut wrows = some_rows(&(0..8).map(|_| vec![1.0f32, 1.0]).collect::<Vec<_>>());
    wrows[0] = None;
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let batch = record_batch(vec![("f0", good_arrow_ids()), ("w0", list_f32(wrows))]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["column `w0`", "null lists"]);
}

#[test]
fn arrow_null_value_inside_list() {
    let mut rows = some_rows(&good_rows());
    rows[2] = Some(vec![Some(2), None]);
    let batch = record_batch(vec![("f0", list_i32(rows))]);
    let e = err(prep(config()).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "feature `f0`",
            "column `f0`",
            "1 null values inside its lists",
        ],
    );

    // A null weight.
    let mut wb = ListBuilder::new(Float32Builder::new());
    for r in 0..8 {
        wb.values().append_value(1.0);
        if r == 5 {
            wb.values().append_null();
        } else {
            wb.values().append_value(1.0);
        }
        wb.append(true);
    }
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let batch = record_batch(vec![
        ("f0", good_arrow_ids()),
        ("w0", Arc::new(wb.finish()) as ArrayRef),
    ]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["column `w0`", "null values"]);
}

#[test]
fn arrow_bad_values_reported_with_feature() {
    // Id and weight validation also applies to Arrow input; LargeList<Int64> ids work.
    let rows: Vec<Vec<i64>> = (0..8)
        .map(|r| {
            if r == 7 {
                vec![r, 1000]
            } else {
                vec![r, r + 100]
            }
        })
        .collect();
    let ids: ArrayRef = Arc::new(LargeListArray::from_iter_primitive::<Int64Type, _, _>(
        some_rows(&rows),
    ));
    let batch = record_batch(vec![("f0", ids)]);
    assert_id_out_of_range(
        &err(prep(config()).run_record_batch(&batch, &mut Output::new())),
        7,
        1000,
    );

    let mut wb = ListBuilder::new(Float32Builder::new());
    for r in 0..8 {
        wb.values()
            .append_slice(&[1.0, if r == 4 { f32::NAN } else { 1.0 }]);
        wb.append(true);
    }
    let cfg = config_with(|v| v["features"][0]["weights_column"] = json!("w0"));
    let batch = record_batch(vec![
        ("f0", good_arrow_ids()),
        ("w0", Arc::new(wb.finish()) as ArrayRef),
    ]);
    let e = err(prep(cfg).run_record_batch(&batch, &mut Output::new()));
    assert!(
        matches!(&e, Error::InvalidWeight { feature, row: 4, .. } if feature == "f0"),
        "{e:?}"
    );

    // Sanity: the same batch without the NaN is fine.
    let mut ib = ListBuilder::new(Int32Builder::new());
    for r in good_rows() {
        ib.values().append_slice(&r);
        ib.append(true);
    }
    let batch = record_batch(vec![("f0", Arc::new(ib.finish()) as ArrayRef)]);
    assert!(prep(config())
        .run_record_batch(&batch, &mut Output::new())
        .is_ok());
}

// ---------------------------------------------------------------------------------------------
// Per-partition limits
// ---------------------------------------------------------------------------------------------

/// 8 samples; SparseCore 0 takes samples 0 and 1, which both hold `hot` (ids in partition 0).
fn hot_rows(hot: &[i32]) -> Vec<Vec<i32>> {
    (0..8)
        .map(|r| if r < 2 { hot.to_vec() } else { vec![r + 1] })
        .collect()
}

#[test]
fn max_ids_per_partition_exceeded() {
    // 10 distinct ids of partition 0 in each of 2 samples: 20 ids, 10 unique; limit 16.
    let hot: Vec<i32> = (0..10).map(|i| 4 * i).collect();
    let e = err(run_ragged(config(), &hot_rows(&hot)));
    match &e {
        Error::LimitExceeded {
            stack,
            kind: LimitKind::MaxIds,
            observed: 20,
            limit: 16,
            device: 0,
            sparsecore: 0,
            partition: 0,
        } => {
            assert_eq!(stack, "t0")
        }
        other => panic!("expected LimitExceeded(MaxIds), got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "Observed max ids per partition: 20",
            "is greater than the set max ids per partition",
            ": 16",
            "allow_id_dropping",
        ],
    );

    let out = run_ragged(
        config_with(|v| v["config"]["allow_id_dropping"] = json!(true)),
        &hot_rows(&hot),
    )
    .unwrap();
    let t0 = out.stack("t0").unwrap();
    assert_eq!(t0.stats.dropped_id_count, 4);
    assert_eq!(t0.stats.max_ids(), 20);
}

#[test]
fn max_unique_ids_per_partition_exceeded() {
    // 5 distinct ids of partition 0 in each of 2 samples: 10 ids (<= 16), 5 unique (> 4).
    let hot: Vec<i32> = (0..5).map(|i| 4 * i).collect();
    let cfg = config_with(|v| v["tables"][0]["max_unique_ids_per_partition"] = json!(4));
    let e = err(run_ragged(cfg, &hot_rows(&hot)));
    match &e {
        Error::LimitExceeded {
            stack,
            kind: LimitKind::MaxUniqueIds,
            observed: 5,
            limit: 4,
            device: 0,
            sparsecore: 0,
            partition: 0,
        } => {
            assert_eq!(stack, "t0")
        }
        other => panic!("expected LimitExceeded(MaxUniqueIds), got {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "stack `t0`",
            "Observed max unique ids per partition: 5",
            "is greater than the set max unique ids per partition",
            ": 4",
        ],
    );

    let cfg = config_with(|v| {
        v["tables"][0]["max_unique_ids_per_partition"] = json!(4);
        v["config"]["allow_id_dropping"] = json!(true);
    });
    let out = run_ragged(cfg, &hot_rows(&hot)).unwrap();
    let t0 = out.stack("t0").unwrap();
    assert!(t0.stats.dropped_id_count > 0);
    assert_eq!(t0.stats.dropped_id_count, 2); // id 16 of both samples
    assert_eq!(t0.stats.max_unique_ids(), 5);
}

#[test]
fn limit_exceeded_reports_device_sparsecore_and_partition() {
    // L = 2, G = 2: the hot samples are the first of device 1, SparseCore 2, partition 3.
    let cfg = config_with(|v| {
        v["config"]["local_device_count"] = json!(2);
        v["config"]["global_device_count"] = json!(2);
    });
    // 16 samples; nsps = 16 / 8 = 2; device 1 SC 2 takes rows (1*4+2)*2 = 12, 13.
    // N = 8: partition 3 ids are 3 + 8k.
    let hot: Vec<i32> = (0..9).map(|k| 3 + 8 * k).collect();
    let rows: Vec<Vec<i32>> = (0..16)
        .map(|r| {
            if r == 12 || r == 13 {
                hot.clone()
            } else {
                vec![r]
            }
        })
        .collect();
    let e = err(run_ragged(cfg, &rows));
    assert!(
        matches!(
            &e,
            Error::LimitExceeded {
                kind: LimitKind::MaxIds,
                observed: 18,
                limit: 16,
                device: 1,
                sparsecore: 2,
                partition: 3,
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["device 1", "SparseCore 2", "partition 3"]);
}

// ---------------------------------------------------------------------------------------------
// Recovery: an error leaves the Output and Preprocessor usable
// ---------------------------------------------------------------------------------------------

#[test]
fn errors_leave_output_and_preprocessor_reusable() {
    for threads in [None, Some(2)] {
        let cfg = config();
        let mut builder = Preprocessor::builder(cfg.clone()).small_batch_ids(0);
        if let Some(n) = threads {
            builder = builder.threads(n);
        }
        let mut p = builder.build().unwrap();
        let mut out = Output::new();

        let (gv, gs) = ragged(&good_rows());
        let good = RaggedInput::from_i32("f0", &gv, &gs).unwrap();
        let expected = prep(cfg.clone()).run_new(&[&good]).unwrap();

        // Bad id.
        let mut bad_rows = good_rows();
        bad_rows[3][0] = -1;
        let (bv, bs) = ragged(&bad_rows);
        let bad_id = RaggedInput::from_i32("f0", &bv, &bs).unwrap();
        assert!(matches!(
            p.run(&[&bad_id], &mut out),
            Err(Error::IdOutOfRange { .. })
        ));
        p.run(&[&good], &mut out).unwrap();
        assert_same_output(&out, &expected);

        // Limit exceeded (the buffers were filled before the check).
        let hot: Vec<i32> = (0..10).map(|i| 4 * i).collect();
        let (hv, hs) = ragged(&hot_rows(&hot));
        let hot_input = RaggedInput::from_i32("f0", &hv, &hs).unwrap();
        assert!(matches!(
            p.run(&[&hot_input], &mut out),
            Err(Error::LimitExceeded { .. })
        ));
        p.run(&[&good], &mut out).unwrap();
        assert_same_output(&out, &expected);

        // A batch of another size that fails the divisibility check, then one that plans
        // differently and fails later, then the good one again.
        let (dv, ds) = ragged(&(0..6).map(|r| vec![r]).collect::<Vec<_>>());
        let odd = RaggedInput::from_i32("f0", &dv, &ds).unwrap();
        assert!(matches!(
            p.run(&[&odd], &mut out),
            Err(Error::BatchNotDivisible { .. })
        ));
        let mut big_rows: Vec<Vec<i32>> = (0..16).map(|r| vec![r]).collect();
        big_rows[15] = vec![5000];
        let (lv, ls) = ragged(&big_rows);
        let big = RaggedInput::from_i32("f0", &lv, &ls).unwrap();
        assert!(matches!(
            p.run(&[&big], &mut out),
            Err(Error::IdOutOfRange { row: 15, .. })
        ));
        p.run(&[&good], &mut out).unwrap();
        assert_same_output(&out, &expected);

        // Invalid weights, then unweighted again.
        let w = vec![f32::NAN; 16];
        let weighted = RaggedInput::from_i32("f0", &gv, &gs)
            .unwrap()
            .with_weights("f0", &w)
            .unwrap();
        assert!(matches!(
            p.run(&[&weighted], &mut out),
            Err(Error::InvalidWeight { .. })
        ));
        // Wrong input count.
        assert!(matches!(
            p.run(&[], &mut out),
            Err(Error::InputCount { .. })
        ));
        p.run(&[&good], &mut out).unwrap();
        assert_same_output(&out, &expected);
    }
}

#[test]
fn record_batch_errors_leave_preprocessor_reusable() {
    let mut p = prep(config());
    let mut out = Output::new();
    let good = record_batch(vec![("f0", good_arrow_ids())]);
    p.run_record_batch(&good, &mut out).unwrap();
    let expected = out.clone();
    let missing = record_batch(vec![("zzz", good_arrow_ids())]);
    assert!(matches!(
        p.run_record_batch(&missing, &mut out),
        Err(Error::MissingColumn { .. })
    ));
    let mut rows = some_rows(&good_rows());
    rows[0] = None;
    let nulls = record_batch(vec![("f0", list_i32(rows))]);
    assert!(matches!(
        p.run_record_batch(&nulls, &mut out),
        Err(Error::InvalidInput { .. })
    ));
    p.run_record_batch(&good, &mut out).unwrap();
    assert_same_output(&out, &expected);
}

// ---------------------------------------------------------------------------------------------
// Golden-case loading (used by the CLI and the golden tests)
// ---------------------------------------------------------------------------------------------

fn case_json(feature: Value) -> String {
    let mut v = base();
    v["features"] = json!([feature]);
    v.to_string()
}

#[test]
fn case_missing_file_and_malformed_json() {
    let e = err(Case::from_path("/nonexistent/sparsecore-prep/case"));
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    assert_msg(&e, &["/nonexistent/sparsecore-prep/case"]);

    let e = err(Case::from_json("[1, 2"));
    assert!(
        matches!(&e, Error::Json { context, .. } if context == "case"),
        "{e:?}"
    );
    // A feature without batch sizes.
    let e = err(Case::from_json(&case_json(
        json!({"name": "f0", "table": "t0"}),
    )));
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert_msg(&e, &["local_batch_size"]);
}

#[test]
fn case_feature_errors() {
    let f = |extra: Value| {
        let mut v =
            json!({"name": "f0", "table": "t0", "local_batch_size": 4, "global_batch_size": 4});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        case_json(v)
    };
    // Unknown layout.
    let e = err(Case::from_json(&f(json!({"layout": "csr", "ids": [[1]]}))));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "unknown case layout", "csr"]);
    // No ids.
    let e = err(Case::from_json(&f(json!({"layout": "ragged"}))));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "no `ids`"]);
    // Weights rows of the wrong length / count.
    let e = err(Case::from_json(&f(
        json!({"ids": [[1, 2], [3]], "weights": [[1.0, 1.0], [1.0, 1.0]]}),
    )));
    assert!(
        matches!(&e, Error::WeightsShape { feature, row: 1, ids: 1, weights: 2 } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "row 1", "2 weights for 1 ids"]);
    let e = err(Case::from_json(&f(
        json!({"ids": [[1], [3]], "weights": [[1.0]]}),
    )));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["1 weight rows for 2 id rows"]);
    // Dense rows of different lengths.
    let e = err(Case::from_json(&f(
        json!({"layout": "dense", "ids": [[1, 2], [3]]}),
    )));
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["feature `f0`", "same length"]);
    // COO without indices / values, and with unsorted indices (rejected by `sources`).
    let e = err(Case::from_json(&f(json!({"layout": "coo", "values": [1]}))));
    assert_msg(&e, &["feature `f0`", "no `indices`"]);
    let e = err(Case::from_json(&f(
        json!({"layout": "coo", "indices": [[0, 0]]}),
    )));
    assert_msg(&e, &["feature `f0`", "no `values`"]);
    let case = Case::from_json(&f(json!({"layout": "coo", "indices": [[1, 0], [0, 0]], "values": [1, 2], "dense_shape": [4, 2]})))
        .unwrap();
    let e = err(case.sources());
    assert!(
        matches!(&e, Error::InvalidInput { feature, .. } if feature == "f0"),
        "{e:?}"
    );
    assert_msg(&e, &["not sorted by row"]);
}
