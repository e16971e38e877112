//! End-to-end tests of `sparsecore-prep balance` and `preprocess --balance W`,
//! run as real processes on a generated `large-vocab` workload (512 rows × 4 batches, 1/1/4).
//!
//! What is checked:
//! - `balance --window 4 --json`: the JSON fields, after ≤ before per stack (max_ids), and the
//!   window's max_ids strictly lower on this skewed workload;
//! - the output holds the same multiset of rows (every column of every row) in the input's
//!   schema, one batch per input batch with the same sizes;
//! - `preprocess --balance 4` on the input writes exactly what `preprocess` writes on
//!   `balance`'s output (stats.json and the stack files);
//! - the human summary (default window 1);
//! - why a window kept its input order (`kept_windows`, and the summary);
//! - bad input (a missing column, a column of the wrong type, a window of 0) fails with one
//!   line and writes nothing: no OUT, no temporaries.

use sparsecore_testkit::TempDir;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use serde_json::Value;
use sparsecore_prep::io::BatchReader;

use crate::support;
use support::{ok, run, s};

/// Runs, requires a non-zero status and one stderr line; returns it.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "`{}` succeeded", args.join(" "));
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("sparsecore-prep: error: "), "{stderr}");
    stderr
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn record_batches(path: &Path) -> Vec<RecordBatch> {
    BatchReader::open(path)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

/// The generated workload: (input, config).
fn generate(dir: &TempDir) -> (PathBuf, PathBuf) {
    let (input, cfg) = (dir.join("in.arrow"), dir.join("cfg.json"));
    ok(&[
        "generate",
        "--profile",
        "large-vocab",
        "--batch-size",
        "512",
        "--num-batches",
        "4",
        "--layout",
        "1/1/4",
        "--out",
        s(&input),
        "--config-out",
        s(&cfg),
    ]);
    (input, cfg)
}

/// Every row of every batch as one string (each column's one-row slice, by its Debug form, which
/// prints the values), sorted.
fn sorted_rows(batches: &[RecordBatch]) -> Vec<String> {
    let mut rows = Vec::new();
    for b in batches {
        for r in 0..b.num_rows() {
            let cells: Vec<String> = b
                .columns()
                .iter()
                .map(|c| format!("{:?}", c.slice(r, 1)))
                .collect();
            rows.push(cells.join("|"));
        }
    }
    rows.sort();
    rows
}

fn last_json(stdout: &str) -> Value {
    serde_json::from_str(stdout.trim_end().lines().last().expect("a line")).expect("JSON")
}

#[test]
fn balance_window_4_json_same_rows_and_preprocess_balance_agrees() {
    let dir = TempDir::new("w4");
    let (input, cfg) = generate(&dir);
    let out = dir.join("balanced.arrow");
    let stdout = ok(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&out),
        "--window",
        "4",
        "--json",
    ]);
    let j = last_json(&stdout);
    assert_eq!(j["window"], 4);
    assert_eq!(j["batches"], 4);
    assert_eq!(j["rows"], 2048);
    assert_eq!(j["windows"], 1);
    let stacks = j["stacks"].as_array().expect("stacks");
    assert_eq!(stacks.len(), 1, "{j}");
    for st in stacks {
        assert!(st["name"].is_string());
        for side in ["before", "after"] {
            for field in [
                "max_ids_per_partition",
                "max_unique_ids_per_partition",
                "required_buffer",
            ] {
                assert!(
                    st[side][field].as_u64().is_some_and(|v| v > 0),
                    "{side}.{field} in {st}"
                );
            }
        }
        let (b, a) = (
            st["before"]["max_ids_per_partition"].as_u64().unwrap(),
            st["after"]["max_ids_per_partition"].as_u64().unwrap(),
        );
        assert!(a <= b, "after {a} > before {b}");
        // This skewed workload balances: the window was reordered and its worst cell dropped.
        assert!(a < b, "no gain: {st}");
        assert!(
            st["after"]["required_buffer"].as_u64().unwrap()
                <= st["before"]["required_buffer"].as_u64().unwrap()
        );
    }
    assert_eq!(j["reordered_windows"], 1);
    assert_eq!(j["kept_windows"], serde_json::json!({}));

    // The same rows, the same schema, one batch per input batch with the same sizes.
    let (inb, outb) = (record_batches(&input), record_batches(&out));
    assert_eq!(outb.len(), inb.len());
    for (i, o) in inb.iter().zip(&outb) {
        assert_eq!(o.num_rows(), i.num_rows());
        assert_eq!(o.schema(), i.schema());
    }
    assert_ne!(inb, outb, "reordered");
    assert_eq!(
        sorted_rows(&outb),
        sorted_rows(&inb),
        "same multiset of rows"
    );
    assert_eq!(
        listing(&dir.0),
        ["balanced.arrow", "cfg.json", "in.arrow"],
        "no temporaries left"
    );

    // The stats in the JSON are the pipeline's own: preprocess of the output reports the after.
    let (p1, p2) = (dir.join("inline"), dir.join("offline"));
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&p1),
        "--balance",
        "4",
    ]);
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&out),
        "--out",
        s(&p2),
    ]);
    let read = |p: &Path| -> Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    let (s1, s2) = (read(&p1.join("stats.json")), read(&p2.join("stats.json")));
    assert_eq!(
        s1, s2,
        "preprocess --balance 4 == preprocess of balance's output"
    );
    assert_eq!(listing(&p1), listing(&p2));
    for name in listing(&p1) {
        assert_eq!(
            std::fs::read(p1.join(&name)).unwrap(),
            std::fs::read(p2.join(&name)).unwrap(),
            "{name}"
        );
    }
    // And both differ from plain preprocess of the input (balancing did something).
    let p0 = dir.join("plain");
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&p0),
    ]);
    assert_ne!(read(&p0.join("stats.json")), s1);
    // `--balance 1` balances each batch alone: never worse than the input, batch by batch.
    let p3 = dir.join("w1");
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&p3),
        "--balance",
        "1",
    ]);
    let max_ids = |v: &Value| -> i64 {
        let stacks = v["stacks"].as_object().unwrap();
        stacks
            .values()
            .flat_map(|x| {
                x["max_ids_per_partition"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_i64().unwrap())
            })
            .max()
            .unwrap()
    };
    assert!(max_ids(&read(&p3.join("stats.json"))) <= max_ids(&read(&p0.join("stats.json"))));
}

