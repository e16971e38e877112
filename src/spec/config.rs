//! The JSON config: device layout, options, tables and features.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};

/// A whole config file: options, tables and features.
///
/// Unknown keys are ignored, so a golden case's `input.json` (which carries inline data and the
/// reference's resolved stacking next to these keys) parses as a config too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Device layout and preprocessing options.
    pub config: Options,
    /// Embedding tables.
    pub tables: Vec<TableConfig>,
    /// Features, in the order the reference would see them (its pytree order). Auto stacking
    /// depends on this order; feature stacking sorts same-table features by name.
    pub features: Vec<FeatureConfig>,
}

/// Device layout and preprocessing options (`"config"` in the JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Options {
    /// L: devices fed by this host.
    pub local_device_count: usize,
    /// G: devices in the job.
    pub global_device_count: usize,
    /// S: SparseCores per device.
    pub num_sc_per_device: usize,
    /// When a partition exceeds a limit: `false` returns [`Error::LimitExceeded`], `true` drops
    /// the excess ids and counts them. The reference's Python default is `false`.
    #[serde(default)]
    pub allow_id_dropping: bool,
    /// How tables are grouped into stacks.
    #[serde(default)]
    pub stacking: Stacking,
    /// Limits of multi-table stacks under auto stacking (the reference defaults both to 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_limits: Option<StackLimits>,
    /// Split batches that exceed a limit into up to 64 minibatches by column hash instead of
    /// dropping ids (SPEC 5). Multi-host jobs need an [`crate::AllReduce`].
    #[serde(default)]
    pub enable_minibatching: bool,
    /// Suggested COO buffer sizes set on stacks after stacking, by stack name (the reference's
    /// `update_preprocessing_parameters`). Overrides the tables' own suggestions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_suggested_coo_buffer_size_per_device: Option<BTreeMap<String, u64>>,
    /// Reject negative ids and ids `>= vocabulary_size` (the reference silently mis-places them).
    /// Turn off only for inputs already known to be valid.
    #[serde(default = "default_true")]
    pub validate_ids: bool,
    /// Only "MOD" exists; accepted for compatibility with the reference's option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding_strategy: Option<String>,
}

fn default_true() -> bool {
    true
}

/// Table grouping mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stacking {
    /// One stack per table; features sharing a table are stacked in feature-name order
    /// (`prepare_feature_specs_for_training`).
    #[default]
    Feature,
    /// Tables with the same padded dim and combiner are stacked, split at 2 MiB of activations
    /// (`auto_stack_tables`).
    Auto,
}

/// Limits applied to multi-table stacks under auto stacking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackLimits {
    /// Limit on de-duplicated ids per partition.
    #[serde(default = "default_limit")]
    pub max_ids_per_partition: u64,
    /// Limit on distinct ids per partition.
    #[serde(default = "default_limit")]
    pub max_unique_ids_per_partition: u64,
}

impl Default for StackLimits {
    fn default() -> Self {
        StackLimits { max_ids_per_partition: 256, max_unique_ids_per_partition: 256 }
    }
}

fn default_limit() -> u64 {
    256
}

/// One embedding table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableConfig {
    /// Unique table name.
    pub name: String,
    /// Rows of the table; valid ids are `0..vocabulary_size`.
    pub vocabulary_size: u64,
    /// Columns of the table (padded to 8 on the device).
    pub embedding_dim: u64,
    /// "sum", "mean" or "sqrtn".
    #[serde(default = "default_combiner")]
    pub combiner: String,
    /// Limit on de-duplicated ids one SparseCore sends to one partition.
    #[serde(default = "default_limit")]
    pub max_ids_per_partition: u64,
    /// Limit on distinct ids one SparseCore sends to one partition.
    #[serde(default = "default_limit")]
    pub max_unique_ids_per_partition: u64,
    /// COO buffer size per device, usually from FDO stats; `None` sizes it from the limits.
    #[serde(default)]
    pub suggested_coo_buffer_size_per_device: Option<u64>,
}

fn default_combiner() -> String {
    "sum".to_string()
}

/// One feature: a column of id lists looked up in one table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureConfig {
    /// Unique feature name.
    pub name: String,
    /// Name of the table it looks up.
    pub table: String,
    /// Arrow column of ids (`List<Int32|Int64>`, or raw keys with `hash`); defaults to the
    /// feature name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// Optional Arrow column of weights (`List<Float32>`, same shape as the ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_column: Option<String>,
    /// Raw keys: the column holds strings, bytes or arbitrary int64s, each mapped to
    /// `xxh3_64(key, seed) mod vocabulary_size` ([`crate::input::hash`]). Arrow input only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<HashConfig>,
}

impl FeatureConfig {
    /// The Arrow column holding this feature's ids.
    pub fn column_name(&self) -> &str {
        self.column.as_deref().unwrap_or(&self.name)
    }
}

impl Config {
    /// Parses a config from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|source| Error::Json { context: "config".into(), source })
    }

    /// Reads and parses a config file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::Io { context: format!("reading config {}", path.display()), source })?;
        serde_json::from_str(&text)
            .map_err(|source| Error::Json { context: format!("config {}", path.display()), source })
    }

    /// Serialises the config as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }

    /// Index of the table named `name`.
    pub fn table_index(&self, name: &str) -> Option<usize> {
        self.tables.iter().position(|t| t.name == name)
    }
}

/// A feature's `"hash"` config (read by `input::hash`): keys are hashed with this seed before the modulo. Different
/// seeds give independent mappings (useful to decorrelate collisions between features).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HashConfig {
    /// XXH3 seed.
    pub seed: u64,
}
