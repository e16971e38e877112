//! Arrow input: `List`/`LargeList` columns of `Int32`/`Int64` ids, optional `List<Float32>`
//! weights, read in place from the Arrow buffers.

use arrow_array::{Array, Float32Array, Int32Array, Int64Array, LargeListArray, ListArray, RecordBatch};

use super::{FeatureView, Ids, Offsets, SampleSource};
use crate::error::{Error, Result};
use crate::spec::Config;

const IDS_TYPES: &str = "List<Int32>, List<Int64>, LargeList<Int32> or LargeList<Int64>";
const WEIGHTS_TYPES: &str = "List<Float32> or LargeList<Float32>";

/// One feature's ids (and weights) borrowed from Arrow list arrays: one list per sample.
#[derive(Debug, Clone)]
pub struct ArrowListInput<'a> {
    ids: Ids<'a>,
    offsets: Offsets<'a>,
    weights: Option<(&'a [f32], Offsets<'a>)>,
}

/// Splits a list array into its offsets and child array, rejecting null lists.
fn list_parts<'a>(feature: &str, column: &str, array: &'a dyn Array, expected: &'static str) -> Result<(Offsets<'a>, &'a dyn Array)> {
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
            format!("column `{column}` has {} null lists; use empty lists for samples without ids", array.null_count()),
        ));
    }
    if child.null_count() > 0 {
        return Err(Error::input(feature, format!("column `{column}` has {} null values inside its lists", child.null_count())));
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
        let weights = match weights {
            None => None,
            Some((wcol, warr)) => {
                let (woffsets, wchild) = list_parts(feature, wcol, warr, WEIGHTS_TYPES)?;
                let values = wchild.as_any().downcast_ref::<Float32Array>().ok_or_else(|| Error::ColumnType {
                    feature: feature.to_string(),
                    column: wcol.to_string(),
                    expected: WEIGHTS_TYPES,
                    found: warr.data_type().to_string(),
                })?;
                if woffsets.rows() != offsets.rows() {
                    return Err(Error::input(
                        feature,
                        format!("weights column `{wcol}` has {} rows, ids column `{column}` has {}", woffsets.rows(), offsets.rows()),
                    ));
                }
                woffsets.validate(feature, "weights list offsets", values.len())?;
                Some((&values.values()[..], woffsets))
            }
        };
        Ok(ArrowListInput { ids, offsets, weights })
    }
}

impl SampleSource for ArrowListInput<'_> {
    fn num_samples(&self) -> usize {
        self.offsets.rows()
    }
    fn has_weights(&self) -> bool {
        self.weights.is_some()
    }
    fn view(&self) -> FeatureView<'_> {
        FeatureView::Ragged { ids: self.ids, offsets: self.offsets, weights: self.weights }
    }
}

/// Maps a record batch to the config's features by their `column` / `weights_column` names,
/// in config feature order.
pub fn features_from_record_batch<'a>(config: &Config, batch: &'a RecordBatch) -> Result<Vec<ArrowListInput<'a>>> {
    let schema = batch.schema_ref();
    let find = |feature: &str, column: &str| -> Result<&'a dyn Array> {
        match schema.index_of(column) {
            Ok(i) => Ok(batch.column(i).as_ref()),
            Err(_) => Err(Error::MissingColumn {
                feature: feature.to_string(),
                column: column.to_string(),
                available: schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", "),
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
            ArrowListInput::new(&f.name, column, ids, weights)
        })
        .collect()
}
