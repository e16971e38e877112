//! The command line's one error type.
//!
//! Every subcommand returns it, so `main` reports every failure the same way: one line on
//! stderr, status 1. The errors of the crates underneath pass through unchanged (their messages
//! already name the feature, table, column, value and limit); the variants of our own are what
//! only the command line knows: which flags go together, and which file a failure was in.

use std::path::PathBuf;

/// Every subcommand's `run` returns it, so `main` has one error type to print.
pub type Result<T> = std::result::Result<T, CliError>;

/// A failure of a subcommand. Messages are matched by the CLI tests: keep their words.
///
/// BESS's errors are boxed: unboxed, one of them and a path would make every `Result` of the
/// command line larger than clippy's `result_large_err` allows.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The pipeline's errors, as the library words them (they carry their file as context).
    #[error(transparent)]
    Prep(#[from] sparsecore_prep::Error),

    /// The dynamic tables' errors (`dynamic load`), which name their batch themselves.
    #[error(transparent)]
    Kernel(#[from] sparsecore_kernel::KernelError),

    /// A flag's value that clap accepts by its type but that is out of range, or that does not
    /// fit the other flags or the files they name.
    #[error("{flag} {value}: {reason}")]
    Argument {
        /// The flag, with its dashes (`--steps`).
        flag: &'static str,
        /// The value given.
        value: String,
        /// What is allowed instead.
        reason: String,
    },

    /// A stack the command cannot use as the config and its files give it.
    #[error("stack `{stack}`: {reason}")]
    Stack {
        /// The stack's name.
        stack: String,
        /// What is wrong, naming the files involved.
        reason: String,
    },

    /// A stream whose step needs more memory than `--max-step-bytes` allows: the flag's own
    /// words, not the library's builder parameter, and no blame on the triples file.
    #[error("--max-step-bytes {cap}: {what} needs {bytes} bytes")]
    StepTooLarge {
        /// The cap given.
        cap: usize,
        /// The step, with the parameters its size follows from.
        what: String,
        /// The bytes it needs, at least.
        bytes: u128,
    },

    /// A flag given without the choice it refines.
    #[error("{flag} applies to {requires} only")]
    OnlyWith {
        /// The flag given (`--shuffle`).
        flag: &'static str,
        /// The flag and value it needs (`--sampler rigid`).
        requires: &'static str,
    },

    /// Of several flags that say the same thing one way or another, none was given.
    #[error("{command}: give {choices}")]
    MissingArgument {
        /// The subcommand (`bess shard create`).
        command: &'static str,
        /// The flags to choose from, with their values' shapes.
        choices: &'static str,
    },

    /// `--out` and `--config-out` name one file: both are written through a temporary next to
    /// them, and the file would end up holding the config alone.
    #[error(
        "--out {} and --config-out {} are the same file ({}); give two different paths",
        out.display(),
        config_out.display(),
        resolved.display()
    )]
    SameFile {
        /// `--out` as given.
        out: PathBuf,
        /// `--config-out` as given.
        config_out: PathBuf,
        /// The file both resolve to.
        resolved: PathBuf,
    },

    /// The triples file could not be opened or read as Arrow IPC or Parquet.
    #[error("triples {}: {source}", path.display())]
    TriplesFile {
        /// `--triples`.
        path: PathBuf,
        /// The reader's error.
        #[source]
        source: sparsecore_prep::Error,
    },

    /// The triples file has record batches but no rows in any of them.
    #[error("triples {}: no triples", path.display())]
    NoTriples {
        /// `--triples`.
        path: PathBuf,
    },

    /// BESS rejected the triples, or the batches drawn from them with the other flags.
    #[error("triples {}: {source}", path.display())]
    Triples {
        /// `--triples`.
        path: PathBuf,
        /// BESS's error.
        #[source]
        source: Box<sparsecore_bess::BessError>,
    },

    /// One record batch of the triples file does not hold triples; its rows locate it.
    #[error("triples {}, record batch {batch} (rows {}..{}): {source}", path.display(), rows.start, rows.end)]
    TriplesBatch {
        /// `--triples`.
        path: PathBuf,
        /// Index of the record batch in the file.
        batch: usize,
        /// Its rows, counted from the file's first.
        rows: std::ops::Range<usize>,
        /// BESS's error.
        #[source]
        source: Box<sparsecore_bess::BessError>,
    },

    /// A sharding file could not be read or written.
    #[error("{action} {}: {source}", path.display())]
    ShardingFile {
        /// What the file was for.
        action: ShardingUse,
        /// The `.npz` file.
        path: PathBuf,
        /// BESS's error.
        #[source]
        source: Box<sparsecore_bess::BessError>,
    },

    /// `bess shard create`'s entities, shards and types do not make a sharding.
    #[error("creating the sharding: {source}")]
    CreateSharding {
        /// BESS's error.
        #[source]
        source: Box<sparsecore_bess::BessError>,
    },

    /// Arrow could not write an output file.
    #[error("writing {}: {source}", path.display())]
    WriteArrow {
        /// The file.
        path: PathBuf,
        /// Arrow's error.
        #[source]
        source: arrow_schema::ArrowError,
    },

    /// An output file could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file (its temporary name, when it is renamed once complete).
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A column of a record batch is not of the type its name promises.
    #[error("column `{column}` {reason}")]
    Column {
        /// The column name.
        column: String,
        /// What it is not.
        reason: ColumnProblem,
    },
}

/// What a [`CliError::ShardingFile`] was being used for; its message starts with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardingUse {
    /// `bess shard show` (and `convert`) reading it.
    Read,
    /// `bess shard create` writing it.
    Write,
    /// `bess batches --sharding` loading it for the stream.
    Batches,
}

impl std::fmt::Display for ShardingUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardingUse::Read => "reading",
            ShardingUse::Write => "writing",
            ShardingUse::Batches => "sharding",
        })
    }
}

/// How a [`CliError::Column`] differs from the list of Int64 ids its name promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnProblem {
    /// Not a list array.
    NotAList,
    /// A list whose values are not Int64.
    NotInt64,
}

impl std::fmt::Display for ColumnProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ColumnProblem::NotAList => "is not a list",
            ColumnProblem::NotInt64 => "does not hold Int64",
        })
    }
}

/// An I/O error with context.
pub fn io_err(context: String) -> impl FnOnce(std::io::Error) -> sparsecore_prep::Error {
    move |source| sparsecore_prep::Error::Io { context, source }
}
