//! Property tests over random device layouts, configs and batches.
//!
//! Every property compares the crate against facts that follow from SPEC Part 2, sections
//! 3.1-3.9, computed here by a deliberately naive model (nested loops, `BTreeMap`s, no 64-bit
//! sort keys):
//!
//! 1. `thread_count_invariance`: 1 thread, 2 threads and the global pool give bit-identical
//!    outputs (and identical errors); so does reusing an `Output` (4 threads) after a batch of
//!    another config and a batch of another shape, and then for that smaller batch again; and
//!    with zero tails (`TailFill::Zeros`), the same bytes up to each segment's final cursor.
//! 2. `layout_equivalence`: dense (C and Fortran order, i32 and i64), ragged (i32 and i64), Arrow
//!    `List<Int32>` (sliced), `LargeList<Int64>`, sliced `List` ids with `LargeList` weights and a
//!    `RecordBatch` give identical outputs; COO equals ragged without weights.
//! 3. `conservation`: without dropping or overflow, decoding every valid slot gives each
//!    (sample, column) pair exactly once, with the gain the naive combiner model computes.
//! 4. `structure`: row pointers, 8-alignment, the tail pointers and the padding triple.
//! 5. `stats_match_naive_counts`: max ids / max unique per partition and required buffer sizes
//!    equal naive de-duplicated counts (taken before dropping).
//! 6. `dropping_respects_limits`: with dropping, every partition keeps at most `max_ids` entries
//!    and `max_unique` distinct ids (exactly the naive kept set, with the naive drop count);
//!    without dropping an exceeded limit is `Error::LimitExceeded` with the naive observation.
//! 7. `whole_output_matches_naive_model`: every output word and every statistic equals a naive
//!    end-to-end model (including buffer overflow), and the plan's placement equals the naive
//!    stacking model.
//!
//! Scenarios: G in {1, 2, 4}, L any divisor of G, S in {1, 2, 4}; 1-3 tables (vocab 1..=300,
//! dim 4/8/16, sum/mean/sqrtn, tight or loose limits, sometimes a suggested buffer size, often a
//! small one); "feature" or "auto" stacking; 1-3 features with local batches of 1-4 times L * S
//! rows (sometimes up to L - 1 extra rows, which no SparseCore reads) of 0..=6 ids, with or
//! without weights k/16 (sometimes k/10 or k/3, whose squares round in f32), k in -32..=64.
//!
//! Cases per property: 192 / 128 / 256 / 256 / 256 / 256 / 256 (about 2 s in debug mode);
//! `PROPERTIES_CASES=n` overrides them for longer hunts (far fewer cases than the defaults can trip
//! the non-vacuity checks below). Runs use a fixed RNG seed (override with
//! `PROPTEST_RNG_SEED`) and no failure persistence, so the test leaves no files behind. Each
//! property also counts its meaningful cases (successful runs, drops, overflows, stacked
//! features, ...) and fails if there are too few, so that none passes vacuously.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow_array::types::{Float32Type, Int32Type, Int64Type};
use arrow_array::{ArrayRef, LargeListArray, ListArray, RecordBatch};
use ndarray::{Array2, ShapeBuilder};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed, TestCaseError, TestRunner};

use sparsecore_prep::input::{
    ArrowListInput, CooInput, DenseInput, Ids, Offsets, RaggedInput, SampleSource,
};
use sparsecore_prep::spec::{PAD_GAIN_BITS, PAD_ID};
use sparsecore_prep::{Config, Error, LimitKind, Output, Plan, Preprocessor, TailFill};

// ---------------------------------------------------------------------------------------------
// Scenario generation
// ---------------------------------------------------------------------------------------------

/// Names of features 0, 1, 2: not in name order, so that feature stacking's sort by name matters.
const FEATURE_NAMES: [&str; 3] = ["fz", "fa", "fm"];

/// Limits above this cannot be reached: at most 3 features * 4 samples per SC * 6 ids.
const UNREACHABLE: u64 = 72;

#[derive(Debug, Clone)]
struct TableGen {
    vocab: u64,
    dim: u64,
    combiner: Comb,
    max_ids: u64,
    max_unique: u64,
    /// Seed of the suggested COO buffer size (see `suggestion`).
    suggest: Option<u32>,
}

#[derive(Debug, Clone)]
struct FeatGen {
    table: usize,
    weighted: bool,
    /// Weights are `k / weight_div`: mostly 16 (exact squares and sums in f32), sometimes 10 or
    /// 3, whose squares and sums round, so that the f32/f64 accumulation order of the combiners
    /// is observable.
    weight_div: f32,
    /// Row length of every row in dense mode.
    valency: usize,
    /// Per row: 6 candidate (raw id, weight numerator) cells and the row length in ragged mode.
    rows: Vec<(Vec<(u32, i32)>, usize)>,
}

#[derive(Clone)]
struct Scn {
    l: usize,
    g: usize,
    s: usize,
    auto: bool,
    drop: bool,
    /// Every row of a feature has the feature's `valency` ids.
    dense: bool,
    stack_limits: Option<(u64, u64)>,
    /// Seed of the suggested sizes set by stack name under auto stacking.
    stack_suggest: Option<u32>,
    tables: Vec<TableGen>,
    feats: Vec<FeatGen>,
}

