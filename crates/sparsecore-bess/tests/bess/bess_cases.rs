//! Every reference case of besskge (`../shared/bess/cases` beside the checkout, or under
//! `SPARSECORE_SHARED`, and `BESS_CASES_DIR` when set) must match array for array.
//!
//! The cases come only from `../shared`: besskge is not among the peer tools, so the repository
//! cannot make cases of its own. When `../shared/bess/cases` is not there the test prints that
//! it did not run them, and passes, unless `CI` is set (to anything but `""`, `0` or `false`):
//! then it fails, as every test over a shared set does (`sparsecore_testkit::sets`). A folder
//! named by `BESS_CASES_DIR` must exist, and every folder must hold cases.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{Array2, ArrayD};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sparsecore_bess::{
    BatchOptions, BatchSampler, Corruption, NegativeSampler, PartitionMode, PartitionedTriples,
    RandomNegative, SamplerKind, Sharding, TripleBasedNegative, Triples, TypeBasedNegative,
};

type R<T> = std::result::Result<T, String>;

fn words(v: &Value) -> R<Vec<u32>> {
    v["words"]
        .as_array()
        .ok_or("seed without words")?
        .iter()
        .map(|w| {
            w.as_u64()
                .map(|x| x as u32)
                .ok_or_else(|| "bad word".to_string())
        })
        .collect()
}

/// (shape, values) of an expected array; values are `None` for the sha256 form.
struct Expected {
    shape: Vec<usize>,
    data: Option<Vec<i64>>,
    sha256: Option<String>,
}

fn expected(v: &Value) -> R<Expected> {
    let shape = v["shape"]
        .as_array()
        .ok_or("array without shape")?
        .iter()
        .map(|d| d.as_u64().unwrap_or(u64::MAX) as usize)
        .collect();
    let data = v.get("data").and_then(Value::as_array).map(|a| {
        a.iter()
            .map(|x| {
                x.as_i64()
                    .or_else(|| x.as_bool().map(i64::from))
                    .unwrap_or(i64::MIN)
            })
            .collect()
    });
    let sha256 = v.get("sha256").and_then(Value::as_str).map(str::to_string);
    if data.is_none() && sha256.is_none() {
        return Err("array without data or sha256".into());
    }
    Ok(Expected {
        shape,
        data,
        sha256,
    })
}

