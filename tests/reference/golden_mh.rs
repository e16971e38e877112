//! Multi-host golden cases: real outputs of the reference's multi-host runs (jax-tpu-embedding
//! 0.1.0, `../shared/golden_mh/README.md`), compared bit for bit.
//!
//! Runs every case under `testdata/reference/golden_mh` (the repository's own, made by
//! `scripts/make_reference_cases.sh`), under `../shared/golden_mh` when it is beside the
//! checkout (`sparsecore_testkit::sets`: a missing one is reported, and fails under `CI`) and,
//! with `GOLDEN_MH_DIR=/some/dir`, every case under that directory. A case is `case.json`
//! (`{"hosts": H, "batch_number": b}`) and `host_h/{input.json, expected.json}` for each host.
//! Each case runs twice, all its hosts together:
//! - in one process, one thread per host, joined by `LocalAllReduce::group`;
//! - as H processes (this test binary re-executed, see [`host_process`]) joined by
//!   `TcpAllReduce` on 127.0.0.1.
//!
//! Every host's output is compared with its own `expected.json` exactly as a `golden_mb` case
//! (tests/common).

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::Value;
use sparsecore_prep::input::SampleSource;
use sparsecore_prep::{AllReduce, LocalAllReduce, Output, Preprocessor, TcpAllReduce};
use sparsecore_testkit::case::Case;
use sparsecore_testkit::sets;

/// Set in a re-executed child: `<case dir>\n<rank>`; the child runs that host over TCP.
const HOST_ENV: &str = "GOLDEN_MH_HOST";
/// Prefix of the line a child prints with its listening address.
const ADDR_LINE: &str = "GOLDEN_MH_ADDR ";
/// Overrides a child's exchange deadline (milliseconds).
const TIMEOUT_ENV: &str = "GOLDEN_MH_TIMEOUT_MS";
/// Names the host that stops after its first step (the kill test).
const VICTIM_ENV: &str = "GOLDEN_MH_VICTIM";
const PAUSED_LINE: &str = "GOLDEN_MH_PAUSED";
const FAILED_LINE: &str = "GOLDEN_MH_FAILED ";
/// The all-reduce deadline of every exchange in these tests.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a whole multi-process case may take before its processes are killed.
const CASE_DEADLINE: Duration = Duration::from_secs(240);

/// A multi-host case directory.
pub struct MhCase {
    pub dir: PathBuf,
    pub hosts: usize,
    pub batch_number: u64,
}

impl MhCase {
    pub fn load(dir: &Path) -> Result<Self, String> {
        let meta = common::load_json(&dir.join("case.json"));
        let hosts = meta["hosts"].as_u64().ok_or("case.json: no `hosts`")? as usize;
        let batch_number = meta["batch_number"]
            .as_u64()
            .ok_or("case.json: no `batch_number`")?;
        if hosts == 0 {
            return Err("case.json: 0 hosts".into());
        }
        for h in 0..hosts {
            let hd = dir.join(format!("host_{h}"));
            if !hd.join("input.json").is_file() || !hd.join("expected.json").is_file() {
                return Err(format!(
                    "{} lacks input.json or expected.json",
                    hd.display()
                ));
            }
        }
        Ok(MhCase {
            dir: dir.to_path_buf(),
            hosts,
            batch_number,
        })
    }

    pub fn host_dir(&self, h: usize) -> PathBuf {
        self.dir.join(format!("host_{h}"))
    }
}

/// Runs host `h` of a case with `all_reduce` and compares with its `expected.json`; returns its
/// number of minibatches.
pub fn run_host(
    host_dir: &Path,
    batch_number: u64,
    all_reduce: Arc<dyn AllReduce>,
) -> Result<usize, String> {
    let case = Case::from_path(host_dir).map_err(|e| format!("loading: {e}"))?;
    let expected: Value = common::load_json(&host_dir.join("expected.json"));
    let builder = Preprocessor::builder(case.config.clone())
        .global_batch_sizes(case.global_batch_sizes())
        .threads(1)
        .all_reduce(all_reduce);
    let mut out = Output::new();
    let result = builder.build().and_then(|mut prep| {
        prep.set_batch_number(batch_number);
        let sources = case.sources()?;
        let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
        prep.run(&inputs, &mut out)?;
        Ok(prep)
    });
    if let Some(err) = expected.get("error") {
        return common::check_error(err, result.map(|_| ())).map(|_| 0);
    }
    let prep = result.map_err(|e| format!("preprocessing failed: {e}"))?;
    common::check_output(&case.raw, &expected, prep.plan().ok_or("no plan")?, &out)?;
    Ok(out.num_minibatches)
}

