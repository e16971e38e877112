//! Measures BESS on SparseCores against random batching (crates/sparsecore-bess/MEASUREMENTS.md):
//! per-cell balance, FDO-tuned buffers, Rigid's padding, and the cost of making the stream
//! against the cost of preprocessing it, on uniform and power-law graphs at n = 4, 16 and 64.
//!
//! `cargo run --release -p sparsecore-tools --bin bess_report [-- --quick]`

use std::sync::Arc;
use std::time::Instant;

use arrow_array::{ArrayRef, Int32Array, ListArray, RecordBatch};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field, Schema};
use sparsecore_bess::{
    cell_loads, synth, BatchOptions, BatchSampler, BessStream, Corruption, NumpyRng, PartitionMode,
    PartitionedTriples, SamplerKind, StreamSampler, Triples,
};
use sparsecore_prep::fdo::{tune, FdoStats};
use sparsecore_prep::{Config, Output, Preprocessor};

struct Loads {
    max: i32,
    min: i32,
    sum: f64,
    cells: f64,
    dropped: u64,
}

impl Loads {
    fn new() -> Self {
        Loads {
            max: 0,
            min: i32::MAX,
            sum: 0.0,
            cells: 0.0,
            dropped: 0,
        }
    }
    fn add(&mut self, cells: &[Vec<i32>]) {
        for row in cells {
            for &v in row {
                self.max = self.max.max(v);
                self.min = self.min.min(v);
                self.sum += f64::from(v);
                self.cells += 1.0;
            }
        }
    }
    fn mean(&self) -> f64 {
        self.sum / self.cells
    }
}

/// Runs batches through a fresh preprocessor: loads, FDO stats, tuned (max_ids, buffer per
/// device), and seconds spent preprocessing.
fn preprocess(config: &Config, batches: &[RecordBatch]) -> (Loads, u64, u64, f64) {
    let mut prep = Preprocessor::new(config.clone()).expect("config");
    let mut out = Output::new();
    let (s, n) = (
        config.config.num_sc_per_device,
        config.config.global_device_count * config.config.num_sc_per_device,
    );
    let mut loads = Loads::new();
    let mut stats: Option<FdoStats> = None;
    let mut secs = 0.0;
    for b in batches {
        let t0 = Instant::now();
        prep.run_record_batch(b, &mut out).expect("no batch fails");
        secs += t0.elapsed().as_secs_f64();
        let so = &out.stacks[0];
        loads.add(&cell_loads(so, s, n));
        loads.dropped += so.stats.dropped_id_count;
        let plan = prep.plan().expect("planned");
        stats
            .get_or_insert_with(|| FdoStats::new(plan.layout))
            .record(plan, &out)
            .expect("record");
    }
    let (tuned, _) = tune(config, stats.as_ref().expect("batches"), 1.0).expect("tune");
    let t = &tuned.tables[0];
    (
        loads,
        t.max_ids_per_partition,
        t.suggested_coo_buffer_size_per_device.unwrap_or(0),
        secs,
    )
}

fn one_id_lists(ids: &[Option<i32>]) -> ArrayRef {
    let mut offsets = vec![0i32];
    let mut values = Vec::new();
    for id in ids {
        values.extend(id.iter().copied());
        offsets.push(values.len() as i32);
    }
    Arc::new(ListArray::new(
        Arc::new(Field::new_list_field(DataType::Int32, false)),
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Arc::new(Int32Array::from(values)),
        None,
    ))
}

/// Random batching of the same shape: every SparseCore slice gets `t` triples drawn uniformly
/// from all triples and `neg` uniform negative entities, with the raw entity ids (mod sharded).
/// The shape of a batch: slices, rows per slice, triples and negatives per slice.
struct Shape {
    slices: usize,
    rows: usize,
    t: usize,
    neg: usize,
}

fn random_batches(
    triples: &Triples,
    n_entity: usize,
    shape: &Shape,
    steps: usize,
    seed: u64,
) -> Vec<RecordBatch> {
    let Shape {
        slices,
        rows,
        t,
        neg,
    } = *shape;
    let mut rng = NumpyRng::new(u128::from(seed));
    let list = DataType::List(Arc::new(Field::new_list_field(DataType::Int32, false)));
    let schema = Arc::new(Schema::new(vec![
        Field::new("head", list.clone(), false),
        Field::new("tail", list.clone(), false),
        Field::new("negative", list, false),
    ]));
    (0..steps)
        .map(|_| {
            let (mut h, mut tl, mut ng) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..slices {
                for r in 0..rows {
                    if r < t {
                        let i = (rng.integers_63() % triples.len() as u64) as usize;
                        h.push(Some(triples.head[i] as i32));
                        tl.push(Some(triples.tail[i] as i32));
                    } else {
                        h.push(None);
                        tl.push(None);
                    }
                    ng.push((r < neg).then(|| (rng.integers_63() % n_entity as u64) as i32));
                }
            }
            RecordBatch::try_new(
                schema.clone(),
                vec![one_id_lists(&h), one_id_lists(&tl), one_id_lists(&ng)],
            )
            .expect("batch")
        })
        .collect()
}

