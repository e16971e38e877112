//! Arrow input: `List`/`LargeList` columns of `Int32`/`Int64` ids, optional `List<Float32>`
//! weights, read in place from the Arrow buffers. A feature with a `"hash"` config may instead
//! carry raw keys (strings, bytes, arbitrary int64s); those are hashed into an owned id buffer
//! (see [`super::hash`]), the one case where this stage copies.

use arrow_array::{
    Array, Float32Array, Int32Array, Int64Array, LargeListArray, ListArray, RecordBatch,
};

use super::hash::{for_each_key, HashBuffers, OwnedIds, RAW_KEY_TYPES};
use super::{FeatureView, Ids, Offsets, SampleSource};
use crate::error::{ConfigItem, Error, Result};
use crate::spec::Config;

const IDS_TYPES: &str =
    "List<Int32>, List<Int64>, LargeList<Int32> or LargeList<Int64> (string or binary keys need a \"hash\" config on the feature)";
const WEIGHTS_TYPES: &str = "List<Float32> or LargeList<Float32>";

/// One feature's ids (and weights) borrowed from Arrow list arrays: one list per sample.
/// Hashed features own their ids instead (materialised from the raw keys).
#[derive(Debug, Clone)]
pub struct ArrowListInput<'a> {
    ids: IdStore<'a>,
    offsets: Offsets<'a>,
    weights: Option<(&'a [f32], Offsets<'a>)>,
}

#[derive(Debug, Clone)]
enum IdStore<'a> {
    Borrowed(Ids<'a>),
    Hashed(OwnedIds),
}

/// Splits a list array into its offsets and child array, rejecting null lists.
pub(crate) fn list_parts<'a>(
    feature: &str,
    column: &str,
    array: &'a dyn Array,
    expected: &'static str,
) -> Result<(Offsets<'a>, &'a dyn Array)> {
    let type_error = || Error::ColumnType {
        feature: feature.to_string(),
        column: column.to_string(),
        expected,
        found: array.data_type().to_string(),
    };
    let (offsets, child): (Offsets<'a>, &'a dyn Array) =
        if let Some(list) = array.as_any().downcast_ref::<ListArray>() {
            (Offsets::I32(list.value_offsets()), list.values().as_ref())
        } else if let Some(list) = array.as_any().downcast_ref::<LargeListArray>() {
            (Offsets::I64(list.value_offsets()), list.values().as_ref())
        } else {
            return Err(type_error());
        };
    if array.null_count() > 0 {
        return Err(Error::input(
            feature,
            format!(
                "column `{column}` has {} null lists; use empty lists for samples without ids",
                array.null_count()
            ),
        ));
    }
    if child.null_count() > 0 {
        return Err(Error::input(
            feature,
            format!(
                "column `{column}` has {} null values inside its lists",
                child.null_count()
            ),
        ));
    }
    Ok((offsets, child))
}

