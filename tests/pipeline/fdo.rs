//! The FDO library API (`sparsecore_prep::fdo`): our JSON stats, the reference's NPZ and CSV
//! dumps (SPEC Part 2, sections 7.2–7.4, with its golden examples), the per-process file client,
//! merging, and the tuner (SPEC 7.5 plus headroom and rounding).
//!
//! Tests marked `// Regression:` reproduce defects that were found and fixed; they keep them fixed.

use sparsecore_testkit::TempDir;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use sparsecore_prep::fdo::csv;
use sparsecore_prep::fdo::npz::{self, NpyArray};
use sparsecore_prep::fdo::{
    tune, FdoClient, FdoStats, FileFdoClient, LayoutKey, FDO_FORMAT_VERSION,
};
use sparsecore_prep::{Config, ConfigItem, Error, NpzBound, Preprocessor, StackStats};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn layout(l: usize, g: usize, s: usize) -> LayoutKey {
    LayoutKey {
        local_device_count: l,
        global_device_count: g,
        num_sc_per_device: s,
    }
}

fn stack(max_ids: &[i32], max_unique: &[i32], required: &[i32], dropped: u64) -> StackStats {
    StackStats {
        max_ids_per_partition: max_ids.to_vec(),
        max_unique_ids_per_partition: max_unique.to_vec(),
        required_buffer_size_per_sc: required.to_vec(),
        dropped_id_count: dropped,
    }
}

/// Stats of layout 2/2/4: L * N = 16 partitions, L * S = 8 SparseCores.
fn sample_stats() -> FdoStats {
    let mut s = FdoStats::new(layout(2, 2, 4));
    s.batches = 7;
    let p: Vec<i32> = (0..16).map(|i| (i * 37 % 23) + 1).collect();
    let u: Vec<i32> = p.iter().map(|v| v / 2 + 1).collect();
    s.stacks.insert(
        "items".into(),
        stack(&p, &u, &[64, 72, 80, 88, 96, 104, 112, 120], 3),
    );
    s.stacks.insert(
        "cats_and_dogs".into(),
        stack(&[0; 16], &[0; 16], &[0; 8], 0),
    );
    s.stacks.insert(
        "q".into(),
        stack(&[i32::MAX; 16], &[1; 16], &[8; 8], u32::MAX as u64 + 5),
    );
    s
}

/// A hand-written `.npy` (format 1.0, what `np.save` writes): magic, version, header length,
/// a dict header padded with spaces to a multiple of 64 bytes ending in `\n`, then the data.
fn npy_bytes(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes an `.npz` (a zip of `<key>.npy` members) from raw member bytes, as `np.savez` does.
fn write_raw_npz(path: &Path, members: &[(&str, Vec<u8>)]) {
    let file = std::fs::File::create(path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in members {
        zip.start_file(format!("{name}.npy"), opts).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

fn arr1(v: &[i64]) -> NpyArray {
    NpyArray {
        shape: vec![v.len()],
        data: v.to_vec(),
    }
}

fn config_1_1_4() -> Config {
    Config::from_json(
        r#"{
      "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
      "tables": [
        {"name": "a", "vocabulary_size": 100000, "embedding_dim": 16, "max_ids_per_partition": 256,
         "max_unique_ids_per_partition": 128, "suggested_coo_buffer_size_per_device": 2048},
        {"name": "b", "vocabulary_size": 100000, "embedding_dim": 16, "max_ids_per_partition": 64,
         "max_unique_ids_per_partition": 32, "suggested_coo_buffer_size_per_device": null},
        {"name": "c", "vocabulary_size": 100000, "embedding_dim": 16, "max_ids_per_partition": 512,
         "max_unique_ids_per_partition": 512, "suggested_coo_buffer_size_per_device": 4096}
      ],
      "features": [{"name": "fa", "table": "a"}, {"name": "fb", "table": "b"}, {"name": "fc", "table": "c"}]
    }"#,
    )
    .unwrap()
}

fn table<'a>(c: &'a Config, name: &str) -> &'a sparsecore_prep::spec::TableConfig {
    c.tables.iter().find(|t| t.name == name).unwrap()
}

// ---------------------------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------------------------

#[test]
fn json_round_trip() {
    let s = sample_stats();
    let text = s.to_json();
    assert_eq!(FdoStats::from_json(&text).unwrap(), s);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["version"], FDO_FORMAT_VERSION);
    assert_eq!(
        v["layout"],
        serde_json::json!({"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 4})
    );
    assert_eq!(v["batches"], 7);
    assert_eq!(v["stacks"]["q"]["dropped_id_count"], u32::MAX as u64 + 5);

    let dir = TempDir::new("json");
    let p = dir.join("stats.json");
    s.write(&p).unwrap();
    assert_eq!(FdoStats::from_path(&p).unwrap(), s);
    let names: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("stats.json")],
        "no temporary file left"
    );
}

