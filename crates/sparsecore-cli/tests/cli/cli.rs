//! End-to-end tests of the `sparsecore-prep` binary: `generate`, `preprocess`, `stats`,
//! `fdo merge`, `fdo tune`, `fdo export`, `fdo import`, `bench` and `demo`, run as real processes
//! in temporary directories.
//!
//! What is checked:
//! - the FDO loop of the issue (generate → preprocess → fdo merge → fdo tune → preprocess) ends
//!   with smaller buffers and no drops, and stacks that saw no ids keep their limits;
//! - the per-stack Arrow files hold exactly what the library returns for the same batches;
//! - sharded runs merged with `fdo merge` equal the unsharded run;
//! - `stats` equals `preprocess`'s stats.json; `bench --json` prints one well-typed JSON line;
//!   `demo` prints its 26 stacks;
//! - Parquet and Arrow IPC stream inputs give what the Arrow IPC file gives;
//! - every bad input exits non-zero with one line on stderr naming what is wrong, and leaves no
//!   output (final or temporary) behind;
//! - `preprocess` names every file it wrote, refuses a non-empty `--out` unless `--overwrite`,
//!   which replaces the earlier outputs all at once (no stale stack file, nothing lost on error);
//! - a closed stdout ends every subcommand quietly (status 141, nothing on stderr);
//! - `generate` draws progress on a terminal only;
//! - `fdo export` / `fdo import` print a summary and warn about what the format cannot hold.
//!
//! Tests marked `// Regression:` reproduce defects that were found and fixed; they keep them fixed.

use sparsecore_testkit::TempDir;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output as ProcOutput};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::{
    Array, ArrayRef, FixedSizeListArray, Float32Array, Int32Array, RecordBatch, UInt64Array,
};
use arrow_ipc::reader::FileReader;
use arrow_ipc::writer::{FileWriter, StreamWriter};
use arrow_schema::{DataType, Schema};
use serde_json::{json, Value};

use sparsecore_prep::io::BatchReader;
use sparsecore_prep::{Config, Output, Preprocessor};

use crate::support;
use support::{ok, run, s, BIN};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Runs and requires a failure with exactly one line on stderr, `sparsecore-prep: error: ...`;
/// returns that line.
fn fail(args: &[&str]) -> String {
    let o = run(args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "`sparsecore-prep {}` succeeded; stdout: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stdout)
    );
    assert_eq!(
        o.status.code(),
        Some(1),
        "exit status of `{}`: {}; stderr: {stderr}",
        args.join(" "),
        o.status
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "`{}`: expected one line on stderr, got {stderr:?}",
        args.join(" ")
    );
    assert!(
        lines[0].starts_with("sparsecore-prep: error: "),
        "stderr line: {:?}",
        lines[0]
    );
    lines[0].to_string()
}

fn assert_mentions(line: &str, words: &[&str]) {
    for w in words {
        assert!(
            line.contains(w),
            "error line {line:?} does not mention {w:?}"
        );
    }
}

fn read_json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// Names of the entries of a directory (empty if it does not exist), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// No `<stack>.arrow`, no `stats.json`, no temporary file in `dir`.
fn assert_no_outputs(dir: &Path) {
    let left = listing(dir);
    let bad: Vec<&String> = left
        .iter()
        .filter(|n| n.ends_with(".arrow") || n.as_str() == "stats.json" || n.contains(".tmp-"))
        .collect();
    assert!(
        bad.is_empty(),
        "partial outputs left in {}: {bad:?}",
        dir.display()
    );
}

/// No temporary file next to `path`, and `path` itself absent.
fn assert_not_written(path: &Path) {
    assert!(!path.exists(), "{} was written", path.display());
    let dir = path.parent().unwrap();
    let tmps: Vec<String> = listing(dir)
        .into_iter()
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(
        tmps.is_empty(),
        "temporary files left in {}: {tmps:?}",
        dir.display()
    );
}

/// `generate` into `dir`: returns (data, config, generate's JSON line).
fn generate(
    dir: &TempDir,
    tag: &str,
    profile: &str,
    batch: usize,
    batches: usize,
    layout: &str,
    weights: bool,
) -> (PathBuf, PathBuf, Value) {
    let data = dir.join(&format!("{tag}.arrow"));
    let cfg = dir.join(&format!("{tag}.json"));
    let bs = batch.to_string();
    let nb = batches.to_string();
    let mut args = vec![
        "generate",
        "--profile",
        profile,
        "--out",
        s(&data),
        "--config-out",
        s(&cfg),
        "--batch-size",
        &bs,
        "--num-batches",
        &nb,
        "--layout",
        layout,
    ];
    if weights {
        args.push("--weights");
    }
    let stdout = ok(&args);
    let line: Value = serde_json::from_str(stdout.trim()).expect("generate prints one JSON line");
    assert_eq!(line["batches"], json!(batches));
    assert_eq!(line["rows_per_batch"], json!(batch));
    (data, cfg, line)
}

fn preprocess(cfg: &Path, input: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "preprocess",
        "--config",
        s(cfg),
        "--input",
        s(input),
        "--out",
        s(out),
    ];
    args.extend_from_slice(extra);
    ok(&args)
}

/// Reads a per-stack output file: its schema and record batches.
fn read_stack_file(p: &Path) -> (Arc<Schema>, Vec<RecordBatch>) {
    let r = FileReader::try_new(
        File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        None,
    )
    .unwrap();
    let schema = r.schema();
    let batches = r.collect::<Result<Vec<_>, _>>().unwrap();
    (schema, batches)
}

/// The FixedSizeList width of a column.
fn width(schema: &Schema, column: &str) -> usize {
    match schema.field_with_name(column).unwrap().data_type() {
        DataType::FixedSizeList(_, n) => *n as usize,
        other => panic!("column {column} has type {other}"),
    }
}

/// Per-stack COO buffer size per device, from the output files of a run.
fn buffer_widths(out: &Path, stacks: &[String]) -> BTreeMap<String, usize> {
    stacks
        .iter()
        .map(|name| {
            (
                name.clone(),
                width(
                    &read_stack_file(&out.join(format!("{name}.arrow"))).0,
                    "embedding_ids",
                ),
            )
        })
        .collect()
}