/// Every host's result, then: all passed and all agree on the number of minibatches.
fn combine(results: Vec<Result<usize, String>>) -> Result<(), String> {
    let mut errors = Vec::new();
    let mut ms = Vec::new();
    for (h, r) in results.into_iter().enumerate() {
        match r {
            Ok(m) => ms.push(m),
            Err(e) => errors.push(format!("host {h}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    if ms.windows(2).any(|w| w[0] != w[1]) {
        return Err(format!("hosts disagree on num_minibatches: {ms:?}"));
    }
    Ok(())
}

/// All hosts as threads of this process, joined by the given all-reduces (one per host).
pub fn run_threads(case: &MhCase, all_reduces: Vec<Arc<dyn AllReduce>>) -> Result<(), String> {
    let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = all_reduces
            .into_iter()
            .enumerate()
            .map(|(h, ar)| {
                let dir = case.host_dir(h);
                s.spawn(move || run_host(&dir, case.batch_number, ar))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("host thread panicked".into()))
            })
            .collect()
    });
    combine(results)
}

fn check_in_process(case: &MhCase) -> Result<(), String> {
    let group = LocalAllReduce::group(case.hosts, EXCHANGE_TIMEOUT);
    run_threads(
        case,
        group
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn AllReduce>)
            .collect(),
    )
    .map_err(|e| format!("in-process: {e}"))
}

/// A child process running one host; its stdout lines come through `lines`.
pub struct HostProcess {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub stderr: std::thread::JoinHandle<String>,
}

/// Starts host `rank` of `case` as a child process (this binary, running only [`host_process`]),
/// with `extra_env` set.
pub fn spawn_host(case_dir: &Path, rank: usize, extra_env: &[(&str, &str)]) -> HostProcess {
    let exe = std::env::current_exe().expect("test binary path");
    // The test's name as libtest knows it: its module path without the crate's name.
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let test = if module.is_empty() {
        "host_process".to_string()
    } else {
        format!("{module}::host_process")
    };
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", &test, "--nocapture", "--test-threads=1"])
        .env(HOST_ENV, format!("{}\n{rank}", case_dir.display()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawning a host process");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                // Keep draining so that the child never blocks on a full pipe.
            }
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    HostProcess {
        child,
        lines,
        stderr,
    }
}

/// Waits for a child's listening address (printed before it runs).
pub fn read_addr(p: &HostProcess, deadline: Instant) -> Result<SocketAddr, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = p
            .lines
            .recv_timeout(left)
            .map_err(|_| "no address from the host process".to_string())?;
        // libtest may print "test host_process ... " on the same line first.
        if let Some((_, a)) = line.split_once(ADDR_LINE) {
            return a
                .trim()
                .parse()
                .map_err(|e| format!("bad address line {line:?}: {e}"));
        }
    }
}

/// Sends every child the peer list.
pub fn send_peers(procs: &mut [HostProcess], addrs: &[SocketAddr]) {
    let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    for p in procs.iter_mut() {
        let mut stdin = p.child.stdin.take().expect("piped stdin");
        let _ = writeln!(stdin, "{}", list.join(","));
    }
}

/// Waits for a child until `deadline` (killing it then); `Ok(())` on exit status 0, else its
/// stderr's tail.
pub fn wait_host(p: HostProcess, deadline: Instant) -> Result<(), String> {
    let HostProcess {
        mut child, stderr, ..
    } = p;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let err = stderr.join().unwrap_or_default();
                if status.success() {
                    return Ok(());
                }
                let tail: String = err
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .take(12)
                    .collect::<Vec<_>>()
                    .join(" | ");
                return Err(format!("exited with {status}: {tail}"));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("did not finish in time (killed)".into());
            }
        }
    }
}

