//! The crate's one error type.
//!
//! The reference implementation aborts the process (`CHECK`, `LOG(FATAL)`) on most bad inputs.
//! A data loader cannot recover from that, so every such condition is a variant here, and every
//! message names what a caller needs to fix it: the stack, table, feature or column, the offending
//! value and the limit it broke. Where the reference has a message, ours contains its key phrase
//! (for example "is greater than the set max ids per partition"), so logs and tests written
//! against the reference keep matching.

use std::fmt;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which per-partition limit a batch exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    /// `max_ids_per_partition`: de-duplicated (sample, id) pairs one SparseCore sends to one
    /// partition.
    MaxIds,
    /// `max_unique_ids_per_partition`: distinct ids one SparseCore sends to one partition.
    MaxUniqueIds,
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitKind::MaxIds => "max ids per partition",
            LimitKind::MaxUniqueIds => "max unique ids per partition",
        })
    }
}

/// The kind of config entry an [`Error::InvalidConfig`] or [`Error::InvalidLimit`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConfigItem {
    /// An entry of `tables`.
    Table,
    /// An entry of `features`.
    Feature,
    /// A stack of tables (or of features, under feature stacking).
    Stack,
}

impl fmt::Display for ConfigItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConfigItem::Table => "table",
            ConfigItem::Feature => "feature",
            ConfigItem::Stack => "stack",
        })
    }
}

/// Which bound an [`Error::NpzMemberTooLarge`] broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NpzBound {
    /// The most one member may decompress to.
    Member,
    /// What the member's own `.npy` header declares (header plus data): bytes past it are no
    /// part of the array.
    Declared,
    /// The most a `.npy` header may take (numpy's own headers take a few hundred bytes).
    Header,
}

impl fmt::Display for NpzBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NpzBound::Member => "decompressed, past the limit on one member of",
            NpzBound::Declared => "decompressed, more than its .npy header declares:",
            NpzBound::Header => "of .npy header, past the header limit of",
        })
    }
}

/// What a [`Error::BatchTooLarge`] counted: each is bounded by the sort key's 26-bit payload
/// (per device or per SparseCore) or by the stack's row offsets built from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BatchCount {
    /// One device's samples of the stack.
    Samples,
    /// One SparseCore's weighted ids: the reference's payload is their extraction index.
    WeightedIds,
    /// The stack's global samples, over all its features.
    GlobalSamples,
    /// A resolved plan's `row_offset`: the stack's global samples before one feature.
    RowOffset,
}

impl fmt::Display for BatchCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BatchCount::Samples => "samples",
            BatchCount::WeightedIds => "weighted ids in one SparseCore",
            BatchCount::GlobalSamples => "global samples",
            BatchCount::RowOffset => "global samples before this feature (row_offset)",
        })
    }
}

