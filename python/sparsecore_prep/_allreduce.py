"""Multi-host minibatching: the all-reduce the hosts of a job agree through.

With minibatching on, every host ORs two values with the others at each step
(under sync keys ``2 * batch_number`` and ``2 * batch_number + 1``): whether
any host needs to split, then the union of the split points, so that all hosts
split the step into the same minibatches. The drop-in calls and
:class:`~sparsecore_prep.Preprocessor` take the collective as
``all_reduce_interface``:

* :func:`get_all_reduce_interface` (the reference's signature): our TCP
  all-reduce, authenticated with a shared secret, run natively (no Python in
  the exchange);
* :class:`JaxDistributedAllReduce`: over the key-value store of the
  ``jax.distributed`` coordination service that a multi-host JAX job already
  runs (no extra port, no secret of ours);
* any object with a method ``all_reduce_or(sync_key: int, value: int) -> int``
  (see :class:`AllReduceInterface`), e.g. built on a collective the job
  already has.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, Sequence, runtime_checkable

from ._errors import ConfigError, SparseCorePrepError
from . import _native

__all__ = ["AllReduceError", "AllReduceInterface", "JaxDistributedAllReduce", "TcpAllReduce", "get_all_reduce_interface"]

TcpAllReduce = _native.TcpAllReduce
"""Our TCP all-reduce; make it with :func:`get_all_reduce_interface`."""

#: The environment variable a job's shared secret is read from when ``token`` is not given.
TOKEN_ENV = "SPARSECORE_PREP_ALLREDUCE_TOKEN"


class AllReduceError(SparseCorePrepError, RuntimeError):
  """The hosts could not agree on a minibatching split.

  A peer that is missing, died, is too slow or speaks with another token (TCP
  all-reduce: the message names it and its address); a coordination service
  that did not answer in time (:class:`JaxDistributedAllReduce`); or a user's
  ``all_reduce_interface`` that raised (chained as ``__cause__``) or returned
  something that is not an OR of this host's value. The step's output is not
  usable on any host; the others fail the same way within their timeout.

  Fields: ``sync_key`` (``2 * batch_number`` for "does any host split?",
  ``2 * batch_number + 1`` for the split bits).
  """

  fields = ("sync_key",)


AllReduceError.__module__ = "sparsecore_prep"


@runtime_checkable
class AllReduceInterface(Protocol):
  """What an ``all_reduce_interface`` must provide.

  ``all_reduce_or(sync_key, value)`` returns the bitwise OR of ``value`` over
  all hosts of the job, each of which calls it with the same ``sync_key``
  (an int in ``[0, 2**64)``). ``value`` is an int in ``[0, 2**64)`` (0 or 1
  for the key ``2 * batch_number``, split bits for ``2 * batch_number + 1``);
  the result must contain ``value``'s bits. It must block until every host has
  contributed, and raise (rather than hang) if one never does: whatever it
  raises becomes an :class:`AllReduceError` naming the sync key, with the
  exception as ``__cause__``.

  It is called from a preprocessing thread with the GIL held, twice per step
  when minibatching is on, in the same order on every host.
  """

  def all_reduce_or(self, sync_key: int, value: int) -> int:
    ...


def _jax_process(what: str) -> int:
  try:
    import jax
  except ImportError as e:
    raise ConfigError(f"{what} was not given and jax is not importable to ask (jax.process_index() / "
                      f"jax.process_count()); pass host_id and host_count", field=what) from e
  return int(jax.process_index() if what == "host_id" else jax.process_count())


def get_all_reduce_interface(
    peer_addresses: Sequence[str],
    minibatching_port: int,
    host_id: int | None = None,
    host_count: int | None = None,
    *,
    token: str | bytes | None = None,
    timeout: float = 60.0,
    bind_address: str | None = None,
) -> "TcpAllReduce":
  """This host's all-reduce for multi-host minibatching, over TCP.

  The reference's ``embedding.get_all_reduce_interface`` with the same
  arguments; pass the result as ``all_reduce_interface`` to
  :func:`~sparsecore_prep.preprocess_sparse_dense_matmul_input` or
  :class:`~sparsecore_prep.Preprocessor`. Unlike the reference's gRPC one,
  every message carries an HMAC under the job's shared secret (messages from
  elsewhere are dropped, counted in :meth:`TcpAllReduce.counters`, and never
  change a split); a peer that is not listening yet is retried until the
  timeout instead of crashing the process; and a peer that is missing or dies
  is an :class:`AllReduceError` naming it on every other host.

  Args:
    peer_addresses: the other hosts' ``"host:port"`` addresses (also
      ``"ipv4:a.b.c.d:port"``, ``"[ipv6]:port"``, ``"dns:///host:port"``),
      in any order, as the reference is given them (each peer's rank is
      learned from its reply); or all ``host_count`` addresses in host order,
      this host's entry unused.
    minibatching_port: the port this host listens on (0: any free port, see
      ``.port``).
    host_id: this host's index (default ``jax.process_index()``).
    host_count: the number of hosts (default ``jax.process_count()``).
    token: the job's shared secret, the same on every host (default: the
      environment variable ``SPARSECORE_PREP_ALLREDUCE_TOKEN``; without
      either, messages are not authenticated and a warning is printed once).
    timeout: seconds one exchange may take before :class:`AllReduceError`.
    bind_address: the interface to listen on (default: all, as the
      reference does: ``0.0.0.0``, or ``[::]`` when a peer address is IPv6).

  Returns:
    A :class:`TcpAllReduce`, listening until it is closed (``.close()``,
    ``with``) or collected. It does not pickle: make one in each process.

  Raises:
    ConfigError: bad host ids, addresses or options; ``host_id`` or
      ``host_count`` omitted without jax to ask.
    OSError: the port cannot be listened on (e.g. it is in use).
  """
  if host_id is None:
    host_id = _jax_process("host_id")
  if host_count is None:
    host_count = _jax_process("host_count")
  if isinstance(peer_addresses, (str, bytes)):
    raise ConfigError("peer_addresses must be a sequence of \"host:port\" strings, not one string",
                      field="peer_addresses")
  return _native.TcpAllReduce(int(host_id), int(host_count), [str(a) for a in peer_addresses],
                              int(minibatching_port), token, float(timeout), bind_address)


# Instances made per name in this process: every host makes its instances in the same order, so
# the n-th one of a name has the same key prefix on all hosts and never meets an older one's keys.
_GENERATIONS: dict[str, int] = {}
_GENERATIONS_LOCK = threading.Lock()


class JaxDistributedAllReduce:
  """An all-reduce over the ``jax.distributed`` coordination service.

  A multi-host JAX job already runs this service (``jax.distributed.initialize``)
  and every process has an authenticated channel to it, so this needs no port
  and no secret of ours. Each exchange writes this process's value under a
  key of the service's key-value store and reads the other processes' values
  (blocking, with ``timeout``); a value is deleted once every process is known
  to have read it (when this process finishes its next exchange).

  Exchanges are numbered per instance, so every process must make its
  instances in the same order and run the same sequence of preprocessing
  calls through each (as a job that splits steps identically does anyway).

  Args:
    name: the key prefix; instances used side by side need distinct names.
    timeout: seconds one exchange may wait for the other processes.

  Raises:
    ConfigError: jax is not importable or ``jax.distributed`` is not
      initialized in this process.
  """

  def __init__(self, name: str = "sparsecore_prep/all_reduce", *, timeout: float = 60.0):
    try:
      from jax._src import distributed
    except ImportError as e:
      raise ConfigError("JaxDistributedAllReduce needs jax", field="all_reduce_interface") from e
    state = distributed.global_state
    if state.client is None:
      raise ConfigError("JaxDistributedAllReduce needs jax.distributed.initialize() to have run in this process",
                        field="all_reduce_interface")
    if not timeout > 0:
      raise ConfigError(f"timeout {timeout} must be a positive number of seconds", field="timeout")
    self._client = state.client
    self._rank = int(state.process_id)
    self._count = int(state.num_processes)
    self._timeout = float(timeout)
    with _GENERATIONS_LOCK:
      generation = _GENERATIONS.get(name, 0)
      _GENERATIONS[name] = generation + 1
    self._prefix = f"{name}/{generation}"
    self._seq = 0
    self._previous: str | None = None
    self._lock = threading.Lock()

  @property
  def host_id(self) -> int:
    """This process's index (``jax.process_index()``)."""
    return self._rank

  @property
  def host_count(self) -> int:
    """The number of processes (``jax.process_count()``)."""
    return self._count

  def all_reduce_or(self, sync_key: int, value: int) -> int:
    """The OR of ``value`` over all processes under ``sync_key``."""
    sync_key, value = int(sync_key), int(value)
    with self._lock:
      base = f"{self._prefix}/{self._seq}/{sync_key}"
      self._seq += 1
      mine = f"{base}/{self._rank}"
      try:
        self._client.key_value_set(mine, str(value))
      except Exception as e:
        raise AllReduceError(f"all-reduce under sync key {sync_key}: the coordination service refused key "
                             f"{mine!r} ({e})", sync_key=sync_key) from e
      deadline = time.monotonic() + self._timeout
      acc = value
      for p in range(self._count):
        if p == self._rank:
          continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
          acc |= int(self._client.blocking_key_value_get(f"{base}/{p}", left_ms))
        except Exception as e:
          raise AllReduceError(f"all-reduce under sync key {sync_key}: no value from process {p} of {self._count} "
                               f"within {self._timeout:g} s through the jax.distributed coordination service "
                               f"({type(e).__name__}: {e})", sync_key=sync_key) from e
      # Every other process has now written this exchange's value, so it has read the previous one of
      # ours: that one can go.
      if self._previous is not None:
        try:
          self._client.key_value_delete(self._previous)
        except Exception:  # only memory in the service is at stake
          pass
      self._previous = mine
      return acc

  def __repr__(self) -> str:
    return f"JaxDistributedAllReduce(process {self._rank} of {self._count}, prefix {self._prefix!r})"
