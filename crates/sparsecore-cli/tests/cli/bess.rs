//! End-to-end tests of `sparsecore-prep bess`: `bess batches` and
//! `bess shard create` / `bess shard show`, run as real processes on triples files written here
//! with arrow (IPC and Parquet).
//!
//! What is checked:
//! - `bess batches` output runs through `preprocess --config CFG --input OUT` with nothing
//!   dropped, and every (device, partition) max_ids equals the config's limit (every cell gets
//!   exactly its share: with `--negatives 0`, and with negatives, Random and Rigid);
//! - the load table and Rigid's padding line;
//! - a sharding written by `bess shard create` reads back (CLI and library) and gives the same
//!   batches as the sharding created from the same seed, and so does a file laid out as
//!   besskge's `Sharding.save` writes it (int32 members, pickled `None` type tables); Parquet
//!   triples give what IPC gives;
//! - bad input exits 1 with one line naming what is wrong (entity id out of range with its
//!   column, row and value; missing column; wrong type; an empty shard pair; a sharding of the
//!   wrong shard count), and writes nothing;
//! - the errors the command line words itself (no --shards or --layout, a sharding that cannot
//!   be created or read, a triples file without rows) are exact lines naming the flag or file;
//! - progress on a terminal only, and a closed stdout ends quietly.

use sparsecore_testkit::TempDir;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema};
use serde_json::Value;

use crate::support;
use support::{ok, run, s, BIN};

const E: i64 = 64;

/// Runs, requires failure with status 1 and one stderr line; returns it.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "`{}`: {stderr}", args.join(" "));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("sparsecore-prep: error: "), "{stderr}");
    stderr
}

/// `n` deterministic triples over `E` entities and 5 relations (a 64-bit LCG).
fn triples(n: usize) -> (Vec<i64>, Vec<i32>, Vec<i64>) {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) % m) as i64
    };
    let (mut h, mut r, mut t) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        h.push(next(E as u64));
        r.push(next(5) as i32);
        t.push(next(E as u64));
    }
    (h, r, t)
}

fn triples_batch(h: Vec<i64>, r: Vec<i32>, t: Vec<i64>) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("head", DataType::Int64, false),
        Field::new("relation", DataType::Int32, false),
        Field::new("tail", DataType::Int64, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(h)),
        Arc::new(Int32Array::from(r)),
        Arc::new(Int64Array::from(t)),
    ];
    RecordBatch::try_new(schema, cols).unwrap()
}

/// Writes record batches as an Arrow IPC file.
fn write_ipc(path: &Path, batches: &[RecordBatch]) {
    let mut w = FileWriter::try_new(File::create(path).unwrap(), &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

/// 600 triples in two record batches (every one of the 16 shard pairs gets some).
fn triples_file(dir: &TempDir) -> PathBuf {
    let (h, r, t) = triples(600);
    let p = dir.join("triples.arrow");
    write_ipc(
        &p,
        &[
            triples_batch(h[..250].to_vec(), r[..250].to_vec(), t[..250].to_vec()),
            triples_batch(h[250..].to_vec(), r[250..].to_vec(), t[250..].to_vec()),
        ],
    );
    p
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// `bess batches` with `extra`, then `preprocess` of its output; returns (bess stdout, config,
/// stats.json).
fn batches_then_preprocess(
    dir: &TempDir,
    triples: &Path,
    tag: &str,
    extra: &[&str],
) -> (String, Value, Value) {
    let (out, cfg, pre) = (
        dir.join(&format!("{tag}.arrow")),
        dir.join(&format!("{tag}.json")),
        dir.join(&format!("{tag}-out")),
    );
    let mut args = vec![
        "bess",
        "batches",
        "--triples",
        s(triples),
        "--entities",
        "64",
        "--layout",
        "1/1/4",
        "--out",
        s(&out),
        "--config-out",
        s(&cfg),
    ];
    args.extend_from_slice(extra);
    let stdout = ok(&args);
    eprintln!("{stdout}");
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&out),
        "--out",
        s(&pre),
    ]);
    (stdout, read_json(&cfg), read_json(&pre.join("stats.json")))
}

