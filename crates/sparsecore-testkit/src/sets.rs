//! Where the tests find reference cases: the repository's own sets under `testdata/`, and the
//! project's shared sets in `../shared`, a folder beside the checkout that a plain clone does
//! not have (`SPARSECORE_SHARED=DIR` names another place, as for the Python tests and
//! `scripts/make_reference_cases.sh`).
//!
//! A test over a shared set asks [`shared_set`] for its folder. When the folder is there the
//! test runs every case in it. When it is not, the test prints that the set was not run and
//! passes, unless the environment variable `CI` is set (to anything but `""`, `0` or `false`,
//! as CI services set `CI=true`): then a missing set is a failure, so that CI never passes
//! with a set silently left out.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The workspace's root directory (the checkout).
pub fn repo_root() -> PathBuf {
    // This crate lives at crates/sparsecore-testkit in the workspace.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `rel` under the repository's `testdata/`, which every checkout has.
pub fn testdata(rel: &str) -> PathBuf {
    repo_root().join("testdata").join(rel)
}

/// The shared folder: `SPARSECORE_SHARED` when set, else `../shared` beside the checkout.
pub fn shared_root() -> PathBuf {
    match std::env::var_os("SPARSECORE_SHARED") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => repo_root().join("../shared"),
    }
}

/// Whether this run is CI's (`CI` set to anything but `""`, `0` or `false`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "FALSE"))
}

/// The folder `rel` of the shared set (for example `golden` or `bess/cases`), if it is there.
///
/// When it is not, `label` (the test's name for the set) is printed as not run, on the stderr
/// handle that the test harness does not capture, and `None` returned; under CI
/// ([`in_ci`]) this panics instead.
#[track_caller]
pub fn shared_set(rel: &str, label: &str) -> Option<PathBuf> {
    let dir = shared_root().join(rel);
    if dir.is_dir() {
        return Some(dir);
    }
    let shown = match std::env::var_os("SPARSECORE_SHARED") {
        Some(d) if !d.is_empty() => dir.display().to_string(),
        _ => format!("../shared/{rel}"),
    };
    if in_ci() {
        panic!(
            "{label}: the shared set {shown} is missing; CI runs every shared set, so ../shared \
             must be beside the checkout (or SPARSECORE_SHARED name it)"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "{label}: NOT RUN: the shared set {shown} is not there (the repository's own testdata/ \
         sets ran; with CI=true a missing shared set fails)"
    );
    None
}
