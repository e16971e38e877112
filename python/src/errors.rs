//! The crate's `Error` as Python exceptions.
//!
//! Where the reference aborts the process (`CHECK`, `LOG(FATAL)`), we raise. Every exception
//! derives from a standard one (`ValueError`, `TypeError`, `OSError`, `RuntimeError`), so code
//! written against the reference's catchable errors keeps working, and carries our message,
//! which names the stack, feature or column, the value and the limit.

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use sparsecore_prep::{Error, LimitKind};

create_exception!(
    _native,
    LimitExceededError,
    PyValueError,
    "A partition received more ids than its limit and `allow_id_dropping` is off (the reference \
     aborts the process here). Attributes: stack, limit_name, observed, limit, device, sparsecore, \
     partition."
);
create_exception!(
    _native,
    InvalidInputError,
    PyValueError,
    "An input the pipeline cannot use: an id outside its table, a non-finite weight, weights of \
     another shape, a batch that does not split over the SparseCores."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LimitExceededError", py.get_type::<LimitExceededError>())?;
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    Ok(())
}

/// Maps an error to the closest Python exception, keeping our message.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    match e.root() {
        Error::LimitExceeded { stack, kind, observed, limit, device, sc, partition } => {
            let err = LimitExceededError::new_err(message);
            let value = err.value(py);
            let kind = match kind {
                LimitKind::MaxIds => "max_ids_per_partition",
                LimitKind::MaxUniqueIds => "max_unique_ids_per_partition",
            };
            // Attributes for callers that retune; setting them cannot fail on a fresh exception.
            let _ = value.setattr("stack", stack.as_str());
            let _ = value.setattr("limit_name", kind);
            let _ = value.setattr("observed", *observed);
            let _ = value.setattr("limit", *limit);
            let _ = value.setattr("device", *device);
            let _ = value.setattr("sparsecore", *sc);
            let _ = value.setattr("partition", *partition);
            err
        }
        Error::IdOutOfRange { .. }
        | Error::InvalidWeight { .. }
        | Error::WeightsShape { .. }
        | Error::InvalidInput { .. }
        | Error::BatchNotDivisible { .. }
        | Error::BatchTooSmall { .. }
        | Error::MissingColumn { .. } => InvalidInputError::new_err(message),
        Error::ColumnType { .. } => PyTypeError::new_err(message),
        Error::Io { .. } => PyOSError::new_err(message),
        Error::AllReduce { .. } => PyRuntimeError::new_err(message),
        _ => PyValueError::new_err(message),
    }
}