/// Nothing dropped, and every (device, partition) max_ids equals the table's limit.
fn assert_exact_limits(config: &Value, stats: &Value, steps: u64) -> u64 {
    let limit = config["tables"][0]["max_ids_per_partition"]
        .as_u64()
        .unwrap();
    assert_eq!(stats["batches"].as_u64(), Some(steps));
    let stacks = stats["stacks"].as_object().unwrap();
    assert_eq!(
        stacks.len(),
        1,
        "one stack: head, tail and negative share the entity table"
    );
    let st = stacks.values().next().unwrap();
    assert_eq!(st["dropped_id_count"], 0);
    let max = st["max_ids_per_partition"].as_array().unwrap();
    assert_eq!(max.len(), 4, "L·N = 1·4");
    for m in max {
        assert_eq!(m.as_u64(), Some(limit), "{st}");
    }
    limit
}

#[test]
fn batches_without_negatives_fill_every_cell_to_the_limit() {
    let dir = TempDir::new("neg0");
    let tr = triples_file(&dir);
    let (stdout, config, stats) = batches_then_preprocess(
        &dir,
        &tr,
        "b",
        &[
            "--shard-batch-size",
            "8",
            "--negatives",
            "0",
            "--seed",
            "3",
            "--steps",
            "5",
        ],
    );
    // ppp = ceil(8 / 4) = 2: every cell takes 2 heads and 2 tails.
    assert_eq!(assert_exact_limits(&config, &stats, 5), 4);
    assert_eq!(config["features"].as_array().unwrap().len(), 2);
    assert!(stdout.contains("wrote 5 steps"), "{stdout}");
    assert!(
        stdout.contains("limits: positives 4, negatives 0, max_ids_per_partition 4"),
        "{stdout}"
    );
    // One row per local SparseCore, every partition at 4+0.
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("slot"))
        .skip(1)
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for (k, row) in rows.iter().enumerate() {
        let f: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &f[..6],
            &[
                k.to_string().as_str(),
                k.to_string().as_str(),
                "4",
                "0",
                "4/4",
                "yes"
            ],
            "{row}"
        );
        assert_eq!(&f[6..], &["4+0"; 4], "{row}");
    }
    assert!(!stdout.contains("rigid padding"));
}

