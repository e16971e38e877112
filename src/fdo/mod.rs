//! Feedback-directed optimisation: statistics that accumulate over batches, shards and hosts,
//! and the tuner that turns them into limits and buffer sizes (SPEC Part 2, section 7).
//!
//! [`FdoStats`] is our JSON format (with a `version`); [`FileFdoClient`] stores one file per
//! process like the reference's file clients; [`npz`] and [`csv`] read and write the reference's
//! own dump formats so that stats can move between the two; [`tune`] applies the reference's
//! rule (`update_preprocessing_parameters`) plus headroom and rounding.

pub mod csv;
pub mod npz;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{ConfigItem, Error, Result};
use crate::fields::{self, Nested, Section};
use crate::io::OutputFile;
use crate::output::Output;
use crate::spec::{round_up, Config, DeviceLayout, Plan, Stacking, ALIGNMENT};
use crate::stats::StackStats;

/// Version of the JSON format written by [`FdoStats::to_json`].
pub const FDO_FORMAT_VERSION: u32 = 1;

/// The device layout stats were measured on; stats of different layouts do not merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutKey {
    /// L.
    pub local_device_count: usize,
    /// G.
    pub global_device_count: usize,
    /// S.
    pub num_sc_per_device: usize,
}

impl From<DeviceLayout> for LayoutKey {
    fn from(l: DeviceLayout) -> Self {
        LayoutKey {
            local_device_count: l.local_devices,
            global_device_count: l.global_devices,
            num_sc_per_device: l.sc_per_device,
        }
    }
}

/// Statistics accumulated over any number of batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdoStats {
    /// Format version ([`FDO_FORMAT_VERSION`]).
    pub version: u32,
    /// Layout the stats were measured on.
    pub layout: LayoutKey,
    /// Batches merged in.
    pub batches: u64,
    /// Per stack: element-wise maxima, and summed drops.
    pub stacks: BTreeMap<String, StackStats>,
}

impl FdoStats {
    /// Empty stats for a layout.
    pub fn new(layout: impl Into<LayoutKey>) -> Self {
        FdoStats {
            version: FDO_FORMAT_VERSION,
            layout: layout.into(),
            batches: 0,
            stacks: BTreeMap::new(),
        }
    }

    /// Adds one batch's output.
    pub fn record(&mut self, plan: &Plan, out: &Output) -> Result<()> {
        let layout: LayoutKey = plan.layout.into();
        if layout != self.layout {
            return Err(layout_mismatch(
                "the recorded stats",
                &self.layout,
                "the new batch",
                &layout,
            ));
        }
        for so in &out.stacks {
            merge_stack(self.stacks.entry(so.name.clone()).or_default(), &so.stats);
        }
        self.batches = self.batches.saturating_add(1);
        Ok(())
    }

    /// Merges `other` in: element-wise max of the per-partition and per-SparseCore arrays, sum
    /// of dropped ids and of batches (saturating: the counts come from files). Stats of another
    /// layout or another set of stacks are refused, naming the difference.
    pub fn merge(&mut self, other: &FdoStats) -> Result<()> {
        if self.layout != other.layout {
            return Err(layout_mismatch(
                "the first stats",
                &self.layout,
                "the second",
                &other.layout,
            ));
        }
        if self.batches > 0 && other.batches > 0 {
            let ours: Vec<&String> = self.stacks.keys().collect();
            let theirs: Vec<&String> = other.stacks.keys().collect();
            if ours != theirs {
                let only_ours: Vec<&str> = self
                    .stacks
                    .keys()
                    .filter(|k| !other.stacks.contains_key(*k))
                    .map(|s| s.as_str())
                    .collect();
                let only_theirs: Vec<&str> = other
                    .stacks
                    .keys()
                    .filter(|k| !self.stacks.contains_key(*k))
                    .map(|s| s.as_str())
                    .collect();
                return Err(Error::config(
                    ConfigItem::Stack,
                    only_ours.first().or(only_theirs.first()).copied().unwrap_or(""),
                    format!(
                        "stats cover different stacks: only in the first: [{}]; only in the second: [{}]",
                        only_ours.join(", "),
                        only_theirs.join(", ")
                    ),
                ));
            }
        }
        // Both sides' arrays have their layout's lengths (or none), and the layouts are equal:
        // the element-wise max below never widens an array, and a refused merge changes nothing.
        self.validate()?;
        other.validate()?;
        for (name, st) in &other.stacks {
            merge_stack(self.stacks.entry(name.clone()).or_default(), st);
        }
        self.batches = self.batches.saturating_add(other.batches);
        Ok(())
    }

