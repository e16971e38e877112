//! Golden cases: real outputs of the reference (jax-tpu-embedding 0.1.0), compared bit for bit.
//!
//! Runs every case directory of the repository's own sets (`testdata/reference/golden`,
//! `testdata/reference/golden_mb` with minibatching, and `testdata/reference_cases`), of the
//! shared sets `../shared/golden` and `../shared/golden_mb` when they are beside the checkout
//! (`sparsecore_testkit::sets`: a missing one is reported, and fails under `CI`), and with
//! `GOLDEN_DIR=/some/dir` every case under that directory. Each case is planned and
//! preprocessed from `input.json` alone and compared with `expected.json`: the planner with
//! `resolved`, row pointers exactly, ids and gain bits inside `valid_ranges`, the padding triple
//! everywhere else, stats exactly, and error cases by error kind and message.

use crate::common;

use std::path::Path;

use sparsecore_prep::Preprocessor;
use sparsecore_testkit::case::Case;
use sparsecore_testkit::sets;

/// Runs one case from `input.json` alone; `Err` describes the first mismatch. One thread runs
/// the tasks in order on the calling thread and two run them on a pool (`small_batch_ids(0)`:
/// every case is a small batch): both are checked.
fn check_case(dir: &Path) -> Result<(), String> {
    let case = Case::from_path(dir).map_err(|e| format!("loading: {e}"))?;
    let expected = common::load_json(&dir.join("expected.json"));
    for threads in [1, 2] {
        let builder = Preprocessor::builder(case.config.clone())
            .global_batch_sizes(case.global_batch_sizes())
            .threads(threads)
            .small_batch_ids(0);
        common::run_and_check(&case, builder, &expected)
            .map_err(|e| format!("{threads} thread(s): {e}"))?;
    }
    Ok(())
}

#[test]
fn golden_cases() {
    if let Some(root) = sets::shared_set("golden", "golden") {
        common::run_dir(&root, "golden", check_case);
    }
}

#[test]
fn golden_minibatching_cases() {
    if let Some(root) = sets::shared_set("golden_mb", "golden_mb") {
        common::run_dir(&root, "golden_mb", check_case);
    }
}

/// The repository's own golden cases, made by `scripts/make_reference_cases.sh`.
#[test]
fn repository_golden_cases() {
    let root = sets::testdata("reference/golden");
    common::run_dir(&root, "testdata golden", check_case);
}

/// The repository's own minibatching cases, made by `scripts/make_reference_cases.sh`.
#[test]
fn repository_golden_minibatching_cases() {
    let root = sets::testdata("reference/golden_mb");
    common::run_dir(&root, "testdata golden_mb", check_case);
}

/// Cases the reference dumped during our own differential campaign (testdata/reference_cases,
/// with a README of what each pins).
#[test]
fn reference_cases() {
    let root = sets::testdata("reference_cases");
    common::run_dir(&root, "reference cases", check_case);
}

#[test]
fn golden_dir_from_env() {
    if let Some(dir) = std::env::var_os("GOLDEN_DIR") {
        common::run_dir(Path::new(&dir), "golden (GOLDEN_DIR)", check_case);
    }
}