#[test]
fn batches_with_negatives_random_and_rigid() {
    let dir = TempDir::new("neg");
    let tr = triples_file(&dir);
    // Per-triple negatives: B = T = 4·ppp = 8 lists of k = 2 per shard: 16 negatives per cell.
    let (stdout, config, stats) = batches_then_preprocess(
        &dir,
        &tr,
        "r",
        &[
            "--shard-batch-size",
            "8",
            "--negatives",
            "2",
            "--seed",
            "1",
            "--steps",
            "3",
        ],
    );
    assert_eq!(assert_exact_limits(&config, &stats, 3), 4 + 16);
    assert!(
        stdout.contains("limits: positives 4, negatives 16, max_ids_per_partition 20"),
        "{stdout}"
    );
    assert_eq!(config["features"].as_array().unwrap().len(), 3);

    // Rigid, flat negatives, ht: one list per side, k = 3 → 6 negatives per cell; one epoch.
    let (stdout, config, stats) = batches_then_preprocess(
        &dir,
        &tr,
        "g",
        &[
            "--shard-batch-size",
            "8",
            "--negatives",
            "3",
            "--sampler",
            "rigid",
            "--corruption",
            "ht",
            "--flat-negatives",
            "--seed",
            "1",
        ],
    );
    let steps: u64 = stdout
        .split("wrote ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(steps > 1, "{stdout}");
    assert_eq!(assert_exact_limits(&config, &stats, steps), 4 + 6);
    let pad = stdout
        .lines()
        .find(|l| l.starts_with("rigid padding: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let pct: f64 = pad["rigid padding: ".len()..]
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pct > 0.0 && pct < 100.0, "{pad}");
    // Every slot draws T = 4 shards · ppp 2 = 8 triples per step, padding included.
    let w: Vec<&str> = pad.split("; ").nth(1).unwrap().split_whitespace().collect();
    let (padding, drawn): (u64, u64) = (w[0].parse().unwrap(), w[3].parse().unwrap());
    assert_eq!(drawn, steps * 4 * 8, "{pad}");
    assert!(padding < drawn, "{pad}");
}

#[test]
fn shard_create_show_and_reuse() {
    let dir = TempDir::new("shard");
    let tr = triples_file(&dir);
    let npz = dir.join("sh.npz");
    let created = ok(&[
        "bess",
        "shard",
        "create",
        "--entities",
        "64",
        "--layout",
        "1/1/4",
        "--seed",
        "7",
        "--out",
        s(&npz),
    ]);
    assert!(
        created.contains("shards 4, entities 64, slots per shard 16"),
        "{created}"
    );
    assert!(
        created.contains("entities per shard: 16 16 16 16"),
        "{created}"
    );
    let shown = ok(&["bess", "shard", "show", s(&npz)]);
    assert_eq!(
        shown.lines().skip(1).collect::<Vec<_>>(),
        created.lines().skip(1).collect::<Vec<_>>()
    );
    // The file is the library's sharding for that seed.
    let loaded = sparsecore_bess::Sharding::load_npz(&npz).unwrap();
    let made =
        sparsecore_bess::Sharding::create(64, 4, &sparsecore_bess::seed_words(7), None).unwrap();
    assert_eq!(loaded, made);

    // Batches from the stored sharding equal batches from the seed.
    let common = [
        "--shard-batch-size",
        "8",
        "--negatives",
        "1",
        "--seed",
        "7",
        "--steps",
        "2",
    ];
    let (a, b) = (dir.join("a.arrow"), dir.join("b.arrow"));
    let (aj, bj, c, cj) = (
        dir.join("a.json"),
        dir.join("b.json"),
        dir.join("c.arrow"),
        dir.join("c.json"),
    );
    let mut args = vec![
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--out",
        s(&a),
        "--config-out",
        s(&aj),
    ];
    args.extend_from_slice(&common);
    ok(&args);
    let mut args = vec![
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--out",
        s(&b),
        "--config-out",
        s(&bj),
    ];
    args.extend_from_slice(&common);
    args.extend_from_slice(&["--sharding", s(&npz)]);
    ok(&args);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());

    // Typed shardings show their per-type counts.
    let typed = dir.join("typed.npz");
    let out = ok(&[
        "bess",
        "shard",
        "create",
        "--entities",
        "64",
        "--shards",
        "4",
        "--type-offsets",
        "0,40",
        "--out",
        s(&typed),
    ]);
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("entities per type:"))
            .count(),
        4,
        "{out}"
    );
    let sums: i64 = out
        .lines()
        .filter_map(|l| l.split("entities per type: ").nth(1))
        .flat_map(|l| {
            l.split_whitespace()
                .map(|x| x.parse::<i64>().unwrap())
                .collect::<Vec<_>>()
        })
        .sum();
    assert_eq!(sums, 64);

    // A sharding with the wrong shard count for the layout.
    let eight = dir.join("eight.npz");
    ok(&[
        "bess",
        "shard",
        "create",
        "--entities",
        "64",
        "--shards",
        "8",
        "--out",
        s(&eight),
    ]);
    let mut args = vec![
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--out",
        s(&c),
        "--config-out",
        s(&cj),
    ];
    args.extend_from_slice(&common);
    args.extend_from_slice(&["--sharding", s(&eight)]);
    let e = fails(&args);
    assert!(
        e.contains("n = 8 shards")
            && e.contains("N = global_device_count 1 * num_sc_per_device 4 = 4"),
        "{e}"
    );
    assert!(!dir.join("c.arrow").exists() && !dir.join("c.json").exists());
    // Not a sharding at all.
    let e = fails(&["bess", "shard", "show", s(&tr)]);
    assert!(e.contains(s(&tr)), "{e}");
}

