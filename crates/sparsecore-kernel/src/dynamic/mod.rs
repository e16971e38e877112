//! Dynamic host tables: embedding tables keyed by raw 64-bit keys that are not known in advance
//! (parameter-server style). A row is created on first sight with a deterministic per-key
//! initial value, its optimizer slots live beside it, and the table may sit in a store that many
//! worker processes share.
//!
//! - [`DynamicTable`]: `get_or_init`, `apply_update` / `apply_gradients`, `export` / `import`.
//! - Backends: [`MemoryTable`] (sharded `HashMap`s behind locks, the embedded default and the
//!   reference) and, with the `redis` feature, [`RedisTable`] (a Redis server shared by workers).
//! - The training path ([`KeyBatch`], [`dynamic_forward`], [`dynamic_backward`]): raw keys →
//!   unique keys (looked up once) → rows → activations with combiners and weights, and back:
//!   one gradient row and one optimizer step per unique key.
//!
//! **Determinism.** A key's initial row is a pure function of the [`Initializer`] and the key, so
//! two workers racing to create the same key write the same bytes, and every backend holds the
//! same values after the same sequence of updates. Updates are computed in Rust on `f32` by
//! [`Optimizer::apply`], whatever the backend.
//!
//! **Exactly once.** Each backend applies a batch's updates atomically (all keys or none). An
//! update may carry an id ([`DynamicTable::apply_update`]): a tagged update already applied is
//! not applied again, so a worker that lost its connection mid-batch can retry it safely, and the
//! table keeps the ids in commit order ([`DynamicTable::applied_updates`]) for audits and replay.

mod load;
mod memory;
#[cfg(feature = "redis")]
mod redis;
mod train;

#[cfg(feature = "redis")]
pub use self::redis::{RedisConfig, RedisTable};
pub use load::LoadStream;
pub use memory::MemoryTable;
pub use train::{dynamic_backward, dynamic_forward, KeyBatch};

use std::collections::BTreeMap;

use ndarray::Array2;

use super::Optimizer;
use crate::error::{KernelError, PlanItem, Result, Subject};

/// How a key's row is initialised on first sight. Pure functions of the key: racing workers and
/// different backends always create identical rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Initializer {
    /// Every element is this value.
    Constant(f32),
    /// Element `j` of key `k`'s row is `scale · (2u − 1)`, `u ∈ [0, 1)` the top 24 bits of
    /// `splitmix64(splitmix64(k xor seed) + j)` divided by 2²⁴ (SplitMix64 as in
    /// `java.util.SplittableRandom`: add 0x9E3779B97F4A7C15, then the two xor-shift-multiply
    /// rounds). Every step is exact except the final multiplication by `scale`.
    Uniform {
        /// Half-width of the interval.
        scale: f32,
        /// Mixed into every key.
        seed: u64,
    },
}

/// SplitMix64's output function applied to `z + γ` (one step of the generator from state `z`).
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Initializer {
    /// Writes key `key`'s initial row into `row`.
    pub fn init_row(&self, key: u64, row: &mut [f32]) {
        match *self {
            Initializer::Constant(v) => row.fill(v),
            Initializer::Uniform { scale, seed } => {
                let base = splitmix64(key ^ seed);
                for (j, x) in row.iter_mut().enumerate() {
                    let u = (splitmix64(base.wrapping_add(j as u64)) >> 40) as f32
                        * (1.0 / 16_777_216.0);
                    *x = scale * (2.0 * u - 1.0);
                }
            }
        }
    }
}

/// A dynamic table's shape: its name, row width, optimizer slots and initializer. Every handle
/// on a shared table must agree on it (values of another shape are reported as corrupt).
/// Made only by [`DynamicTableSpec::new`], which checks the name and the width.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DynamicTableSpec {
    /// Table name: letters, digits, `_`, `-` and `.` (it is part of store key names).
    pub name: String,
    /// Row width.
    pub dim: usize,
    /// Slot names, from [`Optimizer::slot_names`].
    pub slot_names: Vec<&'static str>,
    /// Slot initial values, from [`Optimizer::slot_inits`].
    pub slot_inits: Vec<f32>,
    /// How rows start.
    pub init: Initializer,
}

