//! The Redis backend: a dynamic table in a Redis server that many worker processes share.
//!
//! **Layout.** One string value per key and slot, namespaced by table and slot:
//! `{namespace}:{table}:w:{key:016x}` holds the row and `{namespace}:{table}:{slot}:{key:016x}`
//! each optimizer slot (`accumulator`, `m`, `v`, ...), as `dim` little-endian `f32`s. Tagged
//! updates leave `{namespace}:{table}:applied:{id:016x}` and are appended to the list
//! `{namespace}:{table}:journal`.
//!
//! **Lookups** are one pipelined round trip of `MGET`s; absent keys are then created with one
//! `MSETNX` per key (row and slots together, so a key never exists without its slots) followed
//! by an `MGET` of them in the same pipeline. Initial values are a pure function of the key, so
//! two workers racing to create a key write the same bytes, and the loser reads the winner's.
//!
//! **Updates** are optimistic: one round trip `MGET`s every row and slot of the batch (and
//! checks the update's `applied` marker), the new values are computed in Rust with
//! [`Optimizer::apply`] (exactly the in-memory backend's arithmetic), and one Lua script
//! compares every stored value with the one read and, only if none changed, writes them all,
//! sets the marker and appends the id to the journal. If another worker changed a value in
//! between, the script writes nothing and the batch is retried on fresh values, up to
//! [`RedisConfig::max_retries`] times. A script runs as one unit and is persisted as one unit
//! (its writes reach the AOF wrapped in `MULTI`/`EXEC`, and a truncated block is dropped on
//! load; an RDB snapshot is taken between commands), so a crash never leaves a half-applied
//! batch. (`WATCH` would do the same, but Redis 7.0 checks each newly watched key against every
//! key the client already watches, which is quadratic in the batch.)
//!
//! **Failures.** Connections have connect, read and write timeouts. A refused or dropped
//! connection is [`StoreErrorKind::Connection`], a server that does not answer in time
//! [`StoreErrorKind::Timeout`]; the connection is discarded and the next call reconnects. After
//! such an error the update may or may not have been applied: retrying it under the same update
//! id applies it exactly once.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use redis::{Client, Connection, RedisError, Value};

use super::{check_entry, Applied, DynamicTable, DynamicTableSpec, Entry, Snapshot};
use crate::error::{KernelError, PlanItem, Result, StoreErrorKind};
use crate::Optimizer;

/// Where the table lives and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Server URL, e.g. `redis://127.0.0.1:6379/0`.
    pub url: String,
    /// Prefix of every key name, so that several jobs can share a server.
    pub namespace: String,
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// Limit on each read and write of a request.
    pub io_timeout: Duration,
    /// Conflicting concurrent writers tolerated per update before [`StoreErrorKind::Conflict`].
    pub max_retries: u32,
    /// Keys per `MGET`/`MSET` command (a batch is split into several, in one round trip).
    pub keys_per_command: usize,
}

impl RedisConfig {
    /// A config for `url` with namespace `sparsecore`, 2 s connect and 5 s I/O timeouts,
    /// 1000 retries and 4096 keys per command.
    pub fn new(url: &str) -> Self {
        RedisConfig {
            url: url.to_string(),
            namespace: "sparsecore".to_string(),
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            max_retries: 1000,
            keys_per_command: 4096,
        }
    }
}

/// A dynamic table in a Redis server. Cheap to share between threads (it keeps a small pool of
/// connections); open one per process on the same URL, namespace and spec to share the table.
pub struct RedisTable {
    spec: DynamicTableSpec,
    config: RedisConfig,
    client: Client,
    pool: Mutex<Vec<Connection>>,
    /// Key-name prefixes: `ns:table:w:` then one per slot.
    prefixes: Vec<String>,
    applied_prefix: String,
    journal_key: String,
}

impl std::fmt::Debug for RedisTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTable")
            .field("spec", &self.spec)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn ok_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// The atomic compare-and-set of one batch (`MGET`/`MSET` in chunks of 2000 keys, below Lua's