fn stack_names(stats: &Value) -> Vec<String> {
    stats["stacks"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn vmax(v: &Value) -> i64 {
    ints(v).into_iter().max().unwrap()
}

fn roundup(x: i64, m: i64) -> i64 {
    (x + m - 1) / m * m
}

fn table<'a>(cfg: &'a Value, name: &str) -> &'a Value {
    cfg["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap()
}

fn record_batches(path: &Path) -> Vec<RecordBatch> {
    BatchReader::open(path)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

fn write_arrow_file(path: &Path, batches: &[RecordBatch]) {
    let mut w = FileWriter::try_new(File::create(path).unwrap(), &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

fn write_arrow_stream(path: &Path, batches: &[RecordBatch]) {
    let mut w = StreamWriter::try_new(File::create(path).unwrap(), &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

/// Writes batches as Parquet; with `row_group_per_batch`, one row group per record batch.
fn write_parquet(path: &Path, batches: &[RecordBatch], row_group_per_batch: bool) {
    let mut w = parquet::arrow::ArrowWriter::try_new(
        File::create(path).unwrap(),
        batches[0].schema(),
        None,
    )
    .unwrap();
    for b in batches {
        w.write(b).unwrap();
        if row_group_per_batch {
            w.flush().unwrap();
        }
    }
    w.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 1. The FDO loop of the issue
// ---------------------------------------------------------------------------------------------

/// generate → preprocess (loose config: no suggested sizes, doubled limits, dropping allowed)
/// → preprocess per shard → fdo merge → fdo tune → preprocess with the tuned config: the second
/// run drops nothing, its stats are the first run's, and every buffer is at most (here: strictly
/// below) the first run's theoretical-max buffer, and exactly the tuned suggestion.
#[test]
fn fdo_loop_generate_preprocess_merge_tune_preprocess() {
    let dir = TempDir::new("loop");
    let (data, cfg, _) = generate(&dir, "w", "criteo", 256, 4, "1/1/4", false);
    let generated = read_json(&cfg);

    let mut loose = generated.clone();
    loose["config"]["allow_id_dropping"] = json!(true);
    for t in loose["tables"].as_array_mut().unwrap() {
        t["suggested_coo_buffer_size_per_device"] = Value::Null;
        t["max_ids_per_partition"] = json!(t["max_ids_per_partition"].as_u64().unwrap() * 2);
        t["max_unique_ids_per_partition"] =
            json!(t["max_unique_ids_per_partition"].as_u64().unwrap() * 2);
    }
    let loose_path = dir.join("loose.json");
    write_json(&loose_path, &loose);

    // First run.
    let out1 = dir.join("out1");
    let summary = preprocess(&loose_path, &data, &out1, &["--threads", "2"]);
    assert!(summary.contains("4 batches"), "summary: {summary}");
    let stats1 = read_json(&out1.join("stats.json"));
    assert_eq!(stats1["batches"], json!(4));
    assert_eq!(
        stats1["layout"],
        json!({"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4})
    );
    let stacks = stack_names(&stats1);
    assert_eq!(stacks.len(), 26);
    let mut files = listing(&out1);
    files.retain(|n| n != "stats.json");
    assert_eq!(
        files,
        stacks
            .iter()
            .map(|s| format!("{s}.arrow"))
            .collect::<Vec<_>>(),
        "one file per stack, nothing else"
    );
    let w1 = buffer_widths(&out1, &stacks);
    for name in &stacks {
        // No suggestion: C = T = roundup(max_ids, 8) * S * N, with S = N = 4.
        let max_ids = table(&loose, name)["max_ids_per_partition"]
            .as_i64()
            .unwrap();
        assert_eq!(
            w1[name] as i64,
            roundup(max_ids, 8) * 16,
            "stack {name}: theoretical max buffer"
        );
        assert_eq!(
            stats1["stacks"][name]["dropped_id_count"],
            json!(0),
            "stack {name}"
        );
        // The generated config's limits are the exact maxima of the batches.
        assert_eq!(
            vmax(&stats1["stacks"][name]["max_ids_per_partition"]),
            table(&generated, name)["max_ids_per_partition"]
                .as_i64()
                .unwrap()
        );
    }

    // Shards, merged.
    let sh0 = dir.join("sh0");
    let sh1 = dir.join("sh1");
    preprocess(&loose_path, &data, &sh0, &["--shard", "0/2"]);
    preprocess(&loose_path, &data, &sh1, &["--shard", "1/2"]);
    let merged = dir.join("merged.json");
    let msg = ok(&[
        "fdo",
        "merge",
        s(&sh0.join("stats.json")),
        s(&sh1.join("stats.json")),
        "-o",
        s(&merged),
    ]);
    assert!(
        msg.contains("merged 2 files, 4 batches, 26 stacks"),
        "merge said: {msg}"
    );
    assert_eq!(
        read_json(&merged),
        stats1,
        "merged shard stats equal the unsharded run's"
    );

    // Tune.
    let tuned_path = dir.join("tuned.json");
    let report = ok(&[
        "fdo",
        "tune",
        "--config",
        s(&loose_path),
        "--stats",
        s(&merged),
        "--headroom",
        "1.1",
        "-o",
        s(&tuned_path),
    ]);
    assert!(
        report.contains(&format!("wrote {}", tuned_path.display())),
        "tune said: {report}"
    );
    assert!(
        listing(&dir.0).iter().all(|n| !n.contains(".tmp-")),
        "no temporary file next to tuned.json"
    );
    let tuned = read_json(&tuned_path);
    assert_eq!(tuned["config"], loose["config"], "options are kept");
    assert_eq!(tuned["features"], loose["features"], "features are kept");
    for name in &stacks {
        let st = &stats1["stacks"][name];
        let t = table(&tuned, name);
        let (ids, uniq, req) = (
            vmax(&st["max_ids_per_partition"]),
            vmax(&st["max_unique_ids_per_partition"]),
            vmax(&st["required_buffer_size_per_sc"]) * 4,
        );
        let new_ids = t["max_ids_per_partition"].as_i64().unwrap();
        let new_uniq = t["max_unique_ids_per_partition"].as_i64().unwrap();
        let new_sugg = t["suggested_coo_buffer_size_per_device"].as_i64().unwrap();
        // ceil8(1.1 * max) (integer bounds: no float in the test).
        assert_eq!(new_ids % 8, 0, "{name}: max ids {new_ids}");
        assert!(
            10 * new_ids >= 11 * ids && new_ids < roundup((11 * ids + 9) / 10, 8) + 8,
            "{name}: max ids {ids} -> {new_ids}"
        );
        assert_eq!(new_uniq % 8, 0, "{name}");
        assert!(
            10 * new_uniq >= 11 * uniq && new_uniq <= new_ids,
            "{name}: unique {uniq} -> {new_uniq}"
        );
        assert_eq!(
            new_sugg % 32,
            0,
            "{name}: suggested {new_sugg} is a multiple of 8 * S"
        );
        assert!(
            10 * new_sugg >= 11 * req && new_sugg < roundup((11 * req + 9) / 10, 32) + 32,
            "{name}: required {req} -> {new_sugg}"
        );
        assert!(report.contains(name.as_str()), "tune report names {name}");
    }

    // Second run with the tuned config.
    let out2 = dir.join("out2");
    preprocess(&tuned_path, &data, &out2, &[]);
    let stats2 = read_json(&out2.join("stats.json"));
    for name in &stacks {
        assert_eq!(
            stats2["stacks"][name]["dropped_id_count"],
            json!(0),
            "stack {name} dropped ids after tuning"
        );
    }
    assert_eq!(stats2, stats1, "same data, no drops: the same stats");
    let w2 = buffer_widths(&out2, &stacks);
    for name in &stacks {
        let sugg = table(&tuned, name)["suggested_coo_buffer_size_per_device"]
            .as_u64()
            .unwrap() as usize;
        assert_eq!(w2[name], sugg, "stack {name}: buffer = tuned suggestion");
        assert!(
            w2[name] < w1[name],
            "stack {name}: tuned buffer {} not below the loose {}",
            w2[name],
            w1[name]
        );
    }
}

/// `fdo tune` leaves the limits and suggestion of a stack whose stats saw no id (all-zero
/// arrays) or that is absent from the stats, and tunes the others.
#[test]
fn fdo_tune_keeps_limits_of_stacks_without_ids() {
    let dir = TempDir::new("tune-zero");
    let (data, cfg, _) = generate(&dir, "w", "long", 64, 2, "1/1/4", false);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let mut stats = read_json(&out.join("stats.json"));
    assert_eq!(stack_names(&stats), vec!["cats", "items", "queries"]);
    // `cats` saw no ids; `queries` is missing from the stats.
    let cats = &mut stats["stacks"]["cats"];
    for k in [
        "max_ids_per_partition",
        "max_unique_ids_per_partition",
        "required_buffer_size_per_sc",
    ] {
        cats[k] = json!([0, 0, 0, 0]);
    }
    stats["stacks"].as_object_mut().unwrap().remove("queries");
    let crafted = dir.join("crafted.json");
    write_json(&crafted, &stats);

    let config = read_json(&cfg);
    let tuned_path = dir.join("tuned.json");
    ok(&[
        "fdo",
        "tune",
        "--config",
        s(&cfg),
        "--stats",
        s(&crafted),
        "--headroom",
        "1.0",
        "-o",
        s(&tuned_path),
    ]);
    let tuned = read_json(&tuned_path);
    assert_eq!(
        table(&tuned, "cats"),
        table(&config, "cats"),
        "no ids: old limits kept"
    );
    assert_eq!(
        table(&tuned, "queries"),
        table(&config, "queries"),
        "absent: old limits kept"
    );
    // `items` is tuned with headroom 1.0: ceil8(max), ceil_{8S}(required).
    let st = &stats["stacks"]["items"];
    let t = table(&tuned, "items");
    assert_eq!(
        t["max_ids_per_partition"].as_i64().unwrap(),
        roundup(vmax(&st["max_ids_per_partition"]), 8)
    );
    assert_eq!(
        t["max_unique_ids_per_partition"].as_i64().unwrap(),
        roundup(vmax(&st["max_unique_ids_per_partition"]), 8)
    );
    assert_eq!(
        t["suggested_coo_buffer_size_per_device"].as_i64().unwrap(),
        roundup(vmax(&st["required_buffer_size_per_sc"]) * 4, 32)
    );
    // The tuned config runs.
    let out2 = dir.join("out2");
    preprocess(&tuned_path, &data, &out2, &[]);
}

// ---------------------------------------------------------------------------------------------
// 2. Output files = library output
// ---------------------------------------------------------------------------------------------

fn fsl_values_i32(batch: &RecordBatch, column: &str) -> (usize, Vec<i32>) {
    let a = batch
        .column_by_name(column)
        .unwrap()
        .as_any()
        .downcast_ref::<FixedSizeListArray>()
        .unwrap();
    assert_eq!(a.null_count(), 0);
    let v = a.values().as_any().downcast_ref::<Int32Array>().unwrap();
    (a.value_length() as usize, v.values().to_vec())
}

fn fsl_values_f32_bits(batch: &RecordBatch, column: &str) -> (usize, Vec<u32>) {
    let a = batch
        .column_by_name(column)
        .unwrap()
        .as_any()
        .downcast_ref::<FixedSizeListArray>()
        .unwrap();
    let v = a.values().as_any().downcast_ref::<Float32Array>().unwrap();
    (
        a.value_length() as usize,
        v.values().iter().map(|x| x.to_bits()).collect(),
    )
}

/// Runs `preprocess` and compares every stack file, record batch by record batch and device
/// row by device row, with `Preprocessor::run_record_batch` on the same batches.
fn check_files_match_library(profile: &str, batch: usize, layout: &str, l: usize) {
    let dir = TempDir::new("match");
    let (data, cfg, _) = generate(&dir, "w", profile, batch, 3, layout, true);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &["--threads", "3"]);

    let config = Config::from_path(&cfg).unwrap();
    let mut prep = Preprocessor::builder(config).threads(1).build().unwrap();
    let mut lib: Vec<Output> = Vec::new();
    for b in record_batches(&data) {
        let mut o = Output::new();
        prep.run_record_batch(&b, &mut o).unwrap();
        lib.push(o);
    }
    let names: Vec<String> = lib[0].stacks.iter().map(|s| s.name.clone()).collect();
    let mut expected_files: Vec<String> = names.iter().map(|n| format!("{n}.arrow")).collect();
    expected_files.push("stats.json".into());
    expected_files.sort();
    assert_eq!(listing(&out), expected_files);

    for (si, name) in names.iter().enumerate() {
        let (schema, batches) = read_stack_file(&out.join(format!("{name}.arrow")));
        let cols: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            cols,
            [
                "batch",
                "device",
                "row_pointers",
                "embedding_ids",
                "sample_ids",
                "gains"
            ]
        );
        assert_eq!(schema.field(0).data_type(), &DataType::UInt64);
        assert_eq!(schema.field(1).data_type(), &DataType::Int32);
        assert_eq!(
            batches.len(),
            lib.len(),
            "{name}: one record batch per input batch"
        );
        for (bi, (rb, o)) in batches.iter().zip(&lib).enumerate() {
            let so = &o.stacks[si];
            assert_eq!(so.name, *name);
            assert_eq!(rb.num_rows(), l, "{name}: one row per local device");
            let bcol = rb.column(0).as_any().downcast_ref::<UInt64Array>().unwrap();
            assert_eq!(
                bcol.values().to_vec(),
                vec![bi as u64; l],
                "{name}: batch column"
            );
            let dcol = rb.column(1).as_any().downcast_ref::<Int32Array>().unwrap();
            assert_eq!(
                dcol.values().to_vec(),
                (0..l as i32).collect::<Vec<_>>(),
                "{name}: device column"
            );
            let (rp, row_pointers) = fsl_values_i32(rb, "row_pointers");
            let (c, embedding_ids) = fsl_values_i32(rb, "embedding_ids");
            let (c2, sample_ids) = fsl_values_i32(rb, "sample_ids");
            let (c3, gains) = fsl_values_f32_bits(rb, "gains");
            assert_eq!(rp, so.row_pointers_per_device());
            assert_eq!(
                (c, c2, c3),
                (
                    so.coo_buffer_size_per_device(),
                    so.coo_buffer_size_per_device(),
                    so.coo_buffer_size_per_device()
                )
            );
            let lib_gains: Vec<u32> = so.gains.iter().map(|g| g.to_bits()).collect();
            for d in 0..l {
                assert_eq!(
                    row_pointers[d * rp..(d + 1) * rp],
                    so.row_pointers[d * rp..(d + 1) * rp],
                    "{name} batch {bi} device {d}: row_pointers"
                );
                assert_eq!(
                    embedding_ids[d * c..(d + 1) * c],
                    so.embedding_ids[d * c..(d + 1) * c],
                    "{name} batch {bi} device {d}: embedding_ids"
                );
                assert_eq!(
                    sample_ids[d * c..(d + 1) * c],
                    so.sample_ids[d * c..(d + 1) * c],
                    "{name} batch {bi} device {d}: sample_ids"
                );
                assert_eq!(
                    gains[d * c..(d + 1) * c],
                    lib_gains[d * c..(d + 1) * c],
                    "{name} batch {bi} device {d}: gains (bits)"
                );
            }
            assert_eq!(row_pointers.len(), so.row_pointers.len());
            assert_eq!(embedding_ids.len(), so.embedding_ids.len());
        }
    }
    // The weights are not all one: gains carry information.
    let g: Vec<f32> = lib[0].stacks[0]
        .gains
        .iter()
        .copied()
        .filter(|g| !g.is_nan())
        .collect();
    assert!(
        g.iter().any(|&x| x != 1.0),
        "weighted workload has non-unit gains"
    );
}

#[test]
fn output_files_equal_library_output_two_local_devices() {
    check_files_match_library("long", 64, "2/2/4", 2);
}

#[test]
fn output_files_equal_library_output_two_global_devices() {
    check_files_match_library("criteo", 64, "1/2/4", 1);
}

// ---------------------------------------------------------------------------------------------
// 3. Shards
// ---------------------------------------------------------------------------------------------

/// `--shard 0/2` and `--shard 1/2` process batches {0, 2} and {1, 3}; `fdo merge` of their
/// stats equals the unsharded stats (maxima, drops, batch count).
#[test]
fn shards_merged_equal_unsharded_run() {
    let dir = TempDir::new("shards");
    let (data, cfg, _) = generate(&dir, "w", "criteo", 256, 4, "1/1/4", true);
    // Tight limits with dropping, so that dropped counts are non-zero and must be summed.
    let mut c = read_json(&cfg);
    c["config"]["allow_id_dropping"] = json!(true);
    for t in c["tables"].as_array_mut().unwrap() {
        t["max_ids_per_partition"] = json!(16);
        t["max_unique_ids_per_partition"] = json!(16);
        t["suggested_coo_buffer_size_per_device"] = Value::Null;
    }
    let tight = dir.join("tight.json");
    write_json(&tight, &c);

    let all = dir.join("all");
    preprocess(&tight, &data, &all, &[]);
    let full = read_json(&all.join("stats.json"));
    let total_dropped: u64 = full["stacks"]
        .as_object()
        .unwrap()
        .values()
        .map(|s| s["dropped_id_count"].as_u64().unwrap())
        .sum();
    assert!(total_dropped > 0, "the tight config drops ids");

    let mut shard_stats = Vec::new();
    for (i, want_batches) in [(0, [0u64, 2]), (1, [1, 3])] {
        let out = dir.join(&format!("shard{i}"));
        let spec = format!("{i}/2");
        preprocess(&tight, &data, &out, &["--shard", &spec]);
        let st = read_json(&out.join("stats.json"));
        assert_eq!(st["batches"], json!(2));
        let (_, rbs) = read_stack_file(&out.join("t07.arrow"));
        let got: Vec<u64> = rbs
            .iter()
            .map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<UInt64Array>()
                    .unwrap()
                    .value(0)
            })
            .collect();
        assert_eq!(got, want_batches, "shard {i} holds batches i, i + N");
        shard_stats.push(out.join("stats.json"));
    }
    let merged = dir.join("merged.json");
    ok(&[
        "fdo",
        "merge",
        s(&shard_stats[0]),
        s(&shard_stats[1]),
        "-o",
        s(&merged),
    ]);
    let m = read_json(&merged);
    assert_eq!(m["batches"], json!(4));
    for name in stack_names(&full) {
        let (a, b) = (read_json(&shard_stats[0]), read_json(&shard_stats[1]));
        assert_eq!(
            m["stacks"][&name]["dropped_id_count"].as_u64().unwrap(),
            a["stacks"][&name]["dropped_id_count"].as_u64().unwrap()
                + b["stacks"][&name]["dropped_id_count"].as_u64().unwrap(),
            "{name}: drops are summed"
        );
    }
    assert_eq!(m, full, "merged shards = unsharded");

    // The same through the stats subcommand.
    let s0 = dir.join("s0.json");
    ok(&[
        "stats",
        "--config",
        s(&tight),
        "--input",
        s(&data),
        "--shard",
        "0/2",
        "--out",
        s(&s0),
    ]);
    assert_eq!(read_json(&s0), read_json(&shard_stats[0]));
}

// ---------------------------------------------------------------------------------------------
// 4. stats
// ---------------------------------------------------------------------------------------------

#[test]
fn stats_subcommand_equals_preprocess_stats() {
    let dir = TempDir::new("stats");
    let (data, cfg, _) = generate(&dir, "w", "long", 64, 3, "2/2/4", true);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let want = read_json(&out.join("stats.json"));
    assert_eq!(want["batches"], json!(3));

    let st = dir.join("st.json");
    let summary = ok(&[
        "stats",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&st),
    ]);
    assert_eq!(read_json(&st), want);
    assert!(
        summary.contains("3 batches") && summary.contains("items"),
        "summary: {summary}"
    );

    let stdout = ok(&[
        "stats",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--threads",
        "2",
    ]);
    let printed: Value =
        serde_json::from_str(&stdout).expect("stats without --out prints JSON only");
    assert_eq!(printed, want);
    assert_eq!(
        listing(&dir.0),
        vec!["out", "st.json", "w.arrow", "w.json"],
        "nothing else written"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. bench --json, 6. demo
// ---------------------------------------------------------------------------------------------

#[test]
fn bench_json_prints_one_line() {
    let dir = TempDir::new("bench");
    let (data, cfg, gen) = generate(&dir, "w", "criteo", 64, 2, "1/1/4", false);
    let o = run(&[
        "bench",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--threads",
        "2",
        "--repeat",
        "3",
        "--warmup",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "exactly one line: {stdout:?}");
    assert!(stdout.ends_with('\n'));
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["tool"], json!("sparsecore-prep"));
    assert_eq!(v["version"], json!(env!("CARGO_PKG_VERSION")));
    assert!(v["ids"].is_u64());
    assert_eq!(
        v["ids"], gen["total_ids"],
        "ids = the generator's total_ids"
    );
    assert!(gen["total_ids"].as_u64().unwrap() > 0);
    assert_eq!(v["batches"], json!(2));
    assert_eq!(v["threads"], json!(2));
    let median = v["median_ms"].as_f64().expect("median_ms is a number");
    let min = v["min_ms"].as_f64().expect("min_ms is a number");
    assert!(min > 0.0 && min <= median, "min {min} median {median}");
    let ips = v["ids_per_sec"]
        .as_u64()
        .expect("ids_per_sec is an integer");
    let expect = v["ids"].as_f64().unwrap() / (median / 1e3);
    assert!(
        (ips as f64 - expect).abs() <= 1.0,
        "ids_per_sec {ips} vs {expect}"
    );
}

#[test]
fn demo_prints_26_stacks() {
    let o = run(&["demo", "--threads", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("demo batch: 256 samples, 26 features")
            && lines[0].contains("26 stacks"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("stack") && lines[1].contains("dropped"),
        "{}",
        lines[1]
    );
    let rows: Vec<&str> = lines[2..]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    let want: Vec<String> = (0..26).map(|i| format!("t{i:02}")).collect();
    assert_eq!(rows, want, "one row per stack");
    // No drops in the demo batch.
    assert!(lines[2..]
        .iter()
        .all(|l| l.split_whitespace().last() == Some("0")));
}

// ---------------------------------------------------------------------------------------------
// 7. Bad input: one line, non-zero, nothing left behind
// ---------------------------------------------------------------------------------------------

/// A small valid workload: criteo, 2 batches of 64 samples.
fn small(dir: &TempDir) -> (PathBuf, PathBuf) {
    let (data, cfg, _) = generate(dir, "w", "criteo", 64, 2, "1/1/4", false);
    (data, cfg)
}

fn preprocess_fails(cfg: &Path, input: &Path, out: &Path) -> String {
    let line = fail(&[
        "preprocess",
        "--config",
        s(cfg),
        "--input",
        s(input),
        "--out",
        s(out),
    ]);
    assert_no_outputs(out);
    line
}

#[test]
fn missing_column_is_refused() {
    let dir = TempDir::new("missing-col");
    let (data, cfg) = small(&dir);
    let mut c = read_json(&cfg);
    c["features"][3]["column"] = json!("no_such_column");
    let bad = dir.join("bad.json");
    write_json(&bad, &c);
    let out = dir.join("out");
    let line = preprocess_fails(&bad, &data, &out);
    assert_mentions(&line, &["no_such_column", "f03", "not found"]);
    // stats fails the same way.
    let line = fail(&[
        "stats",
        "--config",
        s(&bad),
        "--input",
        s(&data),
        "--out",
        s(&dir.join("st.json")),
    ]);
    assert_mentions(&line, &["no_such_column"]);
    assert_not_written(&dir.join("st.json"));
}

/// A config with one table `t0` and one feature `f0`, and a file whose `f0` is `List<Utf8>`.
fn utf8_column_file(dir: &TempDir) -> (PathBuf, PathBuf) {
    let cfg = dir.join("cfg.json");
    write_json(
        &cfg,
        &json!({
            "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
            "tables": [{"name": "t0", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "sum",
                        "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64}],
            "features": [{"name": "f0", "table": "t0"}]
        }),
    );
    let mut b = ListBuilder::new(StringBuilder::new());
    for r in 0..8 {
        b.values().append_value(format!("id{r}"));
        b.append(true);
    }
    let col: ArrayRef = Arc::new(b.finish());
    let batch = RecordBatch::try_from_iter([("f0", col)]).unwrap();
    let data = dir.join("utf8.arrow");
    write_arrow_file(&data, &[batch]);
    (data, cfg)
}

#[test]
fn wrongly_typed_column_is_refused() {
    let dir = TempDir::new("utf8-col");
    let (data, cfg) = utf8_column_file(&dir);
    let out = dir.join("out");
    let line = preprocess_fails(&cfg, &data, &out);
    assert_mentions(&line, &["`f0`", "Utf8", "expected"]);
}

#[test]
fn corrupt_arrow_file_is_refused() {
    let dir = TempDir::new("corrupt-arrow");
    let (_, cfg) = small(&dir);
    let bad = dir.join("corrupt.arrow");
    let mut bytes = b"ARROW1\0\0".to_vec();
    bytes.extend((0..4000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8));
    std::fs::write(&bad, bytes).unwrap();
    let line = preprocess_fails(&cfg, &bad, &dir.join("out"));
    assert_mentions(&line, &["corrupt.arrow"]);

    // Not Arrow or Parquet at all.
    let text = dir.join("notes.arrow");
    std::fs::write(&text, "hello, this is not a columnar file\n").unwrap();
    let line = preprocess_fails(&cfg, &text, &dir.join("out2"));
    assert_mentions(
        &line,
        &[
            "notes.arrow",
            "neither Parquet nor an Arrow IPC file or stream",
        ],
    );

    // Empty file.
    let empty = dir.join("empty.arrow");
    std::fs::write(&empty, "").unwrap();
    let line = preprocess_fails(&cfg, &empty, &dir.join("out3"));
    assert_mentions(&line, &["empty.arrow"]);
}

#[test]
fn truncated_arrow_file_is_refused() {
    let dir = TempDir::new("trunc-arrow");
    let (data, cfg) = small(&dir);
    let bytes = std::fs::read(&data).unwrap();
    let cut = dir.join("cut.arrow");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let line = preprocess_fails(&cfg, &cut, &dir.join("out"));
    assert_mentions(&line, &["cut.arrow"]);
}

/// A stream truncated inside its second record batch fails after the first batch was written
/// to temporary files: they are removed.
#[test]
fn truncated_arrow_stream_fails_midway_and_cleans_up() {
    let dir = TempDir::new("trunc-stream");
    let (data, cfg) = small(&dir);
    let stream = dir.join("full.arrows");
    write_arrow_stream(&stream, &record_batches(&data));
    let bytes = std::fs::read(&stream).unwrap();
    let cut = dir.join("cut.arrows");
    std::fs::write(&cut, &bytes[..bytes.len() * 3 / 4]).unwrap();
    let line = preprocess_fails(&cfg, &cut, &dir.join("out"));
    assert_mentions(&line, &["cut.arrows", "record batch 1"]);
}

#[test]
fn corrupt_parquet_file_is_refused() {
    let dir = TempDir::new("corrupt-parquet");
    let (data, cfg) = small(&dir);
    let bad = dir.join("bad.parquet");
    let mut bytes = b"PAR1".to_vec();
    bytes.extend((0..3000u32).map(|i| (i.wrapping_mul(40503) >> 7) as u8));
    std::fs::write(&bad, bytes).unwrap();
    let line = preprocess_fails(&cfg, &bad, &dir.join("out"));
    assert_mentions(&line, &["bad.parquet", "Parquet"]);

    // A truncated valid Parquet file.
    let good = dir.join("good.parquet");
    write_parquet(&good, &record_batches(&data), true);
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let line = preprocess_fails(&cfg, &cut, &dir.join("out2"));
    assert_mentions(&line, &["cut.parquet"]);
}

#[test]
fn unknown_table_in_config_is_refused() {
    let dir = TempDir::new("unknown-table");
    let (data, cfg) = small(&dir);
    let mut c = read_json(&cfg);
    c["features"][5]["table"] = json!("no_such_table");
    let bad = dir.join("bad.json");
    write_json(&bad, &c);
    let line = preprocess_fails(&bad, &data, &dir.join("out"));
    assert_mentions(&line, &["no_such_table", "f05", "unknown table"]);

    // A missing config or input file is named.
    let line = preprocess_fails(&dir.join("absent.json"), &data, &dir.join("out2"));
    assert_mentions(&line, &["absent.json"]);
    let line = preprocess_fails(&cfg, &dir.join("absent.arrow"), &dir.join("out3"));
    assert_mentions(&line, &["absent.arrow"]);
    // A config that is not valid JSON is named.
    let broken = dir.join("broken.json");
    std::fs::write(&broken, "{\"config\": ").unwrap();
    let line = preprocess_fails(&broken, &data, &dir.join("out4"));
    assert_mentions(&line, &["broken.json"]);
}

/// Limits too small for batch 1 (but not batch 0): the error comes after batch 0's buffers went
/// to temporary files, which must be removed.
#[test]
fn limit_exceeded_midway_leaves_nothing() {
    let dir = TempDir::new("limit-midway");
    // Same seed: the 1-batch workload is the first batch of the 4-batch one, and its config's
    // limits are that batch's exact maxima.
    let (_, cfg1, _) = generate(&dir, "one", "criteo", 64, 1, "1/1/4", false);
    let (data4, cfg4, _) = generate(&dir, "four", "criteo", 64, 4, "1/1/4", false);
    let (c1, c4) = (read_json(&cfg1), read_json(&cfg4));
    assert_ne!(
        c1["tables"], c4["tables"],
        "later batches need larger limits"
    );
    let line = preprocess_fails(&cfg1, &data4, &dir.join("out"));
    assert_mentions(&line, &["stack `t", "is greater than the set"]);
}

/// Stats of another layout: merge names both layouts and both files, tune names both layouts;
/// neither writes its output.
#[test]
fn fdo_merge_and_tune_refuse_another_layout() {
    let dir = TempDir::new("layout");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let a = out.join("stats.json");
    let mut other = read_json(&a);
    other["layout"]["global_device_count"] = json!(2);
    let b = dir.join("g2.json");
    write_json(&b, &other);
    let merged = dir.join("merged.json");
    // Arrays of 1/1/4's lengths under layout 1/2/4: the file is refused, named.
    let line = fail(&["fdo", "merge", s(&a), s(&b), "-o", s(&merged)]);
    assert_mentions(&line, &["g2.json: invalid config: stack `t00`: stats field `max_ids_per_partition` has 4 values, expected L·G·S = 1·2·4 = 8"]);
    // With 1·2·4 = 8 partitions (and L·S = 4 SparseCores as before), it is stats of another layout.
    for st in other["stacks"].as_object_mut().unwrap().values_mut() {
        for k in ["max_ids_per_partition", "max_unique_ids_per_partition"] {
            let v = st[k].as_array().unwrap().clone();
            st[k] = json!([v.clone(), v].concat());
        }
    }
    write_json(&b, &other);
    let line = fail(&["fdo", "merge", s(&a), s(&b), "-o", s(&merged)]);
    assert_mentions(&line, &["1/1/4", "1/2/4", "g2.json", "stats.json"]);
    assert_not_written(&merged);

    let tuned = dir.join("tuned.json");
    let line = fail(&[
        "fdo",
        "tune",
        "--config",
        s(&cfg),
        "--stats",
        s(&b),
        "-o",
        s(&tuned),
    ]);
    assert_mentions(&line, &["1/1/4", "1/2/4"]);
    assert_not_written(&tuned);
}

#[test]
fn fdo_merge_refuses_another_stack_set() {
    let dir = TempDir::new("stack-set");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let a = out.join("stats.json");
    let mut other = read_json(&a);
    let st = other["stacks"].as_object_mut().unwrap();
    let t25 = st.remove("t25").unwrap();
    st.insert("zz_extra".into(), t25);
    let b = dir.join("other.json");
    write_json(&b, &other);
    let merged = dir.join("merged.json");
    let line = fail(&["fdo", "merge", s(&a), s(&b), "-o", s(&merged)]);
    assert_mentions(&line, &["t25", "zz_extra", "different stacks"]);
    assert_not_written(&merged);
}

#[test]
fn fdo_merge_reports_unreadable_stats() {
    let dir = TempDir::new("merge-bad");
    let a = dir.join("a.json");
    std::fs::write(&a, "{\"version\": 1, \"layout\": ").unwrap();
    let merged = dir.join("merged.json");
    let line = fail(&["fdo", "merge", s(&a), "-o", s(&merged)]);
    assert_mentions(&line, &["a.json"]);
    let line = fail(&[
        "fdo",
        "merge",
        s(&dir.join("missing.json")),
        "-o",
        s(&merged),
    ]);
    assert_mentions(&line, &["missing.json"]);
    assert_not_written(&merged);
}

#[test]
fn non_writable_output_dir_is_refused() {
    let dir = TempDir::new("non-writable");
    let (data, cfg) = small(&dir);
    let file = dir.join("regular_file");
    std::fs::write(&file, "x").unwrap();
    let under = file.join("out");
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&under),
    ]);
    assert_mentions(&line, &["regular_file/out", "output directory"]);
    // --out is itself a regular file.
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&file),
    ]);
    assert_mentions(&line, &["regular_file"]);
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    // Nothing but the inputs and the file in the temp dir.
    assert_eq!(listing(&dir.0), vec!["regular_file", "w.arrow", "w.json"]);
    // stats --out and fdo merge -o under a regular file.
    let line = fail(&[
        "stats",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&file.join("st.json")),
    ]);
    assert_mentions(&line, &["regular_file/st.json"]);
}

// Regression: `preprocess` renames the per-stack files into place one by one and writes stats.json
// last; when writing stats.json fails (here: a directory of that name is in the way), the
// already renamed `<stack>.arrow` files stay behind, although the run failed.
#[test]
fn failure_when_finishing_leaves_no_stack_files() {
    let dir = TempDir::new("finish-fail");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    std::fs::create_dir_all(out.join("stats.json")).unwrap();
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&out),
    ]);
    assert_mentions(&line, &["stats.json"]);
    let left: Vec<String> = listing(&out)
        .into_iter()
        .filter(|n| n.ends_with(".arrow") || n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "a failed run left outputs: {left:?}");
}