#[test]
fn json_refuses_other_versions_and_names_the_file() {
    let mut v: serde_json::Value = serde_json::from_str(&sample_stats().to_json()).unwrap();
    v["version"] = serde_json::json!(2);
    let e = FdoStats::from_json(&v.to_string()).unwrap_err();
    assert!(
        e.to_string().contains("unsupported FDO stats version"),
        "{e}"
    );

    let dir = TempDir::new("json-bad");
    let p = dir.join("broken_stats.json");
    std::fs::write(&p, "{\"version\": 1, \"layout\": [").unwrap();
    let e = FdoStats::from_path(&p).unwrap_err();
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert!(e.to_string().contains("broken_stats.json"), "{e}");
    let e = FdoStats::from_path(dir.join("absent.json")).unwrap_err();
    assert!(
        matches!(e, Error::Io { .. }) && e.to_string().contains("absent.json"),
        "{e}"
    );

    // A negative count is a damaged file: named by stack, field, position and value.
    let mut v: serde_json::Value = serde_json::from_str(&sample_stats().to_json()).unwrap();
    let stack = v["stacks"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    v["stacks"][&stack]["max_unique_ids_per_partition"][1] = serde_json::json!(-5);
    let e = FdoStats::from_json(&v.to_string()).unwrap_err();
    let message = e.to_string();
    assert!(
        message.contains(&stack) && message.contains("`max_unique_ids_per_partition`[1] is -5"),
        "{message}"
    );
    // So is a layout without devices.
    let mut v: serde_json::Value = serde_json::from_str(&sample_stats().to_json()).unwrap();
    v["layout"]["num_sc_per_device"] = serde_json::json!(0);
    let e = FdoStats::from_json(&v.to_string()).unwrap_err();
    assert!(e.to_string().contains("num_sc_per_device = 0"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Merge
// ---------------------------------------------------------------------------------------------

#[test]
fn merge_is_elementwise_max_with_summed_drops_and_batches() {
    let mut a = FdoStats::new(layout(1, 1, 4));
    a.batches = 2;
    a.stacks.insert(
        "t".into(),
        stack(&[10, 20, 30, 40], &[1, 9, 3, 4], &[64, 8, 16, 0], 5),
    );
    let mut b = FdoStats::new(layout(1, 1, 4));
    b.batches = 3;
    b.stacks.insert(
        "t".into(),
        stack(&[20, 10, 40, 30], &[2, 2, 2, 2], &[128, 0, 0, 8], 7),
    );
    a.merge(&b).unwrap();
    assert_eq!(a.batches, 5);
    assert_eq!(
        a.stacks["t"],
        stack(&[20, 20, 40, 40], &[2, 9, 3, 4], &[128, 8, 16, 8], 12)
    );

    // Empty stats merge into anything.
    let mut e = FdoStats::new(layout(1, 1, 4));
    e.merge(&a).unwrap();
    assert_eq!(e, a);
}

#[test]
fn merge_refuses_other_layouts_and_stack_sets() {
    let mut a = FdoStats::new(layout(1, 1, 4));
    a.batches = 1;
    a.stacks.insert(
        "t".into(),
        stack(&[1, 1, 1, 1], &[1, 1, 1, 1], &[8, 8, 8, 8], 0),
    );
    let mut g2 = a.clone();
    g2.layout = layout(1, 2, 4);
    let e = a.clone().merge(&g2).unwrap_err();
    assert!(
        e.to_string().contains("1/1/4") && e.to_string().contains("1/2/4"),
        "{e}"
    );

    let mut other = a.clone();
    other.stacks.insert("u".into(), a.stacks["t"].clone());
    other.stacks.remove("t");
    let e = a.clone().merge(&other).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("only in the first: [t]") && msg.contains("only in the second: [u]"),
        "{msg}"
    );
    let before = a.clone();
    let mut a2 = a.clone();
    let _ = a2.merge(&other);
    assert_eq!(a2, before, "a refused merge changes nothing");
}

// Regression: `from_json` accepted arrays of any length, and `merge` checked only one array's
// length (naming neither field nor lengths) and widened the others.
#[test]
fn stats_arrays_must_have_the_lengths_of_their_layout() {
    // Layout 1/1/4: L·G·S = 4 partitions, L·S = 4 SparseCores.
    let json = |ids: &str, uniq: &str, req: &str| {
        format!(
            r#"{{"version": 1, "layout": {{"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4}}, "batches": 1,
                "stacks": {{"t": {{"max_ids_per_partition": {ids}, "max_unique_ids_per_partition": {uniq},
                "required_buffer_size_per_sc": {req}, "dropped_id_count": 0}}}}}}"#
        )
    };
    let e = FdoStats::from_json(&json("[1, 2, 3, 4, 5, 6, 7]", "[1]", "[8, 8]")).unwrap_err();
    match &e {
        Error::InvalidConfig {
            what: ConfigItem::Stack,
            name,
            reason,
        } => {
            assert_eq!(name, "t");
            assert_eq!(reason, "stats field `max_ids_per_partition` has 7 values, expected L·G·S = 1·1·4 = 4 (or none, for a field not recorded)");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.to_string(), "invalid config: stack `t`: stats field `max_ids_per_partition` has 7 values, expected L·G·S = 1·1·4 = 4 (or none, for a field not recorded)");
    let e = FdoStats::from_json(&json("[1, 2, 3, 4]", "[1]", "[8, 8]")).unwrap_err();
    assert_eq!(e.to_string(), "invalid config: stack `t`: stats field `max_unique_ids_per_partition` has 1 values, expected L·G·S = 1·1·4 = 4 (or none, for a field not recorded)");
    let e = FdoStats::from_json(&json("[1, 2, 3, 4]", "[1, 1, 1, 1]", "[8, 8]")).unwrap_err();
    assert_eq!(e.to_string(), "invalid config: stack `t`: stats field `required_buffer_size_per_sc` has 2 values, expected L·S = 1·4 = 4 (or none, for a field not recorded)");
    // A file is named.
    let dir = TempDir::new("stats-lengths");
    let p = dir.join("short.json");
    std::fs::write(&p, json("[1, 2, 3, 4]", "[1, 1, 1, 1]", "[8, 8]")).unwrap();
    let e = FdoStats::from_path(&p).unwrap_err();
    assert!(
        matches!(
            e.root(),
            Error::InvalidConfig {
                what: ConfigItem::Stack,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().starts_with(&format!("stats {}: invalid config: stack `t`: stats field `required_buffer_size_per_sc` has 2 values", p.display())), "{e}");
    // A field that was not recorded is empty.
    let s = FdoStats::from_json(&json("[1, 2, 3, 4]", "[]", "[]")).unwrap();
    assert_eq!(s.stacks["t"], stack(&[1, 2, 3, 4], &[], &[], 0));

    // Layout 2/2/4: 16 partitions, 8 SparseCores.
    let mut s = sample_stats();
    s.stacks
        .get_mut("items")
        .unwrap()
        .required_buffer_size_per_sc = vec![8; 16];
    let e = s.validate().unwrap_err();
    assert_eq!(e.to_string(), "invalid config: stack `items`: stats field `required_buffer_size_per_sc` has 16 values, expected L·S = 2·4 = 8 (or none, for a field not recorded)");

    // A layout whose partition count does not fit in 64 bits.
    let mut s = FdoStats::new(layout(1 << 32, 1 << 32, 1));
    s.stacks.insert("t".into(), stack(&[1], &[], &[], 0));
    let e = s.validate().unwrap_err();
    assert_eq!(e.to_string(), "invalid option `layout` = 4294967296/4294967296/1: L·G·S = 4294967296·4294967296·1 partitions does not fit in 64 bits");

    // Merging: the other side's arrays are checked too, and a refused merge changes nothing.
    let mut a = FdoStats::new(layout(1, 1, 4));
    a.batches = 1;
    a.stacks.insert(
        "t".into(),
        stack(&[1, 1, 1, 1], &[1, 1, 1, 1], &[8, 8, 8, 8], 0),
    );
    let mut wide = a.clone();
    wide.stacks
        .get_mut("t")
        .unwrap()
        .max_unique_ids_per_partition = vec![1, 1, 1, 1, 9, 9, 9, 9];
    let mut merged = a.clone();
    let e = merged.merge(&wide).unwrap_err();
    assert_eq!(e.to_string(), "invalid config: stack `t`: stats field `max_unique_ids_per_partition` has 8 values, expected L·G·S = 1·1·4 = 4 (or none, for a field not recorded)");
    assert_eq!(merged, a);
    let mut short = a.clone();
    short
        .stacks
        .get_mut("t")
        .unwrap()
        .required_buffer_size_per_sc = vec![8];
    let e = merged.merge(&short).unwrap_err();
    let required = "invalid config: stack `t`: stats field `required_buffer_size_per_sc` has 1 values, expected L·S = 1·4 = 4 (or none, for a field not recorded)";
    assert_eq!(e.to_string(), required);
    let e = short.merge(&a).unwrap_err();
    assert_eq!(e.to_string(), required);
    // A field one side did not record takes the other side's values.
    let mut partial = FdoStats::new(layout(1, 1, 4));
    partial.batches = 2;
    partial
        .stacks
        .insert("t".into(), stack(&[5, 0, 0, 0], &[], &[], 3));
    partial.merge(&a).unwrap();
    assert_eq!(
        partial.stacks["t"],
        stack(&[5, 1, 1, 1], &[1, 1, 1, 1], &[8, 8, 8, 8], 3)
    );
    assert_eq!(partial.batches, 3);
}

// ---------------------------------------------------------------------------------------------
// NPZ and CSV
// ---------------------------------------------------------------------------------------------

#[test]
fn npz_round_trip() {
    let dir = TempDir::new("npz");
    let s = sample_stats();
    let p = dir.join("fdo_stats_0_1.npz");
    npz::export(&p, &s).unwrap();
    // The reference's keys: `<stack><suffix>`, int64, 1-D arrays, scalar drop counters.
    let arrays = npz::read_npz(&p).unwrap();
    let keys: Vec<&str> = arrays.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "cats_and_dogs_id_drop_counters",
            "cats_and_dogs_max_ids",
            "cats_and_dogs_max_unique_ids",
            "cats_and_dogs_required_buffer_size",
            "items_id_drop_counters",
            "items_max_ids",
            "items_max_unique_ids",
            "items_required_buffer_size",
            "q_id_drop_counters",
            "q_max_ids",
            "q_max_unique_ids",
            "q_required_buffer_size",
        ]
    );
    assert_eq!(arrays["items_max_ids"].shape, vec![16]);
    assert_eq!(
        arrays["items_required_buffer_size"].data,
        vec![64, 72, 80, 88, 96, 104, 112, 120]
    );
    assert_eq!(
        arrays["items_id_drop_counters"],
        NpyArray {
            shape: vec![],
            data: vec![3]
        }
    );
    assert_eq!(arrays["q_id_drop_counters"].data, vec![u32::MAX as i64 + 5]);

    let back = npz::import(&p, layout(2, 2, 4)).unwrap();
    assert_eq!(back.layout, s.layout);
    assert_eq!(back.stacks, s.stacks);
    assert_eq!(
        back.batches, 1,
        "the reference format holds one recorded step, not a batch count"
    );
}

#[test]
fn csv_round_trip() {
    let dir = TempDir::new("csv");
    let s = sample_stats();
    let p = dir.join("fdo_stats_0_1.csv");
    csv::export(&p, &s).unwrap();
    let text = std::fs::read_to_string(&p).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("key,values"));
    assert!(
        text.contains("\nitems_required_buffer_size,64 72 80 88 96 104 112 120\n"),
        "{text}"
    );
    assert!(text.contains("\nitems_id_drop_counters,3\n"), "{text}");
    assert_eq!(text.lines().count(), 1 + 12);
    let back = csv::import(&p, layout(2, 2, 4)).unwrap();
    assert_eq!(back.layout, s.layout);
    assert_eq!(back.stacks, s.stacks);
    assert_eq!(back.batches, 1);
}

/// SPEC 7.3 `test_load_multiple_files`: file 0 `t_one_max_ids = [10, 20, 30, 40]`, file 1
/// `[20, 10, 40, 30]` → `[20, 20, 40, 40]`; required `[64]`, `[128]` → `[128]`. File 0 is
/// written with `write_npz`, file 1 by hand (raw `.npy` bytes in a zip), as numpy would.
#[test]
fn reference_npz_files_merge_to_the_golden_maxima() {
    let dir = TempDir::new("npz-golden");
    let f0 = dir.join("fdo_stats_0_1.npz");
    let mut a = BTreeMap::new();
    a.insert("t_one_max_ids".to_string(), arr1(&[10, 20, 30, 40]));
    a.insert("t_one_required_buffer_size".to_string(), arr1(&[64]));
    npz::write_npz(&f0, &a).unwrap();

    let f1 = dir.join("fdo_stats_1_1.npz");
    write_raw_npz(
        &f1,
        &[
            (
                "t_one_max_ids",
                npy_bytes("<i8", "(4,)", &i64_bytes(&[20, 10, 40, 30])),
            ),
            (
                "t_one_required_buffer_size",
                npy_bytes("<i8", "(1,)", &i64_bytes(&[128])),
            ),
        ],
    );
    // The hand-written bytes (numpy's header text) and encode_npy's (ndarray-npy's, which has no
    // trailing ", " in the dict) are the same array: format 1.0, 64-byte aligned, `<i8`.
    let ours = npz::encode_npy(&arr1(&[20, 10, 40, 30]));
    assert!(
        ours.starts_with(b"\x93NUMPY\x01\x00") && (ours.len() - 32).is_multiple_of(64),
        "{ours:?}"
    );
    assert_eq!(
        npz::decode_npy(
            &npy_bytes("<i8", "(4,)", &i64_bytes(&[20, 10, 40, 30])),
            "numpy"
        )
        .unwrap(),
        npz::decode_npy(&ours, "ours").unwrap()
    );

    // The golden arrays hold 4 partitions and 1 SparseCore: layout 1/4/1. Under another layout
    // the file is refused, naming the array that does not fit.
    let e = npz::import(&f1, layout(1, 1, 4)).unwrap_err();
    assert_eq!(e.to_string(), "invalid config: stack `t_one`: stats field `required_buffer_size_per_sc` has 1 values, expected L·S = 1·4 = 4 (or none, for a field not recorded)");
    let mut merged = npz::import(&f0, layout(1, 4, 1)).unwrap();
    let other = npz::import(&f1, layout(1, 4, 1)).unwrap();
    assert_eq!(
        other.stacks["t_one"].max_ids_per_partition,
        vec![20, 10, 40, 30]
    );
    merged.merge(&other).unwrap();
    assert_eq!(
        merged.stacks["t_one"].max_ids_per_partition,
        vec![20, 20, 40, 40]
    );
    assert_eq!(
        merged.stacks["t_one"].required_buffer_size_per_sc,
        vec![128]
    );
    assert_eq!(merged.batches, 2);

    // An imported file is held to what a stats file is: no count past 32 bits (it was clamped),
    // no negative count, a layout with devices.
    let arrays = |v: i64| -> BTreeMap<String, NpyArray> {
        [("t_one_max_ids".to_string(), arr1(&[1, v, 3, 4]))]
            .into_iter()
            .collect()
    };
    let e = npz::stats_from_arrays(layout(1, 1, 4), &arrays(1 << 40), "big.npz").unwrap_err();
    assert_eq!(
        e.to_string(),
        "big.npz: `t_one_max_ids` holds 1099511627776, past the 32-bit counts stats hold"
    );
    let e = npz::stats_from_arrays(layout(1, 1, 4), &arrays(-3), "neg.npz").unwrap_err();
    assert!(
        e.to_string().contains("`max_ids_per_partition`[1] is -3"),
        "{e}"
    );
    let e = npz::stats_from_arrays(layout(1, 0, 4), &arrays(2), "zero.npz").unwrap_err();
    assert!(e.to_string().contains("global_device_count = 0"), "{e}");
    assert_eq!(
        npz::stats_from_arrays(layout(1, 1, 4), &arrays(2), "ok.npz")
            .unwrap()
            .stacks["t_one"]
            .max_ids_per_partition,
        vec![1, 2, 3, 4]
    );
}

#[test]
fn npy_decoding_int32_scalars_and_errors() {
    let a = npz::decode_npy(
        &npy_bytes(
            "<i4",
            "(2, 3)",
            &[1i32, -2, 3, 4, 5, 6]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>(),
        ),
        "x",
    )
    .unwrap();
    assert_eq!(
        a,
        NpyArray {
            shape: vec![2, 3],
            data: vec![1, -2, 3, 4, 5, 6]
        }
    );
    let s = npz::decode_npy(&npy_bytes("<i8", "()", &i64_bytes(&[42])), "x").unwrap();
    assert_eq!(
        s,
        NpyArray {
            shape: vec![],
            data: vec![42]
        }
    );
    assert_eq!(npz::decode_npy(&npz::encode_npy(&s), "x").unwrap(), s);

    let e = npz::decode_npy(&npy_bytes("<f8", "(1,)", &1.0f64.to_le_bytes()), "arr_f").unwrap_err();
    assert!(
        e.to_string().contains("arr_f") && e.to_string().contains("<f8"),
        "{e}"
    );
    let e = npz::decode_npy(&npy_bytes("<i8", "(4,)", &i64_bytes(&[1, 2])), "short").unwrap_err();
    assert!(e.to_string().contains("16 data bytes for 4 values"), "{e}");
    let e = npz::decode_npy(b"not numpy at all", "junk").unwrap_err();
    assert!(e.to_string().contains("not a .npy"), "{e}");
    // A Fortran-order array (numpy writes one for an F-contiguous array) reads in row-major
    // order, as np.load gives it: [[1, 2, 3], [4, 5, 6]] stored column by column.
    let mut fortran = npy_bytes("<i8", "(2, 3)", &i64_bytes(&[1, 4, 2, 5, 3, 6]));
    let pos = fortran.windows(5).position(|w| w == b"False").unwrap();
    fortran[pos..pos + 5].copy_from_slice(b"True ");
    assert_eq!(
        npz::decode_npy(&fortran, "f").unwrap(),
        NpyArray {
            shape: vec![2, 3],
            data: vec![1, 2, 3, 4, 5, 6]
        }
    );
    // Big-endian int32, which numpy writes on a big-endian host.
    let be = npz::decode_npy(
        &npy_bytes(
            ">i4",
            "(2,)",
            &[7i32, -8]
                .iter()
                .flat_map(|x| x.to_be_bytes())
                .collect::<Vec<_>>(),
        ),
        "be",
    )
    .unwrap();
    assert_eq!(
        be,
        NpyArray {
            shape: vec![2],
            data: vec![7, -8]
        }
    );

    let dir = TempDir::new("npz-bad");
    let p = dir.join("garbage.npz");
    std::fs::write(&p, b"PK\x03\x04 this is no zip").unwrap();
    let e = npz::import(&p, layout(1, 1, 4)).unwrap_err();
    assert!(e.to_string().contains("garbage.npz"), "{e}");
}

/// Hostile `.npy` headers: a shape far larger than the data (ndarray-npy alone would allocate
/// it first and abort), a format 2.0 header length of 4 GiB, and a header nested deeper than its
/// parser goes. Each is an error naming the file, in an `.npz` member too.
#[test]
fn npy_headers_that_declare_more_than_there_is_are_errors() {
    let huge = npy_bytes("<i8", "(576460752303423488,)", &i64_bytes(&[1]));
    let e = npz::decode_npy(&huge, "huge.npy").unwrap_err().to_string();
    assert!(
        e.contains("huge.npy") && e.contains("8 data bytes for 576460752303423488 values"),
        "{e}"
    );

    let mut long = b"\x93NUMPY\x02\x00".to_vec();
    long.extend_from_slice(&0xffff_fff0u32.to_le_bytes());
    long.extend_from_slice(b"{'descr': '<i8', ");
    let e = npz::decode_npy(&long, "long.npy").unwrap_err().to_string();
    assert!(
        e.contains("long.npy") && e.contains("truncated header"),
        "{e}"
    );

    let depth = 20_000;
    let deep = npy_bytes(
        "<i8",
        &format!("{}1{}", "(".repeat(depth), ",)".repeat(depth)),
        &i64_bytes(&[1]),
    );
    let e = npz::decode_npy(&deep, "deep.npy").unwrap_err().to_string();
    assert!(
        e.contains("deep.npy") && e.contains("bad header") && e.len() < 1000,
        "{e}"
    );
    let wide = npy_bytes(&"<".repeat(depth), "(1,)", &i64_bytes(&[1]));
    let e = npz::decode_npy(&wide, "wide.npy").unwrap_err().to_string();
    assert!(
        e.contains("wide.npy") && e.contains("is not int64 or int32") && e.len() < 1000,
        "{e}"
    );

    let dir = TempDir::new("npz-huge");
    let p = dir.join("huge.npz");
    write_raw_npz(&p, &[("t_max_ids", huge)]);
    let e = npz::import(&p, layout(1, 1, 4)).unwrap_err().to_string();
    assert!(
        e.contains("huge.npz/t_max_ids") && e.contains("data bytes"),
        "{e}"
    );
}

/// A deflate bomb: `t_max_ids.npy`, a valid `(4,)` int64 array (header 128 bytes, data 32) followed
/// by `mib` MiB of zeros, in one deflated member; the file is about a thousandth of that.
fn write_deflate_bomb(path: &Path, mib: usize) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    zip.start_file("t_max_ids.npy", opts).unwrap();
    zip.write_all(&npy_bytes("<i8", "(4,)", &i64_bytes(&[1, 2, 3, 4])))
        .unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..mib {
        zip.write_all(&zeros).unwrap();
    }
    zip.finish().unwrap();
}