impl DynamicTableSpec {
    /// A table of `dim`-wide rows with the slots `optimizer` needs.
    pub fn new(name: &str, dim: usize, optimizer: &Optimizer, init: Initializer) -> Result<Self> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                name,
                "names use only ASCII letters, digits, `_`, `-` and `.`",
            ));
        }
        if dim == 0 || dim > 1 << 20 {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                name,
                format!("dim = {dim}, must be in 1..=1048576"),
            ));
        }
        let finite = match init {
            Initializer::Constant(v) => v.is_finite(),
            Initializer::Uniform { scale, .. } => scale.is_finite(),
        };
        if !finite {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                name,
                format!("initializer {init:?} is not finite"),
            ));
        }
        Ok(DynamicTableSpec {
            name: name.to_string(),
            dim,
            slot_names: optimizer.slot_names().to_vec(),
            slot_inits: optimizer.slot_inits().to_vec(),
            init,
        })
    }

    /// Floats stored per key: the row and each slot.
    pub fn entry_len(&self) -> usize {
        self.dim.saturating_mul(1 + self.slot_names.len())
    }

    /// A new key's entry: `[row | slot 0 | slot 1 ...]`.
    pub fn init_entry(&self, key: u64, entry: &mut [f32]) {
        let (row, slots) = entry.split_at_mut(self.dim);
        self.init.init_row(key, row);
        for (slot, &v) in slots.chunks_exact_mut(self.dim).zip(&self.slot_inits) {
            slot.fill(v);
        }
    }

    /// Checks that `optimizer` uses this table's slots.
    pub fn check_optimizer(&self, optimizer: &Optimizer) -> Result<()> {
        optimizer.validate()?;
        if optimizer.slot_names() != self.slot_names.as_slice() {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                &self.name,
                format!(
                    "has slots {:?}; the optimizer needs {:?}",
                    self.slot_names,
                    optimizer.slot_names()
                ),
            ));
        }
        Ok(())
    }

    /// Checks an update's shape: one `dim`-wide gradient row per key, no key twice (a batch's
    /// gradient is applied once per unique key; sum duplicates first, as [`KeyBatch`] does).
    pub fn check_update(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        // The fields are public: `dim` need not be what `new` allows, so the product is checked.
        let expected = keys.len().checked_mul(self.dim);
        if expected != Some(grads.len()) {
            return Err(KernelError::input(
                Subject::DynamicTable(self.name.clone()),
                format!(
                    "{} gradient values for {} keys of dim {} (expected {})",
                    grads.len(),
                    keys.len(),
                    self.dim,
                    expected
                        .map_or_else(|| "more than a usize counts".to_string(), |e| e.to_string())
                ),
            ));
        }
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(KernelError::input(
                Subject::DynamicTable(self.name.clone()),
                format!(
                    "key {:#018x} appears twice in one update; sum its gradients first",
                    w[0]
                ),
            ));
        }
        Ok(())
    }

    /// Checks a lookup's output size.
    pub fn check_rows(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        if keys.len().checked_mul(self.dim) != Some(rows.len()) {
            return Err(KernelError::input(
                Subject::DynamicTable(self.name.clone()),
                format!(
                    "row buffer of {} values for {} keys of dim {}",
                    rows.len(),
                    keys.len(),
                    self.dim
                ),
            ));
        }
        Ok(())
    }
}

/// One key's stored values.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The embedding row.
    pub row: Vec<f32>,
    /// One vector per optimizer slot.
    pub slots: Vec<Vec<f32>>,
}

impl Entry {
    /// Splits a flat `[row | slots...]` entry (`dim > 0`; a shorter `flat` gives a short row).
    pub fn from_flat(dim: usize, flat: &[f32]) -> Self {
        let (row, slots) = flat.split_at(dim.min(flat.len()));
        Entry {
            row: row.to_vec(),
            slots: slots.chunks(dim.max(1)).map(<[f32]>::to_vec).collect(),
        }
    }

    /// Whether every value has the same bits as `other`'s (`==` treats NaNs as unequal and
    /// `0.0 == -0.0`; backends must agree to the bit).
    pub fn bits_eq(&self, other: &Entry) -> bool {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        bits(&self.row) == bits(&other.row)
            && self.slots.len() == other.slots.len()
            && self
                .slots
                .iter()
                .zip(&other.slots)
                .all(|(a, b)| bits(a) == bits(b))
    }
}

