//! Shared comparison of our output with a reference `expected.json` (golden schema).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;
use sparsecore_prep::input::SampleSource;
use sparsecore_prep::spec::{PAD_GAIN_BITS, PAD_ID};
use sparsecore_prep::{Error, Output, Plan, PreprocessorBuilder};
use sparsecore_testkit::case::Case;

/// Builds the preprocessor from `builder`, runs `case` through it and compares with `expected`
/// (an error case by kind and message, otherwise the whole output).
pub fn run_and_check(
    case: &Case,
    builder: PreprocessorBuilder,
    expected: &Value,
) -> Result<(), String> {
    let mut out = Output::new();
    let result = builder.build().and_then(|mut prep| {
        let sources = case.sources()?;
        let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
        prep.run(&inputs, &mut out)?;
        Ok(prep)
    });
    if let Some(err) = expected.get("error") {
        return check_error(err, result.map(|_| ()));
    }
    let prep = result.map_err(|e| format!("preprocessing failed: {e}"))?;
    check_output(&case.raw, expected, prep.plan().ok_or("no plan")?, &out)
}

/// Case directories (holding input.json and expected.json) under `root`, sorted.
pub fn case_dirs(root: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("golden folder {} is missing: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("input.json").is_file() && p.join("expected.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Parses a JSON file, panicking with its path.
pub fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Checks an expected abort against our error: the same message phrase (`message_contains`, the
/// README's schema), and the typed kind that the reference's words name. A case that gives only
/// the reference's whole `message` (glog's header of time and pid, then the words) is held to
/// the kind alone; one that gives neither is a broken case, not one that any error passes.
pub fn check_error(expected_error: &Value, result: Result<(), Error>) -> Result<(), String> {
    let contains = expected_error["message_contains"].as_str();
    let Some(words) = contains.or_else(|| expected_error["message"].as_str()) else {
        return Err(format!(
            "the expected error {expected_error} has neither message_contains nor message"
        ));
    };
    match result {
        Ok(()) => Err(format!("expected an error like {words:?}, got Ok")),
        Err(e) => {
            let msg = e.to_string();
            if let Some(phrase) = contains {
                if !msg.contains(phrase) {
                    return Err(format!("error {msg:?} does not contain {phrase:?}"));
                }
            }
            let reference = expected_error["message"].as_str().unwrap_or(words);
            if reference.contains("ids per partition") && !matches!(e, Error::LimitExceeded { .. })
            {
                return Err(format!("expected Error::LimitExceeded, got {e:?}"));
            }
            Ok(())
        }
    }
}

fn as_i64s(v: &Value, what: &str) -> Result<Vec<Option<i64>>, String> {
    v.as_array()
        .ok_or_else(|| format!("{what} is not an array"))?
        .iter()
        .map(|x| Ok(x.as_i64()))
        .collect()
}

/// Compares a successful run with the reference: the plan with `input.resolved`, then every
/// stack's sizes, row pointers, values inside `valid_ranges`, padding elsewhere, and stats.
pub fn check_output(
    input: &Value,
    expected: &Value,
    plan: &Plan,
    out: &Output,
) -> Result<(), String> {
    let resolved = plan.resolved();
    let want = &input["resolved"];
    if resolved["features"] != want["features"] {
        return Err(format!(
            "resolved features differ:\n ours {}\n want {}",
            resolved["features"], want["features"]
        ));
    }
    if resolved["stacks"] != want["stacks"] {
        return Err(format!(
            "resolved stacks differ:\n ours {}\n want {}",
            resolved["stacks"], want["stacks"]
        ));
    }
    if expected["num_minibatches"].as_u64() != Some(out.num_minibatches as u64) {
        return Err(format!(
            "num_minibatches {} vs {}",
            out.num_minibatches, expected["num_minibatches"]
        ));
    }
    let stacks = expected["stacks"]
        .as_object()
        .ok_or("expected.stacks missing")?;
    if stacks.len() != out.stacks.len() {
        return Err(format!(
            "{} stacks, expected {}",
            out.stacks.len(),
            stacks.len()
        ));
    }
    let s = plan.layout.sc_per_device;
    for (name, want) in stacks {
        let got = out
            .stack(name)
            .ok_or_else(|| format!("stack {name} missing"))?;
        let err = |what: &str| format!("stack {name}: {what}");
        if want["coo_buffer_size_per_device"].as_u64()
            != Some(got.coo_buffer_size_per_device() as u64)
        {
            return Err(err(&format!(
                "C = {} vs {}",
                got.coo_buffer_size_per_device(),
                want["coo_buffer_size_per_device"]
            )));
        }
        // Absent under minibatching, where segments are not fixed C/S slices.
        if !want["coo_buffer_size_per_sc"].is_null()
            && want["coo_buffer_size_per_sc"].as_u64()
                != Some((got.coo_buffer_size_per_device() / s) as u64)
        {
            return Err(err("coo_buffer_size_per_sc"));
        }
        if expected["row_pointers_size_per_device"].as_u64()
            != Some(got.row_pointers_per_device() as u64)
        {
            return Err(err("row_pointers_size_per_device"));
        }
        let rp = as_i64s(&want["row_pointers"], "row_pointers")?;
        if rp.len() != got.row_pointers.len() {
            return Err(err(&format!(
                "{} row pointers, expected {}",
                got.row_pointers.len(),
                rp.len()
            )));
        }
        // Under minibatching only the written pointers are compared.
        let mut rp_inside = vec![want["row_pointers_valid_ranges"].is_null(); rp.len()];
        if let Some(ranges) = want["row_pointers_valid_ranges"].as_array() {
            for r in ranges {
                let (a, b) = (
                    r[0].as_u64().ok_or("range")? as usize,
                    r[1].as_u64().ok_or("range")? as usize,
                );
                rp_inside[a.min(rp.len())..b.min(rp.len())]
                    .iter_mut()
                    .for_each(|x| *x = true);
            }
        }
        for (i, (&w, &o)) in rp.iter().zip(&got.row_pointers).enumerate() {
            if rp_inside[i] && w != Some(o as i64) {
                let ours: Vec<i32> = got.row_pointers.clone();
                return Err(err(&format!(
                    "row pointer {i}: ours {o}, want {w:?}\n ours {ours:?}\n want {rp:?}"
                )));
            }
        }

        let emb = as_i64s(&want["embedding_ids"], "embedding_ids")?;
        let smp = as_i64s(&want["sample_ids"], "sample_ids")?;
        let bits = as_i64s(&want["gains_bits"], "gains_bits")?;
        let total = got.embedding_ids.len();
        if emb.len() != total || smp.len() != total || bits.len() != total {
            return Err(err(&format!("buffer length {total} vs {}", emb.len())));
        }
        let mut inside = vec![false; total];
        for r in want["valid_ranges"].as_array().ok_or("valid_ranges")? {
            let (a, b) = (
                r[0].as_u64().ok_or("range")? as usize,
                r[1].as_u64().ok_or("range")? as usize,
            );
            if a > b || b > total {
                return Err(err(&format!(
                    "valid range [{a}, {b}) outside the buffer of {total}"
                )));
            }
            inside[a..b].iter_mut().for_each(|x| *x = true);
        }
        for i in 0..total {
            let (e, sm, g) = (
                got.embedding_ids[i] as i64,
                got.sample_ids[i] as i64,
                got.gains[i].to_bits() as i64,
            );
            if inside[i] {
                if Some(e) != emb[i] || Some(sm) != smp[i] || Some(g) != bits[i] {
                    return Err(err(&format!(
                        "slot {i}: ours (emb {e}, sample {sm}, gain bits {g:#x}) want ({:?}, {:?}, {:?})",
                        emb[i],
                        smp[i],
                        bits[i].map(|b| format!("{b:#x}"))
                    )));
                }
            } else if e != PAD_ID as i64 || sm != PAD_ID as i64 || g != PAD_GAIN_BITS as i64 {
                return Err(err(&format!(
                    "slot {i} outside valid ranges is not padding: ({e}, {sm}, {g:#x})"
                )));
            }
        }

        let st = &want["stats"];
        let cmp = |field: &str, ours: &[i32]| -> Result<(), String> {
            let want: Vec<i64> = as_i64s(&st[field], field)?
                .into_iter()
                .map(|v| v.unwrap_or(-1))
                .collect();
            let ours: Vec<i64> = ours.iter().map(|&v| v as i64).collect();
            if want != ours {
                return Err(format!(
                    "stack {name}: stats.{field} ours {ours:?} want {want:?}"
                ));
            }
            Ok(())
        };
        cmp("max_ids_per_partition", &got.stats.max_ids_per_partition)?;
        cmp(
            "max_unique_ids_per_partition",
            &got.stats.max_unique_ids_per_partition,
        )?;
        cmp(
            "required_buffer_size_per_sc",
            &got.stats.required_buffer_size_per_sc,
        )?;
        if st["dropped_id_count"].as_u64() != Some(got.stats.dropped_id_count) {
            return Err(err(&format!(
                "dropped {} vs {}",
                got.stats.dropped_id_count, st["dropped_id_count"]
            )));
        }
    }
    Ok(())
}

/// Runs `check` on every case directory under `root`, prints `label: N/N cases passed`, and
/// fails listing every failing case.
pub fn run_dir(root: &Path, label: &str, check: impl Fn(&Path) -> Result<(), String>) {
    let dirs = case_dirs(root);
    assert!(!dirs.is_empty(), "no cases under {}", root.display());
    let mut failures = Vec::new();
    for dir in &dirs {
        if let Err(e) = check(dir) {
            failures.push(format!(
                "{}: {e}",
                dir.file_name().unwrap().to_string_lossy()
            ));
        }
    }
    let passed = dirs.len() - failures.len();
    // Written to the stderr handle directly, which the test harness does not capture, so the
    // count shows in every `cargo test` run.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "{label}: {passed}/{} cases passed",
        dirs.len()
    );
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
