//! Arrow record batches to Python through the Arrow PyCapsule interface (`__arrow_c_array__`),
//! the export half of [`crate::arrow_input`]: `sparsecore_prep.bess.BessStream` and
//! `Preprocessor.balance` hand their batches to pyarrow (`pyarrow.record_batch(obj)`) without
//! copying, and without linking pyarrow: the exported structs keep the Rust buffers alive until
//! pyarrow releases them.

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::{Array, RecordBatch, StructArray};
use arrow_schema::DataType;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

use crate::errors::{raise, Class};

/// One record batch, exported once through `__arrow_c_array__`.
#[pyclass(module = "sparsecore_prep._native")]
pub struct ArrowBatch {
    batch: Option<RecordBatch>,
}

#[pymethods]
impl ArrowBatch {
    /// The Arrow PyCapsule protocol: `(schema capsule, array capsule)` of a struct array whose
    /// children are the columns. `requested_schema` is ignored (the schema is what it is).
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_array__<'py>(
        &mut self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let _ = requested_schema;
        let batch = self.batch.take().ok_or_else(|| {
            raise(
                py,
                Class::InvalidInput,
                "this Arrow batch was already exported".into(),
                &[],
            )
        })?;
        let fields = batch.schema().fields().clone();
        let data = StructArray::from(batch).into_data();
        let schema = FFI_ArrowSchema::try_from(DataType::Struct(fields)).map_err(|e| {
            raise(
                py,
                Class::InvalidInput,
                format!("cannot export the Arrow schema: {e}"),
                &[],
            )
        })?;
        let array = FFI_ArrowArray::new(&data);
        // The capsules own the structs; a consumer moves them out (leaving `release` null, so
        // their drop is a no-op), and a capsule never consumed releases them when it is freed.
        let schema = PyCapsule::new_with_value(py, schema, c"arrow_schema")?;
        let array = PyCapsule::new_with_value(py, array, c"arrow_array")?;
        PyTuple::new(py, [schema.into_any(), array.into_any()])
    }
}

/// A `pyarrow.RecordBatch` viewing `batch`'s buffers.
pub fn to_pyarrow(py: Python<'_>, batch: RecordBatch) -> PyResult<Bound<'_, PyAny>> {
    let exporter = Bound::new(py, ArrowBatch { batch: Some(batch) })?;
    py.import("pyarrow")?
        .call_method1("record_batch", (exporter,))
}