/// `--refine every-stack` and `--refine unique-ids` through both commands: the JSON names the
/// refinement, the rows are the same, and `preprocess --balance W --balance-refine R` writes
/// what preprocessing `balance`'s output writes. A window larger than the file (as large as a
/// `usize` goes) is one window of all its batches, not an allocation of that size.
#[test]
fn every_stack_refinement_and_a_window_past_the_file() {
    let dir = TempDir::new("every");
    let (input, cfg) = generate(&dir);
    let huge = usize::MAX.to_string();
    // Per stack, the unique ids every-stack leaves: unique-ids lowers them in some stack and
    // raises them in none.
    let mut every_unique: Vec<u64> = Vec::new();
    for refine in ["every-stack", "unique-ids"] {
        let out = dir.join(&format!("balanced-{refine}.arrow"));
        let stdout = ok(&[
            "balance",
            "--config",
            s(&cfg),
            "--input",
            s(&input),
            "--out",
            s(&out),
            "--window",
            &huge,
            "--refine",
            refine,
            "--json",
        ]);
        let j = last_json(&stdout);
        assert_eq!(j["refine"], refine);
        assert_eq!(j["windows"], 1);
        assert_eq!(j["reordered_windows"], 1);
        let stacks = j["stacks"].as_array().expect("stacks");
        for st in stacks {
            let (b, a) = (
                st["before"]["max_ids_per_partition"].as_u64().unwrap(),
                st["after"]["max_ids_per_partition"].as_u64().unwrap(),
            );
            assert!(a < b, "{refine}: no gain: {st}");
        }
        let unique: Vec<u64> = stacks
            .iter()
            .map(|st| {
                st["after"]["max_unique_ids_per_partition"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        if refine == "every-stack" {
            every_unique = unique;
        } else {
            assert!(
                unique.iter().zip(&every_unique).all(|(u, e)| u <= e),
                "unique ids {every_unique:?} -> {unique:?}"
            );
            assert!(
                unique.iter().zip(&every_unique).any(|(u, e)| u < e),
                "unique ids {every_unique:?} -> {unique:?}"
            );
        }
        let (inb, outb) = (record_batches(&input), record_batches(&out));
        assert_eq!(
            sorted_rows(&outb),
            sorted_rows(&inb),
            "{refine}: same multiset of rows"
        );
        let (p1, p2) = (
            dir.join(&format!("inline-{refine}")),
            dir.join(&format!("offline-{refine}")),
        );
        ok(&[
            "preprocess",
            "--config",
            s(&cfg),
            "--input",
            s(&input),
            "--out",
            s(&p1),
            "--balance",
            &huge,
            "--balance-refine",
            refine,
        ]);
        ok(&[
            "preprocess",
            "--config",
            s(&cfg),
            "--input",
            s(&out),
            "--out",
            s(&p2),
        ]);
        for name in listing(&p1) {
            assert_eq!(
                std::fs::read(p1.join(&name)).unwrap(),
                std::fs::read(p2.join(&name)).unwrap(),
                "{refine}: {name}"
            );
        }
    }
    // The refinement belongs to --balance.
    let o = run(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&dir.join("x")),
        "--balance-refine",
        "every-stack",
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--balance"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn balance_default_window_prints_summary() {
    let dir = TempDir::new("w1");
    let (input, cfg) = generate(&dir);
    let out = dir.join("b.arrow");
    let stdout = ok(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&out),
    ]);
    assert!(
        stdout.contains("balanced 4 batches (2048 rows) in 4 windows of 1"),
        "{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.contains("max_ids_per_partition"))
        .expect("a stack line");
    for w in ["max_unique_ids_per_partition", "required buffer", "->"] {
        assert!(line.contains(w), "{line}");
    }
    // Per batch: same rows as its input batch (window 1 moves rows within a batch only).
    let (inb, outb) = (record_batches(&input), record_batches(&out));
    assert_eq!(inb.len(), outb.len());
    for (i, o) in inb.iter().zip(&outb) {
        assert_eq!(
            sorted_rows(std::slice::from_ref(o)),
            sorted_rows(std::slice::from_ref(i))
        );
    }
}

/// A window whose input order is kept says why, in the JSON and in the summary:
/// high-multivalency's one stack already sits on the window's lower bound (one id of its small
/// table carries the partition), and criteo's generated limits, equal to the input's largest
/// counts, leave a better order no room in some stack.
#[test]
fn kept_windows_say_why() {
    let dir = TempDir::new("why");
    for (profile, window, reason, stacks) in [
        ("high-multivalency", "4", "at_lower_bound", 1),
        ("criteo", "1", "would_pass_limit", 0),
    ] {
        let (input, cfg) = (
            dir.join(&format!("{profile}.arrow")),
            dir.join(&format!("{profile}.json")),
        );
        ok(&[
            "generate",
            "--profile",
            profile,
            "--batch-size",
            "512",
            "--num-batches",
            "4",
            "--layout",
            "1/4/4",
            "--out",
            s(&input),
            "--config-out",
            s(&cfg),
        ]);
        let out = dir.join(&format!("{profile}-b.arrow"));
        let args = [
            "balance",
            "--config",
            s(&cfg),
            "--input",
            s(&input),
            "--out",
            s(&out),
            "--window",
            window,
        ];
        let j = last_json(&ok(&[&args[..], &["--json"]].concat()));
        let windows = j["windows"].as_u64().unwrap();
        assert_eq!(j["reordered_windows"], 0, "{profile}: {j}");
        let kept = j["kept_windows"].as_object().unwrap();
        assert_eq!(kept.len(), 1, "{profile}: {kept:?}");
        assert_eq!(
            kept[reason]["windows"].as_u64(),
            Some(windows),
            "{profile}: {kept:?}"
        );
        let named = kept[reason]["stacks"].as_array().unwrap();
        assert!(!named.is_empty(), "{profile}: {kept:?}");
        if stacks == 1 {
            assert_eq!(named, &[Value::from("table_0")]);
        }
        // The input order, unchanged.
        assert_eq!(record_batches(&out), record_batches(&input));
        let summary = ok(&args);
        let text = format!(
            "(0 reordered, {windows} kept: {} ({}))",
            reason.replace('_', " "),
            named
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(", ")
        );
        assert!(summary.contains(&text), "{profile}: {summary}");
    }
}

#[test]
fn bad_input_writes_nothing() {
    let dir = TempDir::new("bad");
    let (input, cfg) = generate(&dir);
    let before = listing(&dir.0);
    let out = dir.join("b.arrow");

    // A missing column: the config names a column the file lacks.
    let mut c: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    c["features"][0]["column"] = Value::from("no_such_column");
    let bad_cfg = dir.join("bad_cfg.json");
    std::fs::write(&bad_cfg, c.to_string()).unwrap();
    let before = [before, vec!["bad_cfg.json".to_string()]].concat();
    let line = fails(&[
        "balance",
        "--config",
        s(&bad_cfg),
        "--input",
        s(&input),
        "--out",
        s(&out),
        "--window",
        "4",
    ]);
    assert!(line.contains("no_such_column"), "{line}");
    let mut sorted = before.clone();
    sorted.sort();
    assert_eq!(listing(&dir.0), sorted, "no OUT, no temporaries");
    let line = fails(&[
        "preprocess",
        "--config",
        s(&bad_cfg),
        "--input",
        s(&input),
        "--out",
        s(&dir.join("p")),
        "--balance",
        "2",
    ]);
    assert!(line.contains("no_such_column"), "{line}");

    // A column of the wrong type (Int64 where a list of ids is expected).
    let good: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    // The column defaults to the feature's name.
    let f0 = &good["features"][0];
    let name = f0["column"]
        .as_str()
        .or(f0["name"].as_str())
        .unwrap()
        .to_string();
    let rb = &record_batches(&input)[0];
    let mut fields: Vec<Field> = Vec::new();
    let mut cols: Vec<ArrayRef> = Vec::new();
    for (f, col) in rb.schema().fields().iter().zip(rb.columns()) {
        if f.name() == &name {
            fields.push(Field::new(&name, DataType::Int64, false));
            cols.push(Arc::new(Int64Array::from(vec![1i64; rb.num_rows()])));
        } else {
            fields.push(f.as_ref().clone());
            cols.push(col.clone());
        }
    }
    let wrong = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
    assert_eq!(wrong.column_by_name(&name).unwrap().len(), 512);
    let wrong_path = dir.join("wrong.arrow");
    {
        let mut w = arrow_ipc::writer::FileWriter::try_new(
            std::fs::File::create(&wrong_path).unwrap(),
            &wrong.schema(),
        )
        .unwrap();
        w.write(&wrong).unwrap();
        w.write(&wrong).unwrap();
        w.finish().unwrap();
    }
    let before = listing(&dir.0);
    fails(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&wrong_path),
        "--out",
        s(&out),
        "--window",
        "2",
    ]);
    assert_eq!(listing(&dir.0), before, "no OUT, no temporaries");

    // A window of 0 batches is a usage error.
    let o = run(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&out),
        "--window",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(listing(&dir.0), before);
}

