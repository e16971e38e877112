//! Key hashing (`input::hash`): the mapping from raw keys to ids is xxh3-64 with the feature's
//! seed, and must never change. Every expected value below was computed with the reference
//! implementation of XXH3 (Python `xxhash` 3.x/4.1, libxxhash 0.8.x:
//! `xxhash.xxh3_64_intdigest(bytes, seed)`), never by this crate.

use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, Int64Builder, LargeStringBuilder, ListBuilder, StringBuilder,
};
use arrow_array::{
    ArrayRef, Float64Array, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field};
use serde_json::{json, Value};

use sparsecore_prep::input::hash::{hash_bytes, hash_i64, hash_keys, key_to_id, HASH_ALGORITHM};
use sparsecore_prep::input::{
    features_from_record_batch, features_from_record_batch_reusing, FeatureView, HashBuffers, Ids,
    SampleSource,
};
use sparsecore_prep::{Config, Error, Output, Preprocessor};

/// `(len, xxh3_64(b, 0), xxh3_64(b, 99))` for `b[i] = (31 i + 7) mod 251`: one length in each of
/// XXH3's code paths (1–3, 4–8, 9–16, 17–128, 129–240, > 240 bytes) and at their edges.
const PATTERN_VECTORS: [(usize, u64, u64); 12] = [
    (3, 1582743943441612892, 12409411701557604573),
    (4, 15897727546751563449, 14395867957989266973),
    (9, 1577759300613796701, 11103530401552024784),
    (16, 12062957049132636838, 8900904863223337607),
    (17, 7168634020143139141, 4868595838546842018),
    (100, 7398874497090830788, 7865766453727229316),
    (128, 7858610685710347559, 1088454341388417853),
    (129, 16930153152913556723, 4280251129189483179),
    (200, 17633084426012460677, 13373791260370681201),
    (240, 2518229880650351743, 3567418954125728510),
    (241, 527587168735997055, 11189462528247009111),
    (1000, 9561361491368264718, 7000353507107258005),
];

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

#[test]
fn xxh3_vectors_bytes() {
    assert_eq!(HASH_ALGORITHM, "xxh3-64");
    assert_eq!(hash_bytes(b"", 0), 3244421341483603138);
    assert_eq!(hash_bytes(b"", 42), 12693748630217917650);
    assert_eq!(hash_bytes(b"a", 0), 16629034431890738719);
    assert_eq!(hash_bytes(b"68fd1e64", 0), 49613333376404301);
    assert_eq!(hash_bytes(b"68fd1e64", 7), 2098783994185471099);
    assert_eq!(hash_bytes(b"05db9164", 0), 13684405876034456528);
    assert_eq!(
        hash_bytes(b"hello world", 12345678901234567890),
        15912557960596480334
    );
    let b: Vec<u8> = (0..512).map(|i| (i % 256) as u8).collect();
    assert_eq!(hash_bytes(&b, 0), 1177990759783856649);
    for (n, h0, h99) in PATTERN_VECTORS {
        assert_eq!(hash_bytes(&pattern(n), 0), h0, "len {n}, seed 0");
        assert_eq!(hash_bytes(&pattern(n), 99), h99, "len {n}, seed 99");
    }
}

#[test]
fn xxh3_vectors_int64_little_endian() {
    let vectors: [(i64, u64, u64); 6] = [
        (0, 14374147212387527897, 5133589608643455977),
        (1, 3439722301264460078, 12012694768356207812),
        (-1, 5841669975847748627, 4515201275042620865),
        (i64::MAX, 11687913294787043142, 13118586004693791697),
        (i64::MIN, 9407778237848358495, 14453944126604773445),
        (123456789, 2817400364357085909, 17160999565294658565),
    ];
    for (v, h0, h7) in vectors {
        assert_eq!(hash_i64(v, 0), h0, "{v}, seed 0");
        assert_eq!(hash_i64(v, 7), h7, "{v}, seed 7");
    }
    assert_eq!(key_to_id(5841669975847748627, 1000), Some(627));
    assert_eq!(key_to_id(1, 0), None);
}

/// Criteo-style hex keys with seed 2024: `(key, xxh3_64(key, 2024), that mod 1000)`.
const CRITEO_KEYS: [(&str, u64, i64); 7] = [
    ("68fd1e64", 17804424789898067185, 185),
    ("80e26c9b", 13527552945223126986, 986),
    ("fb936136", 16956260268607682717, 717),
    ("7b4723c4", 13769778353099039391, 391),
    ("25c83c98", 11081260124839526653, 653),
    ("7e0ccccf", 11176857697591239756, 756),
    ("", 1836185169151358548, 548),
];

/// 8 samples of key indices into `CRITEO_KEYS` (one empty sample, one repeated key).
const ROWS: [&[usize]; 8] = [&[0, 1], &[2], &[3, 4, 5], &[6], &[0], &[], &[1, 1], &[4]];