// Regression: the issue asks every bad-input message to say which file is at fault. These name the
// column / table / layout but not the file: a missing or wrongly typed column does not name the
// input file, an unknown table does not name the config file, and `fdo tune` of stats from
// another layout does not name the stats file (and swaps the layouts: it calls the config's
// layout the stats' layout).
#[test]
fn bad_input_messages_name_the_file() {
    let dir = TempDir::new("names-file");
    let (data, cfg) = small(&dir);
    let mut failures = Vec::new();

    let mut c = read_json(&cfg);
    c["features"][3]["column"] = json!("no_such_column");
    let missing = dir.join("missing_col.json");
    write_json(&missing, &c);
    let line = fail(&[
        "preprocess",
        "--config",
        s(&missing),
        "--input",
        s(&data),
        "--out",
        s(&dir.join("o1")),
    ]);
    if !line.contains("w.arrow") {
        failures.push(format!(
            "missing column: {line:?} does not name the input w.arrow"
        ));
    }

    let sub = TempDir::new("names-file-utf8");
    let (utf8, ucfg) = utf8_column_file(&sub);
    let line = fail(&[
        "preprocess",
        "--config",
        s(&ucfg),
        "--input",
        s(&utf8),
        "--out",
        s(&dir.join("o2")),
    ]);
    if !line.contains("utf8.arrow") {
        failures.push(format!(
            "wrongly typed column: {line:?} does not name the input utf8.arrow"
        ));
    }

    let mut c = read_json(&cfg);
    c["features"][5]["table"] = json!("no_such_table");
    let unknown = dir.join("unknown_table.json");
    write_json(&unknown, &c);
    let line = fail(&[
        "preprocess",
        "--config",
        s(&unknown),
        "--input",
        s(&data),
        "--out",
        s(&dir.join("o3")),
    ]);
    if !line.contains("unknown_table.json") {
        failures.push(format!(
            "unknown table: {line:?} does not name the config unknown_table.json"
        ));
    }

    let out = dir.join("o4");
    preprocess(&cfg, &data, &out, &[]);
    let mut st = read_json(&out.join("stats.json"));
    st["layout"]["local_device_count"] = json!(2);
    let other = dir.join("l2_stats.json");
    write_json(&other, &st);
    let line = fail(&[
        "fdo",
        "tune",
        "--config",
        s(&cfg),
        "--stats",
        s(&other),
        "-o",
        s(&dir.join("t.json")),
    ]);
    if !line.contains("l2_stats.json") {
        failures.push(format!(
            "tune layout: {line:?} does not name the stats l2_stats.json"
        ));
    }
    // The config is 1/1/4 and the stats 2/1/4; the message must not call 1/1/4 the stats' layout.
    if line.contains("stats of layout L/G/S = 1/1/4") {
        failures.push(format!("tune layout: {line:?} attributes the config's layout 1/1/4 to the stats (which are 2/1/4)"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 8. Parquet and Arrow IPC stream input
// ---------------------------------------------------------------------------------------------

/// Compares two output directories: the same file names, stats and record batches.
fn assert_same_outputs(a: &Path, b: &Path) {
    assert_eq!(listing(a), listing(b));
    assert_eq!(
        read_json(&a.join("stats.json")),
        read_json(&b.join("stats.json"))
    );
    for name in listing(a).into_iter().filter(|n| n.ends_with(".arrow")) {
        assert_eq!(
            read_stack_file(&a.join(&name)).1,
            read_stack_file(&b.join(&name)).1,
            "{name}"
        );
    }
}

#[test]
fn arrow_stream_input_equals_arrow_file_input() {
    let dir = TempDir::new("stream");
    let (data, cfg, _) = generate(&dir, "w", "long", 64, 3, "2/2/4", true);
    let stream = dir.join("w.arrows");
    write_arrow_stream(&stream, &record_batches(&data));
    let (a, b) = (dir.join("from_file"), dir.join("from_stream"));
    preprocess(&cfg, &data, &a, &[]);
    preprocess(&cfg, &stream, &b, &[]);
    assert_same_outputs(&a, &b);
    assert_eq!(read_json(&b.join("stats.json"))["batches"], json!(3));
    // Sharding works on streams too.
    let c = dir.join("stream_shard");
    preprocess(&cfg, &stream, &c, &["--shard", "1/2"]);
    assert_eq!(read_json(&c.join("stats.json"))["batches"], json!(1));
}

/// A one-batch Parquet file gives the Arrow file's outputs (buffers, stats), for `preprocess`
/// and `stats`.
#[test]
fn parquet_input_equals_arrow_file_input() {
    let dir = TempDir::new("parquet");
    let (data, cfg, _) = generate(&dir, "w", "criteo", 512, 1, "1/1/4", true);
    let pq = dir.join("w.parquet");
    write_parquet(&pq, &record_batches(&data), true);
    let (a, b) = (dir.join("from_arrow"), dir.join("from_parquet"));
    preprocess(&cfg, &data, &a, &[]);
    let summary = preprocess(&cfg, &pq, &b, &[]);
    assert!(summary.starts_with("1 batches"), "summary: {summary}");
    assert_same_outputs(&a, &b);

    let st = dir.join("st.json");
    ok(&[
        "stats",
        "--config",
        s(&cfg),
        "--input",
        s(&pq),
        "--out",
        s(&st),
    ]);
    assert_eq!(read_json(&st), read_json(&a.join("stats.json")));
}

// Regression: Parquet input is not read record batch by record batch. `BatchReader` uses the Parquet
// reader's default batch size (1024 rows), so row groups (one per written record batch here)
// are merged or split into 1024-row batches: 4 batches of 256 samples arrive as one batch of
// 1024 (which then exceeds the config's limits), and 2 batches of 2048 samples (every profile's
// default batch size is larger than 1024) arrive as 4 batches of 1024.
#[test]
fn parquet_keeps_record_batches() {
    let dir = TempDir::new("parquet-batches");
    let mut failures = Vec::new();
    for (tag, profile, batch, n) in [("small", "criteo", 256, 4), ("big", "long", 2048, 2)] {
        let (data, cfg, _) = generate(&dir, tag, profile, batch, n, "1/1/4", false);
        let pq = dir.join(&format!("{tag}.parquet"));
        write_parquet(&pq, &record_batches(&data), true);
        let (a, b) = (
            dir.join(&format!("{tag}_from_arrow")),
            dir.join(&format!("{tag}_from_parquet")),
        );
        preprocess(&cfg, &data, &a, &[]);
        assert_eq!(read_json(&a.join("stats.json"))["batches"], json!(n));
        let o = run(&[
            "preprocess",
            "--config",
            s(&cfg),
            "--input",
            s(&pq),
            "--out",
            s(&b),
        ]);
        if !o.status.success() {
            failures.push(format!(
                "{n} x {batch} rows: preprocess of the Parquet failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            continue;
        }
        let (want, got) = (
            read_json(&a.join("stats.json")),
            read_json(&b.join("stats.json")),
        );
        if got != want {
            failures.push(format!(
                "{n} x {batch} rows: Parquet stats.json has {} batches (Arrow: {}) and differs",
                got["batches"], want["batches"]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Misc
// ---------------------------------------------------------------------------------------------

/// The progress bar is hidden when stderr is not a terminal: a successful run prints nothing on
/// stderr, and the summary table on stdout.
#[test]
fn preprocess_is_quiet_on_stderr_when_not_a_terminal() {
    let dir = TempDir::new("quiet");
    let (data, cfg) = small(&dir);
    let o = run(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&dir.join("out")),
    ]);
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stderr), "");
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert!(stdout.starts_with("2 batches, "), "{stdout}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with('t')).count(),
        26,
        "{stdout}"
    );
}

/// Every file of a directory and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    listing(dir)
        .into_iter()
        .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
        .collect()
}

/// No temporary, staging or set-aside directory or file of a run in `dir`.
fn assert_no_leftovers(dir: &Path) {
    let left: Vec<String> = listing(dir)
        .into_iter()
        .filter(|n| n.contains(".tmp-") || n.contains(".old-"))
        .collect();
    assert!(left.is_empty(), "leftovers in {}: {left:?}", dir.display());
}

/// `preprocess`'s last stdout line, `wrote N files to DIR: a, b, ...`: the names it lists.
fn wrote_line(stdout: &str, out: &Path) -> Vec<String> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("wrote "))
        .unwrap_or_else(|| panic!("no `wrote` line in {stdout}"));
    let prefix = format!("files to {}: ", out.display());
    let (head, names) = line
        .split_once(&prefix)
        .unwrap_or_else(|| panic!("{line:?} does not name {}", out.display()));
    let names: Vec<String> = names.split(", ").map(String::from).collect();
    assert_eq!(head, format!("wrote {} ", names.len()), "{line}");
    names
}

/// A config of the first `n` features of `cfg` and their tables.
fn first_features(cfg: &Path, n: usize, to: &Path) -> Vec<String> {
    let mut c = read_json(cfg);
    let features: Vec<Value> = c["features"].as_array().unwrap()[..n].to_vec();
    let used: Vec<String> = features
        .iter()
        .map(|f| f["table"].as_str().unwrap().to_string())
        .collect();
    let tables: Vec<Value> = c["tables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| used.contains(&t["name"].as_str().unwrap().to_string()))
        .cloned()
        .collect();
    c["features"] = json!(features);
    c["tables"] = json!(tables);
    write_json(to, &c);
    used
}

/// `preprocess` says where its outputs are: one line naming the directory and every file, which
/// are exactly the files there.
#[test]
fn preprocess_says_where_it_wrote() {
    let dir = TempDir::new("wrote");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    let stdout = preprocess(&cfg, &data, &out, &[]);
    let names = wrote_line(&stdout, &out);
    assert_eq!(names.len(), 27, "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("stats.json"));
    assert_eq!(names[0], "t00.arrow");
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(listing(&out), sorted);
    assert_no_leftovers(&dir.0);

    // An existing empty directory is filled (its staging directory inside it is gone after).
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let small_cfg = dir.join("three.json");
    first_features(&cfg, 3, &small_cfg);
    let stdout = preprocess(&small_cfg, &data, &empty, &[]);
    assert_eq!(
        wrote_line(&stdout, &empty),
        ["t00.arrow", "t01.arrow", "t02.arrow", "stats.json"]
    );
    assert_eq!(
        listing(&empty),
        ["stats.json", "t00.arrow", "t01.arrow", "t02.arrow"]
    );
    assert_no_leftovers(&dir.0);
}

// Regression: a rerun into the directory of an earlier run silently mixed the two: the new run
// rewrote the stack files it had, and the earlier run's other `<stack>.arrow` files stayed, as if
// they belonged to it.
/// A non-empty `--out` is refused, naming the directory and `--overwrite`, before any work and
/// with the earlier outputs untouched; with `--overwrite` the rerun replaces them (its stats,
/// its stack files).
#[test]
fn preprocess_overwrites_previous_outputs() {
    let dir = TempDir::new("rerun");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let first = read_json(&out.join("stats.json"));
    let before = snapshot(&out);
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&out),
        "--shard",
        "0/2",
    ]);
    assert_mentions(&line, &[s(&out), "not empty", "stats.json", "--overwrite"]);
    assert_eq!(
        snapshot(&out),
        before,
        "a refused run changed the earlier outputs"
    );
    assert_no_leftovers(&dir.0);

    let stdout = preprocess(&cfg, &data, &out, &["--shard", "0/2", "--overwrite"]);
    let second = read_json(&out.join("stats.json"));
    assert_eq!(first["batches"], json!(2));
    assert_eq!(second["batches"], json!(1));
    assert_eq!(read_stack_file(&out.join("t00.arrow")).1.len(), 1);
    assert_eq!(wrote_line(&stdout, &out).len(), 27);
    assert!(
        stdout.contains(&format!(
            "replaced the 27 files of the earlier run in {} (none stale)",
            out.display()
        )),
        "{stdout}"
    );
    assert_no_leftovers(&out);
    assert_no_leftovers(&dir.0);
}

/// `--overwrite` with fewer stacks than the earlier run: the earlier run's other stack files are
/// gone, and stdout names them.
#[test]
fn overwrite_removes_stale_stack_files() {
    let dir = TempDir::new("stale");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    assert_eq!(listing(&out).len(), 27);
    let three = dir.join("three.json");
    let tables = first_features(&cfg, 3, &three);
    let stdout = preprocess(&three, &data, &out, &["--overwrite"]);
    let mut want: Vec<String> = tables.iter().map(|t| format!("{t}.arrow")).collect();
    want.push("stats.json".into());
    assert_eq!(wrote_line(&stdout, &out), want);
    want.sort();
    assert_eq!(
        listing(&out),
        want,
        "stale stack files of the earlier run are left"
    );
    assert_eq!(stack_names(&read_json(&out.join("stats.json"))), tables);
    assert!(
        stdout.contains("(removed 23 stale: t03.arrow, t04.arrow,"),
        "{stdout}"
    );
    // The stack files are this run's: the same bytes as a fresh run's.
    let fresh = dir.join("fresh");
    preprocess(&three, &data, &fresh, &[]);
    assert_same_outputs(&out, &fresh);
    assert_no_leftovers(&dir.0);
}

/// An `--overwrite` run that fails (here: batch 1 exceeds the limits) leaves the earlier outputs
/// exactly as they were, and nothing else behind.
#[test]
fn failed_overwrite_keeps_the_earlier_outputs() {
    let dir = TempDir::new("overwrite-fail");
    let (_, cfg1, _) = generate(&dir, "one", "criteo", 64, 1, "1/1/4", false);
    let (data4, cfg4, _) = generate(&dir, "four", "criteo", 64, 4, "1/1/4", false);
    let out = dir.join("out");
    preprocess(&cfg4, &data4, &out, &[]);
    let before = snapshot(&out);
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg1),
        "--input",
        s(&data4),
        "--out",
        s(&out),
        "--overwrite",
    ]);
    assert_mentions(&line, &["is greater than the set"]);
    assert_eq!(snapshot(&out), before);
    assert_no_leftovers(&dir.0);
}

