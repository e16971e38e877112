//! Every bad input is a typed error naming the column and the value, never a panic.

use std::sync::Arc;

use arrow_array::{ArrayRef, Float32Array, Int32Array, Int64Array, RecordBatch};
use ndarray::{Array2, ArrayD, IxDyn};
use sparsecore_bess::{
    synth, BatchOptions, BatchSampler, BessError, BessStream, Corruption, NegativeKind,
    NegativeSampler, PartitionMode, PartitionedTriples, RandomNegative, SamplerKind, Sharding,
    StreamSampler, TripleBasedNegative, Triples, TypeBasedNegative,
};

fn sharding() -> Arc<Sharding> {
    Arc::new(Sharding::create(100, 4, &[7], None).unwrap())
}

fn build(t: &Triples) -> Result<PartitionedTriples, BessError> {
    PartitionedTriples::builder(sharding(), PartitionMode::HtShardPair)
        .n_relation(5)
        .build(t)
}

#[test]
fn entity_ids_out_of_range_name_the_column_and_value() {
    let e = build(&Triples::from_rows(&[[0, 0, 1], [3, 1, 100]])).unwrap_err();
    assert!(
        matches!(&e, BessError::EntityOutOfRange { column, row: 1, value: 100, n_entity: 100 } if column == "tail"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "column `tail`, row 1: entity id 100 is outside 0..100"
    );
    let e = build(&Triples::from_rows(&[[-3, 0, 1]])).unwrap_err();
    assert!(
        matches!(&e, BessError::EntityOutOfRange { column, value: -3, .. } if column == "head"),
        "{e:?}"
    );
    let e = PartitionedTriples::builder(sharding(), PartitionMode::HShard)
        .neg_tails(Array2::from_shape_vec((1, 3), vec![1, 250, 2]).unwrap())
        .build(&Triples::from_rows(&[[0, 0, 1]]))
        .unwrap_err();
    assert!(
        matches!(&e, BessError::EntityOutOfRange { column, value: 250, .. } if column == "neg_tails"),
        "{e:?}"
    );
    let e = build(&Triples::from_rows(&[[0, 9, 1]])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "column `relation`, row 0: relation id 9 is outside 0..5"
    );
    // Through the stream builder too.
    let e = BessStream::builder()
        .triples(Triples::from_rows(&[[0, 0, 1], [1, 0, 400]]))
        .n_entity(100)
        .shard_batch_size(4)
        .build()
        .unwrap_err();
    assert!(
        matches!(&e, BessError::EntityOutOfRange { column, value: 400, .. } if column == "tail"),
        "{e:?}"
    );
}

#[test]
fn mismatched_column_lengths() {
    let e = Triples::new(vec![0, 1], vec![0], vec![1, 2]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "column `relation` has 1 rows but column `head` has 2"
    );
    let e = Triples::from_arrow(
        &Int64Array::from(vec![1, 2]),
        &Int32Array::from(vec![0, 0]),
        &Int64Array::from(vec![1, 2, 3]),
    )
    .unwrap_err();
    assert!(
        matches!(&e, BessError::LengthMismatch { column, got: 3, expected: 2, .. } if column == "tail"),
        "{e:?}"
    );
    let e = PartitionedTriples::builder(sharding(), PartitionMode::HShard)
        .neg_heads(Array2::zeros((3, 2)))
        .build(&Triples::from_rows(&[[0, 0, 1], [1, 0, 2]]))
        .unwrap_err();
    assert!(
        matches!(&e, BessError::LengthMismatch { column, got: 3, expected: 2, .. } if column == "neg_heads"),
        "{e:?}"
    );
}

#[test]
fn arrow_columns_are_checked() {
    let batch = |cols: Vec<(&str, ArrayRef)>| RecordBatch::try_from_iter(cols).unwrap();
    let ok = batch(vec![
        ("head", Arc::new(Int32Array::from(vec![0, 5])) as ArrayRef),
        ("relation", Arc::new(Int64Array::from(vec![0, 1]))),
        ("tail", Arc::new(Int64Array::from(vec![3, 4]))),
    ]);
    assert_eq!(
        Triples::from_record_batch(&ok).unwrap(),
        Triples::from_rows(&[[0, 0, 3], [5, 1, 4]])
    );
    let missing = batch(vec![
        ("head", Arc::new(Int32Array::from(vec![0])) as ArrayRef),
        ("tail", Arc::new(Int32Array::from(vec![0]))),
    ]);
    assert_eq!(
        Triples::from_record_batch(&missing)
            .unwrap_err()
            .to_string(),
        "missing column `relation` (expected Int32 or Int64)"
    );
    let floats = batch(vec![
        ("head", Arc::new(Float32Array::from(vec![0.0])) as ArrayRef),
        ("relation", Arc::new(Int32Array::from(vec![0]))),
        ("tail", Arc::new(Int32Array::from(vec![0]))),
    ]);
    assert!(
        matches!(Triples::from_record_batch(&floats).unwrap_err(), BessError::ColumnType { column, .. } if column == "head")
    );
    let nulls = batch(vec![
        ("head", Arc::new(Int32Array::from(vec![0, 1])) as ArrayRef),
        ("relation", Arc::new(Int32Array::from(vec![0, 0]))),
        ("tail", Arc::new(Int32Array::from(vec![Some(0), None]))),
    ]);
    assert_eq!(
        Triples::from_record_batch(&nulls).unwrap_err().to_string(),
        "column `tail`, row 1: null value"
    );
}

/// Triples only between shards 0 and 0..3 of a 4-shard sharding: most shard pairs are empty.
fn lopsided(sh: &Sharding) -> Triples {
    let on = |s: i64| {
        (0..100)
            .find(|&e| sh.entity_to_shard[e as usize] == s)
            .unwrap()
    };
    Triples::from_rows(&(0..4).map(|s| [on(0), 0, on(s)]).collect::<Vec<_>>())
}

#[test]
fn empty_shard_pair() {
    let sh = Sharding::create(100, 4, &[0], None).unwrap();
    let t = lopsided(&sh);
    for sampler in [
        StreamSampler::Rigid { shuffle: false },
        StreamSampler::Random,
    ] {
        let e = BessStream::builder()
            .triples(t.clone())
            .n_entity(100)
            .shard_batch_size(4)
            .sampler(sampler)
            .seed(0)
            .build()
            .unwrap_err();
        assert!(
            matches!(&e, BessError::EmptyPartition { partition, .. } if partition == "(head shard 1, tail shard 0)"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("(head shard 1, tail shard 0) has no triples"),
            "{e}"
        );
    }
    // besskge's Random sampler would silently sample the next partition: ours refuses.
    let part = Arc::new(
        PartitionedTriples::builder(Arc::new(sh), PartitionMode::HtShardPair)
            .build(&t)
            .unwrap(),
    );
    let opts = BatchOptions {
        shard_bs: 4,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: false,
        kind: SamplerKind::Random {
            seed_words: vec![0],
        },
    };
    assert!(matches!(
        BatchSampler::new(part, opts, None).unwrap_err(),
        BessError::EmptyPartition { .. }
    ));
}

#[test]
fn zero_triples_per_block() {
    let t = synth::uniform(100, 3, 500, 1);
    let e = BessStream::builder()
        .triples(t.clone())
        .n_entity(100)
        .shard_batch_size(0)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            BessError::ZeroTriplesPerBlock {
                shard_bs: 0,
                positive_per_partition: 0,
                minimum: 1,
                ..
            }
        ),
        "{e:?}"
    );
    // 4 shards, "ht": ceil(4 / 4) = 1, rounded down to even = 0; 5 gives 2.
    let e = BessStream::builder()
        .triples(t.clone())
        .n_entity(100)
        .shard_batch_size(4)
        .corruption(Corruption::Ht)
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "shard batch size 4 gives 0 triples per block (n = 4 shards, duplicate_batch = false, corruption `ht`); use a shard batch size of at least 5"
    );
    let part = Arc::new(build(&t).unwrap());
    let neg =
        NegativeSampler::Random(RandomNegative::new(2, &[1], Corruption::H, false, false).unwrap());
    let opts = BatchOptions {
        shard_bs: 1,
        batches_per_step: 1,
        duplicate_batch: true,
        return_triple_idx: false,
        kind: SamplerKind::Rigid { shuffle: None },
    };
    assert!(matches!(
        BatchSampler::new(part, opts, Some(neg)).unwrap_err(),
        BessError::ZeroTriplesPerBlock {
            duplicate_batch: true,
            ..
        }
    ));
}

