//! Cross-host agreement for minibatching (SPEC 5.8): every host contributes a value under a
//! sync key and receives the OR over all hosts, so that all hosts split a step identically.
//!
//! [`LocalAllReduce`] serves a single host. [`TcpAllReduce`] connects the hosts of a job over
//! TCP, one listener per host, with a deadline on every exchange: a missing or killed peer gives
//! [`Error::AllReduce`] naming it, never a hang.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Agreement across hosts: every host contributes a value under a key and gets the OR of all.
///
/// The reference uses keys `2·batch_number` (is minibatching needed?) and `2·batch_number + 1`
/// (the split bits); `batch_number` must be equal on all hosts for one step and differ between
/// steps.
pub trait AllReduce: Send + Sync {
    /// Logical OR over all hosts.
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> Result<bool>;
    /// Bitwise OR over all hosts.
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> Result<u64>;
}

/// A single host: the OR of one value is itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalAllReduce;

impl AllReduce for LocalAllReduce {
    fn all_reduce_or_bool(&self, _key: u64, value: bool) -> Result<bool> {
        Ok(value)
    }
    fn all_reduce_or_u64(&self, _key: u64, value: u64) -> Result<u64> {
        Ok(value)
    }
}

impl LocalAllReduce {
    /// `hosts` in-process hosts (e.g. one thread each) of one job: member `r` of the returned
    /// vector is host `r`. Each exchange waits at most `timeout` for the other members, then
    /// fails with [`Error::AllReduce`] naming the members it did not hear from.
    pub fn group(hosts: usize, timeout: Duration) -> Vec<InProcessAllReduce> {
        let shared = Arc::new(GroupState { hosts, slots: Mutex::new(HashMap::new()), cv: Condvar::new() });
        (0..hosts).map(|rank| InProcessAllReduce { rank, timeout, shared: shared.clone() }).collect()
    }
}

/// Contributions of one key inside an [`InProcessAllReduce`] group.
#[derive(Debug)]
struct GroupSlot {
    values: Vec<Option<u64>>,
    read: usize,
}

#[derive(Debug)]
struct GroupState {
    hosts: usize,
    slots: Mutex<HashMap<u64, GroupSlot>>,
    cv: Condvar,
}

/// One member of an in-process group of hosts made by [`LocalAllReduce::group`].
#[derive(Debug, Clone)]
pub struct InProcessAllReduce {
    rank: usize,
    timeout: Duration,
    shared: Arc<GroupState>,
}

impl InProcessAllReduce {
    /// This member's rank in its group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn exchange(&self, key: u64, value: u64) -> Result<u64> {
        let deadline = Instant::now() + self.timeout;
        let g = &*self.shared;
        let poisoned = || Error::AllReduce { key, reason: "group lock poisoned".into() };
        let mut slots = g.slots.lock().map_err(|_| poisoned())?;
        {
            let slot = slots.entry(key).or_insert_with(|| GroupSlot { values: vec![None; g.hosts], read: 0 });
            if slot.values[self.rank].is_some() {
                return Err(Error::AllReduce { key, reason: format!("host {} contributed twice", self.rank) });
            }
            slot.values[self.rank] = Some(value);
        }
        g.cv.notify_all();
        loop {
            let slot = slots.get_mut(&key).expect("a slot stays until every member read it");
            if slot.values.iter().all(Option::is_some) {
                let or = slot.values.iter().fold(0u64, |a, v| a | v.unwrap_or(0));
                slot.read += 1;
                if slot.read == g.hosts {
                    slots.remove(&key);
                }
                return Ok(or);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> =
                    slot.values.iter().enumerate().filter(|(_, v)| v.is_none()).map(|(r, _)| r.to_string()).collect();
                return Err(Error::AllReduce {
                    key,
                    reason: format!("timed out after {:?} waiting for hosts {}", self.timeout, missing.join(", ")),
                });
            }
            slots = g.cv.wait_timeout(slots, deadline - now).map_err(|_| poisoned())?.0;
        }
    }
}

