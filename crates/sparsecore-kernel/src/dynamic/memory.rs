//! The in-memory backend: 64 `HashMap` shards behind `RwLock`s, one flat `[row | slots]` entry
//! per key. It is the embedded default and the reference the other backends are tested against.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{check_entry, Applied, DynamicTable, DynamicTableSpec, Entry, Snapshot};
use crate::error::Result;
use crate::Optimizer;

const SHARD_BITS: u32 = 6;

type Shard = HashMap<u64, Box<[f32]>>;

/// Applied update ids: a set for the exactly-once check, a list for the commit order.
#[derive(Debug, Default)]
struct Journal {
    seen: HashSet<u64>,
    order: Vec<u64>,
}

/// A dynamic table in this process's memory, safe to share between threads.
///
/// Lookups lock one shard at a time; an update locks every shard it touches (in shard order, so
/// concurrent updates cannot deadlock) for its whole batch, so it is atomic with respect to
/// other lookups and updates. A lock poisoned by a panicking thread is recovered: entries are
/// only ever replaced whole.
#[derive(Debug)]
pub struct MemoryTable {
    spec: DynamicTableSpec,
    shards: Vec<RwLock<Shard>>,
    journal: Mutex<Journal>,
}

fn shard_of(key: u64) -> usize {
    // Keys may be raw ints (sequential): mix before taking the top bits.
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARD_BITS)) as usize
}

impl MemoryTable {
    /// An empty table.
    pub fn new(spec: DynamicTableSpec) -> Self {
        MemoryTable {
            spec,
            shards: (0..1 << SHARD_BITS)
                .map(|_| RwLock::new(HashMap::new()))
                .collect(),
            journal: Mutex::default(),
        }
    }

    /// Keys stored.
    pub fn len(&self) -> usize {
        (0..self.shards.len()).map(|s| self.read(s).len()).sum()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self, s: usize) -> RwLockReadGuard<'_, Shard> {
        self.shards[s]
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, s: usize) -> RwLockWriteGuard<'_, Shard> {
        self.shards[s]
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn journal(&self) -> MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_entry(&self, key: u64) -> Box<[f32]> {
        let mut e = vec![0.0f32; self.spec.entry_len()].into_boxed_slice();
        self.spec.init_entry(key, &mut e);
        e
    }
}

impl DynamicTable for MemoryTable {
    fn spec(&self) -> &DynamicTableSpec {
        &self.spec
    }

    fn get_or_init(&self, keys: &[u64], rows: &mut [f32]) -> Result<()> {
        self.spec.check_rows(keys, rows)?;
        let dim = self.spec.dim;
        for (&key, out) in keys.iter().zip(rows.chunks_exact_mut(dim)) {
            let s = shard_of(key);
            if let Some(e) = self.read(s).get(&key) {
                out.copy_from_slice(&e[..dim]);
                continue;
            }
            let mut shard = self.write(s);
            let e = shard.entry(key).or_insert_with(|| self.new_entry(key));
            out.copy_from_slice(&e[..dim]);
        }
        Ok(())
    }

    fn apply_update(
        &self,
        update_id: Option<u64>,
        keys: &[u64],
        grads: &[f32],
        optimizer: &Optimizer,
    ) -> Result<Applied> {
        self.spec.check_optimizer(optimizer)?;
        self.spec.check_update(keys, grads)?;
        let dim = self.spec.dim;
        // The journal lock first (tagged updates only), then shards in ascending order: one
        // global lock order.
        let mut journal = update_id.map(|_| self.journal());
        if let (Some(id), Some(j)) = (update_id, &journal) {
            if j.seen.contains(&id) {
                return Ok(Applied::Already);
            }
        }
        let mut touched: Vec<usize> = keys.iter().map(|&k| shard_of(k)).collect();
        touched.sort_unstable();
        touched.dedup();
        let mut guards: Vec<(usize, RwLockWriteGuard<'_, Shard>)> =
            touched.iter().map(|&s| (s, self.write(s))).collect();
        for (&key, g) in keys.iter().zip(grads.chunks_exact(dim)) {
            let s = shard_of(key);
            let i = guards.partition_point(|(t, _)| *t < s);
            let shard = &mut guards[i].1;
            let e = shard.entry(key).or_insert_with(|| self.new_entry(key));
            let (w, slots) = e.split_at_mut(dim);
            let mut slots: Vec<&mut [f32]> = slots.chunks_exact_mut(dim).collect();
            optimizer.apply(g, w, &mut slots);
        }
        if let (Some(id), Some(j)) = (update_id, &mut journal) {
            j.seen.insert(id);
            j.order.push(id);
        }
        Ok(Applied::Now)
    }

    fn applied_updates(&self) -> Result<Vec<u64>> {
        Ok(self.journal().order.clone())
    }

    fn export(&self) -> Result<Snapshot> {
        let dim = self.spec.dim;
        let mut snap = Snapshot::default();
        for s in 0..self.shards.len() {
            for (&k, e) in self.read(s).iter() {
                snap.entries.insert(k, Entry::from_flat(dim, e));
            }
        }
        Ok(snap)
    }

    fn import(&self, snapshot: &Snapshot) -> Result<()> {
        for (&k, e) in &snapshot.entries {
            check_entry(&self.spec, k, e)?;
        }
        for (&k, e) in &snapshot.entries {
            let flat: Box<[f32]> = e
                .row
                .iter()
                .chain(e.slots.iter().flatten())
                .copied()
                .collect();
            self.write(shard_of(k)).insert(k, flat);
        }
        Ok(())
    }

    fn clear(&self) -> Result<()> {
        let mut journal = self.journal();
        for s in 0..self.shards.len() {
            self.write(s).clear();
        }
        *journal = Journal::default();
        Ok(())
    }
}