fn config(hash: Option<u64>, vocab: u64) -> Config {
    let mut feature = json!({"name": "f0", "table": "t0"});
    if let Some(seed) = hash {
        feature["hash"] = json!({"seed": seed});
    }
    let v: Value = json!({
        "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
        "tables": [{"name": "t0", "vocabulary_size": vocab, "embedding_dim": 8, "combiner": "mean",
                    "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16}],
        "features": [feature]
    });
    Config::from_json(&v.to_string()).unwrap()
}

fn batch(column: ArrayRef) -> RecordBatch {
    RecordBatch::try_from_iter([("f0", column)]).unwrap()
}

fn string_keys() -> ArrayRef {
    let mut b = ListBuilder::new(StringBuilder::new());
    for row in ROWS {
        for &k in row {
            b.values().append_value(CRITEO_KEYS[k].0);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn expected_ids() -> ArrayRef {
    let mut b = ListBuilder::new(Int64Builder::new());
    for row in ROWS {
        for &k in row {
            b.values().append_value(CRITEO_KEYS[k].2);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn run(config: Config, batch: &RecordBatch) -> Output {
    let mut prep = Preprocessor::new(config).unwrap();
    let mut out = Output::new();
    prep.run_record_batch(batch, &mut out).unwrap();
    out
}

/// Buffers compared bit for bit (the gains' padding is NaN).
fn assert_same(a: &Output, b: &Output) {
    assert_eq!(a.stacks.len(), b.stacks.len());
    for (x, y) in a.stacks.iter().zip(&b.stacks) {
        assert_eq!(x.row_pointers, y.row_pointers);
        assert_eq!(x.embedding_ids, y.embedding_ids);
        assert_eq!(x.sample_ids, y.sample_ids);
        let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.gains), bits(&y.gains));
        assert_eq!(x.stats, y.stats);
    }
}

fn ids_of(view: FeatureView<'_>) -> Vec<i64> {
    match view {
        FeatureView::Ragged {
            ids: Ids::I32(v), ..
        } => v.iter().map(|&x| x as i64).collect(),
        FeatureView::Ragged {
            ids: Ids::I64(v), ..
        } => v.to_vec(),
        other => panic!("hashed Arrow input is ragged, got {other:?}"),
    }
}

#[test]
fn hashed_utf8_feature_equals_its_ids() {
    let cfg = config(Some(2024), 1000);
    let hashed = batch(string_keys());
    let fs = features_from_record_batch(&cfg, &hashed).unwrap();
    assert!(fs[0].is_hashed());
    let want: Vec<i64> = ROWS
        .iter()
        .flat_map(|r| r.iter().map(|&k| CRITEO_KEYS[k].2))
        .collect();
    assert_eq!(ids_of(fs[0].view()), want);
    for (key, h, id) in CRITEO_KEYS {
        assert_eq!(hash_bytes(key.as_bytes(), 2024), h);
        assert_eq!(h % 1000, id as u64);
    }
    // The whole pipeline sees exactly the ids the keys hash to.
    assert_same(
        &run(cfg, &hashed),
        &run(config(None, 1000), &batch(expected_ids())),
    );
}

#[test]
fn every_key_type_hashes_its_documented_bytes() {
    let cfg = config(Some(2024), 1000);
    let want = ids_of(features_from_record_batch(&cfg, &batch(string_keys())).unwrap()[0].view());
    // LargeUtf8 and Binary: the same bytes, so the same ids.
    let mut large = ListBuilder::new(LargeStringBuilder::new());
    let mut binary = ListBuilder::new(BinaryBuilder::new());
    for row in ROWS {
        for &k in row {
            large.values().append_value(CRITEO_KEYS[k].0);
            binary.values().append_value(CRITEO_KEYS[k].0.as_bytes());
        }
        large.append(true);
        binary.append(true);
    }
    for col in [
        Arc::new(large.finish()) as ArrayRef,
        Arc::new(binary.finish()),
    ] {
        let b = batch(col);
        assert_eq!(
            ids_of(features_from_record_batch(&cfg, &b).unwrap()[0].view()),
            want
        );
    }
    // Int64 keys: 8 little-endian bytes; Int32 keys widen to Int64 first.
    let cfg7 = config(Some(7), 1_000_003);
    let int_keys = [0i64, 1, -1, 123456789];
    let hashes = [
        5133589608643455977u64,
        12012694768356207812,
        4515201275042620865,
        17160999565294658565,
    ];
    let offsets = OffsetBuffer::<i32>::from_lengths([1, 3, 0, 0, 0, 0, 0, 0]);
    let i64_col = ListArray::new(
        Arc::new(Field::new_list_field(DataType::Int64, false)),
        offsets.clone(),
        Arc::new(Int64Array::from(int_keys.to_vec())),
        None,
    );
    let i32_col = ListArray::new(
        Arc::new(Field::new_list_field(DataType::Int32, false)),
        offsets,
        Arc::new(Int32Array::from(
            int_keys.iter().map(|&v| v as i32).collect::<Vec<_>>(),
        )),
        None,
    );
    let want: Vec<i64> = hashes.iter().map(|h| (h % 1_000_003) as i64).collect();
    for col in [Arc::new(i64_col) as ArrayRef, Arc::new(i32_col)] {
        let b = batch(col);
        assert_eq!(
            ids_of(features_from_record_batch(&cfg7, &b).unwrap()[0].view()),
            want
        );
    }
    // Full 64-bit keys, for dynamic tables.
    let mut keys = Vec::new();
    hash_keys(
        "f0",
        "f0",
        &StringArray::from(vec!["68fd1e64", "", "7e0ccccf"]),
        2024,
        &mut keys,
    )
    .unwrap();
    assert_eq!(
        keys,
        [
            17804424789898067185,
            1836185169151358548,
            11176857697591239756
        ]
    );
}

#[test]
fn sliced_list_hashes_only_its_rows() {
    let cfg = config(Some(2024), 1000);
    let full = string_keys();
    let sliced = full.slice(2, 4); // rows 2..6: [3,4,5], [6], [0], []
    let b = batch(sliced);
    let fs = features_from_record_batch(&cfg, &b).unwrap();
    let FeatureView::Ragged { ids, offsets, .. } = fs[0].view() else {
        panic!("ragged")
    };
    let all = match ids {
        Ids::I32(v) => v.iter().map(|&x| x as i64).collect::<Vec<_>>(),
        Ids::I64(v) => v.to_vec(),
    };
    let rows: Vec<Vec<i64>> = (0..offsets.rows())
        .map(|r| all[offsets.range(r).0..offsets.range(r).1].to_vec())
        .collect();
    assert_eq!(
        rows,
        vec![vec![391, 653, 756], vec![548], vec![185], vec![]]
    );
}

#[test]
fn wide_vocabulary_uses_64_bit_ids() {
    let cfg = config(Some(2024), 5_000_000_000);
    let b = batch(string_keys());
    let fs = features_from_record_batch(&cfg, &b).unwrap();
    let FeatureView::Ragged {
        ids: Ids::I64(v), ..
    } = fs[0].view()
    else {
        panic!("64-bit ids for a vocabulary past 2^31")
    };
    assert_eq!(v[0], (17804424789898067185u64 % 5_000_000_000) as i64);
}

#[test]
fn hash_buffers_are_recycled() {
    let cfg = config(Some(2024), 1000);
    let b = batch(string_keys());
    let mut buffers = HashBuffers::new();
    let fs = features_from_record_batch_reusing(&cfg, &b, &mut buffers).unwrap();
    let first = match fs[0].view() {
        FeatureView::Ragged {
            ids: Ids::I32(v), ..
        } => v.as_ptr(),
        _ => panic!("32-bit hashed ids"),
    };
    buffers.recycle(fs);
    let fs = features_from_record_batch_reusing(&cfg, &b, &mut buffers).unwrap();
    match fs[0].view() {
        FeatureView::Ragged {
            ids: Ids::I32(v), ..
        } => assert_eq!(
            v.as_ptr(),
            first,
            "the second batch reuses the first's buffer"
        ),
        _ => panic!("32-bit hashed ids"),
    }
}

#[test]
fn raw_key_errors_name_the_feature_and_column() {
    // A string column without a hash config.
    let e = features_from_record_batch(&config(None, 1000), &batch(string_keys())).unwrap_err();
    assert!(
        matches!(&e, Error::ColumnType { feature, column, .. } if feature == "f0" && column == "f0"),
        "{e}"
    );
    assert!(e.to_string().contains("\"hash\""), "{e}");
    // A hashed feature over a type that is not a key type.
    let floats = ListArray::new(
        Arc::new(Field::new_list_field(DataType::Float64, false)),
        OffsetBuffer::<i32>::from_lengths([1; 8]),
        Arc::new(Float64Array::from(vec![0.5; 8])),
        None,
    );
    let e =
        features_from_record_batch(&config(Some(1), 1000), &batch(Arc::new(floats))).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::ColumnType { .. }), "{msg}");
    assert!(
        msg.contains("Float64") && msg.contains("Utf8") && msg.contains("f0"),
        "{msg}"
    );
    // Null keys are rejected like null ids.
    let mut b = ListBuilder::new(StringBuilder::new());
    b.values().append_value("a");
    b.values().append_null();
    b.append(true);
    for _ in 0..7 {
        b.append(true);
    }
    let e = features_from_record_batch(&config(Some(1), 1000), &batch(Arc::new(b.finish())))
        .unwrap_err();
    assert!(e.to_string().contains("null values"), "{e}");
    // Unknown keys in the hash config are typos, not silently ignored.
    let v = json!({
        "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
        "tables": [{"name": "t0", "vocabulary_size": 10, "embedding_dim": 8}],
        "features": [{"name": "f0", "table": "t0", "hash": {"sed": 1}}]
    });
    assert!(Config::from_json(&v.to_string())
        .unwrap_err()
        .to_string()
        .contains("sed"));
}

#[test]
fn hash_config_round_trips() {
    let cfg = config(Some(2024), 1000);
    assert_eq!(cfg.features[0].hash.map(|h| h.seed), Some(2024));
    assert_eq!(Config::from_json(&cfg.to_json()).unwrap(), cfg);
    assert!(!config(None, 1000).to_json().contains("hash"));
}
