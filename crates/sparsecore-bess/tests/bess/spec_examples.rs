//! SPEC.md's worked examples (sections 2-5), and the sharding file round trip.

use crate::common;

use std::sync::Arc;

use ndarray::{arr2, Array2};
use sparsecore_bess::{
    BatchOptions, BatchSampler, Corruption, NegativeSampler, PartitionMode, PartitionedTriples,
    RandomNegative, SamplerKind, Sharding, TripleBasedNegative, Triples,
};

fn sharding() -> Arc<Sharding> {
    Arc::new(Sharding::create(10, 4, &[1234], Some(&[0, 4, 7])).unwrap())
}

fn triples() -> Triples {
    Triples::from_rows(&[
        [0, 0, 1],
        [5, 1, 9],
        [2, 0, 3],
        [8, 1, 0],
        [1, 2, 4],
        [9, 0, 9],
        [3, 1, 2],
        [6, 2, 7],
    ])
}

#[test]
fn sharding_worked_example() {
    let s = sharding();
    assert_eq!(
        s.shard_and_idx_to_entity,
        arr2(&[[0, 9, 11], [2, 5, 6], [4, 7, 8], [1, 3, 10]])
    );
    assert_eq!(s.entity_to_shard, [0, 3, 1, 3, 2, 1, 1, 2, 2, 0]);
    assert_eq!(s.entity_to_idx, [0, 0, 0, 1, 0, 1, 2, 1, 2, 1]);
    assert_eq!(s.shard_counts, [2, 3, 3, 2]);
    assert_eq!(
        s.entity_type_counts.as_ref().unwrap(),
        arr2(&[[1, 0, 1], [1, 2, 0], [0, 1, 2], [2, 0, 0]])
    );
    assert_eq!(
        s.entity_type_offsets.as_ref().unwrap(),
        arr2(&[[0, 1, 1], [0, 1, 3], [0, 0, 1], [0, 2, 2]])
    );
}

#[test]
fn partition_worked_examples() {
    let p = PartitionedTriples::builder(sharding(), PartitionMode::HtShardPair)
        .n_relation(3)
        .build(&triples())
        .unwrap();
    assert_eq!(
        p.triple_counts,
        [1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    );
    assert_eq!(
        p.triple_offsets,
        [0, 1, 1, 1, 2, 3, 3, 4, 5, 6, 6, 6, 6, 6, 7, 8]
    );
    assert_eq!(p.triple_sort_idx, [5, 0, 1, 7, 2, 3, 6, 4]);
    assert_eq!(
        p.triples,
        arr2(&[
            [1, 0, 1],
            [0, 0, 0],
            [1, 1, 1],
            [2, 2, 1],
            [0, 0, 1],
            [2, 1, 0],
            [1, 1, 0],
            [0, 2, 0]
        ])
    );
    let p = PartitionedTriples::builder(sharding(), PartitionMode::HShard)
        .n_relation(3)
        .build(&triples())
        .unwrap();
    assert_eq!(p.triple_counts, [2, 3, 1, 2]);
    assert_eq!(p.triple_offsets, [0, 2, 5, 6]);
    assert_eq!(p.triple_sort_idx, [0, 5, 1, 2, 7, 3, 4, 6]);
    assert_eq!(
        p.triples,
        arr2(&[
            [0, 0, 1],
            [1, 0, 9],
            [1, 1, 9],
            [0, 0, 3],
            [2, 2, 7],
            [2, 1, 0],
            [0, 2, 4],
            [1, 1, 2]
        ])
    );
}

fn h_shard() -> Arc<PartitionedTriples> {
    Arc::new(
        PartitionedTriples::builder(sharding(), PartitionMode::HShard)
            .n_relation(3)
            .build(&triples())
            .unwrap(),
    )
}

#[test]
fn random_batch_worked_example() {
    let opts = BatchOptions {
        shard_bs: 2,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: true,
        kind: SamplerKind::Random {
            seed_words: vec![1234],
        },
    };
    let mut s = BatchSampler::new(h_shard(), opts, None).unwrap();
    let b = s.sample(0).unwrap();
    assert_eq!(
        b.triple_idx.unwrap().iter().copied().collect::<Vec<_>>(),
        [1, 0, 3, 3, 5, 5, 7, 7]
    );
    assert_eq!(
        b.head.iter().copied().collect::<Vec<_>>(),
        [1, 0, 0, 0, 2, 2, 1, 1]
    );
}

#[test]
fn rigid_batch_worked_example() {
    let opts = BatchOptions {
        shard_bs: 2,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: true,
        kind: SamplerKind::Rigid { shuffle: None },
    };
    let mut s = BatchSampler::new(h_shard(), opts, None).unwrap();
    assert_eq!(s.len(), 4);
    assert_eq!(s.steps_per_epoch(), 2);
    let flat = |b: &sparsecore_bess::Batch| {
        (
            b.sample_idx.iter().copied().collect::<Vec<_>>(),
            b.triple_mask
                .as_ref()
                .unwrap()
                .iter()
                .map(|&m| u8::from(m))
                .collect::<Vec<_>>(),
        )
    };
    let b0 = s.sample(0).unwrap();
    assert_eq!(
        flat(&b0),
        (vec![0, 1, 2, 3, 5, 5, 6, 7], vec![1, 1, 1, 1, 1, 0, 1, 1])
    );
    let b1 = s.sample(1).unwrap();
    assert_eq!(
        flat(&b1),
        (vec![0, 1, 4, 2, 5, 5, 6, 7], vec![0, 0, 1, 0, 0, 0, 0, 0])
    );
    // Padding: 8 real triples in 4 partitions x 4 positions.
    assert!((s.rigid_padding_fraction() - 0.5).abs() < 1e-12);
}

#[test]
fn rigid_shuffle_is_a_per_epoch_permutation_of_positions() {
    let opts = BatchOptions {
        shard_bs: 1,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: false,
        kind: SamplerKind::Rigid {
            shuffle: Some(vec![5]),
        },
    };
    let part = h_shard();
    let mut s = BatchSampler::new(part.clone(), opts.clone(), None).unwrap();
    let steps = s.steps_per_epoch();
    assert_eq!(steps, 3);
    // Partition 1 (3 triples, offsets 2..5): one epoch visits each of its triples once.
    let mut seen: Vec<i64> = (0..steps)
        .map(|k| s.sample(k).unwrap().sample_idx[[0, 1, 0]])
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, [2, 3, 4]);
    // Deterministic, and random access (going back to an earlier epoch) replays the same order.
    let mut again = BatchSampler::new(part, opts, None).unwrap();
    let a: Vec<i64> = (0..2 * steps)
        .map(|k| again.sample(k).unwrap().sample_idx[[0, 1, 0]])
        .collect();
    let b: Vec<i64> = (0..2 * steps)
        .map(|k| s.sample(k).unwrap().sample_idx[[0, 1, 0]])
        .collect();
    assert_eq!(a, b);
}

