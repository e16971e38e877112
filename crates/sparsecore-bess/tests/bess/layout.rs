//! The SparseCore layout through the real pipeline: exact, equal per-cell counts.

use sparsecore_bess::{synth, BessStream, Corruption, NegativeKind, StreamSampler};
use sparsecore_prep::{Output, Preprocessor, StackOutput};

fn cell_counts(so: &StackOutput, n: usize, s: usize) -> Vec<Vec<i32>> {
    sparsecore_bess::cell_loads(so, s, n)
}

fn run(stream: BessStream, exact_with_negatives: bool) {
    let config = stream.config().clone();
    let counts = *stream.counts();
    let (n, s) = (
        stream.layout().num_sparsecores(),
        stream.layout().sc_per_device,
    );
    let mut prep = Preprocessor::new(config).unwrap();
    let mut out = Output::new();
    let mut batches = 0;
    for b in stream {
        let b = b.unwrap();
        prep.run_record_batch(&b.record_batch, &mut out).unwrap();
        let so = out.stack("entities").unwrap();
        assert_eq!(so.stats.dropped_id_count, 0);
        let limit = counts.max_ids_per_partition as i32;
        let st = &so.stats.max_ids_per_partition;
        if exact_with_negatives {
            // max = min = the precomputed limit in every slot.
            assert!(st.iter().all(|&v| v == limit), "{st:?} vs {limit}");
            for row in cell_counts(so, n, s) {
                assert!(row.iter().all(|&v| v == limit), "{row:?} vs {limit}");
            }
        } else {
            assert!(st.iter().all(|&v| v <= limit));
            for row in cell_counts(so, n, s) {
                assert!(
                    row.iter()
                        .all(|&v| v <= limit && v >= counts.positive_ids_per_partition as i32),
                    "{row:?}"
                );
            }
        }
        assert!(so
            .stats
            .max_unique_ids_per_partition
            .iter()
            .all(|&v| v <= limit));
        assert_eq!(
            so.coo_buffer_size_per_device(),
            counts.coo_buffer_size_per_device
        );
        batches += 1;
    }
    assert!(batches > 0);
}

#[test]
fn positives_only_fill_every_cell_exactly() {
    for (l, g, s, alpha) in [(1, 1, 4, 0.0), (2, 2, 2, 1.1), (1, 4, 4, 1.1)] {
        let n = g * s;
        let e = 50 * n;
        let triples = if alpha == 0.0 {
            synth::uniform(e, 7, 40 * n * n, 3)
        } else {
            synth::power_law(e, 7, 40 * n * n, alpha, 3)
        };
        for sampler in [
            StreamSampler::Random,
            StreamSampler::Rigid { shuffle: false },
            StreamSampler::Rigid { shuffle: true },
        ] {
            let stream = BessStream::builder()
                .triples(triples.clone())
                .n_entity(e)
                .devices(l, g, s)
                .shard_batch_size(2 * n)
                .sampler(sampler)
                .seed(11)
                .steps(5)
                .build()
                .unwrap();
            assert_eq!(stream.counts().max_ids_per_partition, 4);
            run(stream, true);
        }
    }
}

#[test]
fn one_negative_per_row_keeps_every_cell_exact() {
    for (flat, corruption) in [
        (true, Corruption::T),
        (true, Corruption::Ht),
        (false, Corruption::H),
    ] {
        let stream = BessStream::builder()
            .triples(synth::power_law(400, 5, 3000, 1.0, 9))
            .n_entity(400)
            .devices(1, 1, 4)
            .shard_batch_size(8)
            .negatives(3)
            .flat_negatives(flat)
            .corruption(corruption)
            .seed(5)
            .steps(6)
            .build()
            .unwrap();
        run(stream, true);
    }
}

