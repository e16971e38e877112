//! Criterion benches of the whole pipeline per workload profile, through the public API, at 1 and
//! 2 threads. Throughput is reported in ids per second. The stages on their own are in
//! `benches/stages.rs`. `paths` covers what `end_to_end`'s workloads leave out (weights, raw keys,
//! minibatching), each on one profile.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{bench_spec, bench_workload, generate, Profile, WorkloadSpec, BENCH_PROFILES};

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

/// `profile`'s bench spec at its `BENCH_PROFILES` batch size, with `change` applied: the same
/// batches as `end_to_end`'s but for that change, so that the two figures can be compared.
fn bench_spec_with(profile: Profile, change: impl FnOnce(&mut WorkloadSpec)) -> WorkloadSpec {
    let (_, batch) = BENCH_PROFILES.into_iter().find(|&(p, _)| p == profile).expect("a bench profile");
    let mut spec = bench_spec(profile, batch);
    change(&mut spec);
    spec
}

/// The weighted path (gains in the sort key), per-id hashing of string keys, and minibatching.
/// Weights on `long`, whose 100 ids per sample repeat within a sample, so gains are merged; raw
/// keys on `criteo`, the data they come from; minibatching on `moderate-multivalency`, whose ids
/// spread over the buckets evenly enough that halved limits split its batch (in 4) without putting
/// a single bucket over a limit.
fn paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("paths");
    group.sample_size(10);
    let cases = [
        ("long/weights", bench_spec_with(Profile::Long, |s| s.weights = true)),
        ("criteo/raw-keys", bench_spec_with(Profile::Criteo, |s| s.raw_keys = true)),
        ("moderate-multivalency/minibatching", bench_spec_with(Profile::ModerateMultivalency, |s| s.minibatching = Some(2))),
    ];
    for (name, spec) in cases {
        let w = generate(&spec).expect("workload");
        let batch = &w.batches[0];
        let ids = w.total_ids();
        assert!(ids > 0, "{name}: no ids counted");
        // Untimed: a limit too tight for minibatching would make its case a single pass, and a
        // buffer too small would drop ids, so that the bench would not measure what it names.
        let mut out = Output::new();
        Preprocessor::builder(w.config.clone()).threads(1).build().unwrap().run_record_batch(batch, &mut out).unwrap();
        if spec.minibatching.is_some() {
            assert!(out.num_minibatches > 1, "{name}: {} minibatch(es), expected a split", out.num_minibatches);
        }
        assert!(out.stacks.iter().all(|s| s.stats.dropped_id_count == 0), "{name}: ids dropped");
        group.throughput(Throughput::Elements(ids));
        for threads in [1, 2] {
            let mut prep = Preprocessor::builder(w.config.clone()).threads(threads).build().unwrap();
            group.bench_function(format!("{name}/threads={threads}"), |b| b.iter(|| prep.run_record_batch(batch, &mut out).unwrap()));
        }
    }
    group.finish();
}

criterion_group!(benches, end_to_end, paths);
criterion_main!(benches);
