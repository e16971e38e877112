"""The golden cases (real reference outputs) through the drop-in calls, with duck-typed specs.

Each case's `resolved` block is the reference's stacking result; it becomes plain objects with
the attributes the reference's FeatureSpec has (SPEC Part 2, section 2.6), so this test needs
neither jax nor the reference, and checks that those attributes, and nothing else, decide the
output. Expected values are the reference's own (`expected.json`), compared inside its written
ranges, gains by bit pattern. The sparse COO cases (`"layout": "coo"`, case_2NN) go through
`preprocess_sparse_dense_matmul_input_from_sparse_tensor`, the others through
`preprocess_sparse_dense_matmul_input`.
"""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import sparsecore_prep as scp

SHARED = os.environ.get("SPARSECORE_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))
CASES = sorted(glob.glob(os.path.join(SHARED, "golden", "case_[02]*")) + glob.glob(os.path.join(SHARED, "golden_mb", "case_[12]*")))
COO_CASES = [p for p in CASES if os.path.basename(p).startswith("case_2")]
PAD = 2**31 - 1

if not CASES:
  # CI sets REQUIRE_GOLDEN=1: there, missing cases are a failure, never a silent skip.
  if os.environ.get("REQUIRE_GOLDEN") == "1":
    raise RuntimeError(f"REQUIRE_GOLDEN=1 but there are no golden cases under {SHARED}")
  pytest.skip(f"no golden cases under {SHARED}", allow_module_level=True)


def specs_from_resolved(case):
  """Objects with the reference FeatureSpec's attributes, from the case's resolved block."""
  tables = {t["name"]: t for t in case["tables"]}
  stacks = case["resolved"]["stacks"]
  out = []
  for f, r in zip(case["features"], case["resolved"]["features"]):
    assert f["name"] == r["feature"]
    st = stacks[r["stack_name"]]
    t = tables[f["table"]]
    stacked = SimpleNamespace(
        stack_name=r["stack_name"], combiner=st["combiner"], max_ids_per_partition=st["max_ids_per_partition"],
        max_unique_ids_per_partition=st["max_unique_ids_per_partition"],
        suggested_coo_buffer_size_per_device=st["suggested_coo_buffer_size_per_device"])
    table = SimpleNamespace(name=t["name"], vocabulary_size=t["vocabulary_size"], embedding_dim=t["embedding_dim"],
                            stacked_table_spec=stacked, setting_in_stack=SimpleNamespace(stack_name=r["stack_name"]))
    out.append(SimpleNamespace(
        name=f["name"], table_spec=table, output_shape=[f["global_batch_size"], t["embedding_dim"]],
        _id_transformation=SimpleNamespace(row_offset=r["row_offset"], col_offset=r["col_offset"],
                                           col_shift=r["col_shift"])))
  return out


def array(rows, dtype, dense):
  if dense:
    return np.asarray(rows, dtype=dtype).reshape(len(rows), -1)
  out = np.empty(len(rows), dtype=object)
  for i, row in enumerate(rows):
    out[i] = np.asarray(row, dtype=dtype)
  return out


def is_coo(case):
  layouts = {f.get("layout") for f in case["features"]}
  assert layouts <= {"coo"} or "coo" not in layouts, "a case is all COO or has no COO feature"
  return layouts == {"coo"}


def run_coo(case):
  """Indices, values and dense shapes as the reference takes them (int64 indices, int32 ids)."""
  cfg = case["config"]
  indices = [np.asarray(f["indices"], dtype=np.int64).reshape(-1, 2) for f in case["features"]]
  values = [np.asarray(f["values"], dtype=np.int32) for f in case["features"]]
  shapes = [np.asarray(f["dense_shape"], dtype=np.int64) for f in case["features"]]
  return scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      indices, values, shapes, specs_from_resolved(case), cfg["local_device_count"], cfg["global_device_count"],
      num_sc_per_device=cfg["num_sc_per_device"], allow_id_dropping=cfg["allow_id_dropping"],
      enable_minibatching=cfg.get("enable_minibatching", False))