#[test]
fn parquet_triples_give_what_ipc_gives() {
    let dir = TempDir::new("parquet");
    let tr = triples_file(&dir);
    let (h, r, t) = triples(600);
    let pq = dir.join("triples.parquet");
    let batch = triples_batch(h, r, t);
    let mut w =
        parquet::arrow::ArrowWriter::try_new(File::create(&pq).unwrap(), batch.schema(), None)
            .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let run_on = |input: &Path, tag: &str| {
        let out = dir.join(&format!("{tag}.arrow"));
        ok(&[
            "bess",
            "batches",
            "--triples",
            s(input),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--negatives",
            "2",
            "--seed",
            "5",
            "--steps",
            "2",
            "--out",
            s(&out),
            "--config-out",
            s(&dir.join(&format!("{tag}.json"))),
        ]);
        std::fs::read(out).unwrap()
    };
    assert_eq!(run_on(&tr, "ipc"), run_on(&pq, "pq"));
}

#[test]
fn bad_triples_are_typed_errors() {
    let dir = TempDir::new("bad");
    let base = |tag: &str, input: &Path| -> Vec<String> {
        [
            "bess",
            "batches",
            "--triples",
            s(input),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--steps",
            "1",
            "--out",
        ]
        .iter()
        .map(|x| x.to_string())
        .chain([
            s(&dir.join(&format!("o-{tag}.arrow"))).to_string(),
            "--config-out".into(),
            s(&dir.join(&format!("o-{tag}.json"))).to_string(),
        ])
        .collect()
    };
    let fails_on = |tag: &str, input: &Path| -> String {
        let args = base(tag, input);
        let e = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            !dir.join(&format!("o-{tag}.arrow")).exists()
                && !dir.join(&format!("o-{tag}.json")).exists(),
            "{tag}: outputs left behind"
        );
        let left: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{tag}: temporaries left behind");
        e
    };

    // Tail id 64 in the second record batch, global row 300.
    let (h, r, mut t) = triples(600);
    t[300] = E;
    let p = dir.join("tail.arrow");
    write_ipc(
        &p,
        &[
            triples_batch(h[..250].to_vec(), r[..250].to_vec(), t[..250].to_vec()),
            triples_batch(h[250..].to_vec(), r[250..].to_vec(), t[250..].to_vec()),
        ],
    );
    let e = fails_on("tail", &p);
    assert!(
        e.contains("column `tail`, row 300: entity id 64 is outside 0..64"),
        "{e}"
    );

    let (mut h, r, t) = triples(600);
    h[7] = -1;
    let p = dir.join("head.arrow");
    write_ipc(&p, &[triples_batch(h, r, t)]);
    let e = fails_on("head", &p);
    assert!(
        e.contains("column `head`, row 7: entity id -1 is outside 0..64"),
        "{e}"
    );

    // No tail column.
    let (h, r, _) = triples(10);
    let schema = Arc::new(Schema::new(vec![
        Field::new("head", DataType::Int64, false),
        Field::new("relation", DataType::Int32, false),
    ]));
    let b = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(h)) as ArrayRef,
            Arc::new(Int32Array::from(r)),
        ],
    )
    .unwrap();
    let p = dir.join("notail.arrow");
    write_ipc(&p, &[b]);
    let e = fails_on("notail", &p);
    assert!(
        e.contains("missing column `tail`") && e.contains("record batch 0"),
        "{e}"
    );

    // A string relation column.
    let (h, _, t) = triples(10);
    let schema = Arc::new(Schema::new(vec![
        Field::new("head", DataType::Int64, false),
        Field::new("relation", DataType::Utf8, false),
        Field::new("tail", DataType::Int64, false),
    ]));
    let rel: Vec<&str> = vec!["x"; 10];
    let b = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(h)) as ArrayRef,
            Arc::new(StringArray::from(rel)),
            Arc::new(Int64Array::from(t)),
        ],
    )
    .unwrap();
    let p = dir.join("str.arrow");
    write_ipc(&p, &[b]);
    let e = fails_on("str", &p);
    assert!(e.contains("column `relation` has type Utf8"), "{e}");

    // Every triple on the diagonal of entity 0 → most shard pairs are empty.
    let p = dir.join("one.arrow");
    write_ipc(&p, &[triples_batch(vec![0; 20], vec![0; 20], vec![0; 20])]);
    let e = fails_on("one", &p);
    assert!(e.contains("has no triples"), "{e}");

    // Options.
    let tr = triples_file(&dir);
    let mut args = base("opt", &tr);
    args.push("--shuffle".into());
    let e = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        e.contains("--shuffle applies to --sampler rigid only"),
        "{e}"
    );
    let mut args = base("opt", &tr);
    args[7] = "0".into(); // --shard-batch-size 0
    let e = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("shard batch size 0"), "{e}");
}