/// `--overwrite` replaces only what a run writes: a directory that also holds other files is
/// refused (naming them) and left alone; a symlink to the output directory stays a symlink.
#[test]
fn overwrite_refuses_foreign_files_and_keeps_symlinks() {
    let dir = TempDir::new("overwrite-foreign");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::create_dir(out.join("sub")).unwrap();
    let line = fail(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&out),
        "--overwrite",
    ]);
    assert_mentions(&line, &[s(&out), "notes.txt", "sub/", "--overwrite"]);
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(out.join("sub").is_dir());
    assert_eq!(listing(&out).len(), 29);
    assert_no_leftovers(&dir.0);

    // Through a symlink: the outputs are replaced where the link points, and the link stays.
    let real = dir.join("real");
    preprocess(&cfg, &data, &real, &[]);
    let link = dir.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    preprocess(&cfg, &data, &link, &["--overwrite", "--shard", "1/2"]);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(read_json(&real.join("stats.json"))["batches"], json!(1));
    assert_no_leftovers(&dir.0);
}

/// `generate` is deterministic: the same arguments give the same bytes; another seed does not.
#[test]
fn generate_is_deterministic() {
    let dir = TempDir::new("determinism");
    let (d1, c1, l1) = generate(&dir, "one", "long", 64, 2, "1/1/4", true);
    let (d2, c2, l2) = generate(&dir, "two", "long", 64, 2, "1/1/4", true);
    assert_eq!(std::fs::read(&d1).unwrap(), std::fs::read(&d2).unwrap());
    assert_eq!(std::fs::read(&c1).unwrap(), std::fs::read(&c2).unwrap());
    assert_eq!(l1["total_ids"], l2["total_ids"]);
    assert_eq!(
        l1["total_ids"],
        json!(64 * 4 * 100 * 2),
        "long: 4 features of exactly 100 ids"
    );
    let d3 = dir.join("three.arrow");
    ok(&[
        "generate",
        "--profile",
        "long",
        "--out",
        s(&d3),
        "--config-out",
        s(&dir.join("three.json")),
        "--batch-size",
        "64",
        "--num-batches",
        "2",
        "--weights",
        "--seed",
        "7",
    ]);
    assert_ne!(std::fs::read(&d1).unwrap(), std::fs::read(&d3).unwrap());
    assert!(listing(&dir.0).iter().all(|n| !n.contains(".tmp-")));
}

