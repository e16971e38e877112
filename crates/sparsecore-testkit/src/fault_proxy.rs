//! A loopback TCP proxy in front of a Redis server that crashes the server at a chosen point of
//! the n-th batch update (`EVAL` of the compare-and-set script) a client sends, so that fault
//! tests hit the exact moment they mean to:
//!
//! - [`Crash::MidRequest`]: the server receives only the first part of the update's bytes and
//!   is SIGKILLed.
//! - [`Crash::AfterApply`]: the server receives the whole update and runs it, but is SIGKILLed
//!   before the client sees the reply (applied, not acknowledged).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where in the n-th batch update the proxy strikes (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Crash {
    /// The server gets the update's first bytes only, then is killed.
    MidRequest,
    /// The server runs the whole update, then is killed before its reply reaches the client.
    AfterApply,
    /// Not a crash: another client's raw RESP request (a concurrent writer) reaches the server
    /// just before the update, i.e. between the update's read and its write.
    WriteFirst(Vec<u8>),
}

/// The proxy: clients connect to `port` instead of the server's.
pub struct FaultProxy {
    /// The loopback port clients connect to.
    pub port: u16,
    /// Set once the crash has happened.
    pub crashed: Arc<AtomicBool>,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl FaultProxy {
    /// Forwards connections to `127.0.0.1:upstream`; on the `nth` (1-based) `EVAL` crashes as
    /// `crash` says by calling `kill`.
    pub fn start(
        upstream: u16,
        nth: usize,
        crash: Crash,
        kill: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let crashed = Arc::new(AtomicBool::new(false));
        let evals = Arc::new(AtomicUsize::new(0));
        let kill = Arc::new(kill);
        let c = crashed.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                if c.load(Ordering::SeqCst) {
                    drop(client); // the server is gone: refuse like it would
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let drop_replies = Arc::new(AtomicBool::new(false));
                // Server → client.
                {
                    let (mut from, mut to, drop_replies) = (
                        server.try_clone().unwrap(),
                        client.try_clone().unwrap(),
                        drop_replies.clone(),
                    );
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0
                                || (!drop_replies.load(Ordering::SeqCst)
                                    && to.write_all(&buf[..n]).is_err())
                            {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
                // Client → server, watching for the n-th EVAL.
                let (mut from, mut to) = (client, server);
                let (evals, crashed, kill, crash) =
                    (evals.clone(), c.clone(), kill.clone(), crash.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut armed = false;
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => n,
                            Err(e)
                                if armed
                                    && matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) =>
                            {
                                // The client sent the whole update and waits for the reply: let
                                // the server run and persist it, then crash before it replies.
                                std::thread::sleep(Duration::from_millis(300));
                                crashed.store(true, Ordering::SeqCst);
                                kill();
                                let _ = from.shutdown(Shutdown::Both);
                                return;
                            }
                            Err(_) => break,
                        };
                        let chunk = &buf[..n];
                        if !armed {
                            if let Some(at) = find(chunk, b"$4\r\nEVAL\r\n") {
                                if evals.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                                    armed = true;
                                    if let Crash::WriteFirst(request) = &crash {
                                        let mut other =
                                            TcpStream::connect(("127.0.0.1", upstream)).unwrap();
                                        other.write_all(request).unwrap();
                                        let mut reply = [0u8; 64];
                                        let n = other.read(&mut reply).unwrap();
                                        assert!(
                                            reply[..n].starts_with(b"+OK"),
                                            "{:?}",
                                            String::from_utf8_lossy(&reply[..n])
                                        );
                                        armed = false;
                                        if to.write_all(chunk).is_err() {
                                            break;
                                        }
                                        continue;
                                    }
                                    if crash == Crash::MidRequest {
                                        // The rest of this chunk is never sent: the server
                                        // holds an incomplete command.
                                        let cut = at + (n - at) / 2;
                                        let _ = to.write_all(&chunk[..cut]);
                                        std::thread::sleep(Duration::from_millis(200));
                                        crashed.store(true, Ordering::SeqCst);
                                        kill();
                                        let _ = from.shutdown(Shutdown::Both);
                                        return;
                                    }
                                    drop_replies.store(true, Ordering::SeqCst);
                                    let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
                                }
                            }
                        }
                        if to.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
            }
        });
        FaultProxy { port, crashed }
    }

    /// The proxy's `redis://` URL, for a client that should go through it.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}
