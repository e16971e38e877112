"""The drop-in calls: the reference's ``preprocess_sparse_dense_matmul_input`` and
``preprocess_sparse_dense_matmul_input_from_sparse_tensor``, over numpy (or tf.SparseTensor-like)
input and the reference's FeatureSpecs."""

from __future__ import annotations

import numpy as np

from . import _native
from ._errors import ConfigError, InputTypeError, InvalidInputError
from ._pytree import _check_structure, _leaves_and_structure
from ._results import _wrap
from ._specs import _spec_tuples


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


# SparseCores per chip of the TPU kinds that have them, by `jax.Device.device_kind` (the names
# both releases of the reference know), for num_sc_per_device=None without the reference.
_SC_PER_DEVICE_KIND = {"TPU v5": 4, "TPU v5p": 4, "TPU v6e": 2, "TPU v6 lite": 2, "TPU7x": 2}


def _num_sc_per_device_of_device() -> int:
  """num_sc_per_device=None: as the reference resolves it, the SparseCore count of the first JAX
  device, with its ValueError texts (as a ConfigError, a ValueError) for a device without
  SparseCores, such as the CPU. The reference's own resolver when it is installed."""
  try:
    from jax_tpu_embedding.sparsecore.utils import utils
  except ImportError:
    utils = None
  try:
    if utils is not None:
      return int(utils.num_sparsecores_per_device())
    import jax

    device = jax.devices()[0]
    if not hasattr(device, "device_kind"):
      raise ValueError(f"Cannot determine device kind for device: {device}")
    if device.device_kind not in _SC_PER_DEVICE_KIND:
      raise ValueError(f"Unknown sparsecore count for device kind: {device.device_kind}")
    return _SC_PER_DEVICE_KIND[device.device_kind]
  except ImportError:
    raise ConfigError("num_sc_per_device is None and jax is not installed to find the device's SparseCores",
                      field="num_sc_per_device") from None
  except ValueError as e:
    raise ConfigError(str(e), field="num_sc_per_device") from None


def _check_options(sharding_strategy, num_sc_per_device, local_device_count, global_device_count) -> int:
  """Checks the options in the order, and with the ValueError texts, of the reference's current
  release (0.2.0; 0.1.0 aborted the process on most of them); returns num_sc_per_device (None:
  the first device's count)."""
  if num_sc_per_device is None:
    num_sc_per_device = _num_sc_per_device_of_device()
  # The reference's Python functions take only the SparseCore counts of the TPUs it knows (2 and
  # 4), with this message; its C++ layer, and `Preprocessor` here, take any power of two.
  if num_sc_per_device not in _REFERENCE_SC_PER_DEVICE:
    raise ConfigError(f"Invalid num_sc_per_device: {num_sc_per_device}", field="num_sc_per_device")
  if not isinstance(sharding_strategy, str) or sharding_strategy.upper() != "MOD":
    raise ConfigError(f"Unsupported sharding strategy: {sharding_strategy}. Only MOD is supported.",
                      field="sharding_strategy")
  local, global_ = int(local_device_count), int(global_device_count)
  if local <= 0:
    raise ConfigError(f"local_device_count must be greater than 0, but got {local}", field="local_device_count")
  if global_ <= 0:
    raise ConfigError(f"global_device_count must be greater than 0, but got {global_}", field="global_device_count")
  if global_ < local:
    raise ConfigError("global_device_count must be greater than or equal to local_device_count, "
                      f"but got {global_} vs {local}", field="global_device_count")
  total = global_ * int(num_sc_per_device)
  if total & (total - 1):
    raise ConfigError(f"Total number of SparseCores ({total}) must be a power of 2.", field="num_sc_per_device")
  return num_sc_per_device


def _usable_all_reduce(all_reduce_interface, local_device_count, global_device_count):
  """The reference's own interface object (its get_all_reduce_interface) cannot be called from
  Python. A single host (local == global devices) has no other host to agree with, so there it is
  not needed and is left out (the OR over one host is its own value); on several hosts the native
  call rejects it with a ConfigError naming the interfaces it takes."""
  if (all_reduce_interface is not None and not hasattr(all_reduce_interface, "all_reduce_or")
      and int(local_device_count) == int(global_device_count)):
    return None
  return all_reduce_interface


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
    num_sc_per_device: int | None = None,
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
    num_sc_per_device: S, SparseCores per device; None asks the first JAX
      device, as the reference does (a CPU has none: a ConfigError, which is
      a ValueError, with the reference's text).
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
  num_sc_per_device = _check_options(sharding_strategy, num_sc_per_device, local_device_count, global_device_count)
  all_reduce_interface = _usable_all_reduce(all_reduce_interface, local_device_count, global_device_count)
  if not features_weights:
    features_weights = None
  f_leaves, f_struct = _leaves_and_structure(features)
  s_leaves, s_struct = _leaves_and_structure(feature_specs)
  _check_structure(features, f_struct, feature_specs, s_struct, "features", "feature_specs")
  if not s_leaves:
    raise ConfigError("input_batches cannot be empty.", field="features")
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
    num_sc_per_device: int | None = None,
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
  num_sc_per_device = _check_options(sharding_strategy, num_sc_per_device, local_device_count, global_device_count)
  all_reduce_interface = _usable_all_reduce(all_reduce_interface, local_device_count, global_device_count)
  s_leaves, s_struct = _leaves_and_structure(feature_specs)
  if not s_leaves:
    raise ConfigError("input_batches cannot be empty.", field="feature_specs")
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
