//! Cases with inline data: the golden `input.json` format (SPEC Part 1, 1.1 and
//! `golden/README.md`), used by the golden tests, the `demo` command and side-by-side checks.
//!
//! A case is a config whose features also carry their ids inline (`ragged`, `dense` or `coo`
//! layout) with their local and global batch sizes. Loading one gives owned arrays and
//! [`SampleSource`] views over them.

use std::path::Path;

use ndarray::Array2;
use serde::Deserialize;
use serde_json::Value;

use sparsecore_prep::input::{CooInput, DenseInput, Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::spec::Config;
use sparsecore_prep::{Error, Result};

/// One feature's inline data, owned.
#[derive(Debug, Clone)]
pub enum CaseData {
    /// Ragged rows.
    Ragged {
        /// Flat ids.
        values: Vec<i64>,
        /// Row splits (rows + 1).
        row_splits: Vec<i64>,
        /// Flat weights, one per id.
        weights: Option<Vec<f32>>,
    },
    /// A dense `[batch, valency]` array.
    Dense {
        /// Ids.
        ids: Array2<i64>,
        /// Weights of the same shape.
        weights: Option<Array2<f32>>,
    },
    /// Sparse COO.
    Coo {
        /// Flattened `[nnz, 2]` indices.
        indices: Vec<i64>,
        /// Ids.
        values: Vec<i64>,
        /// `dense_shape[0]`.
        batch: usize,
    },
}

/// A feature of a case: its config entry, its batch sizes and its data.
#[derive(Debug, Clone)]
pub struct CaseFeature {
    /// Name (as in the config).
    pub name: String,
    /// Samples on this host.
    pub local_batch_size: usize,
    /// Samples across all hosts.
    pub global_batch_size: usize,
    /// The ids (and weights).
    pub data: CaseData,
}

impl CaseFeature {
    /// A borrowed view for the pipeline.
    pub fn source(&self) -> Result<Box<dyn SampleSource + '_>> {
        Ok(match &self.data {
            CaseData::Ragged {
                values,
                row_splits,
                weights,
            } => {
                let r = RaggedInput::new(&self.name, Ids::I64(values), Offsets::I64(row_splits))?;
                match weights {
                    Some(w) => Box::new(r.with_weights(&self.name, w)?),
                    None => Box::new(r),
                }
            }
            CaseData::Dense { ids, weights } => {
                let d = DenseInput::from_i64(ids.view());
                match weights {
                    Some(w) => Box::new(d.with_weights(&self.name, w.view())?),
                    None => Box::new(d),
                }
            }
            CaseData::Coo {
                indices,
                values,
                batch,
            } => Box::new(CooInput::new(
                &self.name,
                indices,
                Ids::I64(values),
                *batch,
            )?),
        })
    }
}

/// A loaded case: the config, the inline feature data, and the whole `input.json` (for the
/// `resolved` block and anything else a checker needs).
#[derive(Debug, Clone)]
pub struct Case {
    /// The config part.
    pub config: Config,
    /// Feature data, in config order.
    pub features: Vec<CaseFeature>,
    /// The raw document.
    pub raw: Value,
}

#[derive(Deserialize)]
struct RawFeature {
    name: String,
    #[serde(default)]
    layout: Option<String>,
    local_batch_size: usize,
    global_batch_size: usize,
    #[serde(default)]
    ids: Option<Vec<Vec<i64>>>,
    #[serde(default)]
    weights: Option<Vec<Vec<f32>>>,
    #[serde(default)]
    indices: Option<Vec<[i64; 2]>>,
    #[serde(default)]
    values: Option<Vec<i64>>,
    #[serde(default)]
    dense_shape: Option<Vec<i64>>,
}