/// An id out of range in a balanced batch is reported where it is in the input: `preprocess
/// --balance W` names the balanced batch, its row, and the input's record batch and row.
#[test]
fn a_bad_id_in_a_balanced_batch_names_its_input_row() {
    use arrow_array::builder::{Int64Builder, ListBuilder};
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;

    let dir = TempDir::new("badrow");
    let (input, cfg) = generate(&dir);
    let good: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    let f0 = &good["features"][0];
    let name = f0["column"]
        .as_str()
        .or(f0["name"].as_str())
        .unwrap()
        .to_string();
    // Record batch 3, row 37 gets one more id, -7.
    let mut batches = record_batches(&input);
    let rb = &batches[3];
    let k = rb.schema().index_of(&name).unwrap();
    let item = match rb.schema().field(k).data_type() {
        DataType::List(f) => f.clone(),
        other => panic!("{other}"),
    };
    let mut lists = ListBuilder::new(Int64Builder::new()).with_field(item);
    for (row, ids) in rb.column(k).as_list::<i32>().iter().enumerate() {
        lists
            .values()
            .append_slice(ids.unwrap().as_primitive::<Int64Type>().values());
        if row == 37 {
            lists.values().append_value(-7);
        }
        lists.append(true);
    }
    let mut cols = rb.columns().to_vec();
    cols[k] = Arc::new(lists.finish());
    batches[3] = RecordBatch::try_new(rb.schema(), cols).unwrap();
    let bad = dir.join("bad.arrow");
    {
        let mut w = arrow_ipc::writer::FileWriter::try_new(
            std::fs::File::create(&bad).unwrap(),
            &batches[0].schema(),
        )
        .unwrap();
        for b in &batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }
    let plain = fails(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&bad),
        "--out",
        s(&dir.join("p")),
    ]);
    assert!(
        plain.contains("record batch 3: ") && plain.contains("sample row 37: id -7"),
        "{plain}"
    );
    for window in ["1", "4"] {
        let line = fails(&[
            "preprocess",
            "--config",
            s(&cfg),
            "--input",
            s(&bad),
            "--out",
            s(&dir.join("p")),
            "--balance",
            window,
        ]);
        assert!(
            line.contains("balanced record batch ")
                && line.contains("is record batch 3, row 37 of the input)"),
            "W = {window}: {line}"
        );
        assert!(line.contains("id -7 is outside"), "{line}");
    }
    // `balance` itself names the batch of the window.
    let line = fails(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&bad),
        "--out",
        s(&dir.join("b.arrow")),
        "--window",
        "4",
    ]);
    assert!(
        line.contains("batch 3 of 4") && line.contains("sample row 37: id -7"),
        "{line}"
    );
}

