//! The criterion bench `paths` checks, before timing, that each path measures what it names (ids
//! present, none dropped, minibatching split). CI builds the benches without running them, so
//! the same check runs here on every path's workload.

use sparsecore_testkit::workload::{bench_paths, check_bench_path, generate};

#[test]
fn every_bench_path_measures_what_it_names() {
    for (name, spec) in bench_paths() {
        let workload = generate(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Err(e) = check_bench_path(name, &spec, &workload) {
            panic!("{e}");
        }
    }
}
