//! Crash hygiene of `preprocess`: a run killed outright (SIGKILL) leaves its
//! temporaries behind (`DIR.tmp-<pid>`, `DIR/.staging.tmp-<pid>`, `DIR.old-<pid>`,
//! `<file>.tmp-<pid>`); the next run on the same `--out` removes those of dead processes, leaves
//! those of live ones alone, moves earlier outputs back when a run died between its two renames,
//! and writes the same outputs as a clean run.
//!
//! Dead pids come from spawning and reaping a short-lived child (its pid is free afterwards);
//! the live pid is the test process's own.

use sparsecore_testkit::TempDir;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use arrow_ipc::reader::FileReader;
use arrow_ipc::writer::FileWriter;

use crate::support;
use support::{ok, run, s, BIN};

/// A pid that belongs to no process: a reaped child's, checked against `/proc`.
fn dead_pid() -> u32 {
    loop {
        let mut c = Command::new("true").spawn().expect("spawn true");
        let pid = c.id();
        c.wait().unwrap();
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return pid;
        }
    }
}

/// Every file of a directory, by name.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A temporary directory holding one junk file.
fn junk_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::write(p.join("t00.arrow"), b"partial").unwrap();
}

/// The input, its config, and the outputs of a clean run.
fn setup(t: &TempDir) -> (PathBuf, PathBuf, BTreeMap<String, Vec<u8>>) {
    let (input, config, reference) = (t.join("data.arrow"), t.join("cfg.json"), t.join("ref"));
    ok(&[
        "generate",
        "--profile",
        "criteo",
        "--batch-size",
        "256",
        "--num-batches",
        "2",
        "--out",
        s(&input),
        "--config-out",
        s(&config),
    ]);
    ok(&[
        "preprocess",
        "--config",
        s(&config),
        "--input",
        s(&input),
        "--out",
        s(&reference),
    ]);
    let want = files(&reference);
    assert_eq!(want.len(), 27, "26 stacks and stats.json");
    (input, config, want)
}

