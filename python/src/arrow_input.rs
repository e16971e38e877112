//! Arrow record batches from Python through the Arrow PyCapsule interface
//! (`__arrow_c_array__`, `__arrow_c_stream__`), so that any producer works (pyarrow of any
//! version, polars, duckdb, nanoarrow) and nothing is copied: the imported arrays keep the
//! producer's buffers alive through their release callbacks.

use arrow_array::ffi::{from_ffi, FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::ffi_stream::{FFI_ArrowArrayStream, RecordBatchStreamReader};
use arrow_array::{Array, RecordBatch, RecordBatchReader, StructArray};
use arrow_schema::DataType;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyTuple};

use crate::errors::{raise, Class};

/// An [`Class::InputType`] about the batch object (no feature to name).
fn type_error(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, Class::InputType, message.into(), &[])
}

/// An [`Class::InvalidInput`] about the batch.
fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, Class::InvalidInput, message.into(), &[])
}

fn capsule_ptr<T>(capsule: &Bound<'_, PyAny>, name: &'static std::ffi::CStr) -> PyResult<*mut T> {
    let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
        type_error(
            capsule.py(),
            "the Arrow interface did not return a PyCapsule",
        )
    })?;
    Ok(capsule.pointer_checked(Some(name))?.as_ptr() as *mut T)
}

/// Imports one record batch (or a table / reader, whose batches are concatenated).
pub fn record_batch(obj: &Bound<'_, PyAny>) -> PyResult<RecordBatch> {
    let py = obj.py();
    if obj.hasattr("__arrow_c_array__")? {
        let pair = obj.call_method0("__arrow_c_array__")?;
        let pair = pair
            .cast::<PyTuple>()
            .map_err(|_| type_error(py, "__arrow_c_array__ must return a tuple"))?;
        if pair.len() != 2 {
            return Err(type_error(
                py,
                "__arrow_c_array__ must return (schema capsule, array capsule)",
            ));
        }
        let schema: *mut FFI_ArrowSchema = capsule_ptr(&pair.get_item(0)?, c"arrow_schema")?;
        let array: *mut FFI_ArrowArray = capsule_ptr(&pair.get_item(1)?, c"arrow_array")?;
        // SAFETY: the capsules hold valid C data interface structs (their names were checked).
        // `from_raw` moves the array out and marks the capsule's copy released, as the PyCapsule
        // protocol prescribes for consumers; the schema is only borrowed (its capsule frees it).
        let data = unsafe {
            let array = FFI_ArrowArray::from_raw(array);
            from_ffi(array, &*schema)
        }
        .map_err(|e| invalid(py, format!("cannot import the Arrow array: {e}")))?;
        // A plain array (one column) is not a batch: `StructArray::from` would panic on it.
        if !matches!(data.data_type(), DataType::Struct(_)) {
            return Err(type_error(
                py,
                format!(
                    "expected a record batch or table, got an Arrow array of type {}",
                    data.data_type()
                ),
            ));
        }
        let array = StructArray::from(data);
        if array.null_count() > 0 {
            return Err(invalid(py, "the Arrow record batch has null rows"));
        }
        return Ok(RecordBatch::from(array));
    }
    if obj.hasattr("__arrow_c_stream__")? {
        let capsule = obj.call_method0("__arrow_c_stream__")?;
        let stream: *mut FFI_ArrowArrayStream = capsule_ptr(&capsule, c"arrow_array_stream")?;
        // SAFETY: a valid C stream interface struct; `from_raw` takes it over and leaves the
        // capsule's copy released.
        let reader = unsafe { RecordBatchStreamReader::from_raw(stream) }
            .map_err(|e| invalid(py, format!("cannot import the Arrow stream (a record batch or table is expected, not a column): {e}")))?;
        let schema = reader.schema();
        let batches: Vec<RecordBatch> = reader
            .collect::<Result<_, _>>()
            .map_err(|e| invalid(py, format!("reading the Arrow stream: {e}")))?;
        return match batches.len() {
            1 => Ok(batches.into_iter().next().expect("one batch")),
            // Several chunks are one local batch: concatenate (the only copy on this path).
            _ => arrow_select::concat::concat_batches(&schema, &batches)
                .map_err(|e| invalid(py, format!("concatenating the Arrow stream's batches: {e}"))),
        };
    }
    Err(type_error(py, format!(
        "expected an Arrow record batch or table (an object with __arrow_c_array__ or __arrow_c_stream__), got {}",
        obj.get_type().name()?
    )))
}