/// The measured stream: flat tail negatives, `k` per shard.
fn builder(
    triples: &Triples,
    n_entity: usize,
    (l, g, s): (usize, usize, usize),
    shard_bs: usize,
    k: usize,
    steps: usize,
) -> BessStream {
    cost_builder(
        triples,
        n_entity,
        (l, g, s),
        shard_bs,
        StreamSampler::Random,
        Negatives::Flat(k),
        steps,
    )
}

/// The negatives of a cost configuration.
#[derive(Debug, Clone, Copy)]
enum Negatives {
    None,
    /// Flat tail negatives, `k` per shard, shared by the SparseCore slice.
    Flat(usize),
    /// Per-triple tail negatives, `k` per shard for every triple.
    PerTriple(usize),
}

fn cost_builder(
    triples: &Triples,
    n_entity: usize,
    (l, g, s): (usize, usize, usize),
    shard_bs: usize,
    sampler: StreamSampler,
    neg: Negatives,
    steps: usize,
) -> BessStream {
    let (k, flat) = match neg {
        Negatives::None => (0, true),
        Negatives::Flat(k) => (k, true),
        Negatives::PerTriple(k) => (k, false),
    };
    BessStream::builder()
        .triples(triples.clone())
        .n_entity(n_entity)
        .devices(l, g, s)
        .shard_batch_size(shard_bs)
        .negatives(k)
        .flat_negatives(flat)
        .corruption(Corruption::T)
        .sampler(sampler)
        .seed(7)
        .steps(steps)
        .build()
        .expect("stream")
}

/// One measured configuration: per batch, microseconds making the stream and preprocessing it
/// on one thread and on two, ids per batch (Rigid shuffle's per-epoch order included).
struct Cost {
    graph: &'static str,
    sampler: &'static str,
    negatives: String,
    n: usize,
    rows: usize,
    ids: usize,
    one: (f64, f64),
    two: (f64, f64),
    /// Seconds building the stream (partitioning, the physical triple table, Rigid's table).
    build: f64,
}

/// Makes and preprocesses `steps` batches (after one untimed warm-up step), batch by batch in
/// one loop, `rounds` rounds, on `threads` threads; per batch the fastest round, averaged.
/// Rigid shuffle's order of an epoch is drawn at the warm-up step; the first step of the next
/// epoch (which draws that epoch's order), divided by the steps of an epoch, is added to the
/// stream's time per batch.
#[allow(clippy::too_many_arguments)]
fn cost(
    triples: &Triples,
    n_entity: usize,
    lgs: (usize, usize, usize),
    shard_bs: usize,
    sampler: StreamSampler,
    neg: Negatives,
    steps: usize,
    rounds: usize,
    threads: usize,
) -> (f64, f64) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    pool.install(|| {
        let (mut make, mut prep_secs) = (vec![f64::INFINITY; steps], vec![f64::INFINITY; steps]);
        let mut perm = f64::INFINITY;
        for _ in 0..rounds {
            let mut again = cost_builder(triples, n_entity, lgs, shard_bs, sampler, neg, steps + 1);
            let mut prep = Preprocessor::builder(again.config().clone())
                .threads(threads)
                .build()
                .expect("config");
            let mut out = Output::new();
            let b = again.draw(0).expect("draw");
            prep.run_record_batch(&b.record_batch, &mut out)
                .expect("no batch fails");
            drop(b);
            for k in 0..steps {
                let t0 = Instant::now();
                let b = again.draw(k + 1).expect("draw");
                make[k] = make[k].min(t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                prep.run_record_batch(&b.record_batch, &mut out)
                    .expect("no batch fails");
                prep_secs[k] = prep_secs[k].min(t0.elapsed().as_secs_f64());
            }
            if sampler == (StreamSampler::Rigid { shuffle: true }) {
                // The first step of the next epoch draws its order: that step, divided by the
                // steps of an epoch, is added (an upper bound of the order's share).
                let per_epoch = again.batch_sampler().steps_per_epoch();
                let t0 = Instant::now();
                let b = again.draw(per_epoch).expect("draw");
                perm = perm.min(t0.elapsed().as_secs_f64() / per_epoch as f64);
                drop(b);
            }
        }
        let perm = if perm.is_finite() { perm } else { 0.0 };
        (
            make.iter().sum::<f64>() / steps as f64 + perm,
            prep_secs.iter().sum::<f64>() / steps as f64,
        )
    })
}

