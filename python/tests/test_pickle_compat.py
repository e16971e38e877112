"""Pickles made by an earlier layout of the package still load, and new pickles name the same
classes.

data/pickles_pre_split/ holds pickles of every object of pickle_cases.cases(), written by the
package when all its classes lived in sparsecore_prep/__init__.py: they name each class (and the
Preprocessor's reducer) as ``sparsecore_prep.NAME``. Pickles outlive the code that wrote them (Ray
object stores, checkpoints, queues between workers of different versions), so those names stay
importable, and new pickles use them too.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import typing

import numpy as np
import pytest

import sparsecore_prep as scp
from pickle_cases import PROTOCOLS, OneHostOr, cases, record_batch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pickles_pre_split")
FRESH = cases()
FILES = [(name, p) for name in FRESH for p in PROTOCOLS]


def committed(name: str, protocol: int) -> bytes:
  with open(os.path.join(DATA, f"{name}.p{protocol}.pickle"), "rb") as fh:
    return fh.read()


class _Recorder(pickle.Unpickler):
  """Unpickles, recording the (module, name) of every global the pickle asks for."""

  def __init__(self, data: bytes):
    super().__init__(io.BytesIO(data))
    self.names: set[tuple[str, str]] = set()

  def find_class(self, module, name):
    self.names.add((module, name))
    return super().find_class(module, name)


def package_globals(data: bytes) -> set[tuple[str, str]]:
  """The globals of the package a pickle names."""
  r = _Recorder(data)
  r.load()
  return {(m, n) for m, n in r.names if m == "sparsecore_prep" or m.startswith("sparsecore_prep.")}


def test_every_file_is_a_case_and_every_case_has_its_files():
  assert sorted(os.listdir(DATA)) == sorted(f"{name}.p{p}.pickle" for name, p in FILES)


def test_the_committed_pickles_name_the_public_module():
  """What the files test: the classes as the package's top level (the exceptions' reducer has
  always been sparsecore_prep._errors._rebuild)."""
  for name, p in FILES:
    for module, attr in package_globals(committed(name, p)):
      assert module == "sparsecore_prep" or (module, attr) == ("sparsecore_prep._errors", "_rebuild"), (name, module,
                                                                                                         attr)


@pytest.mark.parametrize("name,protocol", FILES)
def test_new_pickles_name_what_the_old_ones_named(name, protocol):
  assert package_globals(pickle.dumps(FRESH[name], protocol=protocol)) == package_globals(committed(name, protocol))


def _assert_arrays(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    np.testing.assert_array_equal(a[k], b[k])


def _assert_matmul_input(a, b) -> None:
  assert type(a) is scp.SparseDenseMatmulInput and type(b) is scp.SparseDenseMatmulInput
  assert a._fields == b._fields
  for x, y in zip(a, b):
    _assert_arrays(x, y)


def _tails(m) -> dict:
  """Per stack, the slots past each SparseCore segment's final (8-aligned) cursor: one device of
  S = 2 segments, as `pickle_cases` makes them."""
  s = 2
  masks = {}
  for name, rp in m.lhs_row_pointers.items():
    c = m.lhs_embedding_ids[name].size
    cs, rpb = c // s, rp.size // s
    mask = np.zeros(c, dtype=bool)
    for seg in range(s):
      end = min(-(-int(rp[seg * rpb:(seg + 1) * rpb].max()) // 8) * 8, cs)
      mask[seg * cs + end:(seg + 1) * cs] = True
    masks[name] = mask
  return masks


def _assert_pre_split_matmul_input(old, fresh) -> None:
  """A result pickled before the split against a fresh one: the same arrays, except that the
  package then filled each segment's tail with the padding triple, and now with zeros."""
  assert type(old) is scp.SparseDenseMatmulInput and type(fresh) is scp.SparseDenseMatmulInput
  _assert_arrays(dict(old.lhs_row_pointers), dict(fresh.lhs_row_pointers))
  for name, tail in _tails(fresh).items():
    assert tail.any(), "the case has tails to check"
    for field, pad in (("lhs_embedding_ids", 2**31 - 1), ("lhs_sample_ids", 2**31 - 1), ("lhs_gains", 0x7FC00000)):
      a, b = getattr(old, field)[name], getattr(fresh, field)[name]
      assert a.dtype == b.dtype and a.shape == b.shape, field
      a, b = a.view(np.uint32), b.view(np.uint32)
      np.testing.assert_array_equal(a[~tail], b[~tail], err_msg=field)
      assert np.all(a[tail] == np.uint32(pad)) and np.all(b[tail] == 0), field