/// `generate --raw-keys` writes Criteo-style hex string keys on hashed features: the same draws
/// as without it, each id written as the documented key, and `preprocess` takes the file as is.
#[test]
fn generate_raw_keys_writes_hashed_string_features() {
    use arrow_array::{Array, Int64Array, ListArray, StringArray};
    let dir = TempDir::new("raw-keys");
    let (ids_file, _, _) = generate(&dir, "ids", "criteo", 64, 1, "1/1/4", false);
    let data = dir.join("raw.arrow");
    let cfg = dir.join("raw.json");
    let line: Value = serde_json::from_str(
        ok(&[
            "generate",
            "--profile",
            "criteo",
            "--raw-keys",
            "--out",
            s(&data),
            "--config-out",
            s(&cfg),
            "--batch-size",
            "64",
        ])
        .trim(),
    )
    .unwrap();
    assert_eq!(line["raw_keys"], json!(true));
    let config = read_json(&cfg);
    let ids = &record_batches(&ids_file)[0];
    let raw = &record_batches(&data)[0];
    for (i, f) in config["features"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            f["hash"],
            json!({"seed": i}),
            "feature {i} declares its hash seed"
        );
        let name = f["name"].as_str().unwrap();
        let keys = raw
            .column_by_name(name)
            .unwrap()
            .as_any()
            .downcast_ref::<ListArray>()
            .expect("List<Utf8>");
        let keys = keys
            .values()
            .as_any()
            .downcast_ref::<StringArray>()
            .expect("Utf8 keys");
        let ids = ids
            .column_by_name(name)
            .unwrap()
            .as_any()
            .downcast_ref::<ListArray>()
            .unwrap();
        let ids = ids.values().as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!(keys.len(), ids.len());
        let salt = 0x5bd1_e995u32.wrapping_mul(i as u32 + 1);
        for (k, &id) in keys.iter().zip(ids.values()) {
            assert_eq!(
                k.unwrap(),
                format!("{:08x}", (id as u32).wrapping_mul(0x9E37_79B1) ^ salt)
            );
        }
    }
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let stats = read_json(&out.join("stats.json"));
    assert_eq!(stats["batches"], json!(1));
    // Mixing raw keys with int32 ids is refused.
    let o = run(&[
        "generate",
        "--profile",
        "criteo",
        "--raw-keys",
        "--int32-ids",
        "--out",
        s(&data),
        "--config-out",
        s(&cfg),
    ]);
    assert!(!o.status.success());
}