#[test]
fn shards_must_be_the_sparsecores() {
    let t = synth::uniform(100, 3, 500, 1);
    let e = BessStream::builder()
        .triples(t.clone())
        .n_entity(100)
        .devices(1, 2, 4)
        .sharding(sharding())
        .shard_batch_size(8)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            BessError::ShardCountMismatch {
                n_shard: 4,
                num_sparsecores: 8,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains(
            "n = 4 shards but the layout has N = global_device_count 2 * num_sc_per_device 4 = 8"
        ),
        "{e}"
    );
    // A layout the pipeline refuses comes through as the pipeline's own error.
    let e = BessStream::builder()
        .triples(t)
        .n_entity(100)
        .devices(1, 1, 3)
        .shard_batch_size(8)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            BessError::Prep(sparsecore_prep::Error::NotPowerOfTwo { num_scs: 3, .. })
        ),
        "{e:?}"
    );
}

#[test]
fn sharding_parameters() {
    assert!(matches!(
        Sharding::create(10, 0, &[0], None).unwrap_err(),
        BessError::InvalidParameter {
            name: "n_shard",
            ..
        }
    ));
    assert!(matches!(
        Sharding::create(10, 2, &[0], Some(&[1, 4])).unwrap_err(),
        BessError::InvalidParameter {
            name: "type_offsets",
            ..
        }
    ));
    let e = Sharding::load_npz("/nonexistent/sharding.npz").unwrap_err();
    assert!(matches!(e, BessError::Io { .. }), "{e:?}");
}

