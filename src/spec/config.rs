//! The JSON config: device layout, options, tables and features.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::fields::{self, Nested, Section};

/// The config format this build reads and writes (the optional top-level `"version"`). A later
/// format that changes a field's meaning bumps it, so that an old build refuses a new file
/// instead of misreading it.
pub const CONFIG_FORMAT_VERSION: u32 = 1;

/// A whole config file: options, tables and features.
///
/// [`Config::from_json`] and [`Config::from_path`] reject fields the format does not know,
/// naming the field, where it is and the closest known one: a misspelled limit must not
/// silently become the default. (serde alone, e.g. `serde_json::from_value`, ignores them,
/// which the golden-case loader relies on: a case's `input.json` carries inline data next to
/// these keys.)
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
        StackLimits {
            max_ids_per_partition: 256,
            max_unique_ids_per_partition: 256,
        }
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
    /// Parses a config from JSON text, rejecting unknown fields and unknown format versions.
    pub fn from_json(text: &str) -> Result<Self> {
        Self::parse(text, "config")
    }

    /// Reads and parses a config file, as [`Config::from_json`].
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            context: format!("reading config {}", path.display()),
            source,
        })?;
        Self::parse(&text, &format!("config {}", path.display()))
    }

    /// Parses a config from a JSON value, as [`Config::from_json`].
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        Self::checked(value, "config")
    }

    fn parse(text: &str, context: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| Error::Json {
                context: context.into(),
                source,
            })?;
        Self::checked(value, context)
    }

    fn checked(mut value: serde_json::Value, context: &str) -> Result<Self> {
        if let Some(version) = value.as_object_mut().and_then(|o| o.remove("version")) {
            if version.as_u64() != Some(CONFIG_FORMAT_VERSION as u64) {
                return Err(Error::option(
                    "version",
                    version,
                    format!("this build reads config format version {CONFIG_FORMAT_VERSION}"),
                ));
            }
        }
        fields::check(&value, &CONFIG_FIELDS)?;
        serde_json::from_value(value).map_err(|source| Error::Json {
            context: context.into(),
            source,
        })
    }

    /// Serialises the config as pretty JSON, with its format version.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Versioned<'a> {
            version: u32,
            #[serde(flatten)]
            config: &'a Config,
        }
        serde_json::to_string_pretty(&Versioned {
            version: CONFIG_FORMAT_VERSION,
            config: self,
        })
        .expect("config serialises")
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