fn check_processes(case: &MhCase) -> Result<(), String> {
    let deadline = Instant::now() + CASE_DEADLINE;
    let mut procs: Vec<HostProcess> = (0..case.hosts)
        .map(|h| spawn_host(&case.dir, h, &[]))
        .collect();
    let addrs: Result<Vec<SocketAddr>, String> =
        procs.iter().map(|p| read_addr(p, deadline)).collect();
    let addrs = match addrs {
        Ok(a) => a,
        Err(e) => {
            for p in &mut procs {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
            return Err(format!("processes: {e}"));
        }
    };
    send_peers(&mut procs, &addrs);
    let results: Vec<Result<usize, String>> = procs
        .into_iter()
        .map(|p| wait_host(p, deadline).map(|_| 0))
        .collect();
    combine(results).map_err(|e| format!("processes over TCP: {e}"))
}

/// The child side: when `GOLDEN_MH_HOST` is set, runs that host over TCP (peers read from
/// stdin after printing its own address) and panics on any mismatch. Otherwise does nothing.
#[test]
fn host_process() {
    let Ok(spec) = std::env::var(HOST_ENV) else {
        return;
    };
    let (dir, rank) = spec.split_once('\n').expect("<dir>\\n<rank>");
    let rank: usize = rank.parse().expect("rank");
    let case = MhCase::load(Path::new(dir)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{ADDR_LINE}{}", listener.local_addr().unwrap()).unwrap();
        out.flush().unwrap();
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let peers: Vec<SocketAddr> = line
        .trim()
        .split(',')
        .map(|a| a.parse().expect("peer address"))
        .collect();
    assert_eq!(peers.len(), case.hosts, "peer list");
    let timeout = std::env::var(TIMEOUT_ENV)
        .ok()
        .map_or(EXCHANGE_TIMEOUT, |ms| {
            Duration::from_millis(ms.parse().unwrap())
        });
    let ar: Arc<dyn AllReduce> =
        Arc::new(TcpAllReduce::with_listener(rank, listener, peers.clone(), timeout).unwrap());
    if let Err(e) = run_host(&case.host_dir(rank), case.batch_number, ar.clone()) {
        panic!("host {rank} of {}: {e}", case.dir.display());
    }
    // The kill test: the victim stops after the first step and waits to be killed; every other
    // host's next step must fail with Error::AllReduce naming the victim.
    if let Ok(victim) = std::env::var(VICTIM_ENV) {
        let victim: usize = victim.parse().unwrap();
        let mut out = std::io::stdout().lock();
        if rank == victim {
            writeln!(out, "{PAUSED_LINE}").unwrap();
            out.flush().unwrap();
            drop(out);
            std::thread::sleep(Duration::from_secs(600));
            panic!("the victim was not killed");
        }
        drop(out);
        let err = run_step(&case.host_dir(rank), case.batch_number + 1, ar)
            .expect_err("a step without the victim");
        assert!(
            matches!(err, sparsecore_prep::Error::AllReduce { .. }),
            "host {rank}: {err:?}"
        );
        let named = format!("peer {victim} at {}", peers[victim]);
        assert!(
            err.to_string().contains(&named),
            "host {rank}: {err} does not name {named}"
        );
        let mut out = std::io::stdout().lock();
        writeln!(out, "{FAILED_LINE}{err}").unwrap();
        out.flush().unwrap();
    }
}

/// Runs host `host_dir`'s batch under another batch number, without comparing.
fn run_step(
    host_dir: &Path,
    batch_number: u64,
    all_reduce: Arc<dyn AllReduce>,
) -> Result<Output, sparsecore_prep::Error> {
    let case = Case::from_path(host_dir)?;
    let mut prep = Preprocessor::builder(case.config.clone())
        .global_batch_sizes(case.global_batch_sizes())
        .threads(1)
        .all_reduce(all_reduce)
        .build()?;
    prep.set_batch_number(batch_number);
    let sources = case.sources()?;
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
    prep.run_new(&inputs)
}

/// Case directories (holding case.json) under `root`, sorted; a missing or empty root panics.
pub fn mh_case_dirs(root: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(root).unwrap_or_else(|e| {
        panic!(
            "multi-host golden folder {} is missing: {e}",
            root.display()
        )
    });
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "no multi-host cases under {}",
        root.display()
    );
    dirs
}

fn run_mh_dir(root: &Path, label: &str) {
    let dirs = mh_case_dirs(root);
    let mut failures = Vec::new();
    for dir in &dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let t = Instant::now();
        let result = MhCase::load(dir).and_then(|case| {
            check_in_process(&case)?;
            let t1 = t.elapsed();
            check_processes(&case)?;
            let _ = writeln!(
                std::io::stderr(),
                "{label}: {name} in-process {t1:.1?}, processes {:.1?}",
                t.elapsed() - t1
            );
            Ok(())
        });
        if let Err(e) = result {
            failures.push(format!("{name}: {e}"));
        }
    }
    let passed = dirs.len() - failures.len();
    let _ = writeln!(
        std::io::stderr(),
        "{label}: {passed}/{} cases passed",
        dirs.len()
    );
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn golden_multihost_cases() {
    if let Some(root) = sets::shared_set("golden_mh", "golden_mh") {
        run_mh_dir(&root, "golden_mh");
    }
}

#[test]
fn repository_multihost_cases() {
    run_mh_dir(&sets::testdata("reference/golden_mh"), "testdata golden_mh");
}

#[test]
fn golden_mh_dir_from_env() {
    if let Some(dir) = std::env::var_os("GOLDEN_MH_DIR") {
        run_mh_dir(Path::new(&dir), "golden_mh (GOLDEN_MH_DIR)");
    }
}

/// A 4-host case whose hosts split differently alone: host 2's rows hold one id each, within
/// every limit, and the job splits (testdata/reference/README.md).
fn four_host_case() -> MhCase {
    MhCase::load(&sets::testdata(
        "reference/golden_mh/mh_h4_l1_weights_thin_host2",
    ))
    .unwrap()
}

/// Killing one host mid-run (after its first step, before its second) makes every other host's
/// second step fail within the deadline with `Error::AllReduce` naming the killed host.
#[test]
fn a_killed_host_is_named_by_every_other_host() {
    let case = four_host_case();
    let victim = 2usize;
    let deadline = Instant::now() + CASE_DEADLINE;
    let v = victim.to_string();
    let env = [
        (VICTIM_ENV, v.as_str()),
        (TIMEOUT_ENV, "3000"),
        ("SPARSECORE_PREP_ALLREDUCE_TOKEN", "kill-test-secret"),
    ];
    let mut procs: Vec<HostProcess> = (0..case.hosts)
        .map(|h| spawn_host(&case.dir, h, &env))
        .collect();
    let addrs: Vec<SocketAddr> = procs
        .iter()
        .map(|p| read_addr(p, deadline).unwrap())
        .collect();
    send_peers(&mut procs, &addrs);
    // Wait until the victim finished its first step, then kill it.
    loop {
        let line = procs[victim]
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("victim paused");
        if line.contains(PAUSED_LINE) {
            break;
        }
    }
    procs[victim].child.kill().unwrap();
    let mut errors = Vec::new();
    for (h, p) in procs.into_iter().enumerate() {
        if h == victim {
            let HostProcess { mut child, .. } = p;
            assert!(!child.wait().unwrap().success(), "the victim was killed");
            continue;
        }
        let mut said = None;
        while let Ok(line) = p
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if let Some((_, e)) = line.split_once(FAILED_LINE) {
                said = Some(e.to_string());
                break;
            }
        }
        // The child itself asserts that its error is an Error::AllReduce naming the victim.
        wait_host(p, deadline).unwrap_or_else(|e| panic!("host {h}: {e}"));
        let said = said.unwrap_or_else(|| panic!("host {h} reported no error"));
        assert!(
            said.contains(&format!("peer {victim} at {}", addrs[victim])),
            "host {h}: {said}"
        );
        errors.push(format!("host {h}: {said}"));
    }
    assert_eq!(errors.len(), case.hosts - 1);
    let _ = writeln!(
        std::io::stderr(),
        "killed host {victim}:\n{}",
        errors.join("\n")
    );
}