#[test]
fn sizes_beyond_the_buffers_are_errors_not_overflows() {
    let t = synth::uniform(100, 3, 500, 1);
    for (bs, k) in [(usize::MAX, 0), (1 << 30, 0), (8, usize::MAX), (8, 1 << 40)] {
        let e = BessStream::builder()
            .triples(t.clone())
            .n_entity(100)
            .shard_batch_size(bs)
            .negatives(k)
            .build()
            .unwrap_err();
        assert!(
            matches!(e, BessError::InvalidParameter { .. }),
            "{bs} {k}: {e:?}"
        );
    }
    assert!(matches!(
        Sharding::create(10, usize::MAX, &[0], None).unwrap_err(),
        BessError::InvalidParameter {
            name: "n_shard",
            ..
        }
    ));
}

#[test]
fn relation_ids_past_int32_are_refused_not_clamped() {
    // The batches' `relation` column is Int32: clamped, each of these ids would be 2147483647.
    let mut t = synth::uniform(1000, 10, 20_000, 1);
    t.relation.iter_mut().for_each(|r| *r += 3_000_000_000);
    let stream = |t: &Triples| {
        BessStream::builder()
            .triples(t.clone())
            .n_entity(1000)
            .shard_batch_size(64)
            .seed(1)
    };
    let first = t.relation[0];
    for e in [
        stream(&t).build().unwrap_err(),
        stream(&t).n_relation(5_000_000_000).build().unwrap_err(),
        stream(&t).inverse_triples(true).build().unwrap_err(),
    ] {
        assert!(
            matches!(&e, BessError::RelationOutOfRange { column, row: 0, value, n_relation: 2147483647 } if column == "relation" && *value == first),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("column `relation`, row 0: relation id {first} is outside 0..2147483647")
        );
    }
    // More relation types than the column holds, even with small ids.
    let small = synth::uniform(1000, 10, 20_000, 1);
    let e = stream(&small)
        .n_relation(5_000_000_000)
        .build()
        .unwrap_err();
    assert!(
        matches!(&e, BessError::InvalidParameter { name: "n_relation", value, .. } if value == "5000000000"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "invalid `n_relation` = 5000000000: the `relation` column is Int32: at most 2147483647 relation types");
    // With inverse triples, ids that fit whose inverses `r + n_relation` would not.
    let mut half = small.clone();
    half.relation.iter_mut().for_each(|r| *r += 1_500_000_000);
    let e = stream(&half).inverse_triples(true).build().unwrap_err();
    assert!(
        matches!(&e, BessError::InvalidParameter { name: "n_relation", value, .. } if value == "1500000010"),
        "{e:?}"
    );
    // Ids that fit come out as themselves, distinct ones distinct.
    let mut high = small.clone();
    high.relation.iter_mut().for_each(|r| *r += 2_147_483_600);
    let batch = stream(&high)
        .build()
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .record_batch;
    let rel = batch
        .column_by_name("relation")
        .unwrap()
        .as_any()
        .downcast_ref::<Int32Array>()
        .unwrap();
    let got: std::collections::BTreeSet<i32> = rel.iter().flatten().collect();
    assert!(
        got.len() > 1
            && got
                .iter()
                .all(|&r| (2_147_483_600..2_147_483_610).contains(&r)),
        "{got:?}"
    );
}

#[test]
fn malformed_sample_idx_is_an_error_not_a_panic() {
    let sh = Arc::new(Sharding::create(100, 4, &[7], Some(&[0, 50])).unwrap());
    let t = synth::uniform(100, 3, 8, 2);
    let typed = PartitionedTriples::builder(sh.clone(), PartitionMode::HShard)
        .type_offsets(vec![0, 50])
        .build(&t)
        .unwrap();
    let idx = |shape: &[usize], v: Vec<i64>| ArrayD::from_shape_vec(IxDyn(shape), v).unwrap();
    let mut type_based =
        NegativeSampler::TypeBased(TypeBasedNegative::new(2, &[1], Corruption::T, false).unwrap());
    let mut random =
        NegativeSampler::Random(RandomNegative::new(2, &[1], Corruption::T, false, false).unwrap());
    assert_eq!(
        type_based
            .sample(&typed, &idx(&[1, 4, 1], vec![0, 1, 2, 7]))
            .unwrap()
            .negative
            .shape(),
        [1, 4, 4, 1, 2]
    );
    // A row past the 8 triples, or before them (the TypeBased sampler read its type at that row).
    for bad in [99, 8, -1] {
        let e = type_based
            .sample(&typed, &idx(&[1, 4, 1], vec![0, 1, 2, bad]))
            .unwrap_err();
        assert!(
            matches!(&e, BessError::InvalidParameter { name: "sample_idx", value, .. } if *value == bad.to_string()),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "invalid `sample_idx` = {bad}: indices must be rows of the 8 partitioned triples"
            )
        );
    }
    // Too few axes (the shape was read at axes 0 and 1), a block of the wrong shard count, an empty axis.
    for (typed_sampler, shape) in [
        (false, vec![4]),
        (true, vec![4]),
        (false, vec![1, 3, 1]),
        (true, vec![1, 4, 0]),
        (false, vec![1, 4, 4, 1]),
    ] {
        let ns = if typed_sampler {
            &mut type_based
        } else {
            &mut random
        };
        let e = ns
            .sample(&typed, &idx(&shape, vec![0; shape.iter().product()]))
            .unwrap_err();
        assert!(
            matches!(
                &e,
                BessError::InvalidParameter {
                    name: "sample_idx",
                    ..
                }
            ),
            "{shape:?}: {e:?}"
        );
        assert_eq!(e.to_string(), format!("invalid `sample_idx` = shape {shape:?}: must be (batches_per_step, 4, q) with no empty axis"));
    }
    let pairs = PartitionedTriples::builder(sh.clone(), PartitionMode::HtShardPair)
        .build(&t)
        .unwrap();
    let e = random
        .sample(&pairs, &idx(&[1, 4, 1], vec![0; 4]))
        .unwrap_err();
    assert_eq!(e.to_string(), "invalid `sample_idx` = shape [1, 4, 1]: must be (batches_per_step, 4, 4, q) with no empty axis");
    // A TripleBased sampler's tables have a row per triple of its own set, 8 here: a set of 16
    // indexed past them.
    let neg = Array2::from_shape_fn((8, 3), |(r, c)| (r * 3 + c) as i64);
    let own = PartitionedTriples::builder(sh.clone(), PartitionMode::HShard)
        .neg_tails(neg)
        .build(&t)
        .unwrap();
    let tb = TripleBasedNegative::new(&own, Corruption::T, true, false).unwrap();
    let mut triple_based = NegativeSampler::TripleBased(Box::new(tb));
    assert!(triple_based
        .sample(&own, &idx(&[1, 4, 1], vec![0, 3, 5, 7]))
        .is_ok());
    let other = Arc::new(
        PartitionedTriples::builder(sh, PartitionMode::HShard)
            .build(&synth::uniform(100, 3, 16, 3))
            .unwrap(),
    );
    let e = triple_based
        .sample(&other, &idx(&[1, 4, 1], vec![12, 13, 14, 15]))
        .unwrap_err();
    assert!(
        matches!(&e, BessError::InvalidParameter { name: "partitioned", value, .. } if value == "16 triples"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "invalid `partitioned` = 16 triples: the TripleBased sampler was built for a set of 8 triples");
    // And a batch sampler refuses the pair from the start.
    let opts = BatchOptions {
        shard_bs: 1,
        batches_per_step: 1,
        duplicate_batch: false,
        return_triple_idx: false,
        kind: SamplerKind::Rigid { shuffle: None },
    };
    let e = BatchSampler::new(other, opts, Some(triple_based)).unwrap_err();
    assert!(
        matches!(
            &e,
            BessError::InvalidParameter {
                name: "partitioned",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn type_offsets_past_the_entities_are_refused() {
    // 1001 entities on 4 shards of 251 slots leave 3 padding slots (ids 1001..1004): an offset
    // of 5000 counted them in type 0 and took them off type 1, whose count went negative.
    let e = Sharding::create(1001, 4, &[1], Some(&[0, 5000])).unwrap_err();
    assert!(
        matches!(&e, BessError::InvalidParameter { name: "type_offsets", value, .. } if value == "[0, 5000]"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "invalid `type_offsets` = [0, 5000]: offset 1 is 5000, past n_entity = 1001 (types are ranges of entity ids)");
    // Up to n_entity, a sharding its own check accepts; at n_entity the last type is empty.
    for last in [1001, 1000] {
        let sh = Sharding::create(1001, 4, &[1], Some(&[0, last])).unwrap();
        sh.validate().unwrap();
        let tc = sh.entity_type_counts.as_ref().unwrap();
        let want: Vec<i64> = (0..4)
            .map(|s| i64::from(last == 1000 && sh.entity_to_shard[1000] == s))
            .collect();
        assert_eq!(tc.column(1).to_vec(), want, "last offset {last}");
        assert_eq!(tc.sum(), 1001);
    }
    // A crafted file's count and offset whose sum overflows are refused, not wrapped past the
    // check (which let the type-based sampler draw outside the shard).
    let mut sh = Sharding::create(1001, 4, &[1], Some(&[0, 1000])).unwrap();
    sh.entity_type_offsets.as_mut().unwrap()[[0, 1]] = 2;
    sh.entity_type_counts.as_mut().unwrap()[[0, 1]] = i64::MAX;
    let e = sh.validate().unwrap_err();
    assert!(e.to_string().contains(&i64::MAX.to_string()), "{e}");
    // The partitioning types triples by the same offsets, and the stream builds its typed
    // sharding from them.
    let t = synth::uniform(100, 3, 500, 1);
    let e = PartitionedTriples::builder(sharding(), PartitionMode::HtShardPair)
        .type_offsets(vec![0, 40, 101])
        .build(&t)
        .unwrap_err();
    assert_eq!(e.to_string(), "invalid `type_offsets` = [0, 40, 101]: offset 2 is 101, past n_entity = 100 (types are ranges of entity ids)");
    let kind = NegativeKind::TypeBased {
        type_offsets: vec![0, 5000],
    };
    let e = BessStream::builder()
        .triples(t)
        .n_entity(100)
        .shard_batch_size(8)
        .negatives(2)
        .negative_sampler(kind)
        .seed(1)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            &e,
            BessError::InvalidParameter {
                name: "type_offsets",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn zero_steps_are_refused() {
    let t = synth::uniform(100, 3, 500, 1);
    let e = BessStream::builder()
        .triples(t.clone())
        .n_entity(100)
        .shard_batch_size(8)
        .steps(0)
        .build()
        .unwrap_err();
    assert!(
        matches!(&e, BessError::InvalidParameter { name: "steps", value, .. } if value == "0"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "invalid `steps` = 0: must be at least 1");
    let s = BessStream::builder()
        .triples(t)
        .n_entity(100)
        .shard_batch_size(8)
        .steps(1)
        .build()
        .unwrap();
    assert_eq!(s.count(), 1);
}

#[test]
fn a_step_past_max_step_bytes_is_refused_before_drawing() {
    let t = synth::uniform(100, 3, 500, 1);
    let stream = |flat: bool, cap: usize| {
        BessStream::builder()
            .triples(t.clone())
            .n_entity(100)
            .shard_batch_size(8)
            .negatives(3)
            .flat_negatives(flat)
            .max_step_bytes(cap)
            .build()
    };
    // 1/1/4, ppp 2: T = 8 triples per SparseCore. Flat: B = 1, NEG = 4·1·3 = 12 rows = R.
    // 4 slices · (12 rows · 12 + 8 triples · 20 + 12 negatives · 8) = 1600 bytes.
    assert_eq!(stream(true, usize::MAX).unwrap().step_bytes(), 1600);
    // Per triple: B = T = 8, NEG = 4·8·3 = 96 rows = R: 4 · (96 · 12 + 8 · 20 + 96 · 8) = 8320.
    assert_eq!(stream(false, 8320).unwrap().step_bytes(), 8320);
    let e = stream(false, 8319).unwrap_err();
    let BessError::TooLarge {
        what,
        bytes,
        reason,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(*bytes, 8320);
    assert_eq!(reason, "more than max_step_bytes = 8319");
    assert!(
        what.contains("layout 1/1/4")
            && what.contains("shard batch size 8 (8 triples per SparseCore)")
            && what.contains("negatives = 3"),
        "{what}"
    );
    assert!(
        e.to_string()
            .contains("needs 8320 bytes (0.00 GiB): more than max_step_bytes = 8319"),
        "{e}"
    );
}

/// A sharding .npz of the given members (name, .npy bytes).
fn npz(path: &std::path::Path, members: &[(&str, Vec<u8>)]) {
    use std::io::Write;
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in members {
        zip.start_file(format!("{name}.npy"), opts).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

#[test]
fn sharding_files_with_2d_or_float_members_name_the_member() {
    use sparsecore_prep::fdo::npz::{encode_npy, NpyArray};
    let s = Sharding::create(50, 4, &[9], None).unwrap();
    let int = |shape: Vec<usize>, data: Vec<i64>| encode_npy(&NpyArray { shape, data });
    let members = |e2s: Vec<u8>| {
        vec![
            ("n_shard", int(vec![], vec![4])),
            ("entity_to_shard", e2s),
            ("entity_to_idx", int(vec![50], s.entity_to_idx.clone())),
            (
                "shard_and_idx_to_entity",
                int(
                    vec![4, 13],
                    s.shard_and_idx_to_entity.iter().copied().collect(),
                ),
            ),
            ("shard_counts", int(vec![4], s.shard_counts.clone())),
        ]
    };
    let dir = std::env::temp_dir().join(format!("bess-npz-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.npz");
    npz(&path, &members(int(vec![50], s.entity_to_shard.clone())));
    assert_eq!(Sharding::load_npz(&path).unwrap(), s);
    // The same 50 values as 10 × 5 were read flattened, as if they were the sharding.
    npz(&path, &members(int(vec![10, 5], s.entity_to_shard.clone())));
    let e = Sharding::load_npz(&path).unwrap_err();
    let name = path.display().to_string();
    assert!(
        matches!(&e, BessError::ShardingFile { path, .. } if *path == name),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!("sharding file {name}: entity_to_shard = an array of shape [10, 5]: must be 1-D")
    );
    // A float member: named as the file's member, not as a feature.
    let mut header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (50,), }".to_vec();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut float = b"\x93NUMPY\x01\x00".to_vec();
    float.extend((header.len() as u16).to_le_bytes());
    float.extend(header);
    float.extend(
        s.entity_to_shard
            .iter()
            .flat_map(|&v| (v as f64).to_le_bytes()),
    );
    npz(&path, &members(float));
    let e = Sharding::load_npz(&path).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "sharding file {name}: member `entity_to_shard`: dtype '<f8' is not int64 or int32"
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
