//! End-to-end tests of `sparsecore-prep report`, run as real processes on
//! stats that the CLI measured: a generated `long` workload (three stacks: items, cats,
//! queries; 128 rows × 4 batches, 1/1/4), preprocessed as is and with `--balance 4`.
//!
//! What is checked:
//! - the SVG parses and renders (resvg) to a picture that is not blank: enough non-white
//!   pixels, many colours, and the bar colours of every quantity present;
//! - its text nodes name every stack of the stats under every run, with the peaks the stats
//!   hold, and the buffer captions carry the config's buffer per SparseCore;
//! - the HTML page holds the picture and a summary row per (stack, run) with the stats' peaks
//!   and the config's limits; default run names are parent/stem when the stems repeat;
//! - bad invocations (no --stats, an unknown extension, an unreadable or invalid stats file, a
//!   --label count that does not match, a config of another layout, an auto-stacked config
//!   without --batch-size or whose stacks are not the stats') fail with one line and write
//!   nothing.

use sparsecore_testkit::TempDir;
use std::path::{Path, PathBuf};

use resvg::tiny_skia::{Pixmap, Transform};
use resvg::usvg::{self, Node};
use serde_json::Value;
use sparsecore_prep::FdoStats;

use crate::support;
use support::{ok, run, s};

/// Runs, requires exit status 1 and one stderr line; returns it.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "`{}`: {stderr}", args.join(" "));
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

/// Generates the workload and preprocesses it twice: (config, before stats, after stats).
fn measured(dir: &TempDir) -> (PathBuf, PathBuf, PathBuf) {
    let (input, cfg) = (dir.join("in.arrow"), dir.join("cfg.json"));
    ok(&[
        "generate",
        "--profile",
        "long",
        "--batch-size",
        "128",
        "--num-batches",
        "4",
        "--layout",
        "1/1/4",
        "--out",
        s(&input),
        "--config-out",
        s(&cfg),
    ]);
    // The generated limits equal the batches' largest counts, so no reordered batch could keep
    // every stack within them and balancing would keep the input order; a tuned config has
    // headroom: double the limits.
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    for t in config["tables"].as_array_mut().unwrap() {
        for key in ["max_ids_per_partition", "max_unique_ids_per_partition"] {
            t[key] = Value::from(t[key].as_u64().unwrap() * 2);
        }
        if let Some(b) = t
            .get("suggested_coo_buffer_size_per_device")
            .and_then(Value::as_u64)
        {
            t["suggested_coo_buffer_size_per_device"] = Value::from(b * 2);
        }
    }
    std::fs::write(&cfg, config.to_string()).unwrap();
    let (before, after) = (dir.join("before"), dir.join("after"));
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&before),
    ]);
    ok(&[
        "preprocess",
        "--config",
        s(&cfg),
        "--input",
        s(&input),
        "--out",
        s(&after),
        "--balance",
        "4",
    ]);
    (cfg, before.join("stats.json"), after.join("stats.json"))
}

/// Options with the system's fonts, the generic families pointed at one of them (usvg's
/// defaults, Arial and Times New Roman, are often missing), so that <text> is laid out.
fn options() -> usvg::Options<'static> {
    let mut opt = usvg::Options::default();
    let db = opt.fontdb_mut();
    db.load_system_fonts();
    let family = {
        let names: Vec<String> = db
            .faces()
            .filter_map(|f| f.families.first().map(|(n, _)| n.clone()))
            .collect();
        assert!(!names.is_empty(), "no system fonts: the test needs one to lay out the SVG's text (install e.g. fonts-dejavu-core)");
        names
            .iter()
            .find(|n| n.contains("Sans"))
            .unwrap_or(&names[0])
            .clone()
    };
    db.set_sans_serif_family(family.clone());
    db.set_serif_family(family);
    opt
}

/// Every text node's text, in document order; each must have been laid out with a font.
fn texts(group: &usvg::Group, out: &mut Vec<String>) {
    for node in group.children() {
        match node {
            Node::Group(g) => texts(g, out),
            Node::Text(t) => {
                // Laid out with a font: usvg turned the glyphs into paths.
                assert!(
                    !t.flattened().children().is_empty(),
                    "text {:?} has no glyphs",
                    t.chunks()[0].text()
                );
                out.push(
                    t.chunks()
                        .iter()
                        .map(|c| c.text())
                        .collect::<String>()
                        .trim()
                        .to_string(),
                )
            }
            _ => {}
        }
    }
}