#[test]
fn progress_on_a_terminal_only_and_quiet_on_a_closed_stdout() {
    let dir = TempDir::new("tty");
    let tr = triples_file(&dir);
    let args = |tag: &str| -> Vec<String> {
        [
            "bess",
            "batches",
            "--triples",
            s(&tr),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--negatives",
            "2",
            "--steps",
            "50",
            "--out",
        ]
        .iter()
        .map(|x| x.to_string())
        .chain([
            s(&dir.join(&format!("{tag}.arrow"))).to_string(),
            "--config-out".into(),
            s(&dir.join(&format!("{tag}.json"))).to_string(),
        ])
        .collect()
    };
    let o = Command::new(BIN).args(args("piped")).output().unwrap();
    assert!(o.status.success());
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "",
        "progress drawn into a pipe"
    );

    // A closed stdout: status 141, nothing on stderr, the files complete.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(BIN)
        .args(args("closed"))
        .stdout(writer)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(141));
    assert_eq!(String::from_utf8_lossy(&o.stderr), "");
    assert_eq!(
        std::fs::read(dir.join("closed.arrow")).unwrap(),
        std::fs::read(dir.join("piped.arrow")).unwrap()
    );

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
    assert!(o.status.success(), "{shown}");
    assert!(
        shown.contains("steps written to "),
        "no progress bar in {shown:?}"
    );
    assert!(
        shown.contains("per-partition load over 50 steps"),
        "no summary in {shown:?}"
    );
    assert_eq!(
        std::fs::read(dir.join("tty.arrow")).unwrap(),
        std::fs::read(dir.join("piped.arrow")).unwrap()
    );
}

/// One `.npy` member: little-endian `descr` data of `shape`, header padded as numpy pads it.
fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
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

fn i32_bytes(v: impl IntoIterator<Item = i64>) -> Vec<u8> {
    v.into_iter()
        .flat_map(|x| (x as i32).to_le_bytes())
        .collect()
}