/// Compact: the layout, options, tables and the materialised rows (ids, and weights if any).
impl std::fmt::Debug for Scn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "L={} G={} S={} stacking={} allow_id_dropping={} dense={} stack_limits={:?} stack_suggest={:?}",
            self.l,
            self.g,
            self.s,
            if self.auto { "auto" } else { "feature" },
            self.drop,
            self.dense,
            self.stack_limits,
            self.stack_suggest
        )?;
        for (i, t) in self.tables.iter().enumerate() {
            writeln!(f, "  t{i}: {t:?}")?;
        }
        for (g, m) in self.feats.iter().zip(feats(self)) {
            writeln!(
                f,
                "  {} -> t{} ({} rows): ids {:?}",
                m.name,
                m.table,
                m.rows.len(),
                m.rows
            )?;
            if let Some(w) = &m.weights {
                writeln!(f, "      weights (k/{}) {:?}", g.weight_div, w)?;
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Comb {
    Sum,
    Mean,
    Sqrtn,
}

impl Comb {
    fn as_str(self) -> &'static str {
        match self {
            Comb::Sum => "sum",
            Comb::Mean => "mean",
            Comb::Sqrtn => "sqrtn",
        }
    }
}

fn limit_strat() -> impl Strategy<Value = u64> {
    prop_oneof![1 => 1u64..=10, 2 => UNREACHABLE..=200]
}

fn tight_limit_strat() -> impl Strategy<Value = u64> {
    1u64..=6
}

fn layout_strat() -> impl Strategy<Value = (usize, usize, usize)> {
    (
        prop::sample::select(vec![1usize, 2, 4]),
        prop::sample::select(vec![1usize, 2, 4]),
    )
        .prop_flat_map(|(g, s)| {
            let divisors: Vec<usize> = (1..=g).filter(|l| g % l == 0).collect();
            (prop::sample::select(divisors), Just(g), Just(s))
        })
}

fn table_strat() -> impl Strategy<Value = TableGen> {
    (
        prop_oneof![1u64..=8, 1u64..=300],
        prop::sample::select(vec![4u64, 8, 16]),
        prop::sample::select(vec![Comb::Sum, Comb::Mean, Comb::Sqrtn]),
        limit_strat(),
        limit_strat(),
        prop::option::weighted(0.3, any::<u32>()),
    )
        .prop_map(
            |(vocab, dim, combiner, max_ids, max_unique, suggest)| TableGen {
                vocab,
                dim,
                combiner,
                max_ids,
                max_unique,
                suggest,
            },
        )
}

fn scn_strat() -> impl Strategy<Value = Scn> {
    (
        layout_strat(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::option::of((limit_strat(), limit_strat())),
        prop::option::weighted(0.3, any::<u32>()),
        prop::collection::vec(table_strat(), 1..=3),
        1usize..=3,
    )
        .prop_flat_map(
            |((l, g, s), auto, drop, dense, stack_limits, stack_suggest, tables, nf)| {
                let nt = tables.len();
                let weight_div = prop::sample::select(vec![16.0f32, 16.0, 10.0, 3.0]);
                // Sometimes up to L - 1 extra rows, which no SparseCore reads (SPEC 1.5, last note).
                let extra = if l > 1 {
                    prop_oneof![3 => Just(0usize), 1 => 1..l].boxed()
                } else {
                    Just(0usize).boxed()
                };
                let feat = (
                    0..nt,
                    any::<bool>(),
                    weight_div,
                    0usize..=6,
                    1usize..=4,
                    extra,
                )
                    .prop_flat_map(move |(table, weighted, weight_div, valency, mult, extra)| {
                        let row = (
                            prop::collection::vec((0u32..300, -32i32..=64), 6),
                            0usize..=6,
                        );
                        (
                            Just((table, weighted, weight_div)),
                            Just(valency),
                            prop::collection::vec(row, mult * l * s + extra),
                        )
                    })
                    .prop_map(|((table, weighted, weight_div), valency, rows)| FeatGen {
                        table,
                        weighted,
                        weight_div,
                        valency,
                        rows,
                    });
                (
                    Just((l, g, s, auto, drop, dense, stack_limits, stack_suggest)),
                    Just(tables),
                    prop::collection::vec(feat, nf),
                )
            },
        )
        .prop_map(
            |((l, g, s, auto, drop, dense, stack_limits, stack_suggest), tables, feats)| Scn {
                l,
                g,
                s,
                auto,
                drop,
                dense,
                stack_limits,
                stack_suggest,
                tables,
                feats,
            },
        )
}

/// Limits that cannot be exceeded, no dropping, no suggested buffer sizes.
fn loosen(mut scn: Scn) -> Scn {
    scn.drop = false;
    for t in &mut scn.tables {
        t.max_ids = t.max_ids.max(UNREACHABLE);
        t.max_unique = t.max_unique.max(UNREACHABLE);
        t.suggest = None;
    }
    scn.stack_limits = scn
        .stack_limits
        .map(|(a, b)| (a.max(UNREACHABLE), b.max(UNREACHABLE)));
    scn.stack_suggest = None;
    scn
}

/// Drops the extra rows, so that every feature's batch is a multiple of L * S. Extra rows shift
/// the row offsets of the features stacked after them (a global batch that is not a multiple of
/// N), so that their rows can run past the SC's `bsps` samples and wrap around in `sample_ids`
/// (SPEC 3.3: row offsets are not validated). Properties that decode `sample_ids` back to rows
/// need the consistent layout.
fn no_extra_rows(mut scn: Scn) -> Scn {
    let k = scn.l * scn.s;
    for f in &mut scn.feats {
        let keep = f.rows.len() / k * k;
        f.rows.truncate(keep);
    }
    scn
}

/// Scenarios whose limits are all tight (1..=6).
fn tight_scn_strat() -> impl Strategy<Value = Scn> {
    (
        scn_strat(),
        prop::collection::vec((tight_limit_strat(), tight_limit_strat()), 3),
        (tight_limit_strat(), tight_limit_strat()),
        any::<bool>(),
    )
        .prop_map(|(mut scn, limits, stack_limits, no_suggest)| {
            for (t, &(a, b)) in scn.tables.iter_mut().zip(&limits) {
                t.max_ids = a;
                t.max_unique = b;
                if no_suggest {
                    t.suggest = None;
                }
            }
            scn.stack_limits = Some(stack_limits);
            if no_suggest {
                scn.stack_suggest = None;
            }
            scn
        })
}

// ---------------------------------------------------------------------------------------------
// Materialised data and inputs
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Feat {
    name: String,
    table: usize,
    rows: Vec<Vec<i32>>,
    weights: Option<Vec<Vec<f32>>>,
}

fn feats(scn: &Scn) -> Vec<Feat> {
    scn.feats
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let vocab = scn.tables[f.table].vocab;
            let len = |row_len: usize| if scn.dense { f.valency } else { row_len };
            let rows: Vec<Vec<i32>> = f
                .rows
                .iter()
                .map(|(cells, n)| {
                    cells[..len(*n)]
                        .iter()
                        .map(|&(id, _)| (id as u64 % vocab) as i32)
                        .collect()
                })
                .collect();
            let weights = f.weighted.then(|| {
                f.rows
                    .iter()
                    .map(|(cells, n)| {
                        cells[..len(*n)]
                            .iter()
                            .map(|&(_, k)| k as f32 / f.weight_div)
                            .collect()
                    })
                    .collect()
            });
            Feat {
                name: FEATURE_NAMES[i].to_string(),
                table: f.table,
                rows,
                weights,
            }
        })
        .collect()
}

fn without_weights(fs: &[Feat]) -> Vec<Feat> {
    fs.iter()
        .map(|f| Feat {
            weights: None,
            ..f.clone()
        })
        .collect()
}

/// Ragged buffers of one feature.
struct Ragged {
    ids: Vec<i32>,
    ids64: Vec<i64>,
    splits: Vec<i32>,
    splits64: Vec<i64>,
    weights: Option<Vec<f32>>,
}

fn ragged(f: &Feat) -> Ragged {
    let ids: Vec<i32> = f.rows.iter().flatten().copied().collect();
    let mut splits = vec![0i32];
    for r in &f.rows {
        splits.push(splits.last().unwrap() + r.len() as i32);
    }
    Ragged {
        ids64: ids.iter().map(|&v| v as i64).collect(),
        ids,
        splits64: splits.iter().map(|&v| v as i64).collect(),
        splits,
        weights: f
            .weights
            .as_ref()
            .map(|w| w.iter().flatten().copied().collect()),
    }
}

fn ragged_inputs<'a>(fs: &[Feat], data: &'a [Ragged], wide: bool) -> Vec<RaggedInput<'a>> {
    fs.iter()
        .zip(data)
        .map(|(f, d)| {
            let r = if wide {
                RaggedInput::from_i64(&f.name, &d.ids64, &d.splits64).unwrap()
            } else {
                RaggedInput::from_i32(&f.name, &d.ids, &d.splits).unwrap()
            };
            match &d.weights {
                Some(w) => r.with_weights(&f.name, w).unwrap(),
                None => r,
            }
        })
        .collect()
}

fn as_sources<T: SampleSource>(v: &[T]) -> Vec<&dyn SampleSource> {
    v.iter().map(|x| x as &dyn SampleSource).collect()
}

// ---------------------------------------------------------------------------------------------
// The naive stacking model (SPEC 2.6, 2.7, 3.2)
// ---------------------------------------------------------------------------------------------

fn roundup(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

/// A suggested COO buffer size per device from a seed: anywhere in `1..=theoretical` for even
/// seeds, at most `8 * S` (one aligned partition per SparseCore) for odd ones.
fn suggestion(seed: u32, theoretical: u64, s: u64) -> u64 {
    let range = if seed.is_multiple_of(2) {
        theoretical
    } else {
        theoretical.min(8 * s)
    };
    1 + (seed / 2) as u64 % range
}

#[derive(Debug, Clone)]
struct MStack {
    name: String,
    /// Features in row-offset order.
    members: Vec<usize>,
    /// Per member: global row offset, column offset, column shift.
    row_offset: Vec<u64>,
    col_offset: Vec<u32>,
    col_shift: Vec<u32>,
    comb: Comb,
    max_ids: u32,
    max_unique: u32,
    suggested: Option<u64>,
    /// C: COO slots per device.
    c: usize,
    weighted: bool,
    stack_vocab: u64,
}

fn model_stacks(scn: &Scn, fs: &[Feat]) -> Vec<MStack> {
    let n = (scn.g * scn.s) as u64;
    let s = scn.s as u64;
    let global = |f: usize| (fs[f].rows.len() * scn.g / scn.l) as u64;
    let padded_vocab = |t: usize| roundup(scn.tables[t].vocab, 8 * n);
    let theoretical = |max_ids: u64| roundup(max_ids, 8) * s * n;
    let mut tables_in_order: Vec<usize> = Vec::new();
    for f in fs {
        if !tables_in_order.contains(&f.table) {
            tables_in_order.push(f.table);
        }
    }
    let groups: Vec<Vec<usize>> = if scn.auto {
        let mut keyed: Vec<((u64, Comb), Vec<usize>)> = Vec::new();
        for &t in &tables_in_order {
            let key = (roundup(scn.tables[t].dim, 8), scn.tables[t].combiner);
            match keyed.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push(t),
                None => keyed.push((key, vec![t])),
            }
        }
        // Activations stay far below 2 MiB at these sizes, so groups are never split.
        keyed.into_iter().map(|(_, g)| g).collect()
    } else {
        tables_in_order.iter().map(|&t| vec![t]).collect()
    };

    let mut stacks = Vec::new();
    for group in groups {
        let t0 = &scn.tables[group[0]];
        let mut members: Vec<usize>;
        let mut col_offset = Vec::new();
        let mut col_shift = Vec::new();
        let (max_ids, max_unique, suggested, name, stack_vocab);
        if scn.auto {
            let mut settings = BTreeMap::new();
            let (mut in_shard, mut rot, mut vocab) = (0u64, 0u64, 0u64);
            for &t in &group {
                settings.insert(t, (in_shard, rot));
                in_shard += padded_vocab(t) / n;
                rot = (rot + s) % n;
                vocab += padded_vocab(t);
            }
            members = (0..fs.len())
                .filter(|&f| group.contains(&fs[f].table))
                .collect();
            for &f in &members {
                let (ins, rot) = settings[&fs[f].table];
                col_offset.push((ins * n) as u32);
                col_shift.push(rot as u32);
            }
            (max_ids, max_unique) = if group.len() == 1 {
                (t0.max_ids, t0.max_unique)
            } else {
                scn.stack_limits.unwrap_or((256, 256))
            };
            // Auto stacking never carries the tables' suggestions; the override by name does.
            suggested = scn
                .stack_suggest
                .map(|seed| suggestion(seed, theoretical(max_ids), s));
            name = group
                .iter()
                .map(|&t| format!("t{t}"))
                .collect::<Vec<_>>()
                .join("_");
            stack_vocab = vocab;
        } else {
            members = (0..fs.len()).filter(|&f| fs[f].table == group[0]).collect();
            members.sort_by(|&a, &b| fs[a].name.cmp(&fs[b].name));
            col_offset = vec![0; members.len()];
            col_shift = vec![0; members.len()];
            (max_ids, max_unique) = (t0.max_ids, t0.max_unique);
            suggested = t0
                .suggest
                .map(|seed| suggestion(seed, theoretical(max_ids), s));
            name = format!("t{}", group[0]);
            stack_vocab = padded_vocab(group[0]);
        }
        let mut row_offset = Vec::new();
        let mut off = 0;
        for &f in &members {
            row_offset.push(off);
            off += global(f);
        }
        let c = match suggested {
            Some(x) => roundup(x, 8 * s),
            None => theoretical(max_ids),
        } as usize;
        stacks.push(MStack {
            name,
            weighted: members.iter().any(|&f| fs[f].weights.is_some()),
            members,
            row_offset,
            col_offset,
            col_shift,
            comb: t0.combiner,
            max_ids: max_ids as u32,
            max_unique: max_unique as u32,
            suggested,
            c,
            stack_vocab,
        })
    }
    stacks
}

