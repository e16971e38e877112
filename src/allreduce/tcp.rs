//! The TCP transport of the all-reduce: [`TcpAllReduce`], its builder and counters, the
//! HMAC-authenticated frames its hosts exchange, and the listener that serves them. Compiled with
//! the `tcp` feature (on by default), which also brings the `hmac` dependency.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{Hmac, KeyInit, Mac};

use super::{deadline_after, AllReduce};
use crate::error::{Error, Result};

/// The environment variable a job's shared all-reduce secret is read from when none is given to
/// [`TcpAllReduceBuilder::token`].
pub const TOKEN_ENV: &str = "SPARSECORE_PREP_ALLREDUCE_TOKEN";
/// Most keys a host keeps pending (received from peers before it asked for them). A peer is at
/// most one exchange ahead, so a job needs 2; more are refused (the sender retries).
pub const INBOX_KEYS: usize = 64;
/// Pending keys older than this many completed exchanges of this host expire.
pub(crate) const STEP_WINDOW: u64 = 4;
/// Most connections served at once; more are closed at once (counted).
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// A served connection that sends nothing for this long is closed.
const IDLE: Duration = Duration::from_secs(5);
/// Completed keys remembered, so that a late duplicate cannot start a new pending key.
const DONE_KEYS: usize = 256;

const HELLO_MAGIC: &[u8; 4] = b"SCAH";
const FRAME_MAGIC: &[u8; 4] = b"SCAF";
/// Hello (receiver to sender): magic, version (u32), receiver rank (u32), challenge (16).
const HELLO: usize = 28;
/// Frame (sender to receiver): magic, src (u32), dst (u32), seq, key, value (u64), HMAC (32).
const FRAME: usize = 68;
const VERSION: u32 = 1;
const DOMAIN: &[u8] = b"sparsecore-prep/allreduce/v1";
const ACK_OK: u8 = 0;
const ACK_REJECTED: u8 = 1;
const ACK_BUSY: u8 = 2;

type HmacSha256 = Hmac<sha2::Sha256>;

/// Counts of what a [`TcpAllReduce`] host dropped; none of these ever changes a result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllReduceCounters {
    /// Frames without the magic, cut short, or connections that sent no whole frame.
    pub malformed: u64,
    /// Frames from a rank outside the job (or this host's own), or addressed to another rank.
    pub unknown_rank: u64,
    /// Frames whose HMAC does not verify under the job's secret (wrong token, tampering, or a
    /// frame replayed on another connection, whose challenge differs).
    pub bad_mac: u64,
    /// Frames replayed on their connection (sequence number not increasing).
    pub replayed: u64,
    /// Authentic frames for a (key, rank) already received or completed: never override.
    pub duplicate: u64,
    /// Authentic frames for a new key refused because [`INBOX_KEYS`] keys were pending.
    pub inbox_full: u64,
    /// Pending keys dropped because they were older than the step window.
    pub expired: u64,
    /// Connections closed at once because the most a host serves at once (64) were being served.
    pub connections_refused: u64,
}