/// `balance --out` through a symlink writes the link's target and keeps the link; `generate`
/// refuses one file for both of its outputs and writes nothing.
#[test]
fn outputs_through_a_symlink_and_the_same_file_twice() {
    let dir = TempDir::new("links");
    let (input, cfg) = generate(&dir);
    let (target, link) = (dir.join("target.arrow"), dir.join("link.arrow"));
    std::fs::write(&target, b"old").unwrap();
    std::os::unix::fs::symlink("target.arrow", &link).unwrap();
    ok(&[
        "balance",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&link),
    ]);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(record_batches(&target).len(), 4);

    let before = listing(&dir.0);
    let same = dir.join("same");
    let line = fails(&[
        "generate",
        "--profile",
        "criteo",
        "--batch-size",
        "64",
        "--out",
        s(&same),
        "--config-out",
        s(&same),
    ]);
    assert!(
        line.contains(&format!(
            "--out {} and --config-out {} are the same file",
            same.display(),
            same.display()
        )),
        "{line}"
    );
    let line = fails(&[
        "generate",
        "--profile",
        "criteo",
        "--batch-size",
        "64",
        "--out",
        s(&target),
        "--config-out",
        s(&link),
    ]);
    assert!(
        line.contains("are the same file")
            && line.contains(&format!("({})", target.canonicalize().unwrap().display())),
        "{line}"
    );
    assert_eq!(listing(&dir.0), before, "nothing written");
}
