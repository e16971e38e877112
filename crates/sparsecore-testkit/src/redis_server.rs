//! A throwaway `redis-server` for tests and benches: loopback only, a random free port, its own
//! temp dir (persistence files included), killed and removed on drop. Set
//! `SPARSECORE_REDIS_SERVER` to use another binary than the `redis-server` on `PATH`
//! (`scripts/ci_redis.sh` installs Debian's).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// How the server persists its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// Nothing on disk.
    None,
    /// Append-only file, fsync after every write: every acknowledged write survives a kill.
    AofAlways,
}

/// A running server, killed and its directory removed on drop.
pub struct RedisServer {
    child: Option<Child>,
    /// Its loopback port.
    pub port: u16,
    /// Its working directory (persistence files and `redis.log`).
    pub dir: PathBuf,
    persistence: Persistence,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a loopback port")
        .local_addr()
        .unwrap()
        .port()
}

fn binary() -> String {
    std::env::var("SPARSECORE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_string())
}

impl RedisServer {
    /// Starts a server and waits (at most 10 s) until it answers PING.
    pub fn start(persistence: Persistence) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("sparsecore-redis-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = RedisServer {
            child: None,
            port: free_port(),
            dir,
            persistence,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(binary());
        cmd.arg("--bind")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(self.port.to_string());
        cmd.arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .arg("--daemonize")
            .arg("no");
        cmd.arg("--logfile").arg(self.dir.join("redis.log"));
        match self.persistence {
            Persistence::None => cmd.arg("--appendonly").arg("no"),
            Persistence::AofAlways => cmd
                .arg("--appendonly")
                .arg("yes")
                .arg("--appendfsync")
                .arg("always"),
        };
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap_or_else(|e| {
            panic!(
                "cannot start `{}` ({e}): the Redis tests need a redis-server; run scripts/ci_redis.sh \
                 (Debian's redis-server) or set SPARSECORE_REDIS_SERVER",
                binary()
            )
        });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s; log: {}",
            self.port,
            self.log()
        );
    }

    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.port).into(),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 64];
        s.write_all(b"PING\r\n").is_ok()
            && matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Its log so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// Its process id; the server must be running.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL: no shutdown save, no goodbye to clients.
    /// Kills it (SIGKILL) and waits for it, if it runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal by name (`STOP`, `CONT`) with kill(1).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(st.success(), "kill -{sig} {}", self.pid());
    }

    /// Starts the server again on the same port and directory (loading its persistence files).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Its working directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped server must be continued to die cleanly.
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(c.id().to_string())
                .status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server for tests that do not kill it: `SPARSECORE_REDIS_URL` if set (the caller uses a
/// unique namespace), else a fresh one owned by the returned guard.
pub fn shared_or_spawned() -> (String, Option<RedisServer>) {
    match std::env::var("SPARSECORE_REDIS_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let s = RedisServer::start(Persistence::None);
            (s.url(), Some(s))
        }
    }
}
