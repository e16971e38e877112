//! Cross-host agreement for minibatching (SPEC 5.8): every host contributes a value under a
//! sync key and receives the OR over all hosts, so that all hosts split a step identically.
//!
//! [`LocalAllReduce`] serves a single host; [`LocalAllReduce::group`] joins hosts that are
//! threads of one process. `TcpAllReduce` (the `tcp` feature, on by default) connects the hosts
//! of a job over TCP, one listener per host, with a deadline on every exchange: a missing or
//! killed peer gives [`Error::AllReduce`] naming it, never a hang. Its messages carry an HMAC
//! under the job's shared secret; what it drops is counted and never changes a result, and its
//! inbox is bounded (RELIABILITY.md, "Multi-host fault model").

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

#[cfg(feature = "tcp")]
mod tcp;
#[cfg(feature = "tcp")]
pub use tcp::{AllReduceCounters, TcpAllReduce, TcpAllReduceBuilder, INBOX_KEYS, TOKEN_ENV};

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
        let shared = Arc::new(GroupState {
            hosts,
            slots: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
        });
        (0..hosts)
            .map(|rank| InProcessAllReduce {
                rank,
                timeout,
                shared: shared.clone(),
            })
            .collect()
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

/// When a wait of `timeout` from now ends. A timeout past what `Instant` can hold (a caller's
/// "wait for ever", such as `Duration::MAX`) waits a century instead of overflowing.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

impl InProcessAllReduce {
    /// This member's rank in its group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn exchange(&self, key: u64, value: u64) -> Result<u64> {
        let deadline = deadline_after(self.timeout);
        let g = &*self.shared;
        let poisoned = || Error::AllReduce {
            key,
            reason: "group lock poisoned".into(),
        };
        let mut slots = g.slots.lock().map_err(|_| poisoned())?;
        {
            let slot = slots.entry(key).or_insert_with(|| GroupSlot {
                values: vec![None; g.hosts],
                read: 0,
            });
            if slot.values[self.rank].is_some() {
                return Err(Error::AllReduce {
                    key,
                    reason: format!("host {} contributed twice", self.rank),
                });
            }
            slot.values[self.rank] = Some(value);
        }
        g.cv.notify_all();
        loop {
            let slot = slots
                .get_mut(&key)
                .expect("a slot stays until every member read it");
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
                let missing: Vec<String> = slot
                    .values
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.is_none())
                    .map(|(r, _)| r.to_string())
                    .collect();
                return Err(Error::AllReduce {
                    key,
                    reason: format!(
                        "timed out after {:?} waiting for hosts {}",
                        self.timeout,
                        missing.join(", ")
                    ),
                });
            }
            slots =
                g.cv.wait_timeout(slots, deadline - now)
                    .map_err(|_| poisoned())?
                    .0;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_in_process_group_ors_and_names_a_missing_member() {
        let group = LocalAllReduce::group(3, Duration::from_secs(10));
        let ors: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|g| s.spawn(move || g.all_reduce_or_u64(5, 1 << g.rank()).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ors, vec![7, 7, 7]);
        let group = LocalAllReduce::group(2, Duration::from_millis(200));
        let e = group[0].all_reduce_or_bool(8, true).unwrap_err();
        assert!(matches!(&e, Error::AllReduce { key: 8, .. }), "{e:?}");
        assert!(e.to_string().contains("waiting for hosts 1"), "{e}");
    }

    #[test]
    fn a_timeout_too_long_for_an_instant_waits_instead_of_overflowing() {
        let group = LocalAllReduce::group(2, Duration::MAX);
        let ors: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .enumerate()
                .map(|(r, h)| s.spawn(move || h.all_reduce_or_u64(5, 4 << r).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ors, vec![12, 12]);
    }
}