#[derive(Default)]
struct Counters {
    malformed: AtomicU64,
    unknown_rank: AtomicU64,
    bad_mac: AtomicU64,
    replayed: AtomicU64,
    duplicate: AtomicU64,
    inbox_full: AtomicU64,
    expired: AtomicU64,
    connections_refused: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Values received for one key, by source rank, and when (in completed exchanges) it arrived.
struct Pending {
    values: HashMap<u32, u64>,
    born: u64,
}

#[derive(Default)]
struct InboxState {
    pending: HashMap<u64, Pending>,
    done: VecDeque<u64>,
    completed: u64,
    /// Values filed whose acknowledgement is not written yet. An exchange that has heard every
    /// peer waits for these before it returns: otherwise this host could finish and close its
    /// connections (drop, exit) before a peer reads the ack of the very value that completed
    /// the exchange, and that peer would resend to a closed port until its deadline.
    acks_in_flight: usize,
}

impl InboxState {
    /// Ends `key` (completed or failed): forgets it, remembers it as done, expires old keys.
    fn finish(&mut self, key: u64, counters: &Counters) {
        self.pending.remove(&key);
        if !self.done.contains(&key) {
            if self.done.len() == DONE_KEYS {
                self.done.pop_front();
            }
            self.done.push_back(key);
        }
        self.completed += 1;
        let completed = self.completed;
        let before = self.pending.len();
        self.pending.retain(|_, p| p.born + STEP_WINDOW > completed);
        for _ in self.pending.len()..before {
            bump(&counters.expired);
        }
    }
}

struct Shared {
    rank: u32,
    hosts: u32,
    token: Vec<u8>,
    inbox: Mutex<InboxState>,
    cv: Condvar,
    counters: Counters,
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
}

fn mac(
    token: &[u8],
    challenge: &[u8],
    src: u32,
    dst: u32,
    seq: u64,
    key: u64,
    value: u64,
) -> HmacSha256 {
    let mut m =
        <HmacSha256 as KeyInit>::new_from_slice(token).expect("HMAC takes keys of any length");
    m.update(DOMAIN);
    m.update(challenge);
    m.update(&src.to_le_bytes());
    m.update(&dst.to_le_bytes());
    m.update(&seq.to_le_bytes());
    m.update(&key.to_le_bytes());
    m.update(&value.to_le_bytes());
    m
}

/// 16 unpredictable bytes: /dev/urandom, else std's randomly keyed hasher over time and a counter.
fn challenge() -> [u8; 16] {
    let mut c = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut c))
        .is_ok()
    {
        return c;
    }
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    for half in c.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(N.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    c
}

/// Encodes one authenticated frame.
fn frame(
    token: &[u8],
    challenge: &[u8],
    src: u32,
    dst: u32,
    seq: u64,
    key: u64,
    value: u64,
) -> [u8; FRAME] {
    let mut f = [0u8; FRAME];
    f[..4].copy_from_slice(FRAME_MAGIC);
    f[4..8].copy_from_slice(&src.to_le_bytes());
    f[8..12].copy_from_slice(&dst.to_le_bytes());
    f[12..20].copy_from_slice(&seq.to_le_bytes());
    f[20..28].copy_from_slice(&key.to_le_bytes());
    f[28..36].copy_from_slice(&value.to_le_bytes());
    f[36..].copy_from_slice(
        &mac(token, challenge, src, dst, seq, key, value)
            .finalize()
            .into_bytes(),
    );
    f
}

/// Serves one connection: hello, then frames until EOF, idle, malformed or stop.
fn serve_conn(shared: &Shared, stream: &mut TcpStream) {
    let ch = challenge();
    let mut hello = [0u8; HELLO];
    hello[..4].copy_from_slice(HELLO_MAGIC);
    hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
    hello[8..12].copy_from_slice(&shared.rank.to_le_bytes());
    hello[12..].copy_from_slice(&ch);
    let _ = stream.set_read_timeout(Some(IDLE));
    let _ = stream.set_write_timeout(Some(IDLE));
    if stream.write_all(&hello).is_err() {
        return;
    }
    let mut last_seq = 0u64;
    let mut buf = [0u8; FRAME];
    loop {
        let mut got = 0;
        while got < FRAME {
            match stream.read(&mut buf[got..]) {
                Ok(0) | Err(_) => {
                    if got > 0 && !shared.stop.load(Ordering::SeqCst) {
                        bump(&shared.counters.malformed); // cut short, or silent mid-frame
                    }
                    return;
                }
                Ok(n) => got += n,
            }
        }
        if &buf[..4] != FRAME_MAGIC {
            bump(&shared.counters.malformed);
            return; // cannot resynchronise a byte stream
        }
        let u32_at = |i: usize| u32::from_le_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        let (src, dst, seq, key, value) =
            (u32_at(4), u32_at(8), u64_at(12), u64_at(20), u64_at(28));
        let ack = if src >= shared.hosts || src == shared.rank || dst != shared.rank {
            bump(&shared.counters.unknown_rank);
            ACK_REJECTED
        } else if mac(&shared.token, &ch, src, dst, seq, key, value)
            .verify_slice(&buf[36..])
            .is_err()
        {
            bump(&shared.counters.bad_mac);
            ACK_REJECTED
        } else if seq <= last_seq {
            bump(&shared.counters.replayed);
            ACK_REJECTED
        } else {
            last_seq = seq;
            file(shared, src, key, value)
        };
        let written = stream.write_all(&[ack]);
        // Only `file` answers ACK_OK, and it counted every such answer.
        if ack == ACK_OK {
            ack_written(shared);
        }
        if written.is_err() {
            return;
        }
    }
}

