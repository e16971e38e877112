//! Structured input: a small random config (layout, tables with limits, stacking, dropping,
//! minibatching) and raw ragged features (ids, weights, row splits, 32- or 64-bit) through
//! `RaggedInput` and `Preprocessor::run`. It must be `Ok` or a typed `Err`, identical on one
//! and two threads, and (without minibatching) equal to the oracle model's result.

#![no_main]

use arbitrary::Arbitrary;
use fuzz_common::{
    check_oracle, kind_of, output_bytes, run_deterministic, verbose, OUTPUT_BUDGET_BYTES,
};
use libfuzzer_sys::fuzz_target;
use sparsecore_prep::input::{Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::spec::{FeatureConfig, Options, StackLimits, Stacking, TableConfig};
use sparsecore_prep::{Config, Plan};

/// Layouts that preprocess (power-of-two N), plus raw values for the option checks.
const LAYOUTS: [(usize, usize, usize); 12] = [
    (1, 1, 1),
    (1, 1, 2),
    (1, 1, 4),
    (1, 2, 2),
    (2, 2, 1),
    (2, 2, 2),
    (1, 4, 1),
    (2, 4, 2),
    (4, 4, 1),
    (1, 2, 4),
    (2, 2, 4),
    (1, 8, 1),
];

#[derive(Arbitrary, Debug)]
enum Layout {
    Preset(u8),
    Raw { l: u8, g: u8, s: u8 },
}

#[derive(Arbitrary, Debug)]
struct Table {
    vocab: u16,
    dim: u8,
    combiner: u8,
    max_ids: u8,
    max_unique: u8,
    suggested: Option<u16>,
}

#[derive(Arbitrary, Debug)]
struct Feature {
    table: u8,
    /// Local batch = L * S * (1 + batch_mult % 3), unless `raw_batch`.
    batch_mult: u8,
    raw_batch: bool,
    rows: Vec<Vec<i32>>,
    /// Ids as given (out of range ones included) instead of reduced modulo the vocabulary.
    raw_ids: bool,
    wide: bool,
    /// Weights in sixteenths, cycled over the ids.
    weights: Option<Vec<i8>>,
    /// One weight replaced by these bits (NaN, infinities, ...).
    bad_weight: Option<(u16, u32)>,
    short_weights: bool,
    /// Row splits used as given instead of those of `rows`.
    raw_splits: Option<Vec<i16>>,
}

#[derive(Arbitrary, Debug)]
struct Case {
    layout: Layout,
    allow_id_dropping: bool,
    minibatching: bool,
    auto_stacking: bool,
    validate_ids: bool,
    stack_limits: Option<(u8, u8)>,
    tables: Vec<Table>,
    features: Vec<Feature>,
    batch_number: u16,
}

/// One feature's flat columns.
struct Columns {
    name: String,
    ids: Vec<i64>,
    splits: Vec<i64>,
    weights: Option<Vec<f32>>,
    wide: bool,
}

const MAX_FEATURES: usize = 4;
const MAX_TABLES: usize = 3;
const MAX_ROW: usize = 16;
const MAX_IDS: usize = 4096;

fn config_of(case: &Case) -> Config {
    let (l, g, s) = match case.layout {
        Layout::Preset(i) => LAYOUTS[i as usize % LAYOUTS.len()],
        Layout::Raw { l, g, s } => (l as usize % 9, g as usize % 9, s as usize % 9),
    };
    let mut tables: Vec<TableConfig> = case
        .tables
        .iter()
        .take(MAX_TABLES)
        .enumerate()
        .map(|(i, t)| TableConfig {
            name: format!("t{i}"),
            vocabulary_size: t.vocab as u64,
            embedding_dim: t.dim as u64,
            combiner: ["sum", "mean", "sqrtn", "max"][t.combiner as usize % 4].to_string(),
            max_ids_per_partition: t.max_ids as u64,
            max_unique_ids_per_partition: t.max_unique as u64,
            suggested_coo_buffer_size_per_device: t.suggested.map(u64::from),
        })
        .collect();
    if tables.is_empty() {
        tables.push(TableConfig {
            name: "t0".into(),
            vocabulary_size: 64,
            embedding_dim: 8,
            combiner: "sum".into(),
            max_ids_per_partition: 16,
            max_unique_ids_per_partition: 16,
            suggested_coo_buffer_size_per_device: None,
        });
    }
    let features = case
        .features
        .iter()
        .take(MAX_FEATURES)
        .enumerate()
        .map(|(i, f)| FeatureConfig {
            name: format!("f{i}"),
            table: tables[f.table as usize % tables.len()].name.clone(),
            column: None,
            weights_column: None,
            hash: None,
        })
        .collect();
    Config {
        config: Options {
            local_device_count: l,
            global_device_count: g,
            num_sc_per_device: s,
            allow_id_dropping: case.allow_id_dropping,
            stacking: if case.auto_stacking {
                Stacking::Auto
            } else {
                Stacking::Feature
            },
            stack_limits: case.stack_limits.map(|(a, b)| StackLimits {
                max_ids_per_partition: a as u64,
                max_unique_ids_per_partition: b as u64,
            }),
            enable_minibatching: case.minibatching,
            stack_suggested_coo_buffer_size_per_device: None,
            validate_ids: case.validate_ids,
            sharding_strategy: None,
        },
        tables,
        features,
    }
}

fn columns_of(config: &Config, case: &Case) -> Vec<Columns> {
    let o = &config.config;
    let unit = o.local_device_count.max(1) * o.num_sc_per_device.max(1);
    let mut budget = MAX_IDS;
    case.features
        .iter()
        .zip(&config.features)
        .map(|(f, fc)| {
            let vocab = config.tables[config.table_index(&fc.table).unwrap()]
                .vocabulary_size
                .max(1) as i64;
            let batch = if f.raw_batch {
                f.rows.len()
            } else {
                unit * (1 + f.batch_mult as usize % 3)
            };
            let mut ids = Vec::new();
            let mut splits = vec![0i64];
            for r in 0..batch {
                let row = f
                    .rows
                    .get(r)
                    .map(|r| &r[..r.len().min(MAX_ROW).min(budget)])
                    .unwrap_or(&[]);
                budget -= row.len();
                ids.extend(row.iter().map(|&id| {
                    if f.raw_ids {
                        id as i64
                    } else {
                        (id as i64).rem_euclid(vocab)
                    }
                }));
                splits.push(ids.len() as i64);
            }
            if let Some(raw) = &f.raw_splits {
                splits = raw.iter().map(|&v| v as i64).collect();
            }
            let weights = f.weights.as_ref().map(|w| {
                let mut v: Vec<f32> = (0..ids.len())
                    .map(|k| {
                        if w.is_empty() {
                            1.0
                        } else {
                            w[k % w.len()] as f32 / 16.0
                        }
                    })
                    .collect();
                if let Some((at, bits)) = f.bad_weight {
                    if !v.is_empty() {
                        let n = v.len();
                        v[at as usize % n] = f32::from_bits(bits);
                    }
                }
                if f.short_weights {
                    v.pop();
                }
                v
            });
            Columns {
                name: fc.name.clone(),
                ids,
                splits,
                weights,
                wide: f.wide,
            }
        })
        .collect()
}

fuzz_target!(|case: Case| {
    let config = config_of(&case);
    let columns = columns_of(&config, &case);
    let i32_columns: Vec<(Vec<i32>, Vec<i32>)> = columns
        .iter()
        .map(|c| {
            (
                c.ids.iter().map(|&v| v as i32).collect(),
                c.splits.iter().map(|&v| v as i32).collect(),
            )
        })
        .collect();
    let mut sources: Vec<RaggedInput<'_>> = Vec::new();
    for (c, (ids32, splits32)) in columns.iter().zip(&i32_columns) {
        let made = if c.wide {
            RaggedInput::new(&c.name, Ids::I64(&c.ids), Offsets::I64(&c.splits))
        } else {
            RaggedInput::new(&c.name, Ids::I32(ids32), Offsets::I32(splits32))
        };
        let made = match (made, &c.weights) {
            (Ok(r), Some(w)) => r.with_weights(&c.name, w),
            (r, _) => r,
        };
        match made {
            Ok(r) => sources.push(r),
            Err(e) => {
                assert!(
                    e.to_string().contains(&c.name),
                    "error does not name feature {}: {e}",
                    c.name
                );
                if verbose() {
                    eprintln!("fuzz outcome: input Err {}", kind_of(&e));
                }
                return;
            }
        }
    }
    let sizes: Vec<usize> = sources.iter().map(|s| s.num_samples()).collect();
    if let Ok(plan) = Plan::for_local_batches(&config, &sizes) {
        if output_bytes(&plan) > OUTPUT_BUDGET_BYTES {
            if verbose() {
                eprintln!("fuzz outcome: skipped (buffers over budget)");
            }
            return;
        }
    }
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s as &dyn SampleSource).collect();
    let ours = run_deterministic(&config, |b| b, case.batch_number as u64, &inputs);
    check_oracle(&config, &inputs, case.batch_number as u64, ours.as_ref());
});
