//! Moving every column of a window's rows to their new places.
//!
//! Arrow's `interleave` allocates every output buffer afresh, and a window's id lists run to
//! megabytes: fresh allocations that large are mapped and faulted in page by page on every
//! window. The columns the pipeline reads (lists of Int32/Int64 ids and Float32/Float64 weights,
//! and primitive columns beside them) are reordered here instead, into buffers taken back from
//! the batches of the previous window once the caller has dropped them. Every other type, and a
//! list whose values carry nulls, goes to `interleave`, whose output the specialised paths match
//! exactly (schema, values, validity).

use std::sync::Arc;

use arrow_array::types::{ArrowPrimitiveType, Float32Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, GenericListArray, OffsetSizeTrait, PrimitiveArray, RecordBatch};
use arrow_buffer::{ArrowNativeType, BooleanBuffer, Buffer, MutableBuffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::{ArrowError, DataType, FieldRef};

use super::SampleRef;
use crate::error::{Error, Result};

/// Applies a permutation to a window: output batch k takes `permutation[k]`'s rows, every
/// column moving together. A stream of windows should keep one [`Reorder`] (a
/// [`super::Balancer`] does) so that output memory is reused.
pub fn apply(window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Result<Vec<RecordBatch>> {
    Reorder::default().apply(window, permutation)
}

/// Reorders windows, reusing the output buffers of the previous window whose batches the caller
/// has dropped by the time the next window comes (a batch still held keeps its buffers: they
/// are never written while shared).
#[derive(Debug, Default)]
pub struct Reorder {
    /// The buffers of the batches handed out last, in the order they were filled.
    lent: Vec<Buffer>,
    /// Buffers taken back, in the order they are handed out again (the last one first), so a
    /// column tends to get the buffer it had, of about the size it needs.
    spare: Vec<MutableBuffer>,
    index: Vec<(usize, usize)>,
}

fn arrow_error(source: ArrowError) -> Error {
    Error::Arrow { context: "reordering a window of batches".into(), source }
}

impl Reorder {
    /// Applies a permutation to a window (see [`apply`]).
    pub fn apply(&mut self, window: &[RecordBatch], permutation: &[Vec<SampleRef>]) -> Result<Vec<RecordBatch>> {
        self.reclaim();
        let mut lent = Vec::new();
        let sources: Vec<&RecordBatch> = window.iter().collect();
        let mut out = Vec::with_capacity(permutation.len());
        for rows in permutation {
            self.index.clear();
            for r in rows {
                if r.batch >= window.len() || r.row >= window[r.batch].num_rows() {
                    return Err(Error::input("balance", format!("permutation names row {} of batch {}, which does not exist", r.row, r.batch)));
                }
                self.index.push((r.batch, r.row));
            }
            let index = std::mem::take(&mut self.index);
            let batch = self.reorder_batch(&sources, &index, &mut lent);
            self.index = index;
            out.push(batch?);
        }
        self.lent = lent;
        Ok(out)
    }

    /// Takes back the buffers of the previous window that nobody else holds any more.
    fn reclaim(&mut self) {
        for b in self.lent.drain(..).rev() {
            if let Ok(m) = b.into_mutable() {
                self.spare.push(m);
            }
        }
    }

    /// An empty buffer with room for `bytes`.
    fn buffer(&mut self, bytes: usize) -> MutableBuffer {
        match self.spare.pop() {
            Some(mut m) => {
                m.clear();
                m.reserve(bytes);
                m
            }
            None => MutableBuffer::with_capacity(bytes),
        }
    }

    fn reorder_batch(&mut self, sources: &[&RecordBatch], index: &[(usize, usize)], lent: &mut Vec<Buffer>) -> Result<RecordBatch> {
        let Some(first) = sources.first() else {
            return Err(Error::input("balance", "a permutation of an empty window names rows"));
        };
        // Arrow's own answers for the shapes it treats specially (an empty output, no columns).
        if index.is_empty() || first.num_columns() == 0 {
            return arrow_select::interleave::interleave_record_batch(sources, index).map_err(arrow_error);
        }
        let schema = first.schema();
        let mut columns = Vec::with_capacity(first.num_columns());
        let mut arrays: Vec<&dyn Array> = Vec::with_capacity(sources.len());
        for c in 0..first.num_columns() {
            arrays.clear();
            arrays.extend(sources.iter().map(|b| b.column(c).as_ref()));
            let column = match self.reorder_column(&arrays, index, lent) {
                Some(column) => column,
                None => arrow_select::interleave::interleave(&arrays, index).map_err(arrow_error)?,
            };
            columns.push(column);
        }
        RecordBatch::try_new(schema, columns).map_err(arrow_error)
    }

    /// The reordered column, or `None` for a type (or shape) left to Arrow's `interleave`.
    fn reorder_column(&mut self, arrays: &[&dyn Array], index: &[(usize, usize)], lent: &mut Vec<Buffer>) -> Option<ArrayRef> {
        let data_type = arrays[0].data_type();
        if arrays.iter().any(|a| a.data_type() != data_type) {
            return None;
        }
        match data_type {
            DataType::Int32 => self.primitive::<Int32Type>(arrays, index, lent),
            DataType::Int64 => self.primitive::<Int64Type>(arrays, index, lent),
            DataType::Float32 => self.primitive::<Float32Type>(arrays, index, lent),
            DataType::Float64 => self.primitive::<Float64Type>(arrays, index, lent),
            DataType::List(field) => self.list::<i32>(arrays, index, field, lent),
            DataType::LargeList(field) => self.list::<i64>(arrays, index, field, lent),
            _ => None,
        }
    }

    fn primitive<T: ArrowPrimitiveType>(&mut self, arrays: &[&dyn Array], index: &[(usize, usize)], lent: &mut Vec<Buffer>) -> Option<ArrayRef> {
        let typed: Vec<&PrimitiveArray<T>> = arrays.iter().map(|a| a.as_any().downcast_ref()).collect::<Option<_>>()?;
        let values: Vec<&[T::Native]> = typed.iter().map(|a| a.values().as_ref()).collect();
        let mut out = self.buffer(index.len() * size_of::<T::Native>());
        for &(b, r) in index {
            out.push(values[b][r]);
        }
        let values = lend::<T::Native>(out, lent);
        Some(Arc::new(PrimitiveArray::<T>::new(values, row_nulls(arrays, index))))
    }

    fn list<O: OffsetSizeTrait>(&mut self, arrays: &[&dyn Array], index: &[(usize, usize)], field: &FieldRef, lent: &mut Vec<Buffer>) -> Option<ArrayRef> {
        let lists: Vec<&GenericListArray<O>> = arrays.iter().map(|a| a.as_any().downcast_ref()).collect::<Option<_>>()?;
        // Values with nulls of their own take Arrow's path, which carries their validity.
        if lists.iter().any(|l| l.values().null_count() != 0) {
            return None;
        }
        let values = match field.data_type() {
            DataType::Int32 => self.list_values::<O, Int32Type>(&lists, index, lent)?,
            DataType::Int64 => self.list_values::<O, Int64Type>(&lists, index, lent)?,
            DataType::Float32 => self.list_values::<O, Float32Type>(&lists, index, lent)?,
            DataType::Float64 => self.list_values::<O, Float64Type>(&lists, index, lent)?,
            _ => return None,
        };
        let (offsets, values) = values;
        Some(Arc::new(GenericListArray::<O>::try_new(field.clone(), offsets, values, row_nulls(arrays, index)).ok()?))
    }

    /// The output offsets and values of a list column of `T`.
    fn list_values<O: OffsetSizeTrait, T: ArrowPrimitiveType>(
        &mut self,
        lists: &[&GenericListArray<O>],
        index: &[(usize, usize)],
        lent: &mut Vec<Buffer>,
    ) -> Option<(OffsetBuffer<O>, ArrayRef)> {
        let offsets: Vec<&[O]> = lists.iter().map(|l| l.value_offsets()).collect();
        let values: Vec<&[T::Native]> =
            lists.iter().map(|l| l.values().as_any().downcast_ref::<PrimitiveArray<T>>().map(|v| v.values().as_ref())).collect::<Option<_>>()?;
        let mut out_offsets = self.buffer((index.len() + 1) * size_of::<O>());
        let (data, offsets_out) = if offsets.iter().all(|o| o.windows(2).all(|w| w[1].as_usize() == w[0].as_usize() + 1)) {
            // One value per row (single-id features): a gather, with no runs to measure.
            let mut data = self.buffer(index.len() * size_of::<T::Native>());
            for (i, &(b, r)) in index.iter().enumerate() {
                out_offsets.push(O::usize_as(i));
                data.push(values[b][offsets[b][0].as_usize() + r]);
            }
            out_offsets.push(O::usize_as(index.len()));
            (data, out_offsets)
        } else {
            let mut total = 0usize;
            out_offsets.push(O::usize_as(0));
            for &(b, r) in index {
                total += offsets[b][r + 1].as_usize() - offsets[b][r].as_usize();
                out_offsets.push(O::from_usize(total)?);
            }
            let mut data = self.buffer(total * size_of::<T::Native>());
            for &(b, r) in index {
                let (start, end) = (offsets[b][r].as_usize(), offsets[b][r + 1].as_usize());
                if end == start + 1 {
                    data.push(values[b][start]);
                } else {
                    data.extend_from_slice(&values[b][start..end]);
                }
            }
            (data, out_offsets)
        };
        let offsets = OffsetBuffer::new(lend::<O>(offsets_out, lent));
        let values = lend::<T::Native>(data, lent);
        Some((offsets, Arc::new(PrimitiveArray::<T>::new(values, None)) as ArrayRef))
    }
}

/// A filled buffer as the column's values, keeping a reference to take it back later.
fn lend<T: ArrowNativeType>(buffer: MutableBuffer, lent: &mut Vec<Buffer>) -> ScalarBuffer<T> {
    let buffer = Buffer::from(buffer);
    lent.push(buffer.clone());
    let len = buffer.len() / size_of::<T>();
    ScalarBuffer::new(buffer, 0, len)
}

/// The rows' validity as `interleave` builds it: present whenever any input has nulls, even if
/// none of the chosen rows is null.
fn row_nulls(arrays: &[&dyn Array], index: &[(usize, usize)]) -> Option<NullBuffer> {
    if arrays.iter().all(|a| a.null_count() == 0) {
        return None;
    }
    Some(
        BooleanBuffer::collect_bool(index.len(), |i| {
            let (b, r) = index[i];
            arrays[b].is_valid(r)
        })
        .into(),
    )
}