/// Files an authentic value: never overrides, never grows past [`INBOX_KEYS`] keys. Every
/// [`ACK_OK`] it returns is counted in `acks_in_flight` until [`ack_written`].
fn file(shared: &Shared, src: u32, key: u64, value: u64) -> u8 {
    let Ok(mut inbox) = shared.inbox.lock() else {
        return ACK_BUSY;
    };
    if inbox.done.contains(&key) {
        bump(&shared.counters.duplicate);
        inbox.acks_in_flight += 1;
        return ACK_OK; // already used: a resend after a lost ack
    }
    let born = inbox.completed;
    let full = inbox.pending.len() >= INBOX_KEYS;
    match inbox.pending.get_mut(&key) {
        Some(p) => match p.values.entry(src) {
            std::collections::hash_map::Entry::Occupied(_) => bump(&shared.counters.duplicate),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(value);
            }
        },
        None if full => {
            bump(&shared.counters.inbox_full);
            return ACK_BUSY;
        }
        None => {
            inbox.pending.insert(
                key,
                Pending {
                    values: HashMap::from([(src, value)]),
                    born,
                },
            );
        }
    }
    inbox.acks_in_flight += 1;
    shared.cv.notify_all();
    ACK_OK
}

/// The ack of a value [`file`] counted is written (or failed): wakes exchanges waiting for it.
fn ack_written(shared: &Shared) {
    if let Ok(mut inbox) = shared.inbox.lock() {
        inbox.acks_in_flight = inbox.acks_in_flight.saturating_sub(1);
        shared.cv.notify_all();
    }
}

/// Accepts connections until stopped, each served by its own thread (at most
/// [`MAX_CONNECTIONS`] at once).
fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(mut stream) = stream else { continue };
        let id = next_id;
        next_id += 1;
        {
            let Ok(mut conns) = shared.conns.lock() else {
                break;
            };
            if conns.len() >= MAX_CONNECTIONS {
                bump(&shared.counters.connections_refused);
                continue; // dropped: closed
            }
            match stream.try_clone() {
                Ok(c) => conns.insert(id, c),
                Err(_) => continue,
            };
        }
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("sparsecore-allreduce-{}-conn", shared.rank))
            .spawn(move || {
                serve_conn(&sh, &mut stream);
                let _ = stream.shutdown(std::net::Shutdown::Both);
                if let Ok(mut conns) = sh.conns.lock() {
                    conns.remove(&id);
                }
            });
        if spawned.is_err() {
            if let Ok(mut conns) = shared.conns.lock() {
                conns.remove(&id);
            }
        }
    }
}

/// Why one attempt to deliver our value to a peer failed.
struct Undelivered {
    reason: String,
    /// The attempt ran out of time (its own step, or the exchange's deadline) rather than
    /// being refused or cut off: the least informative failure.
    timed_out: bool,
}

impl Undelivered {
    fn io(what: &str, e: std::io::Error) -> Self {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        Undelivered {
            reason: format!("{what}: {e}"),
            timed_out,
        }
    }
}