/// The config's limits of a table: (max_ids_per_partition, max_unique_ids_per_partition).
fn table_limits(cfg: &Value, table: &str) -> (u64, u64) {
    let t = cfg["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == table)
        .unwrap();
    (
        t["max_ids_per_partition"].as_u64().unwrap(),
        t["max_unique_ids_per_partition"].as_u64().unwrap(),
    )
}

#[test]
fn svg_renders_and_names_every_stack_of_every_run() {
    let dir = TempDir::new("report-svg");
    let (cfg, before, after) = measured(&dir);
    let out = dir.join("report.svg");
    let stdout = ok(&[
        "report",
        "--stats",
        s(&before),
        "--stats",
        s(&after),
        "--label",
        "before",
        "--label",
        "after",
        "--config",
        s(&cfg),
        "--out",
        s(&out),
    ]);
    assert_eq!(
        stdout.trim(),
        format!(
            "drew 3 stacks x 2 runs (stacks x runs) to {} with the config's limits",
            out.display()
        )
    );

    let (b, a) = (
        FdoStats::from_path(&before).unwrap(),
        FdoStats::from_path(&after).unwrap(),
    );
    let stacks: Vec<&String> = b.stacks.keys().collect();
    assert_eq!(stacks, ["cats", "items", "queries"]);
    // Balancing lowered the worst cell of some stack: the two columns differ.
    assert!(
        stacks
            .iter()
            .any(|k| a.stacks[*k].max_ids() < b.stacks[*k].max_ids()),
        "{b:?}\n{a:?}"
    );

    let data = std::fs::read(&out).unwrap();
    let tree = usvg::Tree::from_data(&data, &options()).expect("the SVG parses");
    let mut found = Vec::new();
    texts(tree.root(), &mut found);
    // The panel captions: every stack under every run, with the peaks its stats hold.
    for (label, stats) in [("before", &b), ("after", &a)] {
        for (name, st) in &stats.stacks {
            let caption = format!(
                "{name} · {label}: peak {} ids, {} unique, {} dropped",
                st.max_ids(),
                st.max_unique_ids(),
                st.dropped_id_count
            );
            assert!(
                found.contains(&caption),
                "no text node {caption:?} in {found:?}"
            );
        }
    }
    // The buffer captions carry the config's buffer per SparseCore: the generated config
    // suggests a buffer per device (a multiple of 8·S), and the plan takes it as given.
    let config: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    for (name, st) in &b.stacks {
        let t = config["tables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name.as_str())
            .unwrap();
        let per_sc = t["suggested_coo_buffer_size_per_device"].as_u64().unwrap() / 4;
        let peak = st.required_buffer_size_per_sc.iter().max().unwrap();
        let caption = format!("COO buffer per local SparseCore: peak {peak} of {per_sc} slots");
        assert!(
            found.contains(&caption),
            "no text node {caption:?} in {found:?}"
        );
    }
    // A config measured on this data has exactly the limits the input order needs; `measured`
    // doubled them.
    for name in &stacks {
        let (ids, uniq) = table_limits(&config, name);
        assert_eq!(
            (ids, uniq),
            (
                2 * b.stacks[*name].max_ids() as u64,
                2 * b.stacks[*name].max_unique_ids() as u64
            )
        );
    }

    // Rendered, the picture is not blank.
    let size = tree.size().to_int_size();
    assert_eq!(
        (size.width(), size.height()),
        (2 * 620, 100 + 3 * (300 + 190))
    );
    let mut pixmap = Pixmap::new(size.width(), size.height()).unwrap();
    resvg::render(&tree, Transform::default(), &mut pixmap.as_mut());
    let pixels: Vec<[u8; 4]> = pixmap
        .pixels()
        .iter()
        .map(|p| [p.red(), p.green(), p.blue(), p.alpha()])
        .collect();
    let background = pixels
        .iter()
        .filter(|p| **p == [255, 255, 255, 255])
        .count();
    let inked = pixels.len() - background;
    assert!(
        inked * 100 > 10 * pixels.len(),
        "only {inked} of {} pixels are not white",
        pixels.len()
    );
    let mut colours: Vec<[u8; 4]> = pixels.clone();
    colours.sort();
    colours.dedup();
    assert!(colours.len() > 20, "only {} colours", colours.len());
    // The bars of each quantity (ids blue, unique ids orange, buffer green), each a solid area.
    for (what, rgb) in [
        ("max ids", [31, 119, 180]),
        ("max unique ids", [255, 127, 14]),
        ("buffer", [44, 160, 44]),
    ] {
        let n = pixels.iter().filter(|p| p[..3] == rgb).count();
        assert!(
            n > 10_000,
            "{what}: only {n} pixels of its bar colour {rgb:?}"
        );
    }
}

#[test]
fn html_has_the_picture_and_the_numbers() {
    let dir = TempDir::new("report-html");
    let (cfg, before, after) = measured(&dir);
    let out = dir.join("report.html");
    ok(&[
        "report",
        "--stats",
        s(&before),
        "--stats",
        s(&after),
        "--config",
        s(&cfg),
        "--out",
        s(&out),
    ]);
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"), "{}", &page[..80]);
    assert_eq!(page.matches("<svg").count(), 1);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    // Both stats files are named stats.json: the runs are named by their directories.
    for (label, path) in [("before/stats", &before), ("after/stats", &after)] {
        let stats = FdoStats::from_path(path).unwrap();
        for (name, st) in &stats.stacks {
            let (ids, uniq) = table_limits(&config, name);
            let t = config["tables"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["name"] == name.as_str())
                .unwrap();
            let per_sc = t["suggested_coo_buffer_size_per_device"].as_u64().unwrap() / 4;
            let row = format!(
                "<tr><td>{name}</td><td>{label}</td><td>{}</td><td>{ids}</td><td>{}</td><td>{uniq}</td><td>{}</td><td>{per_sc}</td><td>{}</td></tr>",
                st.max_ids(),
                st.max_unique_ids(),
                st.required_buffer_size_per_sc.iter().max().unwrap(),
                st.dropped_id_count
            );
            assert!(page.contains(&row), "no row {row:?}");
            let cells: String = st
                .max_ids_per_partition
                .iter()
                .map(|v| format!("<td>{v}</td>"))
                .collect();
            assert!(
                page.contains(&format!("<tr><td>max_ids_per_partition</td>{cells}</tr>")),
                "{name} {label}: no cell row"
            );
        }
    }

    // Without --config the picture has no limits, and says so.
    let out = dir.join("plain.svg");
    ok(&["report", "--stats", s(&before), "--out", s(&out)]);
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.contains("\n(no --config: limits not drawn)\n"));
    for st in FdoStats::from_path(&before).unwrap().stacks.values() {
        let peak = st.required_buffer_size_per_sc.iter().max().unwrap();
        assert!(
            svg.contains(&format!(
                "\nCOO buffer per local SparseCore: peak {peak} slots\n"
            )),
            "{peak}"
        );
    }
    assert!(
        !svg.contains("max_ids_per_partition limit"),
        "a limit in the legend without a config"
    );
}

#[test]
fn bad_invocations_fail_with_one_line_and_write_nothing() {
    let dir = TempDir::new("report-errors");
    let (cfg, before, _) = measured(&dir);
    let outdir = dir.join("out");
    std::fs::create_dir(&outdir).unwrap();
    let svg = outdir.join("r.svg");
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "{\"version\": 1, \"layout\": ").unwrap();
    // The config on another layout (S = 2).
    let mut other: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    other["config"]["num_sc_per_device"] = Value::from(2);
    let other_cfg = dir.join("other.json");
    std::fs::write(&other_cfg, other.to_string()).unwrap();
    let missing = dir.join("missing.json");
    // The config under auto stacking: its stacks depend on the batch size, and they are not
    // the stacks the stats were measured with.
    let mut auto: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    auto["config"]["stacking"] = Value::from("auto");
    let auto_cfg = dir.join("auto.json");
    std::fs::write(&auto_cfg, auto.to_string()).unwrap();
    let png = outdir.join("r.png");

    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["report", "--out", s(&svg)], "report: give at least one --stats FILE to draw".into()),
        (
            vec!["report", "--stats", s(&before), "--out", s(&png)],
            format!("--out {}: unknown extension \"png\"; expected .svg or .html", png.display()),
        ),
        (vec!["report", "--stats", s(&missing), "--out", s(&svg)], format!("reading stats {}: ", missing.display())),
        (vec!["report", "--stats", s(&before), "--stats", s(&garbage), "--out", s(&svg)], format!("stats {}: ", garbage.display())),
        (
            vec!["report", "--stats", s(&before), "--label", "a", "--label", "b", "--out", s(&svg)],
            "--label a, b: 2 --label for 1 --stats".into(),
        ),
        (
            vec!["report", "--stats", s(&before), "--config", s(&other_cfg), "--out", s(&svg)],
            format!("--config {}: its layout L/G/S is 1/1/2 but stats {} were measured on 1/1/4", other_cfg.display(), before.display()),
        ),
        (
            vec!["report", "--stats", s(&before), "--config", s(&auto_cfg), "--out", s(&svg)],
            format!("--config {}: uses auto stacking, whose stacks depend on the batch size: give --batch-size", auto_cfg.display()),
        ),
        (
            vec!["report", "--stats", s(&before), "--config", s(&auto_cfg), "--batch-size", "6", "--out", s(&svg)],
            "--batch-size 6: local samples per feature: a positive multiple of the 4 local SparseCores".into(),
        ),
        (
            vec!["report", "--stats", s(&before), "--config", s(&auto_cfg), "--batch-size", "128", "--out", s(&svg)],
            format!(
                "stack `cats`: in stats {} but not a stack of config {} (its stacks: items_cats_queries)",
                before.display(),
                auto_cfg.display()
            ),
        ),
    ];
    for (args, want) in cases {
        let e = fails(&args);
        assert!(
            e.contains(&want),
            "`{}`: {e:?} does not contain {want:?}",
            args.join(" ")
        );
        assert!(
            listing(&outdir).is_empty(),
            "`{}` wrote {:?}",
            args.join(" "),
            listing(&outdir)
        );
    }
}