/// besskge's `Sharding.save` of an untyped sharding: `np.savez` of the dataclass fields, the
/// arrays int32 as torch/numpy leave them, and the two type tables as pickled `None`.
#[test]
fn a_besskge_sharding_file_reads_back() {
    use std::io::Write;
    let dir = TempDir::new("besskge");
    let tr = triples_file(&dir);
    let sh =
        sparsecore_bess::Sharding::create(64, 4, &sparsecore_bess::seed_words(11), None).unwrap();
    let path = dir.join("besskge.npz");
    let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let m = sh.max_entity_per_shard();
    let members: Vec<(&str, Vec<u8>)> = vec![
        ("n_shard", npy("<i8", &[], &4i64.to_le_bytes())),
        (
            "entity_to_shard",
            npy("<i4", &[64], &i32_bytes(sh.entity_to_shard.iter().copied())),
        ),
        (
            "entity_to_idx",
            npy("<i4", &[64], &i32_bytes(sh.entity_to_idx.iter().copied())),
        ),
        (
            "shard_and_idx_to_entity",
            npy(
                "<i4",
                &[4, m],
                &i32_bytes(sh.shard_and_idx_to_entity.iter().copied()),
            ),
        ),
        (
            "shard_counts",
            npy("<i4", &[4], &i32_bytes(sh.shard_counts.iter().copied())),
        ),
        ("entity_type_counts", npy("|O", &[], b"\x80\x02N.")),
        ("entity_type_offsets", npy("|O", &[], b"\x80\x02N.")),
    ];
    for (name, bytes) in members {
        zip.start_file(format!("{name}.npy"), opts).unwrap();
        zip.write_all(&bytes).unwrap();
    }
    zip.finish().unwrap();

    let shown = ok(&["bess", "shard", "show", s(&path)]);
    assert!(
        shown.contains("shards 4, entities 64, slots per shard 16"),
        "{shown}"
    );
    let counts: Vec<String> = sh.shard_counts.iter().map(i64::to_string).collect();
    assert!(
        shown.contains(&format!("entities per shard: {}", counts.join(" "))),
        "{shown}"
    );
    assert!(!shown.contains("per type"), "{shown}");

    // Batches over it equal batches over the sharding of seed 11.
    let run_with = |tag: &str, extra: &[&str]| {
        let (out, cfg) = (
            dir.join(&format!("{tag}.arrow")),
            dir.join(&format!("{tag}.json")),
        );
        let mut args = vec![
            "bess",
            "batches",
            "--triples",
            s(&tr),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--negatives",
            "2",
            "--seed",
            "11",
            "--steps",
            "2",
            "--out",
            s(&out),
            "--config-out",
            s(&cfg),
        ];
        args.extend_from_slice(extra);
        ok(&args);
        std::fs::read(out).unwrap()
    };
    assert_eq!(
        run_with("file", &["--sharding", s(&path)]),
        run_with("seed", &[])
    );
}

/// The files in `dir` (names), sorted.
fn listing(dir: &TempDir) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn out_and_config_out_naming_one_file_are_refused_and_nothing_is_written() {
    let dir = TempDir::new("samepath");
    let tr = triples_file(&dir);
    let batches = |out: &Path, cfg: &Path| {
        fails(&[
            "bess",
            "batches",
            "--triples",
            s(&tr),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--steps",
            "2",
            "--out",
            s(out),
            "--config-out",
            s(cfg),
        ])
    };
    let x = dir.join("o.arrow");
    let canonical = std::fs::canonicalize(&dir.0).unwrap().join("o.arrow");
    // The same path twice; the same file through `.`; the same file through a symlink, to a
    // file that does not exist yet and then to one that does (kept as it was).
    let e = batches(&x, &x);
    assert!(
        e.contains(&format!(
            "--out {} and --config-out {} are the same file ({})",
            s(&x),
            s(&x),
            canonical.display()
        )),
        "{e}"
    );
    assert_eq!(listing(&dir), ["triples.arrow"]);
    let dotted = dir.0.join(".").join("o.arrow");
    let e = batches(&x, &dotted);
    assert!(
        e.contains(&format!(
            "--config-out {} are the same file ({})",
            s(&dotted),
            canonical.display()
        )),
        "{e}"
    );
    assert_eq!(listing(&dir), ["triples.arrow"]);
    let link = dir.join("link.json");
    std::os::unix::fs::symlink("o.arrow", &link).unwrap();
    let e = batches(&x, &link);
    assert!(
        e.contains(&format!("are the same file ({})", canonical.display())),
        "{e}"
    );
    assert_eq!(listing(&dir), ["link.json", "triples.arrow"]);
    std::fs::write(&x, b"kept").unwrap();
    let e = batches(&link, &x);
    assert!(
        e.contains(&format!("--out {} and --config-out {}", s(&link), s(&x))),
        "{e}"
    );
    assert_eq!(std::fs::read(&x).unwrap(), b"kept");
    assert_eq!(listing(&dir), ["link.json", "o.arrow", "triples.arrow"]);
    // Two different files in one directory are still allowed.
    ok(&[
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--shard-batch-size",
        "8",
        "--steps",
        "2",
        "--out",
        s(&x),
        "--config-out",
        s(&dir.join("c.json")),
    ]);
    assert!(std::fs::read(&x).unwrap().starts_with(b"ARROW1"));
}