/// The cost of making the stream against preprocessing it, for every sampler, negatives
/// configuration, graph and n.
fn cost_table(
    graphs: &[(&'static str, Triples)],
    n_entity: usize,
    shard_bs: usize,
    steps: usize,
    rounds: usize,
) {
    let mut rows = Vec::new();
    for (graph, triples) in graphs {
        for n in [4usize, 16, 64] {
            let (l, g, s) = (n / 4, n / 4, 4);
            let ppp = shard_bs / n;
            for (sampler, sname) in [
                (StreamSampler::Random, "Random"),
                (StreamSampler::Rigid { shuffle: false }, "Rigid"),
                (StreamSampler::Rigid { shuffle: true }, "Rigid shuffle"),
            ] {
                for neg in [
                    Negatives::None,
                    Negatives::Flat(ppp),
                    Negatives::PerTriple(1),
                ] {
                    let t0 = Instant::now();
                    let probe =
                        cost_builder(triples, n_entity, (l, g, s), shard_bs, sampler, neg, 1);
                    let build = t0.elapsed().as_secs_f64();
                    let c = *probe.counts();
                    let slices = l * s;
                    let ids =
                        slices * (2 * c.triples_per_sparsecore + n * c.negative_ids_per_partition);
                    let negatives = match neg {
                        Negatives::None => "none".to_string(),
                        Negatives::Flat(k) => format!("flat, k = {k}"),
                        Negatives::PerTriple(k) => format!("per triple, k = {k}"),
                    };
                    let one = cost(
                        triples,
                        n_entity,
                        (l, g, s),
                        shard_bs,
                        sampler,
                        neg,
                        steps,
                        rounds,
                        1,
                    );
                    let two = cost(
                        triples,
                        n_entity,
                        (l, g, s),
                        shard_bs,
                        sampler,
                        neg,
                        steps,
                        rounds,
                        2,
                    );
                    let row = Cost {
                        graph,
                        sampler: sname,
                        negatives,
                        n,
                        rows: slices * c.rows_per_sparsecore,
                        ids,
                        one,
                        two,
                        build,
                    };
                    eprintln!(
                        "  {} {} {} n={}: {:.1}% / {:.1}%",
                        row.graph,
                        row.sampler,
                        row.negatives,
                        n,
                        100.0 * one.0 / one.1,
                        100.0 * two.0 / two.1
                    );
                    rows.push(row);
                }
            }
        }
    }
    println!(
        "\nCost per batch: one thread each (CPU cost), then two threads each (wall time). ns/id: per id of the batch, one thread. build: once per stream."
    );
    println!("\n| graph | sampler | negatives | n | rows | ids | stream 1t (µs) | prep 1t (µs) | ratio 1t | stream 2t (µs) | prep 2t (µs) | ratio 2t | stream ns/id | prep ns/id | build (ms) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let (m1, p1) = r.one;
        let (m2, p2) = r.two;
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.1}% | {:.0} | {:.0} | {:.1}% | {:.2} | {:.2} | {:.0} |",
            r.graph,
            r.sampler,
            r.negatives,
            r.n,
            r.rows,
            r.ids,
            m1 * 1e6,
            p1 * 1e6,
            100.0 * m1 / p1,
            m2 * 1e6,
            p2 * 1e6,
            100.0 * m2 / p2,
            m1 * 1e9 / r.ids as f64,
            p1 * 1e9 / r.ids as f64,
            r.build * 1e3
        );
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let cost_only = std::env::args().any(|a| a == "--cost-only");
    let (n_entity, n_triples, steps) = if quick {
        (4_000, 200_000, 4)
    } else {
        (20_000, 400_000, 20)
    };
    let shard_bs = 256;
    let graphs = [
        ("uniform", synth::uniform(n_entity, 50, n_triples, 1)),
        (
            "power law a=1.0",
            synth::power_law(n_entity, 50, n_triples, 1.0, 1),
        ),
    ];
    let (cost_steps, rounds) = if quick { (4, 2) } else { (10, 5) };
    if cost_only {
        cost_table(&graphs, n_entity, shard_bs, cost_steps, rounds);
        return;
    }
    println!("E = {n_entity} entities, {n_triples} triples, 50 relations; shard batch size {shard_bs} triples per SparseCore; {steps} batches per row; flat tail negatives, k = ppp per shard.\n");
    println!("| graph | n (L,G,S) | batching | ids per cell max / mean / min | max/mean | dropped | tuned max_ids | buffer from tuned limits | tuned buffer per device | Rigid padding |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, triples) in &graphs {
        for n in [4usize, 16, 64] {
            let (l, g, s) = (n / 4, n / 4, 4);
            let ppp = shard_bs / n;
            // Positives only: every cell exactly 2·ppp.
            let mut pos = BessStream::builder()
                .triples(triples.clone())
                .n_entity(n_entity)
                .devices(l, g, s)
                .shard_batch_size(shard_bs)
                .seed(7)
                .steps(steps.min(5))
                .build()
                .expect("stream");
            let pos_batches: Vec<RecordBatch> = (0..pos.steps())
                .map(|k| pos.draw(k).expect("draw").record_batch)
                .collect();
            let (pl, ..) = preprocess(pos.config(), &pos_batches);
            let exact = pl.max == pl.min && pl.max as usize == pos.counts().max_ids_per_partition;
            // With negatives.
            let mut stream = builder(triples, n_entity, (l, g, s), shard_bs, ppp, steps);
            let c = *stream.counts();
            let batches: Vec<RecordBatch> = (0..steps)
                .map(|k| stream.draw(k).expect("draw").record_batch)
                .collect();
            let (bl, b_ids, b_buf, _) = preprocess(stream.config(), &batches);
            // Rigid's padding on the same graph and geometry.
            let part = stream.partitioned().clone();
            let rigid = BatchSampler::positives_only(
                Arc::new(PartitionedTriples::clone(&part)),
                BatchOptions {
                    shard_bs,
                    batches_per_step: 1,
                    duplicate_batch: false,
                    return_triple_idx: false,
                    kind: SamplerKind::Rigid { shuffle: None },
                },
                Corruption::T,
            )
            .expect("rigid");
            assert_eq!(part.mode, PartitionMode::HtShardPair);
            let pad = rigid.rigid_padding_fraction();
            // Random batching, same shape, raw ids, limits that cannot drop.
            let mut rc = stream.config().clone();
            let big = (2 * c.triples_per_sparsecore + c.negative_ids_per_partition * n) as u64;
            rc.tables[0].vocabulary_size = n_entity as u64;
            rc.tables[0].max_ids_per_partition = big;
            rc.tables[0].max_unique_ids_per_partition = big;
            rc.tables[0].suggested_coo_buffer_size_per_device = None;
            let shape = Shape {
                slices: l * s,
                rows: c.rows_per_sparsecore,
                t: c.triples_per_sparsecore,
                neg: c.negative_ids_per_partition * n,
            };
            let rb = random_batches(triples, n_entity, &shape, steps, 99);
            let (rl, r_ids, r_buf, _) = preprocess(&rc, &rb);
            println!(
                "| {name} | {n} ({l},{g},{s}) | BESS (positives only: max = min = {}: {}) | {} / {:.1} / {} | {:.2} | {} | {b_ids} | {} | {b_buf} | {:.1}% |",
                pos.counts().max_ids_per_partition,
                if exact { "yes" } else { "NO" },
                bl.max,
                bl.mean(),
                bl.min,
                f64::from(bl.max) / bl.mean(),
                bl.dropped,
                b_ids.div_ceil(8) * 8 * (s * n) as u64,
                100.0 * pad
            );
            println!(
                "| {name} | {n} ({l},{g},{s}) | random | {} / {:.1} / {} | {:.2} | {} | {r_ids} | {} | {r_buf} | |",
                rl.max,
                rl.mean(),
                rl.min,
                f64::from(rl.max) / rl.mean(),
                rl.dropped,
                r_ids.div_ceil(8) * 8 * (s * n) as u64
            );
            eprintln!(
                "  precomputed limit {} (2*ppp {} + negatives {}), buffer {}",
                c.max_ids_per_partition,
                c.positive_ids_per_partition,
                c.negative_ids_per_partition,
                c.coo_buffer_size_per_device
            );
        }
    }
    cost_table(&graphs, n_entity, shard_bs, cost_steps, rounds);
}