impl<'a> ArrowListInput<'a> {
    /// Wraps an ids column and an optional weights column of the same shape. `feature` and the
    /// column names label errors.
    pub fn new(
        feature: &str,
        column: &str,
        ids: &'a dyn Array,
        weights: Option<(&str, &'a dyn Array)>,
    ) -> Result<Self> {
        let (offsets, child) = list_parts(feature, column, ids, IDS_TYPES)?;
        let ids = if let Some(v) = child.as_any().downcast_ref::<Int32Array>() {
            Ids::I32(v.values())
        } else if let Some(v) = child.as_any().downcast_ref::<Int64Array>() {
            Ids::I64(v.values())
        } else {
            return Err(Error::ColumnType {
                feature: feature.to_string(),
                column: column.to_string(),
                expected: IDS_TYPES,
                found: ids.data_type().to_string(),
            });
        };
        offsets.validate(feature, "list offsets", ids.len())?;
        let weights = weights_parts(feature, column, &offsets, weights)?;
        Ok(ArrowListInput {
            ids: IdStore::Borrowed(ids),
            offsets,
            weights,
        })
    }

    /// Wraps a column of raw keys (`List`/`LargeList` of Utf8, LargeUtf8, Binary, LargeBinary,
    /// Int64 or Int32), hashing each key to `xxh3_64(key, seed) mod vocabulary_size` (see
    /// [`super::hash`] for the exact bytes hashed). The ids are materialised in a buffer taken
    /// from `buffers`; give it back with [`HashBuffers::recycle`].
    pub fn hashed(
        feature: &str,
        column: &str,
        keys: &'a dyn Array,
        weights: Option<(&str, &'a dyn Array)>,
        seed: u64,
        vocabulary_size: u64,
        buffers: &mut HashBuffers,
    ) -> Result<Self> {
        let (offsets, child) = list_parts(feature, column, keys, RAW_KEY_TYPES)?;
        offsets.validate(feature, "list offsets", child.len())?;
        let rows = offsets.rows();
        let range = if rows == 0 {
            (0, 0)
        } else {
            (offsets.range(0).0, offsets.range(rows - 1).1)
        };
        let ids = buffers.hash(feature, column, child, range, seed, vocabulary_size)?;
        let weights = weights_parts(feature, column, &offsets, weights)?;
        Ok(ArrowListInput {
            ids: IdStore::Hashed(ids),
            offsets,
            weights,
        })
    }

    /// Whether the ids were hashed from raw keys (and so are owned, not borrowed).
    pub fn is_hashed(&self) -> bool {
        matches!(self.ids, IdStore::Hashed(_))
    }

    pub(crate) fn into_owned_ids(self) -> Option<OwnedIds> {
        match self.ids {
            IdStore::Hashed(ids) => Some(ids),
            IdStore::Borrowed(_) => None,
        }
    }

    fn ids(&self) -> Ids<'_> {
        match &self.ids {
            IdStore::Borrowed(ids) => *ids,
            IdStore::Hashed(OwnedIds::I32(v)) => Ids::I32(v),
            IdStore::Hashed(OwnedIds::I64(v)) => Ids::I64(v),
        }
    }
}

/// The weights column's values and offsets, checked against the ids' rows.
pub(crate) fn weights_parts<'a>(
    feature: &str,
    column: &str,
    offsets: &Offsets<'a>,
    weights: Option<(&str, &'a dyn Array)>,
) -> Result<Option<(&'a [f32], Offsets<'a>)>> {
    let Some((wcol, warr)) = weights else {
        return Ok(None);
    };
    let (woffsets, wchild) = list_parts(feature, wcol, warr, WEIGHTS_TYPES)?;
    let values = wchild
        .as_any()
        .downcast_ref::<Float32Array>()
        .ok_or_else(|| Error::ColumnType {
            feature: feature.to_string(),
            column: wcol.to_string(),
            expected: WEIGHTS_TYPES,
            found: warr.data_type().to_string(),
        })?;
    if woffsets.rows() != offsets.rows() {
        return Err(Error::input(
            feature,
            format!(
                "weights column `{wcol}` has {} rows, ids column `{column}` has {}",
                woffsets.rows(),
                offsets.rows()
            ),
        ));
    }
    woffsets.validate(feature, "weights list offsets", values.len())?;
    Ok(Some((&values.values()[..], woffsets)))
}

impl SampleSource for ArrowListInput<'_> {
    fn num_samples(&self) -> usize {
        self.offsets.rows()
    }
    fn has_weights(&self) -> bool {
        self.weights.is_some()
    }
    fn view(&self) -> FeatureView<'_> {
        FeatureView::Ragged {
            ids: self.ids(),
            offsets: self.offsets,
            weights: self.weights,
        }
    }
}

impl HashBuffers {
    /// Takes back the hashed-id buffers of `inputs` (inputs without hashing hold none).
    pub fn recycle<'a>(&mut self, inputs: impl IntoIterator<Item = ArrowListInput<'a>>) {
        for input in inputs {
            if let Some(ids) = input.into_owned_ids() {
                self.give_back(ids);
            }
        }
    }
}

/// Maps a record batch to the config's features by their `column` / `weights_column` names,
/// in config feature order. Features with a `"hash"` config are hashed into fresh buffers; use
/// [`features_from_record_batch_reusing`] to recycle them across batches.
pub fn features_from_record_batch<'a>(
    config: &Config,
    batch: &'a RecordBatch,
) -> Result<Vec<ArrowListInput<'a>>> {
    features_from_record_batch_reusing(config, batch, &mut HashBuffers::new())
}