/// All-reduce over TCP between `peers.len()` hosts of one job; this host is `rank`.
///
/// Each exchange delivers this host's value to every peer (retrying until the deadline while a
/// peer is not listening yet) and waits for every peer's value under the same key, all within
/// one deadline. Every value travels in a frame authenticated with the job's shared secret
/// (HMAC-SHA256 over a per-connection challenge, source and destination rank, sequence number,
/// key and value): frames that are malformed, from unknown ranks, badly authenticated, replayed
/// or duplicated are dropped and counted ([`TcpAllReduce::counters`]) and never change a result.
/// At most [`INBOX_KEYS`] keys wait in the inbox, and those older than 4 of this host's exchanges
/// expire. A peer that is missing, dies or is too slow is an [`Error::AllReduce`] naming it.
///
/// Available with the `tcp` feature (on by default).
pub struct TcpAllReduce {
    peers: Vec<SocketAddr>,
    /// [`TcpAllReduceBuilder::peers_in_any_order`]: the rank each peer address announced in its
    /// hello, once learned (None otherwise, and for this host's own entry).
    learned: Option<Mutex<Vec<Option<usize>>>>,
    timeout: Duration,
    shared: Arc<Shared>,
    listener: Option<JoinHandle<()>>,
    local: SocketAddr,
}

impl std::fmt::Debug for TcpAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpAllReduce")
            .field("rank", &self.shared.rank)
            .field("peers", &self.peers)
            .finish()
    }
}

/// Builds a [`TcpAllReduce`]: [`TcpAllReduce::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct TcpAllReduceBuilder {
    rank: usize,
    peers: Vec<SocketAddr>,
    timeout: Duration,
    token: Option<Vec<u8>>,
    listener: Option<TcpListener>,
    any_order: bool,
}

impl TcpAllReduceBuilder {
    /// The deadline of one exchange (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The job's shared secret; every host of the job must use the same one. Without it, the
    /// secret is read from [`TOKEN_ENV`]; without that either, frames are only checked for
    /// integrity, not authenticity, and a warning is printed once per process.
    pub fn token(mut self, token: impl AsRef<[u8]>) -> Self {
        self.token = Some(token.as_ref().to_vec());
        self
    }

    /// Serves on an already bound listener instead of binding `peers[rank]` (e.g. bound to port
    /// 0 first, so that every peer's address is known before starting).
    pub fn listener(mut self, listener: TcpListener) -> Self {
        self.listener = Some(listener);
        self
    }

    /// The addresses other than `peers[rank]` may be in any order: each peer's rank is learned
    /// from the hello it answers a connection with. The reference's peer list carries no ranks,
    /// so a job that passes it as is works unchanged. Which peer is which does not matter to the
    /// result: values are authenticated by the sender's rank, and every rank must be heard from.
    pub fn peers_in_any_order(mut self) -> Self {
        self.any_order = true;
        self
    }