// Regression: each member was inflated whole before its header was looked at, so a small file
// took about a thousand times its size in memory, and a larger one aborted the process.
#[test]
fn npz_deflate_bombs_are_refused_before_they_are_inflated() {
    let dir = TempDir::new("npz-bomb");
    let p = dir.join("bomb.npz");
    write_deflate_bomb(&p, 16);
    assert!(
        std::fs::metadata(&p).unwrap().len() < 200_000,
        "the bomb is small on disk"
    );
    let start = std::time::Instant::now();
    let e = npz::import(&p, layout(1, 1, 4)).unwrap_err();
    let took = start.elapsed();
    let name = p.display().to_string();
    match &e {
        Error::NpzMemberTooLarge {
            file,
            member,
            size,
            bound,
            limit,
        } => {
            assert_eq!(
                (file.as_str(), member.as_str(), *size, *bound, *limit),
                (
                    name.as_str(),
                    "t_max_ids",
                    16_777_376,
                    NpzBound::Declared,
                    160
                )
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.to_string(), format!("{name}: member `t_max_ids`: 16777376 bytes decompressed, more than its .npy header declares: 160"));
    assert!(
        took < std::time::Duration::from_secs(2),
        "refused in {took:?}"
    );
    // Without the zeros the same member reads.
    write_deflate_bomb(&p, 0);
    assert_eq!(npz::read_npz(&p).unwrap()["t_max_ids"], arr1(&[1, 2, 3, 4]));
}

/// `read_npy_member` reads a header, then exactly the data it declares: a member above the limit,
/// with a header past 64 KiB, or with even one byte more than declared is refused, naming the
/// file, member, size and limit; a short one is left to `decode_npy`, which counts its bytes.
#[test]
fn npz_members_are_read_to_what_their_header_declares() {
    let good = npy_bytes("<i8", "(4,)", &i64_bytes(&[5, 6, 7, 8]));
    assert_eq!(good.len(), 160);
    assert_eq!(
        npz::read_npy_member(&good[..], 160, 160, "f.npz", "t").unwrap(),
        good
    );

    let e = npz::read_npy_member(&good[..], 160, 159, "f.npz", "t").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NpzMemberTooLarge {
                size: 160,
                bound: NpzBound::Member,
                limit: 159,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "f.npz: member `t`: 160 bytes decompressed, past the limit on one member of 159"
    );

    let mut longer = good.clone();
    longer.push(0);
    let e = npz::read_npy_member(&longer[..], 161, 1 << 20, "f.npz", "t").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NpzMemberTooLarge {
                size: 161,
                bound: NpzBound::Declared,
                limit: 160,
                ..
            }
        ),
        "{e:?}"
    );
    // A reader that yields more than the size it was given for the member is refused the same way.
    let e = npz::read_npy_member(&longer[..], 160, 1 << 20, "f.npz", "t").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NpzMemberTooLarge {
                size: 161,
                bound: NpzBound::Declared,
                limit: 160,
                ..
            }
        ),
        "{e:?}"
    );

    let mut long = b"\x93NUMPY\x02\x00".to_vec();
    long.extend_from_slice(&0x8000_0000u32.to_le_bytes());
    let e = npz::read_npy_member(&long[..], 1 << 20, 1 << 30, "f.npz", "t").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NpzMemberTooLarge {
                size: 2_147_483_648,
                bound: NpzBound::Header,
                limit: 65_536,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "f.npz: member `t`: 2147483648 bytes of .npy header, past the header limit of 65536"
    );

    let short = &good[..150];
    let bytes = npz::read_npy_member(short, 150, 1 << 20, "f.npz", "t").unwrap();
    assert_eq!(bytes.len(), 150);
    let e = npz::decode_npy(&bytes, "f.npz/t").unwrap_err();
    assert_eq!(e.to_string(), "f.npz/t: 22 data bytes for 4 values");
    // A dtype this module does not read: only the header is read, and decode_npy names the dtype.
    let float = npy_bytes("<f8", "(1000,)", &[0u8; 8000]);
    let bytes = npz::read_npy_member(&float[..], 8128, 1 << 20, "f.npz", "x").unwrap();
    assert_eq!(bytes.len(), 128);
    assert_eq!(
        npz::decode_npy(&bytes, "f.npz/x").unwrap_err().to_string(),
        "f.npz/x: dtype '<f8' is not int64 or int32"
    );
}

