//! Criterion benches of dynamic tables: lookups (`get_or_init` of 4096 existing keys, dim 16)
//! and updates (one Adagrad step on 4096 distinct keys) on the in-memory backend and, with the
//! `redis` feature, on a Redis server this bench starts on a random loopback port. Throughput
//! is keys per second. `redis-benchmark -t get,set,mget` on the same machine is the ceiling
//! for the Redis numbers (BENCHMARKS.md).

#[cfg(feature = "redis")]
use sparsecore_testkit::redis_server;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sparsecore_kernel::dynamic::{
    DynamicTable, DynamicTableSpec, Initializer, LoadStream, MemoryTable,
};
use sparsecore_kernel::Optimizer;

const KEYS: usize = 4096;
const DIM: usize = 16;

fn run(c: &mut Criterion, name: &str, table: &dyn DynamicTable) {
    let opt = Optimizer::Adagrad { lr: 0.05 };
    let stream = LoadStream {
        seed: 1,
        keys_per_batch: KEYS,
        key_space: 1 << 20,
        lookups_per_batch: 0,
        dim: DIM,
    };
    let (keys, grads) = stream.update(0);
    let mut rows = vec![0.0f32; KEYS * DIM];
    table.get_or_init(&keys, &mut rows).unwrap();
    let mut g = c.benchmark_group(format!("dynamic/{name}"));
    g.throughput(Throughput::Elements(KEYS as u64));
    g.sample_size(20);
    g.bench_function("lookup_4096x16", |b| {
        b.iter(|| table.get_or_init(&keys, &mut rows).unwrap())
    });
    g.bench_function("update_adagrad_4096x16", |b| {
        b.iter(|| table.apply_gradients(&keys, &grads, &opt).unwrap())
    });
    g.finish();
}

fn spec() -> DynamicTableSpec {
    DynamicTableSpec::new(
        "bench",
        DIM,
        &Optimizer::Adagrad { lr: 0.05 },
        Initializer::Uniform {
            scale: 0.05,
            seed: 1,
        },
    )
    .unwrap()
}

fn bench(c: &mut Criterion) {
    run(c, "memory", &MemoryTable::new(spec()));
    #[cfg(feature = "redis")]
    {
        let server = redis_server::RedisServer::start(redis_server::Persistence::None);
        let table = sparsecore_kernel::dynamic::RedisTable::open(
            spec(),
            sparsecore_kernel::dynamic::RedisConfig::new(&server.url()),
        )
        .unwrap();
        run(c, "redis", &table);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
