//! Criterion benches of the whole pipeline per workload profile, through the public API, at 1 and
//! 2 threads. Throughput is reported in ids per second. The stages on their own are in
//! `benches/stages.rs`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, Workload, WorkloadSpec};

fn workload(profile: Profile, batch: usize) -> Workload {
    let mut spec = WorkloadSpec::new(profile);
    spec.batch_size = batch;
    spec.layout = if profile == Profile::Criteo { (4, 4, 4) } else { (1, 1, 4) };
    generate(&spec).expect("workload")
}

/// The profiles and (smaller than default) batch sizes every bench runs.
const PROFILES: [(Profile, usize); 5] = [
    (Profile::Criteo, 4096),
    (Profile::Long, 2048),
    (Profile::LargeVocab, 2048),
    (Profile::HighMultivalency, 2048),
    (Profile::ModerateMultivalency, 4096),
];

fn end_to_end(c: &mut Criterion) {
    let mut group = c.benchmark_group("end_to_end");
    group.sample_size(10);
    for (profile, batch) in PROFILES {
        let w = workload(profile, batch);
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
