//! Golden cases: real outputs of the reference (jax-tpu-embedding 0.1.0), compared bit for bit.
//!
//! Runs every case directory under `../shared/golden`, and with `GOLDEN_DIR=/some/dir` also every
//! case under that directory. Each case is planned and preprocessed from `input.json` alone and
//! compared with `expected.json`: the planner with `resolved`, row pointers exactly, ids and gain
//! bits inside `valid_ranges`, the padding triple everywhere else, stats exactly, and error cases
//! by error kind and message.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sparsecore_prep::case::Case;
use sparsecore_prep::spec::{PAD_GAIN_BITS, PAD_ID};
use sparsecore_prep::{Error, Output, Preprocessor};

fn case_dirs(root: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(root).unwrap_or_else(|e| panic!("golden folder {} is missing: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("input.json").is_file() && p.join("expected.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn as_i64s(v: &Value, what: &str) -> Result<Vec<Option<i64>>, String> {
    v.as_array().ok_or_else(|| format!("{what} is not an array"))?.iter().map(|x| Ok(x.as_i64())).collect()
}

/// Runs one case; `Err` describes the first mismatch.
fn check_case(dir: &Path) -> Result<(), String> {
    let case = Case::from_path(dir).map_err(|e| format!("loading: {e}"))?;
    let expected = load_json(&dir.join("expected.json"));
    let result = Preprocessor::builder(case.config.clone())
        .global_batch_sizes(case.global_batch_sizes())
        .threads(2)
        .build()
        .and_then(|mut prep| {
            let sources = case.sources()?;
            let inputs: Vec<&dyn sparsecore_prep::input::SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
            let mut out = Output::new();
            prep.run(&inputs, &mut out)?;
            Ok((prep, out))
        });

    if let Some(err) = expected.get("error") {
        let contains = err["message_contains"].as_str().unwrap_or_default();
        return match result {
            Ok(_) => Err(format!("expected an error containing {contains:?}, got Ok")),
            Err(e) => {
                let msg = e.to_string();
                if !msg.contains(contains) {
                    return Err(format!("error {msg:?} does not contain {contains:?}"));
                }
                if contains.contains("ids per partition") && !matches!(e, Error::LimitExceeded { .. }) {
                    return Err(format!("expected Error::LimitExceeded, got {e:?}"));
                }
                Ok(())
            }
        };
    }
    let (prep, out) = result.map_err(|e| format!("preprocessing failed: {e}"))?;
    let plan = prep.plan().ok_or("no plan")?;

    // The planner.
    let resolved = plan.resolved();
    let want = &case.raw["resolved"];
    if resolved["features"] != want["features"] {
        return Err(format!("resolved features differ:\n ours {}\n want {}", resolved["features"], want["features"]));
    }
    if resolved["stacks"] != want["stacks"] {
        return Err(format!("resolved stacks differ:\n ours {}\n want {}", resolved["stacks"], want["stacks"]));
    }

    if expected["num_minibatches"].as_u64() != Some(out.num_minibatches as u64) {
        return Err(format!("num_minibatches {} vs {}", out.num_minibatches, expected["num_minibatches"]));
    }
    let stacks = expected["stacks"].as_object().ok_or("expected.stacks missing")?;
    if stacks.len() != out.stacks.len() {
        return Err(format!("{} stacks, expected {}", out.stacks.len(), stacks.len()));
    }
    let s = plan.layout.sc_per_device;
    for (name, want) in stacks {
        let got = out.stack(name).ok_or_else(|| format!("stack {name} missing"))?;
        let err = |what: &str| format!("stack {name}: {what}");
        if want["coo_buffer_size_per_device"].as_u64() != Some(got.coo_buffer_size_per_device() as u64) {
            return Err(err(&format!("C = {} vs {}", got.coo_buffer_size_per_device(), want["coo_buffer_size_per_device"])));
        }
        if want["coo_buffer_size_per_sc"].as_u64() != Some((got.coo_buffer_size_per_device() / s) as u64) {
            return Err(err("coo_buffer_size_per_sc"));
        }
        if expected["row_pointers_size_per_device"].as_u64() != Some(got.row_pointers_per_device() as u64) {
            return Err(err("row_pointers_size_per_device"));
        }
        let rp: Vec<i64> = as_i64s(&want["row_pointers"], "row_pointers")?.into_iter().map(|v| v.unwrap_or(-1)).collect();
        let ours: Vec<i64> = got.row_pointers.iter().map(|&v| v as i64).collect();
        if rp != ours {
            return Err(err(&format!("row pointers differ:\n ours {ours:?}\n want {rp:?}")));
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
            let (a, b) = (r[0].as_u64().ok_or("range")? as usize, r[1].as_u64().ok_or("range")? as usize);
            inside[a..b].iter_mut().for_each(|x| *x = true);
        }
        for i in 0..total {
            let (e, sm, g) = (got.embedding_ids[i] as i64, got.sample_ids[i] as i64, got.gains[i].to_bits() as i64);
            if inside[i] {
                if Some(e) != emb[i] || Some(sm) != smp[i] || Some(g) != bits[i] {
                    return Err(err(&format!(
                        "slot {i}: ours (emb {e}, sample {sm}, gain bits {g:#x}) want ({:?}, {:?}, {:?})",
                        emb[i], smp[i], bits[i].map(|b| format!("{b:#x}"))
                    )));
                }
            } else if e != PAD_ID as i64 || sm != PAD_ID as i64 || g != PAD_GAIN_BITS as i64 {
                return Err(err(&format!("slot {i} outside valid ranges is not padding: ({e}, {sm}, {g:#x})")));
            }
        }

        let st = &want["stats"];
        let cmp = |field: &str, ours: &[i32]| -> Result<(), String> {
            let want: Vec<i64> = as_i64s(&st[field], field)?.into_iter().map(|v| v.unwrap_or(-1)).collect();
            let ours: Vec<i64> = ours.iter().map(|&v| v as i64).collect();
            if want != ours {
                return Err(format!("stack {name}: stats.{field} ours {ours:?} want {want:?}"));
            }
            Ok(())
        };
        cmp("max_ids_per_partition", &got.stats.max_ids_per_partition)?;
        cmp("max_unique_ids_per_partition", &got.stats.max_unique_ids_per_partition)?;
        cmp("required_buffer_size_per_sc", &got.stats.required_buffer_size_per_sc)?;
        if st["dropped_id_count"].as_u64() != Some(got.stats.dropped_id_count) {
            return Err(err(&format!("dropped {} vs {}", got.stats.dropped_id_count, st["dropped_id_count"])));
        }
    }
    Ok(())
}

fn run_dir(root: &Path, label: &str) {
    let dirs = case_dirs(root);
    assert!(!dirs.is_empty(), "no golden cases under {}", root.display());
    let mut failures = Vec::new();
    for dir in &dirs {
        if let Err(e) = check_case(dir) {
            failures.push(format!("{}: {e}", dir.file_name().unwrap().to_string_lossy()));
        }
    }
    let passed = dirs.len() - failures.len();
    println!("{label}: {passed}/{} cases passed", dirs.len());
    assert!(failures.is_empty(), "{} golden case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn golden_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/golden");
    run_dir(&root, "golden");
}

#[test]
fn golden_dir_from_env() {
    if let Some(dir) = std::env::var_os("GOLDEN_DIR") {
        run_dir(Path::new(&dir), "golden (GOLDEN_DIR)");
    }
}
