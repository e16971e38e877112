"""An Arrow-native loader stage for Grain: Parquet batches in, SparseCore buffers out.

::

    import grain
    from sparsecore_prep.grain import ParquetBatches, Preprocess

    source = ParquetBatches(paths, batch_size=4096)              # element i: rows [i*B, (i+1)*B)
    ds = (grain.MapDataset.source(source)
          .shuffle(seed=0)
          .map(Preprocess(feature_specs, local_device_count=L, global_device_count=G, num_sc_per_device=S))
          .to_iter_dataset()
          .mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    for preprocessed, stats, rest in ds:                          # rest: {"label": ndarray, ...}
        ...

* :class:`ParquetBatches` is a random-access source: element ``i`` is one
  ``pyarrow.Table`` of ``batch_size`` consecutive rows of the files taken as one
  sequence, read from the row groups that hold them and nothing else. It pickles
  as the paths and the row-group sizes, so any number of workers share any
  number of files evenly.
* :class:`Preprocess` is a ``grain.transforms.Map`` from such a table (or a
  ``RecordBatch``, or Grain's per-row dicts batched by :func:`ragged_batch`) to
  ``(preprocessed, stats, rest)``: exactly the drop-in call's result on the same
  rows, and every other column as a numpy array. The features' Arrow columns are
  read in place by the native preprocessor, without building per-sample numpy
  objects.
* :func:`tune` measures the files' FDO statistics in parallel (no buffers are
  built) and updates the feature specs as the reference's
  ``embedding.update_preprocessing_parameters`` does.

Errors are the package's exceptions (they pickle, so one raised in a Grain
worker reaches the main process as itself), with the file and rows of the batch
in the message; :class:`DataSourceError` is an unreadable file or a missing
column of the source.
"""

from __future__ import annotations

try:
  import grain
except ImportError as _e:  # pragma: no cover - exercised by a subprocess test
  raise ImportError(
      "sparsecore_prep.grain needs Grain (the `grain` package, import name `grain`): "
      "pip install grain") from _e

import bisect
import collections
import concurrent.futures
import copy
import dataclasses
import json
import math
import os
import threading
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ._dropin import preprocess_sparse_dense_matmul_input
from ._errors import ConfigError, InputTypeError, InvalidInputError, SparseCorePrepError
from ._fdo import FdoStats
from ._preprocessor import Preprocessor
from ._pytree import _leaves_and_structure
from ._results import SparseDenseMatmulInputStats
from ._specs import _spec_tuples

__all__ = ["DataSourceError", "ParquetBatches", "Preprocess", "ragged_batch", "tune"]



def _grain_profiling_flag_readable() -> None:
  """Lets ``mp_prefetch`` read its profiling flag in programs that never parse absl flags.

  Grain (0.2.17, 0.2.18) with a jaxlib that has subprocess profiling hooks reads the absl flag
  ``--grain_enable_multiprocess_worker_profiling`` when a multiprocess iterator starts, and absl
  refuses to read a flag before the command line was parsed (``UnparsedFlagAccessError``) unless
  the flag is marked present. Marking it present keeps its value (the default, off, unless the
  program set it); a program that parses its flags (``absl.app.run``) is left alone.
  """
  try:
    from absl import flags
  except ImportError:
    return
  name = "grain_enable_multiprocess_worker_profiling"
  if not flags.FLAGS.is_parsed() and name in flags.FLAGS and not flags.FLAGS[name].present:
    flags.FLAGS[name].present = 1


_grain_profiling_flag_readable()

# The schema metadata key under which ParquetBatches records where a batch's rows came from;
# Preprocess names them in its errors and takes the step number from it.
_ORIGIN_KEY = b"sparsecore_prep.origin"


class DataSourceError(SparseCorePrepError, ValueError):
  """A source file that cannot be read, or a column it lacks or holds in another type.

  Fields: ``path`` (the file), ``column`` (when one is to blame) and
  ``row_group`` (when reading one failed).
  """

  fields = ("path", "column", "row_group")


# ---------------------------------------------------------------------------------------------
# ParquetBatches
# ---------------------------------------------------------------------------------------------


class _Slot:
  """One row group being read or read: the first thread to ask reads it, the others wait."""

  def __init__(self):
    self.done = threading.Event()
    self.table = None
    self.error = None


