//! Arbitrary bytes as FDO statistics, through every reader: our JSON (`FdoStats::from_json`),
//! the reference's `.npz` (`fdo::npz::import`, and `decode_npy` on the raw bytes) and its
//! `.csv` (`fdo::csv::import`). Whatever parses is merged, tuned against a fixed config and
//! written back out; nothing may panic, and our own output must read back unchanged.

#![no_main]

use fuzz_common::write_scratch;
use libfuzzer_sys::fuzz_target;
use sparsecore_prep::fdo::{self, csv, npz, FdoStats, LayoutKey};
use sparsecore_prep::Config;

const CONFIG: &str = r#"{
  "config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 2},
  "tables": [
    {"name": "t0", "vocabulary_size": 64, "embedding_dim": 8, "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16},
    {"name": "t1", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "mean"}
  ],
  "features": [{"name": "a", "table": "t0"}, {"name": "b", "table": "t1"}]
}"#;

const LAYOUT: LayoutKey = LayoutKey {
    local_device_count: 1,
    global_device_count: 2,
    num_sc_per_device: 2,
};

/// What every successfully read stats object goes through.
fn exercise(stats: &FdoStats, config: &Config) {
    let back = FdoStats::from_json(&stats.to_json()).expect("stats we wrote parse");
    assert_eq!(&back, stats, "JSON round trip changed the stats");
    let mut merged = stats.clone();
    if merged.merge(stats).is_ok() {
        assert_eq!(
            merged.batches,
            stats.batches.saturating_mul(2),
            "batches of a self-merge"
        );
    }
    for headroom in [1.0, 1.1] {
        if let Ok((tuned, _)) = fdo::tune(config, stats, headroom) {
            // A tuned config is still a config: it parses back and plans or fails typed.
            let again = Config::from_json(&tuned.to_json()).expect("a tuned config parses");
            let _ = sparsecore_prep::Plan::new(&again, &vec![8; again.features.len()]);
        }
    }
    // The reference's formats: what we write must read back to the same arrays.
    let arrays = npz::stats_to_arrays(stats);
    // Keys with a comma or a line break are refused by `csv::export`; others must come back.
    if arrays.keys().all(|k| csv::representable(k)) {
        let parsed = csv::parse(&csv::render(&arrays), "rendered").expect("CSV we rendered parses");
        for (k, a) in &arrays {
            // An empty array renders as no line at all, so only non-empty ones come back.
            if !a.data.is_empty() {
                assert_eq!(
                    parsed.get(k).map(|p| &p.data),
                    Some(&a.data),
                    "CSV round trip of {k:?}"
                );
            }
        }
    }
    for a in arrays.values() {
        let decoded =
            npz::decode_npy(&npz::encode_npy(a), "encoded").expect("npy we encoded decodes");
        assert_eq!(&decoded, a, "npy round trip");
    }
}

fuzz_target!(|data: &[u8]| {
    let config = Config::from_json(CONFIG).expect("fixed config");
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(stats) = FdoStats::from_json(text) {
            exercise(&stats, &config);
        }
        if let Ok(arrays) = csv::parse(text, "fuzz.csv") {
            if let Ok(stats) = npz::stats_from_arrays(LAYOUT, &arrays, "fuzz.csv") {
                exercise(&stats, &config);
            }
        }
    }
    if let Ok(a) = npz::decode_npy(data, "fuzz.npy") {
        let again =
            npz::decode_npy(&npz::encode_npy(&a), "again.npy").expect("npy we encoded decodes");
        assert_eq!(again, a);
        let _ = a.max_over_rows();
    }
    // The file readers, on the same bytes.
    let scratch = write_scratch("stats", data);
    if let Ok(stats) = npz::import(scratch.path(), LAYOUT) {
        exercise(&stats, &config);
    }
    if let Ok(stats) = csv::import(scratch.path(), LAYOUT) {
        exercise(&stats, &config);
    }
    if let Ok(stats) = FdoStats::from_path(scratch.path()) {
        exercise(&stats, &config);
    }
});