fn sha256_hex(values: &[i64]) -> String {
    let mut h = Sha256::new();
    for v in values {
        h.update(v.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn check(name: &str, exp: &Value, shape: &[usize], got: Vec<i64>) -> R<()> {
    let e = expected(exp).map_err(|m| format!("{name}: {m}"))?;
    if e.shape != shape {
        return Err(format!("{name}: shape {shape:?}, expected {:?}", e.shape));
    }
    if let Some(d) = e.data {
        if d != got {
            let first = d
                .iter()
                .zip(&got)
                .position(|(a, b)| a != b)
                .unwrap_or(d.len().min(got.len()));
            return Err(format!(
                "{name}: values differ at flat index {first}: got {:?}, expected {:?}",
                got.get(first),
                d.get(first)
            ));
        }
    }
    if let Some(s) = e.sha256 {
        if sha256_hex(&got) != s {
            return Err(format!("{name}: sha256 differs"));
        }
    }
    Ok(())
}

fn check_nd<T: Copy + Into<i64>>(name: &str, exp: &Value, a: &ArrayD<T>) -> R<()> {
    check(name, exp, a.shape(), a.iter().map(|&x| x.into()).collect())
}

fn check_bool(name: &str, exp: &Value, a: &ArrayD<bool>) -> R<()> {
    check(
        name,
        exp,
        a.shape(),
        a.iter().map(|&x| i64::from(x)).collect(),
    )
}

fn check_2d(name: &str, exp: &Value, a: &Array2<i64>) -> R<()> {
    check(name, exp, a.shape(), a.iter().copied().collect())
}

fn check_int(name: &str, exp: &Value, got: usize) -> R<()> {
    match exp.as_u64() {
        Some(e) if e as usize == got => Ok(()),
        _ => Err(format!("{name}: got {got}, expected {exp}")),
    }
}

fn array2(v: &Value) -> R<Array2<i64>> {
    let e = expected(v)?;
    let d = e.data.ok_or("input array given as sha256")?;
    match e.shape[..] {
        [r, c] => Array2::from_shape_vec((r, c), d).map_err(|x| x.to_string()),
        _ => Err("expected a 2-D input array".into()),
    }
}

fn type_offsets(input: &Value) -> Option<Vec<i64>> {
    input["type_offsets"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_i64().unwrap_or(-1)).collect())
}

fn check_sharding(s: &Sharding, exp: &Value) -> R<()> {
    check_int(
        "max_entity_per_shard",
        &exp["max_entity_per_shard"],
        s.max_entity_per_shard(),
    )?;
    check_2d(
        "shard_and_idx_to_entity",
        &exp["shard_and_idx_to_entity"],
        &s.shard_and_idx_to_entity,
    )?;
    check(
        "entity_to_shard",
        &exp["entity_to_shard"],
        &[s.n_entity()],
        s.entity_to_shard.clone(),
    )?;
    check(
        "entity_to_idx",
        &exp["entity_to_idx"],
        &[s.n_entity()],
        s.entity_to_idx.clone(),
    )?;
    check(
        "shard_counts",
        &exp["shard_counts"],
        &[s.n_shard],
        s.shard_counts.clone(),
    )?;
    for (k, a) in [
        ("entity_type_counts", &s.entity_type_counts),
        ("entity_type_offsets", &s.entity_type_offsets),
    ] {
        match (exp.get(k), a) {
            (Some(e), Some(a)) => check_2d(k, e, a)?,
            (None, None) => {}
            _ => return Err(format!("{k}: presence differs")),
        }
    }
    Ok(())
}

fn run_case(dir: &Path) -> R<()> {
    let read = |f: &str| -> R<Value> {
        let t = std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{f}: {e}"))?;
        serde_json::from_str(&t).map_err(|e| format!("{f}: {e}"))
    };
    let input = read("input.json")?;
    let exp = read("expected.json")?;
    let e = |x: sparsecore_bess::BessError| x.to_string();
    let kind = input["kind"].as_str().ok_or("no kind")?;
    let n_entity = input["n_entity"].as_u64().ok_or("no n_entity")? as usize;
    let n_shard = input["n_shard"].as_u64().ok_or("no n_shard")? as usize;
    let offsets = type_offsets(&input);
    if kind == "sharding" {
        let s = Sharding::create(
            n_entity,
            n_shard,
            &words(&input["seed"])?,
            offsets.as_deref(),
        )
        .map_err(e)?;
        return check_sharding(&s, &exp["sharding"]);
    }
    let sharding = Arc::new(
        Sharding::create(
            n_entity,
            n_shard,
            &words(&input["sharding_seed"])?,
            offsets.as_deref(),
        )
        .map_err(e)?,
    );
    check_sharding(&sharding, &exp["sharding"])?;
    let mode = PartitionMode::parse(
        input["partition_mode"]
            .as_str()
            .ok_or("no partition_mode")?,
    )
    .map_err(e)?;
    let t = array2(&input["triples"])?;
    let triples = Triples::new(
        t.column(0).to_vec(),
        t.column(1).to_vec(),
        t.column(2).to_vec(),
    )
    .map_err(e)?;
    let mut b = PartitionedTriples::builder(sharding.clone(), mode)
        .n_relation(input["n_relation"].as_u64().ok_or("no n_relation")? as usize)
        .inverse_triples(
            input["add_inverse_triples"]
                .as_bool()
                .ok_or("no add_inverse_triples")?,
        );
    if let Some(o) = offsets {
        b = b.type_offsets(o);
    }
    if let Some(v) = input.get("neg_heads").filter(|v| !v.is_null()) {
        b = b.neg_heads(array2(v)?);
    }
    if let Some(v) = input.get("neg_tails").filter(|v| !v.is_null()) {
        b = b.neg_tails(array2(v)?);
    }
    let part = b.build(&triples).map_err(e)?;
    let ep = &exp["partition"];
    let p = part.n_partitions();
    let pshape: Vec<usize> = if mode == PartitionMode::HtShardPair {
        vec![n_shard, n_shard]
    } else {
        vec![n_shard]
    };
    check(
        "triple_counts",
        &ep["triple_counts"],
        &pshape,
        part.triple_counts.clone(),
    )?;
    check(
        "triple_offsets",
        &ep["triple_offsets"],
        &pshape,
        part.triple_offsets.clone(),
    )?;
    assert_eq!(p, pshape.iter().product::<usize>());
    check(
        "triple_sort_idx",
        &ep["triple_sort_idx"],
        &[part.len()],
        part.triple_sort_idx.clone(),
    )?;
    check_2d("triples", &ep["triples"], &part.triples)?;
    for (k, a) in [
        ("types", &part.types),
        ("neg_heads", &part.neg_heads),
        ("neg_tails", &part.neg_tails),
    ] {
        match (ep.get(k), a) {
            (Some(x), Some(a)) => check_2d(k, x, a)?,
            (None, None) => {}
            _ => return Err(format!("partition {k}: presence differs")),
        }
    }
    if kind == "partition" {
        return Ok(());
    }
    let part = Arc::new(part);
    let neg = &input["negative"];
    let corruption = Corruption::parse(
        neg["corruption_scheme"]
            .as_str()
            .ok_or("no corruption_scheme")?,
    )
    .map_err(e)?;
    let flag = |v: &Value, k: &str| v[k].as_bool().ok_or_else(|| format!("no {k}"));
    let negative = match neg["kind"].as_str() {
        Some("random") => NegativeSampler::Random(
            RandomNegative::new(
                neg["n_negative"].as_u64().ok_or("no n_negative")? as usize,
                &words(&neg["seed"])?,
                corruption,
                flag(neg, "local_sampling")?,
                flag(neg, "flat_negative_format")?,
            )
            .map_err(e)?,
        ),
        Some("type_based") => NegativeSampler::TypeBased(
            TypeBasedNegative::new(
                neg["n_negative"].as_u64().ok_or("no n_negative")? as usize,
                &words(&neg["seed"])?,
                corruption,
                flag(neg, "local_sampling")?,
            )
            .map_err(e)?,
        ),
        Some("triple_based") => {
            let tb = TripleBasedNegative::new(
                &part,
                corruption,
                flag(neg, "mask_on_gather")?,
                flag(neg, "return_sort_idx")?,
            )
            .map_err(e)?;
            let st = &exp["triple_based_state"];
            if st["flat_negative_format"].as_bool() != Some(tb.flat_negative_format) {
                return Err("triple_based_state.flat_negative_format differs".into());
            }
            let rows = tb
                .heads
                .as_ref()
                .or(tb.tails.as_ref())
                .map_or(0, |t| t.sort_idx.nrows());
            check_int("triple_based_state.N", &st["N"], rows)?;
            check_int(
                "triple_based_state.n_negative",
                &st["n_negative"],
                tb.n_negative,
            )?;
            check_int(
                "triple_based_state.padded_shard_length",
                &st["padded_shard_length"],
                tb.padded_shard_length,
            )?;
            let tables: Vec<(&str, &sparsecore_bess::negative::PaddedNegatives)> = match corruption
            {
                Corruption::H => vec![("", tb.heads.as_ref().ok_or("no heads")?)],
                Corruption::T => vec![("", tb.tails.as_ref().ok_or("no tails")?)],
                Corruption::Ht => vec![
                    ("h", tb.heads.as_ref().ok_or("no heads")?),
                    ("t", tb.tails.as_ref().ok_or("no tails")?),
                ],
            };
            for (sfx, tab) in tables {
                let (si, pn, mk) = if sfx.is_empty() {
                    (
                        "sort_neg_idx".to_string(),
                        "padded_negatives".to_string(),
                        "mask".to_string(),
                    )
                } else {
                    (
                        format!("sort_neg_{sfx}_idx"),
                        format!("padded_negatives_{sfx}"),
                        format!("mask_{sfx}"),
                    )
                };
                check(
                    &si,
                    &st[&si],
                    tab.sort_idx.shape(),
                    tab.sort_idx.iter().map(|&x| i64::from(x)).collect(),
                )?;
                check(
                    &pn,
                    &st[&pn],
                    tab.padded.shape(),
                    tab.padded.iter().copied().collect(),
                )?;
                check(
                    &mk,
                    &st[&mk],
                    tab.mask.shape(),
                    tab.mask.iter().map(|&x| i64::from(x)).collect(),
                )?;
            }
            NegativeSampler::TripleBased(Box::new(tb))
        }
        other => return Err(format!("unknown negative kind {other:?}")),
    };
    let s = &input["sampler"];
    let kind = match s["kind"].as_str() {
        Some("random") => SamplerKind::Random {
            seed_words: words(&s["seed"])?,
        },
        Some("rigid") => {
            if s.get("shuffle").and_then(Value::as_bool) == Some(true) {
                return Err("rigid with shuffle=True is not a reference case".into());
            }
            SamplerKind::Rigid { shuffle: None }
        }
        other => return Err(format!("unknown sampler kind {other:?}")),
    };
    let options = BatchOptions {
        shard_bs: s["shard_bs"].as_u64().ok_or("no shard_bs")? as usize,
        batches_per_step: s["batches_per_step"]
            .as_u64()
            .ok_or("no batches_per_step")? as usize,
        duplicate_batch: flag(s, "duplicate_batch")?,
        return_triple_idx: flag(s, "return_triple_idx")?,
        kind,
    };
    let mut sampler = BatchSampler::new(part.clone(), options, Some(negative)).map_err(e)?;
    let es = &exp["sampler"];
    check_int(
        "positive_per_partition",
        &es["positive_per_partition"],
        sampler.geometry().positive_per_partition,
    )?;
    check_int(
        "partition_sample_size",
        &es["partition_sample_size"],
        sampler.geometry().partition_sample_size,
    )?;
    check_int("len", &es["len"], sampler.len())?;
    let steps = exp["steps"].as_array().ok_or("no steps")?;
    if steps.len() as u64 != s["n_steps"].as_u64().unwrap_or(u64::MAX) {
        return Err("steps and n_steps differ".into());
    }
    let pss = sampler.geometry().partition_sample_size;
    for (k, st) in steps.iter().enumerate() {
        let idx: Vec<usize> = st["idx"]
            .as_array()
            .ok_or("no idx")?
            .iter()
            .map(|x| x.as_u64().unwrap_or(0) as usize)
            .collect();
        let step = match idx[..] {
            [i] => i,
            [a, b] if b == a + pss && a % pss == 0 => a / pss,
            _ => return Err(format!("step {k}: unexpected idx {idx:?}")),
        };
        let batch = sampler.sample(step).map_err(|x| format!("step {k}: {x}"))?;
        let out = &st["outputs"];
        let mut ours: BTreeSet<&str> = ["head", "relation", "tail"].into();
        let w = |name: &str| format!("step {k} {name}");
        check_nd(&w("head"), &out["head"], &batch.head)?;
        check_nd(&w("relation"), &out["relation"], &batch.relation)?;
        check_nd(&w("tail"), &out["tail"], &batch.tail)?;
        if let Some(m) = &batch.triple_mask {
            ours.insert("triple_mask");
            check_bool(&w("triple_mask"), &out["triple_mask"], m)?;
        }
        if let Some(a) = &batch.negative {
            ours.insert("negative");
            check_nd(&w("negative"), &out["negative"], a)?;
        }
        if let Some(m) = &batch.negative_mask {
            ours.insert("negative_mask");
            check_bool(&w("negative_mask"), &out["negative_mask"], m)?;
        }
        if let Some(a) = &batch.negative_sort_idx {
            ours.insert("negative_sort_idx");
            check_nd(&w("negative_sort_idx"), &out["negative_sort_idx"], a)?;
        }
        if let Some(a) = &batch.triple_idx {
            ours.insert("triple_idx");
            check_nd(&w("triple_idx"), &out["triple_idx"], a)?;
        }
        let theirs: BTreeSet<&str> = out
            .as_object()
            .ok_or("outputs not an object")?
            .keys()
            .map(String::as_str)
            .collect();
        if ours != theirs {
            return Err(format!(
                "step {k}: output keys {ours:?}, expected {theirs:?}"
            ));
        }
    }
    Ok(())
}

fn case_dirs(root: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("cases folder {} cannot be read: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("input.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// `bess/cases` of the shared folder (`SPARSECORE_SHARED`, else `../shared` beside the
/// checkout), if it is there; when it is not, says so (and fails under CI), as
/// `sparsecore_testkit::sets::shared_set` does for the other shared sets.
fn shared_cases() -> Option<PathBuf> {
    let (dir, shown) = match std::env::var_os("SPARSECORE_SHARED") {
        Some(shared) if !shared.is_empty() => {
            let dir = PathBuf::from(shared).join("bess/cases");
            let shown = dir.display().to_string();
            (dir, shown)
        }
        _ => (
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/bess/cases"),
            "../shared/bess/cases".to_string(),
        ),
    };
    if dir.is_dir() {
        return Some(dir);
    }
    let ci = std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "FALSE"));
    assert!(
        !ci,
        "bess cases: the shared set {shown} is missing; CI runs every shared set, so ../shared \
         must be beside the checkout (or SPARSECORE_SHARED name it)"
    );
    let _ = writeln!(
        std::io::stderr(),
        "bess cases: NOT RUN: the shared set {shown} is not there (with CI=true a missing shared \
         set fails)"
    );
    None
}

#[test]
fn bess_cases() {
    let mut roots: Vec<PathBuf> = shared_cases().into_iter().collect();
    if let Ok(extra) = std::env::var("BESS_CASES_DIR") {
        roots.push(PathBuf::from(extra));
    }
    if roots.is_empty() {
        return;
    }
    let mut total = 0;
    let mut failures = Vec::new();
    for root in &roots {
        assert!(root.is_dir(), "cases folder {} is missing", root.display());
        let dirs = case_dirs(root);
        assert!(
            !dirs.is_empty(),
            "cases folder {} holds no case",
            root.display()
        );
        for dir in dirs {
            total += 1;
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match std::panic::catch_unwind(|| run_case(&dir)) {
                Ok(Ok(())) => {}
                Ok(Err(m)) => failures.push(format!("{name}: {m}")),
                Err(_) => failures.push(format!("{name}: panicked")),
            }
        }
    }
    for f in &failures {
        println!("FAIL {f}");
    }
    println!("bess cases: {}/{} passed", total - failures.len(), total);
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed",
        failures.len()
    );
}
