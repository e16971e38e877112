//! `Plan::from_resolved` + `PreprocessorBuilder::plan`: a stacking decided elsewhere (the
//! reference's FeatureSpecs, as the Python drop-in reads them) drives the pipeline unchanged.
//!
//! Every golden case (the repository's own, and the shared sets when they are beside the
//! checkout) is run from its `resolved` block (the reference's own stacking result)
//! instead of our planner, and must still match `expected.json` bit for bit; the plan must equal
//! our planner's where both define it. Inconsistent placements are errors.

use crate::common;

use std::path::Path;

use serde_json::Value;
use sparsecore_prep::spec::{Placement, ResolvedStack};
use sparsecore_prep::{Config, Error, Plan, Preprocessor};
use sparsecore_testkit::case::Case;
use sparsecore_testkit::sets;

fn resolved(case: &Case) -> (Vec<Placement>, Vec<ResolvedStack>) {
    let r = &case.raw["resolved"];
    let gb = case.global_batch_sizes();
    let placements = r["features"]
        .as_array()
        .expect("resolved.features")
        .iter()
        .zip(gb)
        .map(|(f, global_batch_size)| Placement {
            stack: f["stack_name"].as_str().unwrap().to_string(),
            row_offset: f["row_offset"].as_u64().unwrap(),
            col_offset: f["col_offset"].as_u64().unwrap(),
            col_shift: f["col_shift"].as_u64().unwrap(),
            global_batch_size,
        })
        .collect();
    let stacks = r["stacks"]
        .as_object()
        .expect("resolved.stacks")
        .values()
        .map(|s: &Value| ResolvedStack {
            name: s["stack_name"].as_str().unwrap().to_string(),
            combiner: s["combiner"].as_str().unwrap().to_string(),
            max_ids_per_partition: s["max_ids_per_partition"].as_u64().unwrap(),
            max_unique_ids_per_partition: s["max_unique_ids_per_partition"].as_u64().unwrap(),
            suggested_coo_buffer_size_per_device: s["suggested_coo_buffer_size_per_device"]
                .as_u64(),
        })
        .collect();
    (placements, stacks)
}

fn check_case(dir: &Path) -> Result<(), String> {
    let case = Case::from_path(dir).map_err(|e| format!("loading: {e}"))?;
    let expected = common::load_json(&dir.join("expected.json"));
    let (placements, stacks) = resolved(&case);
    let plan = Plan::from_resolved(&case.config, &placements, &stacks)
        .map_err(|e| format!("from_resolved: {e}"))?;
    // Where both planners define a value, they agree with the reference's resolved block.
    let ours = Plan::new(&case.config, &case.global_batch_sizes())
        .map_err(|e| format!("planning: {e}"))?;
    for (a, b) in plan.features.iter().zip(&ours.features) {
        let key = |f: &sparsecore_prep::spec::FeaturePlan, p: &Plan| {
            (
                p.stacks[f.stack].name.clone(),
                f.row_offset,
                f.col_offset,
                f.col_shift,
            )
        };
        if key(a, &plan) != key(b, &ours) {
            return Err(format!(
                "feature {}: {:?} vs planner {:?}",
                a.name,
                key(a, &plan),
                key(b, &ours)
            ));
        }
    }
    for s in &plan.stacks {
        let o = ours
            .stack(&s.name)
            .ok_or(format!("stack {} not planned", s.name))?;
        let members = |p: &Plan, st: &sparsecore_prep::spec::StackPlan| -> Vec<String> {
            st.features
                .iter()
                .map(|&f| p.features[f].name.clone())
                .collect()
        };
        if members(&plan, s) != members(&ours, o)
            || s.coo_buffer_size_per_device != o.coo_buffer_size_per_device
            || s.row_pointers_per_device != o.row_pointers_per_device
            || s.stack_vocab_size > o.stack_vocab_size
        {
            return Err(format!("stack {} differs from the planner's", s.name));
        }
    }
    common::run_and_check(
        &case,
        Preprocessor::builder(case.config.clone())
            .plan(plan)
            .threads(2),
        &expected,
    )
}

#[test]
fn golden_cases_from_their_resolved_stacking() {
    if let Some(root) = sets::shared_set("golden", "golden (resolved)") {
        common::run_dir(&root, "golden (resolved)", check_case);
    }
    if let Some(root) = sets::shared_set("golden_mb", "golden_mb (resolved)") {
        common::run_dir(&root, "golden_mb (resolved)", check_case);
    }
}

#[test]
fn repository_golden_cases_from_their_resolved_stacking() {
    for set in ["golden", "golden_mb"] {
        let root = sets::testdata(&format!("reference/{set}"));
        common::run_dir(&root, &format!("testdata {set} (resolved)"), check_case);
    }
}

fn two_features() -> Config {
    Config::from_json(
        r#"{"config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
            "tables": [{"name": "t0", "vocabulary_size": 100, "embedding_dim": 8}],
            "features": [{"name": "a", "table": "t0"}, {"name": "b", "table": "t0"}]}"#,
    )
    .unwrap()
}

fn placement(stack: &str, row_offset: u64, col_shift: u64) -> Placement {
    Placement {
        stack: stack.into(),
        row_offset,
        col_offset: 0,
        col_shift,
        global_batch_size: 8,
    }
}

fn stack(name: &str, combiner: &str) -> ResolvedStack {
    ResolvedStack {
        name: name.into(),
        combiner: combiner.into(),
        max_ids_per_partition: 16,
        max_unique_ids_per_partition: 16,
        suggested_coo_buffer_size_per_device: None,
    }
}

#[test]
fn members_follow_row_offsets_not_config_order() {
    let plan = Plan::from_resolved(
        &two_features(),
        &[placement("s", 8, 0), placement("s", 0, 0)],
        &[stack("s", "mean")],
    )
    .unwrap();
    let s = &plan.stacks[0];
    assert_eq!(s.features, vec![1, 0]);
    assert_eq!(s.coo_buffer_size_per_device, 16 * 4 * 4);
    assert_eq!(s.stack_vocab_size, 128); // col_offset 0 + vocab 100 padded to 8 * N = 32
}

#[test]
fn inconsistent_placements_are_errors() {
    let config = two_features();
    let err = |p: &[Placement], s: &[ResolvedStack]| {
        Plan::from_resolved(&config, p, s).unwrap_err().to_string()
    };
    assert!(err(
        &[placement("s", 0, 0), placement("s", 0, 0)],
        &[stack("s", "sum")]
    )
    .contains("the same row_offset 0"));
    assert!(err(
        &[placement("s", 0, 0), placement("x", 8, 0)],
        &[stack("s", "sum")]
    )
    .contains("stack `x`"));
    assert!(err(
        &[placement("s", 0, 4), placement("s", 8, 0)],
        &[stack("s", "sum")]
    )
    .contains("col_shift 4"));
    assert!(err(
        &[placement("s", 0, 0), placement("s", 8, 0)],
        &[stack("s", "avg")]
    )
    .contains("unknown combiner"));
    let e =
        Plan::from_resolved(&config, &[placement("s", 0, 0)], &[stack("s", "sum")]).unwrap_err();
    assert!(matches!(
        e,
        Error::InputCount {
            expected: 2,
            got: 1
        }
    ));
}