/// After k recorded steps the reference stores `[k, len]` matrices (and `[k, 1]` drop
/// counters); importing reduces them to the column-wise max, and the batch count to k.
#[test]
fn two_dimensional_arrays_reduce_to_columnwise_max() {
    let dir = TempDir::new("npz-2d");
    let p = dir.join("fdo_stats_0_5.npz");
    let mut a = BTreeMap::new();
    a.insert(
        "t_max_ids".to_string(),
        NpyArray {
            shape: vec![3, 4],
            data: vec![1, 9, 3, 4, 5, 2, 7, 0, 2, 2, 2, 8],
        },
    );
    a.insert(
        "t_max_unique_ids".to_string(),
        NpyArray {
            shape: vec![3, 4],
            data: vec![1, 1, 1, 1, 0, 0, 5, 0, 2, 0, 0, 0],
        },
    );
    a.insert(
        "t_required_buffer_size".to_string(),
        NpyArray {
            shape: vec![3, 4],
            data: vec![8, 16, 24, 32, 40, 8, 8, 8, 0, 0, 0, 48],
        },
    );
    a.insert(
        "t_id_drop_counters".to_string(),
        NpyArray {
            shape: vec![3, 1],
            data: vec![4, 11, 2],
        },
    );
    npz::write_npz(&p, &a).unwrap();
    let s = npz::import(&p, layout(1, 1, 4)).unwrap();
    assert_eq!(s.batches, 3);
    assert_eq!(
        s.stacks["t"],
        stack(&[5, 9, 7, 8], &[2, 1, 5, 1], &[40, 16, 24, 48], 11)
    );

    // The same through CSV: one row per recorded step.
    let c = dir.join("fdo_stats_0_5.csv");
    std::fs::write(&c, csv::render(&a)).unwrap();
    let text = std::fs::read_to_string(&c).unwrap();
    assert!(
        text.contains("t_max_ids,1 9 3 4\nt_max_ids,5 2 7 0\nt_max_ids,2 2 2 8\n"),
        "{text}"
    );
    assert_eq!(csv::import(&c, layout(1, 1, 4)).unwrap(), s);
}