// ---------------------------------------------------------------------------------------------
// A closed stdout
// ---------------------------------------------------------------------------------------------

/// The exit status of a process whose stdout was closed by its reader: 141 (128 + SIGPIPE,
/// what a shell reports for `yes | head`), or death by SIGPIPE itself, or 0.
fn assert_quiet_pipe_end(what: &str, o: &ProcOutput) {
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "{what}: stderr {stderr:?}"
    );
    assert_eq!(stderr, "", "{what}: a closed stdout is not an error");
    assert!(
        matches!(o.status.code(), Some(0) | Some(141)) || o.status.signal() == Some(13),
        "{what}: exit status {} (want 0, 141 or SIGPIPE)",
        o.status
    );
}

// Regression: `sparsecore-prep ... | head` panicked with `failed printing to stdout: Broken pipe`
// and exit status 101.
/// `stats` without `--out` prints its stats JSON, here 1.2 MB, more than any pipe holds (64 KiB
/// by default, at most /proc/sys/fs/pipe-max-size, 1 MiB by default): a reader that takes 16
/// bytes and closes its end makes the tool's writes fail, and it ends quietly.
#[test]
fn closed_stdout_ends_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    let dir = TempDir::new("epipe");
    let (data, cfg, _) = generate(&dir, "w", "criteo", 256, 1, "8/64/4", false);
    let args = ["stats", "--config", s(&cfg), "--input", s(&data)];
    let full = ok(&args);
    assert!(
        full.len() > 1 << 20,
        "stats prints {} bytes; the test needs more than a pipe holds",
        full.len()
    );
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut head = [0u8; 16];
    let mut reader = child.stdout.take().unwrap();
    reader.read_exact(&mut head).unwrap();
    drop(reader);
    assert_eq!(&head[..], &full.as_bytes()[..16]);
    let o = child.wait_with_output().unwrap();
    assert_quiet_pipe_end("stats | head -c 16", &o);
    // It could not have written everything: it saw the closed pipe, so the status is 141.
    assert_eq!(
        o.status.code(),
        Some(141),
        "stats | head -c 16: {}",
        o.status
    );
}

