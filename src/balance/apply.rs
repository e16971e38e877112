//! Moving every column of a window's rows to their new places.
//!
//! Arrow's `interleave` allocates every output buffer afresh, and a window's id lists run to
//! megabytes: fresh allocations that large are mapped and faulted in page by page on every
//! window. The columns the pipeline reads (lists of Int32/Int64 ids and Float32/Float64 weights,
//! and primitive columns beside them) are reordered here instead, into buffers taken back from
//! the batches of the previous window once the caller has dropped them (`Buffer::into_mutable`
//! hands a buffer back only when nothing else holds it). Every other type, and a list whose
//! values carry nulls, goes to `interleave`, whose output the specialised paths match exactly
//! (schema, values, validity).

use std::sync::Arc;

use arrow_array::types::{ArrowPrimitiveType, Float32Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{
    Array, ArrayRef, GenericListArray, OffsetSizeTrait, PrimitiveArray, RecordBatch,
};
use arrow_buffer::{
    ArrowNativeType, BooleanBuffer, Buffer, MutableBuffer, NullBuffer, OffsetBuffer, ScalarBuffer,
    ToByteSlice,
};
use arrow_schema::{ArrowError, DataType, FieldRef};

use super::samples::SampleRef;
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
    /// Buffers taken back, stacked so that they are handed out again in the order they were
    /// filled: a column tends to get the buffer it had, of about the size it needs.
    spare: Vec<MutableBuffer>,
    /// Per output batch, (input batch, row) of each row.
    index: Vec<Vec<(usize, usize)>>,
}

/// Every batch of `window` has the first's schema: output batches take their columns from all
/// of them.
pub(super) fn one_schema(window: &[RecordBatch]) -> Result<()> {
    let Some(first) = window.first() else {
        return Ok(());
    };
    match window
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, b)| b.schema() != first.schema())
    {
        Some((k, b)) => Err(Error::data(
            "balancing window",
            format!(
                "batch {k} has another schema than batch 0 ({} vs {} columns, or other types)",
                b.num_columns(),
                first.num_columns()
            ),
        )),
        None => Ok(()),
    }
}

fn arrow_error(source: ArrowError) -> Error {
    Error::Arrow {
        context: "reordering a window of batches".into(),
        source,
    }
}

impl Reorder {
    /// Applies a permutation to a window (see [`apply`]).
    pub fn apply(
        &mut self,
        window: &[RecordBatch],
        permutation: &[Vec<SampleRef>],
    ) -> Result<Vec<RecordBatch>> {
        one_schema(window)?;
        self.reclaim();
        self.index.resize_with(permutation.len(), Vec::new);
        for (index, rows) in self.index.iter_mut().zip(permutation) {
            index.clear();
            for r in rows {
                if r.batch >= window.len() || r.row >= window[r.batch].num_rows() {
                    return Err(Error::data(
                        "permutation",
                        format!(
                            "it names row {} of batch {}, which does not exist",
                            r.row, r.batch
                        ),
                    ));
                }
                index.push((r.batch, r.row));
            }
        }
        let index = std::mem::take(&mut self.index);
        let out = self.reorder(window, &index[..permutation.len()]);
        self.index = index;
        // Buffers this window did not need are freed, so that a smaller window after a larger
        // one leaves no more than its own batches' worth behind.
        self.spare.clear();
        out
    }