// The fields of each part of a config file, for `fields::check`. The unit test
// `field_lists_match_the_structs` keeps them equal to what the structs serialise.
static CONFIG_FIELDS: Section = Section {
    what: "the config",
    named_by: None,
    fields: &[
        ("config", Nested::Object(&OPTIONS_FIELDS)),
        ("tables", Nested::ArrayOf(&TABLE_FIELDS)),
        ("features", Nested::ArrayOf(&FEATURE_FIELDS)),
    ],
};
static OPTIONS_FIELDS: Section = Section {
    what: "`config`",
    named_by: None,
    fields: &[
        ("local_device_count", Nested::Leaf),
        ("global_device_count", Nested::Leaf),
        ("num_sc_per_device", Nested::Leaf),
        ("allow_id_dropping", Nested::Leaf),
        ("stacking", Nested::Leaf),
        ("stack_limits", Nested::Object(&STACK_LIMITS_FIELDS)),
        ("enable_minibatching", Nested::Leaf),
        ("stack_suggested_coo_buffer_size_per_device", Nested::Leaf),
        ("validate_ids", Nested::Leaf),
        ("sharding_strategy", Nested::Leaf),
    ],
};
static STACK_LIMITS_FIELDS: Section = Section {
    what: "stack limits",
    named_by: None,
    fields: &[
        ("max_ids_per_partition", Nested::Leaf),
        ("max_unique_ids_per_partition", Nested::Leaf),
    ],
};
static TABLE_FIELDS: Section = Section {
    what: "table",
    named_by: Some("name"),
    fields: &[
        ("name", Nested::Leaf),
        ("vocabulary_size", Nested::Leaf),
        ("embedding_dim", Nested::Leaf),
        ("combiner", Nested::Leaf),
        ("max_ids_per_partition", Nested::Leaf),
        ("max_unique_ids_per_partition", Nested::Leaf),
        ("suggested_coo_buffer_size_per_device", Nested::Leaf),
    ],
};
static FEATURE_FIELDS: Section = Section {
    what: "feature",
    named_by: Some("name"),
    fields: &[
        ("name", Nested::Leaf),
        ("table", Nested::Leaf),
        ("column", Nested::Leaf),
        ("weights_column", Nested::Leaf),
        ("hash", Nested::Object(&HASH_FIELDS)),
    ],
};
static HASH_FIELDS: Section = Section {
    what: "hash config",
    named_by: None,
    fields: &[("seed", Nested::Leaf)],
};

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Config {
        Config {
            config: Options {
                local_device_count: 1,
                global_device_count: 1,
                num_sc_per_device: 4,
                allow_id_dropping: true,
                stacking: Stacking::Auto,
                stack_limits: Some(StackLimits::default()),
                enable_minibatching: true,
                stack_suggested_coo_buffer_size_per_device: Some(BTreeMap::from([(
                    "s".to_string(),
                    64,
                )])),
                validate_ids: true,
                sharding_strategy: Some("MOD".into()),
            },
            tables: vec![TableConfig {
                name: "t".into(),
                vocabulary_size: 8,
                embedding_dim: 8,
                combiner: "sum".into(),
                max_ids_per_partition: 1,
                max_unique_ids_per_partition: 1,
                suggested_coo_buffer_size_per_device: Some(64),
            }],
            features: vec![FeatureConfig {
                name: "f".into(),
                table: "t".into(),
                column: Some("c".into()),
                weights_column: Some("w".into()),
                hash: Some(HashConfig { seed: 1 }),
            }],
        }
    }

    fn keys(v: &serde_json::Value) -> Vec<String> {
        v.as_object().unwrap().keys().cloned().collect()
    }

    fn names(s: &Section) -> Vec<String> {
        let mut v: Vec<String> = s.fields.iter().map(|(n, _)| n.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn field_lists_match_the_structs() {
        let v = serde_json::to_value(full()).unwrap();
        assert_eq!(keys(&v), names(&CONFIG_FIELDS));
        assert_eq!(keys(&v["config"]), names(&OPTIONS_FIELDS));
        assert_eq!(
            keys(&v["config"]["stack_limits"]),
            names(&STACK_LIMITS_FIELDS)
        );
        assert_eq!(keys(&v["tables"][0]), names(&TABLE_FIELDS));
        assert_eq!(keys(&v["features"][0]), names(&FEATURE_FIELDS));
        assert_eq!(keys(&v["features"][0]["hash"]), names(&HASH_FIELDS));
    }

    #[test]
    fn versions_and_unknown_fields() {
        let c = full();
        assert_eq!(Config::from_json(&c.to_json()).unwrap(), c);
        assert!(c.to_json().contains("\"version\": 1"));
        let mut v = serde_json::to_value(&c).unwrap();
        v["version"] = 2.into();
        let e = Config::from_value(v).unwrap_err().to_string();
        assert!(
            e.contains("version") && e.contains("reads config format version 1"),
            "{e}"
        );
        let mut v = serde_json::to_value(&c).unwrap();
        v["tables"][0]["max_ids_per_partitions"] = 4.into();
        let e = Config::from_value(v).unwrap_err().to_string();
        assert_eq!(e, "unknown field `max_ids_per_partitions` in table `t`; did you mean `max_ids_per_partition`?");
        let mut v = serde_json::to_value(&c).unwrap();
        v["config"]["allow_id_droping"] = true.into();
        let e = Config::from_value(v).unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown field `allow_id_droping` in `config`; did you mean `allow_id_dropping`?"
        );
        let mut v = serde_json::to_value(&c).unwrap();
        v["features"][0]["hash"]["sead"] = 1.into();
        let e = Config::from_value(v).unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown field `sead` in `hash` of feature `f`; did you mean `seed`?"
        );
    }
}
