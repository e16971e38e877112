//! The Redis backend of dynamic tables against a real `redis-server` on loopback (each test
//! starts its own on a random free port in a temp dir, or uses `SPARSECORE_REDIS_URL` when it
//! does not kill the server): identical results to the in-memory reference, the stored layout,
//! four worker processes on overlapping keys checked against a sequential replay, a server
//! killed mid-stream (typed errors, no partial batch after a restart from its AOF, exactly-once
//! retries) and a stopped server (timeouts, not hangs).

use sparsecore_testkit::{fault_proxy, redis_server};

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fault_proxy::{Crash, FaultProxy};
use redis_server::{shared_or_spawned, Persistence, RedisServer};
use serde_json::Value;
use sparsecore_kernel::dynamic::{
    Applied, DynamicTable, DynamicTableSpec, Initializer, LoadStream, MemoryTable, RedisConfig,
    RedisTable, Snapshot,
};
use sparsecore_kernel::Optimizer;
use sparsecore_kernel::{KernelError, StoreErrorKind};

const BIN: &str = env!("CARGO_BIN_EXE_sparsecore-prep");
static NS: AtomicUsize = AtomicUsize::new(0);

/// A namespace no other test (or earlier run on a shared server) uses.
fn namespace() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "test-{}-{}-{nanos}",
        std::process::id(),
        NS.fetch_add(1, Ordering::SeqCst)
    )
}

fn spec(name: &str, dim: usize, opt: &Optimizer, seed: u64) -> DynamicTableSpec {
    DynamicTableSpec::new(name, dim, opt, Initializer::Uniform { scale: 0.05, seed }).unwrap()
}

fn open(url: &str, ns: &str, spec: DynamicTableSpec, timeout: Duration) -> RedisTable {
    let mut c = RedisConfig::new(url);
    c.namespace = ns.to_string();
    c.connect_timeout = timeout;
    c.io_timeout = timeout;
    c.keys_per_command = 7; // several MGET/MSET commands per batch, in one round trip
    RedisTable::open(spec, c).unwrap()
}

fn store_kind(e: &KernelError) -> Option<StoreErrorKind> {
    match e.root() {
        KernelError::DynamicStore { kind, .. } => Some(*kind),
        _ => None,
    }
}

/// One batch of the stream on any table: the lookups a training step does, then its update.
fn step(
    t: &dyn DynamicTable,
    s: &LoadStream,
    opt: &Optimizer,
    id: u64,
) -> Result<(Vec<f32>, Applied), KernelError> {
    let (keys, grads) = s.update(id);
    let all: Vec<u64> = keys.iter().chain(&s.lookups(id)).copied().collect();
    let mut rows = vec![0.0; all.len() * s.dim];
    t.get_or_init(&all, &mut rows)?;
    let applied = t.apply_update(Some(id), &keys, &grads, opt)?;
    Ok((rows, applied))
}

/// The in-memory table after running `ids` one after another.
fn replay(spec: DynamicTableSpec, s: &LoadStream, opt: &Optimizer, ids: &[u64]) -> Snapshot {
    let t = MemoryTable::new(spec);
    for &id in ids {
        assert_eq!(step(&t, s, opt, id).unwrap().1, Applied::Now);
    }
    t.export().unwrap()
}

fn assert_same(got: &Snapshot, want: &Snapshot) {
    assert!(
        got.bits_eq(want),
        "{} vs {} keys; first difference at key {:?}",
        got.entries.len(),
        want.entries.len(),
        got.first_difference(want)
    );
}