#[test]
fn stale_temporaries_of_dead_runs_are_removed_and_live_ones_kept() {
    let t = TempDir::new("stale");
    let (input, config, want) = setup(&t);
    let (dead, live) = (dead_pid(), std::process::id());
    let pre = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "preprocess",
            "--config",
            s(&config),
            "--input",
            s(&input),
            "--out",
            s(out),
        ];
        args.extend_from_slice(extra);
        run(&args)
    };

    // --out missing: the sibling staging directory of a dead run goes, a live run's stays.
    let a = t.join("a");
    junk_dir(&t.join(&format!("a.tmp-{dead}")));
    let not_ours = t.join(&format!("a.tmp-{live}"));
    junk_dir(&not_ours);
    let o = pre(&a, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("cleaned up 1 temporaries of killed runs"),
        "{stdout}"
    );
    assert!(!t.join(&format!("a.tmp-{dead}")).exists());
    assert!(
        not_ours.join("t00.arrow").exists(),
        "a live process's staging directory is left alone"
    );
    assert_eq!(files(&a), want);

    // --out empty but for a dead run's inner staging directory: not "non-empty" any more.
    let b = t.join("b");
    junk_dir(&b.join(format!(".staging.tmp-{dead}")));
    let o = pre(&b, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(files(&b), want);

    // --out holds earlier outputs: --overwrite, with a dead run's .tmp and .old siblings and a
    // temporary stats file inside.
    let c = t.join("c");
    ok(&[
        "preprocess",
        "--config",
        s(&config),
        "--input",
        s(&input),
        "--out",
        s(&c),
    ]);
    junk_dir(&t.join(&format!("c.tmp-{dead}")));
    junk_dir(&t.join(&format!("c.old-{dead}")));
    std::fs::write(c.join(format!("stats.json.tmp-{dead}")), b"{").unwrap();
    let o = pre(&c, &["--overwrite"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("cleaned up 3 temporaries"));
    for gone in [format!("c.tmp-{dead}"), format!("c.old-{dead}")] {
        assert!(!t.join(&gone).exists(), "{gone}");
    }
    assert_eq!(files(&c), want);

    // A run killed between its two renames: --out missing, the earlier outputs in
    // DIR.old-<pid>, the new ones in DIR.tmp-<pid>. The earlier outputs come back.
    let d = t.join("d");
    std::fs::create_dir_all(t.join(&format!("d.old-{dead}"))).unwrap();
    for (name, bytes) in &want {
        std::fs::write(t.join(&format!("d.old-{dead}")).join(name), bytes).unwrap();
    }
    junk_dir(&t.join(&format!("d.tmp-{dead}")));
    let o = pre(&d, &[]);
    assert!(
        !o.status.success(),
        "the restored outputs make --out non-empty"
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("moved them back"), "{stderr}");
    assert!(stderr.contains("not empty"), "{stderr}");
    assert_eq!(files(&d), want);
    assert!(
        !t.join(&format!("d.tmp-{dead}")).exists() && !t.join(&format!("d.old-{dead}")).exists()
    );
    let o = pre(&d, &["--overwrite"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(files(&d), want);

    // stats --out: a dead run's temporary file beside the stats file goes.
    let st = t.join("stats.json");
    std::fs::write(t.join(&format!("stats.json.tmp-{dead}")), b"{").unwrap();
    ok(&[
        "stats",
        "--config",
        s(&config),
        "--input",
        s(&input),
        "--out",
        s(&st),
    ]);
    assert!(!t.join(&format!("stats.json.tmp-{dead}")).exists());
    assert_eq!(std::fs::read(&st).unwrap(), want["stats.json"]);

    // fdo merge -o: the same for the merged file.
    let merged = t.join("merged.json");
    std::fs::write(t.join(&format!("merged.json.tmp-{dead}")), b"{").unwrap();
    std::fs::write(t.join(&format!("merged.json.tmp-{live}")), b"{").unwrap();
    ok(&["fdo", "merge", s(&st), "-o", s(&merged)]);
    assert!(!t.join(&format!("merged.json.tmp-{dead}")).exists());
    assert!(
        t.join(&format!("merged.json.tmp-{live}")).exists(),
        "a live process's temporary is left alone"
    );
}

#[test]
fn a_run_killed_with_sigkill_is_cleaned_up_by_the_next() {
    let t = TempDir::new("kill");
    let (input, config, want) = setup(&t);
    // A long input: the two batches, 300 times over.
    let big = t.join("big.arrow");
    {
        let reader = FileReader::try_new(File::open(&input).unwrap(), None).unwrap();
        let schema = reader.schema();
        let batches: Vec<_> = reader.map(|b| b.unwrap()).collect();
        let mut w = FileWriter::try_new(File::create(&big).unwrap(), &schema).unwrap();
        for _ in 0..300 {
            for b in &batches {
                w.write(b).unwrap();
            }
        }
        w.finish().unwrap();
    }
    let out = t.join("out");
    let mut child = Command::new(BIN)
        .args([
            "preprocess",
            "--config",
            s(&config),
            "--input",
            s(&big),
            "--out",
            s(&out),
            "--threads",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let staging = t.join(&format!("out.tmp-{}", child.id()));
    // Wait until the run is writing its stack files, then kill it.
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("preprocess ended ({status}) before it could be killed; the input is too small");
        }
        if std::fs::read_dir(&staging)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert!(
        staging.is_dir(),
        "SIGKILL leaves the staging directory behind"
    );
    assert!(!out.exists());

    let o = run(&[
        "preprocess",
        "--config",
        s(&config),
        "--input",
        s(&input),
        "--out",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("cleaned up 1 temporaries of killed runs"));
    assert!(
        !staging.exists(),
        "the killed run's staging directory is gone"
    );
    assert_eq!(files(&out), want);
    let left: Vec<String> = std::fs::read_dir(&t.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-") || n.contains(".old-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