fn config_json(scn: &Scn, fs: &[Feat], stacks: &[MStack]) -> Config {
    let n = (scn.g * scn.s) as u64;
    let tables: Vec<serde_json::Value> = scn
        .tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({
                "name": format!("t{i}"),
                "vocabulary_size": t.vocab,
                "embedding_dim": t.dim,
                "combiner": t.combiner.as_str(),
                "max_ids_per_partition": t.max_ids,
                "max_unique_ids_per_partition": t.max_unique,
                // Under auto stacking these must be ignored (SPEC 2.7).
                "suggested_coo_buffer_size_per_device":
                    t.suggest.map(|seed| suggestion(seed, roundup(t.max_ids, 8) * scn.s as u64 * n, scn.s as u64)),
            })
        })
        .collect();
    let features: Vec<serde_json::Value> = fs
        .iter()
        .map(|f| {
            serde_json::json!({
                "name": f.name,
                "table": format!("t{}", f.table),
                "weights_column": f.weights.as_ref().map(|_| format!("{}_w", f.name)),
            })
        })
        .collect();
    let mut options = serde_json::json!({
        "local_device_count": scn.l,
        "global_device_count": scn.g,
        "num_sc_per_device": scn.s,
        "allow_id_dropping": scn.drop,
        "stacking": if scn.auto { "auto" } else { "feature" },
    });
    if let Some((a, b)) = scn.stack_limits {
        options["stack_limits"] =
            serde_json::json!({"max_ids_per_partition": a, "max_unique_ids_per_partition": b});
    }
    if scn.auto {
        let overrides: BTreeMap<String, u64> = stacks
            .iter()
            .filter_map(|st| st.suggested.map(|x| (st.name.clone(), x)))
            .collect();
        if !overrides.is_empty() {
            options["stack_suggested_coo_buffer_size_per_device"] = serde_json::json!(overrides);
        }
    }
    let doc = serde_json::json!({"config": options, "tables": tables, "features": features});
    Config::from_json(&doc.to_string()).expect("generated config parses")
}

// ---------------------------------------------------------------------------------------------
// The naive per-SparseCore model (SPEC 3.3-3.8)
// ---------------------------------------------------------------------------------------------

/// A de-duplicated (sample, column) pair of one SparseCore.
#[derive(Debug, Clone, Copy)]
struct Pair {
    row: u32,
    col: u32,
    gain: f32,
    /// Raw occurrences merged into this pair.
    occ: u64,
}

#[derive(Debug, Clone)]
struct ScModel {
    bsps: usize,
    /// (device-level row, column, gain) in extraction order.
    raw: Vec<(u32, u32, f32)>,
    /// Pairs kept by the limits (all of them without dropping).
    kept: Vec<Pair>,
    limit_dropped: u64,
}

fn row_gains(comb: Comb, weights: Option<&[f32]>, n: usize) -> Vec<f32> {
    match weights {
        None => {
            let g = match comb {
                Comb::Sum => 1.0f32,
                Comb::Mean => 1.0f32 / n as f32,
                Comb::Sqrtn => 1.0f32 / (n as f32).sqrt(),
            };
            vec![g; n]
        }
        Some(w) => match comb {
            Comb::Sum => w.to_vec(),
            Comb::Mean => {
                let mut d = 0.0f32;
                for &x in w {
                    d += x;
                }
                w.iter().map(|&x| x / d).collect()
            }
            Comb::Sqrtn => {
                let mut q = 0.0f32;
                for &x in w {
                    q = (q as f64 + (x as f64) * (x as f64)) as f32;
                }
                w.iter().map(|&x| x / q.sqrt()).collect()
            }
        },
    }
}

fn bsps(scn: &Scn, fs: &[Feat], st: &MStack) -> usize {
    st.members
        .iter()
        .map(|&f| fs[f].rows.len() / scn.l)
        .sum::<usize>()
        / scn.s
}

fn model_sc(scn: &Scn, fs: &[Feat], st: &MStack, d: usize, sc: usize) -> ScModel {
    let n = (scn.g * scn.s) as u32;
    let bsps = bsps(scn, fs, st);
    let mut raw = Vec::new();
    for (k, &f) in st.members.iter().enumerate() {
        let nsps = fs[f].rows.len() / (scn.l * scn.s);
        let start = (d * scn.s + sc) * nsps;
        let base = sc * bsps + (st.row_offset[k] / n as u64) as usize;
        for r in start..start + nsps {
            let ids = &fs[f].rows[r];
            let ones;
            let w: Option<&[f32]> = match (&fs[f].weights, st.weighted) {
                (Some(w), _) => Some(&w[r]),
                (None, true) => {
                    ones = vec![1.0f32; ids.len()];
                    Some(&ones)
                }
                (None, false) => None,
            };
            let gains = row_gains(st.comb, w, ids.len());
            for (&id, &g) in ids.iter().zip(&gains) {
                let id = id as u32;
                let col = ((id + st.col_shift[k]) % n) + (id / n) * n + st.col_offset[k];
                raw.push(((base + r - start) as u32, col, g));
            }
        }
    }
    // Output order: partition, local id, then row (unity) or extraction index (weighted).
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by_key(|&i| {
        let (row, col, _) = raw[i];
        (col % n, col / n, if st.weighted { 0 } else { row }, i)
    });
    let mut pairs: Vec<Pair> = Vec::new();
    for i in order {
        let (row, col, gain) = raw[i];
        match pairs.last_mut() {
            Some(p) if p.row == row && p.col == col => {
                p.gain += gain;
                p.occ += 1;
            }
            _ => pairs.push(Pair {
                row,
                col,
                gain,
                occ: 1,
            }),
        }
    }
    // Dropping: in each partition, keep the pairs among the first `max_ids` whose column is among
    // the first `max_unique` distinct columns.
    let mut kept = Vec::new();
    let mut limit_dropped = 0;
    let mut per_part: BTreeMap<u32, (u32, Vec<u32>)> = BTreeMap::new();
    for p in &pairs {
        let (count, cols) = per_part.entry(p.col % n).or_default();
        if cols.last() != Some(&p.col) {
            cols.push(p.col);
        }
        let keep = !scn.drop || (*count < st.max_ids && cols.len() as u32 <= st.max_unique);
        *count += 1;
        if keep {
            kept.push(*p);
        } else {
            limit_dropped += p.occ;
        }
    }
    ScModel {
        bsps,
        raw,
        kept,
        limit_dropped,
    }
}

/// Naive statistics of one SparseCore: de-duplicated pairs and distinct columns per partition.
fn naive_counts(sc: &ScModel, n: usize) -> (Vec<u32>, Vec<u32>) {
    let pairs: BTreeSet<(u32, u32)> = sc.raw.iter().map(|&(r, c, _)| (r, c)).collect();
    let mut ids = vec![0u32; n];
    let mut cols: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n];
    for &(_, c) in &pairs {
        ids[c as usize % n] += 1;
        cols[c as usize % n].insert(c);
    }
    (ids, cols.iter().map(|s| s.len() as u32).collect())
}