#[test]
fn zero_steps_are_refused_before_anything_is_written() {
    let dir = TempDir::new("steps0");
    let tr = triples_file(&dir);
    let (out, cfg) = (dir.join("o.arrow"), dir.join("c.json"));
    let e = fails(&[
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--shard-batch-size",
        "8",
        "--steps",
        "0",
        "--out",
        s(&out),
        "--config-out",
        s(&cfg),
    ]);
    assert!(e.contains("--steps 0: steps must be at least 1"), "{e}");
    assert_eq!(listing(&dir), ["triples.arrow"]);
}

/// The errors only the command line words (which flags, which file), each as one exact line.
#[test]
fn shard_and_triples_errors_name_the_flags_and_the_file() {
    let dir = TempDir::new("clierr");
    let tr = triples_file(&dir);
    let npz = dir.join("sh.npz");
    let line = |e: &str| format!("sparsecore-prep: error: {e}\n");
    let e = fails(&[
        "bess",
        "shard",
        "create",
        "--entities",
        "64",
        "--out",
        s(&npz),
    ]);
    assert_eq!(
        e,
        line("bess shard create: give --shards N or --layout L/G/S")
    );
    let e = fails(&[
        "bess",
        "shard",
        "create",
        "--entities",
        "0",
        "--shards",
        "4",
        "--out",
        s(&npz),
    ]);
    assert_eq!(
        e,
        line("creating the sharding: invalid `n_entity` = 0: must be at least 1")
    );
    assert!(!npz.exists());
    // The triples file is no .npz, read as a sharding by `shard show` and by `--sharding`.
    let e = fails(&["bess", "shard", "show", s(&tr)]);
    assert!(
        e.starts_with(&format!("sparsecore-prep: error: reading {}: ", s(&tr))),
        "{e}"
    );
    let (out, cfg) = (dir.join("o.arrow"), dir.join("c.json"));
    let batches = |triples: &Path, extra: &[&str]| {
        let mut args = vec![
            "bess",
            "batches",
            "--triples",
            s(triples),
            "--entities",
            "64",
            "--shard-batch-size",
            "8",
            "--out",
            s(&out),
            "--config-out",
            s(&cfg),
        ];
        args.extend_from_slice(extra);
        fails(&args)
    };
    let e = batches(&tr, &["--sharding", s(&tr)]);
    assert!(
        e.starts_with(&format!("sparsecore-prep: error: sharding {}: ", s(&tr))),
        "{e}"
    );
    // A file with its columns but no rows.
    let empty = dir.join("empty.arrow");
    write_ipc(&empty, &[triples_batch(vec![], vec![], vec![])]);
    let e = batches(&empty, &[]);
    assert_eq!(e, line(&format!("triples {}: no triples", s(&empty))));
    assert_eq!(listing(&dir), ["empty.arrow", "triples.arrow"]);
}

