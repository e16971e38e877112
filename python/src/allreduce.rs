//! Multi-host minibatching from Python: the all-reduce a preprocessor agrees through.
//!
//! Two kinds of `all_reduce_interface` reach the pipeline:
//! - [`NativeTcpAllReduce`] (made by `sparsecore_prep.get_all_reduce_interface`) wraps the
//!   crate's authenticated `TcpAllReduce`; the pipeline calls it directly, without the GIL and
//!   without a Python round trip.
//! - Any other Python object with a method `all_reduce_or(sync_key: int, value: int) -> int`
//!   (a user's own collective, or `sparsecore_prep.JaxDistributedAllReduce`) is wrapped in
//!   [`PyAllReduce`], which re-acquires the GIL for each of the (two per step) exchanges. What it
//!   raises is kept, so that the `AllReduceError` the caller sees names the sync key and chains
//!   the object's own exception as its `__cause__`.
//!
//! Preprocessors are built once and reused for many calls (the drop-in keeps a cache of them),
//! while the interface is an argument of each call; so a preprocessor that minibatches across
//! hosts is built with an [`AllReduceSlot`], which holds the interface of the call in flight.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyType};
use sparsecore_prep::{AllReduce, Error, Result, TcpAllReduce};

use crate::errors::{self, to_py};

/// `sparsecore_prep._allreduce.AllReduceError(message, sync_key=...)`, caused by `cause` when the
/// failure was an exception of the user's object (a `RuntimeError` if the class cannot be found,
/// which only a broken installation causes).
fn all_reduce_error(
    py: Python<'_>,
    message: String,
    sync_key: Option<u64>,
    cause: Option<PyErr>,
) -> PyErr {
    static CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let made = (|| -> PyResult<Bound<'_, PyAny>> {
        let kwargs = PyDict::new(py);
        kwargs.set_item("sync_key", sync_key)?;
        CLASS
            .import(py, "sparsecore_prep._allreduce", "AllReduceError")?
            .call((message.as_str(),), Some(&kwargs))
    })();
    let err = match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(message),
    };
    if let Some(cause) = cause {
        err.set_cause(py, Some(cause));
    }
    err
}

/// Maps a pipeline error to Python: an all-reduce failure becomes `AllReduceError` naming the
/// sync key (chaining the exception of the user's object that caused it, if any, taken from
/// `slot`); anything else as `errors::to_py`.
pub fn to_py_error(py: Python<'_>, e: Error, slot: Option<&AllReduceSlot>) -> PyErr {
    let cause = slot.and_then(AllReduceSlot::take_failure);
    match e.root() {
        Error::AllReduce { key, .. } => all_reduce_error(py, e.to_string(), Some(*key), cause),
        _ => to_py(py, e),
    }
}

/// A Python object with `all_reduce_or(sync_key, value) -> int`, called with the GIL
/// re-acquired (the pipeline runs with it released).
pub struct PyAllReduce {
    obj: Py<PyAny>,
    /// The exception the object raised in the last failed exchange.
    failure: Mutex<Option<PyErr>>,
}

impl PyAllReduce {
    fn exchange(&self, key: u64, value: u64) -> Result<u64> {
        Python::attach(|py| {
            let obj = self.obj.bind(py);
            let what = || {
                let ty = obj
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "?".into());
                format!("the all_reduce_interface ({ty}).all_reduce_or({key}, {value})")
            };
            let fail = |reason: String, err: Option<PyErr>| {
                if let Ok(mut f) = self.failure.lock() {
                    *f = err;
                }
                Error::AllReduce { key, reason }
            };
            let got = match obj.call_method1("all_reduce_or", (key, value)) {
                Ok(got) => got,
                Err(err) => {
                    let text = err
                        .value(py)
                        .repr()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "an exception".into());
                    return Err(fail(format!("{} raised {text}", what()), Some(err)));
                }
            };
            let or = match got.extract::<u64>() {
                Ok(or) => or,
                Err(err) => {
                    let shown = got
                        .repr()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "?".into());
                    return Err(fail(
                        format!("{} returned {shown}, not an integer in [0, 2**64)", what()),
                        Some(err),
                    ));
                }
            };
            // An OR over the hosts contains this host's own bits; anything else is a broken
            // collective, which would split the hosts' steps differently.
            if or & value != value {
                return Err(fail(
                    format!("{} returned {or}, which lacks bits of this host's own value (an OR over the hosts contains them)", what()),
                    None,
                ));
            }
            Ok(or)
        })
    }
}