#[test]
fn redis_equals_memory_on_the_same_key_stream() {
    let (url, _server) = shared_or_spawned();
    let optimizers = [
        Optimizer::Adagrad { lr: 0.05 },
        Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step: 4,
        },
        Optimizer::Ftrl {
            lr: 0.1,
            lr_power: -0.5,
            l1: 0.001,
            l2: 0.0,
            beta: 0.0,
            multiply_linear_by_lr: true,
        },
        Optimizer::Sgd { lr: 0.5 },
    ];
    let s = LoadStream {
        seed: 3,
        keys_per_batch: 40,
        key_space: 100,
        lookups_per_batch: 25,
        dim: 5,
    };
    for opt in optimizers {
        let ns = namespace();
        let r = open(&url, &ns, spec("emb", 5, &opt, 3), Duration::from_secs(5));
        let m = MemoryTable::new(spec("emb", 5, &opt, 3));
        for id in 0..12 {
            let (rows_r, ar) = step(&r, &s, &opt, id).unwrap();
            let (rows_m, am) = step(&m, &s, &opt, id).unwrap();
            assert_eq!(ar, am);
            assert_eq!(
                rows_r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                rows_m.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        // Untagged updates and replays of tagged ones.
        let (keys, grads) = s.update(99);
        r.apply_gradients(&keys, &grads, &opt).unwrap();
        m.apply_gradients(&keys, &grads, &opt).unwrap();
        assert_eq!(
            r.apply_update(Some(3), &keys, &grads, &opt).unwrap(),
            Applied::Already
        );
        assert_eq!(r.applied_updates().unwrap(), (0..12).collect::<Vec<u64>>());
        assert_same(&r.export().unwrap(), &m.export().unwrap());
        // Import into another Redis table equals the source.
        let copy = open(&url, &ns, spec("copy", 5, &opt, 3), Duration::from_secs(5));
        copy.import(&m.export().unwrap()).unwrap();
        assert_same(&copy.export().unwrap(), &m.export().unwrap());
        r.clear().unwrap();
        assert!(r.export().unwrap().entries.is_empty() && r.applied_updates().unwrap().is_empty());
        assert!(
            !copy.export().unwrap().entries.is_empty(),
            "clearing one table leaves the others"
        );
        copy.clear().unwrap();
    }
}

/// Batches of 4500 rows and slots cross the script's 2000-key chunks (and the client's
/// per-command chunks) and still equal memory. A concurrent write to a slot that sits in the
/// last chunk, landing between a batch's read and its write (injected by the proxy), is seen:
/// the batch is retried on the new value instead of overwriting it.
#[test]
fn large_batches_see_a_conflict_in_their_last_chunk() {
    let server = RedisServer::start(Persistence::None);
    let opt = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step: 0,
    };
    let s = LoadStream {
        seed: 8,
        keys_per_batch: 1500,
        key_space: 1600,
        lookups_per_batch: 100,
        dim: 4,
    };
    let ns = namespace();
    // Key 1400 of batch 2: its names are 4200..4203 of 4500, in the script's third chunk.
    let key = s.update(2).0[1400];
    let m_name = format!("{ns}:big:m:{key:016x}");
    let new_m = [1.0f32, 2.0, 3.0, 4.0];
    let bytes: Vec<u8> = new_m.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut request = format!(
        "*3\r\n$3\r\nSET\r\n${}\r\n{m_name}\r\n${}\r\n",
        m_name.len(),
        bytes.len()
    )
    .into_bytes();
    request.extend_from_slice(&bytes);
    request.extend_from_slice(b"\r\n");
    let proxy = FaultProxy::start(server.port, 3, Crash::WriteFirst(request), || {});
    let r = open(
        &proxy.url(),
        &ns,
        spec("big", 4, &opt, 8),
        Duration::from_secs(5),
    );
    let m = MemoryTable::new(spec("big", 4, &opt, 8));
    for id in 0..2 {
        step(&r, &s, &opt, id).unwrap();
        step(&m, &s, &opt, id).unwrap();
    }
    assert_same(&r.export().unwrap(), &m.export().unwrap());
    // Batch 2's update is the third EVAL: the other writer's SET lands first.
    step(&r, &s, &opt, 2).unwrap();
    let mut e = m.export().unwrap().entries[&key].clone();
    e.slots[0] = new_m.to_vec();
    let mut patch = Snapshot::default();
    patch.entries.insert(key, e);
    m.import(&patch).unwrap();
    step(&m, &s, &opt, 2).unwrap();
    step(&r, &s, &opt, 3).unwrap();
    step(&m, &s, &opt, 3).unwrap();
    assert_same(&r.export().unwrap(), &m.export().unwrap());
}