#[test]
fn unknown_keys_are_refused() {
    let dir = TempDir::new("bogus");
    let p = dir.join("bogus.npz");
    let mut a = BTreeMap::new();
    a.insert("t_max_ids".to_string(), arr1(&[1, 2, 3, 4]));
    a.insert("t_bogus".to_string(), arr1(&[1]));
    npz::write_npz(&p, &a).unwrap();
    let e = npz::import(&p, layout(1, 1, 4)).unwrap_err();
    assert!(e.to_string().contains("Unexpected key: t_bogus"), "{e}");
    assert!(e.to_string().contains("bogus.npz"), "{e}");

    let c = dir.join("bogus.csv");
    std::fs::write(&c, "key,values\nt_max_ids,1 2 3 4\nt_bogus,1\n").unwrap();
    let e = csv::import(&c, layout(1, 1, 4)).unwrap_err();
    assert!(e.to_string().contains("Unexpected key: t_bogus"), "{e}");
}

#[test]
fn csv_repeated_keys_stack_rows() {
    let text = "key,values\nt_one_max_ids,10 20 30 40\nt_one_required_buffer_size,64\nt_one_max_ids,20 10 40 30\nt_one_required_buffer_size,128\n";
    let arrays = csv::parse(text, "x.csv").unwrap();
    assert_eq!(
        arrays["t_one_max_ids"],
        NpyArray {
            shape: vec![2, 4],
            data: vec![10, 20, 30, 40, 20, 10, 40, 30]
        }
    );
    assert_eq!(
        arrays["t_one_required_buffer_size"],
        NpyArray {
            shape: vec![2, 1],
            data: vec![64, 128]
        }
    );
    let dir = TempDir::new("csv-rows");
    let p = dir.join("x.csv");
    std::fs::write(&p, text).unwrap();
    let s = csv::import(&p, layout(1, 4, 1)).unwrap();
    assert_eq!(
        s.stacks["t_one"].max_ids_per_partition,
        vec![20, 20, 40, 40]
    );
    assert_eq!(s.stacks["t_one"].required_buffer_size_per_sc, vec![128]);
    assert_eq!(s.batches, 2);

    // Malformed CSV.
    let e = csv::parse("k,v\n", "h.csv").unwrap_err();
    assert!(
        e.to_string().contains("key,values") && e.to_string().contains("h.csv"),
        "{e}"
    );
    let e = csv::parse("key,values\nt_max_ids,1 2\nt_max_ids,1 2 3\n", "r.csv").unwrap_err();
    assert!(e.to_string().contains("different lengths"), "{e}");
    let e = csv::parse("key,values\nt_max_ids,1 x 3\n", "n.csv").unwrap_err();
    assert!(
        e.to_string().contains("line 2") && e.to_string().contains("\"x\""),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// File client
// ---------------------------------------------------------------------------------------------

fn one_stack(batches: u64, v: i32) -> FdoStats {
    let mut s = FdoStats::new(layout(1, 1, 4));
    s.batches = batches;
    s.stacks.insert(
        "t".into(),
        stack(&[v, 1, 1, 1], &[1, 1, 1, 1], &[8, 8, 8, 8], 0),
    );
    s
}

/// SPEC 7.3 `test_latest_files_by_process`: files 0_10, 0_20, 0_30, 1_09, 0_40, 2_10 → the
/// latest per process are 2_10, 1_09 and 0_40. Batch counts are distinct powers of two, so the
/// merged count says which files were loaded; the stale files carry a large max that must not
/// show.
#[test]
fn file_client_loads_the_latest_file_per_process() {
    let dir = TempDir::new("latest");
    for (name, batches) in [
        ("0_10", 1),
        ("0_20", 2),
        ("0_30", 4),
        ("1_09", 8),
        ("0_40", 16),
        ("2_10", 32),
    ] {
        let stale = matches!(name, "0_10" | "0_20" | "0_30");
        let v = if stale { 1000 } else { batches as i32 };
        one_stack(batches, v)
            .write(dir.join(&format!("fdo_stats_{name}.json")))
            .unwrap();
    }
    // Files the client must ignore.
    one_stack(64, 5000)
        .write(dir.join("fdo_stats_x_99.json"))
        .unwrap();
    one_stack(128, 5000)
        .write(dir.join("other_0_99.json"))
        .unwrap();
    std::fs::write(dir.join("fdo_stats_0_99.npz"), b"not json").unwrap();

    let loaded = FileFdoClient::new(&dir.0, 7).load().unwrap();
    assert_eq!(
        loaded.batches,
        8 + 16 + 32,
        "loaded 1_09, 0_40 and 2_10 only"
    );
    assert_eq!(loaded.stacks["t"].max_ids_per_partition, vec![32, 1, 1, 1]);
}

#[test]
fn file_client_publish_and_load_across_processes() {
    let dir = TempDir::new("client");
    let mut p0 = FileFdoClient::new(&dir.0, 0);
    let mut p1 = FileFdoClient::new(&dir.0, 1);
    let e = p0.publish().unwrap_err();
    assert!(
        matches!(e, Error::InvalidData { .. })
            && e.to_string()
                .ends_with(": publish before any stats were recorded"),
        "{e}"
    );
    assert!(p0.load().is_err(), "no file yet");

    p0.record(&one_stack(1, 10)).unwrap();
    let first = p0.publish().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    p1.record(&one_stack(100, 30)).unwrap();
    let other = p1.publish().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    p0.record(&one_stack(10, 20)).unwrap();
    let second = p0.publish().unwrap();

    for (p, proc_id) in [(&first, 0), (&other, 1), (&second, 0)] {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(&format!("fdo_stats_{proc_id}_")) && name.ends_with(".json"),
            "{name}"
        );
        assert_eq!(p.parent().unwrap(), dir.0);
    }
    assert_ne!(first, second);
    // A publish holds everything recorded so far by that process.
    assert_eq!(FdoStats::from_path(&second).unwrap().batches, 11);
    assert_eq!(
        FdoStats::from_path(&second).unwrap().stacks["t"].max_ids_per_partition,
        vec![20, 1, 1, 1]
    );

    let loaded = p1.load().unwrap();
    assert_eq!(
        loaded.batches,
        11 + 100,
        "process 0's latest file and process 1's"
    );
    assert_eq!(loaded.stacks["t"].max_ids_per_partition, vec![30, 1, 1, 1]);
    assert_eq!(loaded, p0.load().unwrap());

    // Stats of another layout are refused when recorded.
    let mut g2 = one_stack(1, 1);
    g2.layout = layout(1, 2, 4);
    assert!(p0.record(&g2).is_err());
}

// ---------------------------------------------------------------------------------------------
// Tune
// ---------------------------------------------------------------------------------------------

/// Stats for config_1_1_4: `a` max 16 / unique 9 / required max 64 per SC (256 per device);
/// `b` saw no ids; `c` max 33 / unique 33 / required 100 per SC (400 per device).
fn tune_stats() -> FdoStats {
    let mut s = FdoStats::new(layout(1, 1, 4));
    s.batches = 4;
    s.stacks.insert(
        "a".into(),
        stack(&[10, 16, 3, 0], &[9, 4, 3, 0], &[40, 48, 56, 64], 0),
    );
    s.stacks.insert(
        "b".into(),
        stack(&[0, 0, 0, 0], &[0, 0, 0, 0], &[0, 0, 0, 0], 0),
    );
    s.stacks.insert(
        "c".into(),
        stack(&[33, 1, 2, 3], &[33, 1, 1, 1], &[100, 8, 8, 8], 2),
    );
    s
}

#[test]
fn tune_headroom_one_rounds_to_8_and_8s() {
    let config = config_1_1_4();
    let (tuned, changes) = tune(&config, &tune_stats(), 1.0).unwrap();
    let a = table(&tuned, "a");
    assert_eq!(
        (
            a.max_ids_per_partition,
            a.max_unique_ids_per_partition,
            a.suggested_coo_buffer_size_per_device
        ),
        (16, 16, Some(256))
    );
    let c = table(&tuned, "c");
    // 33 -> 40; 400 per device -> 416 (a multiple of 8 * S = 32).
    assert_eq!(
        (
            c.max_ids_per_partition,
            c.max_unique_ids_per_partition,
            c.suggested_coo_buffer_size_per_device
        ),
        (40, 40, Some(416))
    );
    assert_eq!(
        table(&tuned, "b"),
        table(&config, "b"),
        "no ids: the old limits stay"
    );
    assert_eq!(tuned.features, config.features);
    assert_eq!(tuned.config, config.config);

    let names: Vec<&str> = changes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["a", "c"]);
    assert_eq!(changes[0].max_ids, (256, 16));
    assert_eq!(changes[0].max_unique, (128, 16));
    assert_eq!(changes[0].suggested, (Some(2048), Some(256)));
    assert_eq!(changes[1].suggested, (Some(4096), Some(416)));
    Preprocessor::new(tuned).expect("the tuned config is valid");
}