impl AllReduce for PyAllReduce {
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> Result<bool> {
        Ok(self.exchange(key, value as u64)? != 0)
    }
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> Result<u64> {
        self.exchange(key, value)
    }
}

/// The interface of the call in flight, resolved from the Python argument.
#[derive(Clone)]
struct Resolved {
    all_reduce: Arc<dyn AllReduce>,
    /// Set when it is a Python object, whose exceptions are kept.
    python: Option<Arc<PyAllReduce>>,
}

/// The all-reduce a reusable preprocessor is built with: it forwards to the interface set for
/// the current call ([`AllReduceSlot::set`]), and fails (naming the key) when there is none.
#[derive(Default)]
pub struct AllReduceSlot {
    current: Mutex<Option<Resolved>>,
}

impl AllReduceSlot {
    /// Uses the interface `obj` (None: none) from now on; a `ConfigError` if `obj` is neither
    /// our TCP all-reduce nor an object with a callable `all_reduce_or`.
    pub fn set(&self, obj: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let resolved = match obj {
            None => None,
            Some(o) if o.is_none() => None,
            Some(o) => Some(resolve(o)?),
        };
        if let Ok(mut c) = self.current.lock() {
            *c = resolved;
        }
        Ok(())
    }

    /// Forgets the interface (so that a cached preprocessor keeps no user object alive).
    pub fn clear(&self) {
        if let Ok(mut c) = self.current.lock() {
            *c = None;
        }
    }

    fn get(&self, key: u64) -> Result<Arc<dyn AllReduce>> {
        self.current.lock().ok().and_then(|c| c.as_ref().map(|r| r.all_reduce.clone())).ok_or_else(|| Error::AllReduce {
            key,
            reason: "no all_reduce_interface was given for this call (multi-host minibatching needs one)".into(),
        })
    }

    /// The exception a Python interface raised in the failed exchange, if any.
    fn take_failure(&self) -> Option<PyErr> {
        let py = self.current.lock().ok()?.as_ref()?.python.clone()?;
        let failure = py.failure.lock().ok()?.take();
        failure
    }
}

impl AllReduce for AllReduceSlot {
    fn all_reduce_or_bool(&self, key: u64, value: bool) -> Result<bool> {
        self.get(key)?.all_reduce_or_bool(key, value)
    }
    fn all_reduce_or_u64(&self, key: u64, value: u64) -> Result<u64> {
        self.get(key)?.all_reduce_or_u64(key, value)
    }
}

/// Our TCP all-reduce natively; any object with a callable `all_reduce_or` through the GIL.
fn resolve(obj: &Bound<'_, PyAny>) -> PyResult<Resolved> {
    let py = obj.py();
    if let Ok(tcp) = obj.cast::<NativeTcpAllReduce>() {
        let inner = tcp.get().live(py)?;
        return Ok(Resolved {
            all_reduce: inner,
            python: None,
        });
    }
    let callable = obj
        .getattr("all_reduce_or")
        .map(|m| m.is_callable())
        .unwrap_or(false);
    if !callable {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        let message = format!(
            "all_reduce_interface: a {ty} has no method all_reduce_or(sync_key, value) -> int; pass \
             sparsecore_prep.get_all_reduce_interface(...), sparsecore_prep.JaxDistributedAllReduce() or an object \
             with that method (the reference's own interface object cannot be called from Python)"
        );
        return Err(errors::raise(
            py,
            errors::Class::Config,
            message,
            &[("field", errors::field(py, "all_reduce_interface"))],
        ));
    }
    let p = Arc::new(PyAllReduce {
        obj: obj.clone().unbind(),
        failure: Mutex::new(None),
    });
    Ok(Resolved {
        all_reduce: p.clone(),
        python: Some(p),
    })
}

/// One host address as the reference takes it ("host:port", "ipv4:1.2.3.4:port",
/// "ipv6:[::1]:port", "dns:///host:port"), resolved to its first socket address.
fn peer_address(py: Python<'_>, text: &str) -> PyResult<SocketAddr> {
    let bare = ["dns:///", "dns:", "ipv4:", "ipv6:"]
        .iter()
        .find_map(|p| text.strip_prefix(p))
        .unwrap_or(text);
    let bad = |why: String| {
        errors::raise(
            py,
            errors::Class::Config,
            format!("peer address {text:?}: {why}"),
            &[("field", errors::field(py, "peer_addresses"))],
        )
    };
    let mut addrs = py
        .detach(|| bare.to_socket_addrs())
        .map_err(|e| bad(format!("cannot resolve it as host:port ({e})")))?
        .collect::<Vec<_>>();
    // Prefer IPv4, which every listener below accepts.
    addrs.sort_by_key(|a| !a.is_ipv4());
    addrs
        .into_iter()
        .next()
        .ok_or_else(|| bad("resolves to no address".into()))
}