/// Everything that can go wrong between a config, a batch and its buffers.
///
/// Variants are grouped by the stage that detects them: the config and planner (`spec`), the
/// input views (`input`), extraction (`extract`) and grouping (`group`). No variant is ever the
/// result of a bug in well-formed input; those would be panics, and the crate has none on user
/// data.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device-layout or option value is out of range (L, G, S, sharding strategy, ...).
    #[error("invalid option `{option}` = {value}: {reason}")]
    InvalidOption {
        /// The option's config key.
        option: &'static str,
        /// The value given, rendered as text.
        value: String,
        /// What was expected.
        reason: String,
    },

    /// `G * S` is not a power of two; the partition index is taken with a bit mask.
    #[error(
        "Total number of SparseCores (N = global_device_count {global_devices} * num_sc_per_device \
         {sc_per_device} = {num_scs}) must be a power of 2"
    )]
    NotPowerOfTwo {
        /// G.
        global_devices: usize,
        /// S.
        sc_per_device: usize,
        /// G * S.
        num_scs: usize,
    },

    /// The config is inconsistent: an unknown table, a duplicate name, a bad combiner, ...
    #[error("invalid config: {what} `{name}`: {reason}")]
    InvalidConfig {
        /// Which kind of entry.
        what: ConfigItem,
        /// Its name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A table or stack limit is unusable (zero, or too large for the 32-bit buffers).
    #[error("invalid limit for {what} `{name}`: {limit} = {value}; {reason}")]
    InvalidLimit {
        /// A table or a stack (limits belong to no feature).
        what: ConfigItem,
        /// Its name.
        name: String,
        /// Which limit.
        limit: &'static str,
        /// The configured value.
        value: u64,
        /// What is allowed.
        reason: String,
    },

    /// The suggested COO buffer size exceeds what the limits can ever fill. The message holds
    /// the reference's abort line word for word (a case that records it matches on it), which
    /// names the stack by its first feature, then our own account of the numbers.
    #[error(
        "stack `{stack}`: Check failed: suggested_value <= theoretical_max Suggested Coo Buffer Size is larger than the \
         theoretical max for table {feature}: {rounded} vs {theoretical}. Adjust the suggested size or the \
         max_ids_per_partition values. (suggested_coo_buffer_size_per_device {suggested}, rounded up to {rounded}, \
         a multiple of 8 * num_sc_per_device; lower it or raise max_ids_per_partition)"
    )]
    SuggestedBufferTooLarge {
        /// Stack name.
        stack: String,
        /// First feature of the stack, by which the reference's words name it.
        feature: String,
        /// The configured suggestion.
        suggested: u64,
        /// The suggestion rounded up to a multiple of 8 * S.
        rounded: u64,
        /// `roundup(max_ids, 8) * S * N`.
        theoretical: u64,
    },

    /// The COO buffer size does not fit the 32-bit buffers (or is zero). The message holds the
    /// reference's abort line word for word, as for [`Error::SuggestedBufferTooLarge`].
    #[error(
        "stack `{stack}`: Check failed: computed_coo_buffer_size_per_device > 0 && computed_coo_buffer_size_per_device < \
         INT_MAX Computed Coo Buffer Size ({size}) for table {feature} is out of the valid range (0, INT_MAX). (COO \
         buffer size per device {size} must be in (0, 2147483647); lower max_ids_per_partition or set \
         suggested_coo_buffer_size_per_device)"
    )]
    BufferSizeOutOfRange {
        /// Stack name.
        stack: String,
        /// First feature of the stack, by which the reference's words name it.
        feature: String,
        /// The computed size.
        size: u64,
    },

    /// An output array of a stack cannot be allocated: the config is valid, but `L * C` (or
    /// `L * RP`, `L * N`) elements are more than this machine can hold. The reference would
    /// abort on the allocation; we fail before writing anything.
    #[error(
        "stack `{stack}`: cannot allocate the output array {array} of {elements} elements \
         ({local_devices} local devices); lower local_device_count, max_ids_per_partition or \
         suggested_coo_buffer_size_per_device"
    )]
    OutputTooLarge {
        /// Stack name.
        stack: String,
        /// Which array (`row_pointers`, `embedding_ids`, ..., `max_ids_per_partition`).
        array: &'static str,
        /// L.
        local_devices: usize,
        /// Elements asked for (`u64::MAX` when the count itself overflows).
        elements: u64,
    },

    /// The number of inputs handed to the preprocessor does not match the config's features.
    #[error("expected {expected} feature inputs (one per config feature), got {got}")]
    InputCount {
        /// Features in the config.
        expected: usize,
        /// Inputs given.
        got: usize,
    },

    /// The config has no features, so there is nothing to preprocess.
    #[error("input_batches cannot be empty: the config has no features")]
    NoFeatures,

    /// A stack's per-device batch exceeds the 26-bit payload of the sort key.
    #[error(
        "stack `{stack}`: {count} {what} on one device exceeds the maximum limit supported by the \
         SparseCore CooFormat sorting key ({limit})"
    )]
    BatchTooLarge {
        /// Stack name.
        stack: String,
        /// What was counted.
        what: BatchCount,
        /// The observed count.
        count: u64,
        /// 2^26 - 1.
        limit: u64,
    },

    /// A config or stats file holds a field its format does not know (a typo, most often).
    #[error("unknown field `{field}` in {location}{}", did_you_mean(.suggestion))]
    UnknownField {
        /// The field as written.
        field: String,
        /// Where it is: "table `t03`", "the config", "stack `s0`".
        location: String,
        /// The known field closest to it, when one is close.
        suggestion: Option<String>,
    },

    /// A stack's per-device batch does not split evenly over the SparseCores. The message holds
    /// the reference's abort line word for word, which names the stack by its first feature.
    #[error(
        "stack `{stack}` (first feature `{feature}`): Check failed: batch_size_for_device % num_sc_per_device == 0 \
         ({} vs. 0) batch_size_for_device ({batch}) for stacked table '{feature}' must be divisible by \
         num_sc_per_device ({sc_per_device}).",
        (*.batch).checked_rem(*.sc_per_device).unwrap_or(0)
    )]
    BatchNotDivisible {
        /// Stack name.
        stack: String,
        /// First feature of the stack.
        feature: String,
        /// Per-device stacked batch.
        batch: usize,
        /// S.
        sc_per_device: usize,
    },

    /// A stack's per-device batch gives some SparseCore no sample of some feature (or the batch
    /// is empty: `batch` 0).
    #[error("stack `{stack}`: {}", batch_too_small(*.batch, *.sc_per_device, *.features))]
    BatchTooSmall {
        /// Stack name.
        stack: String,
        /// Per-device stacked batch.
        batch: usize,
        /// S.
        sc_per_device: usize,
        /// Features in the stack.
        features: usize,
    },

    /// An id is negative or not below its table's vocabulary size.
    #[error(
        "feature `{feature}` (table `{table}`), sample row {row}: id {id} is outside \
         [0, vocabulary_size {vocabulary_size})"
    )]
    IdOutOfRange {
        /// Feature name.
        feature: String,
        /// Table name.
        table: String,
        /// Sample row in the feature's local batch.
        row: usize,
        /// The id.
        id: i64,
        /// The table's vocabulary size.
        vocabulary_size: u64,
    },

    /// A weight is NaN or infinite.
    #[error("feature `{feature}`, sample row {row}: weight {value} is not finite")]
    InvalidWeight {
        /// Feature name.
        feature: String,
        /// Sample row.
        row: usize,
        /// The weight.
        value: f32,
    },

    /// A weights row does not have as many entries as its ids row.
    #[error(
        "feature `{feature}`, sample row {row}: {weights} weights for {ids} ids (the weights must \
         have the ids' shape)"
    )]
    WeightsShape {
        /// Feature name.
        feature: String,
        /// Sample row.
        row: usize,
        /// Ids in the row.
        ids: usize,
        /// Weights in the row.
        weights: usize,
    },

    /// A structurally invalid input: decreasing row splits, unsorted COO indices, ...
    #[error("feature `{feature}`: invalid input: {reason}")]
    InvalidInput {
        /// Feature name (or the column, for Arrow input).
        feature: String,
        /// What is wrong.
        reason: String,
    },

    /// Invalid data that is no feature's input: a file's contents (an `.npz` member, a CSV
    /// row), a window of record batches, a permutation.
    #[error("{what}: {reason}")]
    InvalidData {
        /// The file, member or object at fault, as the message names it.
        what: String,
        /// What is wrong.
        reason: String,
    },

    /// An `.npz` member is larger than its reader accepts. The zip's declared size is what one
    /// member decompresses to, so it is checked before a byte is inflated: a deflate bomb (a
    /// small array followed by gigabytes of zeros, about 1000:1) would otherwise be read whole.
    #[error("{file}: member `{member}`: {size} bytes {bound} {limit}")]
    NpzMemberTooLarge {
        /// The `.npz` file.
        file: String,
        /// The member, by the name `np.load` gives it (without `.npy`).
        member: String,
        /// Its size in bytes: decompressed, or of its `.npy` header.
        size: u64,
        /// Which bound it broke.
        bound: NpzBound,
        /// The bound in bytes.
        limit: u64,
    },

    /// An Arrow column named by the config is absent from the record batch.
    #[error("feature `{feature}`: column `{column}` not found in the record batch (columns: {available})")]
    MissingColumn {
        /// Feature name.
        feature: String,
        /// Column name from the config.
        column: String,
        /// The batch's column names.
        available: String,
    },

    /// An Arrow column has the wrong data type.
    #[error("feature `{feature}`: column `{column}` has type {found}, expected {expected}")]
    ColumnType {
        /// Feature name.
        feature: String,
        /// Column name.
        column: String,
        /// The accepted types.
        expected: &'static str,
        /// The type found.
        found: String,
    },

    /// A partition received more ids than its limit and `allow_id_dropping` is off.
    #[error(
        "stack `{stack}`: Observed {kind}: {observed} (device {device}, SparseCore {sparsecore}, \
         partition {partition}) is greater than the set {kind}: {limit}. Use `allow_id_dropping` \
         or increase the limit"
    )]
    LimitExceeded {
        /// Stack name.
        stack: String,
        /// Which limit.
        kind: LimitKind,
        /// The largest count observed for that limit in this batch.
        observed: u32,
        /// The configured limit.
        limit: u32,
        /// Local device where it was observed.
        device: usize,
        /// Local SparseCore where it was observed.
        sparsecore: usize,
        /// Destination partition (global SparseCore).
        partition: usize,
    },

    /// A JSON document (config, case, stats) could not be parsed.
    #[error("{context}: {source}")]
    Json {
        /// Which document.
        context: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },

    /// A file could not be read or written.
    #[error("{context}: {source}")]
    Io {
        /// Which file and operation.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// Hosts could not agree (minibatching's cross-host OR): a peer is missing, slow or sent
    /// garbage.
    #[error("all-reduce under sync key {key}: {reason}")]
    AllReduce {
        /// The sync key (`2·batch_number` or `2·batch_number + 1`).
        key: u64,
        /// What went wrong, naming the peers.
        reason: String,
    },

    /// An error with the file (or other context) it happened in.
    #[error("{context}: {source}")]
    Context {
        /// Which file, batch or step.
        context: String,
        /// The underlying error.
        #[source]
        source: Box<Error>,
    },

    /// Arrow rejected a buffer or file.
    #[error("{context}: {source}")]
    Arrow {
        /// Which file or column.
        context: String,
        /// Arrow's error.
        #[source]
        source: arrow_schema::ArrowError,
    },
}