/// The review's repro: under `ulimit -v 3000000` (3 GB of address space), 10 M negatives per
/// list per triple need about 26 GB a step (1.28 G negative rows on the host's 4 SparseCores):
/// a typed error naming the negatives and the size, not an abort (the allocation is refused at
/// once, so nothing near that much is ever used).
#[test]
fn a_step_the_process_cannot_hold_is_an_error_not_an_abort() {
    let dir = TempDir::new("hugeneg");
    let tr = triples_file(&dir);
    let (out, cfg) = (dir.join("o.arrow"), dir.join("c.json"));
    let o = Command::new("sh")
        .args([
            "-c",
            "ulimit -v 3000000 && exec \"$0\" \"$@\"",
            BIN,
            "bess",
            "batches",
            "--triples",
            s(&tr),
            "--entities",
            "64",
        ])
        .args([
            "--shard-batch-size",
            "8",
            "--negatives",
            "10000000",
            "--steps",
            "1",
            "--out",
            s(&out),
            "--config-out",
            s(&cfg),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    // T = 8 triples per SparseCore, B = 8 lists of K = 10 M: NEG = 4·8·10 M rows per slice.
    // 4 slices · (320 M rows · 12 + 8 · 20 + 320 M · 8) bytes.
    let bytes = 4u64 * (320_000_000 * 12 + 8 * 20 + 320_000_000 * 8);
    assert!(stderr.contains("shard batch size 8 (8 triples per SparseCore) and 8 negative lists of 10000000 per shard"), "{stderr}");
    assert!(
        stderr.contains(&format!("needs {bytes} bytes"))
            && stderr.contains("the allocator refuses that much"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert_eq!(listing(&dir), ["triples.arrow"]);
}

/// `--max-step-bytes` refuses the same stream up front, whatever the allocator would give, and
/// a cap at the step's exact size lets it through.
#[test]
fn max_step_bytes_refuses_a_larger_step_before_anything_is_written() {
    let dir = TempDir::new("maxstep");
    let tr = triples_file(&dir);
    let (out, cfg) = (dir.join("o.arrow"), dir.join("c.json"));
    let run = |cap: &str| {
        Command::new(BIN)
            .args([
                "bess",
                "batches",
                "--triples",
                s(&tr),
                "--entities",
                "64",
                "--shard-batch-size",
                "8",
                "--negatives",
                "2",
            ])
            .args([
                "--steps",
                "1",
                "--max-step-bytes",
                cap,
                "--out",
                s(&out),
                "--config-out",
                s(&cfg),
            ])
            .output()
            .unwrap()
    };
    // As in the test above: 4 slices · (rows · 12 + T · 20 + NEG · 8) bytes, with T = 8 triples per
    // SparseCore and 8 lists of K = 2 negatives from each of the 4 shards: NEG = 64 negative rows,
    // one output row each.
    let bytes = 4 * (64 * 12 + 8 * 20 + 64 * 8);
    let o = run(&(bytes - 1).to_string());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "sparsecore-prep: error: --max-step-bytes {}: a step of layout 1/1/4 (4 SparseCores on this host), shard batch size 8 \
             (8 triples per SparseCore) and 8 negative lists of 2 per shard (64 negative rows per SparseCore; negatives = 2) needs {bytes} bytes\n",
            bytes - 1
        )
    );
    assert_eq!(listing(&dir), ["triples.arrow"]);
    let o = run(&bytes.to_string());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(listing(&dir), ["c.json", "o.arrow", "triples.arrow"]);
}

#[test]
fn batches_help_says_how_rows_and_the_shard_batch_size_are_laid_out() {
    let help = ok(&["bess", "batches", "--help"]);
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(help.contains("rounded up to a multiple of the n shards, as besskge does (at n = 4, 2 gives 4 and 6 gives 8)"), "{help}");
    assert!(help.contains("The negatives are one per row in rows 0 .. n·B·K of the same slice, beside the triples but not aligned with them"), "{help}");
    // And it does: 6 at n = 4 gives ppp 2, 8 triples per SparseCore.
    let dir = TempDir::new("sbs6");
    let tr = triples_file(&dir);
    let (out, cfg) = (dir.join("o.arrow"), dir.join("c.json"));
    let stdout = ok(&[
        "bess",
        "batches",
        "--triples",
        s(&tr),
        "--entities",
        "64",
        "--shard-batch-size",
        "6",
        "--steps",
        "1",
        "--out",
        s(&out),
        "--config-out",
        s(&cfg),
    ]);
    assert!(
        stdout.contains("ppp 2 triples per shard-pair block per step"),
        "{stdout}"
    );
    assert_eq!(read_json(&cfg)["tables"][0]["max_ids_per_partition"], 4);
}
