//! Criterion benches of the whole pipeline per workload profile, through the public API, at 1 and
//! 2 threads. Throughput is reported in ids per second. The stages on their own are in
//! `benches/stages.rs`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{bench_workload, BENCH_PROFILES};

fn end_to_end(c: &mut Criterion) {
    let mut group = c.benchmark_group("end_to_end");
    group.sample_size(10);
    for (profile, batch) in BENCH_PROFILES {
        let w = bench_workload(profile, batch).expect("workload");
        let batch = &w.batches[0];
        group.throughput(Throughput::Elements(w.total_ids()));
        for threads in [1, 2] {
            let mut prep = Preprocessor::builder(w.config.clone()).threads(threads).build().unwrap();
            let mut out = Output::new();
            group.bench_function(format!("{}/threads={threads}", profile.name()), |b| {
                b.iter(|| prep.run_record_batch(batch, &mut out).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, end_to_end);
criterion_main!(benches);
