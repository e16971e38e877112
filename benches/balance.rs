//! Criterion benches of balancing (src/balance/) per workload profile, beside preprocessing the
//! same window on one thread, so the two read as a ratio: 128 samples per SparseCore at 1/1/4,
//! windows of 1 and 4 batches, the test kit's limits doubled (as
//! `tools/src/bin/balance_report.rs`). Throughput is in ids per second.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_prep::balance::Balancer;
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

fn balance(c: &mut Criterion) {
    let mut group = c.benchmark_group("balance");
    group.sample_size(10);
    for profile in [
        Profile::Criteo,
        Profile::Long,
        Profile::LargeVocab,
        Profile::HighMultivalency,
        Profile::ModerateMultivalency,
    ] {
        let mut spec = WorkloadSpec::new(profile);
        spec.layout = (1, 1, 4);
        spec.batch_size = 512;
        spec.num_batches = 4;
        let mut w = generate(&spec).expect("workload");
        for t in &mut w.config.tables {
            t.max_ids_per_partition *= 2;
            t.max_unique_ids_per_partition *= 2;
            t.suggested_coo_buffer_size_per_device =
                t.suggested_coo_buffer_size_per_device.map(|b| b * 2);
        }
        group.throughput(Throughput::Elements(w.total_ids()));
        let mut prep = Preprocessor::builder(w.config.clone())
            .threads(1)
            .build()
            .unwrap();
        let mut out = Output::new();
        group.bench_function(format!("{}/preprocess", profile.name()), |b| {
            b.iter(|| {
                for batch in &w.batches {
                    prep.run_record_batch(batch, &mut out).unwrap();
                }
            })
        });
        let mut balancer = Balancer::new(w.config.clone()).unwrap();
        for window in [1, 4] {
            group.bench_function(format!("{}/balance W={window}", profile.name()), |b| {
                b.iter(|| {
                    for chunk in w.batches.chunks(window) {
                        balancer.balance(chunk).unwrap();
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, balance);
criterion_main!(benches);
