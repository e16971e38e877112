//! The crate's `Error` as Python exceptions.
//!
//! Where the reference aborts the process (`CHECK`, `LOG(FATAL)`), we raise. The exception
//! classes are defined in Python (`sparsecore_prep/_errors.py`, exported by `sparsecore_prep`),
//! so that they pickle: an error raised in a `ProcessPoolExecutor`, Ray or Spark worker reaches
//! the parent as itself. This module looks them up there and raises them with our message, which
//! names the stack, feature or column, the value and the limit, and with the same facts as
//! fields. Every class derives from a standard exception (`ValueError`, `TypeError`), so code
//! written against the reference's catchable errors keeps working.

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use pyo3::BoundObject;
use sparsecore_kernel::{KernelError, PlanItem};
use sparsecore_prep::{BatchCount, ConfigItem, Error, LimitKind};

/// The package's exception classes, with the standard exception each derives from (raised
/// instead if the class cannot be found, which only a broken installation causes).
#[derive(Clone, Copy)]
pub enum Class {
    Config,
    InvalidInput,
    LimitExceeded,
    InputType,
}

impl Class {
    fn name(self) -> &'static str {
        match self {
            Class::Config => "ConfigError",
            Class::InvalidInput => "InvalidInputError",
            Class::LimitExceeded => "LimitExceededError",
            Class::InputType => "InputTypeError",
        }
    }

    fn fallback(self, message: String) -> PyErr {
        match self {
            Class::InputType => PyTypeError::new_err(message),
            _ => PyValueError::new_err(message),
        }
    }

    fn lookup<'py>(self, py: Python<'py>) -> PyResult<&'py Bound<'py, PyType>> {
        static CLASSES: [PyOnceLock<Py<PyType>>; 4] = [
            PyOnceLock::new(),
            PyOnceLock::new(),
            PyOnceLock::new(),
            PyOnceLock::new(),
        ];
        CLASSES[self as usize].import(py, "sparsecore_prep._errors", self.name())
    }
}

/// A `class(message, **fields)` exception; fields whose value is `None` are left out (they
/// default to None).
pub fn raise<'py>(
    py: Python<'py>,
    class: Class,
    message: String,
    fields: &[(&str, Option<Bound<'py, PyAny>>)],
) -> PyErr {
    let made = (|| -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(py);
        for (name, value) in fields {
            if let Some(value) = value {
                kwargs.set_item(name, value)?;
            }
        }
        class.lookup(py)?.call((message.as_str(),), Some(&kwargs))
    })();
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => class.fallback(message),
    }
}

