//! A driver for profilers (`perf`, `valgrind --tool=callgrind`): makes one stream configuration's
//! batches, optionally preprocessing each one after it is made (as in training, so the triple
//! table leaves the caches between steps), and prints the time per step of each part.
//!
//! `stream_profile SAMPLER NEGATIVES N [GRAPH] [STEPS] [PREP]`: SAMPLER `random`, `rigid` or
//! `shuffle`; NEGATIVES `none`, `flat` (k = ppp) or `triple` (per triple, k = 1); N 4, 16 or 64;
//! GRAPH `uniform` (default) or `power`; STEPS (default 200); PREP `1` (default) to preprocess
//! every batch, `0` to make the stream only.

use std::time::Instant;

use sparsecore_bess::{synth, BessStream, Corruption, StreamSampler};
use sparsecore_prep::{Output, Preprocessor};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let sampler = match arg(1, "random").as_str() {
        "random" => StreamSampler::Random,
        "rigid" => StreamSampler::Rigid { shuffle: false },
        "shuffle" => StreamSampler::Rigid { shuffle: true },
        s => panic!("sampler {s}"),
    };
    let n: usize = arg(3, "4").parse().expect("n");
    let shard_bs = 256;
    let ppp = shard_bs / n;
    let (k, flat) = match arg(2, "none").as_str() {
        "none" => (0, true),
        "flat" => (ppp, true),
        "triple" => (1, false),
        s => panic!("negatives {s}"),
    };
    let n_entity = 20_000;
    // STREAM_TRIPLES: another graph size (the table's 4 bytes a row against the caches).
    let m: usize = std::env::var("STREAM_TRIPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400_000);
    let triples = match arg(4, "uniform").as_str() {
        "uniform" => synth::uniform(n_entity, 50, m, 1),
        "power" => synth::power_law(n_entity, 50, m, 1.0, 1),
        s => panic!("graph {s}"),
    };
    let steps: usize = arg(5, "200").parse().expect("steps");
    let prep_on = arg(6, "1") == "1";
    let mut stream = BessStream::builder()
        .triples(triples)
        .n_entity(n_entity)
        .devices(n / 4, n / 4, 4)
        .shard_batch_size(shard_bs)
        .negatives(k)
        .flat_negatives(flat)
        .corruption(Corruption::T)
        .sampler(sampler)
        .seed(7)
        .steps(steps)
        .build()
        .expect("stream");
    let mut prep = Preprocessor::builder(stream.config().clone())
        .threads(1)
        .build()
        .expect("config");
    let mut out = Output::new();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let (mut make, mut pre) = (0.0, 0.0);
    pool.install(|| {
        for step in 0..steps {
            let t0 = Instant::now();
            let b = stream.draw(step).expect("draw");
            make += t0.elapsed().as_secs_f64();
            if prep_on {
                let t0 = Instant::now();
                prep.run_record_batch(&b.record_batch, &mut out)
                    .expect("no batch fails");
                pre += t0.elapsed().as_secs_f64();
            }
        }
    });
    println!(
        "stream {:.2} µs/step, preprocess {:.2} µs/step, ratio {:.1}%",
        make * 1e6 / steps as f64,
        pre * 1e6 / steps as f64,
        100.0 * make / pre
    );
}
