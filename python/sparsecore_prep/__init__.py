"""sparsecore_prep: SparseCore input preprocessing in Rust, for Python.

Three entry points:

* :func:`preprocess_sparse_dense_matmul_input` is a drop-in replacement for
  ``jax_tpu_embedding.sparsecore.lib.nn.embedding.preprocess_sparse_dense_matmul_input``:
  the same arguments (numpy dense or ragged features, the reference's own
  ``FeatureSpec`` objects after ``prepare_feature_specs_for_training`` or
  ``auto_stack_tables``), the same result structure and values, and Python
  exceptions where the reference aborts the process;
  :func:`preprocess_sparse_dense_matmul_input_from_sparse_tensor` is the same
  for the reference's sparse COO entry point (``tf.SparseTensor``-like input).
* :class:`Preprocessor` takes our JSON config and Arrow record batches (any
  producer of ``__arrow_c_array__`` / ``__arrow_c_stream__``, read without
  copies). It pickles through its config, so it ships to Ray Data and Spark
  workers.
* :class:`FdoStats` merges per-batch FDO statistics from any number of
  workers and tunes a config from them; :class:`FdoStatsMapper` is the
  :class:`Preprocessor` shaped for ``ray.data.Dataset.map_batches``.
* Multi-host minibatching: both take an ``all_reduce_interface`` from
  :func:`get_all_reduce_interface` (the reference's signature; our
  authenticated TCP all-reduce), :class:`JaxDistributedAllReduce` (over the
  ``jax.distributed`` coordination service), or any object with
  ``all_reduce_or(sync_key, value) -> int`` (:class:`AllReduceInterface`).

The heavy lifting runs in the Rust crate ``sparsecore-prep`` with the GIL
released. Errors are the picklable exceptions of :mod:`sparsecore_prep._errors`
(:class:`ConfigError`, :class:`InvalidInputError`, :class:`LimitExceededError`,
:class:`InputTypeError`, :class:`FeatureSpecError`, all
:class:`SparseCorePrepError`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import sys
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np

from ._errors import (
    ConfigError,
    FeatureSpecError,
    InputTypeError,
    InvalidInputError,
    LimitExceededError,
    SparseCorePrepError,
)
from . import _native
from ._allreduce import (
    AllReduceError,
    AllReduceInterface,
    JaxDistributedAllReduce,
    TcpAllReduce,
    get_all_reduce_interface,
)

__all__ = [
    "AllReduceError",
    "AllReduceInterface",
    "ConfigError",
    "FdoStats",
    "FdoStatsMapper",
    "FeatureSpecError",
    "InputTypeError",
    "InvalidInputError",
    "JaxDistributedAllReduce",
    "LimitExceededError",
    "PreprocessedInput",
    "Preprocessor",
    "SparseCorePrepError",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "TcpAllReduce",
    "get_all_reduce_interface",
    "preprocess_sparse_dense_matmul_input",
    "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
]

__version__ = _native.__version__

_REFERENCE_EMBEDDING = "jax_tpu_embedding.sparsecore.lib.nn.embedding"


# -----------------------------------------------------------------------------
# Result types (the reference's field names)
# -----------------------------------------------------------------------------


class SparseDenseMatmulInput(NamedTuple):
  """Per-stack CSR-wrapped COO buffers, keyed by stack name.

  Same fields as the reference's class of this name. Without a leading
  dimension each array is 1-D (``L * RP`` row pointers, ``L * C`` entries);
  with it, ``[L, RP]`` and ``[L, C]``.
  """

  lhs_row_pointers: Mapping[str, np.ndarray]
  lhs_embedding_ids: Mapping[str, np.ndarray]
  lhs_sample_ids: Mapping[str, np.ndarray]
  lhs_gains: Mapping[str, np.ndarray]


@dataclasses.dataclass
class SparseDenseMatmulInputStats:
  """FDO statistics of one call, per stack (the reference's field names).

  ``max_ids_per_partition`` and ``max_unique_ids_per_partition`` are int32
  arrays of ``L * N`` (device-major), ``required_buffer_size_per_sc`` int32
  arrays of ``L * S``, ``id_drop_counters`` ints.
  """

  max_ids_per_partition: dict[str, np.ndarray]
  max_unique_ids_per_partition: dict[str, np.ndarray]
  required_buffer_size_per_sc: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  id_drop_counters: dict[str, int] = dataclasses.field(default_factory=dict)

  def get_required_buffer_size_per_device(self, table_name: str, num_sc_per_device: int | None = None) -> int | None:
    """The buffer a device needs for ``table_name``: max over its SparseCores times S."""
    if table_name not in self.required_buffer_size_per_sc:
      return None
    val = self.required_buffer_size_per_sc[table_name]
    return int(np.max(val) * (num_sc_per_device or np.size(val)))


@dataclasses.dataclass
class PreprocessedInput:
  """The buffers and the number of minibatches (``np.full(L, M)``).

  The ``lhs_*`` properties forward to :attr:`sparse_dense_matmul_input`, as
  the reference's class does.
  """

  sparse_dense_matmul_input: SparseDenseMatmulInput
  num_minibatches: np.ndarray

  @property
  def lhs_row_pointers(self) -> Mapping[str, np.ndarray]:
    """Row pointers per stack."""
    return self.sparse_dense_matmul_input.lhs_row_pointers

  @property
  def lhs_embedding_ids(self) -> Mapping[str, np.ndarray]:
    """Shard-local embedding rows per stack."""
    return self.sparse_dense_matmul_input.lhs_embedding_ids

  @property
  def lhs_sample_ids(self) -> Mapping[str, np.ndarray]:
    """SparseCore-local sample ids per stack."""
    return self.sparse_dense_matmul_input.lhs_sample_ids

  @property
  def lhs_gains(self) -> Mapping[str, np.ndarray]:
    """Combined gains per stack."""
    return self.sparse_dense_matmul_input.lhs_gains


def _result_types():
  """The reference's own result classes when it is already imported, else ours.

  Returning its classes (a flax PyTreeNode among them) lets the result flow
  unchanged into ``tpu_sparse_dense_matmul`` under ``jax.jit``; the reference
  is never imported on our behalf (importing jax takes seconds).
  """
  ref = sys.modules.get(_REFERENCE_EMBEDDING)
  if ref is not None:
    try:
      return ref.SparseDenseMatmulInput, ref.PreprocessedInput, ref.SparseDenseMatmulInputStats
    except AttributeError:
      pass
  return SparseDenseMatmulInput, PreprocessedInput, SparseDenseMatmulInputStats


def _wrap(raw, local_device_count: int, has_leading_dimension: bool, minibatches_dtype=np.int64):
  rp, eid, sid, gains, num_minibatches, (max_ids, max_unique, required, dropped) = raw
  matmul_input, preprocessed, stats_type = _result_types()
  # int64 as the reference's NumPy path makes it, int32 on its sparse COO path.
  minibatches = np.full(local_device_count, num_minibatches, dtype=minibatches_dtype)
  if has_leading_dimension:
    minibatches = minibatches.reshape(local_device_count, 1)
  return (
      preprocessed(matmul_input(rp, eid, sid, gains), minibatches),
      stats_type(max_ids, max_unique, required, dropped),
  )


# -----------------------------------------------------------------------------
# Pytrees (dicts by sorted key, lists and tuples in order, None empty), as
# jax.tree.leaves flattens them; jax itself is used when it is already loaded.
# -----------------------------------------------------------------------------


def _flatten(tree, path=(), out=None):
  if out is None:
    out = []
  if tree is None:
    return out
  if isinstance(tree, Mapping):
    for k in sorted(tree):
      _flatten(tree[k], path + (k,), out)
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      _flatten(v, path + (i,), out)
  else:
    out.append((path, tree))
  return out


def _leaves_with_paths(tree):
  jax = sys.modules.get("jax")
  if jax is not None:
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    return [p for p, _ in pairs], [v for _, v in pairs]
  pairs = _flatten(tree)
  return [p for p, _ in pairs], [v for _, v in pairs]


def _leaves_and_structure(tree):
  """The leaves, and a structure to compare: jax's treedef when jax is loaded (flattening
  without key paths is several times faster), else the paths."""
  jax = sys.modules.get("jax")
  if jax is not None:
    return jax.tree_util.tree_flatten(tree)
  pairs = _flatten(tree)
  return [v for _, v in pairs], [p for p, _ in pairs]


def _check_structure(a, a_struct, b, b_struct, a_name: str, b_name: str) -> None:
  """Raises unless trees `a` and `b` have leaves at the same paths. Equal structures pass at
  once; otherwise the paths decide (a list and a tuple with the same indices still match)."""
  if a_struct != b_struct:
    _same_structure(_leaves_with_paths(a)[0], _leaves_with_paths(b)[0], a_name, b_name)


def _same_structure(a_paths, b_paths, a_name: str, b_name: str) -> None:
  if a_paths != b_paths:
    raise InvalidInputError(
        f"Pytree structures of {a_name} and {b_name} do not match.\n"
        f"{a_name}: {len(a_paths)} leaves at {a_paths[:8]}{'...' if len(a_paths) > 8 else ''}\n"
        f"{b_name}: {len(b_paths)} leaves at {b_paths[:8]}{'...' if len(b_paths) > 8 else ''}")


# -----------------------------------------------------------------------------
# FeatureSpecs, read by duck typing (SPEC Part 2, section 2.6)
# -----------------------------------------------------------------------------

# What a feature spec must have (python/README.md, "Feature specs", lists the same).
_SPEC_HELP = (
    "a feature spec needs `name`, `table_spec.name`, `table_spec.vocabulary_size`, "
    "`table_spec.setting_in_stack.stack_name` and `table_spec.stacked_table_spec.combiner`, "
    "`.max_ids_per_partition`, `.max_unique_ids_per_partition` and `.suggested_coo_buffer_size_per_device` "
    "(None allowed); optional: `_id_transformation` (`row_offset`, `col_offset`, `col_shift`), "
    "`table_spec.embedding_dim`, `output_shape` or `input_shape` (see python/README.md, \"Feature specs\")")

_REQUIRED = object()


class _SpecProblem(Exception):
  """An attribute of a feature spec that is missing or unusable (turned into FeatureSpecError)."""

  def __init__(self, attribute: str, problem: str):
    super().__init__(attribute, problem)
    self.attribute, self.problem = attribute, problem


def _attr(obj, dotted: str, default=_REQUIRED):
  """`obj.a.b.c` for `dotted` "a.b.c"; `default` if a part is missing (or _SpecProblem)."""
  value = obj
  for part in dotted.split("."):
    try:
      value = getattr(value, part)
    except AttributeError:
      if default is _REQUIRED:
        raise _SpecProblem(dotted, "is missing") from None
      return default
  return value


def _count(value, dotted: str) -> int:
  """A non-negative integer (ints and numpy integers; a float is an error, not truncated)."""
  try:
    n = operator.index(value)
  except TypeError:
    raise _SpecProblem(dotted, f"is {value!r}, not an integer") from None
  if n < 0:
    raise _SpecProblem(dotted, f"is {n}, must not be negative")
  return n


def _spec_tuple(spec) -> tuple:
  """What preprocessing reads of one FeatureSpec, as the native call takes it (_SpecProblem if
  an attribute is missing or unusable)."""
  stacked = "table_spec.stacked_table_spec"
  path = "_id_transformation"
  if _attr(spec, path, None) is None:
    path = "id_transformation"
  row_offset = col_offset = col_shift = 0
  if _attr(spec, path, None) is not None:
    row_offset, col_offset, col_shift = (_count(_attr(spec, f"{path}.{a}"), f"{path}.{a}")
                                         for a in ("row_offset", "col_offset", "col_shift"))
  shape_path = "output_shape"
  if _attr(spec, shape_path, None) is None:
    shape_path = "input_shape"
  shape = _attr(spec, shape_path, None)
  global_batch = 0
  if shape is not None:
    try:
      dims = [_count(d, shape_path) for d in shape]
    except TypeError:
      raise _SpecProblem(shape_path, f"is {shape!r}, not a sequence of integers") from None
    global_batch = math.prod(dims[:-1]) if len(dims) > 1 else (dims[0] if dims else 0)
  dim = _attr(spec, "table_spec.embedding_dim", None)
  suggested = _attr(spec, f"{stacked}.suggested_coo_buffer_size_per_device")
  return (
      (
          str(_attr(spec, "name")),
          str(_attr(spec, "table_spec.name")),
          _count(_attr(spec, "table_spec.vocabulary_size"), "table_spec.vocabulary_size"),
          0 if dim is None else _count(dim, "table_spec.embedding_dim"),
          global_batch,
      ),
      (str(_attr(spec, "table_spec.setting_in_stack.stack_name")), row_offset, col_offset, col_shift),
      (
          str(_attr(spec, f"{stacked}.combiner")),
          _count(_attr(spec, f"{stacked}.max_ids_per_partition"), f"{stacked}.max_ids_per_partition"),
          _count(_attr(spec, f"{stacked}.max_unique_ids_per_partition"), f"{stacked}.max_unique_ids_per_partition"),
          None if suggested is None else _count(suggested, f"{stacked}.suggested_coo_buffer_size_per_device"),
      ),
  )


def _nonneg(value) -> int:
  n = operator.index(value)
  if n < 0:
    raise ValueError(n)
  return n


def _spec_tuple_fast(spec) -> tuple:
  """_spec_tuple by plain attribute access (it runs for every feature of every call); any
  problem makes _spec_tuples ask _spec_tuple, which names it."""
  table = spec.table_spec
  stacked = table.stacked_table_spec
  transform = getattr(spec, "_id_transformation", None)
  if transform is None:
    transform = getattr(spec, "id_transformation", None)
  offsets = (0, 0, 0) if transform is None else (
      _nonneg(transform.row_offset), _nonneg(transform.col_offset), _nonneg(transform.col_shift))
  shape = getattr(spec, "output_shape", None)
  if shape is None:
    shape = getattr(spec, "input_shape", None)
  global_batch = 0
  if shape is not None:
    dims = [_nonneg(d) for d in shape]
    global_batch = math.prod(dims[:-1]) if len(dims) > 1 else (dims[0] if dims else 0)
  dim = getattr(table, "embedding_dim", None)
  suggested = stacked.suggested_coo_buffer_size_per_device
  return (
      (str(spec.name), str(table.name), _nonneg(table.vocabulary_size), 0 if dim is None else _nonneg(dim),
       global_batch),
      (str(table.setting_in_stack.stack_name),) + offsets,
      (str(stacked.combiner), _nonneg(stacked.max_ids_per_partition), _nonneg(stacked.max_unique_ids_per_partition),
       None if suggested is None else _nonneg(suggested)),
  )


def _leaf_path(tree, i: int) -> str:
  """`feature_specs['f']`-style path of leaf `i` of `tree`, for messages."""
  try:
    paths, _ = _leaves_with_paths(tree)
    path = paths[i]
    jax = sys.modules.get("jax")
    if jax is not None:
      return "feature_specs" + jax.tree_util.keystr(path)
    return "feature_specs" + "".join(f"[{k!r}]" for k in path)
  except Exception:  # a message must not fail: fall back to the leaf's position
    return f"feature_specs leaf {i}"


def _spec_tuples(leaves, tree) -> list:
  """The spec tuples of all leaves; FeatureSpecError names the spec and the attribute."""
  out = []
  for i, spec in enumerate(leaves):
    try:
      try:
        out.append(_spec_tuple_fast(spec))
      except (AttributeError, TypeError, ValueError):
        out.append(_spec_tuple(spec))  # raises _SpecProblem, naming the attribute
    except _SpecProblem as e:
      where = _leaf_path(tree, i)
      name = getattr(spec, "name", None)
      feature = str(name) if name is not None else where
      label = f"{where} (feature `{name}`)" if name is not None else where
      raise FeatureSpecError(f"{label}: `{e.attribute}` {e.problem}; {_SPEC_HELP}", feature=feature,
                             attribute=e.attribute) from None
  return out


_INT_IDS = (np.dtype(np.int32), np.dtype(np.int64))
_INT64_MAX = int(np.iinfo(np.int64).max)


def _reject_beyond_int64(ids: np.ndarray, row_of, spec: tuple) -> None:
  """uint64 ids of 2**63 and more have no int64 equivalent: InvalidInputError for the first,
  naming the feature, its row and the id exactly as given."""
  beyond = np.flatnonzero(ids > _INT64_MAX)
  if beyond.size:
    k = int(beyond[0])
    name, table, vocab = spec[0][0], spec[0][1], spec[0][2]
    row, bad = int(row_of(k)), int(ids[k])
    raise InvalidInputError(
        f"feature `{name}` (table `{table}`), sample row {row}: id {bad} is outside [0, vocabulary_size {vocab})",
        feature=name, row=row, id=bad)


def _feature_leaf(leaf, spec: tuple):
  """Dense leaves become int32/int64 arrays (other integer types are widened, exactly)."""
  if not isinstance(leaf, np.ndarray):
    leaf = np.asarray(leaf)
  if leaf.ndim == 2 and leaf.dtype not in _INT_IDS:
    name = spec[0][0]
    if leaf.dtype.kind not in "iu":
      raise InputTypeError(f"feature `{name}`: ids must be integers, got dtype {leaf.dtype}", feature=name)
    if leaf.dtype == np.uint64 and leaf.size:
      width = leaf.shape[1]
      _reject_beyond_int64(leaf.ravel(), lambda k: k // width, spec)
    leaf = leaf.astype(np.int64)
  return leaf


def _weights_leaf(leaf):
  if not isinstance(leaf, np.ndarray):
    leaf = np.asarray(leaf)
  if leaf.ndim == 2 and leaf.dtype != np.float32:
    leaf = leaf.astype(np.float32)  # the reference force-casts dense weights to float32
  return leaf


def _check_options(sharding_strategy, num_sc_per_device) -> None:
  if not isinstance(sharding_strategy, str) or sharding_strategy.upper() != "MOD":
    raise ConfigError(f"Unsupported sharding strategy: {sharding_strategy}. Only MOD is supported.",
                      field="sharding_strategy")
  if num_sc_per_device is None:
    raise ConfigError("num_sc_per_device must be given (there is no TPU to detect it from)", field="num_sc_per_device")
  # The reference's Python functions take only the SparseCore counts of the TPUs it knows (2 and
  # 4), with this message; its C++ layer, and `Preprocessor` here, take any power of two.
  if num_sc_per_device not in _REFERENCE_SC_PER_DEVICE:
    raise ConfigError(f"Invalid num_sc_per_device: {num_sc_per_device}", field="num_sc_per_device")


# SparseCores per device of the TPUs the reference knows (v5p: 4; v6e and 7x: 2).
_REFERENCE_SC_PER_DEVICE = (2, 4)


def _run_native(specs, local_device_count, global_device_count, num_sc_per_device, sharding_strategy,
                allow_id_dropping, enable_minibatching, validate_ids, run, multi_host=False):
  """`run(native)` on the cached native state for these specs and options (`multi_host`: the
  call passes an all_reduce_interface, which the native state takes per call)."""
  key = (tuple(specs), int(local_device_count), int(global_device_count), int(num_sc_per_device), sharding_strategy,
         bool(allow_id_dropping), bool(enable_minibatching), bool(validate_ids), bool(multi_host))
  # Taken out of the cache for the call, so that concurrent calls never share one.
  native = _DROP_IN_CACHE.pop(key, None)
  if native is None:
    native = _native.NativeDropIn(specs, *key[1:])
  try:
    return run(native)
  finally:
    _DROP_IN_CACHE[key] = native
    while len(_DROP_IN_CACHE) > _DROP_IN_CACHE_SIZE:
      _DROP_IN_CACHE.pop(next(iter(_DROP_IN_CACHE)), None)


def preprocess_sparse_dense_matmul_input(
    features,
    features_weights,
    feature_specs,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    *,
    all_reduce_interface=None,
    validate_ids: bool = True,
):
  """Preprocesses one batch for the SparseCore sparse-dense matmul.

  A drop-in replacement for the reference's
  ``embedding.preprocess_sparse_dense_matmul_input``: the same arguments, the
  same ``(PreprocessedInput, SparseDenseMatmulInputStats)`` result, and the same
  values in every position the reference writes.

  Args:
    features: pytree (dict, list, tuple) of per-feature local batches: 2-D
      integer numpy arrays ``[batch, valency]`` (every cell is an id), or 1-D
      ``dtype=object`` arrays holding one 1-D id array per sample.
    features_weights: the same structure of float weights, or None (or an
      empty container) for unit weights.
    feature_specs: the same structure of the reference's ``FeatureSpec``s,
      stacked by ``prepare_feature_specs_for_training`` or
      ``auto_stack_tables`` (any object with the attributes listed in
      python/README.md, "Feature specs", works).
    local_device_count: L, devices fed by this host.
    global_device_count: G, devices in the job.
    num_sc_per_device: S, SparseCores per device (there is no TPU to ask).
    sharding_strategy: only "MOD" (any case).
    has_leading_dimension: arrays shaped ``[L, ...]`` instead of flat.
    allow_id_dropping: drop ids over the limits (counted in the stats) instead
      of raising :class:`LimitExceededError`.
    batch_number: keys minibatching's cross-host agreement.
    enable_minibatching: split batches that exceed a limit into minibatches.
    all_reduce_interface: the hosts' all-reduce for multi-host minibatching
      (required with ``enable_minibatching`` when ``global_device_count >
      local_device_count``): :func:`get_all_reduce_interface` (as the
      reference's), :class:`JaxDistributedAllReduce`, or any object with
      ``all_reduce_or(sync_key, value) -> int`` (:class:`AllReduceInterface`).
      Every host must call with the same ``batch_number`` for one step.
    validate_ids: reject ids outside ``[0, vocabulary_size)`` (the reference
      silently misplaces them). Turn off only for inputs known to be valid.

  Returns:
    ``(PreprocessedInput, SparseDenseMatmulInputStats)``. When the reference is
    already imported, its own classes are used, so the result passes to its
    ``tpu_sparse_dense_matmul`` unchanged.

  Raises:
    ConfigError: bad options or spec values (a ``ValueError``).
    FeatureSpecError: a spec without an attribute the call reads (a
      ``TypeError``).
    LimitExceededError: exceeded limits without dropping (the reference aborts).
    InvalidInputError: bad ids, weights or batch sizes, a pytree mismatch (a
      ``ValueError``).
    InputTypeError: leaves of an unusable type or dtype (a ``TypeError``).
    AllReduceError: the hosts could not agree on a minibatching split (a
      peer missing, dead or too slow, or the interface raised; a
      ``RuntimeError``).
  """
  _check_options(sharding_strategy, num_sc_per_device)
  if not features_weights:
    features_weights = None
  f_leaves, f_struct = _leaves_and_structure(features)
  s_leaves, s_struct = _leaves_and_structure(feature_specs)
  _check_structure(features, f_struct, feature_specs, s_struct, "features", "feature_specs")
  w_leaves = None
  if features_weights is not None:
    w_leaves, w_struct = _leaves_and_structure(features_weights)
    _check_structure(features_weights, w_struct, feature_specs, s_struct, "features_weights", "feature_specs")
  specs = _spec_tuples(s_leaves, feature_specs)
  f_leaves = [_feature_leaf(f, s) for f, s in zip(f_leaves, specs)]
  if w_leaves is not None:
    w_leaves = [_weights_leaf(w) for w in w_leaves]
  raw = _run_native(specs, local_device_count, global_device_count, num_sc_per_device, sharding_strategy,
                    allow_id_dropping, enable_minibatching, validate_ids,
                    lambda native: native.run(f_leaves, w_leaves, bool(has_leading_dimension), int(batch_number),
                                              all_reduce_interface),
                    all_reduce_interface is not None)
  return _wrap(raw, int(local_device_count), has_leading_dimension)


def _coo_leaves(indices, values, dense_shape, spec: tuple):
  """One sparse COO feature as the native call takes it: ``[nnz, 2]`` C-contiguous int64
  indices, ``[nnz]`` int32/int64 ids, and the batch (``dense_shape[0]``)."""
  name = spec[0][0]
  idx, ids, shape = np.asarray(indices), np.asarray(values), np.asarray(dense_shape)
  if idx.size == 0:
    idx = np.zeros((0, 2), np.int64)
  if ids.size == 0:
    ids = np.zeros(0, np.int32)
  for what, a in (("indices", idx), ("values", ids), ("dense_shape", shape)):
    if a.dtype.kind not in "iu":
      raise InputTypeError(f"feature `{name}`: COO {what} must be integers, got dtype {a.dtype}", feature=name)
  if idx.ndim != 2 or idx.shape[1] != 2:
    raise InvalidInputError(f"feature `{name}`: COO indices must have shape [nnz, 2] (a rank-2 sparse tensor), "
                            f"got {list(idx.shape)}", feature=name)
  if ids.ndim != 1 or ids.shape[0] != idx.shape[0]:
    raise InvalidInputError(f"feature `{name}`: COO values must have shape [nnz] = [{idx.shape[0]}] like the "
                            f"indices, got {list(ids.shape)}", feature=name)
  if shape.ndim != 1 or shape.size < 1 or int(shape[0]) > _INT64_MAX:
    raise InvalidInputError(f"feature `{name}`: dense_shape must be [batch, width], got {shape.tolist()}", feature=name)
  batch = int(shape[0])
  if idx.dtype == np.uint64 and idx.size:
    beyond = np.flatnonzero(idx[:, 0] > _INT64_MAX)
    if beyond.size:
      k = int(beyond[0])
      raise InvalidInputError(f"feature `{name}`: invalid input: indices[{k}] has row {int(idx[k, 0])}, outside "
                              f"the batch of {batch} (dense_shape[0])", feature=name, row=int(idx[k, 0]))
  if ids.dtype == np.uint64 and ids.size:
    _reject_beyond_int64(ids, lambda k: idx[k, 0], spec)
  idx = np.ascontiguousarray(idx, dtype=np.int64)
  ids = np.ascontiguousarray(ids if ids.dtype in _INT_IDS else ids.astype(np.int64))
  return idx, ids, batch


def preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    indices,
    values,
    dense_shapes,
    feature_specs,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    *,
    all_reduce_interface=None,
    validate_ids: bool = True,
):
  """Preprocesses one batch of sparse COO features (``tf.SparseTensor``-like).

  A drop-in replacement for the reference's
  ``embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor``: the
  same arguments, the same result, the same values in every position the
  reference writes. Every id has weight 1 (COO input carries no weights).

  Args:
    indices: pytree of per-feature ``[nnz, 2]`` integer arrays (anything
      ``np.asarray`` takes, e.g. a ``tf.Tensor``): column 0 is the sample row
      in the local batch, sorted non-decreasing; column 1 (the position) is
      ignored, as in the reference. Or, with ``values`` and ``dense_shapes``
      None, a pytree of ``tf.SparseTensor``-like objects, whose ``.indices``,
      ``.values`` and ``.dense_shape`` are read.
    values: the same structure of ``[nnz]`` integer ids.
    dense_shapes: the same structure of ``[batch, width]``: ``batch`` is the
      feature's local batch (rows without entries are empty samples);
      ``width`` is not used.
    feature_specs, local_device_count, global_device_count, num_sc_per_device,
    sharding_strategy, has_leading_dimension, allow_id_dropping, batch_number,
    enable_minibatching, all_reduce_interface, validate_ids: as in
      :func:`preprocess_sparse_dense_matmul_input`.

  Returns:
    ``(PreprocessedInput, SparseDenseMatmulInputStats)``; ``num_minibatches``
    is int32, as the reference's COO path makes it.

  Raises:
    As :func:`preprocess_sparse_dense_matmul_input`; also
    :class:`InvalidInputError` for indices that are not sorted by row or lie
    outside ``dense_shape[0]`` (the reference misreads them).
  """
  _check_options(sharding_strategy, num_sc_per_device)
  s_leaves, s_struct = _leaves_and_structure(feature_specs)
  if values is None and dense_shapes is None:
    tensors, t_struct = _leaves_and_structure(indices)
    _check_structure(indices, t_struct, feature_specs, s_struct, "sparse tensors", "feature_specs")
    i_leaves, v_leaves, d_leaves = [], [], []
    for i, t in enumerate(tensors):
      try:
        i_leaves.append(t.indices)
        v_leaves.append(t.values)
        d_leaves.append(t.dense_shape)
      except AttributeError:
        raise InputTypeError(
            f"sparse tensor {i}: with values and dense_shapes None, indices must hold tf.SparseTensor-like objects "
            f"(.indices, .values, .dense_shape), got {type(t).__name__}") from None
  else:
    i_leaves, i_struct = _leaves_and_structure(indices)
    _check_structure(indices, i_struct, feature_specs, s_struct, "indices", "feature_specs")
    v_leaves, v_struct = _leaves_and_structure(values)
    _check_structure(values, v_struct, feature_specs, s_struct, "values", "feature_specs")
    d_leaves, d_struct = _leaves_and_structure(dense_shapes)
    _check_structure(dense_shapes, d_struct, feature_specs, s_struct, "dense_shapes", "feature_specs")
  specs = _spec_tuples(s_leaves, feature_specs)
  coo = [_coo_leaves(i, v, d, s) for i, v, d, s in zip(i_leaves, v_leaves, d_leaves, specs)]
  idx, ids, batches = [c[0] for c in coo], [c[1] for c in coo], [c[2] for c in coo]
  raw = _run_native(specs, local_device_count, global_device_count, num_sc_per_device, sharding_strategy,
                    allow_id_dropping, enable_minibatching, validate_ids,
                    lambda native: native.run_coo(idx, ids, batches, bool(has_leading_dimension), int(batch_number),
                                                  all_reduce_interface),
                    all_reduce_interface is not None)
  return _wrap(raw, int(local_device_count), has_leading_dimension, np.int32)


# The drop-in calls' native state (plan, scratch memory, gather buffers) per distinct specs and
# options, most recently used last. The key holds what the specs say (read afresh every call),
# not the spec objects, so a spec changed in place (FDO raising a limit) gets a new entry.
_DROP_IN_CACHE: dict = {}
_DROP_IN_CACHE_SIZE = 4


# -----------------------------------------------------------------------------
# Config + Arrow
# -----------------------------------------------------------------------------


def _config_json(config) -> str:
  """Config text from a dict, a JSON string, or a path to a JSON file."""
  if isinstance(config, Mapping):
    return json.dumps(config)
  if isinstance(config, (str, os.PathLike)):
    text = os.fspath(config)
    if isinstance(text, str) and text.lstrip().startswith("{"):
      return text
    with open(text) as fh:
      return fh.read()
  raise TypeError(f"config must be a dict, a JSON string or a path, got {type(config).__name__}")


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
      CPU). A batch of fewer than 8,192 ids runs on the calling thread
      whatever the count: a pool's hand-over costs more than such a batch.
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
    self._native = _native.NativePreprocessor(_config_json(config), threads, None if later else all_reduce_interface,
                                              later)
    self._threads = threads
    self._leading = bool(has_leading_dimension)
    self._local_devices = int(self.config["config"]["local_device_count"])

  @property
  def config(self) -> dict:
    """The config, with defaults filled in."""
    return json.loads(self._native.config_json)

  def __call__(self, batch):
    """Preprocesses one record batch: ``(PreprocessedInput, SparseDenseMatmulInputStats)``."""
    raw = self._native.run(batch, self._leading)
    return _wrap(raw, self._local_devices, self._leading)

  def set_batch_number(self, batch_number: int) -> None:
    """Sets the step number that keys minibatching's cross-host agreement."""
    self._native.set_batch_number(int(batch_number))

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
    self._native.set_all_reduce_interface(all_reduce_interface)

  def fdo_stats(self, batch) -> "FdoStats":
    """The FDO statistics of one record batch, without writing buffers.

    Limits are measured, not enforced, so this never raises
    :class:`LimitExceededError`.
    """
    return FdoStats(self._native.fdo_stats(batch))

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
    out, permutation, reports = _native._balance(self._native.config_json, list(batches), window, str(refine))
    if with_report:
      return out, permutation, reports
    return out, permutation

  def __reduce__(self):
    return (_rebuild_preprocessor, (type(self), self._native.config_json, self._threads, self._leading,
                                    self._native.multi_host))

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


class FdoStats:
  """FDO statistics merged over batches, workers and hosts.

  Element-wise maxima of the per-partition and per-SparseCore arrays, sums of
  dropped ids and of batches; the JSON format is the CLI's ``stats.json``, so
  ``sparsecore-prep fdo merge`` / ``fdo tune`` read it too.
  """

  def __init__(self, native: "_native.NativeFdoStats"):
    self._native = native

  @classmethod
  def from_json(cls, text: str) -> "FdoStats":
    """Parses stats JSON (ours or the CLI's)."""
    return cls(_native.NativeFdoStats.from_json(text))

  @classmethod
  def read(cls, path) -> "FdoStats":
    """Reads a stats JSON file."""
    with open(path) as fh:
      return cls.from_json(fh.read())

  @classmethod
  def merge_all(cls, stats: Iterable["FdoStats"]) -> "FdoStats":
    """Merges any number of stats (at least one) into new stats."""
    it = iter(stats)
    try:
      first = next(it)
    except StopIteration:
      raise ValueError("no FDO stats to merge") from None
    out = cls.from_json(first.to_json())
    for s in it:
      out.merge(s)
    return out

  def merge(self, other: "FdoStats") -> "FdoStats":
    """Merges ``other`` into these stats (in place) and returns them."""
    self._native.merge(other._native)
    return self

  @property
  def batches(self) -> int:
    """Batches merged in."""
    return self._native.batches

  def to_json(self) -> str:
    """The stats as JSON."""
    return self._native.to_json()

  def to_dict(self) -> dict:
    """The stats as a dict (the JSON, parsed)."""
    return json.loads(self.to_json())

  def write(self, path) -> None:
    """Writes the JSON to ``path`` atomically (temporary name, then rename)."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
      fh.write(self.to_json())
    os.replace(tmp, path)

  def tune(self, config, headroom: float = 1.0) -> dict:
    """A copy of ``config`` with limits and buffer sizes from these stats.

    The rule of ``sparsecore-prep fdo tune``: observed maxima times
    ``headroom``, rounded up to 8 (buffers to 8 * S).
    """
    return json.loads(self._native.tune(_config_json(config), float(headroom)))

  def __eq__(self, other) -> bool:
    return isinstance(other, FdoStats) and self._native == other._native

  def __reduce__(self):
    return (FdoStats.from_json, (self.to_json(),))

  def __repr__(self) -> str:
    d = self.to_dict()
    return f"FdoStats({d['batches']} batches, stacks {sorted(d['stacks'])})"


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
