"""The preprocessor for our JSON config over Arrow record batches, and its form for Ray Data's
``map_batches`` that yields FDO statistics."""

from __future__ import annotations

import json
import operator
import threading

import numpy as np

from . import _native
from ._config import _config_json
from ._fdo import FdoStats
from ._results import _wrap


class Preprocessor:
  """A reusable preprocessor for one config, over Arrow record batches.

  ``Preprocessor(config)(batch)`` returns ``(PreprocessedInput,
  SparseDenseMatmulInputStats)`` like the drop-in call. ``batch`` is one local
  batch: a pyarrow ``RecordBatch`` or ``Table`` or any object with
  ``__arrow_c_array__`` / ``__arrow_c_stream__``, whose columns the config's
  features name (``List``/``LargeList`` of Int32/Int64 ids, optional
  ``List<Float32>`` weights). Nothing is copied on the way in, and the GIL is
  released while the batch is processed.

  It pickles as its config, so Ray Data (``map_batches``) and Spark
  (``mapInArrow``) can ship it to workers, where it is rebuilt.

  Args:
    config: our config (SPEC Part 1, section 1.1) as a dict, JSON text or a
      path to a JSON file.
    threads: a dedicated pool of this many threads; 1 runs on the calling
      thread, with no pool (default: one shared pool with one thread per
      CPU). A batch of fewer than ``sparsecore_prep._native.SMALL_BATCH_IDS``
      ids runs on the calling thread whatever the count: a pool's hand-over
      costs more than such a batch.
    has_leading_dimension: shape arrays ``[L, ...]`` instead of flat.
    all_reduce_interface: the hosts' all-reduce for multi-host minibatching,
      as in :func:`preprocess_sparse_dense_matmul_input` (see
      :meth:`set_all_reduce_interface`). It is not pickled (it holds a socket
      or a connection): a preprocessor unpickled in a worker raises
      :class:`AllReduceError` at its first split until the worker sets its own.
  """

  def __init__(self, config, *, threads: int | None = None, has_leading_dimension: bool = False,
               all_reduce_interface=None):
    later = all_reduce_interface is _SET_LATER
    self._all_reduce = None if later else all_reduce_interface
    native = _native.NativePreprocessor(_config_json(config), threads, self._all_reduce, later)
    self._config_json = native.config_json
    self._multi_host = native.multi_host
    self._threads = threads
    self._leading = bool(has_leading_dimension)
    self._local_devices = int(self.config["config"]["local_device_count"])
    # Concurrent calls each take a native preprocessor of their own (its output buffers and
    # workspaces serve one call at a time), made like the first on demand and kept for later
    # calls. The settings below reach each one before its next call: `_settings` counts their
    # changes, and every idle native remembers the count it has seen.
    self._lock = threading.Lock()
    self._idle = [(native, 0)]
    self._settings = 0
    self._batch_number = None

  def _take(self):
    with self._lock:
      native, seen = self._idle.pop() if self._idle else (None, -1)
      settings, batch_number, all_reduce, multi_host = (self._settings, self._batch_number, self._all_reduce,
                                                        self._multi_host)
    if native is None:
      native = _native.NativePreprocessor(self._config_json, self._threads, all_reduce,
                                          multi_host and all_reduce is None)
    elif seen != settings:
      if multi_host:
        native.set_all_reduce_interface(all_reduce)
    if batch_number is not None and seen != settings:
      native.set_batch_number(batch_number)
    return native, settings

  def _run(self, method, *args):
    native, settings = self._take()
    try:
      return getattr(native, method)(*args)
    finally:
      with self._lock:
        self._idle.append((native, settings))

  @property
  def config(self) -> dict:
    """The config, with defaults filled in."""
    return json.loads(self._config_json)

  def __call__(self, batch):
    """Preprocesses one record batch: ``(PreprocessedInput, SparseDenseMatmulInputStats)``."""
    raw = self._run("run", batch, self._leading)
    return _wrap(raw, self._local_devices, self._leading)

  def set_batch_number(self, batch_number: int) -> None:
    """Sets the step number that keys minibatching's cross-host agreement."""
    batch_number = int(batch_number)
    if batch_number < 0:
      raise OverflowError("can't convert negative int to unsigned")
    with self._lock:
      self._batch_number = batch_number
      self._settings += 1

  def set_all_reduce_interface(self, all_reduce_interface) -> None:
    """Agrees on minibatching splits with the other hosts through ``all_reduce_interface``.

    :func:`get_all_reduce_interface`, :class:`JaxDistributedAllReduce`, or any
    object with ``all_reduce_or(sync_key, value) -> int``
    (:class:`AllReduceInterface`); None removes it (a multi-host config then
    fails at its next split with :class:`AllReduceError`). Every host must
    process its batch of a step under the same :meth:`set_batch_number`.

    Raises:
      ConfigError: an object without ``all_reduce_or``.
    """
    if all_reduce_interface is not None and not hasattr(all_reduce_interface, "all_reduce_or"):
      # The native call's own check, so that the error comes now rather than at the next call.
      _native.NativePreprocessor(self._config_json, 1).set_all_reduce_interface(all_reduce_interface)
    with self._lock:
      self._all_reduce = all_reduce_interface
      self._multi_host = self._multi_host or all_reduce_interface is not None
      self._settings += 1

  def fdo_stats(self, batch) -> "FdoStats":
    """The FDO statistics of one record batch, without writing buffers.

    Limits are measured, not enforced, so this never raises
    :class:`LimitExceededError`.
    """
    return FdoStats(self._run("fdo_stats", batch))

  def balance(self, batches, *, window: int = 1, refine: str = "worst-cell", with_report: bool = False):
    """Reorders the samples of record batches so that every (SparseCore slice,
    partition) cell of each batch gets an even share of ids.

    ``batches`` (pyarrow RecordBatches or Tables, or any Arrow PyCapsule
    producer, all of one schema) are taken in windows of ``window`` consecutive
    batches (the last may be shorter); the samples of a window are dealt back
    out as batches of the input sizes, every column of a row moving together.
    Every output batch's worst cell (relative to its stack's limit) is lower
    than its input's (W = 1) or than the window's worst input batch's (W > 1),
    and no stack rises above both what its input needed and its limit, so
    batches that fit the config's limits still fit them; where balancing
    cannot help, the input order is kept.
    The same as ``sparsecore-prep balance --window W`` (``sparsecore_prep::balance``).
    ``refine="every-stack"`` (``--refine every-stack``) also lowers every stack's
    own worst cell after the worst one, with no stack's buffer rising: smaller
    tuned limits and buffers per stack, for more balancing work;
    ``refine="unique-ids"`` then also lowers each stack's worst
    ``max_unique_ids_per_partition`` cell, for the most work.

    Returns ``(batches, permutation)``: the reordered ``pyarrow.RecordBatch``es,
    one per input batch, and an int64 array over all rows in order: output row
    ``j`` is input row ``permutation[j]``. With ``with_report=True``, also a
    list of per-window dicts (``batches``, ``reordered``, ``outcome``: why the
    input order was kept, one of ``"reordered"``, ``"empty_window"``,
    ``"uneven_batch"``, ``"mixed_plans"``, ``"at_lower_bound"``,
    ``"no_better_order"``, ``"would_pass_limit"``, ``"would_pass_unique_limit"``,
    with the stack it names in ``outcome_stack`` or ``None``, and per stack the
    worst ``max_ids_per_partition`` and ``required_buffer`` before and after,
    counted exactly as the pipeline counts them, and the ``lower_bound`` no
    order can beat). Unique ids need the pipeline's sort: preprocess the
    batches (or ``fdo_stats``) for ``max_unique_ids_per_partition``.

    Raises :class:`InvalidInputError` for batches of different schemas or a
    missing column (and returns nothing), and ``TypeError`` for one batch or
    table instead of a sequence of them, or a window that is not an ``int``.
    Unlike ``sparsecore-prep balance``, which also preprocesses every window
    for its report, this does not check ids against the vocabulary:
    preprocessing the batches does.
    """
    if hasattr(batches, "__arrow_c_array__") or hasattr(batches, "__arrow_c_stream__"):
      raise TypeError("balance takes a sequence of record batches (or tables), not one: wrap it in a list")
    window = operator.index(window)  # TypeError for 1.5, as for any index
    out, permutation, reports = _native._balance(self._config_json, list(batches), window, str(refine))
    if with_report:
      return out, permutation, reports
    return out, permutation

  def __reduce__(self):
    return (_rebuild_preprocessor, (type(self), self._config_json, self._threads, self._leading, self._multi_host))

  def __repr__(self) -> str:
    cfg = self.config
    return (f"{type(self).__name__}({len(cfg['features'])} features, {len(cfg['tables'])} tables, "
            f"layout {cfg['config']['local_device_count']}/{cfg['config']['global_device_count']}/"
            f"{cfg['config']['num_sc_per_device']})")


