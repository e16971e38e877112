//! Criterion benches of the whole pipeline per workload profile, through the public API, at 1 and
//! 2 threads. Throughput is reported in ids per second. The stages on their own are in
//! `benches/stages.rs`. `paths` covers what `end_to_end`'s workloads leave out (weights, raw keys,
//! minibatching), each on one profile.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{
    bench_paths, bench_workload, check_bench_path, generate, BENCH_PROFILES,
};

fn end_to_end(c: &mut Criterion) {
    let mut group = c.benchmark_group("end_to_end");
    group.sample_size(10);
    for (profile, batch) in BENCH_PROFILES {
        let w = bench_workload(profile, batch).expect("workload");
        let batch = &w.batches[0];
        group.throughput(Throughput::Elements(w.total_ids()));
        for threads in [1, 2] {
            let mut prep = Preprocessor::builder(w.config.clone())
                .threads(threads)
                .build()
                .unwrap();
            let mut out = Output::new();
            group.bench_function(format!("{}/threads={threads}", profile.name()), |b| {
                b.iter(|| prep.run_record_batch(batch, &mut out).unwrap())
            });
        }
    }
    group.finish();
}

/// The paths `end_to_end`'s workloads leave out (`bench_paths`: weights, raw keys, minibatching),
/// each on the same batches as `end_to_end`'s but for that change, so that the figures compare.
fn paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("paths");
    group.sample_size(10);
    for (name, spec) in bench_paths() {
        let w = generate(&spec).expect("workload");
        check_bench_path(name, &spec, &w).unwrap();
        let batch = &w.batches[0];
        let mut out = Output::new();
        group.throughput(Throughput::Elements(w.total_ids()));
        for threads in [1, 2] {
            let mut prep = Preprocessor::builder(w.config.clone())
                .threads(threads)
                .build()
                .unwrap();
            group.bench_function(format!("{name}/threads={threads}"), |b| {
                b.iter(|| prep.run_record_batch(batch, &mut out).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, end_to_end, paths);
criterion_main!(benches);