#[test]
fn type_and_triple_based_negatives_stay_within_the_limits() {
    let triples = synth::uniform(300, 4, 2000, 2);
    let typed = BessStream::builder()
        .triples(triples.clone())
        .n_entity(300)
        .shard_batch_size(8)
        .negatives(2)
        .flat_negatives(false)
        .negative_sampler(NegativeKind::TypeBased {
            type_offsets: vec![0, 100, 250],
        })
        .seed(1)
        .steps(4)
        .build()
        .unwrap();
    run(typed, true);
    let tails = ndarray::Array2::from_shape_fn((1, 12), |(_, c)| (c * 23 % 300) as i64);
    let listed = BessStream::builder()
        .triples(triples)
        .n_entity(300)
        .shard_batch_size(8)
        .negative_sampler(NegativeKind::TripleBased {
            neg_heads: None,
            neg_tails: Some(tails),
        })
        .sampler(StreamSampler::Rigid { shuffle: false })
        .seed(1)
        .steps(4)
        .build()
        .unwrap();
    run(listed, true);
}

#[test]
fn record_batch_ids_are_the_sharded_entities() {
    let triples = synth::uniform(200, 3, 1500, 4);
    let mut stream = BessStream::builder()
        .triples(triples.clone())
        .n_entity(200)
        .shard_batch_size(4)
        .negatives(2)
        .annotations(true)
        .seed(3)
        .steps(2)
        .build()
        .unwrap();
    let b = stream.next().unwrap().unwrap();
    let rb = &b.record_batch;
    let lists = |name: &str| {
        rb.column_by_name(name)
            .unwrap()
            .as_any()
            .downcast_ref::<arrow_array::ListArray>()
            .unwrap()
            .clone()
    };
    let (head, tail) = (lists("head"), lists("tail"));
    let tidx = rb
        .column_by_name("triple_idx")
        .unwrap()
        .as_any()
        .downcast_ref::<arrow_array::Int64Array>()
        .unwrap()
        .clone();
    let part = stream.partitioned().clone();
    let sh = stream.sharding().clone();
    let r = stream.counts().rows_per_sparsecore;
    let t = stream.counts().triples_per_sparsecore;
    for row in 0..rb.num_rows() {
        if row % r >= t {
            assert_eq!(head.value_length(row), 0);
            continue;
        }
        let idx = tidx.value(row) as usize;
        let orig = part.triple_sort_idx[idx] as usize;
        let h = head
            .value(row)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap()
            .value(0);
        let tl = tail
            .value(row)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap()
            .value(0);
        assert_eq!(h, stream.physical_id_of_entity(triples.head[orig]).unwrap());
        assert_eq!(
            tl,
            stream.physical_id_of_entity(triples.tail[orig]).unwrap()
        );
        // Back from the physical id to the entity.
        let (s, i) = stream.layout().shard_and_local(h);
        assert_eq!(
            sh.shard_and_idx_to_entity[[s, i as usize]],
            triples.head[orig]
        );
    }
}

#[test]
fn hosts_feed_their_own_sparsecores() {
    // G = 2 devices of S = 2 SparseCores: one host feeding both equals two hosts of one device
    // each, concatenated (host 0's rows first).
    let triples = synth::power_law(300, 4, 2500, 0.8, 6);
    let make = |l: usize, host: usize| {
        BessStream::builder()
            .triples(triples.clone())
            .n_entity(300)
            .devices(l, 2, 2)
            .host(host)
            .shard_batch_size(6)
            .negatives(2)
            .seed(8)
            .steps(3)
            .build()
            .unwrap()
    };
    let (mut both, mut h0, mut h1) = (make(2, 0), make(1, 0), make(1, 1));
    assert!(matches!(
        BessStream::builder()
            .triples(triples.clone())
            .n_entity(300)
            .devices(1, 2, 2)
            .host(2)
            .shard_batch_size(6)
            .build(),
        Err(sparsecore_bess::BessError::InvalidParameter { name: "host", .. })
    ));
    for step in 0..3 {
        let all = both.draw(step).unwrap().record_batch;
        let parts = [
            h0.draw(step).unwrap().record_batch,
            h1.draw(step).unwrap().record_batch,
        ];
        let joined = arrow_select::concat::concat_batches(&all.schema(), &parts).unwrap();
        assert_eq!(all, joined);
    }
}