impl Error {
    /// Wraps the error with context (a file name, a batch index), keeping its kind reachable
    /// through [`Error::root`].
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    /// The innermost error, below any [`Error::Context`] wrappers.
    pub fn root(&self) -> &Error {
        match self {
            Error::Context { source, .. } => source.root(),
            other => other,
        }
    }

    /// An [`Error::InvalidOption`].
    pub fn option(
        option: &'static str,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Error::InvalidOption {
            option,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// An [`Error::InvalidConfig`].
    pub fn config(what: ConfigItem, name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            what,
            name: name.into(),
            reason: reason.into(),
        }
    }

    /// An [`Error::InvalidInput`].
    pub fn input(feature: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            feature: feature.into(),
            reason: reason.into(),
        }
    }

    /// An [`Error::InvalidData`].
    pub fn data(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidData {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// "; did you mean `x`?" for [`Error::UnknownField`].
fn did_you_mean(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean `{s}`?"))
        .unwrap_or_default()
}

/// The message of [`Error::BatchTooSmall`]: the reference's abort line word for word, preceded
/// by "empty batch" when there are no samples at all (the usual cause, and not what the
/// reference's words say), then the numbers in our words.
fn batch_too_small(batch: usize, sc_per_device: usize, features: usize) -> String {
    let empty = if batch == 0 {
        "empty batch (no samples): "
    } else {
        ""
    };
    let needed = sc_per_device.saturating_mul(features);
    format!(
        "{empty}Check failed: batch_size_for_device >= feature_slices_per_device * stacked_table_metadata.size() ({batch} vs. \
         {needed}) Batch size must be greater or equal to the number of features stacked together (per feature slice). \
         (per-device batch {batch} < num_sc_per_device {sc_per_device} * {features} features)"
    )
}