#[test]
fn tune_headroom_1_1() {
    let config = config_1_1_4();
    let (tuned, _) = tune(&config, &tune_stats(), 1.1).unwrap();
    let a = table(&tuned, "a");
    // 16 * 1.1 = 17.6 -> 24; 9 * 1.1 = 9.9 -> 16; 256 * 1.1 = 281.6 -> 288.
    assert_eq!(
        (
            a.max_ids_per_partition,
            a.max_unique_ids_per_partition,
            a.suggested_coo_buffer_size_per_device
        ),
        (24, 16, Some(288))
    );
    let c = table(&tuned, "c");
    // 33 * 1.1 = 36.3 -> 40; 400 * 1.1 = 440 -> 448.
    assert_eq!(
        (
            c.max_ids_per_partition,
            c.max_unique_ids_per_partition,
            c.suggested_coo_buffer_size_per_device
        ),
        (40, 40, Some(448))
    );
    assert_eq!(table(&tuned, "b"), table(&config, "b"));
}

// Regression: `tune` computes `ceil(v as f64 * headroom)` in floating point, so headroom 1.1 of a
// value whose exact product is a multiple of the rounding step is rounded one step too far:
// 400 * 1.1 is 440.00000000000006 in f64, so max ids 400 becomes 448 instead of
// ceil8(440) = 440, and a required 1600 per device becomes 1792 instead of ceil32(1760) = 1760.
#[test]
fn tune_headroom_rounding_is_exact() {
    let config = Config::from_json(
        r#"{
      "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
      "tables": [{"name": "a", "vocabulary_size": 100000, "embedding_dim": 16,
                  "max_ids_per_partition": 512, "max_unique_ids_per_partition": 512}],
      "features": [{"name": "fa", "table": "a"}]
    }"#,
    )
    .unwrap();
    let mut s = FdoStats::new(layout(1, 1, 4));
    s.batches = 1;
    s.stacks.insert(
        "a".into(),
        stack(&[400, 1, 1, 1], &[80, 1, 1, 1], &[400, 8, 8, 8], 0),
    );
    let (tuned, _) = tune(&config, &s, 1.1).unwrap();
    let a = table(&tuned, "a");
    assert_eq!(
        (
            a.max_ids_per_partition,
            a.max_unique_ids_per_partition,
            a.suggested_coo_buffer_size_per_device
        ),
        (440, 88, Some(1760)),
        "ceil8(1.1 * 400), ceil8(1.1 * 80), ceil32(1.1 * 1600)"
    );
}