/// `unpack` limit). KEYS: the update's applied marker, the journal, then
/// every row and slot name. ARGV: the update id (empty when untagged), the values read (empty
/// for an absent key; stored values are never empty), then the new values. Returns 2 if the
/// update was already applied, 0 if any value changed since it was read (nothing written), 1
/// once every value is written and the update journaled.
const CAS_SCRIPT: &str = r"
local n = #KEYS - 2
if ARGV[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then return 2 end
local step = 2000
for s = 1, n, step do
  local e = math.min(s + step - 1, n)
  local cur = redis.call('MGET', unpack(KEYS, s + 2, e + 2))
  for i = s, e do
    local c = cur[i - s + 1]
    if c == false then c = '' end
    if c ~= ARGV[i + 1] then return 0 end
  end
end
for s = 1, n, step do
  local e = math.min(s + step - 1, n)
  local kv = {}
  for i = s, e do
    kv[#kv + 1] = KEYS[i + 2]
    kv[#kv + 1] = ARGV[n + i + 1]
  end
  redis.call('MSET', unpack(kv))
end
if ARGV[1] ~= '' then
  redis.call('SET', KEYS[1], '1')
  redis.call('RPUSH', KEYS[2], ARGV[1])
end
return 1
";

fn encode(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl RedisTable {
    /// Opens the table (connecting once, so that a wrong URL or a down server is reported here).
    pub fn open(spec: DynamicTableSpec, config: RedisConfig) -> Result<Self> {
        if !ok_name(&config.namespace) {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                &spec.name,
                format!(
                    "namespace {:?}: use only ASCII letters, digits, `_`, `-` and `.`",
                    config.namespace
                ),
            ));
        }
        if config.connect_timeout.is_zero()
            || config.io_timeout.is_zero()
            || config.keys_per_command == 0
        {
            return Err(KernelError::plan(
                PlanItem::DynamicTable,
                &spec.name,
                "Redis timeouts and keys_per_command must be positive",
            ));
        }
        let client = Client::open(config.url.as_str()).map_err(|e| KernelError::DynamicStore {
            table: spec.name.clone(),
            store: config.url.clone(),
            op: "parsing the URL".into(),
            kind: StoreErrorKind::Connection,
            reason: e.to_string(),
        })?;
        let base = format!("{}:{}", config.namespace, spec.name);
        let prefixes = std::iter::once("w")
            .chain(spec.slot_names.iter().copied())
            .map(|s| format!("{base}:{s}:"))
            .collect();
        let table = RedisTable {
            applied_prefix: format!("{base}:applied:"),
            journal_key: format!("{base}:journal"),
            prefixes,
            spec,
            config,
            client,
            pool: Mutex::new(Vec::new()),
        };
        let con = table.connect()?;
        table.pool().push(con);
        Ok(table)
    }

    /// The connection settings.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Vec<Connection>> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn err(&self, op: impl Into<String>, e: RedisError) -> KernelError {
        let kind = if e.is_timeout() {
            StoreErrorKind::Timeout
        } else if e.is_connection_refusal() || e.is_connection_dropped() || e.is_io_error() {
            StoreErrorKind::Connection
        } else {
            StoreErrorKind::Server
        };
        let limit = match kind {
            StoreErrorKind::Timeout => format!(
                " (connect timeout {:?}, I/O timeout {:?})",
                self.config.connect_timeout, self.config.io_timeout
            ),
            _ => String::new(),
        };
        KernelError::DynamicStore {
            table: self.spec.name.clone(),
            store: self.config.url.clone(),
            op: op.into(),
            kind,
            reason: format!("{e}{limit}"),
        }
    }

    fn store_error(
        &self,
        op: impl Into<String>,
        kind: StoreErrorKind,
        reason: String,
    ) -> KernelError {
        KernelError::DynamicStore {
            table: self.spec.name.clone(),
            store: self.config.url.clone(),
            op: op.into(),
            kind,
            reason,
        }
    }

    fn connect(&self) -> Result<Connection> {
        let con = self
            .client
            .get_connection_with_timeout(self.config.connect_timeout)
            .map_err(|e| self.err("connecting", e))?;
        con.set_read_timeout(Some(self.config.io_timeout))
            .map_err(|e| self.err("setting the read timeout", e))?;
        con.set_write_timeout(Some(self.config.io_timeout))
            .map_err(|e| self.err("setting the write timeout", e))?;
        Ok(con)
    }

    /// Runs `f` on a pooled connection. A connection that saw any error is dropped, never
    /// returned to the pool: it may hold a half-read reply or a pending `WATCH`.
    fn with_con<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
        let pooled = self.pool().pop();
        let mut con = match pooled {
            Some(c) => c,
            None => self.connect()?,
        };
        let out = f(&mut con)?;
        self.pool().push(con);
        Ok(out)
    }

    fn name(&self, array: usize, key: u64) -> String {
        format!("{}{key:016x}", self.prefixes[array])
    }

    fn decode(&self, key: u64, what: usize, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        if bytes.len() != out.len() * 4 {
            return Err(self.store_error(
                format!("reading {}", self.name(what, key)),
                StoreErrorKind::Corrupt,
                format!(
                    "{} bytes stored, expected {} (dim {} as little-endian f32)",
                    bytes.len(),
                    out.len() * 4,
                    self.spec.dim
                ),
            ));
        }
        for (v, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// `MGET`s of `names` in chunks, appended to `pipe`.
    fn mget(&self, pipe: &mut redis::Pipeline, names: &[String]) {
        for chunk in names.chunks(self.config.keys_per_command) {
            pipe.cmd("MGET").arg(chunk);
        }
    }

    /// Flattens the replies of [`RedisTable::mget`] (the last `chunks` replies of `replies`).
    fn mget_replies(&self, op: &str, replies: Vec<Value>) -> Result<Vec<Option<Vec<u8>>>> {
        let mut out = Vec::new();
        for r in replies {
            let part: Vec<Option<Vec<u8>>> =
                redis::from_redis_value(r).map_err(|e| self.err(op, e.into()))?;
            out.extend(part);
        }
        Ok(out)
    }

    /// Every key name of this table's rows (SCAN; not atomic with concurrent writers).
    fn scan_rows(&self, con: &mut Connection) -> Result<Vec<u64>> {
        let pattern = format!("{}*", self.prefixes[0]);
        let mut cursor: u64 = 0;
        let mut keys = Vec::new();
        loop {
            let (next, names): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query(con)
                .map_err(|e| self.err("SCAN", e))?;
            for n in names {
                let hex = &n[self.prefixes[0].len()..];
                let k = u64::from_str_radix(hex, 16).map_err(|_| {
                    self.store_error(
                        "SCAN",
                        StoreErrorKind::Corrupt,
                        format!("key name {n:?} does not end in a 16-digit hex key"),
                    )
                })?;
                keys.push(k);
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }
}

impl DynamicTable for RedisTable {
    fn spec(&self) -> &DynamicTableSpec {
        &self.spec
    }

    fn get_or_init(&self, keys: &[u64], rows: &mut [f32]) -> Result<()> {
        self.spec.check_rows(keys, rows)?;
        if keys.is_empty() {
            return Ok(());
        }
        let dim = self.spec.dim;
        let op = format!("MGET of {} rows", keys.len());
        self.with_con(|con| {
            let names: Vec<String> = keys.iter().map(|&k| self.name(0, k)).collect();
            let mut pipe = redis::pipe();
            self.mget(&mut pipe, &names);
            let replies: Vec<Value> = pipe.query(con).map_err(|e| self.err(&op, e))?;
            let values = self.mget_replies(&op, replies)?;
            let mut missing = Vec::new();
            for (i, v) in values.iter().enumerate() {
                match v {
                    Some(bytes) => {
                        self.decode(keys[i], 0, bytes, &mut rows[i * dim..(i + 1) * dim])?
                    }
                    None => missing.push(i),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            // Create the absent keys (row and slots at once), then read back what is stored:
            // ours, or what a racing worker created (identical bytes) and maybe already updated.
            let op = format!("MSETNX of {} new keys", missing.len());
            let mut pipe = redis::pipe();
            let mut entry = vec![0.0f32; self.spec.entry_len()];
            for &i in &missing {
                let k = keys[i];
                self.spec.init_entry(k, &mut entry);
                let cmd = pipe.cmd("MSETNX");
                for (a, part) in entry.chunks_exact(dim).enumerate() {
                    cmd.arg(self.name(a, k)).arg(encode(part));
                }
                cmd.ignore();
            }
            let new_names: Vec<String> = missing.iter().map(|&i| self.name(0, keys[i])).collect();
            self.mget(&mut pipe, &new_names);
            let replies: Vec<Value> = pipe.query(con).map_err(|e| self.err(&op, e))?;
            let values = self.mget_replies(&op, replies)?;
            for (&i, v) in missing.iter().zip(values) {
                let bytes = v.ok_or_else(|| {
                    self.store_error(
                        &op,
                        StoreErrorKind::Server,
                        format!(
                            "{} vanished right after it was created",
                            self.name(0, keys[i])
                        ),
                    )
                })?;
                self.decode(keys[i], 0, &bytes, &mut rows[i * dim..(i + 1) * dim])?;
            }
            Ok(())
        })
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
        if keys.is_empty() && update_id.is_none() {
            return Ok(Applied::Now);
        }
        let dim = self.spec.dim;
        let arrays = 1 + self.spec.slot_names.len();
        // Entry-major: key 0's row and slots, key 1's, ...
        let mut names: Vec<String> = Vec::with_capacity(keys.len() * arrays);
        for &k in keys {
            for a in 0..arrays {
                names.push(self.name(a, k));
            }
        }
        let marker = match update_id {
            Some(id) => format!("{}{id:016x}", self.applied_prefix),
            None => format!("{}untagged", self.applied_prefix),
        };
        let op = format!("update of {} keys", keys.len());
        self.with_con(|con| {
            let mut entries = vec![0.0f32; keys.len() * self.spec.entry_len()];
            for _attempt in 0..=self.config.max_retries {
                // Read: the applied marker and every row and slot, in one round trip.
                let mut pipe = redis::pipe();
                pipe.cmd("EXISTS").arg(&marker);
                self.mget(&mut pipe, &names);
                let mut replies: Vec<Value> = pipe
                    .query(con)
                    .map_err(|e| self.err(format!("MGET ({op})"), e))?;
                let exists: bool = redis::from_redis_value(replies.remove(0))
                    .map_err(|e| self.err(&op, e.into()))?;
                if exists && update_id.is_some() {
                    return Ok(Applied::Already);
                }
                let old = self.mget_replies(&op, replies)?;
                // Compute: the same arithmetic as every other backend.
                for (i, (&k, entry)) in keys
                    .iter()
                    .zip(entries.chunks_exact_mut(self.spec.entry_len()))
                    .enumerate()
                {
                    let parts = &old[i * arrays..(i + 1) * arrays];
                    match parts.iter().filter(|p| p.is_some()).count() {
                        0 => self.spec.init_entry(k, entry),
                        n if n == arrays => {
                            for (a, (bytes, out)) in
                                parts.iter().zip(entry.chunks_exact_mut(dim)).enumerate()
                            {
                                self.decode(k, a, bytes.as_deref().unwrap_or_default(), out)?;
                            }
                        }
                        n => {
                            return Err(self.store_error(
                                &op,
                                StoreErrorKind::Corrupt,
                                format!(
                                "key {k:#018x} has {n} of its {arrays} values (row and slots {:?})",
                                self.spec.slot_names
                            ),
                            ))
                        }
                    }
                    let (w, slots) = entry.split_at_mut(dim);
                    let mut slots: Vec<&mut [f32]> = slots.chunks_exact_mut(dim).collect();
                    optimizer.apply(&grads[i * dim..(i + 1) * dim], w, &mut slots);
                }
                // Write, if nothing changed since the read: one atomic script.
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(CAS_SCRIPT)
                    .arg(names.len() + 2)
                    .arg(&marker)
                    .arg(&self.journal_key)
                    .arg(&names);
                cmd.arg(update_id.map_or(String::new(), |id| id.to_string()));
                for v in &old {
                    cmd.arg(v.as_deref().unwrap_or_default());
                }
                for part in entries.chunks_exact(dim) {
                    cmd.arg(encode(part));
                }
                let outcome: i64 = cmd
                    .query(con)
                    .map_err(|e| self.err(format!("EVAL compare-and-set ({op})"), e))?;
                match outcome {
                    1 => return Ok(Applied::Now),
                    2 => return Ok(Applied::Already),
                    _ => {} // a concurrent writer changed a value: retry on fresh values
                }
            }
            Err(self.store_error(
                &op,
                StoreErrorKind::Conflict,
                format!(
                    "concurrent writers changed its keys {} times in a row (max_retries = {})",
                    self.config.max_retries + 1,
                    self.config.max_retries
                ),
            ))
        })
    }

    fn applied_updates(&self) -> Result<Vec<u64>> {
        self.with_con(|con| {
            let ids: Vec<String> = redis::cmd("LRANGE")
                .arg(&self.journal_key)
                .arg(0)
                .arg(-1)
                .query(con)
                .map_err(|e| self.err("LRANGE journal", e))?;
            ids.iter()
                .map(|s| {
                    s.parse().map_err(|_| {
                        self.store_error(
                            "LRANGE journal",
                            StoreErrorKind::Corrupt,
                            format!("journal entry {s:?} is not an update id"),
                        )
                    })
                })
                .collect()
        })
    }

    fn export(&self) -> Result<Snapshot> {
        let dim = self.spec.dim;
        let arrays = 1 + self.spec.slot_names.len();
        self.with_con(|con| {
            let keys = self.scan_rows(con)?;
            let mut snap = Snapshot::default();
            for chunk in keys.chunks(self.config.keys_per_command.div_ceil(arrays).max(1)) {
                let names: Vec<String> = chunk
                    .iter()
                    .flat_map(|&k| (0..arrays).map(move |a| (a, k)))
                    .map(|(a, k)| self.name(a, k))
                    .collect();
                let op = format!("export MGET of {} keys", chunk.len());
                let values: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                    .arg(&names)
                    .query(con)
                    .map_err(|e| self.err(&op, e))?;
                for (i, &k) in chunk.iter().enumerate() {
                    let mut flat = vec![0.0f32; self.spec.entry_len()];
                    for a in 0..arrays {
                        let bytes = values[i * arrays + a].as_deref().ok_or_else(|| {
                            self.store_error(
                                &op,
                                StoreErrorKind::Corrupt,
                                format!("{} is missing", self.name(a, k)),
                            )
                        })?;
                        self.decode(k, a, bytes, &mut flat[a * dim..(a + 1) * dim])?;
                    }
                    snap.entries.insert(k, Entry::from_flat(dim, &flat));
                }
            }
            Ok(snap)
        })
    }

    fn import(&self, snapshot: &Snapshot) -> Result<()> {
        for (&k, e) in &snapshot.entries {
            check_entry(&self.spec, k, e)?;
        }
        let arrays = 1 + self.spec.slot_names.len();
        self.with_con(|con| {
            let entries: Vec<(&u64, &Entry)> = snapshot.entries.iter().collect();
            for chunk in entries.chunks(self.config.keys_per_command.div_ceil(arrays).max(1)) {
                let mut cmd = redis::cmd("MSET");
                for (&k, e) in chunk {
                    cmd.arg(self.name(0, k)).arg(encode(&e.row));
                    for (a, s) in e.slots.iter().enumerate() {
                        cmd.arg(self.name(a + 1, k)).arg(encode(s));
                    }
                }
                cmd.query::<()>(con)
                    .map_err(|e| self.err(format!("import MSET of {} keys", chunk.len()), e))?;
            }
            Ok(())
        })
    }

    fn clear(&self) -> Result<()> {
        self.with_con(|con| {
            let base = format!("{}:{}:*", self.config.namespace, self.spec.name);
            let mut cursor: u64 = 0;
            loop {
                let (next, names): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&base)
                    .arg("COUNT")
                    .arg(1000)
                    .query(con)
                    .map_err(|e| self.err("SCAN", e))?;
                if !names.is_empty() {
                    redis::cmd("DEL")
                        .arg(&names)
                        .query::<()>(con)
                        .map_err(|e| self.err(format!("DEL of {} keys", names.len()), e))?;
                }
                cursor = next;
                if cursor == 0 {
                    return Ok(());
                }
            }
        })
    }
}