def run(case):
  cfg = case["config"]
  if is_coo(case):
    return run_coo(case)
  feats = [array(f["ids"], np.int32, f.get("layout") == "dense") for f in case["features"]]
  weights = None
  if cfg.get("weights"):
    weights = [array(f["weights"] if f["weights"] is not None else [[1.0] * len(r) for r in f["ids"]], np.float32,
                     f.get("layout") == "dense") for f in case["features"]]
  return scp.preprocess_sparse_dense_matmul_input(
      feats, weights, specs_from_resolved(case), cfg["local_device_count"], cfg["global_device_count"],
      cfg["num_sc_per_device"], allow_id_dropping=cfg["allow_id_dropping"],
      enable_minibatching=cfg.get("enable_minibatching", False))


def test_every_coo_case_is_found():
  # case_200 to case_205 in golden/, case_206 (minibatching) in golden_mb/.
  assert [os.path.basename(p)[:8] for p in COO_CASES] == [f"case_{n}" for n in range(200, 207)]


@pytest.mark.parametrize("path", CASES, ids=os.path.basename)
def test_golden_case(path):
  with open(os.path.join(path, "input.json")) as fh:
    case = json.load(fh)
  with open(os.path.join(path, "expected.json")) as fh:
    expected = json.load(fh)
  if "error" in expected:
    with pytest.raises(scp.LimitExceededError, match=expected["error"]["message_contains"]):
      run(case)
    return
  out, stats = run(case)
  m = out.sparse_dense_matmul_input
  assert sorted(m.lhs_row_pointers) == sorted(expected["stacks"])
  np.testing.assert_array_equal(out.num_minibatches, expected["num_minibatches"])
  # The reference's NumPy path makes int64, its COO path int32 (SPEC C6).
  assert out.num_minibatches.dtype == (np.int32 if is_coo(case) else np.int64)
  for name, want in expected["stacks"].items():
    rp = m.lhs_row_pointers[name]
    want_rp = np.array([PAD if v is None else v for v in want["row_pointers"]])
    mask = np.array([v is not None for v in want["row_pointers"]])
    np.testing.assert_array_equal(rp[mask], want_rp[mask], err_msg=f"{name} row pointers")
    valid = np.zeros(len(want["embedding_ids"]), dtype=bool)
    for lo, hi in want["valid_ranges"]:
      valid[lo:hi] = True
    for key, got in (("embedding_ids", m.lhs_embedding_ids[name]), ("sample_ids", m.lhs_sample_ids[name]),
                     ("gains_bits", m.lhs_gains[name].view(np.uint32))):
      want_v = np.array([0 if v is None else v for v in want[key]], dtype=np.int64)
      assert got.shape == want_v.shape, key
      bad = np.flatnonzero(valid & (got.astype(np.int64) != want_v))
      assert bad.size == 0, f"{name} {key} differ at {bad[:10]}"
    if not case["config"].get("enable_minibatching"):
      # Outside the written ranges (each segment's tail) the package writes zeros: fresh pages
      # that no batch touches (the Rust library's default is the padding triple).
      assert np.all(m.lhs_embedding_ids[name][~valid] == 0)
      assert np.all(m.lhs_sample_ids[name][~valid] == 0)
      assert np.all(m.lhs_gains[name].view(np.uint32)[~valid] == 0)
    st = want["stats"]
    np.testing.assert_array_equal(stats.max_ids_per_partition[name], st["max_ids_per_partition"])
    np.testing.assert_array_equal(stats.max_unique_ids_per_partition[name], st["max_unique_ids_per_partition"])
    np.testing.assert_array_equal(stats.required_buffer_size_per_sc[name], st["required_buffer_size_per_sc"])
    assert stats.id_drop_counters[name] == st["dropped_id_count"]