#[test]
fn keys_are_namespaced_by_table_and_slot() {
    let (url, _server) = shared_or_spawned();
    let ns = namespace();
    let opt = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step: 0,
    };
    let t = open(&url, &ns, spec("users", 3, &opt, 1), Duration::from_secs(5));
    t.apply_update(Some(5), &[0xabc], &[0.5, -0.5, 0.25], &opt)
        .unwrap();
    let mut con = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query(&mut con)
        .unwrap();
    names.sort();
    let want = [
        format!("{ns}:users:applied:0000000000000005"),
        format!("{ns}:users:journal"),
        format!("{ns}:users:m:0000000000000abc"),
        format!("{ns}:users:v:0000000000000abc"),
        format!("{ns}:users:w:0000000000000abc"),
    ];
    assert_eq!(names, want);
    let e = &t.export().unwrap().entries[&0xabc];
    let stored: Vec<u8> = redis::cmd("GET").arg(&want[4]).query(&mut con).unwrap();
    assert_eq!(
        stored,
        e.row
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
        "rows are little-endian f32"
    );
    let m: Vec<u8> = redis::cmd("GET").arg(&want[2]).query(&mut con).unwrap();
    assert_eq!(
        m,
        e.slots[0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
    );
    // A value of the wrong size, or a key missing a slot, is reported, not misread.
    let _: () = redis::cmd("SET")
        .arg(format!("{ns}:users:w:0000000000000001"))
        .arg("xyz")
        .query(&mut con)
        .unwrap();
    let e = t.get_or_init(&[1], &mut [0.0; 3]).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Corrupt), "{e}");
    assert!(
        e.to_string().contains("users") && e.to_string().contains("3 bytes stored, expected 12"),
        "{e}"
    );
    let e = t.apply_gradients(&[1], &[0.0; 3], &opt).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Corrupt), "{e}");
    assert!(e.to_string().contains("1 of its 3 values"), "{e}");
    t.clear().unwrap();
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query(&mut con)
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn unreachable_server_is_a_typed_connection_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = RedisConfig::new(&format!("redis://127.0.0.1:{port}/"));
    c.connect_timeout = Duration::from_millis(500);
    let e = RedisTable::open(spec("t", 2, &Optimizer::Sgd { lr: 0.1 }, 0), c).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Connection), "{e}");
    assert!(
        e.to_string().contains(&port.to_string()) && e.to_string().contains("`t`"),
        "{e}"
    );
    let e = RedisTable::open(
        spec("t", 2, &Optimizer::Sgd { lr: 0.1 }, 0),
        RedisConfig::new("not a url"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("not a url"), "{e}");
}

/// Four `sparsecore-prep dynamic load` processes create and update overlapping keys at once.
/// Every update is journaled exactly once, and the table equals a sequential replay of the
/// journal on the in-memory backend, bit for bit; keys only looked up hold their initial row.
#[test]
fn four_worker_processes_equal_a_sequential_replay() {
    let (url, _server) = shared_or_spawned();
    let ns = namespace();
    let (workers, batches) = (4u64, 25u64);
    let s = LoadStream {
        seed: 5,
        keys_per_batch: 32,
        key_space: 64,
        lookups_per_batch: 16,
        dim: 4,
    };
    let children: Vec<_> = (0..workers)
        .map(|w| {
            Command::new(BIN)
                .args([
                    "dynamic",
                    "load",
                    "--backend",
                    "redis",
                    "--url",
                    &url,
                    "--namespace",
                    &ns,
                    "--table",
                    "shared",
                ])
                .args([
                    "--dim",
                    "4",
                    "--optimizer",
                    "adagrad",
                    "--lr",
                    "0.05",
                    "--init-scale",
                    "0.05",
                    "--seed",
                    "5",
                ])
                .args([
                    "--worker",
                    &w.to_string(),
                    "--batches",
                    &batches.to_string(),
                ])
                .args([
                    "--keys-per-batch",
                    "32",
                    "--key-space",
                    "64",
                    "--lookups-per-batch",
                    "16",
                ])
                .output_async()
        })
        .collect();
    for (w, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "worker {w}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(line["applied"], batches, "worker {w}: {line}");
    }
    let opt = Optimizer::Adagrad { lr: 0.05 };
    let t = open(
        &url,
        &ns,
        spec("shared", 4, &opt, 5),
        Duration::from_secs(5),
    );
    let journal = t.applied_updates().unwrap();
    let mut sorted = journal.clone();
    sorted.sort_unstable();
    let all: Vec<u64> = (0..workers)
        .flat_map(|w| (0..batches).map(move |i| w << 32 | i))
        .collect();
    assert_eq!(sorted, all, "every update applied exactly once");
    assert!(
        journal != all,
        "the workers interleaved (otherwise this test shows nothing)"
    );
    let got = t.export().unwrap();
    assert_same(
        &got,
        &replay(spec("shared", 4, &opt, 5), &s, &opt, &journal),
    );
    // One initial value per key: keys that were only looked up hold exactly their initial row.
    let updated: BTreeSet<u64> = all.iter().flat_map(|&id| s.update(id).0).collect();
    let mut lookup_only = 0;
    for (k, e) in &got.entries {
        if !updated.contains(k) {
            let mut init = [0f32; 4];
            Initializer::Uniform {
                scale: 0.05,
                seed: 5,
            }
            .init_row(*k, &mut init);
            assert_eq!(e.row, init);
            assert_eq!(e.slots, vec![vec![0.1f32; 4]]);
            lookup_only += 1;
        }
    }
    assert!(lookup_only > 0);
    t.clear().unwrap();
}