    /// Binds (unless a listener was given) and starts serving.
    pub fn build(self) -> Result<TcpAllReduce> {
        let TcpAllReduceBuilder {
            rank,
            mut peers,
            timeout,
            token,
            listener,
            any_order,
        } = self;
        if rank >= peers.len() {
            return Err(Error::option(
                "rank",
                rank,
                format!("must index the {} peer addresses", peers.len()),
            ));
        }
        if peers.len() > u32::MAX as usize {
            return Err(Error::option(
                "peers",
                peers.len(),
                "at most 2^32 - 1 hosts",
            ));
        }
        let listener = match listener {
            Some(l) => l,
            None => {
                let addr = peers[rank];
                TcpListener::bind(addr).map_err(|source| Error::Io {
                    context: format!("all-reduce: listening on {addr}"),
                    source,
                })?
            }
        };
        let local = listener.local_addr().map_err(|source| Error::Io {
            context: "all-reduce: reading the listener address".into(),
            source,
        })?;
        peers[rank] = local;
        let token = token.filter(|t| !t.is_empty()).or_else(|| {
            std::env::var_os(TOKEN_ENV)
                .filter(|t| !t.is_empty())
                .map(|t| t.into_encoded_bytes())
        });
        let token = token.unwrap_or_else(|| {
            static WARN: std::sync::Once = std::sync::Once::new();
            WARN.call_once(|| {
                eprintln!(
                    "sparsecore-prep: warning: the TCP all-reduce has no shared secret (TcpAllReduce::builder().token() or \
                     {TOKEN_ENV}); anyone who can reach its port can take part in minibatching decisions"
                )
            });
            Vec::new()
        });
        let shared = Arc::new(Shared {
            rank: rank as u32,
            hosts: peers.len() as u32,
            token,
            inbox: Mutex::new(InboxState::default()),
            cv: Condvar::new(),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
        });
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sparsecore-allreduce-{rank}"))
            .spawn(move || accept_loop(listener, sh))
            .map_err(|source| Error::Io {
                context: "all-reduce: starting the listener thread".into(),
                source,
            })?;
        let learned = any_order.then(|| Mutex::new(vec![None; peers.len()]));
        Ok(TcpAllReduce {
            peers,
            learned,
            timeout,
            shared,
            listener: Some(handle),
            local,
        })
    }
}

impl TcpAllReduce {
    /// A builder for host `rank` of the job whose hosts listen on `peers`.
    pub fn builder(rank: usize, peers: Vec<SocketAddr>) -> TcpAllReduceBuilder {
        TcpAllReduceBuilder {
            rank,
            peers,
            timeout: Duration::from_secs(60),
            token: None,
            listener: None,
            any_order: false,
        }
    }

    /// Listens on `peers[rank]` and talks to the others, waiting at most `timeout` per exchange;
    /// the secret comes from [`TOKEN_ENV`].
    pub fn new(rank: usize, peers: Vec<SocketAddr>, timeout: Duration) -> Result<Self> {
        Self::builder(rank, peers).timeout(timeout).build()
    }

    /// Like [`TcpAllReduce::new`] with an already bound listener (e.g. bound to port 0 first, so
    /// that tests can learn every peer's address before starting).
    pub fn with_listener(
        rank: usize,
        listener: TcpListener,
        peers: Vec<SocketAddr>,
        timeout: Duration,
    ) -> Result<Self> {
        Self::builder(rank, peers)
            .timeout(timeout)
            .listener(listener)
            .build()
    }

    /// This host's listening address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// What this host has dropped so far.
    pub fn counters(&self) -> AllReduceCounters {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AllReduceCounters {
            malformed: g(&c.malformed),
            unknown_rank: g(&c.unknown_rank),
            bad_mac: g(&c.bad_mac),
            replayed: g(&c.replayed),
            duplicate: g(&c.duplicate),
            inbox_full: g(&c.inbox_full),
            expired: g(&c.expired),
            connections_refused: g(&c.connections_refused),
        }
    }

    /// Keys waiting in the inbox now (at most [`INBOX_KEYS`]).
    pub fn inbox_keys(&self) -> usize {
        self.shared.inbox.lock().map_or(0, |i| i.pending.len())
    }

    /// The rank the peer at `peers[slot]` is known to be: `slot`, unless the peers are in any
    /// order, where it is what its hello said (None before that).
    fn rank_at(&self, slot: usize) -> Option<usize> {
        match &self.learned {
            None => Some(slot),
            Some(l) => l.lock().ok().and_then(|l| l[slot]),
        }
    }

    /// "peer 2 at 10.0.0.3:7777" (or "the peer at ..." while its rank is unknown).
    fn describe_slot(&self, slot: usize) -> String {
        match self.rank_at(slot) {
            Some(r) => format!("peer {r} at {}", self.peers[slot]),
            None => format!("the peer at {}", self.peers[slot]),
        }
    }