#[test]
fn random_negative_worked_example() {
    // shard counts [2,3,3,2], k=2, per-triple, h_shard with q=2.
    let neg = RandomNegative::new(2, &[7], Corruption::H, false, false).unwrap();
    let opts = BatchOptions {
        shard_bs: 2,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: false,
        kind: SamplerKind::Random {
            seed_words: vec![1],
        },
    };
    let mut s = BatchSampler::new(h_shard(), opts, Some(NegativeSampler::Random(neg))).unwrap();
    let n = s.sample(0).unwrap().negative.unwrap();
    assert_eq!(n.shape(), [1, 4, 4, 2, 2]);
    assert_eq!(
        [
            n[[0, 0, 0, 0, 0]],
            n[[0, 0, 0, 0, 1]],
            n[[0, 0, 0, 1, 0]],
            n[[0, 0, 0, 1, 1]]
        ],
        [1, 0, 0, 0]
    );
}

#[test]
fn triple_based_worked_example() {
    let p = PartitionedTriples::builder(sharding(), PartitionMode::HShard)
        .n_relation(3)
        .neg_heads(Array2::from_shape_vec((1, 7), vec![7, 2, 9, 4, 2, 0, 5]).unwrap())
        .build(&triples())
        .unwrap();
    let tb = TripleBasedNegative::new(&p, Corruption::H, false, true).unwrap();
    assert!(tb.flat_negative_format);
    assert_eq!(tb.padded_shard_length, 3);
    let h = tb.heads.unwrap();
    assert_eq!(h.sort_idx.row(0).to_vec(), [2, 5, 1, 4, 6, 0, 3]);
    assert_eq!(
        h.padded.index_axis(ndarray::Axis(0), 0),
        arr2(&[[1, 0, 1], [0, 0, 1], [1, 0, 1], [0, 0, 0]])
    );
    let m = h.mask.index_axis(ndarray::Axis(0), 0).mapv(u8::from);
    assert_eq!(m, arr2(&[[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]]));
}

#[test]
fn sharding_npz_round_trip() {
    let dir = std::env::temp_dir().join(format!("bess-npz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for s in [
        Sharding::create(1001, 8, &[0], None).unwrap(),
        Sharding::create(500, 4, &[1234], Some(&[0, 200, 260])).unwrap(),
    ] {
        let path = dir.join("sharding.npz");
        s.save_npz(&path).unwrap();
        assert_eq!(Sharding::load_npz(&path).unwrap(), s);
    }
    // A corrupted mapping is refused, naming the field.
    let mut bad = Sharding::create(100, 4, &[3], None).unwrap();
    bad.entity_to_idx[5] += 1;
    let path = dir.join("bad.npz");
    bad.save_npz(&path).unwrap();
    let e = Sharding::load_npz(&path).unwrap_err().to_string();
    assert!(
        e.contains("entity_to_shard") && e.contains("entity 5"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn besskge_untyped_sharding_files_hold_pickled_nones() {
    // besskge's `Sharding.save` of an untyped sharding writes the two type fields as pickled
    // `None` object arrays; they are read as "untyped".
    use std::io::Write;
    let s = Sharding::create(50, 4, &[9], None).unwrap();
    let dir = std::env::temp_dir().join(format!("bess-npz-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("besskge.npz");
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in common::sharding_members(&s) {
        zip.start_file(name, opts).unwrap();
        zip.write_all(&bytes).unwrap();
    }
    let mut header = b"{'descr': '|O', 'fortran_order': False, 'shape': (), }".to_vec();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut object = b"\x93NUMPY\x01\x00".to_vec();
    object.extend((header.len() as u16).to_le_bytes());
    object.extend(header);
    object.extend(b"\x80\x03N.");
    for name in ["entity_type_counts.npy", "entity_type_offsets.npy"] {
        zip.start_file(name, opts).unwrap();
        zip.write_all(&object).unwrap();
    }
    zip.finish().unwrap();
    assert_eq!(Sharding::load_npz(&path).unwrap(), s);
    std::fs::remove_dir_all(&dir).unwrap();
}