trait OutputAsync {
    fn output_async(&mut self) -> std::process::Child;
}

impl OutputAsync for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// The server is SIGKILLed while a stream of batches runs. Calls return typed connection errors
/// (no panic, no hang); after a restart from its append-only file the journal is a prefix of
/// the stream holding every acknowledged batch, and the table equals the replay of exactly that
/// prefix: no batch was applied partially. Retrying the interrupted batch under its id then
/// applies it exactly once.
#[test]
fn killed_server_leaves_no_partial_batch() {
    let server = Arc::new(Mutex::new(RedisServer::start(Persistence::AofAlways)));
    let url = server.lock().unwrap().url();
    let ns = namespace();
    let opt = Optimizer::Adagrad { lr: 0.05 };
    let s = LoadStream {
        seed: 11,
        keys_per_batch: 300,
        key_space: 1000,
        lookups_per_batch: 0,
        dim: 8,
    };
    let t = open(&url, &ns, spec("ft", 8, &opt, 11), Duration::from_secs(2));
    let total = 60u64;
    let acked = Arc::new(AtomicU64::new(0));
    let killer = {
        let (server, acked) = (server.clone(), acked.clone());
        std::thread::spawn(move || {
            // Bounded wait for 20 acknowledged batches, then SIGKILL mid-stream after a varying
            // delay, so that runs hit different phases of a batch (read, compute, write).
            for _ in 0..6000 {
                if acked.load(Ordering::SeqCst) >= 20 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
            std::thread::sleep(Duration::from_micros(u64::from(nanos % 20_000)));
            server.lock().unwrap().kill();
        })
    };
    let mut failed = None;
    for id in 0..total {
        let (keys, grads) = s.update(id);
        match t.apply_update(Some(id), &keys, &grads, &opt) {
            Ok(a) => {
                assert_eq!(a, Applied::Now);
                acked.store(id + 1, Ordering::SeqCst);
            }
            Err(e) => {
                let kind = store_kind(&e);
                assert!(
                    matches!(
                        kind,
                        Some(StoreErrorKind::Connection | StoreErrorKind::Timeout)
                    ),
                    "{e}"
                );
                assert!(e.to_string().contains("`ft`"), "{e}");
                failed = Some(id);
                break;
            }
        }
    }
    killer.join().unwrap();
    let failed = failed.expect("the server was killed before the stream ended");
    // While it is down, every call fails the same typed way.
    let e = t.get_or_init(&[1, 2], &mut [0.0; 16]).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Connection), "{e}");
    let e = t.applied_updates().unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Connection), "{e}");

    server.lock().unwrap().restart();
    let journal = t.applied_updates().unwrap();
    let n = journal.len() as u64;
    eprintln!("killed at batch {failed}; {n} batches survived the restart");
    assert_eq!(
        journal,
        (0..n).collect::<Vec<u64>>(),
        "the journal is a prefix of the stream"
    );
    assert!(
        n == failed || n == failed + 1,
        "every acknowledged batch survived: journal {n}, first failure at {failed}"
    );
    assert_same(
        &t.export().unwrap(),
        &replay(spec("ft", 8, &opt, 11), &s, &opt, &journal),
    );

    // Resume: the interrupted batch under its own id (applied once, whether or not it had
    // committed), then the rest.
    for id in failed..total {
        let (keys, grads) = s.update(id);
        let a = t.apply_update(Some(id), &keys, &grads, &opt).unwrap();
        assert_eq!(a == Applied::Already, id < n, "batch {id}");
    }
    let all: Vec<u64> = (0..total).collect();
    assert_eq!(t.applied_updates().unwrap(), all);
    assert_same(
        &t.export().unwrap(),
        &replay(spec("ft", 8, &opt, 11), &s, &opt, &all),
    );
}