    fn reorder(
        &mut self,
        window: &[RecordBatch],
        index: &[Vec<(usize, usize)>],
    ) -> Result<Vec<RecordBatch>> {
        let Some(first) = window.first() else {
            return if index.is_empty() {
                Ok(Vec::new())
            } else {
                Err(Error::data(
                    "permutation",
                    "it has batches, but the window is empty",
                ))
            };
        };
        let sources: Vec<&RecordBatch> = window.iter().collect();
        // A batch without columns is Arrow's to define.
        if first.num_columns() == 0 {
            return index
                .iter()
                .map(|index| {
                    arrow_select::interleave::interleave_record_batch(&sources, index)
                        .map_err(arrow_error)
                })
                .collect();
        }
        // Column by column, so that each column's inputs are looked at once per window.
        let mut lent = Vec::new();
        let mut columns: Vec<Vec<ArrayRef>> = index
            .iter()
            .map(|_| Vec::with_capacity(first.num_columns()))
            .collect();
        let mut arrays: Vec<&dyn Array> = Vec::with_capacity(window.len());
        for c in 0..first.num_columns() {
            arrays.clear();
            arrays.extend(window.iter().map(|b| b.column(c).as_ref()));
            let mut reordered = Vec::with_capacity(index.len());
            if !self.reorder_column(&arrays, index, &mut lent, &mut reordered) {
                reordered.clear();
                for index in index {
                    reordered.push(
                        arrow_select::interleave::interleave(&arrays, index)
                            .map_err(arrow_error)?,
                    );
                }
            }
            for ((batch, column), index) in columns.iter_mut().zip(reordered).zip(index) {
                // An empty output batch is Arrow's to define too (its empty arrays have no
                // validity, with nulls in the inputs or not).
                let column = if index.is_empty() {
                    arrow_select::interleave::interleave(&arrays, index).map_err(arrow_error)?
                } else {
                    column
                };
                batch.push(column);
            }
        }
        self.lent = lent;
        columns
            .into_iter()
            .map(|columns| RecordBatch::try_new(first.schema(), columns).map_err(arrow_error))
            .collect()
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
            // Aligned to 8 bytes, which suits every type reordered here (a buffer may hold
            // another type in the next window): Arrow's own 64-byte alignment takes the
            // allocator's slower aligned path, and a fresh allocation is what a caller holding
            // its batches pays for every window.
            None => MutableBuffer::from(Vec::<u64>::with_capacity(bytes.div_ceil(8))),
        }
    }

    /// A buffer of `bytes` bytes for the caller to overwrite: a buffer taken back keeps its old
    /// bytes up to its old length (zeroing a buffer that is about to be overwritten cost as
    /// much as the writes), and only what it grows by is zeroed.
    fn overwritable(&mut self, bytes: usize) -> MutableBuffer {
        let mut m = self
            .spare
            .pop()
            .unwrap_or_else(|| MutableBuffer::from(Vec::<u64>::with_capacity(bytes.div_ceil(8))));
        m.resize(bytes, 0);
        m
    }

    /// Pushes the column of every output batch to `out`; false for a type (or shape) left to
    /// Arrow's `interleave`.
    fn reorder_column(
        &mut self,
        arrays: &[&dyn Array],
        index: &[Vec<(usize, usize)>],
        lent: &mut Vec<Buffer>,
        out: &mut Vec<ArrayRef>,
    ) -> bool {
        let data_type = arrays[0].data_type();
        if arrays.iter().any(|a| a.data_type() != data_type) {
            return false;
        }
        let done = match data_type {
            DataType::Int32 => self.primitive::<Int32Type>(arrays, index, lent, out),
            DataType::Int64 => self.primitive::<Int64Type>(arrays, index, lent, out),
            DataType::Float32 => self.primitive::<Float32Type>(arrays, index, lent, out),
            DataType::Float64 => self.primitive::<Float64Type>(arrays, index, lent, out),
            DataType::List(field) => self.list::<i32>(arrays, index, field, lent, out),
            DataType::LargeList(field) => self.list::<i64>(arrays, index, field, lent, out),
            _ => None,
        };
        done.is_some()
    }

    fn primitive<T: ArrowPrimitiveType>(
        &mut self,
        arrays: &[&dyn Array],
        index: &[Vec<(usize, usize)>],
        lent: &mut Vec<Buffer>,
        out: &mut Vec<ArrayRef>,
    ) -> Option<()> {
        let typed: Vec<&PrimitiveArray<T>> = arrays
            .iter()
            .map(|a| a.as_any().downcast_ref())
            .collect::<Option<_>>()?;
        let values: Vec<&[T::Native]> = typed.iter().map(|a| a.values().as_ref()).collect();
        let nulls = arrays.iter().any(|a| a.null_count() != 0);
        for index in index {
            let mut data = self.buffer(index.len() * size_of::<T::Native>());
            for &(b, r) in index {
                data.push(values[b][r]);
            }
            let data = lend::<T::Native>(data, lent);
            out.push(Arc::new(PrimitiveArray::<T>::new(
                data,
                row_nulls(nulls, arrays, index),
            )));
        }
        Some(())
    }

    fn list<O: OffsetSizeTrait>(
        &mut self,
        arrays: &[&dyn Array],
        index: &[Vec<(usize, usize)>],
        field: &FieldRef,
        lent: &mut Vec<Buffer>,
        out: &mut Vec<ArrayRef>,
    ) -> Option<()> {
        let lists: Vec<&GenericListArray<O>> = arrays
            .iter()
            .map(|a| a.as_any().downcast_ref())
            .collect::<Option<_>>()?;
        // Values with nulls of their own take Arrow's path, which carries their validity.
        if lists.iter().any(|l| l.values().null_count() != 0) {
            return None;
        }
        match field.data_type() {
            DataType::Int32 => {
                self.list_of::<O, Int32Type>(arrays, &lists, index, field, lent, out)
            }
            DataType::Int64 => {
                self.list_of::<O, Int64Type>(arrays, &lists, index, field, lent, out)
            }
            DataType::Float32 => {
                self.list_of::<O, Float32Type>(arrays, &lists, index, field, lent, out)
            }
            DataType::Float64 => {
                self.list_of::<O, Float64Type>(arrays, &lists, index, field, lent, out)
            }
            _ => None,
        }
    }

    /// A list column of `T` values for every output batch.
    fn list_of<O: OffsetSizeTrait, T: ArrowPrimitiveType>(
        &mut self,
        arrays: &[&dyn Array],
        lists: &[&GenericListArray<O>],
        index: &[Vec<(usize, usize)>],
        field: &FieldRef,
        lent: &mut Vec<Buffer>,
        out: &mut Vec<ArrayRef>,
    ) -> Option<()> {
        let offsets: Vec<&[O]> = lists.iter().map(|l| l.value_offsets()).collect();
        let values: Vec<&[T::Native]> = lists
            .iter()
            .map(|l| {
                l.values()
                    .as_any()
                    .downcast_ref::<PrimitiveArray<T>>()
                    .map(|v| v.values().as_ref())
            })
            .collect::<Option<_>>()?;
        let nulls = arrays.iter().any(|a| a.null_count() != 0);
        // One value per row (single-id features): a gather, with no runs to measure.
        let unit = offsets
            .iter()
            .all(|o| o.windows(2).all(|w| w[1].as_usize() == w[0].as_usize() + 1));
        // Each input's offsets and values (as bytes) side by side: one look-up per row.
        let inputs: Vec<(&[O], &[u8])> = offsets
            .iter()
            .copied()
            .zip(values.iter().map(|v| v.to_byte_slice()))
            .collect();
        for index in index {
            let (offsets_out, data) = match &inputs[..] {
                // A window of one batch: every row comes from it, and an output batch of its
                // size takes all its values.
                [(o, v)] => {
                    let whole = (o.len() == index.len() + 1)
                        .then(|| o[index.len()].as_usize().saturating_sub(o[0].as_usize()));
                    self.list_rows::<O, T::Native>(index, unit, whole, |_| Some((o, v)))?
                }
                _ => self.list_rows::<O, T::Native>(index, unit, None, |b| {
                    inputs.get(b).map(|(o, v)| (*o, *v))
                })?,
            };
            let offsets_out = lend::<O>(offsets_out, lent);
            // SAFETY: `list_rows` wrote the offsets from 0, each the one before plus a row's
            // length (a difference of two offsets of a valid input, never negative), so they
            // are non-negative and never fall, which is all `new_unchecked` asks (the list's
            // `try_new` checks the last against the values). Checking them again cost a pass.
            #[allow(unsafe_code)]
            let offsets_out = unsafe { OffsetBuffer::new_unchecked(offsets_out) };
            let data: ArrayRef = Arc::new(PrimitiveArray::<T>::new(
                lend::<T::Native>(data, lent),
                None,
            ));
            out.push(Arc::new(
                GenericListArray::<O>::try_new(
                    field.clone(),
                    offsets_out,
                    data,
                    row_nulls(nulls, arrays, index),
                )
                .ok()?,
            ));
        }
        Some(())
    }

    /// One output batch's offsets and values of a list column: `input(b)` is input b's offsets
    /// and values (as bytes), `whole` the batch's values when known. Buffers taken back are
    /// sized first and then written in place, which costs a bounds check per row where a push
    /// checks the room and bumps the length; fresh ones are pushed to instead.
    #[inline(always)]
    fn list_rows<'i, O: OffsetSizeTrait, T: ArrowNativeType>(
        &mut self,
        index: &[(usize, usize)],
        unit: bool,
        whole: Option<usize>,
        input: impl Fn(usize) -> Option<(&'i [O], &'i [u8])>,
    ) -> Option<(MutableBuffer, MutableBuffer)> {
        let (so, st) = (size_of::<O>(), size_of::<T>());
        let run = |b: usize, r: usize| {
            let (o, v) = input(b)?;
            match o.get(r..r + 2) {
                Some(&[start, end]) => Some((start.as_usize(), end.as_usize(), v)),
                _ => None,
            }
        };
        // The size first, as a buffer grown midway is copied and, when fresh, faulted in twice:
        // one value per row, `whole`, or summed over the rows.
        let total = match whole {
            _ if unit => index.len(),
            Some(total) => total,
            None => index
                .iter()
                .map(|&(b, r)| run(b, r).map_or(0, |(start, end, _)| end.saturating_sub(start)))
                .sum(),
        };
        O::from_usize(total)?;
        if self.spare.len() < 2 {
            return self.list_rows_pushed::<O>(index, unit, total, st, run);
        }
        let mut offsets_out = self.overwritable((index.len() + 1) * so);
        let mut data = self.overwritable((total + SHORT) * st);
        let (offs, dst) = (offsets_out.as_slice_mut(), data.as_slice_mut());
        offs.get_mut(..so)?
            .copy_from_slice(O::usize_as(0).to_byte_slice());
        let mut at = 0;
        if unit {
            for (k, &(b, r)) in index.iter().enumerate() {
                let (start, _, v) = run(b, r)?;
                dst.get_mut(k * st..(k + 1) * st)?
                    .copy_from_slice(v.get(start * st..(start + 1) * st)?);
                offs.get_mut((k + 1) * so..(k + 2) * so)?
                    .copy_from_slice(O::usize_as(k + 1).to_byte_slice());
            }
            at = total;
        } else {
            // Rows of a handful of values (criteo's one to five ids) are copied as a whole block
            // of SHORT values (a few vector moves; `data` has room for SHORT values past the
            // column's) where the input has that many from the run's start, and the next row
            // overwrites what lies past the run: a call to copy a handful of values costs more
            // than the copy.
            let short = total <= index.len() * SHORT;
            for (k, &(b, r)) in index.iter().enumerate() {
                let (start, end, v) = run(b, r)?;
                let len = end.checked_sub(start)?;
                match v.get(start * st..(start + SHORT) * st) {
                    Some(block) if short && len <= SHORT => dst
                        .get_mut(at * st..(at + SHORT) * st)?
                        .copy_from_slice(block),
                    _ => dst
                        .get_mut(at * st..(at + len) * st)?
                        .copy_from_slice(v.get(start * st..end * st)?),
                }
                at += len;
                offs.get_mut((k + 1) * so..(k + 2) * so)?
                    .copy_from_slice(O::usize_as(at).to_byte_slice());
            }
            if at != total {
                return None;
            }
        }
        data.truncate(at * st);
        Some((offsets_out, data))
    }
}