/// The TCP all-reduce's wire format, as a stranger (or a test) would write it.
mod wire {
    pub use crate::allreduce_wire::frame;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    /// Connects and reads the receiver's hello; returns the stream and its challenge.
    pub fn open(addr: SocketAddr) -> Option<(TcpStream, [u8; 16])> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let mut hello = [0u8; 28];
        s.read_exact(&mut hello).ok()?;
        assert_eq!(&hello[..4], b"SCAH");
        Some((s, hello[12..].try_into().unwrap()))
    }

    /// Sends `bytes` and reads the one-byte acknowledgement (None if the connection closed).
    pub fn send(s: &mut TcpStream, bytes: &[u8]) -> Option<u8> {
        s.write_all(bytes).ok()?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).ok()?;
        Some(ack[0])
    }
}

/// A stranger sends garbage, frames under a wrong token, replayed frames (authentic under an
/// earlier connection's challenge) and frames from ranks outside the job to every host of a
/// 4-host run, before and during it: every host's output still equals its expected.json, and
/// every kind of message was dropped and counted.
#[test]
fn a_stranger_cannot_change_a_four_host_run() {
    const TOKEN: &[u8] = b"the job's secret";
    let case = four_host_case();
    let listeners: Vec<TcpListener> = (0..case.hosts)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let hosts: Vec<Arc<TcpAllReduce>> = listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            Arc::new(
                TcpAllReduce::builder(r, addrs.clone())
                    .token(TOKEN)
                    .listener(l)
                    .timeout(EXCHANGE_TIMEOUT)
                    .build()
                    .unwrap(),
            )
        })
        .collect();
    let keys = [2 * case.batch_number, 2 * case.batch_number + 1];
    let done = std::sync::atomic::AtomicBool::new(false);
    let (round_tx, round_rx) = mpsc::channel::<()>();
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            let mut rounds = 0u64;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                for (r, &addr) in addrs.iter().enumerate() {
                    let peer = ((r + 1) % addrs.len()) as u32;
                    // Garbage: closes the connection (malformed).
                    if let Some((mut c, _)) = wire::open(addr) {
                        let _ = wire::send(&mut c, &[0xA5u8; 68]);
                    }
                    if let Some((mut c, ch)) = wire::open(addr) {
                        for (i, &key) in keys.iter().enumerate() {
                            let seq = 1 + i as u64;
                            // A wrong token (bad MAC), then a frame from outside the job.
                            let f = wire::frame(
                                b"a guessed token",
                                &ch,
                                peer,
                                r as u32,
                                seq,
                                key,
                                u64::MAX,
                            );
                            assert_eq!(
                                wire::send(&mut c, &f),
                                Some(1),
                                "a wrong token is rejected"
                            );
                            let f = wire::frame(TOKEN, &ch, 9, r as u32, seq, key, u64::MAX);
                            assert_eq!(
                                wire::send(&mut c, &f),
                                Some(1),
                                "an unknown rank is rejected"
                            );
                            // A frame recorded on an earlier connection, replayed here.
                            let f = wire::frame(
                                TOKEN,
                                &[rounds as u8; 16],
                                peer,
                                r as u32,
                                seq,
                                key,
                                u64::MAX,
                            );
                            assert_eq!(
                                wire::send(&mut c, &f),
                                Some(1),
                                "a replayed frame is rejected"
                            );
                        }
                    }
                }
                rounds += 1;
                let _ = round_tx.send(());
            }
        });
        round_rx.recv().unwrap(); // one whole round before the hosts start
        let r = run_threads(
            &case,
            hosts
                .iter()
                .map(|h| h.clone() as Arc<dyn AllReduce>)
                .collect(),
        );
        round_rx.recv().unwrap(); // and at least one more while or after they ran
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    result.unwrap();
    for (r, h) in hosts.iter().enumerate() {
        let c = h.counters();
        assert!(
            c.malformed >= 2 && c.bad_mac >= 8 && c.unknown_rank >= 4,
            "host {r}: {c:?}"
        );
        assert_eq!((c.duplicate, c.inbox_full), (0, 0), "host {r}: {c:?}");
        let _ = writeln!(std::io::stderr(), "stranger: host {r} dropped {c:?}");
    }
}
