//! Two hosts of one job, each with its own preprocessor and TCP all-reduce on 127.0.0.1, agree
//! on minibatching: the host whose batch fits its limits still splits like the one whose batch
//! does not, under the sync keys of the same batch number.
//!
//! Every test here talks TCP, so the file needs the `tcp` feature.
#![cfg(feature = "tcp")]

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use sparsecore_prep::input::{RaggedInput, SampleSource};
use sparsecore_prep::{AllReduce, Config, Error, Output, Preprocessor, TcpAllReduce};

fn config() -> Config {
    Config::from_json(
        r#"{"config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 4,
                        "enable_minibatching": true, "allow_id_dropping": true},
            "tables": [{"name": "t0", "vocabulary_size": 4096, "embedding_dim": 8, "combiner": "sum",
                        "max_ids_per_partition": 4, "max_unique_ids_per_partition": 4}],
            "features": [{"name": "f0", "table": "t0"}]}"#,
    )
    .unwrap()
}

/// 32 samples; `skewed` gives each sample 6 distinct ids of one partition (over the limits).
fn batch(skewed: bool) -> (Vec<i32>, Vec<i32>) {
    let mut values = Vec::new();
    let mut splits = vec![0];
    for r in 0..32 {
        if skewed {
            values.extend((0..6).map(|k| 8 * (6 * r + k)));
        } else {
            values.push(r);
        }
        splits.push(values.len() as i32);
    }
    (values, splits)
}

fn run_host(rank: usize, all_reduce: Arc<dyn AllReduce>, skewed: bool) -> Result<Output, Error> {
    let mut prep = Preprocessor::builder(config())
        .all_reduce(all_reduce)
        .build()?;
    prep.set_batch_number(7);
    let (values, splits) = batch(skewed);
    let f0 = RaggedInput::from_i32("f0", &values, &splits)?;
    let mut out = Output::new();
    prep.run(&[&f0 as &dyn SampleSource], &mut out)?;
    let _ = rank;
    Ok(out)
}

#[test]
fn hosts_agree_on_one_split() {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let hosts: Vec<Arc<dyn AllReduce>> = listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            Arc::new(
                TcpAllReduce::with_listener(r, l, addrs.clone(), Duration::from_secs(20)).unwrap(),
            ) as Arc<dyn AllReduce>
        })
        .collect();
    let outs: Vec<Output> = std::thread::scope(|s| {
        let handles: Vec<_> = hosts
            .iter()
            .enumerate()
            .map(|(r, h)| {
                let h = h.clone();
                s.spawn(move || run_host(r, h, r == 0).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        outs[0].num_minibatches > 1,
        "the skewed host needs minibatches"
    );
    assert_eq!(
        outs[0].num_minibatches, outs[1].num_minibatches,
        "both hosts use the agreed split"
    );

    // Alone, the balanced host would not split at all.
    let alone = {
        let cfg = {
            let mut c = config();
            c.config.global_device_count = 1;
            c
        };
        let mut prep = Preprocessor::new(cfg).unwrap();
        let (values, splits) = batch(false);
        let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
        prep.run_new(&[&f0 as &dyn SampleSource]).unwrap()
    };
    assert_eq!(alone.num_minibatches, 1);
}

#[test]
fn a_missing_host_is_an_error_not_a_hang() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap(); // closed at once
    let me = listener.local_addr().unwrap();
    let h: Arc<dyn AllReduce> = Arc::new(
        TcpAllReduce::with_listener(0, listener, vec![me, nobody], Duration::from_millis(500))
            .unwrap(),
    );
    let started = std::time::Instant::now();
    let e = run_host(0, h, true).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(matches!(e, Error::AllReduce { key: 14, .. }), "{e:?}"); // 2 * batch number 7
    assert!(e.to_string().contains(&nobody.to_string()), "{e}");
}

/// The TCP all-reduce's wire format, written by hand (a peer holding the token, or a stranger).
mod wire {
    pub use crate::allreduce_wire::frame;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    pub fn open(addr: SocketAddr) -> (TcpStream, [u8; 16]) {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut hello = [0u8; 28];
        s.read_exact(&mut hello).unwrap();
        (s, hello[12..].try_into().unwrap())
    }

    pub fn send(s: &mut TcpStream, bytes: &[u8]) -> u8 {
        s.write_all(bytes).unwrap();
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).unwrap();
        ack[0]
    }
}

const TOKEN: &[u8] = b"flood-test-secret";

fn two_hosts(timeout: Duration) -> Vec<Arc<TcpAllReduce>> {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            Arc::new(
                TcpAllReduce::builder(r, addrs.clone())
                    .token(TOKEN)
                    .listener(l)
                    .timeout(timeout)
                    .build()
                    .unwrap(),
            )
        })
        .collect()
}