#[test]
fn tune_refuses_bad_input() {
    let config = config_1_1_4();
    let mut other = tune_stats();
    other.layout = layout(1, 2, 4);
    let e = tune(&config, &other, 1.1).unwrap_err();
    assert!(
        e.to_string().contains("1/1/4") && e.to_string().contains("1/2/4"),
        "{e}"
    );

    let mut unknown = tune_stats();
    unknown.stacks.insert(
        "zz".into(),
        stack(&[8, 0, 0, 0], &[8, 0, 0, 0], &[8, 0, 0, 0], 0),
    );
    let e = tune(&config, &unknown, 1.1).unwrap_err();
    assert!(
        e.to_string().contains("`zz`") && e.to_string().contains("not a table"),
        "{e}"
    );

    for h in [0.5, f64::NAN, f64::INFINITY] {
        let e = tune(&config, &tune_stats(), h).unwrap_err();
        assert!(e.to_string().contains("headroom"), "{e}");
    }
}

/// Stats measured on real batches, tuned, then replayed: nothing is dropped and the buffers are
/// exactly the tuned suggestions.
#[test]
fn tuned_config_holds_the_measured_batches() {
    use sparsecore_prep::Output;
    use sparsecore_testkit::workload::{generate, Profile, WorkloadSpec};
    let mut spec = WorkloadSpec::new(Profile::Long);
    spec.batch_size = 64;
    spec.num_batches = 3;
    spec.layout = (2, 2, 4);
    let w = generate(&spec).unwrap();
    let mut loose = w.config.clone();
    loose.config.allow_id_dropping = true;
    for t in &mut loose.tables {
        t.suggested_coo_buffer_size_per_device = None;
        t.max_ids_per_partition *= 3;
        t.max_unique_ids_per_partition *= 3;
    }
    let mut prep = Preprocessor::new(loose.clone()).unwrap();
    let mut out = Output::new();
    let mut stats = FdoStats::new(layout(2, 2, 4));
    let mut loose_c = BTreeMap::new();
    for b in &w.batches {
        prep.run_record_batch(b, &mut out).unwrap();
        stats.record(prep.plan().unwrap(), &out).unwrap();
        for so in &out.stacks {
            loose_c.insert(so.name.clone(), so.coo_buffer_size_per_device());
        }
    }
    assert_eq!(stats.batches, 3);
    let (tuned, _) = tune(&loose, &stats, 1.1).unwrap();
    let mut prep = Preprocessor::new(tuned.clone()).unwrap();
    let mut replay = FdoStats::new(layout(2, 2, 4));
    for b in &w.batches {
        prep.run_record_batch(b, &mut out).unwrap();
        replay.record(prep.plan().unwrap(), &out).unwrap();
        for so in &out.stacks {
            assert_eq!(so.stats.dropped_id_count, 0, "{}", so.name);
            let t = table(&tuned, &so.name);
            assert_eq!(
                Some(so.coo_buffer_size_per_device() as u64),
                t.suggested_coo_buffer_size_per_device
            );
            assert!(
                so.coo_buffer_size_per_device() < loose_c[&so.name],
                "{}",
                so.name
            );
        }
    }
    assert_eq!(replay, stats, "same batches, same stats");
}