impl AllReduce for InProcessAllReduce {
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> Result<bool> {
        Ok(self.exchange(key, value as u64)? != 0)
    }
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> Result<u64> {
        self.exchange(key, value)
    }
}

/// Wire message: key (8 bytes LE), source rank (4), value (8).
const MESSAGE: usize = 20;

/// Contributions received so far, by key then source rank.
type Inbox = Mutex<HashMap<u64, HashMap<u32, u64>>>;

/// All-reduce over TCP between `peers.len()` hosts; this host is `rank`.
///
/// Each exchange sends this host's value to every peer (retrying until the deadline while a peer
/// is not listening yet) and waits for every peer's value under the same key.
pub struct TcpAllReduce {
    rank: u32,
    peers: Vec<SocketAddr>,
    timeout: Duration,
    inbox: Arc<(Inbox, Condvar)>,
    stop: Arc<AtomicBool>,
    listener: Option<JoinHandle<()>>,
    local: SocketAddr,
}

impl std::fmt::Debug for TcpAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpAllReduce").field("rank", &self.rank).field("peers", &self.peers).finish()
    }
}

impl TcpAllReduce {
    /// Listens on `peers[rank]` and talks to the others, waiting at most `timeout` per exchange.
    pub fn new(rank: usize, peers: Vec<SocketAddr>, timeout: Duration) -> Result<Self> {
        let addr = *peers.get(rank).ok_or_else(|| {
            Error::option("rank", rank, format!("must index the {} peer addresses", peers.len()))
        })?;
        let listener = TcpListener::bind(addr)
            .map_err(|source| Error::Io { context: format!("all-reduce: listening on {addr}"), source })?;
        Self::with_listener(rank, listener, peers, timeout)
    }

    /// Like [`TcpAllReduce::new`] with an already bound listener (e.g. bound to port 0 first, so
    /// that tests can learn every peer's address before starting).
    pub fn with_listener(rank: usize, listener: TcpListener, mut peers: Vec<SocketAddr>, timeout: Duration) -> Result<Self> {
        if rank >= peers.len() {
            return Err(Error::option("rank", rank, format!("must index the {} peer addresses", peers.len())));
        }
        let local = listener
            .local_addr()
            .map_err(|source| Error::Io { context: "all-reduce: reading the listener address".into(), source })?;
        peers[rank] = local;
        let inbox: Arc<(Inbox, Condvar)> = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (inbox2, stop2) = (inbox.clone(), stop.clone());
        let handle = std::thread::Builder::new()
            .name(format!("sparsecore-allreduce-{rank}"))
            .spawn({
                let hosts = peers.len() as u32;
                move || serve(listener, inbox2, stop2, rank as u32, hosts)
            })
            .map_err(|source| Error::Io { context: "all-reduce: starting the listener thread".into(), source })?;
        Ok(TcpAllReduce { rank: rank as u32, peers, timeout, inbox, stop, listener: Some(handle), local })
    }

