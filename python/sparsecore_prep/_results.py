"""The drop-in calls' result classes (the reference's names and fields), and the wrapping of the
native results into them, or into the reference's own classes when it is imported.

No ``from __future__ import annotations`` here: the classes name ``sparsecore_prep`` as their
module (for pickle), so string annotations would resolve there, where ``np`` and ``Mapping`` are
not; evaluated now, ``typing.get_type_hints`` reads them from the classes themselves.
"""

import contextlib
import dataclasses
import importlib.util
import sys
import threading
import warnings
from typing import Mapping, NamedTuple

import numpy as np

_REFERENCE_EMBEDDING = "jax_tpu_embedding.sparsecore.lib.nn.embedding"


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

  def __iter__(self):
    """The four buffer mappings, as the reference's class iterates (deprecated there too)."""
    warnings.warn("Please use attributed lookup on sparse_dense_matmul_input attribute.", DeprecationWarning,
                  stacklevel=2)
    return iter(self.sparse_dense_matmul_input)


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


# Our dataclasses become JAX pytrees as soon as jax is imported, so that `jax.tree.map` (for
# example `jax.make_array_from_process_local_data` over a result) reaches their arrays. Their
# children are the reference's, in its order: a flax `PyTreeNode` and `struct.dataclass` flatten
# every field, in declaration order (the NamedTuple is a pytree already). jax is never imported
# on our behalf (seconds); the check runs at import and with every result.
_PYTREE_FIELDS = {
    PreprocessedInput: ("sparse_dense_matmul_input", "num_minibatches"),
    SparseDenseMatmulInputStats: ("max_ids_per_partition", "max_unique_ids_per_partition",
                                  "required_buffer_size_per_sc", "id_drop_counters"),
}
_pytrees_registered = False
_pytree_lock = threading.Lock()


def _register_pytrees() -> None:
  """Registers the result dataclasses with jax.tree_util, once, if jax is imported."""
  global _pytrees_registered
  if _pytrees_registered or "jax" not in sys.modules:
    return
  with _pytree_lock:
    if _pytrees_registered:
      return
    try:
      from jax import tree_util
    except ImportError:  # a jax that fails to import leaves plain objects
      return
    for cls, fields in _PYTREE_FIELDS.items():
      try:
        tree_util.register_dataclass(cls, data_fields=list(fields), meta_fields=[])
      except ValueError:  # registered already (the module reloaded)
        pass
    _pytrees_registered = True


def _wrap(raw, local_device_count: int, has_leading_dimension: bool, minibatches_dtype=np.int64):
  _register_pytrees()
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


# Pickle and repr name the classes where users import them from, sparsecore_prep, the path that
# existing pickles hold (tests/test_pickle_compat.py).
for _cls in (SparseDenseMatmulInput, SparseDenseMatmulInputStats, PreprocessedInput):
  _cls.__module__ = "sparsecore_prep"
del _cls

class _AfterJaxImport:
  """A one-shot `sys.meta_path` finder: when jax is imported after this package, registers the
  result classes right after jax's own module has run, so that results made before, and
  results of other threads, are pytrees from then on."""

  def find_spec(self, name, path=None, target=None):
    if name != "jax":
      return None
    with contextlib.suppress(ValueError):
      sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
      return spec
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      _register_pytrees()

    spec.loader.exec_module = exec_module
    return spec


if "jax" in sys.modules:
  _register_pytrees()
else:
  sys.meta_path.insert(0, _AfterJaxImport())
