//! The crate's one error type.
//!
//! besskge asserts, raises a bare `IndexError` or silently samples the wrong partition on bad
//! input; a data loader feeding SparseCores needs to know which column and which value to fix.
//! Every bad input is a variant here, never a panic.

/// Result alias of the crate.
pub type Result<T, E = BessError> = std::result::Result<T, E>;

/// Everything that can go wrong between triples, a sharding, the samplers and the SparseCore
/// layout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BessError {
    /// An entity id is negative or not below the number of entities.
    #[error("column `{column}`, row {row}: entity id {value} is outside 0..{n_entity}")]
    EntityOutOfRange {
        /// Column (or list) the id came from: `head`, `tail`, `neg_heads`, ...
        column: String,
        /// Row of the value.
        row: usize,
        /// The id.
        value: i64,
        /// Number of entities.
        n_entity: usize,
    },

    /// A relation id is negative, or not below the number of relation types when that is given.
    #[error("column `{column}`, row {row}: relation id {value} is outside 0..{n_relation}")]
    RelationOutOfRange {
        /// Column name.
        column: String,
        /// Row of the value.
        row: usize,
        /// The id.
        value: i64,
        /// Number of relation types (i32::MAX when not given).
        n_relation: i64,
    },

    /// Two columns (or lists) that must have one value per triple differ in length.
    #[error("column `{column}` has {got} rows but column `{other}` has {expected}")]
    LengthMismatch {
        /// The column whose length is off.
        column: String,
        /// Its length.
        got: usize,
        /// The column it is compared with.
        other: String,
        /// That column's length.
        expected: usize,
    },

    /// A required column is missing from a record batch.
    #[error("missing column `{column}` (expected Int32 or Int64)")]
    MissingColumn {
        /// The column name.
        column: String,
    },

    /// A column has an unsupported Arrow type.
    #[error("column `{column}` has type {found}; expected Int32 or Int64")]
    ColumnType {
        /// The column name.
        column: String,
        /// The Arrow type found.
        found: String,
    },

    /// A column holds a null.
    #[error("column `{column}`, row {row}: null value")]
    NullValue {
        /// The column name.
        column: String,
        /// The row.
        row: usize,
    },

    /// A partition (shard pair, or shard) has no triples where the sampler needs some.
    #[error(
        "{sampler}: partition {partition} has no triples; every partition needs at least one \
         (besskge would silently sample another partition's triples)"
    )]
    EmptyPartition {
        /// Which sampler or layout refused it.
        sampler: &'static str,
        /// The partition, as `(head shard, tail shard)` or `shard`.
        partition: String,
    },

    /// The batch geometry gives zero positive triples per partition block.
    #[error(
        "shard batch size {shard_bs} gives {positive_per_partition} triples per block (n = {n_shard} shards, \
         duplicate_batch = {duplicate_batch}, corruption `{corruption}`); use a shard batch size \
         of at least {minimum}"
    )]
    ZeroTriplesPerBlock {
        /// The shard batch size given.
        shard_bs: usize,
        /// Triples per partition block it gives (besskge's `ppp`).
        positive_per_partition: usize,
        /// Number of shards.
        n_shard: usize,
        /// Whether batches are duplicated.
        duplicate_batch: bool,
        /// The corruption scheme.
        corruption: &'static str,
        /// The smallest shard batch size that gives at least one triple per block.
        minimum: usize,
    },

    /// The number of shards is not the number of SparseCores of the layout.
    #[error(
        "the sharding has n = {n_shard} shards but the layout has N = global_device_count \
         {global_devices} * num_sc_per_device {sc_per_device} = {num_sparsecores} SparseCores; \
         BESS on SparseCores needs one shard per SparseCore"
    )]
    ShardCountMismatch {
        /// Shards of the sharding.
        n_shard: usize,
        /// N = G * S.
        num_sparsecores: usize,
        /// G.
        global_devices: usize,
        /// S.
        sc_per_device: usize,
    },

    /// A parameter is out of range.
    #[error("invalid `{name}` = {value}: {reason}")]
    InvalidParameter {
        /// Parameter name.
        name: &'static str,
        /// The value, as text.
        value: String,
        /// What is allowed.
        reason: String,
    },

    /// What a stream needs for a step is more memory than it may use or the allocator gives:
    /// refused before drawing, instead of aborting the process on a failed allocation.
    #[error("{what} needs {bytes} bytes ({:.2} GiB): {reason}", gib(.bytes))]
    TooLarge {
        /// What needs the memory, with the parameters it follows from (negatives, shard batch
        /// size, layout).
        what: String,
        /// The bytes needed (at least; an estimate from below for a whole step).
        bytes: u128,
        /// Why it is refused: past `max_step_bytes`, or the allocator refused it.
        reason: String,
    },

    /// A sharding file (`.npz`) is malformed.
    #[error("sharding file {path}: {reason}")]
    ShardingFile {
        /// File path.
        path: String,
        /// What is wrong.
        reason: String,
    },

    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },

    /// Building Arrow arrays or record batches failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),

    /// The preprocessing pipeline refused the config or a batch.
    #[error(transparent)]
    Prep(#[from] sparsecore_prep::Error),
}

/// Bytes in GiB, for messages.
fn gib(bytes: &u128) -> f64 {
    *bytes as f64 / f64::from(1u32 << 30)
}

impl BessError {
    pub(crate) fn param(
        name: &'static str,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        BessError::InvalidParameter {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}