fn exchange_both(hosts: &[Arc<TcpAllReduce>], key: u64) -> Vec<u64> {
    std::thread::scope(|s| {
        let hs: Vec<_> = hosts
            .iter()
            .enumerate()
            .map(|(r, h)| s.spawn(move || h.all_reduce_or_u64(key, 1 << (3 * r)).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// 100,000 authentic frames with random fresh keys (a peer gone wrong, holding the token) leave
/// at most 64 keys (`INBOX_KEYS`) in the host's inbox; the rest are refused and counted, and the
/// job's next exchange still gets the right OR. 1,000 frames under a wrong token never reach it.
#[test]
fn a_flood_of_fresh_keys_cannot_grow_the_inbox() {
    const CAP: usize = 64;
    let hosts = two_hosts(Duration::from_secs(30));
    let (mut c, ch) = wire::open(hosts[0].local_addr());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut acks = [0usize; 3];
    for seq in 1..=100_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = x | (1 << 63); // never the job's keys below
        acks[wire::send(&mut c, &wire::frame(TOKEN, &ch, 1, 0, seq, key, u64::MAX)) as usize] += 1;
        if seq % 10_000 == 0 {
            assert!(
                hosts[0].inbox_keys() <= CAP,
                "{} keys after {seq} frames",
                hosts[0].inbox_keys()
            );
        }
    }
    assert_eq!(hosts[0].inbox_keys(), CAP);
    assert_eq!(
        acks,
        [CAP, 0, 100_000 - CAP],
        "accepted, rejected, refused as full"
    );
    let (mut c2, ch2) = wire::open(hosts[0].local_addr());
    for seq in 1..=1_000u64 {
        assert_eq!(
            wire::send(
                &mut c2,
                &wire::frame(b"wrong", &ch2, 1, 0, seq, seq, u64::MAX)
            ),
            1
        );
    }
    let counters = hosts[0].counters();
    assert_eq!(
        (counters.inbox_full, counters.bad_mac),
        (100_000 - CAP as u64, 1_000),
        "{counters:?}"
    );
    // The job goes on: the flood's values never reach its keys, and they expire with its steps.
    for step in 0..5u64 {
        assert_eq!(exchange_both(&hosts, 2 * step), vec![1 | 8, 1 | 8]);
    }
    assert_eq!(hosts[0].inbox_keys(), 0, "the flood's keys expired");
    assert_eq!(hosts[0].counters().expired, CAP as u64);
}

/// A frame sent again on its own connection (a replay by whoever relays it) is dropped and
/// counted; a second authentic value for a (key, rank) never overrides the first.
#[test]
fn replayed_and_duplicate_frames_never_override() {
    let hosts = two_hosts(Duration::from_secs(30));
    let (mut c, ch) = wire::open(hosts[0].local_addr());
    // Host 1's value for key 100, as a peer holding the token would send it...
    let f = wire::frame(TOKEN, &ch, 1, 0, 1, 100, 2);
    assert_eq!(wire::send(&mut c, &f), 0);
    // ...replayed on the same connection, then a later frame with another value for that key.
    assert_eq!(wire::send(&mut c, &f), 1);
    assert_eq!(
        wire::send(&mut c, &wire::frame(TOKEN, &ch, 1, 0, 2, 100, 1 << 40)),
        0
    );
    let c0 = hosts[0].counters();
    assert_eq!((c0.replayed, c0.duplicate), (1, 1), "{c0:?}");
    // Host 0's exchange uses the first value (host 1 itself never runs key 100 here).
    assert_eq!(hosts[0].all_reduce_or_u64(100, 1).unwrap(), 1 | 2);
}

/// A peer that starts listening only after this host's exchange began is retried until the
/// deadline (the reference's all-reduce dies with SIGSEGV on "Connection refused").
#[test]
fn a_peer_not_listening_yet_is_retried() {
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let late = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap(); // closed: refused for now
    let addrs = vec![l0.local_addr().unwrap(), late];
    let h0 = TcpAllReduce::builder(0, addrs.clone())
        .token(TOKEN)
        .listener(l0)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let got = std::thread::scope(|s| {
        let first = s.spawn(|| h0.all_reduce_or_u64(6, 1).unwrap());
        std::thread::sleep(Duration::from_millis(300)); // host 0 is being refused meanwhile
        let h1 = TcpAllReduce::builder(1, addrs.clone())
            .token(TOKEN)
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let second = h1.all_reduce_or_u64(6, 4).unwrap();
        (first.join().unwrap(), second)
    });
    assert_eq!(got, (5, 5));
}