/// Listens on `bind`, by default on every interface as the reference's gRPC server does: of
/// IPv4 (`0.0.0.0`) when every peer address is IPv4, else of IPv6 (`[::]`, which also takes IPv4
/// where the system makes IPv6 sockets dual-stack). A `[::]` socket alone would miss IPv4 peers
/// on systems with `bindv6only` set.
fn listen(py: Python<'_>, bind: Option<&str>, port: u16, ipv6: bool) -> PyResult<TcpListener> {
    let io = |addr: &str, e: std::io::Error| {
        to_py(
            py,
            Error::Io {
                context: format!("all-reduce: listening on {addr} (minibatching_port)"),
                source: e,
            },
        )
    };
    if let Some(host) = bind {
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        return TcpListener::bind(&addr).map_err(|e| io(&addr, e));
    }
    if ipv6 {
        TcpListener::bind(("::", port)).map_err(|e| io(&format!("[::]:{port}"), e))
    } else {
        TcpListener::bind(("0.0.0.0", port)).map_err(|e| io(&format!("0.0.0.0:{port}"), e))
    }
}

/// The TCP all-reduce (`sparsecore_prep.get_all_reduce_interface`): this host listens on its
/// minibatching port and exchanges HMAC-authenticated messages with its peers.
#[pyclass(module = "sparsecore_prep._native", name = "TcpAllReduce", frozen)]
pub struct NativeTcpAllReduce {
    inner: Mutex<Option<Arc<TcpAllReduce>>>,
    host_id: usize,
    host_count: usize,
    port: u16,
    peers: Vec<SocketAddr>,
}

impl NativeTcpAllReduce {
    fn live(&self, py: Python<'_>) -> PyResult<Arc<TcpAllReduce>> {
        self.inner
            .lock()
            .ok()
            .and_then(|i| i.clone())
            .ok_or_else(|| {
                errors::raise(
                    py,
                    errors::Class::Config,
                    format!(
                        "all_reduce_interface: host {}'s TCP all-reduce was closed",
                        self.host_id
                    ),
                    &[("field", errors::field(py, "all_reduce_interface"))],
                )
            })
    }
}