/// The server crashes at an exact point of the 21st batch's update (through a proxy that
/// watches the bytes): with only part of the request received, or after running it but before
/// replying. After a restart from the AOF the batch is wholly absent or wholly present,
/// the table equals the replay of the journal, and retrying under its id applies it once.
fn crash_at(crash: Crash) {
    let server = Arc::new(Mutex::new(RedisServer::start(Persistence::AofAlways)));
    let upstream = server.lock().unwrap().port;
    // The proxy's threads outlive the test: they hold the server weakly, so that dropping it
    // at the end (or while unwinding) still stops the process.
    let killer = Arc::downgrade(&server);
    let proxy = FaultProxy::start(upstream, 21, crash.clone(), move || {
        if let Some(s) = killer.upgrade() {
            s.lock().unwrap().kill();
        }
    });
    let ns = namespace();
    let opt = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step: 1,
    };
    let s = LoadStream {
        seed: 12,
        keys_per_batch: 400,
        key_space: 1000,
        lookups_per_batch: 0,
        dim: 8,
    };
    let t = open(
        &proxy.url(),
        &ns,
        spec("cut", 8, &opt, 12),
        Duration::from_secs(2),
    );
    let total = 30u64;
    let mut failed = None;
    for id in 0..total {
        let (keys, grads) = s.update(id);
        if let Err(e) = t.apply_update(Some(id), &keys, &grads, &opt) {
            assert_eq!(store_kind(&e), Some(StoreErrorKind::Connection), "{e}");
            failed = Some(id);
            break;
        }
    }
    assert_eq!(
        failed,
        Some(20),
        "{crash:?}: the 21st update is the one cut"
    );
    assert!(proxy.crashed.load(Ordering::SeqCst));
    let e = t.get_or_init(&[1], &mut [0.0; 8]).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Connection), "{e}");

    server.lock().unwrap().restart();
    let url = server.lock().unwrap().url();
    let t = open(&url, &ns, spec("cut", 8, &opt, 12), Duration::from_secs(2));
    let journal = t.applied_updates().unwrap();
    let survived = if crash == Crash::AfterApply { 21 } else { 20 };
    assert_eq!(journal, (0..survived).collect::<Vec<u64>>(), "{crash:?}");
    assert_same(
        &t.export().unwrap(),
        &replay(spec("cut", 8, &opt, 12), &s, &opt, &journal),
    );
    for id in 20..total {
        let (keys, grads) = s.update(id);
        let a = t.apply_update(Some(id), &keys, &grads, &opt).unwrap();
        assert_eq!(a == Applied::Already, id < survived, "{crash:?} batch {id}");
    }
    let all: Vec<u64> = (0..total).collect();
    assert_eq!(t.applied_updates().unwrap(), all);
    assert_same(
        &t.export().unwrap(),
        &replay(spec("cut", 8, &opt, 12), &s, &opt, &all),
    );
}

#[test]
fn crash_mid_request_applies_nothing_of_the_batch() {
    crash_at(Crash::MidRequest);
}

#[test]
fn crash_after_apply_keeps_the_whole_batch_and_retry_is_a_no_op() {
    crash_at(Crash::AfterApply);
}

/// A server that stops answering (SIGSTOP) makes calls fail with a timeout error instead of
/// hanging; once it continues, the table works again on a fresh connection.
#[test]
fn stopped_server_times_out() {
    let server = RedisServer::start(Persistence::None);
    let opt = Optimizer::Sgd { lr: 0.1 };
    let t = open(
        &server.url(),
        &namespace(),
        spec("slow", 2, &opt, 0),
        Duration::from_millis(300),
    );
    t.apply_update(Some(1), &[7], &[1.0, 1.0], &opt).unwrap();
    server.signal("STOP");
    let e = t
        .apply_update(Some(2), &[7], &[1.0, 1.0], &opt)
        .unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Timeout), "{e}");
    assert!(
        e.to_string().contains("300ms"),
        "the message names the timeout: {e}"
    );
    let e = t.get_or_init(&[7], &mut [0.0; 2]).unwrap_err();
    assert_eq!(store_kind(&e), Some(StoreErrorKind::Timeout), "{e}");
    server.signal("CONT");
    // The timed-out update may have been queued by the kernel and applied after CONT; retrying
    // it under its id applies it exactly once either way.
    t.apply_update(Some(2), &[7], &[1.0, 1.0], &opt).unwrap();
    assert_eq!(t.applied_updates().unwrap(), [1, 2]);
    let mut init = [0f32; 2];
    Initializer::Uniform {
        scale: 0.05,
        seed: 0,
    }
    .init_row(7, &mut init);
    let row = t.lookup(&[7]).unwrap();
    assert_eq!(
        row.as_slice().unwrap(),
        [init[0] - 0.1 - 0.1, init[1] - 0.1 - 0.1]
    );
}