/// The reference's `set_required_buffer_size_per_device(table, size, S)` stores S values
/// whatever L is; imported under L = 2 they stand for both local devices (each SparseCore's
/// share of one device's size), and a length that is neither S nor L·S is still refused.
#[test]
fn required_sizes_set_per_device_import_for_every_local_device() {
    let layout = LayoutKey {
        local_device_count: 2,
        global_device_count: 2,
        num_sc_per_device: 4,
    };
    let arrays: BTreeMap<String, NpyArray> = [
        (
            "t_max_ids".to_string(),
            arr1(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
        ),
        (
            "t_required_buffer_size".to_string(),
            arr1(&[40, 40, 48, 40]),
        ),
    ]
    .into_iter()
    .collect();
    let stats = npz::stats_from_arrays(layout, &arrays, "set.npz").unwrap();
    assert_eq!(
        stats.stacks["t"].required_buffer_size_per_sc,
        vec![40, 40, 48, 40, 40, 40, 48, 40]
    );

    let mut odd = arrays.clone();
    odd.insert("t_required_buffer_size".to_string(), arr1(&[40, 40, 48]));
    let e = npz::stats_from_arrays(layout, &odd, "odd.npz").unwrap_err();
    assert!(
        e.to_string()
            .contains("`required_buffer_size_per_sc` has 3 values, expected L·S = 2·4 = 8"),
        "{e}"
    );
}