    /// Serialises as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("stats serialise")
    }

    /// Parses JSON, checking the version and rejecting fields the format does not know (naming
    /// the field, its stack and the closest known field).
    pub fn from_json(text: &str) -> Result<Self> {
        let json_err = |source| Error::Json {
            context: "FDO stats".into(),
            source,
        };
        let value: serde_json::Value = serde_json::from_str(text).map_err(json_err)?;
        // The version first: a later format may add fields this build does not know.
        if let Some(version) = value.get("version").and_then(serde_json::Value::as_u64) {
            if version != FDO_FORMAT_VERSION as u64 {
                return Err(Error::option(
                    "version",
                    version,
                    format!("unsupported FDO stats version (expected {FDO_FORMAT_VERSION})"),
                ));
            }
        }
        fields::check(&value, &STATS_FIELDS)?;
        let s: FdoStats = serde_json::from_value(value).map_err(json_err)?;
        if s.version != FDO_FORMAT_VERSION {
            return Err(Error::option(
                "version",
                s.version,
                format!("unsupported FDO stats version (expected {FDO_FORMAT_VERSION})"),
            ));
        }
        s.validate()?;
        Ok(s)
    }

    /// Checks what a stats file (ours, or the reference's imported) must hold: a layout of at
    /// least one device and SparseCore; arrays of the layout's lengths (`[L·G·S]` per partition,
    /// `[L·S]` per SparseCore, docs/stats.md), since a value at another position would be read
    /// as another partition's, tuned and merged as such; and no negative count (a damaged file,
    /// which would tune a limit below zero or draw a bar below the axis). An empty array is a
    /// field that was not recorded (a reference dump may omit one). The error names the stack,
    /// the field, and the length and the expected one, or the position and the value.
    pub fn validate(&self) -> Result<()> {
        let l = &self.layout;
        let (ld, gd, sc) = (
            l.local_device_count,
            l.global_device_count,
            l.num_sc_per_device,
        );
        for (field, v) in [
            ("local_device_count", ld),
            ("global_device_count", gd),
            ("num_sc_per_device", sc),
        ] {
            if v == 0 {
                return Err(Error::option(
                    "layout",
                    format!("{field} = 0"),
                    "an FDO stats file's layout counts devices and SparseCores: at least 1 each",
                ));
            }
        }
        let Some(partitions) = ld.checked_mul(gd).and_then(|n| n.checked_mul(sc)) else {
            return Err(Error::option(
                "layout",
                l,
                format!(
                    "L·G·S = {ld}·{gd}·{sc} partitions does not fit in {} bits",
                    usize::BITS
                ),
            ));
        };
        // Cannot overflow: L·S divides L·G·S.
        let scs = ld * sc;
        for (name, st) in &self.stacks {
            let arrays = [
                (
                    "max_ids_per_partition",
                    &st.max_ids_per_partition,
                    partitions,
                    format!("L·G·S = {ld}·{gd}·{sc}"),
                ),
                (
                    "max_unique_ids_per_partition",
                    &st.max_unique_ids_per_partition,
                    partitions,
                    format!("L·G·S = {ld}·{gd}·{sc}"),
                ),
                (
                    "required_buffer_size_per_sc",
                    &st.required_buffer_size_per_sc,
                    scs,
                    format!("L·S = {ld}·{sc}"),
                ),
            ];
            for (field, values, expected, formula) in &arrays {
                if !values.is_empty() && values.len() != *expected {
                    let len = values.len();
                    let reason = format!("stats field `{field}` has {len} values, expected {formula} = {expected} (or none, for a field not recorded)");
                    return Err(Error::config(ConfigItem::Stack, name, reason));
                }
            }
            for (field, values, ..) in arrays {
                if let Some((i, v)) = values.iter().enumerate().find(|(_, &v)| v < 0) {
                    return Err(Error::config(
                        ConfigItem::Stack,
                        name,
                        format!("stats field `{field}`[{i}] is {v}: counts cannot be negative"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reads a stats JSON file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            context: format!("reading stats {}", path.display()),
            source,
        })?;
        Self::from_json(&text).map_err(|e| match e {
            Error::Json { source, .. } => Error::Json {
                context: format!("stats {}", path.display()),
                source,
            },
            other => other.context(format!("stats {}", path.display())),
        })
    }

    /// Writes a stats JSON file atomically (temporary name, then rename).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        write_atomic(path.as_ref(), self.to_json().as_bytes())
    }
}

impl std::fmt::Display for LayoutKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.local_device_count, self.global_device_count, self.num_sc_per_device
        )
    }
}