/// The expected segment of one SparseCore: partition p starts at roundup(end of p-1, 8), entries
/// past `cs` are dropped, and every pointer is capped at `cs`.
struct SegModel {
    rp: Vec<i32>,
    emb: Vec<i32>,
    smp: Vec<i32>,
    gains: Vec<u32>,
    overflow: u64,
}

fn model_segment(kept: &[Pair], n: usize, cs: usize, bsps: usize) -> SegModel {
    let rpb = n.max(8);
    let mut m = SegModel {
        rp: vec![0; rpb],
        emb: vec![PAD_ID; cs],
        smp: vec![PAD_ID; cs],
        gains: vec![PAD_GAIN_BITS; cs],
        overflow: 0,
    };
    let mut end = 0usize;
    for p in 0..n {
        let start = if p == 0 {
            0
        } else {
            roundup(end as u64, 8) as usize
        };
        let mut pos = start;
        for e in kept.iter().filter(|e| e.col as usize % n == p) {
            if pos < cs {
                m.emb[pos] = (e.col as usize / n) as i32;
                m.smp[pos] = (e.row as usize % bsps) as i32;
                m.gains[pos] = e.gain.to_bits();
            } else {
                m.overflow += 1;
            }
            pos += 1;
        }
        end = pos;
        m.rp[p] = end.min(cs) as i32;
    }
    let tail = (roundup(end as u64, 8) as usize).min(cs) as i32;
    for v in &mut m.rp[n..] {
        *v = tail;
    }
    m
}

// ---------------------------------------------------------------------------------------------
// Running and comparing
// ---------------------------------------------------------------------------------------------

/// Runs on `threads` (None: rayon's global pool), every batch on the threads however small.
fn run(
    cfg: &Config,
    threads: Option<usize>,
    inputs: &[&dyn SampleSource],
) -> (Result<Output, Error>, Option<Plan>) {
    let mut b = Preprocessor::builder(cfg.clone()).small_batch_ids(0);
    if let Some(t) = threads {
        b = b.threads(t);
    }
    let mut prep = b.build().expect("generated config builds");
    let mut out = Output::new();
    let r = prep.run(inputs, &mut out).map(|_| out);
    (r, prep.plan().cloned())
}

fn same_output(a: &Output, b: &Output, what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        a.num_minibatches,
        b.num_minibatches,
        "{}: num_minibatches",
        what
    );
    prop_assert_eq!(a.stacks.len(), b.stacks.len(), "{}: stack count", what);
    for (x, y) in a.stacks.iter().zip(&b.stacks) {
        prop_assert_eq!(&x.name, &y.name, "{}: stack name", what);
        prop_assert_eq!(
            x.coo_buffer_size_per_device(),
            y.coo_buffer_size_per_device(),
            "{}: C of {}",
            what,
            x.name
        );
        prop_assert_eq!(
            &x.row_pointers,
            &y.row_pointers,
            "{}: row pointers of {}",
            what,
            x.name
        );
        prop_assert_eq!(
            &x.embedding_ids,
            &y.embedding_ids,
            "{}: embedding ids of {}",
            what,
            x.name
        );
        prop_assert_eq!(
            &x.sample_ids,
            &y.sample_ids,
            "{}: sample ids of {}",
            what,
            x.name
        );
        let gx: Vec<u32> = x.gains.iter().map(|g| g.to_bits()).collect();
        let gy: Vec<u32> = y.gains.iter().map(|g| g.to_bits()).collect();
        prop_assert_eq!(gx, gy, "{}: gain bits of {}", what, x.name);
        prop_assert_eq!(&x.stats, &y.stats, "{}: stats of {}", what, x.name);
    }
    Ok(())
}

/// `out` with zeros in place of the padding past each segment's final (aligned) cursor.
fn with_zero_tails(mut out: Output, plan: &Plan) -> Output {
    let (n, rpb) = (
        plan.layout.num_partitions(),
        plan.layout.row_pointers_per_segment(),
    );
    for so in &mut out.stacks {
        let cs = so.coo_buffer_size_per_device() / plan.layout.sc_per_device;
        if cs == 0 {
            continue;
        }
        for seg in 0..so.embedding_ids.len() / cs {
            let end = so.row_pointers[seg * rpb + n - 1] as usize;
            let tail = (seg * cs + end.next_multiple_of(8).min(cs))..(seg + 1) * cs;
            so.embedding_ids[tail.clone()].fill(0);
            so.sample_ids[tail.clone()].fill(0);
            so.gains[tail].fill(0.0);
        }
    }
    out
}

fn same_result(
    a: &Result<Output, Error>,
    b: &Result<Output, Error>,
    what: &str,
) -> Result<(), TestCaseError> {
    match (a, b) {
        (Ok(x), Ok(y)) => same_output(x, y, what),
        (Err(x), Err(y)) => {
            prop_assert_eq!(
                format!("{x:?}"),
                format!("{y:?}"),
                "{}: errors differ",
                what
            );
            Ok(())
        }
        (x, y) => Err(TestCaseError::fail(format!(
            "{what}: one run failed: {:?} vs {:?}",
            x.as_ref().err(),
            y.as_ref().err()
        ))),
    }
}

fn gains_match(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
}

fn runner(cases: u32) -> TestRunner {
    // `PROPERTIES_CASES=n` runs n cases per property instead (for longer bug hunts).
    let cases = std::env::var("PROPERTIES_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let mut config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    if config.rng_seed == RngSeed::Random {
        config.rng_seed = RngSeed::Fixed(0x5c0d_e5eed);
    }
    config.max_shrink_iters = 2000;
    TestRunner::new(config)
}

fn check<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    if let Err(e) = runner(cases).run(&strategy, test) {
        panic!("property `{name}` failed: {e}");
    }
}

/// Per (stack, device, SC): the segment of the output, by slot index.
struct Seg<'a> {
    rp: &'a [i32],
    emb: &'a [i32],
    smp: &'a [i32],
    gains: &'a [f32],
}

fn segment<'a>(
    out: &'a sparsecore_prep::StackOutput,
    n: usize,
    s: usize,
    d: usize,
    sc: usize,
) -> Seg<'a> {
    let rpb = n.max(8);
    let c = out.coo_buffer_size_per_device();
    let cs = c / s;
    let rp0 = d * out.row_pointers_per_device() + sc * rpb;
    let c0 = d * c + sc * cs;
    Seg {
        rp: &out.row_pointers[rp0..rp0 + rpb],
        emb: &out.embedding_ids[c0..c0 + cs],
        smp: &out.sample_ids[c0..c0 + cs],
        gains: &out.gains[c0..c0 + cs],
    }
}

/// Slot range of partition `p` of a segment.
fn part_range(seg: &Seg<'_>, p: usize) -> std::ops::Range<usize> {
    let start = if p == 0 {
        0
    } else {
        roundup(seg.rp[p - 1] as u64, 8) as usize
    };
    start..seg.rp[p] as usize
}

// ---------------------------------------------------------------------------------------------
// 1. Thread-count invariance (and Output reuse)
// ---------------------------------------------------------------------------------------------