    /// This host's listening address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn exchange(&self, key: u64, value: u64) -> Result<u64> {
        let deadline = Instant::now() + self.timeout;
        let mut msg = [0u8; MESSAGE];
        msg[..8].copy_from_slice(&key.to_le_bytes());
        msg[8..12].copy_from_slice(&self.rank.to_le_bytes());
        msg[12..].copy_from_slice(&value.to_le_bytes());
        for (r, addr) in self.peers.iter().enumerate() {
            if r as u32 == self.rank {
                continue;
            }
            send(addr, &msg, deadline).map_err(|e| Error::AllReduce {
                key,
                reason: format!("cannot reach peer {r} at {addr} within {:?}: {e}", self.timeout),
            })?;
        }
        let (lock, cv) = &*self.inbox;
        let mut inbox = lock.lock().map_err(|_| Error::AllReduce { key, reason: "inbox lock poisoned".into() })?;
        let others = self.peers.len() - 1;
        loop {
            let got = inbox.get(&key).map_or(0, |m| m.len());
            if got >= others {
                let values = inbox.remove(&key).unwrap_or_default();
                return Ok(values.values().fold(value, |a, &b| a | b));
            }
            let now = Instant::now();
            if now >= deadline {
                // Forget this key: late messages for it must not satisfy a later exchange.
                let heard_map = inbox.remove(&key);
                let heard: Vec<u32> = heard_map.map(|m| m.keys().copied().collect()).unwrap_or_default();
                let missing: Vec<String> = (0..self.peers.len() as u32)
                    .filter(|r| *r != self.rank && !heard.contains(r))
                    .map(|r| format!("{r} ({})", self.peers[r as usize]))
                    .collect();
                return Err(Error::AllReduce {
                    key,
                    reason: format!("timed out after {:?} waiting for peers {}", self.timeout, missing.join(", ")),
                });
            }
            inbox = cv
                .wait_timeout(inbox, deadline - now)
                .map_err(|_| Error::AllReduce { key, reason: "inbox lock poisoned".into() })?
                .0;
        }
    }
}

/// Sends one message, retrying until `deadline` while the peer is not accepting yet.
fn send(addr: &SocketAddr, msg: &[u8], deadline: Instant) -> std::io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        match TcpStream::connect_timeout(addr, left) {
            Ok(mut s) => {
                s.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
                return s.write_all(msg);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10).min(left)),
        }
    }
}

/// Accepts messages until stopped, filing them in the inbox.
fn serve(listener: TcpListener, inbox: Arc<(Inbox, Condvar)>, stop: Arc<AtomicBool>, rank: u32, hosts: u32) {
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut buf = [0u8; MESSAGE];
        if stream.read_exact(&mut buf).is_err() {
            continue; // a probe or a broken peer: ignore
        }
        let key = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        let src = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes"));
        let value = u64::from_le_bytes(buf[12..].try_into().expect("8 bytes"));
        if src >= hosts || src == rank {
            continue; // not a peer of this job: never let it complete an exchange
        }
        let (lock, cv) = &*inbox;
        if let Ok(mut m) = lock.lock() {
            m.entry(key).or_default().insert(src, value);
            cv.notify_all();
        }
    }
}

impl AllReduce for TcpAllReduce {
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> Result<bool> {
        Ok(self.exchange(key, value as u64)? != 0)
    }
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> Result<u64> {
        self.exchange(key, value)
    }
}

impl Drop for TcpAllReduce {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.local, Duration::from_millis(200));
        if let Some(h) = self.listener.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: usize, timeout: Duration) -> Vec<TcpAllReduce> {
        let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        listeners.into_iter().enumerate().map(|(r, l)| TcpAllReduce::with_listener(r, l, addrs.clone(), timeout).unwrap()).collect()
    }

    #[test]
    fn three_hosts_agree_on_the_or() {
        let hs = hosts(3, Duration::from_secs(10));
        let results: Vec<(bool, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = hs
                .iter()
                .enumerate()
                .map(|(r, h)| {
                    s.spawn(move || {
                        let b = h.all_reduce_or_bool(10, r == 1).unwrap();
                        let u = h.all_reduce_or_u64(11, 1u64 << (r * 7)).unwrap();
                        (b, u)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (b, u) in results {
            assert!(b);
            assert_eq!(u, 1 | (1 << 7) | (1 << 14));
        }
    }

    #[test]
    fn missing_peer_is_a_timeout_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // A peer address nobody listens on.
        let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let h = TcpAllReduce::with_listener(0, listener, vec!["127.0.0.1:0".parse().unwrap(), dead], Duration::from_millis(300))
            .unwrap();
        let t = Instant::now();
        let e = h.all_reduce_or_bool(4, true).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(matches!(&e, Error::AllReduce { key: 4, .. }), "{e:?}");
        assert!(e.to_string().contains(&dead.to_string()), "{e}");
    }
}