/// `Some(value)` as a Python object, for [`raise`]'s fields.
pub fn field<'py, T: IntoPyObject<'py>>(py: Python<'py>, value: T) -> Option<Bound<'py, PyAny>> {
    value
        .into_pyobject(py)
        .ok()
        .map(|v| v.into_any().into_bound())
}

/// An [`Class::InvalidInput`] naming the feature, and the row and id when known (the id exactly
/// as given: any integer type converts).
pub fn invalid_input<'py, I: IntoPyObject<'py>>(
    py: Python<'py>,
    feature: &str,
    row: Option<usize>,
    id: Option<I>,
    message: String,
) -> PyErr {
    let id = id.and_then(|id| field(py, id));
    raise(
        py,
        Class::InvalidInput,
        message,
        &[
            ("feature", field(py, feature)),
            ("row", row.and_then(|r| field(py, r))),
            ("id", id),
        ],
    )
}

/// An [`Class::InputType`] naming the feature.
pub fn input_type(py: Python<'_>, feature: &str, message: String) -> PyErr {
    raise(
        py,
        Class::InputType,
        message,
        &[("feature", field(py, feature))],
    )
}

/// Maps an error to the package's exception for it, keeping our message and the error's facts
/// as fields.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    let f = |v: &str| field(py, v);
    let config = |field_name: Option<&str>, location: Option<String>| {
        raise(
            py,
            Class::Config,
            message.clone(),
            &[
                ("field", field_name.and_then(f)),
                ("location", location.and_then(|l| field(py, l))),
            ],
        )
    };
    match e.root() {
        Error::LimitExceeded {
            stack,
            kind,
            observed,
            limit,
            device,
            sparsecore,
            partition,
        } => {
            let kind = match kind {
                LimitKind::MaxIds => "max_ids_per_partition",
                LimitKind::MaxUniqueIds => "max_unique_ids_per_partition",
            };
            raise(
                py,
                Class::LimitExceeded,
                message,
                &[
                    ("stack", f(stack)),
                    ("limit_name", f(kind)),
                    ("observed", field(py, *observed)),
                    ("limit", field(py, *limit)),
                    ("device", field(py, *device)),
                    ("sparsecore", field(py, *sparsecore)),
                    ("partition", field(py, *partition)),
                ],
            )
        }
        Error::IdOutOfRange {
            feature, row, id, ..
        } => invalid_input(py, feature, Some(*row), Some(*id), message),
        Error::InvalidWeight { feature, row, .. } | Error::WeightsShape { feature, row, .. } => {
            invalid_input(py, feature, Some(*row), None::<i64>, message)
        }
        Error::InvalidInput { feature, .. }
        | Error::MissingColumn { feature, .. }
        | Error::BatchNotDivisible { feature, .. } => {
            invalid_input(py, feature, None, None::<i64>, message)
        }
        // One device's samples over the sort key's payload: the reference's current text (0.1.0
        // aborted).
        Error::BatchTooLarge {
            what: BatchCount::Samples,
            limit,
            ..
        } => raise(
            py,
            Class::InvalidInput,
            format!(
                "The total local batch size for device (including stacked tables) exceeds the \
                 maximum limit supported by the SparseCore CooFormat sorting key ({limit})."
            ),
            &[],
        ),
        Error::BatchTooSmall { .. }
        | Error::BatchTooLarge { .. }
        | Error::InputCount { .. }
        | Error::Arrow { .. }
        | Error::InvalidData { .. }
        | Error::NpzMemberTooLarge { .. } => raise(py, Class::InvalidInput, message, &[]),
        Error::ColumnType {
            feature, column, ..
        } => raise(
            py,
            Class::InputType,
            message,
            &[("feature", f(feature)), ("column", f(column))],
        ),
        Error::UnknownField {
            field: name,
            location,
            suggestion,
        } => raise(
            py,
            Class::Config,
            message,
            &[
                ("field", f(name)),
                ("location", f(location)),
                ("suggestion", suggestion.as_deref().and_then(f)),
            ],
        ),
        Error::InvalidOption { option, .. } => config(Some(option), None),
        Error::InvalidConfig { what, name, .. } => config(None, Some(format!("{what} `{name}`"))),
        Error::InvalidLimit {
            what, name, limit, ..
        } => config(Some(limit), Some(format!("{what} `{name}`"))),
        Error::SuggestedBufferTooLarge { stack, .. } => config(
            Some("suggested_coo_buffer_size_per_device"),
            Some(format!("stack `{stack}`")),
        ),
        Error::BufferSizeOutOfRange { stack, .. } | Error::OutputTooLarge { stack, .. } => {
            config(None, Some(format!("stack `{stack}`")))
        }
        Error::NotPowerOfTwo { .. } => config(Some("num_sc_per_device"), None),
        Error::NoFeatures => config(Some("features"), None),
        Error::Json { context, .. } => config(None, Some(context.clone())),
        // Not the data's or the config's fault (and not reachable from Python today).
        Error::Io { .. } => PyOSError::new_err(message),
        Error::AllReduce { .. } => PyRuntimeError::new_err(message),
        _ => PyValueError::new_err(message),
    }
}

/// The kernel crate's error as the pipeline error it corresponds to (the same exception classes
/// and fields as before the kernel had an error type of its own), or itself when there is none.
fn kernel_as_pipeline(e: KernelError) -> std::result::Result<Error, KernelError> {
    Ok(match e {
        // The exception's `feature` field has held the subject's name since before subjects were typed.
        KernelError::InvalidInput { subject, reason } => Error::InvalidInput {
            feature: subject.name().to_string(),
            reason,
        },
        KernelError::Plan { kind, name, reason } => match kind {
            PlanItem::Stack => Error::InvalidConfig {
                what: ConfigItem::Stack,
                name,
                reason,
            },
            PlanItem::Feature => Error::InvalidConfig {
                what: ConfigItem::Feature,
                name,
                reason,
            },
            PlanItem::Table => Error::InvalidConfig {
                what: ConfigItem::Table,
                name,
                reason,
            },
            // Python binds no dynamic tables: such an error (or a kind added later) stays the
            // kernel's own, with its own message and class.
            other => {
                return Err(KernelError::Plan {
                    kind: other,
                    name,
                    reason,
                })
            }
        },
        KernelError::Parameter {
            name,
            value,
            reason,
        } => Error::InvalidOption {
            option: name,
            value,
            reason,
        },
        KernelError::InvalidWeight {
            feature,
            row,
            value,
        } => Error::InvalidWeight {
            feature,
            row,
            value,
        },
        KernelError::Context { context, source } => kernel_as_pipeline(*source)?.context(context),
        KernelError::Pipeline(e) => e,
        other => return Err(other),
    })
}

/// Maps a kernel error to the package's exception for it (see [`to_py`]).
pub fn kernel_to_py(py: Python<'_>, e: KernelError) -> PyErr {
    match kernel_as_pipeline(e) {
        Ok(e) => to_py(py, e),
        Err(e) => PyRuntimeError::new_err(e.to_string()),
    }
}
