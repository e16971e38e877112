//! Criterion benches of each pipeline stage (extract, sort + group, fill) on SparseCore 0 of each
//! profile's largest stack, one thread. They reach the stages through the unstable `internals`
//! feature: `cargo bench --features internals --bench stages`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use sparsecore_prep::extract::{extract_sc, ExtractScratch, StackCtx};
use sparsecore_prep::extracted::Extracted;
use sparsecore_prep::fill::{fill_segment, Segment};
use sparsecore_prep::group::{sort_and_group, Entry, Limits, ScStats, SortScratch};
use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::key::KeyFormat;
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{bench_workload, BENCH_PROFILES};

/// Each stage on SparseCore 0 of each profile's largest stack, one thread.
fn stages(c: &mut Criterion) {
    for (profile, batch) in BENCH_PROFILES {
        let w = bench_workload(profile, batch).expect("workload");
        let batch = &w.batches[0];
        let mut prep = Preprocessor::builder(w.config.clone())
            .threads(1)
            .build()
            .unwrap();
        let mut out = Output::new();
        prep.run_record_batch(batch, &mut out).unwrap();
        let plan = prep.plan().unwrap().clone();
        let features = features_from_record_batch(&w.config, batch).unwrap();
        let inputs: Vec<&dyn SampleSource> =
            features.iter().map(|f| f as &dyn SampleSource).collect();
        let ids = |s: &sparsecore_prep::spec::StackPlan| -> usize {
            s.features.iter().map(|&f| inputs[f].view().num_ids()).sum()
        };
        let stack = plan.stacks.iter().max_by_key(|s| ids(s)).unwrap();
        let layout = plan.layout;
        let bsd: usize = stack
            .features
            .iter()
            .map(|&f| inputs[f].num_samples() / layout.local_devices)
            .sum();
        let ctx = StackCtx {
            name: &stack.name,
            layout,
            combiner: stack.combiner,
            weighted: false,
            validate_ids: true,
            batch_per_sc: bsd / layout.sc_per_device,
            local_bits: KeyFormat::local_bits_for(
                layout.partition_bits(),
                stack.stack_vocab_size,
                true,
            ),
        };
        let limits = Limits {
            max_ids: stack.max_ids_per_partition,
            max_unique: stack.max_unique_ids_per_partition,
            drop: false,
        };
        let mut ex = Extracted::default();
        let mut ex_scratch = ExtractScratch::default();
        extract_sc(
            &ctx,
            &plan.features,
            &stack.features,
            &inputs,
            0,
            0,
            &mut ex,
            &mut ex_scratch,
        )
        .unwrap();
        let mut group = c.benchmark_group(format!("stages/{}/{}-sc0", profile.name(), stack.name));
        group.throughput(Throughput::Elements(ex.len() as u64));
        group.sample_size(20);
        group.bench_function("extract", |b| {
            b.iter(|| {
                extract_sc(
                    &ctx,
                    &plan.features,
                    &stack.features,
                    &inputs,
                    0,
                    0,
                    &mut ex,
                    &mut ex_scratch,
                )
                .unwrap()
            })
        });
        let mut scratch = SortScratch::default();
        let mut entries: Vec<Entry> = Vec::new();
        let mut stats = ScStats::default();
        let extracted = ex.clone();
        group.bench_function("sort_and_group", |b| {
            b.iter_batched_ref(
                || extracted.clone(),
                |ex| sort_and_group(ex, &mut scratch, limits, &mut entries, &mut stats),
                BatchSize::LargeInput,
            )
        });
        let cs = stack.coo_buffer_size_per_sc(&layout);
        let (mut rp, mut emb, mut smp, mut g) = (
            vec![0; layout.row_pointers_per_segment()],
            vec![0; cs],
            vec![0; cs],
            vec![0.0; cs],
        );
        group.bench_function("fill", |b| {
            b.iter(|| {
                let seg = Segment {
                    row_pointers: &mut rp,
                    embedding_ids: &mut emb,
                    sample_ids: &mut smp,
                    gains: &mut g,
                };
                fill_segment(
                    &entries,
                    layout.num_partitions(),
                    ctx.batch_per_sc as u32,
                    seg,
                )
            })
        });
        group.finish();
    }
}

criterion_group!(benches, stages);
criterion_main!(benches);