impl Reorder {
    /// [`Reorder::list_rows`] into fresh buffers, which are pushed to: sizing them first would
    /// have them zeroed, which costs more than the pushes.
    #[inline(always)]
    fn list_rows_pushed<'i, O: OffsetSizeTrait>(
        &mut self,
        index: &[(usize, usize)],
        unit: bool,
        total: usize,
        st: usize,
        run: impl Fn(usize, usize) -> Option<(usize, usize, &'i [u8])>,
    ) -> Option<(MutableBuffer, MutableBuffer)> {
        let mut offsets_out = self.buffer((index.len() + 1) * size_of::<O>());
        offsets_out.push(O::usize_as(0));
        let mut data = self.buffer((total + SHORT) * st);
        if unit {
            for (k, &(b, r)) in index.iter().enumerate() {
                let (start, _, v) = run(b, r)?;
                data.extend_from_slice(v.get(start * st..(start + 1) * st)?);
                offsets_out.push(O::usize_as(k + 1));
            }
        } else {
            let short = total <= index.len() * SHORT;
            let mut at = 0;
            for &(b, r) in index {
                let (start, end, v) = run(b, r)?;
                let len = end.checked_sub(start)?;
                match v.get(start * st..(start + SHORT) * st) {
                    Some(block) if short && len <= SHORT => {
                        let keep = data.len() + len * st;
                        data.extend_from_slice(block);
                        data.truncate(keep);
                    }
                    _ => data.extend_from_slice(v.get(start * st..end * st)?),
                }
                at += len;
                offsets_out.push(O::usize_as(at));
            }
            if at != total {
                return None;
            }
        }
        Some((offsets_out, data))
    }
}

/// Rows of up to this many values are copied as a whole block of this many.
const SHORT: usize = 8;

/// A filled buffer as the column's values, keeping a reference to take it back later.
fn lend<T: ArrowNativeType>(buffer: MutableBuffer, lent: &mut Vec<Buffer>) -> ScalarBuffer<T> {
    let buffer = Buffer::from(buffer);
    lent.push(buffer.clone());
    let len = buffer.len() / size_of::<T>();
    ScalarBuffer::new(buffer, 0, len)
}

/// The rows' validity as `interleave` builds it: present whenever any input has nulls
/// (`nulls`), even if none of the chosen rows is null.
fn row_nulls(nulls: bool, arrays: &[&dyn Array], index: &[(usize, usize)]) -> Option<NullBuffer> {
    nulls.then(|| {
        BooleanBuffer::collect_bool(index.len(), |i| {
            let (b, r) = index[i];
            arrays[b].is_valid(r)
        })
        .into()
    })
}
