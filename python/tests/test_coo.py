"""The sparse COO drop-in call, `preprocess_sparse_dense_matmul_input_from_sparse_tensor`.

Its golden cases (case_200 to case_206) run in test_golden.py and random cases against the
reference in test_differential.py. Here: COO input equals the same ids as ragged rows with unit
weights (the reference's own equivalence, SPEC 1.3), whatever the positions and the index and id
types; `tf.SparseTensor`-like objects; and the errors where the reference misreads its input.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import sparsecore_prep as scp
from test_api import load, spec_example_specs
from test_golden import array, specs_from_resolved

FIELDS = ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains")


def to_coo(rows, gaps=False, index_type=np.int64, value_type=np.int32, extra_rows=0):
  """Ragged rows as (indices, values, dense_shape); `gaps` leaves holes in the positions."""
  entries = [(r, (2 * k + r % 3) if gaps else k, v) for r, row in enumerate(rows) for k, v in enumerate(row)]
  indices = np.array([[r, p] for r, p, _ in entries], dtype=index_type).reshape(-1, 2)
  values = np.array([v for _, _, v in entries], dtype=value_type)
  width = max([p + 1 for _, p, _ in entries], default=1)
  return indices, values, np.array([len(rows) + extra_rows, width], dtype=np.int64)


def assert_same(a, b):
  (out_a, stats_a), (out_b, stats_b) = a, b
  for field in FIELDS:
    for stack, arr in getattr(out_a, field).items():
      other = getattr(out_b, field)[stack]
      if arr.dtype == np.float32:
        arr, other = arr.view(np.uint32), other.view(np.uint32)
      np.testing.assert_array_equal(arr, other, err_msg=f"{field}[{stack}]")
  np.testing.assert_array_equal(out_a.num_minibatches, out_b.num_minibatches)
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    for stack, arr in getattr(stats_a, field).items():
      np.testing.assert_array_equal(arr, getattr(stats_b, field)[stack], err_msg=f"{field}[{stack}]")
  assert stats_a.id_drop_counters == stats_b.id_drop_counters


UNWEIGHTED = ["case_000_single_sum_noweights_g1", "case_004_sqrtn_noweights_g1", "case_007_dups_mean_noweights_g1",
              "case_010_all_empty_feature_g2l2", "case_012_feature_stacking_3f_diffbatch_g2l2",
              "case_016_auto_stack_shared_table_g4l1", "case_020_drop_with_dups_g1", "case_025_g4l4_zipf_b64"]


@pytest.mark.parametrize("name", UNWEIGHTED)
@pytest.mark.parametrize("gaps, index_type, value_type", [(False, np.int64, np.int32), (True, np.int32, np.int64),
                                                          (True, np.uint64, np.uint32)])
def test_coo_equals_the_same_ragged_rows(name, gaps, index_type, value_type):
  case, _ = load(name)
  assert not case["config"]["weights"]
  cfg = case["config"]
  args = (cfg["local_device_count"], cfg["global_device_count"])
  opts = dict(num_sc_per_device=cfg["num_sc_per_device"], allow_id_dropping=cfg["allow_id_dropping"])
  specs = specs_from_resolved(case)
  ragged = scp.preprocess_sparse_dense_matmul_input(
      [array(f["ids"], np.int32, f.get("layout") == "dense") for f in case["features"]], None, specs, *args, **opts)
  coo = [to_coo(f["ids"], gaps, index_type, value_type) for f in case["features"]]
  got = scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      [c[0] for c in coo], [c[1] for c in coo], [c[2] for c in coo], specs, *args, **opts)
  assert got[0].num_minibatches.dtype == np.int32 and ragged[0].num_minibatches.dtype == np.int64
  assert_same(got, ragged)
  # tf.SparseTensor-like objects, in place of the three trees.
  tensors = [SimpleNamespace(indices=i, values=v, dense_shape=d) for i, v, d in coo]
  assert_same(scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(tensors, None, None, specs, *args, **opts),
              ragged)


def spec_example_coo():
  """SPEC 3.9's two samples as COO (test_api.spec_example_ids)."""
  return to_coo([[0, 0, 0, 2, 4, 1], [1, 1, 1, 3, 3, 5, 5, 7, 7, 0]])


def run(indices, values, shape, specs=None, **kw):
  return scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      {"f": indices}, {"f": values}, {"f": shape}, specs or spec_example_specs(), 1, 1, num_sc_per_device=2, **kw)


def test_spec_example_as_coo():
  out, stats = run(*spec_example_coo())
  np.testing.assert_array_equal(out.lhs_row_pointers["t"], [3, 9, 16, 16, 16, 16, 16, 16, 1, 12, 16, 16, 16, 16, 16, 16])
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 4])
  np.testing.assert_array_equal(stats.max_unique_ids_per_partition["t"], [3, 4])
  np.testing.assert_array_equal(out.lhs_embedding_ids["t"][[0, 1, 2, 8]], [0, 1, 2, 0])
  np.testing.assert_array_equal(out.lhs_gains["t"][[0, 1, 2, 8]], [3, 1, 1, 1])
  np.testing.assert_array_equal(out.lhs_gains["t"][[16, 24, 25, 26, 27]], [1, 3, 2, 2, 2])
  assert out.num_minibatches.tolist() == [1]
  out, _ = run(*spec_example_coo(), has_leading_dimension=True)
  assert out.lhs_row_pointers["t"].shape == (1, 16) and out.num_minibatches.shape == (1, 1)
  assert out.num_minibatches.dtype == np.int32


