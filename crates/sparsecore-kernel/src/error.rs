//! The kernel crate's one error type. Every message names the stack, table or feature, the value
//! and what it had to fit; errors of the pipeline (a config, a plan, a batch) pass through
//! unchanged as [`KernelError::Pipeline`].

use std::fmt;

/// A `Result` of the kernel crate.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Why a kernel call, a host table or a dynamic table refused its input.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// An array (table, slot variables, activations, gradients, offsets, weights) or a row that
    /// does not fit the plan or the table.
    #[error("{subject}: invalid input: {reason}")]
    InvalidInput {
        /// What the array or row belongs to.
        subject: Subject,
        /// What is wrong, with the shapes or indices involved.
        reason: String,
    },

    /// A stack, table or feature that the plan does not have, or that belongs elsewhere.
    #[error("invalid config: {kind} `{name}`: {reason}")]
    Plan {
        /// Which kind of entry.
        kind: PlanItem,
        /// Its name (or index).
        name: String,
        /// What does not match.
        reason: String,
    },

    /// An optimizer hyper-parameter or an option out of its range.
    #[error("invalid option `{name}` = {value}: {reason}")]
    Parameter {
        /// The parameter (`optimizer`, `replicas`, `embedding_var_limits`, ...).
        name: &'static str,
        /// The value given.
        value: String,
        /// The range it must be in.
        reason: String,
    },

    /// A weight that is not finite.
    #[error("feature `{feature}`, sample row {row}: weight {value} is not finite")]
    InvalidWeight {
        /// Feature name.
        feature: String,
        /// Sample (row) index.
        row: usize,
        /// The weight.
        value: f32,
    },

    /// A dynamic table's store failed. After a `Connection` or `Timeout` error the batch may or
    /// may not have been applied; retrying it under the same update id applies it exactly once.
    #[error("dynamic table `{table}` at {store}: {op}: {kind}: {reason}")]
    DynamicStore {
        /// Table name.
        table: String,
        /// The store (`memory`, or the server's address).
        store: String,
        /// The operation, with its size (e.g. "MGET of 512 keys").
        op: String,
        /// What kind of failure.
        kind: StoreErrorKind,
        /// The underlying message, with the limit that was hit (timeout, retries).
        reason: String,
    },

    /// An error with the batch, step or file it happened in.
    #[error("{context}: {source}")]
    Context {
        /// Which batch, step or file.
        context: String,
        /// The underlying error.
        #[source]
        source: Box<KernelError>,
    },

    /// The pipeline refused something (a config, a plan, a batch, an output).
    #[error(transparent)]
    Pipeline(#[from] sparsecore_prep::Error),
}

impl KernelError {
    /// Wraps the error with context (a batch index, an update id), keeping its kind reachable
    /// through [`KernelError::root`].
    pub fn context(self, context: impl Into<String>) -> Self {
        KernelError::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    /// The innermost error, below any [`KernelError::Context`] wrappers.
    pub fn root(&self) -> &KernelError {
        match self {
            KernelError::Context { source, .. } => source.root(),
            other => other,
        }
    }

    /// A [`KernelError::InvalidInput`].
    pub fn input(subject: Subject, reason: impl Into<String>) -> Self {
        KernelError::InvalidInput {
            subject,
            reason: reason.into(),
        }
    }

    /// A [`KernelError::Plan`].
    pub fn plan(kind: PlanItem, name: impl Into<String>, reason: impl Into<String>) -> Self {
        KernelError::Plan {
            kind,
            name: name.into(),
            reason: reason.into(),
        }
    }

    /// A [`KernelError::Parameter`].
    pub fn parameter(
        name: &'static str,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        KernelError::Parameter {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// What a [`KernelError::InvalidInput`] is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Subject {
    /// A stack of the plan: its buffers, table, slot variables, activations or gradients.
    Stack(String),
    /// A feature of the plan, or of a dynamic table's key batch.
    Feature(String),
    /// A dynamic table (raw keys, rows created lazily).
    DynamicTable(String),
    /// A host table split across replicas ([`crate::PartitionedTable`]).
    HostTable,
    /// A column of the caller's data (a label column, say).
    Column(String),
    /// An argument of the call, by name.
    Argument(&'static str),
}

impl Subject {
    /// The name it carries (the argument's name; "host table" for a host table).
    pub fn name(&self) -> &str {
        match self {
            Subject::Stack(n)
            | Subject::Feature(n)
            | Subject::DynamicTable(n)
            | Subject::Column(n) => n,
            Subject::HostTable => "host table",
            Subject::Argument(n) => n,
        }
    }
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Subject::Stack(n) => write!(f, "stack `{n}`"),
            Subject::Feature(n) => write!(f, "feature `{n}`"),
            Subject::DynamicTable(n) => write!(f, "dynamic table `{n}`"),
            Subject::HostTable => f.write_str("host table"),
            Subject::Column(n) => write!(f, "column `{n}`"),
            Subject::Argument(n) => write!(f, "argument `{n}`"),
        }
    }
}

/// The kind of entry a [`KernelError::Plan`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PlanItem {
    /// A stack of the plan (a stacked table).
    Stack,
    /// A feature of the plan.
    Feature,
    /// A table of the config.
    Table,
    /// A dynamic table's spec (raw keys, rows created lazily).
    DynamicTable,
}

impl fmt::Display for PlanItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlanItem::Stack => "stack",
            PlanItem::Feature => "feature",
            PlanItem::Table => "table",
            PlanItem::DynamicTable => "dynamic table",
        })
    }
}

/// Why a dynamic table's backing store failed ([`KernelError::DynamicStore`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreErrorKind {
    /// The server refused the connection, or dropped it (killed, restarted, network down).
    Connection,
    /// The server did not answer within the configured timeout.
    Timeout,
    /// A batch update kept conflicting with concurrent writers past the retry limit.
    Conflict,
    /// A stored value has the wrong size or a slot is missing (written by another table shape).
    Corrupt,
    /// The server answered with an error (out of memory, wrong type, read-only replica, ...).
    Server,
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreErrorKind::Connection => "connection error",
            StoreErrorKind::Timeout => "timed out",
            StoreErrorKind::Conflict => "too many conflicts",
            StoreErrorKind::Corrupt => "corrupt value",
            StoreErrorKind::Server => "server error",
        })
    }
}