/// `ours` and `theirs` describe the two sides ("the first stats", "the config", ...).
fn layout_mismatch(ours: &str, a: &LayoutKey, theirs: &str, b: &LayoutKey) -> Error {
    Error::option("layout", b, format!("{ours} has layout L/G/S = {a} but {theirs} has layout {b}; stats of different layouts do not combine"))
}

/// Element-wise max and summed drops. The arrays have equal lengths or one side has none (a
/// field not recorded, or a stack new to `into`): validated stats, or a batch's output.
fn merge_stack(into: &mut StackStats, from: &StackStats) {
    fn max_into(a: &mut Vec<i32>, b: &[i32]) {
        if a.is_empty() {
            a.extend_from_slice(b);
            return;
        }
        for (x, &y) in a.iter_mut().zip(b) {
            *x = (*x).max(y);
        }
    }
    max_into(&mut into.max_ids_per_partition, &from.max_ids_per_partition);
    max_into(
        &mut into.max_unique_ids_per_partition,
        &from.max_unique_ids_per_partition,
    );
    max_into(
        &mut into.required_buffer_size_per_sc,
        &from.required_buffer_size_per_sc,
    );
    into.dropped_id_count = into.dropped_id_count.saturating_add(from.dropped_id_count);
}

/// Writes `bytes` to `path` whole or not at all (see [`crate::io::OutputFile`]: through a
/// temporary sibling, removed if the write fails; symlinks followed; pipes and devices written
/// in place).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let out = OutputFile::new(path)?;
    std::fs::write(out.path(), bytes).map_err(|source| Error::Io {
        context: format!("writing {}", out.path().display()),
        source,
    })?;
    out.commit()
}

/// Where stats are recorded, published and loaded (the reference's `FDOClient`).
pub trait FdoClient {
    /// Adds one batch's stats.
    fn record(&mut self, stats: &FdoStats) -> Result<()>;
    /// Persists what was recorded; returns where.
    fn publish(&mut self) -> Result<PathBuf>;
    /// Loads the latest stats of every process, max-merged.
    fn load(&self) -> Result<FdoStats>;
}

/// One JSON file per process and publish: `fdo_stats_<process>_<nanos>.json` in a directory.
/// `load` keeps each process's latest file and merges them, as the reference's file clients do
/// (SPEC 7.3), except that drop counts are summed across processes rather than max-ed.
#[derive(Debug, Clone)]
pub struct FileFdoClient {
    dir: PathBuf,
    process: u64,
    pending: Option<FdoStats>,
}

impl FileFdoClient {
    /// A client for `process` writing into `dir`.
    pub fn new(dir: impl Into<PathBuf>, process: u64) -> Self {
        FileFdoClient {
            dir: dir.into(),
            process,
            pending: None,
        }
    }
}

impl FdoClient for FileFdoClient {
    fn record(&mut self, stats: &FdoStats) -> Result<()> {
        match &mut self.pending {
            Some(p) => p.merge(stats),
            None => {
                self.pending = Some(stats.clone());
                Ok(())
            }
        }
    }

    fn publish(&mut self) -> Result<PathBuf> {
        let stats = self.pending.as_ref().ok_or_else(|| {
            Error::data(
                format!("FDO client of {}", self.dir.display()),
                "publish before any stats were recorded",
            )
        })?;
        std::fs::create_dir_all(&self.dir).map_err(|source| Error::Io {
            context: format!("creating {}", self.dir.display()),
            source,
        })?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = self
            .dir
            .join(format!("fdo_stats_{}_{}.json", self.process, nanos));
        stats.write(&path)?;
        Ok(path)
    }

