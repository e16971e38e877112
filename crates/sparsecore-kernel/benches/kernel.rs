//! Criterion benches of the CPU backend: forward (sparse-dense matmul) and backward (gradient +
//! Adagrad step) on the criteo workload at dim 16 and 64. Throughput is reported as looked-up
//! rows per second and as bytes of table rows read per second. The stacks with vocabularies up
//! to 1e5 are used (criteo's largest tables would not fit this machine at dim 64).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ndarray::Array2;
use sparsecore_kernel::{apply_gradients, sparse_dense_matmul, Optimizer, Slots, StackedTable};
use sparsecore_prep::{Output, Preprocessor};
use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};

fn bench(c: &mut Criterion) {
    for dim in [16u64, 64] {
        let mut spec = WorkloadSpec::new(Profile::Criteo);
        spec.batch_size = 4096;
        let mut w = generate(&spec).unwrap();
        for t in &mut w.config.tables {
            t.embedding_dim = dim;
        }
        let mut prep = Preprocessor::builder(w.config.clone())
            .threads(1)
            .build()
            .unwrap();
        let mut out = Output::new();
        prep.run_record_batch(&w.batches[0], &mut out).unwrap();
        let plan = prep.plan().unwrap().clone();
        let small: Vec<usize> = (0..plan.stacks.len())
            .filter(|&i| plan.stacks[i].stack_vocab_size <= 100_000)
            .collect();
        let mut tables: Vec<StackedTable> = small
            .iter()
            .map(|&i| {
                let st = &plan.stacks[i];
                let t = &w.config.tables[st.tables[0]];
                let values = Array2::from_elem((t.vocabulary_size as usize, dim as usize), 0.5f32);
                StackedTable::from_tables(&plan, &st.name, &[values.view()]).unwrap()
            })
            .collect();
        let lookups: u64 = small
            .iter()
            .map(|&i| {
                let so = &out.stacks[i];
                so.embedding_ids.iter().filter(|&&e| e != i32::MAX).count() as u64
            })
            .sum();
        let bsd: Vec<usize> = small
            .iter()
            .map(|&i| plan.stacks[i].total_sample_count as usize)
            .collect();
        for (label, throughput) in [
            ("rows", Throughput::Elements(lookups)),
            ("bytes", Throughput::Bytes(lookups * dim * 4)),
        ] {
            let mut g = c.benchmark_group(format!("kernel/criteo/dim={dim}/{label}"));
            g.throughput(throughput);
            g.sample_size(10);
            g.bench_function("forward", |b| {
                b.iter(|| {
                    for (k, &i) in small.iter().enumerate() {
                        sparse_dense_matmul(&plan, &out.stacks[i], out.num_minibatches, &tables[k])
                            .unwrap();
                    }
                })
            });
            let opt = Optimizer::Adagrad { lr: 0.01 };
            let mut slots: Vec<Slots> = tables.iter().map(|t| Slots::new(t, &opt)).collect();
            let dacts: Vec<Array2<f32>> = bsd
                .iter()
                .map(|&n| Array2::from_elem((n, dim as usize), 0.01f32))
                .collect();
            g.bench_function("backward_adagrad", |b| {
                b.iter(|| {
                    for (k, &i) in small.iter().enumerate() {
                        apply_gradients(
                            &plan,
                            &out.stacks[i],
                            out.num_minibatches,
                            &[dacts[k].view()],
                            &opt,
                            &mut tables[k],
                            &mut slots[k],
                        )
                        .unwrap();
                    }
                })
            });
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