/// A table's contents: every key's row and slots, by key.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// Entries in key order.
    pub entries: BTreeMap<u64, Entry>,
}

impl Snapshot {
    /// Whether both snapshots hold the same keys with bit-identical values.
    pub fn bits_eq(&self, other: &Snapshot) -> bool {
        self.entries.len() == other.entries.len()
            && self
                .entries
                .iter()
                .zip(&other.entries)
                .all(|((ka, a), (kb, b))| ka == kb && a.bits_eq(b))
    }

    /// The first key whose values differ (or that only one side has), for test messages.
    pub fn first_difference(&self, other: &Snapshot) -> Option<u64> {
        let keys: std::collections::BTreeSet<u64> = self
            .entries
            .keys()
            .chain(other.entries.keys())
            .copied()
            .collect();
        keys.into_iter()
            .find(|k| match (self.entries.get(k), other.entries.get(k)) {
                (Some(a), Some(b)) => !a.bits_eq(b),
                _ => true,
            })
    }
}

/// What [`DynamicTable::apply_update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The update was applied now.
    Now,
    /// An update with this id had already been applied; nothing changed.
    Already,
}

/// A table of rows keyed by raw 64-bit keys, created on first sight.
///
/// Every method is atomic per call with respect to other handles on the same table: a lookup
/// sees each key's row either before or after any concurrent update, and an update changes all
/// its keys or none of them.
pub trait DynamicTable: Send + Sync {
    /// The table's shape.
    fn spec(&self) -> &DynamicTableSpec;

    /// The rows of `keys` (duplicates allowed), creating absent keys with their initial row and
    /// slots. `rows` is `[keys.len(), dim]`, row-major.
    fn get_or_init(&self, keys: &[u64], rows: &mut [f32]) -> Result<()>;

    /// One optimizer step per key (`keys` unique, `grads` `[keys.len(), dim]` row-major),
    /// creating absent keys first, all or nothing. With `update_id`, an update whose id was
    /// already applied is skipped ([`Applied::Already`]) and the id is journaled.
    fn apply_update(
        &self,
        update_id: Option<u64>,
        keys: &[u64],
        grads: &[f32],
        optimizer: &Optimizer,
    ) -> Result<Applied>;

    /// The ids of applied tagged updates, in commit order.
    fn applied_updates(&self) -> Result<Vec<u64>>;

    /// Every key's row and slots.
    fn export(&self) -> Result<Snapshot>;

    /// Writes every entry of `snapshot` (overwriting those keys; others are kept).
    fn import(&self, snapshot: &Snapshot) -> Result<()>;

    /// Removes every key, slot and journal entry of the table.
    fn clear(&self) -> Result<()>;

    /// [`DynamicTable::apply_update`] without an id.
    fn apply_gradients(&self, keys: &[u64], grads: &[f32], optimizer: &Optimizer) -> Result<()> {
        self.apply_update(None, keys, grads, optimizer).map(|_| ())
    }

    /// [`DynamicTable::get_or_init`] into a new `[keys.len(), dim]` array.
    fn lookup(&self, keys: &[u64]) -> Result<Array2<f32>> {
        let dim = self.spec().dim;
        let mut rows = Array2::zeros((keys.len(), dim));
        self.get_or_init(
            keys,
            rows.as_slice_mut().expect("a new array is contiguous"),
        )?;
        Ok(rows)
    }
}

/// Checks that an imported entry has the table's shape.
pub(crate) fn check_entry(spec: &DynamicTableSpec, key: u64, e: &Entry) -> Result<()> {
    if e.row.len() != spec.dim
        || e.slots.len() != spec.slot_names.len()
        || e.slots.iter().any(|s| s.len() != spec.dim)
    {
        return Err(KernelError::input(
            Subject::DynamicTable(spec.name.clone()),
            format!(
                "entry {key:#018x} has a row of {} and {} slots, the table has dim {} and {} slots",
                e.row.len(),
                e.slots.len(),
                spec.dim,
                spec.slot_names.len()
            ),
        ));
    }
    Ok(())
}