    fn load(&self) -> Result<FdoStats> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| Error::Io {
            context: format!("listing {}", self.dir.display()),
            source,
        })?;
        // Latest file per process id: (process, timestamp, path).
        let mut latest: BTreeMap<String, (u128, PathBuf)> = BTreeMap::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name
                .strip_prefix("fdo_stats_")
                .and_then(|r| r.strip_suffix(".json"))
            else {
                continue;
            };
            let Some((proc_id, ts)) = rest.split_once('_') else {
                continue;
            };
            let (Ok(_), Ok(ts)) = (proc_id.parse::<u64>(), ts.parse::<u128>()) else {
                continue;
            };
            let slot = latest.entry(proc_id.to_string()).or_insert((ts, e.path()));
            if ts > slot.0 {
                *slot = (ts, e.path());
            }
        }
        let mut merged: Option<FdoStats> = None;
        for (_, path) in latest.values() {
            let s = FdoStats::from_path(path)?;
            match &mut merged {
                Some(m) => m.merge(&s)?,
                None => merged = Some(s),
            }
        }
        merged.ok_or_else(|| Error::Io {
            context: format!("no fdo_stats_*.json in {}", self.dir.display()),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })
    }
}

/// One line of a tuning report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuneChange {
    /// Table or stack name.
    pub name: String,
    /// (before, after) max ids per partition.
    pub max_ids: (u64, u64),
    /// (before, after) max unique ids per partition.
    pub max_unique: (u64, u64),
    /// (before, after) suggested COO buffer size per device.
    pub suggested: (Option<u64>, Option<u64>),
}

/// Applies stats to a config: for each stack seen, `max_ids = ceil8(headroom · max)`,
/// `max_unique = ceil8(headroom · max)`, `suggested = ceil(headroom · max(required) · S)`
/// rounded to `8 · S` (SPEC 7.5 plus headroom and rounding). A stack that saw no ids keeps its
/// old values rather than getting zero limits.
///
/// Feature-stacked (and single-table) stacks update their table; multi-table auto stacks update
/// `stack_suggested_coo_buffer_size_per_device` and raise the shared `stack_limits`.
pub fn tune(config: &Config, stats: &FdoStats, headroom: f64) -> Result<(Config, Vec<TuneChange>)> {
    if !(headroom.is_finite() && headroom >= 1.0) {
        return Err(Error::option(
            "headroom",
            headroom,
            "must be a finite number >= 1.0",
        ));
    }
    let layout = DeviceLayout::new(
        config.config.local_device_count,
        config.config.global_device_count,
        config.config.num_sc_per_device,
    )?;
    let key: LayoutKey = layout.into();
    if key != stats.layout {
        return Err(layout_mismatch(
            "the config",
            &key,
            "the stats",
            &stats.layout,
        ));
    }
    let s = layout.sc_per_device as u64;
    // ceil(v * headroom), immune to binary fractions: 400 * 1.1 is 440.00000000000006 in f64,
    // which must give 440, not 441.
    let scale = |v: u64, m: u64| -> u64 {
        round_up(((v as f64 * headroom * 1e6).round() / 1e6).ceil() as u64, m)
    };
    let mut tuned = config.clone();
    let mut changes = Vec::new();
    let mut auto_limits: Option<(u64, u64)> = None;
    for (name, st) in &stats.stacks {
        let ids = st.max_ids().max(0) as u64;
        let uniq = st.max_unique_ids().max(0) as u64;
        if ids == 0 {
            continue; // no ids seen: keep the old limits
        }
        let new_ids = scale(ids, ALIGNMENT as u64).min(i32::MAX as u64);
        let new_uniq = scale(uniq.max(1), ALIGNMENT as u64).min(new_ids);
        let required = st.required_buffer_size_per_device(layout.sc_per_device);
        let new_suggested = scale(required.max(1), ALIGNMENT as u64 * s);
        if let Some(t) = tuned.tables.iter_mut().find(|t| &t.name == name) {
            changes.push(TuneChange {
                name: name.clone(),
                max_ids: (t.max_ids_per_partition, new_ids),
                max_unique: (t.max_unique_ids_per_partition, new_uniq),
                suggested: (t.suggested_coo_buffer_size_per_device, Some(new_suggested)),
            });
            t.max_ids_per_partition = new_ids;
            t.max_unique_ids_per_partition = new_uniq;
            t.suggested_coo_buffer_size_per_device = Some(new_suggested);
            if tuned.config.stacking == Stacking::Auto {
                tuned
                    .config
                    .stack_suggested_coo_buffer_size_per_device
                    .get_or_insert_with(BTreeMap::new)
                    .insert(name.clone(), new_suggested);
            }
        } else if tuned.config.stacking == Stacking::Auto {
            let old = tuned.config.stack_limits.unwrap_or_default();
            let old_suggested = tuned
                .config
                .stack_suggested_coo_buffer_size_per_device
                .as_ref()
                .and_then(|m| m.get(name).copied());
            changes.push(TuneChange {
                name: name.clone(),
                max_ids: (old.max_ids_per_partition, new_ids),
                max_unique: (old.max_unique_ids_per_partition, new_uniq),
                suggested: (old_suggested, Some(new_suggested)),
            });
            let a = auto_limits.get_or_insert((0, 0));
            a.0 = a.0.max(new_ids);
            a.1 = a.1.max(new_uniq);
            tuned
                .config
                .stack_suggested_coo_buffer_size_per_device
                .get_or_insert_with(BTreeMap::new)
                .insert(name.clone(), new_suggested);
        } else {
            return Err(Error::config(
                ConfigItem::Stack,
                name,
                "in the stats but not a table of the config",
            ));
        }
    }
    if let Some((ids, uniq)) = auto_limits {
        tuned.config.stack_limits = Some(crate::spec::StackLimits {
            max_ids_per_partition: ids,
            max_unique_ids_per_partition: uniq,
        });
    }
    Ok((tuned, changes))
}