def _assert_preprocessed(a, b) -> None:
  assert type(a) is scp.PreprocessedInput
  _assert_pre_split_matmul_input(a.sparse_dense_matmul_input, b.sparse_dense_matmul_input)
  assert a.num_minibatches.dtype == b.num_minibatches.dtype
  np.testing.assert_array_equal(a.num_minibatches, b.num_minibatches)
  # The lhs_* properties forward to the matmul input.
  for x in (a, b):
    _assert_arrays(dict(x.lhs_gains), dict(x.sparse_dense_matmul_input.lhs_gains))


def _assert_stats(a, b) -> None:
  assert type(a) is scp.SparseDenseMatmulInputStats
  for f in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    _assert_arrays(getattr(a, f), getattr(b, f))
  assert a.id_drop_counters == b.id_drop_counters
  assert a.get_required_buffer_size_per_device("t0") == b.get_required_buffer_size_per_device("t0")


def _ours(m) -> scp.SparseDenseMatmulInput:
  """A call's matmul input as the package's class (a call returns the reference's classes once the
  reference is imported)."""
  return scp.SparseDenseMatmulInput(dict(m.lhs_row_pointers), dict(m.lhs_embedding_ids), dict(m.lhs_sample_ids),
                                    dict(m.lhs_gains))


def _assert_run_alike(a, b) -> None:
  """Two preprocessors give the same output for the same batch."""
  (ra, sa), (rb, sb) = a(record_batch()), b(record_batch())
  _assert_matmul_input(_ours(ra.sparse_dense_matmul_input), _ours(rb.sparse_dense_matmul_input))
  np.testing.assert_array_equal(ra.num_minibatches, rb.num_minibatches)
  for f in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    _assert_arrays(dict(getattr(sa, f)), dict(getattr(sb, f)))


def _assert_preprocessor(a, b) -> None:
  assert type(a) is type(b)
  # The state it pickles: config, threads, leading dimension, multi-host.
  assert a.__reduce__()[1][1:] == b.__reduce__()[1][1:]
  assert a.config == b.config and repr(a) == repr(b)
  if type(a) is scp.FdoStatsMapper:
    assert a(record_batch())["fdo_stats"].tolist() == b(record_batch())["fdo_stats"].tolist()
    return
  if a.config["config"]["global_device_count"] > a.config["config"]["local_device_count"]:
    # Unpickled without its all_reduce_interface: the first split asks for one.
    with pytest.raises(scp.AllReduceError, match="no all_reduce_interface was given"):
      a(record_batch())
    a.set_all_reduce_interface(OneHostOr())
  _assert_run_alike(a, b)


@pytest.mark.parametrize("name,protocol", FILES)
def test_pre_split_pickle_loads_as_a_fresh_object(name, protocol):
  old, fresh = pickle.loads(committed(name, protocol)), FRESH[name]
  if isinstance(fresh, BaseException):
    assert type(old) is type(fresh) and old.args == fresh.args and old.field_values() == fresh.field_values()
    assert str(old) == str(fresh) and type(old).__module__ == "sparsecore_prep"
  elif isinstance(fresh, scp.Preprocessor):
    _assert_preprocessor(old, fresh)
  elif isinstance(fresh, scp.FdoStats):
    assert type(old) is scp.FdoStats and old == fresh and old.batches == fresh.batches == 2
    assert old.to_dict() == fresh.to_dict()
  elif isinstance(fresh, scp.PreprocessedInput):
    _assert_preprocessed(old, fresh)
  elif isinstance(fresh, scp.SparseDenseMatmulInput):
    _assert_pre_split_matmul_input(old, fresh)
  elif isinstance(fresh, scp.SparseDenseMatmulInputStats):
    _assert_stats(old, fresh)
  else:
    raise AssertionError(f"{name}: no comparison for {type(fresh).__name__}")


def test_every_exported_class_that_pickles_has_a_case():
  """A class added to __all__ gets a case here, unless its instances cannot pickle."""
  # A protocol, and the two all-reduces, which hold a socket or a coordination-service client.
  no_instances_to_pickle = {"AllReduceInterface", "JaxDistributedAllReduce", "TcpAllReduce"}
  classes = {n for n in scp.__all__ if isinstance(getattr(scp, n), type)} - no_instances_to_pickle
  assert classes == {type(obj).__name__ for obj in FRESH.values()}


def test_result_classes_resolve_their_annotations():
  """The result classes name sparsecore_prep as their module; their annotations still resolve."""
  fields = {
      scp.SparseDenseMatmulInput: set(scp.SparseDenseMatmulInput._fields),
      scp.SparseDenseMatmulInputStats: {f.name for f in dataclasses.fields(scp.SparseDenseMatmulInputStats)},
      scp.PreprocessedInput: {f.name for f in dataclasses.fields(scp.PreprocessedInput)},
  }
  for cls, names in fields.items():
    assert cls.__module__ == "sparsecore_prep"
    assert set(typing.get_type_hints(cls)) == names, cls
