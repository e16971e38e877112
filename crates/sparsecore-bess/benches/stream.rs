//! Criterion benches of making the BESS stream: one `BessStream::draw` (sampling, negatives and
//! the Arrow columns) for every batch sampler (Random, Rigid, Rigid with shuffle) and negatives
//! configuration (none, flat with `k = ppp`, per triple with `k = 1`), at n = 4 and 64 on a
//! uniform graph of 20,000 entities and 400,000 triples, 256 triples per SparseCore. Throughput
//! is the batch's ids (head, tail and negative), the unit the pipeline's cost is measured in;
//! `tools/src/bin/bess_report.rs` sets the stream against preprocessing the same batches.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_bess::{synth, BessStream, Corruption, StreamSampler};

fn bench(c: &mut Criterion) {
    let n_entity = 20_000;
    let triples = synth::uniform(n_entity, 50, 400_000, 1);
    let shard_bs = 256;
    for n in [4usize, 64] {
        let ppp = shard_bs / n;
        let mut g = c.benchmark_group(format!("bess_stream/n{n}"));
        g.sample_size(20);
        g.warm_up_time(std::time::Duration::from_secs(1));
        g.measurement_time(std::time::Duration::from_secs(2));
        for (sampler, sname) in [
            (StreamSampler::Random, "random"),
            (StreamSampler::Rigid { shuffle: false }, "rigid"),
            (StreamSampler::Rigid { shuffle: true }, "rigid_shuffle"),
        ] {
            for (k, flat, nname) in [
                (0, true, "no_negatives"),
                (ppp, true, "flat"),
                (1, false, "per_triple"),
            ] {
                let mut stream = BessStream::builder()
                    .triples(triples.clone())
                    .n_entity(n_entity)
                    .devices(n / 4, n / 4, 4)
                    .shard_batch_size(shard_bs)
                    .negatives(k)
                    .flat_negatives(flat)
                    .corruption(Corruption::T)
                    .sampler(sampler)
                    .seed(7)
                    .build()
                    .expect("stream");
                let cnt = *stream.counts();
                let ids = stream.layout().local_sparsecores()
                    * (2 * cnt.triples_per_sparsecore + n * cnt.negative_ids_per_partition);
                g.throughput(Throughput::Elements(ids as u64));
                let steps = stream.steps();
                let mut step = 0;
                g.bench_function(format!("{sname}/{nname}"), |b| {
                    b.iter(|| {
                        let batch = stream.draw(step % steps).expect("draw");
                        step += 1;
                        batch
                    })
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