// The fields of a stats file, for `fields::check`; the test `stats_field_lists_match_the_structs`
// keeps them equal to what the structs serialise.
static STATS_FIELDS: Section = Section {
    what: "the FDO stats",
    named_by: None,
    fields: &[
        ("version", Nested::Leaf),
        ("layout", Nested::Object(&LAYOUT_FIELDS)),
        ("batches", Nested::Leaf),
        ("stacks", Nested::MapOf(&STACK_STATS_FIELDS)),
    ],
};
static LAYOUT_FIELDS: Section = Section {
    what: "`layout`",
    named_by: None,
    fields: &[
        ("local_device_count", Nested::Leaf),
        ("global_device_count", Nested::Leaf),
        ("num_sc_per_device", Nested::Leaf),
    ],
};
static STACK_STATS_FIELDS: Section = Section {
    what: "stack",
    named_by: None,
    fields: &[
        ("max_ids_per_partition", Nested::Leaf),
        ("max_unique_ids_per_partition", Nested::Leaf),
        ("required_buffer_size_per_sc", Nested::Leaf),
        ("dropped_id_count", Nested::Leaf),
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(s: &Section) -> Vec<String> {
        let mut v: Vec<String> = s.fields.iter().map(|(n, _)| n.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn stats_field_lists_match_the_structs() {
        let mut stats = FdoStats::new(LayoutKey {
            local_device_count: 1,
            global_device_count: 1,
            num_sc_per_device: 4,
        });
        stats.stacks.insert("s".into(), StackStats::default());
        let v = serde_json::to_value(&stats).unwrap();
        let keys =
            |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&v), sorted(&STATS_FIELDS));
        assert_eq!(keys(&v["layout"]), sorted(&LAYOUT_FIELDS));
        assert_eq!(keys(&v["stacks"]["s"]), sorted(&STACK_STATS_FIELDS));
        let mut bad = v.clone();
        bad["stacks"]["s"]["max_ids_per_partitions"] = serde_json::json!([1]);
        let e = FdoStats::from_json(&bad.to_string())
            .unwrap_err()
            .to_string();
        assert_eq!(e, "unknown field `max_ids_per_partitions` in stack `s`; did you mean `max_ids_per_partition`?");
        let mut bad = v;
        bad["layot"] = serde_json::json!({});
        let e = FdoStats::from_json(&bad.to_string())
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "unknown field `layot` in the FDO stats; did you mean `layout`?"
        );
    }
}