/// [`features_from_record_batch`], taking hashed features' id buffers from `buffers` (hand the
/// inputs back with [`HashBuffers::recycle`] after the batch).
pub fn features_from_record_batch_reusing<'a>(
    config: &Config,
    batch: &'a RecordBatch,
    buffers: &mut HashBuffers,
) -> Result<Vec<ArrowListInput<'a>>> {
    let schema = batch.schema_ref();
    let find = |feature: &str, column: &str| -> Result<&'a dyn Array> {
        match schema.index_of(column) {
            Ok(i) => Ok(batch.column(i).as_ref()),
            Err(_) => Err(Error::MissingColumn {
                feature: feature.to_string(),
                column: column.to_string(),
                available: schema
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    };
    config
        .features
        .iter()
        .map(|f| {
            let column = f.column_name();
            let ids = find(&f.name, column)?;
            let weights = match &f.weights_column {
                Some(w) => Some((w.as_str(), find(&f.name, w)?)),
                None => None,
            };
            match &f.hash {
                None => ArrowListInput::new(&f.name, column, ids, weights),
                Some(h) => {
                    let table = config
                        .tables
                        .iter()
                        .find(|t| t.name == f.table)
                        .ok_or_else(|| {
                            Error::config(
                                ConfigItem::Feature,
                                &f.name,
                                format!("table `{}` is not in the config", f.table),
                            )
                        })?;
                    ArrowListInput::hashed(
                        &f.name,
                        column,
                        ids,
                        weights,
                        h.seed,
                        table.vocabulary_size,
                        buffers,
                    )
                }
            }
        })
        .collect()
}

/// The rows of an Arrow list column of raw keys, each key hashed to its full 64-bit value (see
/// [`super::hash`]), flattened with their row offsets and optional weights. This is the input
/// of tables keyed by raw keys (dynamic tables), which need the keys before any
/// `mod vocabulary_size`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RawKeyRows {
    /// Every key, row after row.
    pub keys: Vec<u64>,
    /// Row `r` holds `keys[offsets[r]..offsets[r + 1]]`; `offsets[0]` is 0.
    pub offsets: Vec<usize>,
    /// One weight per key, when a weights column was given.
    pub weights: Option<Vec<f32>>,
}

impl RawKeyRows {
    /// Reads `keys` (a `List`/`LargeList` of a raw key type, column `column` of feature
    /// `feature`) and optional `List<Float32>` weights. Errors name the feature and column.
    pub fn from_arrow(
        feature: &str,
        column: &str,
        keys: &dyn Array,
        weights: Option<(&str, &dyn Array)>,
        seed: u64,
    ) -> Result<Self> {
        let (offsets, child) = list_parts(feature, column, keys, RAW_KEY_TYPES)?;
        offsets.validate(feature, "list offsets", child.len())?;
        let rows = offsets.rows();
        // Checks the key type even when there are no rows.
        for_each_key(feature, column, child, (0, 0), seed, |_, _| {})?;
        let mut flat_keys = Vec::with_capacity(child.len());
        let mut flat_offsets = Vec::with_capacity(rows + 1);
        flat_offsets.push(0);
        let weights = weights_parts(feature, column, &offsets, weights)?;
        let mut flat_weights = weights.map(|_| Vec::with_capacity(child.len()));
        for r in 0..rows {
            let (lo, hi) = offsets.range(r);
            for_each_key(feature, column, child, (lo, hi), seed, |_, k| {
                flat_keys.push(k)
            })?;
            if let (Some((values, woffsets)), Some(fw)) = (&weights, &mut flat_weights) {
                let (wlo, whi) = woffsets.range(r);
                if whi - wlo != hi - lo {
                    return Err(Error::WeightsShape {
                        feature: feature.to_string(),
                        row: r,
                        ids: hi - lo,
                        weights: whi - wlo,
                    });
                }
                fw.extend_from_slice(&values[wlo..whi]);
            }
            flat_offsets.push(flat_keys.len());
        }
        Ok(RawKeyRows {
            keys: flat_keys,
            offsets: flat_offsets,
            weights: flat_weights,
        })
    }
}