def test_empty_rows_and_an_empty_feature():
  # Rows 0 and 3 (the last, past every index) are empty samples.
  indices, values, _ = to_coo([[], [1, 2], [3], []])
  out, stats = run(indices, values, np.array([4, 5]))
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [1, 1])
  # nnz = 0: indices of shape [0, 2], or any empty array.
  for empty_indices, empty_values in ((np.zeros((0, 2), np.int64), np.zeros(0, np.int32)),
                                      (np.array([]), np.array([]))):
    out, stats = scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        [empty_indices], [empty_values], [np.array([2, 1])], [spec_example_specs()["f"]], 1, 1, num_sc_per_device=2)
    np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [0, 0])
    assert np.all(out.lhs_row_pointers["t"] == 0)


def test_coo_errors():
  indices, values, shape = spec_example_coo()
  # Rows out of order: the reference misreads them (a debug-only check).
  swapped = indices[::-1].copy()
  with pytest.raises(scp.InvalidInputError, match="not sorted by row") as e:
    run(swapped, values[::-1].copy(), shape)
  assert e.value.feature == "f"
  with pytest.raises(scp.InvalidInputError, match=r"indices\[6\] has row 1, outside the batch of 1"):
    run(indices, values, np.array([1, 10]))
  with pytest.raises(scp.InvalidInputError, match=r"shape \[nnz, 2\]"):
    run(np.zeros((16, 3), np.int64), values, shape)
  with pytest.raises(scp.InvalidInputError, match=r"COO values must have shape \[nnz\] = \[16\]"):
    run(indices, values[:-1], shape)
  with pytest.raises(scp.InputTypeError, match="COO values must be integers, got dtype float32") as e:
    run(indices, values.astype(np.float32), shape)
  assert e.value.feature == "f"
  with pytest.raises(scp.InvalidInputError, match="dense_shape must be"):
    run(indices, values, np.zeros((2, 2), np.int64))
  # An id outside the table names the sample row it is in (column 0 of its index).
  bad = values.copy()
  bad[9] = 8
  with pytest.raises(scp.InvalidInputError) as e:
    run(indices, bad, shape)
  assert e.value.field_values() == {"feature": "f", "row": 1, "id": 8}
  assert str(e.value) == "feature `f` (table `t`), sample row 1: id 8 is outside [0, vocabulary_size 8)"
  # A uint64 id beyond int64, exactly as given.
  big = values.astype(np.uint64)
  big[12] = 2**63
  with pytest.raises(scp.InvalidInputError) as e:
    run(indices, big, shape)
  assert e.value.field_values() == {"feature": "f", "row": 1, "id": 2**63}
  assert "id 9223372036854775808 is outside" in str(e.value)
  # Limits, pytrees, tensors without the attributes.
  tight = spec_example_specs()
  tight["f"].table_spec.stacked_table_spec.max_ids_per_partition = 2
  with pytest.raises(scp.LimitExceededError):
    run(indices, values, shape, specs=tight)
  with pytest.raises(scp.InvalidInputError, match="Pytree structures of values and feature_specs"):
    scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        {"f": indices}, {"g": values}, {"f": shape}, spec_example_specs(), 1, 1, num_sc_per_device=2)
  with pytest.raises(scp.InputTypeError, match="tf.SparseTensor-like"):
    scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        {"f": indices}, None, None, spec_example_specs(), 1, 1, num_sc_per_device=2)
  specs = spec_example_specs()
  del specs["f"].table_spec.setting_in_stack
  with pytest.raises(scp.FeatureSpecError) as e:
    run(indices, values, shape, specs=specs)
  assert e.value.attribute == "table_spec.setting_in_stack.stack_name"


def test_coo_minibatching_splits_like_the_reference():
  """case_206 (minibatching) through SparseTensor-like objects: 10 minibatches, int32."""
  import glob
  import json
  import os

  from test_golden import SHARED

  [path] = glob.glob(os.path.join(SHARED, "golden_mb", "case_206*"))
  with open(os.path.join(path, "input.json")) as fh:
    case = json.load(fh)
  with open(os.path.join(path, "expected.json")) as fh:
    expected = json.load(fh)
  tensors = [SimpleNamespace(indices=np.array(f["indices"]), values=np.array(f["values"]), dense_shape=f["dense_shape"])
             for f in case["features"]]
  # dense_shape as a list is a pytree node, so it goes inside the tensor object, not as a leaf.
  cfg = case["config"]
  out, _ = scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      tensors, None, None, specs_from_resolved(case), cfg["local_device_count"], cfg["global_device_count"],
      cfg["num_sc_per_device"], enable_minibatching=True)
  assert out.num_minibatches.tolist() == [expected["num_minibatches"]] and out.num_minibatches.dtype == np.int32
  stack = next(iter(expected["stacks"]))
  want = expected["stacks"][stack]["row_pointers"]
  written = [i for i, v in enumerate(want) if v is not None]
  assert len(written) > 40
  np.testing.assert_array_equal(out.lhs_row_pointers[stack][written], [want[i] for i in written])