class _RowGroupCache:
  """Decoded row groups of this process, the most recently used kept (a batch that straddles two
  row groups, or row groups larger than a batch, read them once, not once per batch)."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._lock = threading.Lock()
    self._slots: collections.OrderedDict = collections.OrderedDict()

  def get(self, key, load):
    with self._lock:
      slot = self._slots.get(key)
      owner = slot is None
      if owner:
        slot = self._slots[key] = _Slot()
        while len(self._slots) > self.capacity:
          self._slots.popitem(last=False)
      else:
        self._slots.move_to_end(key)
    if owner:
      try:
        slot.table = load()
      except BaseException as e:
        slot.error = e
        with self._lock:
          if self._slots.get(key) is slot:
            del self._slots[key]
        raise
      finally:
        slot.done.set()
    slot.done.wait()
    if slot.error is not None:
      raise slot.error
    return slot.table


_ROW_GROUPS = _RowGroupCache(8)
# Open ParquetFiles, per thread (a ParquetFile is not documented as safe to share between threads)
# and per process (a forked child opens its own).
_FILES = threading.local()


def _parquet_file(path: str) -> pq.ParquetFile:
  files = getattr(_FILES, "files", None)
  if files is None or _FILES.pid != os.getpid():
    files = _FILES.files = {}
    _FILES.pid = os.getpid()
  f = files.get(path)
  if f is None:
    try:
      f = files[path] = pq.ParquetFile(path)
    except Exception as e:
      raise DataSourceError(f"{path}: cannot open the Parquet file ({type(e).__name__}: {e})", path=path) from None
  return f


def _shard_of(shard) -> tuple[int, int]:
  if shard is None:
    return 0, 1
  if shard == "jax":
    import jax

    return int(jax.process_index()), int(jax.process_count())
  if hasattr(shard, "shard_index") and hasattr(shard, "shard_count"):  # grain.sharding.ShardOptions
    return int(shard.shard_index), int(shard.shard_count)
  try:
    index, count = shard
    index, count = int(index), int(count)
  except (TypeError, ValueError):
    raise ConfigError(f"shard must be (index, count), a grain ShardOptions, \"jax\" or None, got {shard!r}",
                      field="shard") from None
  if not 0 <= index < count:
    raise ConfigError(f"shard {index} of {count}: the index must be in [0, count)", field="shard")
  return index, count


class ParquetBatches:
  """Parquet files as a Grain random-access source of fixed-size row batches.

  The files are one sequence of rows, in the order given. Element ``i`` is the
  ``pyarrow.Table`` of rows ``[i * batch_size, (i + 1) * batch_size)`` of that
  sequence, across file and row-group boundaries; only the row groups holding
  those rows are read (from the files' footers, read once here). Decoded row
  groups are cached per process (the 8 most recent) and open files per thread,
  so consecutive batches of one row group decode it once.

  Use it with ``grain.MapDataset.source(ParquetBatches(...))``. It pickles as
  its paths and row-group sizes, so Grain's worker processes (``mp_prefetch``)
  each read the batches of their own slice, whatever the number of files.

  Args:
    paths: a path or a sequence of paths of Parquet files.
    batch_size: rows per element (the local batch).
    columns: the columns to read (default: all the first file's columns). Every
      file must hold them, with the same types.
    drop_remainder: drop the last, shorter batch (default); else it is the
      last element.
    shard: ``(index, count)`` or a ``grain.sharding.ShardOptions``: this host
      reads batches ``index, index + count, index + 2 * count, ...``, and every
      host the same number of them (``len(total batches) // count``), so that
      hosts stay in step; ``"jax"`` takes ``(jax.process_index(),
      jax.process_count())``. Default: every batch.

  Each table carries, in its schema metadata, the files and rows it came from
  and its step (its index in this source); :class:`Preprocess` names them in
  its errors and uses the step as the minibatching ``batch_number``.

  Raises:
    ConfigError: ``batch_size`` below 1, a bad ``shard``.
    DataSourceError: a file that cannot be opened or read as Parquet, a
      column missing from a file or of another type than in the first file.
  """

  def __init__(self, paths, batch_size: int, *, columns: Sequence[str] | None = None, drop_remainder: bool = True,
               shard=None):
    if isinstance(paths, (str, bytes, os.PathLike)):
      paths = [paths]
    self._paths = tuple(os.fsdecode(p) for p in paths)
    if not self._paths:
      raise ConfigError("ParquetBatches needs at least one path", field="paths")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
      raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}", field="batch_size")
    self._batch_size = int(batch_size)
    self._drop_remainder = bool(drop_remainder)
    self._shard = _shard_of(shard)
    schema = None
    sizes = []
    for path in self._paths:
      try:
        meta = pq.read_metadata(path)
        file_schema = meta.schema.to_arrow_schema()
      except Exception as e:
        raise DataSourceError(f"{path}: cannot read the Parquet footer ({type(e).__name__}: {e})",
                              path=path) from None
      if schema is None:
        schema = file_schema
        if columns is None:
          columns = list(file_schema.names)
      for c in columns:
        i = file_schema.get_field_index(c)
        if i < 0:
          raise DataSourceError(f"{path}: no column `{c}` (the file has {', '.join(file_schema.names)})",
                                path=path, column=c)
        want = schema.field(c).type if schema.get_field_index(c) >= 0 else None
        got = file_schema.field(i).type
        if want is not None and got != want:
          raise DataSourceError(f"{path}: column `{c}` is {got}, but {want} in {self._paths[0]}", path=path, column=c)
      sizes.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    self._columns = tuple(columns)
    self._row_groups = tuple(sizes)
    self._index()

  def _index(self):
    # Row-group start offsets over all files (the last entry is the total), and each row
    # group's (file, group) pair: small (one entry per row group), rebuilt after unpickling.
    starts, where, self._file_starts = [0], [], []
    for f, groups in enumerate(self._row_groups):
      self._file_starts.append(starts[-1])
      for g, n in enumerate(groups):
        if n:
          starts.append(starts[-1] + n)
          where.append((f, g))
    self._starts = starts
    self._where = where
    total = starts[-1]
    batches = total // self._batch_size if self._drop_remainder else -(-total // self._batch_size)
    self._len = batches // self._shard[1]

  @property
  def num_rows(self) -> int:
    """Rows in all files."""
    return self._starts[-1]

  @property
  def columns(self) -> tuple[str, ...]:
    """The columns read."""
    return self._columns

  @property
  def paths(self) -> tuple[str, ...]:
    """The files, in order."""
    return self._paths

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> pa.Table:
    index = int(index)
    if index < 0:
      index += self._len
    if not 0 <= index < self._len:
      raise IndexError(f"batch {index} of a source of {self._len} batches")
    shard_index, shard_count = self._shard
    b = index * shard_count + shard_index
    lo = b * self._batch_size
    hi = min(lo + self._batch_size, self._starts[-1])
    pieces, origin = [], []
    k = bisect.bisect_right(self._starts, lo) - 1
    while k < len(self._where) and self._starts[k] < hi:
      f, g = self._where[k]
      start = self._starts[k]
      table = _ROW_GROUPS.get((self._paths[f], g, self._columns), lambda f=f, g=g: self._read(f, g))
      a, z = max(lo, start) - start, min(hi, self._starts[k + 1]) - start
      pieces.append(table.slice(a, z - a).replace_schema_metadata(None))
      file_first = start - self._file_starts[f]
      origin.append([self._paths[f], file_first + a, file_first + z])
      k += 1
    out = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces, promote_options="default")
    # Rows of one file that follow each other make one entry.
    merged = []
    for path, a, z in origin:
      if merged and merged[-1][0] == path and merged[-1][2] == a:
        merged[-1][2] = z
      else:
        merged.append([path, a, z])
    meta = dict(out.schema.metadata or {})
    meta[_ORIGIN_KEY] = json.dumps({"step": index, "rows": merged}).encode()
    return out.replace_schema_metadata(meta)

  def _read(self, f: int, g: int) -> pa.Table:
    path = self._paths[f]
    try:
      return _parquet_file(path).read_row_group(g, columns=list(self._columns))
    except DataSourceError:
      raise
    except Exception as e:
      raise DataSourceError(f"{path}: cannot read row group {g} ({type(e).__name__}: {e})",
                            path=path, row_group=g) from None

  def __getstate__(self):
    return {"paths": self._paths, "batch_size": self._batch_size, "columns": self._columns,
            "drop_remainder": self._drop_remainder, "shard": self._shard, "row_groups": self._row_groups}

  def __setstate__(self, state):
    self._paths = state["paths"]
    self._batch_size = state["batch_size"]
    self._columns = state["columns"]
    self._drop_remainder = state["drop_remainder"]
    self._shard = state["shard"]
    self._row_groups = state["row_groups"]
    self._index()

  def __repr__(self) -> str:
    shard = "" if self._shard == (0, 1) else f", shard {self._shard[0]} of {self._shard[1]}"
    return (f"ParquetBatches({len(self._paths)} files, {self.num_rows} rows, batch_size={self._batch_size}, "
            f"{self._len} batches{shard})")


def _origin(table) -> dict | None:
  meta = getattr(getattr(table, "schema", None), "metadata", None)
  if not meta or _ORIGIN_KEY not in meta:
    return None
  try:
    return json.loads(meta[_ORIGIN_KEY])
  except ValueError:
    return None


def _where(origin: dict | None) -> str:
  if not origin:
    return ""
  rows = "; ".join(f"{p} rows {a}..{z}" for p, a, z in origin["rows"])
  return f"batch {origin['step']} ({rows}): "


# ---------------------------------------------------------------------------------------------
# Grain's per-row dicts
# ---------------------------------------------------------------------------------------------


def ragged_batch(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
  """Grain's per-row dicts (e.g. from ``grain.experimental.ParquetIterDataset``)
  as one ``pyarrow.Table``, for ``.batch(B, batch_fn=ragged_batch)`` before
  :class:`Preprocess`.

  A value that is a sequence or a 1-D array per row becomes a list column
  (``List<Int64>`` for integer ids, ``List<Float64>``/``List<Float32>`` for
  weights); scalars become a plain column.
  """
  rows = list(rows)
  if not rows:
    raise InvalidInputError("ragged_batch got no rows")
  columns = {}
  for name in rows[0]:
    try:
      values = [r[name] for r in rows]
    except KeyError:
      raise InvalidInputError(f"ragged_batch: column `{name}` is missing from some rows") from None
    first = values[0]
    if isinstance(first, np.ndarray) and first.ndim == 1 and all(
        isinstance(v, np.ndarray) and v.ndim == 1 for v in values):
      columns[name] = _list_array(values)
    elif isinstance(first, (list, tuple, np.ndarray)):
      columns[name] = pa.array(values)
    else:
      columns[name] = pa.array(np.asarray(values))
  return pa.table(columns)


def _list_array(rows: list) -> pa.Array:
  """1-D numpy rows as one list array: the values concatenated once, in the rows' common dtype
  (empty rows, whatever their dtype, do not count)."""
  lengths = np.fromiter((v.size for v in rows), np.int64, len(rows))
  filled = [v for v in rows if v.size]
  if filled:
    flat = np.concatenate(filled).astype(np.result_type(*(v.dtype for v in filled)), copy=False)
  else:
    flat = np.empty(0, rows[0].dtype if rows[0].dtype.kind in "iuf" else np.int64)
  offsets = np.zeros(len(rows) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  if offsets[-1] < 2**31:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
  return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))


# ---------------------------------------------------------------------------------------------
# Preprocess
# ---------------------------------------------------------------------------------------------

_DROP_IN_OPTIONS = ("local_device_count", "global_device_count", "num_sc_per_device", "sharding_strategy",
                    "has_leading_dimension", "allow_id_dropping", "enable_minibatching", "all_reduce_interface",
                    "validate_ids")


def _portable(spec) -> SimpleNamespace:
  """The attributes the drop-in call reads (python/README.md, "Feature specs"), copied into plain
  objects: the reference's FeatureSpecs hold initializers that need not pickle, these do."""
  table, stacked = spec.table_spec, spec.table_spec.stacked_table_spec
  t = getattr(spec, "_id_transformation", None)
  if t is None:
    t = getattr(spec, "id_transformation", None)
  shape = getattr(spec, "output_shape", None)
  if shape is None:
    shape = getattr(spec, "input_shape", None)
  return SimpleNamespace(
      name=spec.name,
      output_shape=None if shape is None else [int(d) for d in shape],
      _id_transformation=None if t is None else SimpleNamespace(
          row_offset=int(t.row_offset), col_offset=int(t.col_offset), col_shift=int(t.col_shift)),
      table_spec=SimpleNamespace(
          name=table.name, vocabulary_size=table.vocabulary_size, embedding_dim=getattr(table, "embedding_dim", None),
          setting_in_stack=SimpleNamespace(stack_name=table.setting_in_stack.stack_name),
          stacked_table_spec=SimpleNamespace(
              combiner=stacked.combiner, max_ids_per_partition=stacked.max_ids_per_partition,
              max_unique_ids_per_partition=stacked.max_unique_ids_per_partition,
              suggested_coo_buffer_size_per_device=stacked.suggested_coo_buffer_size_per_device)))


def _offset(spec) -> int:
  t = spec._id_transformation
  return 0 if t is None else t.row_offset


def _config_from_specs(specs, weights, options) -> dict | None:
  """Our JSON config that plans the specs' stacks, or None when the config format cannot say
  them (Preprocess then checks the plan against the drop-in's before trusting it)."""
  stacks: dict[str, list] = {}
  for s in specs:
    stacks.setdefault(str(s.table_spec.setting_in_stack.stack_name), []).append(s)
  per_stack = {}
  for name, members in stacks.items():
    first = min(members, key=_offset).table_spec.stacked_table_spec  # the drop-in's choice
    per_stack[name] = (first, sorted({str(m.table_spec.name) for m in members}))
  single = all(len(t) == 1 and t[0] == name for name, (_, t) in per_stack.items())
  tables: dict[str, dict] = {}
  stack_limits = None
  for name, (st, members) in per_stack.items():
    if not single and len(members) > 1:
      limits = {"max_ids_per_partition": int(st.max_ids_per_partition),
                "max_unique_ids_per_partition": int(st.max_unique_ids_per_partition)}
      if stack_limits not in (None, limits):
        return None  # the config has one pair of limits for every multi-table stack
      stack_limits = limits
  suggested = {}
  for s in specs:
    ts = s.table_spec
    stack = str(ts.setting_in_stack.stack_name)
    st = per_stack[stack][0]
    if ts.embedding_dim is None or int(ts.embedding_dim) < 1:
      return None
    entry = {"name": str(ts.name), "vocabulary_size": int(ts.vocabulary_size), "embedding_dim": int(ts.embedding_dim),
             "combiner": str(st.combiner), "max_ids_per_partition": int(st.max_ids_per_partition),
             "max_unique_ids_per_partition": int(st.max_unique_ids_per_partition)}
    if tables.setdefault(entry["name"], entry) != entry:
      return None
    if st.suggested_coo_buffer_size_per_device is not None:
      suggested[stack] = int(st.suggested_coo_buffer_size_per_device)
  opts = {"local_device_count": int(options["local_device_count"]),
          "global_device_count": int(options["global_device_count"]),
          "num_sc_per_device": int(options["num_sc_per_device"]),
          "allow_id_dropping": bool(options.get("allow_id_dropping", False)),
          "enable_minibatching": bool(options.get("enable_minibatching", False)),
          "validate_ids": bool(options.get("validate_ids", True)),
          "stacking": "feature" if single else "auto"}
  if stack_limits is not None:
    opts["stack_limits"] = stack_limits
  if suggested:
    opts["stack_suggested_coo_buffer_size_per_device"] = suggested
  features = [{"name": str(s.name), "table": str(s.table_spec.name), "column": str(s.name),
               "weights_column": weights.get(str(s.name))} for s in specs]
  return {"config": opts, "tables": list(tables.values()), "features": features}


def _same_result(a, b) -> bool:
  (pa_, sa), (pb, sb) = a, b

  def same(x, y):
    x, y = np.asarray(x), np.asarray(y)
    # Padding entries' gains are NaN: compare bit patterns.
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))

  def same_dicts(x, y):
    return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)

  return (all(same_dicts(getattr(pa_, f), getattr(pb, f))
              for f in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"))
          and same(pa_.num_minibatches, pb.num_minibatches)
          and all(same_dicts(getattr(sa, f), getattr(sb, f))
                  for f in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"))
          and dict(sa.id_drop_counters) == dict(sb.id_drop_counters))


def _list_type_ok(t: pa.DataType, value_ok) -> bool:
  return (pa.types.is_list(t) or pa.types.is_large_list(t)) and value_ok(t.value_type)


class Preprocess(grain.transforms.Map):
  """A Grain map from a batch of rows to ``(preprocessed, stats, rest)``.

  ``map(rows)`` takes one local batch: a ``pyarrow.Table`` or ``RecordBatch``
  (from :class:`ParquetBatches`), or a list of Grain's per-row dicts (see
  :func:`ragged_batch`). Each feature is read from the column named after the
  feature (``spec.name``), its weights from ``weights[feature]`` if given.
  ``preprocessed`` and ``stats`` are what
  :func:`~sparsecore_prep.preprocess_sparse_dense_matmul_input` returns for the
  same rows as ragged numpy features; ``rest`` maps every other column to a
  numpy array (labels, dense features).

  The features' columns go to the native Arrow reader in place. Its plan comes
  from a config derived from the specs, which is trusted only after it gave the
  drop-in's exact result on a random batch of the same size (checked once per
  batch size and process); otherwise, and for specs our config format cannot
  express, the columns become per-sample numpy views and go through the drop-in
  call itself. ``arrow_native(batch_size)`` tells which.

  Thread-safe: every thread that calls ``map`` (Grain reads with 16) gets its
  own native preprocessor. It pickles small (a copy of the specs' preprocessing
  attributes, the config), so Grain workers rebuild it.

  Args:
    feature_specs_or_config: the reference's feature specs (a pytree, after
      ``prepare_feature_specs_for_training`` or ``auto_stack_tables``; read
      once, here: build the stage after tuning), or our JSON config (dict,
      text or path), as :class:`~sparsecore_prep.Preprocessor` takes it.
    weights: ``{feature: column}`` of ``List<Float32>`` (or ``Float64``)
      weights; features without an entry have weight 1.
    local_device_count, global_device_count, num_sc_per_device,
    sharding_strategy, has_leading_dimension, allow_id_dropping,
    enable_minibatching, validate_ids: the drop-in call's options (with specs;
      a config holds its own).
    all_reduce_interface: multi-host minibatching's collective, as for the
      drop-in call. It stays in the process that made this stage (it does not
      pickle): with minibatching across hosts, run the stage in each host's
      main process (``mp_prefetch`` with 0 workers, or no ``mp_prefetch``);
      in a worker process it raises :class:`~sparsecore_prep.ConfigError`.
      The hosts exchange step after step, so each host preprocesses one batch
      at a time, in step order: read with one thread
      (``grain.ReadOptions(num_threads=1)``; two calls at once raise
      ``ConfigError``). The ``batch_number`` is the batch's step in
      :class:`ParquetBatches`, the same on every host.
    threads: the native preprocessors' threads (see
      :class:`~sparsecore_prep.Preprocessor`; default the shared pool; with an
      ``all_reduce_interface``, 1).

  Raises (from ``map``): the drop-in call's exceptions, with the batch's files
  and rows in the message when it came from :class:`ParquetBatches`;
  :class:`~sparsecore_prep.InvalidInputError` for a missing feature or weights
  column and :class:`~sparsecore_prep.InputTypeError` for one of another type,
  naming the column.
  """

  def __init__(self, feature_specs_or_config, *, weights: Mapping[str, str] | None = None, threads: int | None = None,
               **drop_in_options):
    self._init_local()
    unknown = sorted(set(drop_in_options) - set(_DROP_IN_OPTIONS))
    if unknown:
      raise ConfigError(f"Preprocess got unknown option(s) {', '.join(unknown)} (known: {', '.join(_DROP_IN_OPTIONS)})",
                        field=unknown[0])
    weights = {str(k): str(v) for k, v in (weights or {}).items()}
    self._ari = drop_in_options.pop("all_reduce_interface", None)
    self._leading = bool(drop_in_options.pop("has_leading_dimension", False))
    self._threads = 1 if self._ari is not None and threads is None else threads
    if _is_config(feature_specs_or_config):
      if set(drop_in_options) - {"validate_ids"}:
        raise ConfigError("with a config, the options are the config's: pass only weights, threads, "
                          "has_leading_dimension and all_reduce_interface", field=sorted(drop_in_options)[0])
      config = Preprocessor(feature_specs_or_config).config
      if "validate_ids" in drop_in_options:
        config["config"]["validate_ids"] = bool(drop_in_options["validate_ids"])
      for f in config["features"]:
        if f["name"] in weights:
          f["weights_column"] = weights[f["name"]]
        f.setdefault("column", f["name"])
        if f.get("column") is None:
          f["column"] = f["name"]
      self._specs = None
      self._options = dict(config["config"])
      self._config = json.dumps(config)
      self._features = [(f["name"], f["column"], f.get("weights_column")) for f in config["features"]]
      self._verified = {}
    else:
      for k in ("local_device_count", "global_device_count", "num_sc_per_device"):
        if k not in drop_in_options:
          raise ConfigError(f"Preprocess with feature specs needs {k}=", field=k)
      leaves, _ = _leaves_and_structure(feature_specs_or_config)
      _spec_tuples(leaves, feature_specs_or_config)  # FeatureSpecError naming a spec's missing attribute
      self._specs = [_portable(s) for s in leaves]
      names = [str(s.name) for s in self._specs]
      stray = sorted(set(weights) - set(names))
      if stray:
        raise ConfigError(f"weights name feature(s) {', '.join(stray)} that the specs do not have", field="weights")
      self._options = dict(drop_in_options)
      self._options.setdefault("sharding_strategy", "MOD")
      self._features = [(n, n, weights.get(n)) for n in names]
      config = _config_from_specs(self._specs, weights, self._options)
      self._config = None if config is None else json.dumps(config)
      self._verified = {}
      batch = self._spec_batch()
      if self._config is not None and batch is not None:
        self._verify(batch)
    self._minibatching = bool(self._options.get("enable_minibatching", False))
    self._multi_host = (self._minibatching and int(self._options["global_device_count"]) >
                        int(self._options["local_device_count"]))
    self._columns = {c for _, c, w in self._features for c in (c, w) if c is not None}

  def _init_local(self):
    self._local = threading.local()
    self._lock = threading.Lock()
    self._exchange = threading.Lock()

  def _spec_batch(self) -> int | None:
    """The local batch the specs' output shapes say, if they all say the same."""
    sizes = set()
    for s in self._specs:
      if not s.output_shape:
        return None
      dims = s.output_shape
      g = math.prod(dims[:-1]) if len(dims) > 1 else dims[0]
      sizes.add(g * int(self._options["local_device_count"]) // int(self._options["global_device_count"]))
    return sizes.pop() if len(sizes) == 1 else None

  # -- the check of the derived config against the drop-in call ------------------------------

  def arrow_native(self, batch_size: int) -> bool:
    """Whether batches of ``batch_size`` rows take the native Arrow path (else the drop-in call)."""
    if self._specs is None:
      return True
    if self._config is None:
      return False
    ok = self._verified.get(batch_size)
    if ok is None:
      ok = self._verify(batch_size)
    return ok

  def _verify(self, n: int) -> bool:
    rng = np.random.default_rng(n)
    columns = {}
    for s, (name, column, wcol) in zip(self._specs, self._features):
      lengths = rng.integers(0, 4, n)
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
      ids = rng.integers(0, int(s.table_spec.vocabulary_size), int(offsets[-1])).astype(np.int32)
      columns[column] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
      if wcol is not None:
        w = (rng.integers(1, 64, int(offsets[-1])) / 16).astype(np.float32)
        columns[wcol] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(w))
    table = pa.table(columns)
    probe = json.loads(self._config)
    probe["config"].update(allow_id_dropping=True, enable_minibatching=False)
    try:
      ours = Preprocessor(probe, threads=1)(table)
      theirs = self._drop_in(table, {"allow_id_dropping": True, "enable_minibatching": False}, 0)
      ok = _same_result(ours, theirs)
    except SparseCorePrepError:
      ok = False
    with self._lock:
      self._verified[n] = ok
    return ok

  # -- the two paths --------------------------------------------------------------------------

  def _preprocessor(self) -> Preprocessor:
    prep = getattr(self._local, "prep", None)
    if prep is None:
      prep = self._local.prep = Preprocessor(self._config, threads=self._threads,
                                             has_leading_dimension=self._leading,
                                             all_reduce_interface=self._ari if self._multi_host else None)
    return prep

  def _drop_in(self, table: pa.Table, override: Mapping[str, Any], batch_number: int):
    features, weights = [], []
    any_weights = any(w is not None for _, _, w in self._features)
    for _, column, wcol in self._features:
      col = table.column(column)
      ids, offsets = _flat(col)
      features.append(_rows(ids, offsets))
      if any_weights:
        if wcol is None:
          weights.append(_rows(np.ones(len(ids), np.float32), offsets))
        else:
          w, _ = _flat(table.column(wcol))
          weights.append(_rows(w, offsets))
    opts = {k: v for k, v in self._options.items() if k in _DROP_IN_OPTIONS}
    opts.update(override)
    L, G, S = opts.pop("local_device_count"), opts.pop("global_device_count"), opts.pop("num_sc_per_device")
    ari = self._ari if opts.get("enable_minibatching") else None
    return preprocess_sparse_dense_matmul_input(features, weights if any_weights else None, self._specs, L, G, S,
                                                has_leading_dimension=self._leading, batch_number=batch_number,
                                                all_reduce_interface=ari, **opts)

  def _table(self, rows):
    if isinstance(rows, pa.RecordBatch):
      return pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
      return rows
    if isinstance(rows, (list, tuple)):
      return ragged_batch(rows)
    if hasattr(rows, "__arrow_c_stream__") or hasattr(rows, "__arrow_c_array__"):
      return pa.table(rows)
    raise InputTypeError(f"Preprocess takes a pyarrow Table or RecordBatch or a list of per-row dicts, "
                         f"got {type(rows).__name__}")

  def _checked(self, table: pa.Table, where: str) -> pa.Table:
    """The feature and weights columns, present and of usable types (other integer and float
    widths cast, as the drop-in call converts them)."""
    cols = {}
    for name, column, wcol in self._features:
      for c, what in ((column, "ids"), (wcol, "weights")):
        if c is None or c in cols:
          continue
        i = table.schema.get_field_index(c)
        if i < 0:
          raise InvalidInputError(f"{where}feature `{name}`: no column `{c}` for its {what} (columns: "
                                  f"{', '.join(table.column_names)})", feature=name)
        arr = table.column(i)
        t = arr.type
        if what == "ids":
          if not _list_type_ok(t, pa.types.is_integer):
            raise InputTypeError(f"{where}feature `{name}`: column `{c}` is {t}, not a list of integer ids",
                                 feature=name, column=c)
          if t.value_type not in (pa.int32(), pa.int64()):
            arr = _cast_values(arr, pa.int64(), name, c, where)
        else:
          if not _list_type_ok(t, pa.types.is_floating):
            raise InputTypeError(f"{where}feature `{name}`: weights column `{c}` is {t}, not a list of floats",
                                 feature=name, column=c)
          if t.value_type != pa.float32():
            arr = _cast_values(arr, pa.float32(), name, c, where)
        cols[c] = arr
    return pa.table(cols)

  def map(self, rows):
    """``(preprocessed, stats, rest)`` for one local batch (see the class)."""
    table = self._table(rows)
    origin = _origin(table)
    where = _where(origin)
    step = origin["step"] if origin else 0
    try:
      if self._multi_host and self._ari is None:
        raise ConfigError(
            "minibatching across hosts (enable_minibatching, global_device_count > local_device_count) needs the "
            "hosts' all_reduce_interface in the process that preprocesses; this Preprocess was pickled into "
            "another process (a Grain worker: mp_prefetch with num_workers > 0) and its interface stayed behind. "
            "Run it in each host's main process (num_workers=0) with all_reduce_interface=...",
            field="all_reduce_interface")
      features = self._checked(table, where)
      if self._multi_host:
        # The hosts exchange step after step, in one order: two steps in flight on one host would
        # each wait for a peer that is waiting for the other.
        if not self._exchange.acquire(blocking=False):
          raise ConfigError(
              "minibatching across hosts preprocesses one batch at a time per host, in step order, but two "
              "threads called this Preprocess at once: read with one thread, "
              "to_iter_dataset(grain.ReadOptions(num_threads=1))", field="all_reduce_interface")
        try:
          preprocessed, stats = self._run(features, table.num_rows, step)
        finally:
          self._exchange.release()
      else:
        preprocessed, stats = self._run(features, table.num_rows, step)
    except SparseCorePrepError as e:
      if not where:
        raise
      raise type(e)(where + e.message, **e.field_values()) from None
    rest = {name: _to_numpy(table.column(name)) for name in table.column_names if name not in self._columns}
    return preprocessed, stats, rest

  def _run(self, features: pa.Table, rows: int, step: int):
    if self.arrow_native(rows):
      prep = self._preprocessor()
      if self._minibatching:
        prep.set_batch_number(step)
      return prep(features)
    return self._drop_in(features, {}, step)

  def fdo_stats(self, rows) -> FdoStats:
    """The FDO statistics of one batch, without building buffers where the native Arrow path
    applies; limits are measured, not enforced."""
    table = self._table(rows)
    where = _where(_origin(table))
    try:
      features = self._checked(table, where)
      if self.arrow_native(table.num_rows):
        return self._preprocessor().fdo_stats(features)
      _, stats = self._drop_in(features, {"allow_id_dropping": True, "enable_minibatching": False}, 0)
    except SparseCorePrepError as e:
      if not where:
        raise
      raise type(e)(where + e.message, **e.field_values()) from None
    o = self._options
    return FdoStats.from_json(json.dumps({
        "version": 1,
        "layout": {k: int(o[k]) for k in ("local_device_count", "global_device_count", "num_sc_per_device")},
        "batches": 1,
        "stacks": {s: {"max_ids_per_partition": np.asarray(stats.max_ids_per_partition[s]).ravel().tolist(),
                       "max_unique_ids_per_partition":
                           np.asarray(stats.max_unique_ids_per_partition[s]).ravel().tolist(),
                       "required_buffer_size_per_sc": np.asarray(stats.required_buffer_size_per_sc[s]).ravel().tolist(),
                       "dropped_id_count": int(stats.id_drop_counters[s])}
                   for s in stats.max_ids_per_partition}}))

  def __getstate__(self):
    state = {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "_exchange", "_ari")}
    state["_ari"] = None  # a socket or a connection: it stays in this process
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_local()

  def __repr__(self) -> str:
    kind = "config" if self._specs is None else "feature specs"
    return f"Preprocess({len(self._features)} features from {kind})"


def _is_config(x) -> bool:
  if isinstance(x, Mapping):
    return "config" in x and "features" in x
  return isinstance(x, (str, os.PathLike))


def _cast_values(arr, value_type, name, column, where):
  target = pa.large_list(value_type) if pa.types.is_large_list(arr.type) else pa.list_(value_type)
  try:
    return arr.cast(target)
  except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
    raise InvalidInputError(f"{where}feature `{name}`: column `{column}` does not convert to {target} ({e})",
                            feature=name) from None


def _flat(col):
  """A list column's flat values and offsets, as numpy (one copy only when it has several chunks)."""
  arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
  offsets = arr.offsets.to_numpy()
  values = arr.values.to_numpy(zero_copy_only=False)
  return values, offsets


def _rows(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """Per-sample views of one flat array (the drop-in call reads such rows in place)."""
  out = np.empty(len(offsets) - 1, dtype=object)
  out[:] = [values[a:z] for a, z in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
  return out


def _to_numpy(col) -> np.ndarray:
  try:
    return col.to_numpy()
  except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
    return np.asarray(col.to_pylist(), dtype=object)


# ---------------------------------------------------------------------------------------------
# tune
# ---------------------------------------------------------------------------------------------


def _ceil(x: float) -> int:
  return int(math.ceil(round(x, 6)))


def tune(paths, feature_specs, *, headroom: float = 1.1, sample: int | None = None, batch_size: int | None = None,
         weights: Mapping[str, str] | None = None, workers: int | None = None, **drop_in_options):
  """Measures the files' FDO statistics and updates the specs' limits and buffer sizes.

  Every batch of ``batch_size`` rows (default: the specs' local batch) of the
  files (see :class:`ParquetBatches`), or ``sample`` of them spread evenly, is
  measured on ``workers`` threads (default: one per CPU) without building
  buffers. Then each stack's ``stacked_table_spec`` gets, as the reference's
  ``embedding.update_preprocessing_parameters`` sets them from the merged stats:
  ``max_ids_per_partition`` and ``max_unique_ids_per_partition`` = the
  observed maximum times ``headroom``, rounded up; and
  ``suggested_coo_buffer_size_per_device`` = S times the largest SparseCore's
  required buffer times ``headroom``, rounded up to 8 (and kept at most the
  buffer the new limits allow). With ``headroom=1.0`` the values are exactly
  the reference's. Limits stay at least 1 (a stack that received no ids).

  The specs are updated in place (dataclasses are replaced as the reference
  does); the keyword options are the drop-in call's (``local_device_count``,
  ``global_device_count``, ``num_sc_per_device``, ...).

  Returns:
    The merged stats, as ``SparseDenseMatmulInputStats`` (per stack arrays;
    ``id_drop_counters`` what the old limits would have dropped).
  """
  if not headroom >= 1.0:
    raise ConfigError(f"headroom {headroom} must be at least 1.0", field="headroom")
  drop_in_options = dict(drop_in_options, allow_id_dropping=True, enable_minibatching=False)
  stage = Preprocess(feature_specs, weights=weights, threads=1, **drop_in_options)
  if batch_size is None:
    batch_size = stage._spec_batch()
    if batch_size is None:
      raise ConfigError("tune: the specs' output shapes do not give one local batch size; pass batch_size=",
                        field="batch_size")
  source = ParquetBatches(paths, batch_size, columns=sorted(stage._columns))
  indices = range(len(source))
  if sample is not None and sample < len(source):
    indices = sorted(set(np.linspace(0, len(source) - 1, max(1, int(sample))).round().astype(int).tolist()))
  if not len(indices):
    raise DataSourceError(f"tune: {source!r} holds no batch of {batch_size} rows", path=source.paths[0])
  with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
    merged = FdoStats.merge_all(pool.map(lambda i: stage.fdo_stats(source[i]), indices))
  d = merged.to_dict()
  stats = SparseDenseMatmulInputStats(
      max_ids_per_partition={s: np.asarray(v["max_ids_per_partition"], np.int32) for s, v in d["stacks"].items()},
      max_unique_ids_per_partition={s: np.asarray(v["max_unique_ids_per_partition"], np.int32)
                                    for s, v in d["stacks"].items()},
      required_buffer_size_per_sc={s: np.asarray(v["required_buffer_size_per_sc"], np.int32)
                                   for s, v in d["stacks"].items()},
      id_drop_counters={s: int(v["dropped_id_count"]) for s, v in d["stacks"].items()})
  _update_specs(feature_specs, stats, int(drop_in_options["num_sc_per_device"]),
                int(drop_in_options["global_device_count"]), float(headroom))
  return stats


def _update_specs(feature_specs, stats, S: int, G: int, headroom: float) -> None:
  leaves, _ = _leaves_and_structure(feature_specs)
  n = G * S
  for spec in leaves:
    table = spec.table_spec
    stacked = table.stacked_table_spec
    stack = getattr(stacked, "stack_name", None) or table.setting_in_stack.stack_name
    if stack not in stats.max_ids_per_partition:
      continue
    max_ids = max(1, _ceil(int(np.max(stats.max_ids_per_partition[stack])) * headroom))
    max_unique = max(1, _ceil(int(np.max(stats.max_unique_ids_per_partition[stack])) * headroom))
    buffer = stacked.suggested_coo_buffer_size_per_device
    required = stats.required_buffer_size_per_sc.get(stack)
    if required is not None and np.size(required):
      per_sc = _ceil(int(np.max(required)) * headroom)
      buffer = max(8, -(-per_sc // 8) * 8) * S
      buffer = min(buffer, -(-max_ids // 8) * 8 * S * n)  # the most the new limits let a device need
    values = {"max_ids_per_partition": max_ids, "max_unique_ids_per_partition": max_unique,
              "suggested_coo_buffer_size_per_device": buffer}
    if dataclasses.is_dataclass(stacked) and not isinstance(stacked, type):
      table.stacked_table_spec = dataclasses.replace(stacked, **values)
    else:
      for k, v in values.items():
        setattr(stacked, k, v)


for _obj in (DataSourceError,):
  _obj.__module__ = "sparsecore_prep.grain"
del _obj