    /// "peer 2 at 10.0.0.3:7777": rank `r` in the same words as [`Self::describe_slot`], so a
    /// peer that died reads alike whether we timed out waiting for its value or failed to send
    /// it ours (which of the two happens first is a race).
    fn describe_rank(&self, r: usize) -> String {
        match (0..self.peers.len())
            .find(|&slot| slot != self.shared.rank as usize && self.rank_at(slot) == Some(r))
        {
            Some(slot) => format!("peer {r} at {}", self.peers[slot]),
            None => format!("peer {r} (address not known yet)"),
        }
    }

    /// The rank to address at `peers[slot]`, given the rank its hello announced.
    fn check_rank(&self, slot: usize, theirs: usize) -> std::result::Result<usize, String> {
        let Some(learned) = &self.learned else {
            return if theirs == slot {
                Ok(slot)
            } else {
                Err(format!("it is rank {theirs} of its job, not rank {slot}"))
            };
        };
        let me = self.shared.rank as usize;
        if theirs >= self.peers.len() || theirs == me {
            return Err(format!(
                "it says it is rank {theirs}, not one of this {}-host job's other ranks",
                self.peers.len()
            ));
        }
        let mut l = learned
            .lock()
            .map_err(|_| "rank table lock poisoned".to_string())?;
        if let Some(other) = (0..l.len()).find(|&o| o != slot && l[o] == Some(theirs)) {
            return Err(format!(
                "it says it is rank {theirs}, as the peer at {} did",
                self.peers[other]
            ));
        }
        l[slot] = Some(theirs);
        Ok(theirs)
    }