/// Every subcommand that prints, run with a stdout whose reader is gone before it starts: each
/// ends with status 141 and nothing on stderr, and what it writes to files is complete (a
/// closed stdout only loses the summary).
#[test]
fn every_subcommand_ends_quietly_on_a_closed_stdout() {
    let dir = TempDir::new("epipe-all");
    let (data, cfg) = small(&dir);
    let closed = |args: &[&str]| -> ProcOutput {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        Command::new(BIN)
            .args(args)
            .stdout(writer)
            .output()
            .unwrap()
    };
    let check = |args: &[&str]| {
        let o = closed(args);
        assert_quiet_pipe_end(&args.join(" "), &o);
        assert_eq!(
            o.status.code(),
            Some(141),
            "`{}`: {}",
            args.join(" "),
            o.status
        );
    };
    check(&["demo", "--threads", "1"]);
    let g = dir.join("g.arrow");
    check(&[
        "generate",
        "--profile",
        "criteo",
        "--batch-size",
        "64",
        "--out",
        s(&g),
        "--config-out",
        s(&dir.join("g.json")),
    ]);
    assert_eq!(record_batches(&g).len(), 1);
    let out = dir.join("out");
    check(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&out),
    ]);
    let reference = dir.join("reference");
    preprocess(&cfg, &data, &reference, &[]);
    assert_same_outputs(&out, &reference);
    check(&["stats", "--config", s(&cfg), "--input", s(&data)]);
    let st = out.join("stats.json");
    check(&[
        "stats",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--out",
        s(&dir.join("st.json")),
    ]);
    assert_eq!(read_json(&dir.join("st.json")), read_json(&st));
    check(&["fdo", "merge", s(&st), s(&st), "-o", s(&dir.join("m.json"))]);
    assert_eq!(read_json(&dir.join("m.json"))["batches"], json!(4));
    check(&[
        "fdo",
        "tune",
        "--config",
        s(&cfg),
        "--stats",
        s(&st),
        "--headroom",
        "1.0",
        "-o",
        s(&dir.join("t.json")),
    ]);
    assert!(dir.join("t.json").exists());
    check(&[
        "bench",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--threads",
        "1",
        "--repeat",
        "1",
    ]);
    check(&[
        "bench",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--threads",
        "1",
        "--repeat",
        "1",
        "--json",
    ]);
    // One batch: the export loses nothing, so it warns about nothing.
    let mut one = read_json(&st);
    one["batches"] = json!(1);
    write_json(&dir.join("one.json"), &one);
    check(&[
        "fdo",
        "export",
        s(&dir.join("one.json")),
        "-o",
        s(&dir.join("m.npz")),
    ]);
    check(&[
        "fdo",
        "import",
        s(&dir.join("m.npz")),
        "--layout",
        "1/1/4",
        "-o",
        s(&dir.join("i.json")),
    ]);
    assert_eq!(
        read_json(&dir.join("i.json"))["stacks"],
        read_json(&st)["stacks"]
    );
    check(&["dynamic", "load", "--backend", "memory", "--batches", "2"]);
    // soak prints its first line before any batch.
    check(&["soak", "--minutes", "0.01", "--threads", "1"]);
    // A duration that is no number of minutes is an error, not a panic.
    for bad in ["inf", "NaN", "-1"] {
        let e = fail(&["soak", &format!("--minutes={bad}"), "--threads", "1"]);
        assert!(
            e.contains("--minutes ") && e.contains("a finite number of minutes, at least 0"),
            "{bad}: {e}"
        );
    }
}