#[test]
fn thread_count_invariance() {
    let ok = Cell::new(0u32);
    check("thread_count_invariance", 192, scn_strat(), |scn| {
        let fs = feats(&scn);
        let stacks = model_stacks(&scn, &fs);
        let cfg = config_json(&scn, &fs, &stacks);
        let data: Vec<Ragged> = fs.iter().map(ragged).collect();
        let inputs = ragged_inputs(&fs, &data, false);
        let sources = as_sources(&inputs);
        let (one, _) = run(&cfg, Some(1), &sources);
        let (two, _) = run(&cfg, Some(2), &sources);
        let (global, _) = run(&cfg, None, &sources);
        same_result(&one, &two, "threads(1) vs threads(2)")?;
        same_result(&one, &global, "threads(1) vs global pool")?;
        let mut pooled = Preprocessor::builder(cfg.clone())
            .small_batch_ids(0)
            .threads(2)
            .build()
            .expect("generated config builds");
        let mut out = Output::new();
        let on_caller = pooled.run_on_caller_thread(&sources, &mut out).map(|_| out);
        same_result(
            &one,
            &on_caller,
            "threads(1) vs a pool of 2's run_on_caller_thread",
        )?;
        // The calling thread with a pool's threads helping (every batch through it: small-batch
        // size 0), whatever the preprocessor was built with; minibatching falls back to the pool.
        let helpers = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut out = Output::new();
        let helped = pooled.run_helped(&helpers, &sources, &mut out).map(|_| out);
        same_result(&one, &helped, "threads(1) vs run_helped with a pool of 2")?;

        // Reuse: a batch of another shape (first L*S rows of each feature, reversed), then this
        // batch, into the same Output and Preprocessor.
        let warm: Vec<Feat> = fs
            .iter()
            .map(|f| {
                let k = scn.l * scn.s;
                let mut w = f.clone();
                w.rows = f.rows[..k].iter().rev().cloned().collect();
                w.weights = f
                    .weights
                    .as_ref()
                    .map(|w| w[..k].iter().rev().cloned().collect());
                w
            })
            .collect();
        let warm_data: Vec<Ragged> = warm.iter().map(ragged).collect();
        let warm_inputs = ragged_inputs(&warm, &warm_data, false);
        // Before that, another config (the other stacking mode, dropping on, so other stacks and
        // buffer sizes) writes the same Output.
        let mut other = scn.clone();
        other.auto = !other.auto;
        other.drop = true;
        let other_cfg = config_json(&other, &fs, &model_stacks(&other, &fs));
        let mut other_prep = Preprocessor::builder(other_cfg).threads(3).build().unwrap();
        let mut out = Output::new();
        let _ = other_prep.run(&sources, &mut out);
        let mut prep = Preprocessor::builder(cfg.clone())
            .threads(4)
            .build()
            .unwrap();
        let _ = prep.run(&as_sources(&warm_inputs), &mut out);
        let reused = prep.run(&sources, &mut out).map(|_| out.clone());
        same_result(&one, &reused, "fresh vs reused Output")?;
        // Then the smaller batch again: the reused buffers pad only where the last batch wrote,
        // which must cover everything the larger batch left past this one's cursors.
        let warm_sources = as_sources(&warm_inputs);
        let (warm_fresh, warm_plan) = run(&cfg, Some(1), &warm_sources);
        let shrunk = prep.run(&warm_sources, &mut out).map(|_| out);
        same_result(
            &warm_fresh,
            &shrunk,
            "fresh vs reused Output after a larger batch",
        )?;
        // The same sequence into an Output whose tails hold zeros: the same bytes up to each
        // segment's final cursor, and zeros past it.
        let mut zeroed = Output::new().with_tail_fill(TailFill::Zeros);
        let _ = other_prep.run(&sources, &mut zeroed);
        let _ = prep.run(&sources, &mut zeroed);
        let zeroed = prep.run(&warm_sources, &mut zeroed).map(|_| zeroed);
        let want = match (warm_fresh, &warm_plan) {
            (Ok(o), Some(plan)) => Ok(with_zero_tails(o, plan)),
            (r, _) => r,
        };
        same_result(&want, &zeroed, "padded vs zero tails")?;
        if one.is_ok() {
            ok.set(ok.get() + 1);
        }
        Ok(())
    });
    eprintln!("thread_count_invariance: {} successful runs", ok.get());
    assert!(
        ok.get() >= 16,
        "too few successful runs ({}) to be meaningful",
        ok.get()
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Layout equivalence
// ---------------------------------------------------------------------------------------------

fn arrow_list_i32_sliced(rows: &[Vec<i32>]) -> ListArray {
    // A leading junk row, sliced away: offsets then start past 0.
    let junk = std::iter::once(Some(vec![Some(12345)]));
    let it = junk.chain(
        rows.iter()
            .map(|r| Some(r.iter().map(|&v| Some(v)).collect::<Vec<_>>())),
    );
    ListArray::from_iter_primitive::<Int32Type, _, _>(it).slice(1, rows.len())
}

fn arrow_weights_sliced(rows: &[Vec<f32>]) -> ListArray {
    let junk = std::iter::once(Some(vec![Some(f32::NAN)]));
    let it = junk.chain(
        rows.iter()
            .map(|r| Some(r.iter().map(|&v| Some(v)).collect::<Vec<_>>())),
    );
    ListArray::from_iter_primitive::<Float32Type, _, _>(it).slice(1, rows.len())
}

fn arrow_large_i64(rows: &[Vec<i32>]) -> LargeListArray {
    LargeListArray::from_iter_primitive::<Int64Type, _, _>(
        rows.iter()
            .map(|r| Some(r.iter().map(|&v| Some(v as i64)).collect::<Vec<_>>())),
    )
}

fn arrow_large_weights(rows: &[Vec<f32>]) -> LargeListArray {
    LargeListArray::from_iter_primitive::<Float32Type, _, _>(
        rows.iter()
            .map(|r| Some(r.iter().map(|&v| Some(v)).collect::<Vec<_>>())),
    )
}

#[test]
fn layout_equivalence() {
    let ok = Cell::new(0u32);
    let weighted = Cell::new(0u32);
    let record_batches = Cell::new(0u32);
    // Dense rows; half the time every feature has the same batch size, so that the features fit
    // one RecordBatch.
    let strat = (scn_strat(), any::<bool>()).prop_map(|(mut s, equalize)| {
        s.dense = true;
        if equalize {
            let rows = s.feats.iter().map(|f| f.rows.len()).min().unwrap();
            for f in &mut s.feats {
                f.rows.truncate(rows);
            }
        }
        s
    });
    check("layout_equivalence", 128, strat, |scn| {
        let fs = feats(&scn);
        let stacks = model_stacks(&scn, &fs);
        let cfg = config_json(&scn, &fs, &stacks);
        let data: Vec<Ragged> = fs.iter().map(ragged).collect();
        let reference = run(
            &cfg,
            Some(2),
            &as_sources(&ragged_inputs(&fs, &data, false)),
        )
        .0;

        // Ragged with 64-bit ids and splits.
        let r64 = run(&cfg, Some(2), &as_sources(&ragged_inputs(&fs, &data, true))).0;
        same_result(&reference, &r64, "ragged i32 vs ragged i64")?;

        // Dense, C order (i32) and Fortran order (i64).
        let dense_ids: Vec<Array2<i32>> = fs
            .iter()
            .map(|f| {
                let v = f.rows.first().map_or(0, |r| r.len());
                Array2::from_shape_vec(
                    (f.rows.len(), v),
                    f.rows.iter().flatten().copied().collect(),
                )
                .unwrap()
            })
            .collect();
        let dense_w: Vec<Option<Array2<f32>>> = fs
            .iter()
            .zip(&dense_ids)
            .map(|(f, a)| {
                f.weights.as_ref().map(|w| {
                    Array2::from_shape_vec(a.dim(), w.iter().flatten().copied().collect()).unwrap()
                })
            })
            .collect();
        let fortran_ids: Vec<Array2<i64>> = dense_ids
            .iter()
            .map(|a| {
                let mut f = Array2::<i64>::zeros(a.dim().f());
                f.zip_mut_with(a, |x, &y| *x = y as i64);
                f
            })
            .collect();
        let dense_c: Vec<DenseInput> = fs
            .iter()
            .zip(dense_ids.iter().zip(&dense_w))
            .map(|(f, (a, w))| {
                let d = DenseInput::from_i32(a.view());
                match w {
                    Some(w) => d.with_weights(&f.name, w.view()).unwrap(),
                    None => d,
                }
            })
            .collect();
        let dense_f: Vec<DenseInput> = fs
            .iter()
            .zip(fortran_ids.iter().zip(&dense_w))
            .map(|(f, (a, w))| {
                let d = DenseInput::from_i64(a.view());
                match w {
                    Some(w) => d.with_weights(&f.name, w.view()).unwrap(),
                    None => d,
                }
            })
            .collect();
        same_result(
            &reference,
            &run(&cfg, Some(2), &as_sources(&dense_c)).0,
            "ragged vs dense (C order, i32)",
        )?;
        same_result(
            &reference,
            &run(&cfg, Some(1), &as_sources(&dense_f)).0,
            "ragged vs dense (F order, i64)",
        )?;

        // Arrow List<Int32> (sliced) and LargeList<Int64>.
        let lists: Vec<(ListArray, Option<ListArray>)> = fs
            .iter()
            .map(|f| {
                (
                    arrow_list_i32_sliced(&f.rows),
                    f.weights.as_ref().map(|w| arrow_weights_sliced(w)),
                )
            })
            .collect();
        let arrow: Vec<ArrowListInput> = fs
            .iter()
            .zip(&lists)
            .map(|(f, (ids, w))| {
                ArrowListInput::new(
                    &f.name,
                    &f.name,
                    ids,
                    w.as_ref().map(|w| ("w", w as &dyn arrow_array::Array)),
                )
                .unwrap()
            })
            .collect();
        same_result(
            &reference,
            &run(&cfg, Some(2), &as_sources(&arrow)).0,
            "ragged vs Arrow List<Int32>",
        )?;
        let large: Vec<(LargeListArray, Option<LargeListArray>)> = fs
            .iter()
            .map(|f| {
                (
                    arrow_large_i64(&f.rows),
                    f.weights.as_ref().map(|w| arrow_large_weights(w)),
                )
            })
            .collect();
        let arrow_large: Vec<ArrowListInput> = fs
            .iter()
            .zip(&large)
            .map(|(f, (ids, w))| {
                ArrowListInput::new(
                    &f.name,
                    &f.name,
                    ids,
                    w.as_ref().map(|w| ("w", w as &dyn arrow_array::Array)),
                )
                .unwrap()
            })
            .collect();
        same_result(
            &reference,
            &run(&cfg, Some(2), &as_sources(&arrow_large)).0,
            "ragged vs Arrow LargeList<Int64>",
        )?;
        // Sliced List<Int32> ids with unsliced LargeList<Float32> weights: different offsets.
        let mixed_arrow: Vec<ArrowListInput> = fs
            .iter()
            .zip(lists.iter().zip(&large))
            .map(|(f, ((ids, _), (_, w)))| {
                ArrowListInput::new(
                    &f.name,
                    &f.name,
                    ids,
                    w.as_ref().map(|w| ("w", w as &dyn arrow_array::Array)),
                )
                .unwrap()
            })
            .collect();
        same_result(
            &reference,
            &run(&cfg, Some(2), &as_sources(&mixed_arrow)).0,
            "ragged vs Arrow List ids + LargeList weights",
        )?;

        // A RecordBatch, columns in reverse order, mapped by the config's column names.
        if fs.iter().all(|f| f.rows.len() == fs[0].rows.len()) {
            record_batches.set(record_batches.get() + 1);
            let mut columns: Vec<(String, ArrayRef)> = Vec::new();
            for (f, (ids, w)) in fs.iter().zip(&lists).rev() {
                columns.push((f.name.clone(), Arc::new(ids.clone())));
                if let Some(w) = w {
                    columns.push((format!("{}_w", f.name), Arc::new(w.clone())));
                }
            }
            let batch = RecordBatch::try_from_iter(columns).unwrap();
            let mut prep = Preprocessor::builder(cfg.clone())
                .threads(2)
                .build()
                .unwrap();
            let mut out = Output::new();
            let rb = prep.run_record_batch(&batch, &mut out).map(|_| out);
            same_result(&reference, &rb, "ragged vs RecordBatch")?;
        }

        // COO (unweighted; position column gaps are ignored) vs ragged without weights.
        let plain = without_weights(&fs);
        let plain_stacks = model_stacks(&scn, &plain);
        let plain_cfg = config_json(&scn, &plain, &plain_stacks);
        let plain_data: Vec<Ragged> = plain.iter().map(ragged).collect();
        let plain_ref = run(
            &plain_cfg,
            Some(2),
            &as_sources(&ragged_inputs(&plain, &plain_data, false)),
        )
        .0;
        let coo: Vec<(Vec<i64>, Vec<i32>)> = plain
            .iter()
            .map(|f| {
                let mut idx = Vec::new();
                let mut vals = Vec::new();
                for (r, row) in f.rows.iter().enumerate() {
                    for (k, &id) in row.iter().enumerate() {
                        idx.extend([r as i64, 3 * k as i64 + 1]);
                        vals.push(id);
                    }
                }
                (idx, vals)
            })
            .collect();
        let coo_inputs: Vec<CooInput> = plain
            .iter()
            .zip(&coo)
            .map(|(f, (idx, vals))| {
                CooInput::new(&f.name, idx, Ids::I32(vals), f.rows.len()).unwrap()
            })
            .collect();
        same_result(
            &plain_ref,
            &run(&plain_cfg, Some(2), &as_sources(&coo_inputs)).0,
            "ragged vs COO",
        )?;
        // RaggedInput::new with explicit 64-bit offsets and 32-bit ids.
        let mixed: Vec<RaggedInput> = plain
            .iter()
            .zip(&plain_data)
            .map(|(f, d)| {
                RaggedInput::new(&f.name, Ids::I32(&d.ids), Offsets::I64(&d.splits64)).unwrap()
            })
            .collect();
        same_result(
            &plain_ref,
            &run(&plain_cfg, Some(1), &as_sources(&mixed)).0,
            "ragged vs ragged (i64 offsets)",
        )?;

        if reference.is_ok() {
            ok.set(ok.get() + 1);
            if fs.iter().any(|f| f.weights.is_some()) {
                weighted.set(weighted.get() + 1);
            }
        }
        Ok(())
    });
    eprintln!(
        "layout_equivalence: ok {}, weighted {}, record batches {}",
        ok.get(),
        weighted.get(),
        record_batches.get()
    );
    assert!(
        ok.get() >= 12 && weighted.get() >= 4 && record_batches.get() >= 12,
        "too few meaningful runs ({}, weighted {}, record batches {})",
        ok.get(),
        weighted.get(),
        record_batches.get()
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Conservation
// ---------------------------------------------------------------------------------------------

#[test]
fn conservation() {
    let stacked = Cell::new(0u32);
    let merged = Cell::new(0u32);
    check(
        "conservation",
        256,
        scn_strat().prop_map(loosen).prop_map(no_extra_rows),
        |scn| {
            let fs = feats(&scn);
            let stacks = model_stacks(&scn, &fs);
            let cfg = config_json(&scn, &fs, &stacks);
            let data: Vec<Ragged> = fs.iter().map(ragged).collect();
            let (out, _) = run(
                &cfg,
                Some(2),
                &as_sources(&ragged_inputs(&fs, &data, false)),
            );
            let out = out.map_err(|e| TestCaseError::fail(format!("unexpected error: {e}")))?;
            let (n, s) = (scn.g * scn.s, scn.s);
            for st in &stacks {
                let so = out
                    .stack(&st.name)
                    .ok_or_else(|| TestCaseError::fail(format!("no stack {}", st.name)))?;
                prop_assert_eq!(so.stats.dropped_id_count, 0);
                if st.members.len() > 1 {
                    stacked.set(stacked.get() + 1);
                }
                for d in 0..scn.l {
                    for sc in 0..s {
                        let m = model_sc(&scn, &fs, st, d, sc);
                        // Naive: (row, col) -> gain summed in extraction order (= sorted order).
                        let mut want: BTreeMap<(u32, u32), f32> = BTreeMap::new();
                        for &(row, col, g) in &m.raw {
                            want.entry((row, col)).and_modify(|x| *x += g).or_insert(g);
                        }
                        if want.len() < m.raw.len() {
                            merged.set(merged.get() + 1);
                        }
                        let seg = segment(so, n, s, d, sc);
                        let mut got: BTreeMap<(u32, u32), f32> = BTreeMap::new();
                        for p in 0..n {
                            let mut prev: Option<(i32, i32)> = None;
                            for i in part_range(&seg, p) {
                                let (e, smp) = (seg.emb[i], seg.smp[i]);
                                prop_assert!(
                                    e >= 0 && e != PAD_ID && smp >= 0 && (smp as usize) < m.bsps,
                                    "{} d{} s{} slot {}: emb {} sample {}",
                                    st.name,
                                    d,
                                    sc,
                                    i,
                                    e,
                                    smp
                                );
                                // Sorted by local id, then sample; pairs are unique.
                                prop_assert!(
                                    prev < Some((e, smp)),
                                    "{} d{} s{} p{}: order {:?} then {:?}",
                                    st.name,
                                    d,
                                    sc,
                                    p,
                                    prev,
                                    (e, smp)
                                );
                                prev = Some((e, smp));
                                let key = (
                                    (sc * m.bsps) as u32 + smp as u32,
                                    e as u32 * n as u32 + p as u32,
                                );
                                prop_assert!(
                                    got.insert(key, seg.gains[i]).is_none(),
                                    "pair {:?} twice",
                                    key
                                );
                            }
                        }
                        prop_assert_eq!(
                            got.keys().collect::<Vec<_>>(),
                            want.keys().collect::<Vec<_>>(),
                            "{} d{} s{}: (sample, column) pairs",
                            st.name,
                            d,
                            sc
                        );
                        for (k, &g) in &got {
                            prop_assert!(
                                gains_match(g, want[k]),
                                "{} d{} s{} pair {:?}: gain {} (bits {:#x}), want {} (bits {:#x})",
                                st.name,
                                d,
                                sc,
                                k,
                                g,
                                g.to_bits(),
                                want[k],
                                want[k].to_bits()
                            );
                        }
                    }
                }
            }
            Ok(())
        },
    );
    eprintln!(
        "conservation: stacked {}, merging {}",
        stacked.get(),
        merged.get()
    );
    assert!(
        stacked.get() >= 4 && merged.get() >= 4,
        "too few stacked ({}) / merging ({}) cases",
        stacked.get(),
        merged.get()
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Structure
// ---------------------------------------------------------------------------------------------

#[test]
fn structure() {
    let overflowed = Cell::new(0u32);
    let strat = scn_strat().prop_map(|mut s| {
        s.drop = true;
        s
    });
    check("structure", 256, strat, |scn| {
        let fs = feats(&scn);
        let stacks = model_stacks(&scn, &fs);
        let cfg = config_json(&scn, &fs, &stacks);
        let data: Vec<Ragged> = fs.iter().map(ragged).collect();
        let (out, plan) = run(
            &cfg,
            Some(2),
            &as_sources(&ragged_inputs(&fs, &data, false)),
        );
        let out = out.map_err(|e| TestCaseError::fail(format!("unexpected error: {e}")))?;
        let plan = plan.unwrap();
        let (n, s) = (scn.g * scn.s, scn.s);
        let rpb = n.max(8);
        for (sp, so) in plan.stacks.iter().zip(&out.stacks) {
            let c = so.coo_buffer_size_per_device();
            let cs = c / s;
            prop_assert_eq!(c % (8 * s), 0);
            prop_assert_eq!(so.row_pointers.len(), scn.l * rpb * s);
            prop_assert_eq!(so.embedding_ids.len(), scn.l * c);
            prop_assert_eq!(so.sample_ids.len(), scn.l * c);
            prop_assert_eq!(so.gains.len(), scn.l * c);
            let st = stacks.iter().find(|m| m.name == sp.name).unwrap();
            let bsps = bsps(&scn, &fs, st);
            let local_rows = sp.stack_vocab_size / n as u64;
            for d in 0..scn.l {
                for sc in 0..s {
                    let seg = segment(so, n, s, d, sc);
                    let mut inside = vec![false; cs];
                    for p in 0..n {
                        let start = if p == 0 {
                            0
                        } else {
                            roundup(seg.rp[p - 1] as u64, 8) as i32
                        };
                        prop_assert!(
                            seg.rp[p] >= start && seg.rp[p] as usize <= cs,
                            "{} d{} s{}: rp[{}] = {} with start {} (Cs {}); rp {:?}",
                            sp.name,
                            d,
                            sc,
                            p,
                            seg.rp[p],
                            start,
                            cs,
                            seg.rp
                        );
                        for i in part_range(&seg, p) {
                            inside[i] = true;
                            prop_assert!(
                                seg.emb[i] >= 0 && (seg.emb[i] as u64) < local_rows,
                                "emb {} at {}",
                                seg.emb[i],
                                i
                            );
                            prop_assert!(
                                seg.smp[i] >= 0 && (seg.smp[i] as usize) < bsps,
                                "sample {} at {}",
                                seg.smp[i],
                                i
                            );
                        }
                    }
                    let tail = (roundup(seg.rp[n - 1] as u64, 8) as usize).min(cs) as i32;
                    for q in n..rpb {
                        prop_assert_eq!(seg.rp[q], tail, "{} d{} s{}: rp[{}]", sp.name, d, sc, q);
                    }
                    if seg.rp[n - 1] as usize == cs && bsps > 0 {
                        overflowed.set(overflowed.get() + 1);
                    }
                    for i in (0..cs).filter(|&i| !inside[i]) {
                        prop_assert!(
                            seg.emb[i] == PAD_ID
                                && seg.smp[i] == PAD_ID
                                && seg.gains[i].to_bits() == PAD_GAIN_BITS,
                            "{} d{} s{} slot {} outside partitions: ({}, {}, {:#x})",
                            sp.name,
                            d,
                            sc,
                            i,
                            seg.emb[i],
                            seg.smp[i],
                            seg.gains[i].to_bits()
                        );
                    }
                }
            }
        }
        Ok(())
    });
    eprintln!("structure: full segments {}", overflowed.get());
    assert!(overflowed.get() >= 1, "no case filled a segment to the end");
}

// ---------------------------------------------------------------------------------------------
// 5. Statistics
// ---------------------------------------------------------------------------------------------

/// Naive stats of a stack: (max_ids [L*N], max_unique [L*N], required [L*S]).
fn naive_stats(scn: &Scn, fs: &[Feat], st: &MStack) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let (n, s) = (scn.g * scn.s, scn.s);
    let mut max_ids = vec![0i32; scn.l * n];
    let mut max_unique = vec![0i32; scn.l * n];
    let mut required = vec![0i32; scn.l * s];
    for d in 0..scn.l {
        for sc in 0..s {
            let m = model_sc(scn, fs, st, d, sc);
            let (ids, uniq) = naive_counts(&m, n);
            for g in 0..n {
                max_ids[d * n + g] = max_ids[d * n + g].max(ids[g] as i32);
                max_unique[d * n + g] = max_unique[d * n + g].max(uniq[g] as i32);
            }
            required[d * s + sc] = ids.iter().map(|&c| roundup(c as u64, 8) as i32).sum();
        }
    }
    (max_ids, max_unique, required)
}

#[test]
fn stats_match_naive_counts() {
    let dropped_cases = Cell::new(0u32);
    let ok = Cell::new(0u32);
    check("stats_match_naive_counts", 256, scn_strat(), |scn| {
        let fs = feats(&scn);
        let stacks = model_stacks(&scn, &fs);
        let cfg = config_json(&scn, &fs, &stacks);
        let data: Vec<Ragged> = fs.iter().map(ragged).collect();
        let (out, _) = run(
            &cfg,
            Some(2),
            &as_sources(&ragged_inputs(&fs, &data, false)),
        );
        let naive: Vec<_> = stacks.iter().map(|st| naive_stats(&scn, &fs, st)).collect();
        let exceeded = stacks.iter().zip(&naive).any(|(st, (ids, uniq, _))| {
            ids.iter().any(|&v| v as u32 > st.max_ids)
                || uniq.iter().any(|&v| v as u32 > st.max_unique)
        });
        if !scn.drop && exceeded {
            prop_assert!(
                matches!(out, Err(Error::LimitExceeded { .. })),
                "expected LimitExceeded, got {:?}",
                out.err()
            );
            return Ok(());
        }
        let out = out.map_err(|e| TestCaseError::fail(format!("unexpected error: {e}")))?;
        ok.set(ok.get() + 1);
        for (st, (ids, uniq, req)) in stacks.iter().zip(&naive) {
            let so = out.stack(&st.name).unwrap();
            prop_assert_eq!(
                &so.stats.max_ids_per_partition,
                ids,
                "{}: max_ids_per_partition",
                st.name
            );
            prop_assert_eq!(
                &so.stats.max_unique_ids_per_partition,
                uniq,
                "{}: max_unique_ids_per_partition",
                st.name
            );
            prop_assert_eq!(
                &so.stats.required_buffer_size_per_sc,
                req,
                "{}: required_buffer_size_per_sc",
                st.name
            );
            if so.stats.dropped_id_count > 0 {
                dropped_cases.set(dropped_cases.get() + 1);
            }
        }
        Ok(())
    });
    eprintln!(
        "stats_match_naive_counts: ok {}, with drops {}",
        ok.get(),
        dropped_cases.get()
    );
    assert!(
        ok.get() >= 16 && dropped_cases.get() >= 4,
        "too few meaningful cases (ok {}, with drops {})",
        ok.get(),
        dropped_cases.get()
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Dropping and limit errors
// ---------------------------------------------------------------------------------------------

#[test]
fn dropping_respects_limits() {
    let dropping = Cell::new(0u32);
    let errors = Cell::new(0u32);
    check(
        "dropping_respects_limits",
        256,
        tight_scn_strat().prop_map(no_extra_rows),
        |scn| {
            let fs = feats(&scn);
            let stacks = model_stacks(&scn, &fs);
            let cfg = config_json(&scn, &fs, &stacks);
            let data: Vec<Ragged> = fs.iter().map(ragged).collect();
            let (out, _) = run(
                &cfg,
                Some(2),
                &as_sources(&ragged_inputs(&fs, &data, false)),
            );
            let (n, s) = (scn.g * scn.s, scn.s);

            if !scn.drop {
                // The first stack (plan order) with an exceeded limit is reported; within it, the
                // first SparseCore (device-major) that exceeds one, ids before unique, with that
                // SparseCore's own largest count (as the reference checks them).
                let mut want: Option<(String, LimitKind, u32, u32)> = None;
                'stacks: for st in &stacks {
                    for d in 0..scn.l {
                        for sc in 0..s {
                            let (ids, uniq) = naive_counts(&model_sc(&scn, &fs, st, d, sc), n);
                            let (mi, mu) = (
                                ids.iter().copied().max().unwrap_or(0),
                                uniq.iter().copied().max().unwrap_or(0),
                            );
                            if mi > st.max_ids {
                                want = Some((st.name.clone(), LimitKind::MaxIds, mi, st.max_ids));
                            } else if mu > st.max_unique {
                                want = Some((
                                    st.name.clone(),
                                    LimitKind::MaxUniqueIds,
                                    mu,
                                    st.max_unique,
                                ));
                            }
                            if want.is_some() {
                                break 'stacks;
                            }
                        }
                    }
                }
                match (want, out) {
                    (None, Ok(_)) => {}
                    (
                        Some((name, kind, obs, lim)),
                        Err(Error::LimitExceeded {
                            stack,
                            kind: k,
                            observed,
                            limit,
                            device,
                            sparsecore: sc,
                            partition,
                        }),
                    ) => {
                        errors.set(errors.get() + 1);
                        prop_assert_eq!((&stack, k, observed, limit), (&name, kind, obs, lim));
                        // The location is one where the observed count occurs.
                        let st = stacks.iter().find(|m| m.name == name).unwrap();
                        let m = model_sc(&scn, &fs, st, device, sc);
                        let (ids, uniq) = naive_counts(&m, n);
                        let at = if kind == LimitKind::MaxIds {
                            ids[partition]
                        } else {
                            uniq[partition]
                        };
                        prop_assert_eq!(
                            at,
                            observed,
                            "count at device {} sc {} partition {}",
                            device,
                            sc,
                            partition
                        );
                    }
                    (w, o) => {
                        return Err(TestCaseError::fail(format!(
                            "expected {w:?}, got {:?}",
                            o.map(|_| "Ok")
                        )))
                    }
                }
                return Ok(());
            }

            let out = out.map_err(|e| TestCaseError::fail(format!("unexpected error: {e}")))?;
            for st in &stacks {
                let so = out.stack(&st.name).unwrap();
                let cs = so.coo_buffer_size_per_device() / s;
                let mut naive_dropped = 0u64;
                for d in 0..scn.l {
                    for sc in 0..s {
                        let m = model_sc(&scn, &fs, st, d, sc);
                        let seg = segment(so, n, s, d, sc);
                        let mut got: BTreeSet<(u32, u32)> = BTreeSet::new();
                        for p in 0..n {
                            let r = part_range(&seg, p);
                            let distinct: BTreeSet<i32> = r.clone().map(|i| seg.emb[i]).collect();
                            prop_assert!(
                                r.len() as u32 <= st.max_ids,
                                "{} d{} s{} p{}: {} entries > max_ids {}",
                                st.name,
                                d,
                                sc,
                                p,
                                r.len(),
                                st.max_ids
                            );
                            prop_assert!(
                                distinct.len() as u32 <= st.max_unique,
                                "{} d{} s{} p{}: {} distinct ids > max_unique {}",
                                st.name,
                                d,
                                sc,
                                p,
                                distinct.len(),
                                st.max_unique
                            );
                            for i in r {
                                got.insert((
                                    (sc * m.bsps) as u32 + seg.smp[i] as u32,
                                    seg.emb[i] as u32 * n as u32 + p as u32,
                                ));
                            }
                        }
                        let kept: BTreeSet<(u32, u32)> =
                            m.kept.iter().map(|p| (p.row, p.col)).collect();
                        prop_assert!(
                            got.is_subset(&kept),
                            "{} d{} s{}: output holds pairs that the limits drop",
                            st.name,
                            d,
                            sc
                        );
                        let written = got.len() as u64;
                        let mut per_part = vec![0u64; n];
                        for p in &m.kept {
                            per_part[p.col as usize % n] += 1;
                        }
                        if per_part.iter().map(|&c| roundup(c, 8)).sum::<u64>() <= cs as u64 {
                            // Cannot overflow: exactly the naive kept set.
                            prop_assert_eq!(&got, &kept, "{} d{} s{}: kept pairs", st.name, d, sc);
                        }
                        naive_dropped += m.limit_dropped + (kept.len() as u64 - written);
                        if m.limit_dropped > 0 {
                            dropping.set(dropping.get() + 1);
                        }
                    }
                }
                prop_assert_eq!(
                    so.stats.dropped_id_count,
                    naive_dropped,
                    "{}: dropped_id_count",
                    st.name
                );
            }
            Ok(())
        },
    );
    eprintln!(
        "dropping_respects_limits: dropping SCs {}, limit errors {}",
        dropping.get(),
        errors.get()
    );
    assert!(
        dropping.get() >= 8 && errors.get() >= 8,
        "too few dropping ({}) / error ({}) cases",
        dropping.get(),
        errors.get()
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Whole output against the naive end-to-end model
// ---------------------------------------------------------------------------------------------

#[test]
fn whole_output_matches_naive_model() {
    let ok = Cell::new(0u32);
    let overflow = Cell::new(0u32);
    check(
        "whole_output_matches_naive_model",
        256,
        scn_strat(),
        |scn| {
            let fs = feats(&scn);
            let stacks = model_stacks(&scn, &fs);
            let cfg = config_json(&scn, &fs, &stacks);
            let data: Vec<Ragged> = fs.iter().map(ragged).collect();
            let (out, plan) = run(
                &cfg,
                Some(2),
                &as_sources(&ragged_inputs(&fs, &data, false)),
            );
            let plan = plan.unwrap();
            let (n, s) = (scn.g * scn.s, scn.s);

            // The plan equals the naive stacking model.
            prop_assert_eq!(
                plan.stacks
                    .iter()
                    .map(|p| p.name.clone())
                    .collect::<Vec<_>>(),
                stacks.iter().map(|m| m.name.clone()).collect::<Vec<_>>()
            );
            for (p, m) in plan.stacks.iter().zip(&stacks) {
                prop_assert_eq!(&p.features, &m.members, "{}: members", m.name);
                prop_assert_eq!(p.coo_buffer_size_per_device, m.c, "{}: C", m.name);
                prop_assert_eq!(
                    (p.max_ids_per_partition, p.max_unique_ids_per_partition),
                    (m.max_ids, m.max_unique)
                );
                prop_assert_eq!(p.stack_vocab_size, m.stack_vocab);
                for (k, &f) in m.members.iter().enumerate() {
                    let fp = &plan.features[f];
                    prop_assert_eq!(
                        (fp.row_offset, fp.col_offset, fp.col_shift),
                        (m.row_offset[k], m.col_offset[k], m.col_shift[k]),
                        "feature {}",
                        fp.name
                    );
                }
            }

            let exceeded = stacks.iter().any(|st| {
                let (ids, uniq, _) = naive_stats(&scn, &fs, st);
                ids.iter().any(|&v| v as u32 > st.max_ids)
                    || uniq.iter().any(|&v| v as u32 > st.max_unique)
            });
            if !scn.drop && exceeded {
                prop_assert!(
                    matches!(out, Err(Error::LimitExceeded { .. })),
                    "expected LimitExceeded, got {:?}",
                    out.err()
                );
                return Ok(());
            }
            let out = out.map_err(|e| TestCaseError::fail(format!("unexpected error: {e}")))?;
            ok.set(ok.get() + 1);
            for st in &stacks {
                let so = out.stack(&st.name).unwrap();
                let cs = st.c / s;
                let mut dropped = 0;
                for d in 0..scn.l {
                    for sc in 0..s {
                        let m = model_sc(&scn, &fs, st, d, sc);
                        let want = model_segment(&m.kept, n, cs, m.bsps);
                        if want.overflow > 0 {
                            overflow.set(overflow.get() + 1);
                        }
                        dropped += m.limit_dropped + want.overflow;
                        let seg = segment(so, n, s, d, sc);
                        prop_assert_eq!(
                            seg.rp,
                            &want.rp[..],
                            "{} d{} s{}: row pointers",
                            st.name,
                            d,
                            sc
                        );
                        prop_assert_eq!(
                            seg.emb,
                            &want.emb[..],
                            "{} d{} s{}: embedding ids",
                            st.name,
                            d,
                            sc
                        );
                        prop_assert_eq!(
                            seg.smp,
                            &want.smp[..],
                            "{} d{} s{}: sample ids",
                            st.name,
                            d,
                            sc
                        );
                        for (i, (&g, &w)) in seg.gains.iter().zip(&want.gains).enumerate() {
                            prop_assert!(
                                gains_match(g, f32::from_bits(w)),
                                "{} d{} s{} slot {}: gain bits {:#x}, want {:#x}",
                                st.name,
                                d,
                                sc,
                                i,
                                g.to_bits(),
                                w
                            );
                        }
                    }
                }
                prop_assert_eq!(
                    so.stats.dropped_id_count,
                    dropped,
                    "{}: dropped_id_count",
                    st.name
                );
                let (ids, uniq, req) = naive_stats(&scn, &fs, st);
                prop_assert_eq!(&so.stats.max_ids_per_partition, &ids);
                prop_assert_eq!(&so.stats.max_unique_ids_per_partition, &uniq);
                prop_assert_eq!(&so.stats.required_buffer_size_per_sc, &req);
            }
            Ok(())
        },
    );
    eprintln!(
        "whole_output_matches_naive_model: ok {}, overflowing SCs {}",
        ok.get(),
        overflow.get()
    );
    assert!(
        ok.get() >= 16 && overflow.get() >= 2,
        "too few meaningful cases (ok {}, overflow {})",
        ok.get(),
        overflow.get()
    );
}