    /// Delivers one value to the peer at `peers[r]`: connect, read its hello, send a frame, read
    /// the ack.
    fn deliver(
        &self,
        r: usize,
        key: u64,
        value: u64,
        deadline: Instant,
    ) -> std::result::Result<(), Undelivered> {
        let addr = self.peers[r];
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Undelivered {
                reason: "deadline passed".into(),
                timed_out: true,
            });
        }
        let step = left.min(Duration::from_secs(2));
        let failed = |what: &'static str| move |e: std::io::Error| Undelivered::io(what, e);
        let mut s = TcpStream::connect_timeout(&addr, step).map_err(failed("connecting"))?;
        s.set_read_timeout(Some(step))
            .map_err(failed("talking to it"))?;
        s.set_write_timeout(Some(step))
            .map_err(failed("talking to it"))?;
        let _ = s.set_nodelay(true);
        let mut hello = [0u8; HELLO];
        s.read_exact(&mut hello)
            .map_err(failed("reading its hello"))?;
        let refused = |reason: String| Undelivered {
            reason,
            timed_out: false,
        };
        if &hello[..4] != HELLO_MAGIC || hello[4..8] != VERSION.to_le_bytes() {
            return Err(refused("it does not speak this all-reduce protocol".into()));
        }
        let their_rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes"));
        let dst = self.check_rank(r, their_rank as usize).map_err(refused)?;
        let f = frame(
            &self.shared.token,
            &hello[12..],
            self.shared.rank,
            dst as u32,
            1,
            key,
            value,
        );
        s.write_all(&f).map_err(failed("talking to it"))?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)
            .map_err(failed("reading its acknowledgement"))?;
        match ack[0] {
            ACK_OK => Ok(()),
            ACK_BUSY => Err(refused("its inbox was full".into())),
            _ => Err(refused(
                "it rejected our message (do all hosts use the same token?)".into(),
            )),
        }
    }

    fn exchange(&self, key: u64, value: u64) -> Result<u64> {
        let deadline = deadline_after(self.timeout);
        let me = self.shared.rank as usize;
        let mut undelivered: Vec<usize> = (0..self.peers.len()).filter(|&r| r != me).collect();
        let mut why: HashMap<usize, String> = HashMap::new();
        let poisoned = || Error::AllReduce {
            key,
            reason: "inbox lock poisoned".into(),
        };
        {
            // Reserve the key so that the flood cap never refuses the key being waited for.
            let mut inbox = self.shared.inbox.lock().map_err(|_| poisoned())?;
            let born = inbox.completed;
            inbox.done.retain(|&k| k != key);
            inbox.pending.entry(key).or_insert_with(|| Pending {
                values: HashMap::new(),
                born,
            });
        }
        loop {
            undelivered.retain(|&r| match self.deliver(r, key, value, deadline) {
                Ok(()) => false,
                Err(e) => {
                    // A timeout never replaces an earlier failure: the last attempts before the
                    // deadline get only what is left of it, and "reading its hello: timed out"
                    // there would hide that the peer had rejected every message before.
                    if !e.timed_out || !why.contains_key(&r) {
                        why.insert(r, e.reason);
                    }
                    true
                }
            });
            let mut inbox = self.shared.inbox.lock().map_err(|_| poisoned())?;
            let heard: Vec<u32> = inbox
                .pending
                .get(&key)
                .map(|p| p.values.keys().copied().collect())
                .unwrap_or_default();
            if heard.len() == self.peers.len() - 1 && undelivered.is_empty() {
                let or = inbox
                    .pending
                    .get(&key)
                    .map_or(value, |p| p.values.values().fold(value, |a, &b| a | b));
                inbox.finish(key, &self.shared.counters);
                // The peers' acks for what we heard go out before we return (each is one byte
                // to a socket just read from; bounded all the same, by the serving timeout).
                let until = Instant::now() + IDLE;
                while inbox.acks_in_flight > 0 {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    inbox = self
                        .shared
                        .cv
                        .wait_timeout(inbox, left)
                        .map_err(|_| poisoned())?
                        .0;
                }
                return Ok(or);
            }
            let now = Instant::now();
            if now >= deadline {
                inbox.finish(key, &self.shared.counters);
                let silent: Vec<String> = (0..self.peers.len())
                    .filter(|&r| r != me && !heard.contains(&(r as u32)))
                    .map(|r| self.describe_rank(r))
                    .collect();
                let mut reason = format!("timed out after {:?}", self.timeout);
                if !silent.is_empty() {
                    reason += &format!(" waiting for {}", silent.join(", "));
                }
                for r in &undelivered {
                    reason += &format!(
                        "; cannot reach {}: {}",
                        self.describe_slot(*r),
                        why.get(r).map_or("", |s| s)
                    );
                }
                return Err(Error::AllReduce { key, reason });
            }
            let wait = if undelivered.is_empty() {
                deadline - now
            } else {
                Duration::from_millis(10).min(deadline - now)
            };
            drop(
                self.shared
                    .cv
                    .wait_timeout(inbox, wait)
                    .map_err(|_| poisoned())?,
            );
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
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag, and end every served connection.
        let _ = TcpStream::connect_timeout(&self.local, Duration::from_millis(200));
        if let Ok(conns) = self.shared.conns.lock() {
            for c in conns.values() {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
        if let Some(h) = self.listener.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: usize, timeout: Duration) -> Vec<TcpAllReduce> {
        group(n, |_, b| b.timeout(timeout))
    }

    /// `n` hosts on bound loopback listeners, each builder finished by `configure(rank, ..)`.
    fn group(
        n: usize,
        configure: impl Fn(usize, TcpAllReduceBuilder) -> TcpAllReduceBuilder,
    ) -> Vec<TcpAllReduce> {
        let listeners: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                configure(r, TcpAllReduce::builder(r, addrs.clone()).listener(l))
                    .build()
                    .unwrap()
            })
            .collect()
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
    fn a_timeout_too_long_for_an_instant_waits_instead_of_overflowing() {
        let hs = hosts(2, Duration::MAX);
        let ors: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = hs
                .iter()
                .enumerate()
                .map(|(r, h)| s.spawn(move || h.all_reduce_or_u64(5, 1 << r).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ors, vec![3, 3]);
    }

    #[test]
    fn peers_in_any_order_learn_their_ranks() {
        let listeners: Vec<TcpListener> = (0..4)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let hs: Vec<TcpAllReduce> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                // This host's entry stays at `r`; the others are rotated out of rank order.
                let mut others: Vec<SocketAddr> =
                    (0..4).filter(|&o| o != r).map(|o| addrs[o]).collect();
                others.rotate_left(1 + r % 2);
                let mut peers = others;
                peers.insert(r, addrs[r]);
                TcpAllReduce::builder(r, peers)
                    .timeout(Duration::from_secs(10))
                    .token("t")
                    .listener(l)
                    .peers_in_any_order()
                    .build()
                    .unwrap()
            })
            .collect();
        let ors: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = hs
                .iter()
                .enumerate()
                .map(|(r, h)| s.spawn(move || h.all_reduce_or_u64(3, 1 << r).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ors, vec![15; 4]);
        // The same lists without the flag: a peer at another rank's position is refused.
        let listeners: Vec<TcpListener> = (0..3)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let swapped = vec![addrs[0], addrs[2], addrs[1]];
        let hs: Vec<TcpAllReduce> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                TcpAllReduce::builder(r, swapped.clone())
                    .timeout(Duration::from_millis(800))
                    .token("t")
                    .listener(l)
                    .build()
                    .unwrap()
            })
            .collect();
        let e = hs[0].all_reduce_or_bool(1, true).unwrap_err();
        assert!(
            e.to_string()
                .contains("it is rank 2 of its job, not rank 1"),
            "{e}"
        );
    }

    #[test]
    fn missing_peer_is_a_timeout_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // A peer address nobody listens on.
        let dead = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let h = TcpAllReduce::with_listener(
            0,
            listener,
            vec!["127.0.0.1:0".parse().unwrap(), dead],
            Duration::from_millis(300),
        )
        .unwrap();
        let t = Instant::now();
        let e = h.all_reduce_or_bool(4, true).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(matches!(&e, Error::AllReduce { key: 4, .. }), "{e:?}");
        assert!(e.to_string().contains(&dead.to_string()), "{e}");
    }

    #[test]
    fn a_peer_that_takes_our_value_but_never_sends_its_own_is_named_like_an_unreachable_one() {
        // Host 1 serves (so our delivery succeeds) but never calls all-reduce itself: the
        // error is the timeout, and it must name the peer as the refused-connection case does.
        let hs = hosts(2, Duration::from_millis(300));
        let e = hs[0].all_reduce_or_bool(8, true).unwrap_err();
        assert!(matches!(&e, Error::AllReduce { key: 8, .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("waiting for peer 1 at {}", hs[1].local)),
            "{text}"
        );
        assert!(!text.contains("cannot reach"), "{text}");
    }

    #[test]
    fn a_wrong_token_is_named_whatever_the_last_attempt_before_the_deadline_met() {
        // Both hosts reject each other's messages until the deadline; the attempts just before
        // it get almost no time, and their timeouts must not replace the rejection.
        let hs = group(2, |r, b| {
            b.timeout(Duration::from_millis(400)).token(format!("t{r}"))
        });
        let errs: Vec<Error> = std::thread::scope(|s| {
            let js: Vec<_> = hs
                .iter()
                .map(|h| s.spawn(move || h.all_reduce_or_bool(12, true).unwrap_err()))
                .collect();
            js.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (r, e) in errs.iter().enumerate() {
            assert!(matches!(e, Error::AllReduce { key: 12, .. }), "{e:?}");
            let other = hs[1 - r].local;
            let named = format!("cannot reach peer {} at {other}: it rejected our message (do all hosts use the same token?)", 1 - r);
            assert!(e.to_string().contains(&named), "{e}");
        }
    }
}