#[pymethods]
impl NativeTcpAllReduce {
    /// Host `host_id` of `host_count`: listens on `minibatching_port` (0: any free port) and
    /// talks to `peer_addresses`: the other hosts in any order (their ranks are learned from
    /// their hellos, since the reference's list carries none), or all `host_count` hosts in host
    /// order, this one's entry unused. `token`: the job's shared secret (str or bytes; default: the
    /// environment variable `SPARSECORE_PREP_ALLREDUCE_TOKEN`). `timeout`: seconds one exchange
    /// may take before it fails naming the silent peers.
    #[new]
    #[pyo3(signature = (host_id, host_count, peer_addresses, minibatching_port, token=None, timeout=60.0, bind_address=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host_id: usize,
        host_count: usize,
        peer_addresses: Vec<String>,
        minibatching_port: u16,
        token: Option<&Bound<'_, PyAny>>,
        timeout: f64,
        bind_address: Option<&str>,
    ) -> PyResult<Self> {
        let config = |field: &str, message: String| {
            errors::raise(
                py,
                errors::Class::Config,
                message,
                &[("field", errors::field(py, field))],
            )
        };
        if host_count == 0 || host_id >= host_count {
            return Err(config(
                "host_id",
                format!("host_id {host_id} must be in [0, host_count {host_count})"),
            ));
        }
        // The address count is checked before anything is sized by host_count, so a mistyped
        // host_count is a ConfigError, never an allocation of one entry per claimed host.
        let any_order = peer_addresses.len() + 1 == host_count;
        let in_host_order = peer_addresses.len() == host_count && host_count > 1;
        if !any_order && !in_host_order {
            return Err(config(
                "peer_addresses",
                format!(
                    "{} peer addresses for host_count {host_count}: give the other {} hosts' addresses (in any order), \
                     or all {host_count} in host order (this host's entry unused)",
                    peer_addresses.len(),
                    host_count - 1
                ),
            ));
        }
        let given: Vec<&String> = if in_host_order {
            peer_addresses
                .iter()
                .enumerate()
                .filter(|&(h, _)| h != host_id)
                .map(|(_, a)| a)
                .collect()
        } else {
            peer_addresses.iter().collect()
        };
        let timeout = Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                config(
                    "timeout",
                    format!("timeout {timeout} must be a positive number of seconds"),
                )
            })?;
        let token: Option<Vec<u8>> = match token {
            None => None,
            Some(t) if t.is_none() => None,
            Some(t) => {
                if let Ok(s) = t.cast::<PyString>() {
                    Some(s.to_str()?.as_bytes().to_vec())
                } else if let Ok(b) = t.cast::<PyBytes>() {
                    Some(b.as_bytes().to_vec())
                } else {
                    return Err(errors::raise(
                        py,
                        errors::Class::InputType,
                        format!("token must be str or bytes, got {}", t.get_type().name()?),
                        &[],
                    ));
                }
            }
        };
        if token.as_ref().is_some_and(|t| t.is_empty()) {
            return Err(config("token", "token must not be empty".into()));
        }
        let mut peers: Vec<SocketAddr> = Vec::with_capacity(host_count);
        let mut it = given.into_iter();
        for h in 0..host_count {
            peers.push(if h == host_id {
                SocketAddr::from(([127, 0, 0, 1], 0)) // replaced by the listener's address
            } else {
                peer_address(py, it.next().expect("one address per other host"))?
            });
        }
        let ipv6 = peers
            .iter()
            .enumerate()
            .any(|(h, a)| h != host_id && a.is_ipv6());
        let listener = listen(py, bind_address, minibatching_port, ipv6)?;
        let port = listener
            .local_addr()
            .map(|a| a.port())
            .unwrap_or(minibatching_port);
        let mut builder = TcpAllReduce::builder(host_id, peers.clone())
            .timeout(timeout)
            .listener(listener);
        if let Some(t) = token {
            builder = builder.token(t);
        }
        if any_order {
            builder = builder.peers_in_any_order();
        }
        let inner = builder.build().map_err(|e| to_py(py, e))?;
        peers.remove(host_id);
        Ok(NativeTcpAllReduce {
            inner: Mutex::new(Some(Arc::new(inner))),
            host_id,
            host_count,
            port,
            peers,
        })
    }

    /// The OR of `value` over all hosts under `sync_key` (every host calls it with the same
    /// key); an `AllReduceError` naming the silent peers after the timeout.
    fn all_reduce_or(&self, py: Python<'_>, sync_key: u64, value: u64) -> PyResult<u64> {
        let inner = self.live(py)?;
        py.detach(|| inner.all_reduce_or_u64(sync_key, value))
            .map_err(|e| to_py_error(py, e, None))
    }

    /// This host's index.
    #[getter]
    fn host_id(&self) -> usize {
        self.host_id
    }

    /// The number of hosts.
    #[getter]
    fn host_count(&self) -> usize {
        self.host_count
    }

    /// The port this host listens on (the one picked when `minibatching_port` was 0).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// The other hosts' resolved addresses, as given.
    #[getter]
    fn peers(&self) -> Vec<String> {
        self.peers.iter().map(|a| a.to_string()).collect()
    }

    /// What this host has dropped so far (messages that never changed a result), by reason.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.live(py)?.counters();
        let d = PyDict::new(py);
        for (k, v) in [
            ("malformed", c.malformed),
            ("unknown_rank", c.unknown_rank),
            ("bad_mac", c.bad_mac),
            ("replayed", c.replayed),
            ("duplicate", c.duplicate),
            ("inbox_full", c.inbox_full),
            ("expired", c.expired),
            ("connections_refused", c.connections_refused),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Stops listening (once no call is using it); later use is a `ConfigError`.
    fn close(&self) {
        let taken = self.inner.lock().ok().and_then(|mut i| i.take());
        drop(taken);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.close();
        false
    }

    fn __reduce__(&self, py: Python<'_>) -> PyResult<()> {
        Err(errors::raise(
            py,
            errors::Class::InputType,
            "a TCP all-reduce holds a listening socket and cannot be pickled; make one in each worker with \
             sparsecore_prep.get_all_reduce_interface"
                .into(),
            &[],
        ))
    }

    fn __repr__(&self) -> String {
        let open = self.inner.lock().map(|i| i.is_some()).unwrap_or(false);
        format!(
            "TcpAllReduce(host {} of {}, port {}, peers [{}]{})",
            self.host_id,
            self.host_count,
            self.port,
            self.peers
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            if open { "" } else { ", closed" }
        )
    }
}