# The all_reduce_interface of an unpickled multi-host Preprocessor: its interface stayed behind, and
# the worker sets its own (set_all_reduce_interface) before the first split.
_SET_LATER = object()


def _rebuild_preprocessor(cls, config_json, threads, leading, multi_host=False):
  if multi_host:
    return cls(config_json, threads=threads, has_leading_dimension=leading, all_reduce_interface=_SET_LATER)
  return cls(config_json, threads=threads, has_leading_dimension=leading)


class FdoStatsMapper(Preprocessor):
  """A :class:`Preprocessor` shaped for ``ray.data.Dataset.map_batches``.

  Each call takes one batch (pyarrow ``Table``) and returns a one-row batch
  ``{"fdo_stats": [json]}``, the statistics of that batch; merge the rows with
  :meth:`FdoStats.merge_all`. Pass it as the class so that Ray builds one per
  worker::

      ds.map_batches(FdoStatsMapper, fn_constructor_args=(config,),
                     batch_format="pyarrow", batch_size=B, concurrency=2)
  """

  def __call__(self, batch):
    """``{"fdo_stats": np.array([stats JSON], dtype=object)}`` for one batch."""
    return {"fdo_stats": np.array([self.fdo_stats(batch).to_json()], dtype=object)}


# Pickle and repr name the classes, and the reducer that Preprocessor.__reduce__ returns, where the
# package exports them, sparsecore_prep, the path that existing pickles hold
# (tests/test_pickle_compat.py).
for _obj in (Preprocessor, FdoStatsMapper, _rebuild_preprocessor):
  _obj.__module__ = "sparsecore_prep"
del _obj