/// Counts that no machine could hold or run to the end are errors naming the flag, the value and
/// the bound, refused before anything is generated or timed; they ended in a "capacity
/// overflow" panic (or ran until an allocation aborted).
#[test]
fn counts_past_what_a_command_can_hold_are_errors_not_panics() {
    let dir = TempDir::new("huge-counts");
    let (data, cfg) = small(&dir);
    let (out, config_out) = (dir.join("g.arrow"), dir.join("g.json"));
    let generate_with = |flag: &str, value: &str| {
        fail(&[
            "generate",
            "--profile",
            "criteo",
            "--out",
            s(&out),
            "--config-out",
            s(&config_out),
            flag,
            value,
        ])
    };
    let started = std::time::Instant::now();
    // criteo: 16384 samples per batch, 26 features of one int64 id (8 bytes) and its offset (4).
    assert_eq!(
        generate_with("--num-batches", "18446744073709551615"),
        "sparsecore-prep: error: invalid option `num-batches` = 18446744073709551615: batches of 16384 samples take at least \
         94296213929941075621969920 bytes (312 per sample), more than a process can address (9223372036854775807)"
    );
    assert_eq!(
        generate_with("--batch-size", "4611686018427387904"),
        "sparsecore-prep: error: invalid option `batch-size` = 4611686018427387904: at most 2147483647 samples: every sample has at \
         least one id, and a list column's offsets are int32"
    );
    assert!(!out.exists() && !config_out.exists(), "nothing written");
    let o = run(&[
        "bench",
        "--config",
        s(&cfg),
        "--input",
        s(&data),
        "--repeat",
        "18446744073709551615",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains("invalid value '18446744073709551615' for '--repeat <REPEAT>': expected a number of passes from 0 to 100000, got \"18446744073709551615\""),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(20),
        "three refusals took {took:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------------------

/// `generate` draws its progress on stderr when that is a terminal (here a pseudo-terminal from
/// util-linux `script`), and nothing when it is a pipe; either way it writes the same files.
#[test]
fn generate_shows_progress_on_a_terminal_only() {
    let dir = TempDir::new("gen-progress");
    let args = |tag: &str| -> Vec<String> {
        [
            "generate",
            "--profile",
            "criteo",
            "--batch-size",
            "64",
            "--num-batches",
            "2",
            "--out",
        ]
        .iter()
        .map(|a| a.to_string())
        .chain([
            s(&dir.join(&format!("{tag}.arrow"))).to_string(),
            "--config-out".into(),
            s(&dir.join(&format!("{tag}.json"))).to_string(),
        ])
        .collect()
    };
    let piped = args("piped");
    let o = Command::new(BIN).args(&piped).output().unwrap();
    assert!(o.status.success());
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "",
        "progress drawn into a pipe"
    );
    assert_eq!(String::from_utf8(o.stdout).unwrap().lines().count(), 1);

    // The terminal half runs under util-linux `script`, which every Linux base system has: on
    // Linux its absence fails the test rather than skipping half of it.
    if !cfg!(target_os = "linux") {
        return;
    }
    let has_script = Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_script,
        "the terminal half of this test needs util-linux `script`"
    );
    let quoted: Vec<String> = std::iter::once(BIN.to_string())
        .chain(args("tty"))
        .map(|a| format!("'{a}'"))
        .collect();
    let o = Command::new("script")
        .args(["-qec", &quoted.join(" "), "/dev/null"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{shown}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        shown.contains("generating 2 batches of 64 samples (criteo)"),
        "no generation spinner in {shown:?}"
    );
    assert!(
        shown.contains("batches written to "),
        "no writing bar in {shown:?}"
    );
    assert!(
        shown.contains("\"batches\":2"),
        "no summary line in {shown:?}"
    );
    assert_eq!(
        std::fs::read(dir.join("tty.arrow")).unwrap(),
        std::fs::read(dir.join("piped.arrow")).unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// fdo export / import
// ---------------------------------------------------------------------------------------------

/// Runs and requires success; returns (stdout, stderr lines).
fn ok_with_stderr(args: &[&str]) -> (String, Vec<String>) {
    let o = run(args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "`sparsecore-prep {}` failed ({}): {stderr}",
        args.join(" "),
        o.status
    );
    (
        String::from_utf8(o.stdout).unwrap(),
        stderr.lines().map(String::from).collect(),
    )
}

// Regression: `fdo export` and `fdo import` printed nothing, and the NPZ/CSV round trip silently
// turned `batches` 4 into 1.
/// Stats of 4 batches exported to NPZ and to CSV: one summary line each (stacks, arrays, the
/// input, batches, layout, the output and its format, the --layout to import it with), and one
/// warning that the format does not keep batches (4) and reads back as 1; importing prints its
/// own summary, warns about nothing, and gives the stats back with batches 1.
#[test]
fn fdo_export_and_import_summarise_and_warn_about_batches() {
    let dir = TempDir::new("fdo-roundtrip");
    let (data, cfg) = small(&dir);
    let out = dir.join("out");
    preprocess(&cfg, &data, &out, &[]);
    let st = out.join("stats.json");
    let merged = dir.join("merged.json");
    ok(&["fdo", "merge", s(&st), s(&st), "-o", s(&merged)]);
    let original = read_json(&merged);
    assert_eq!(original["batches"], json!(4));
    for (ext, format, client) in [
        ("npz", "NPZ", "NPZFileFDOClient"),
        ("csv", "CSV", "CSVFileFDOClient"),
    ] {
        let dump = dir.join(&format!("fdo_stats.{ext}"));
        let (stdout, warnings) = ok_with_stderr(&["fdo", "export", s(&merged), "-o", s(&dump)]);
        assert_eq!(
            stdout,
            format!(
                "exported 26 stacks (104 arrays) of {} (batches 4, layout 1/1/4) to {} ({format}, the reference's {client} dump); it stores no layout: import it with --layout 1/1/4\n",
                merged.display(),
                dump.display()
            )
        );
        assert_eq!(
            warnings,
            [format!(
                "sparsecore-prep: warning: {}: the {format} format holds no batch count: batches (4) is not kept and will read back as 1",
                dump.display()
            )]
        );

        let back = dir.join(&format!("back_{ext}.json"));
        let (stdout, warnings) = ok_with_stderr(&[
            "fdo",
            "import",
            s(&dump),
            "--layout",
            "1/1/4",
            "-o",
            s(&back),
        ]);
        assert_eq!(
            stdout,
            format!(
                "imported 26 stacks (104 arrays) from {} ({format}) to {}: layout 1/1/4, batches 1 (one per recorded row; {format} stores no batch count)\n",
                dump.display(),
                back.display()
            )
        );
        assert_eq!(warnings, Vec::<String>::new());
        let mut want = original.clone();
        want["batches"] = json!(1);
        assert_eq!(
            read_json(&back),
            want,
            "{ext}: everything but batches reads back"
        );
    }

    // Stats of one batch lose nothing: no warning.
    let one = dir.join("one.npz");
    let (stdout, warnings) =
        ok_with_stderr(&["fdo", "export", s(&out.join("stats.json")), "-o", s(&one)]);
    assert!(stdout.contains("(batches 2, layout 1/1/4)"), "{stdout}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let mut single = read_json(&st);
    single["batches"] = json!(1);
    let single_path = dir.join("single.json");
    write_json(&single_path, &single);
    let (_, warnings) = ok_with_stderr(&["fdo", "export", s(&single_path), "-o", s(&one)]);
    assert_eq!(warnings, Vec::<String>::new());
}

/// Other values the formats cannot hold are named too: a drop count past int64 on export, and on
/// import a negative drop count (imported as 0); a count outside int32 or negative fails the
/// import, naming the member and the value, and writes nothing.
#[test]
fn fdo_export_and_import_warn_about_values_they_cannot_hold() {
    let dir = TempDir::new("fdo-values");
    let stats = dir.join("stats.json");
    write_json(
        &stats,
        &json!({
            "version": 1,
            "layout": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
            "batches": 1,
            "stacks": {"a": {"max_ids_per_partition": [1, 2, 3, 4], "max_unique_ids_per_partition": [1, 1, 1, 1],
                             "required_buffer_size_per_sc": [8, 8, 8, 8], "dropped_id_count": u64::MAX}}
        }),
    );
    let dump = dir.join("a.csv");
    let (stdout, warnings) = ok_with_stderr(&["fdo", "export", s(&stats), "-o", s(&dump)]);
    assert!(
        stdout.starts_with("exported 1 stack (4 arrays) of "),
        "{stdout}"
    );
    assert_eq!(
        warnings,
        [format!(
            "sparsecore-prep: warning: {}: stack `a`: dropped_id_count (18446744073709551615) does not fit the format's int64 and will read back as 0",
            dump.display()
        )]
    );

    let odd = dir.join("odd.csv");
    std::fs::write(
        &odd,
        "key,values\nx_max_ids,1 2 3\nx_max_unique_ids,1 1 1\nx_id_drop_counters,-3\n",
    )
    .unwrap();
    let back = dir.join("odd.json");
    let (stdout, warnings) = ok_with_stderr(&[
        "fdo",
        "import",
        s(&odd),
        "--layout",
        "1/1/3",
        "-o",
        s(&back),
    ]);
    assert!(
        stdout.starts_with(&format!(
            "imported 1 stack (3 arrays) from {} (CSV) to {}: layout 1/1/3, batches 1",
            odd.display(),
            back.display()
        )),
        "{stdout}"
    );
    let w = |m: &str| format!("sparsecore-prep: warning: {}: {m}", odd.display());
    assert_eq!(
        warnings,
        [w("x_id_drop_counters is negative (-3), imported as 0")]
    );
    let got = read_json(&back);
    assert_eq!(
        got["stacks"]["x"]["max_ids_per_partition"],
        json!([1, 2, 3])
    );
    assert_eq!(got["stacks"]["x"]["dropped_id_count"], json!(0));

    let (big, negative) = (dir.join("big.csv"), dir.join("negative.csv"));
    std::fs::write(&big, "key,values\nx_max_ids,1 5000000000 3\n").unwrap();
    std::fs::write(&negative, "key,values\nx_max_ids,1 -5 3\n").unwrap();
    let e = fail(&[
        "fdo",
        "import",
        s(&big),
        "--layout",
        "1/1/3",
        "-o",
        s(&dir.join("big.json")),
    ]);
    assert!(
        e.ends_with(&format!(
            "{}: `x_max_ids` holds 5000000000, past the 32-bit counts stats hold",
            big.display()
        )),
        "{e}"
    );
    let e = fail(&[
        "fdo",
        "import",
        s(&negative),
        "--layout",
        "1/1/3",
        "-o",
        s(&dir.join("negative.json")),
    ]);
    assert!(
        e.contains("stack `x`")
            && e.contains("`max_ids_per_partition`[1] is -5: counts cannot be negative"),
        "{e}"
    );
    assert!(!dir.join("big.json").exists() && !dir.join("negative.json").exists());
}