impl Case {
    /// Reads `input.json` of a case directory (or a JSON file directly).
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join("input.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|source| Error::Io {
            context: format!("reading case {}", file.display()),
            source,
        })?;
        Self::from_json(&text).map_err(|e| match e {
            Error::Json { source, .. } => Error::Json {
                context: format!("case {}", file.display()),
                source,
            },
            other => other,
        })
    }

    /// Parses a case from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let json_err = |source| Error::Json {
            context: "case".into(),
            source,
        };
        let raw: Value = serde_json::from_str(text).map_err(json_err)?;
        let config: Config = serde_json::from_value(raw.clone()).map_err(json_err)?;
        let raw_features: Vec<RawFeature> =
            serde_json::from_value(raw.get("features").cloned().unwrap_or(Value::Null))
                .map_err(json_err)?;
        // A case records whether the reference got weights; features without them get none.
        let weighted = raw
            .pointer("/config/weights")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let features = raw_features
            .into_iter()
            .map(|f| parse_feature(f, weighted))
            .collect::<Result<Vec<_>>>()?;
        if features.len() != config.features.len() {
            return Err(Error::InputCount {
                expected: config.features.len(),
                got: features.len(),
            });
        }
        Ok(Case {
            config,
            features,
            raw,
        })
    }

    /// Views of every feature, in config order.
    pub fn sources(&self) -> Result<Vec<Box<dyn SampleSource + '_>>> {
        self.features.iter().map(CaseFeature::source).collect()
    }

    /// Global batch sizes, in config order.
    pub fn global_batch_sizes(&self) -> Vec<usize> {
        self.features.iter().map(|f| f.global_batch_size).collect()
    }
}

fn parse_feature(f: RawFeature, weighted: bool) -> Result<CaseFeature> {
    let layout = f.layout.as_deref().unwrap_or("ragged");
    let weights = if weighted { f.weights } else { None };
    let data = match layout {
        "ragged" | "dense" => {
            let rows = f
                .ids
                .ok_or_else(|| Error::input(&f.name, "case feature has no `ids`"))?;
            if let Some(w) = &weights {
                if w.len() != rows.len() {
                    return Err(Error::input(
                        &f.name,
                        format!("{} weight rows for {} id rows", w.len(), rows.len()),
                    ));
                }
                for (r, (wr, ir)) in w.iter().zip(&rows).enumerate() {
                    if wr.len() != ir.len() {
                        return Err(Error::WeightsShape {
                            feature: f.name.clone(),
                            row: r,
                            ids: ir.len(),
                            weights: wr.len(),
                        });
                    }
                }
            }
            if layout == "dense" {
                let valency = rows.first().map_or(0, Vec::len);
                if rows.iter().any(|r| r.len() != valency) {
                    return Err(Error::input(
                        &f.name,
                        "dense rows must all have the same length",
                    ));
                }
                let ids = Array2::from_shape_vec((rows.len(), valency), rows.concat())
                    .map_err(|e| Error::input(&f.name, e.to_string()))?;
                let weights = weights
                    .map(|w| Array2::from_shape_vec((w.len(), valency), w.concat()))
                    .transpose()
                    .map_err(|e| Error::input(&f.name, e.to_string()))?;
                CaseData::Dense { ids, weights }
            } else {
                let mut row_splits = Vec::with_capacity(rows.len() + 1);
                row_splits.push(0i64);
                for r in &rows {
                    row_splits.push(row_splits.last().copied().unwrap_or(0) + r.len() as i64);
                }
                CaseData::Ragged {
                    values: rows.concat(),
                    row_splits,
                    weights: weights.map(|w| w.concat()),
                }
            }
        }
        "coo" => {
            let indices = f
                .indices
                .ok_or_else(|| Error::input(&f.name, "COO case feature has no `indices`"))?;
            let values = f
                .values
                .ok_or_else(|| Error::input(&f.name, "COO case feature has no `values`"))?;
            let batch = f
                .dense_shape
                .as_ref()
                .and_then(|s| s.first().copied())
                .filter(|&b| b >= 0)
                .map(|b| b as usize)
                .unwrap_or(f.local_batch_size);
            CaseData::Coo {
                indices: indices.concat(),
                values,
                batch,
            }
        }
        other => {
            return Err(Error::input(
                &f.name,
                format!("unknown case layout {other:?}"),
            ))
        }
    };
    Ok(CaseFeature {
        name: f.name,
        local_batch_size: f.local_batch_size,
        global_batch_size: f.global_batch_size,
        data,
    })
}
