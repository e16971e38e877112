"""The package's API: Arrow input, pickling, FDO stats, input forms and errors.

Expected values come from the reference: SPEC Part 2 section 3.9's worked example (the peer's
actual output) and the golden cases' expected.json, never from our own code.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

import sparsecore_prep as scp
from test_golden import SHARED, array, specs_from_resolved

GOLDEN = os.path.join(SHARED, "golden")


def load(name):
  with open(os.path.join(GOLDEN, name, "input.json")) as fh:
    case = json.load(fh)
  with open(os.path.join(GOLDEN, name, "expected.json")) as fh:
    return case, json.load(fh)


def record_batch(case):
  """The case's inline data as an Arrow record batch (one List column per feature)."""
  cols, names = [], []
  for f in case["features"]:
    cols.append(pa.array(f["ids"], type=pa.list_(pa.int64())))
    names.append(f["name"])
    if case["config"].get("weights"):
      cols.append(pa.array(f["weights"], type=pa.list_(pa.float32())))
      names.append(f["name"] + "__w")
  return pa.RecordBatch.from_arrays(cols, names=names)


# The options of our config format; a golden case's `config` also records the reference's call
# (`weights`, `batch_number`, ...), which a strict config rejects as unknown fields.
CONFIG_OPTIONS = ("local_device_count", "global_device_count", "num_sc_per_device", "allow_id_dropping", "stacking",
                  "stack_limits", "enable_minibatching", "stack_suggested_coo_buffer_size_per_device",
                  "sharding_strategy")


def arrow_config(case):
  cfg = {k: case[k] for k in ("config", "tables", "features")}
  cfg["config"] = {k: v for k, v in case["config"].items() if k in CONFIG_OPTIONS}
  cfg["features"] = [{"name": f["name"], "table": f["table"],
                      "weights_column": f["name"] + "__w" if case["config"].get("weights") else None}
                     for f in case["features"]]
  return cfg


def assert_matches(expected, out, stats):
  m = out.sparse_dense_matmul_input
  for name, want in expected["stacks"].items():
    np.testing.assert_array_equal(m.lhs_row_pointers[name], want["row_pointers"])
    for lo, hi in want["valid_ranges"]:
      np.testing.assert_array_equal(m.lhs_embedding_ids[name][lo:hi], want["embedding_ids"][lo:hi])
      np.testing.assert_array_equal(m.lhs_sample_ids[name][lo:hi], want["sample_ids"][lo:hi])
      np.testing.assert_array_equal(m.lhs_gains[name][lo:hi].view(np.uint32), want["gains_bits"][lo:hi])
    st = want["stats"]
    np.testing.assert_array_equal(stats.max_ids_per_partition[name], st["max_ids_per_partition"])
    np.testing.assert_array_equal(stats.required_buffer_size_per_sc[name], st["required_buffer_size_per_sc"])
    assert stats.id_drop_counters[name] == st["dropped_id_count"]


def spec_example_specs():
  """SPEC 3.9: one table, vocab 8, S = 2, G = 1."""
  stacked = SimpleNamespace(combiner="sum", max_ids_per_partition=8, max_unique_ids_per_partition=8,
                            suggested_coo_buffer_size_per_device=None)
  table = SimpleNamespace(name="t", vocabulary_size=8, embedding_dim=8, stacked_table_spec=stacked,
                          setting_in_stack=SimpleNamespace(stack_name="t"))
  return {"f": SimpleNamespace(name="f", table_spec=table, output_shape=[2, 8], _id_transformation=None)}


def spec_example_ids():
  ids = np.empty(2, dtype=object)
  ids[0] = np.array([0, 0, 0, 2, 4, 1], dtype=np.int64)
  ids[1] = np.array([1, 1, 1, 3, 3, 5, 5, 7, 7, 0], dtype=np.int32)
  return {"f": ids}


def test_spec_stats_example_with_duck_typed_specs():
  out, stats = scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, spec_example_specs(), 1, 1, 2)
  np.testing.assert_array_equal(out.lhs_row_pointers["t"], [3, 9, 16, 16, 16, 16, 16, 16, 1, 12, 16, 16, 16, 16, 16, 16])
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 4])
  np.testing.assert_array_equal(stats.max_unique_ids_per_partition["t"], [3, 4])
  np.testing.assert_array_equal(stats.required_buffer_size_per_sc["t"], [16, 16])
  eid, gains = out.lhs_embedding_ids["t"], out.lhs_gains["t"]
  np.testing.assert_array_equal(eid[[0, 1, 2, 8]], [0, 1, 2, 0])
  np.testing.assert_array_equal(gains[[0, 1, 2, 8]], [3, 1, 1, 1])
  np.testing.assert_array_equal(eid[[16, 24, 25, 26, 27]], [0, 0, 1, 2, 3])
  np.testing.assert_array_equal(gains[[16, 24, 25, 26, 27]], [1, 3, 2, 2, 2])
  assert out.num_minibatches.tolist() == [1] and out.num_minibatches.dtype == np.int64
  assert stats.get_required_buffer_size_per_device("t") == 32


def test_ragged_rows_as_lists_and_leading_dimension():
  ids = spec_example_ids()
  ids["f"][0] = [0, 0, 0, 2, 4, 1]  # a Python list row
  out, _ = scp.preprocess_sparse_dense_matmul_input(ids, None, spec_example_specs(), 1, 1, 2,
                                                    has_leading_dimension=True)
  assert out.lhs_row_pointers["t"].shape == (1, 16)
  assert out.lhs_embedding_ids["t"].shape == (1, 32)
  assert out.num_minibatches.shape == (1, 1)
  np.testing.assert_array_equal(out.lhs_row_pointers["t"][0, :8], [3, 9, 16, 16, 16, 16, 16, 16])


def test_golden_case_through_arrow_and_pickle():
  case, expected = load("case_001_single_sum_weights_g1")
  prep = scp.Preprocessor(arrow_config(case))
  rb = record_batch(case)
  assert_matches(expected, *prep(rb))
  # A table of several chunks is one local batch (the stream interface).
  table = pa.Table.from_batches([rb.slice(0, 5), rb.slice(5)])
  assert table.column(0).num_chunks == 2
  assert_matches(expected, *prep(table))
  clone = pickle.loads(pickle.dumps(prep))
  assert clone.config == prep.config
  assert_matches(expected, *clone(rb))


def test_config_from_a_path(tmp_path):
  case, expected = load("case_013_multi_table_mixed_combiners_g2l2")
  path = tmp_path / "cfg.json"
  path.write_text(json.dumps(arrow_config(case)))
  assert_matches(expected, *scp.Preprocessor(path)(record_batch(case)))
  assert_matches(expected, *scp.Preprocessor(str(path), threads=1)(record_batch(case)))


def test_fdo_stats_merge_and_tune():
  case, expected = load("case_019_drop_hot_partition_g2l2")
  prep = scp.Preprocessor(arrow_config(case))
  one = prep.fdo_stats(record_batch(case))
  st = expected["stacks"]["t0"]["stats"]
  d = one.to_dict()
  assert d["batches"] == 1
  assert d["stacks"]["t0"]["max_ids_per_partition"] == st["max_ids_per_partition"]
  assert d["stacks"]["t0"]["required_buffer_size_per_sc"] == st["required_buffer_size_per_sc"]
  merged = scp.FdoStats.merge_all([one, one, pickle.loads(pickle.dumps(one))])
  assert merged.batches == 3
  assert merged.to_dict()["stacks"]["t0"]["max_ids_per_partition"] == st["max_ids_per_partition"]
  assert merged.to_dict()["stacks"]["t0"]["dropped_id_count"] == 3 * d["stacks"]["t0"]["dropped_id_count"]
  assert scp.FdoStats.from_json(merged.to_json()) == merged
  tuned = merged.tune(arrow_config(case), headroom=1.0)
  t0 = tuned["tables"][0]
  # Observed maxima rounded up to 8: the tuned config drops nothing on this batch.
  assert t0["max_ids_per_partition"] == -(-max(st["max_ids_per_partition"]) // 8) * 8
  tuned["config"]["allow_id_dropping"] = False
  _, stats = scp.Preprocessor(tuned)(record_batch(case))
  assert stats.id_drop_counters["t0"] == 0


def test_limit_exceeded_raises_with_attributes():
  case, expected = load("case_033_error_exceed_without_drop_g1")
  with pytest.raises(scp.LimitExceededError, match=expected["error"]["message_contains"]) as e:
    scp.Preprocessor(arrow_config(case))(record_batch(case))
  assert isinstance(e.value, ValueError)
  assert e.value.stack == "t0" and e.value.observed > e.value.limit
  # fdo_stats measures instead of enforcing.
  assert scp.Preprocessor(arrow_config(case)).fdo_stats(record_batch(case)).batches == 1


def test_input_errors_name_the_feature():
  case, _ = load("case_001_single_sum_weights_g1")
  prep = scp.Preprocessor(arrow_config(case))
  rb = record_batch(case).drop_columns(["f0"]) if hasattr(pa.RecordBatch, "drop_columns") else None
  if rb is not None:
    with pytest.raises(scp.InvalidInputError, match="f0"):
      prep(rb)
  with pytest.raises(TypeError, match="Arrow"):
    prep({"f0": [1, 2]})
  bad = pa.RecordBatch.from_arrays([pa.array([1.0, 2.0]), pa.array([[1.0], [1.0]], type=pa.list_(pa.float32()))],
                                   names=["f0", "f0__w"])
  with pytest.raises(TypeError, match="f0"):
    prep(bad)
  cfg = arrow_config(case)
  cfg["config"]["num_sc_per_device"] = 3
  with pytest.raises(ValueError, match="num_sc_per_device"):
    scp.Preprocessor(cfg)


def test_drop_in_errors():
  specs = spec_example_specs()
  ids = spec_example_ids()
  with pytest.raises(ValueError, match="Pytree structures"):
    scp.preprocess_sparse_dense_matmul_input({"g": ids["f"]}, None, specs, 1, 1, 2)
  weights = {"g": np.array([np.ones(6, np.float32), np.ones(10, np.float32)], dtype=object)}
  with pytest.raises(ValueError, match="Pytree structures of features_weights and feature_specs"):
    scp.preprocess_sparse_dense_matmul_input(ids, weights, specs, 1, 1, 2)
  # A list and a tuple with the same items match: leaves are paired by path, as jax's key paths
  # pair them (with or without jax loaded).
  out, _ = scp.preprocess_sparse_dense_matmul_input([ids["f"]], None, (specs["f"],), 1, 1, 2)
  np.testing.assert_array_equal(out.lhs_row_pointers["t"][:8], [3, 9, 16, 16, 16, 16, 16, 16])
  with pytest.raises(ValueError, match="Unsupported sharding strategy"):
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2, sharding_strategy="DIV")
  with pytest.raises(ValueError, match="power of 2"):
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 3, 2)
  with pytest.raises(TypeError, match="integers"):
    scp.preprocess_sparse_dense_matmul_input({"f": np.ones((2, 2), np.float32)}, None, specs, 1, 1, 2)
  with pytest.raises(ValueError, match="dtype=object"):
    scp.preprocess_sparse_dense_matmul_input({"f": np.arange(2)}, None, specs, 1, 1, 2)
  bad = spec_example_ids()
  bad["f"][1] = np.array([1, 9], dtype=np.int32)  # vocabulary_size is 8
  with pytest.raises(scp.InvalidInputError, match="id 9"):
    scp.preprocess_sparse_dense_matmul_input(bad, None, specs, 1, 1, 2)
  weights = {"f": np.array([np.ones(6, np.float32), np.ones(3, np.float32)], dtype=object)}
  with pytest.raises(ValueError, match="weights"):
    scp.preprocess_sparse_dense_matmul_input(ids, weights, specs, 1, 1, 2)
  with pytest.raises(scp.LimitExceededError):
    tight = spec_example_specs()
    tight["f"].table_spec.stacked_table_spec.max_ids_per_partition = 2
    scp.preprocess_sparse_dense_matmul_input(ids, None, tight, 1, 1, 2)


def ragged_views(rows, dtype, layout):
  """An object array of per-sample arrays with `rows`' values, laid out in memory as `layout` says."""
  out = np.empty(len(rows), dtype=object)
  lens = [len(r) for r in rows]
  flat = np.asarray([v for r in rows for v in r], dtype=dtype)
  ends = np.cumsum([0] + lens)
  if layout == "separate":  # one allocation per sample
    for i, r in enumerate(rows):
      out[i] = np.asarray(r, dtype=dtype)
  elif layout == "chained":  # consecutive slices of one flat array (np.split's layout)
    for i in range(len(rows)):
      out[i] = flat[ends[i]:ends[i + 1]]
  elif layout == "backwards":  # slices of one array, the last sample's first in memory
    back = np.concatenate([flat[ends[i]:ends[i + 1]] for i in reversed(range(len(rows)))] + [flat[:0]])
    start = len(flat)
    for i in range(len(rows)):
      start -= lens[i]
      out[i] = back[start:start + lens[i]]
  elif layout == "strided":  # every other element of a doubled array
    doubled = np.repeat(flat, 2)
    for i in range(len(rows)):
      out[i] = doubled[2 * ends[i]:2 * ends[i + 1]:2]
  elif layout == "reversed":  # negative strides
    for i in range(len(rows)):
      out[i] = flat[ends[i]:ends[i + 1]][::-1].copy()[::-1]
  return out


@pytest.mark.parametrize("name", ["case_005_sqrtn_weights_g1", "case_009_empty_samples_g1", "case_025_g4l4_zipf_b64"])
@pytest.mark.parametrize("layout", ["separate", "chained", "backwards", "strided", "reversed"])
def test_ragged_row_layouts_read_alike(name, layout):
  """Rows are read from their own memory whatever its layout: the chained fast path (rows that
  are consecutive slices of one array) and the per-row path give the reference's output."""
  case, expected = load(name)
  assert all(f.get("layout") != "dense" for f in case["features"])
  specs = specs_from_resolved(case)
  cfg = case["config"]
  args = (cfg["local_device_count"], cfg["global_device_count"], cfg["num_sc_per_device"])
  for id_type, weight_type in ((np.int32, np.float32), (np.int64, np.float64)):
    feats = [ragged_views(f["ids"], id_type, layout) for f in case["features"]]
    weights = None
    if cfg.get("weights"):
      weights = [ragged_views(f["weights"] if f["weights"] is not None else [[1.0] * len(r) for r in f["ids"]],
                              weight_type, layout) for f in case["features"]]
    assert_matches(expected, *scp.preprocess_sparse_dense_matmul_input(feats, weights, specs, *args))
  # Weights whose rows do not match the ids' row by row are refused, in any layout.
  if cfg.get("weights"):
    rows = case["features"][0]["ids"]
    shifted = [[1.0] * len(r) for r in rows[1:]] + [[1.0] * len(rows[0])]
    if [len(r) for r in shifted] != [len(r) for r in rows]:
      feats = [ragged_views(f["ids"], np.int32, layout) for f in case["features"]]
      bad = [ragged_views(shifted, np.float32, layout)] + [
          ragged_views(f["weights"] if f["weights"] is not None else [[1.0] * len(r) for r in f["ids"]], np.float32, layout)
          for f in case["features"][1:]]
      with pytest.raises(ValueError, match="weights"):
        scp.preprocess_sparse_dense_matmul_input(feats, bad, specs, *args)


def test_dense_input_dtypes():
  case, expected = load("case_029_dense_layout_g2l2")
  specs = specs_from_resolved(case)
  cfg = case["config"]
  for dtype in (np.int32, np.int64, np.int16, np.uint16):
    feats = [array(f["ids"], dtype, True) for f in case["features"]]
    weights = [array(f["weights"], np.float64, True) for f in case["features"]]  # cast to f32 like the reference
    out, stats = scp.preprocess_sparse_dense_matmul_input(feats, weights, specs, cfg["local_device_count"],
                                                          cfg["global_device_count"], cfg["num_sc_per_device"])
    assert_matches(expected, out, stats)
  # Non-contiguous views are read in place.
  feats = [np.asfortranarray(array(f["ids"], np.int32, True)) for f in case["features"]]
  weights = [array(f["weights"], np.float32, True) for f in case["features"]]
  assert_matches(expected, *scp.preprocess_sparse_dense_matmul_input(
      feats, weights, specs, cfg["local_device_count"], cfg["global_device_count"], cfg["num_sc_per_device"]))


def test_concurrent_calls_from_threads():
  """The GIL is released while preprocessing: calls from several threads all finish correctly."""
  case, expected = load("case_025_g4l4_zipf_b64")
  prep_cfg = arrow_config(case)
  rb = record_batch(case)
  errors = []

  def work():
    try:
      p = scp.Preprocessor(prep_cfg)
      for _ in range(5):
        assert_matches(expected, *p(rb))
    except Exception as e:  # collected and re-raised on the main thread
      errors.append(e)

  threads = [threading.Thread(target=work) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors


def test_drop_in_state_is_reused_but_specs_are_read_every_call():
  # The native state is cached between calls; a spec edited in place (a limit lowered) must still
  # take effect, a failed call must not poison the next one, and reused gather buffers must not
  # leak the previous batch's rows.
  specs, ids = spec_example_specs(), spec_example_ids()
  first, _ = scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  specs["f"].table_spec.stacked_table_spec.max_ids_per_partition = 2
  with pytest.raises(scp.LimitExceededError):
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  specs["f"].table_spec.stacked_table_spec.max_ids_per_partition = 8
  again, stats = scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
    np.testing.assert_array_equal(getattr(again, field)["t"], getattr(first, field)["t"])
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 4])
  # Fewer ids through the same cached state: only this batch's ids count. Sample 1 (SparseCore 1)
  # is now empty, so the maxima come from sample 0 alone: partition 0 holds ids 0, 2, 4 (the
  # three 0s combine into one entry), partition 1 holds id 1.
  short = {"f": np.empty(2, dtype=object)}
  short["f"][0], short["f"][1] = ids["f"][0], np.array([], dtype=np.int32)
  _, stats = scp.preprocess_sparse_dense_matmul_input(short, None, specs, 1, 1, 2)
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 1])
  np.testing.assert_array_equal(stats.required_buffer_size_per_sc["t"], [16, 0])  # 3 and 1 entries, each rounded up to 8


def test_native_spec_reader_reads_as_the_python_one():
  # The native reader returns exactly what the Python reader does for plain specs, and leaves
  # anything it does not take (numpy ints, bools, shapes of other types, properties that
  # raise) to the Python reader, whose answer the call then uses.
  from sparsecore_prep import _native, _specs

  def python(leaves):
    return tuple(_specs._spec_tuple_fast(s) for s in leaves)

  spec = spec_example_specs()["f"]
  spec._id_transformation = SimpleNamespace(row_offset=8, col_offset=2, col_shift=1)
  spec.table_spec.stacked_table_spec.suggested_coo_buffer_size_per_device = 64
  assert _native.spec_tuples([spec]) == python([spec])
  assert _specs._spec_tuples([spec], [spec]) == python([spec])
  spec.output_shape = None
  spec.input_shape = (3, 4, 1)
  assert _native.spec_tuples([spec]) == python([spec]) and python([spec])[0][0][4] == 12
  unusual = [("max_ids_per_partition", np.int64(8)), ("max_ids_per_partition", True),
             ("combiner", np.str_("sum"))]
  for attribute, value in unusual:
    stacked = spec.table_spec.stacked_table_spec
    old, stacked.__dict__[attribute] = getattr(stacked, attribute), value
    assert _native.spec_tuples([spec]) is None, attribute
    assert list(_specs._spec_tuples([spec], [spec])) == list(python([spec])), attribute
    stacked.__dict__[attribute] = old
  spec.input_shape = np.array([3, 1])
  assert _native.spec_tuples([spec]) is None
  assert list(_specs._spec_tuples([spec], [spec])) == list(python([spec]))
  spec.input_shape = [2**40, 2**40, 1]  # a product past 2**64
  assert _native.spec_tuples([spec]) is None
  del spec.table_spec.stacked_table_spec.combiner
  with pytest.raises(scp.FeatureSpecError, match="combiner"):
    _specs._spec_tuples([spec], [spec])


def _whole_output(out):
  """Every array of a result, whole (padding included), copied."""
  m = out.sparse_dense_matmul_input
  return {f: {k: np.array(v) for k, v in getattr(m, f).items()}
          for f in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains")}


def _assert_same_output(a, b):
  for field, stacks in a.items():
    for name, arr in stacks.items():
      np.testing.assert_array_equal(arr.view(np.uint32) if arr.dtype == np.float32 else arr,
                                    b[field][name].view(np.uint32) if arr.dtype == np.float32 else b[field][name],
                                    err_msg=f"{field}[{name}]")


def _data_ptr(a):
  return a.__array_interface__["data"][0]


def test_output_memory_is_reused_only_after_numpy_frees_it():
  # The arrays a call returns are views of buffers that go back to the drop-in state when numpy
  # frees them. Arrays still alive must never be overwritten by a later call; freed ones are
  # reused, and a reused buffer must not leak the earlier batch (padding included).
  case_a, _ = load("case_025_g4l4_zipf_b64")
  specs = specs_from_resolved(case_a)
  opts = dict(local_device_count=case_a["config"]["local_device_count"],
              global_device_count=case_a["config"]["global_device_count"],
              num_sc_per_device=case_a["config"]["num_sc_per_device"])
  assert all(f.get("layout", "ragged") == "ragged" for f in case_a["features"])
  feats = [array(f["ids"], np.int64, False) for f in case_a["features"]]
  # A second batch of the same shape with other ids: every row reversed and shifted by one.
  vocab = {t["name"]: t["vocabulary_size"] for t in case_a["tables"]}
  other = [array([[(v + 1) % vocab[f["table"]] for v in r[::-1]] for r in f["ids"]], np.int64, False)
           for f in case_a["features"]]

  fresh_other = _whole_output(scp.preprocess_sparse_dense_matmul_input(other, None, specs, **opts)[0])
  kept, _ = scp.preprocess_sparse_dense_matmul_input(feats, None, specs, **opts)
  kept_copy = _whole_output(kept)
  # `kept` is alive: the next call must use other memory and leave it untouched.
  second, _ = scp.preprocess_sparse_dense_matmul_input(other, None, specs, **opts)
  for field in kept_copy:
    for name in kept_copy[field]:
      assert not np.shares_memory(getattr(kept.sparse_dense_matmul_input, field)[name],
                                  getattr(second.sparse_dense_matmul_input, field)[name])
  _assert_same_output(kept_copy, _whole_output(kept))
  _assert_same_output(fresh_other, _whole_output(second))
  # Free `kept` (its buffers return to the pool): the next call reuses exactly that memory, and
  # its output is the other batch's, byte for byte.
  name = next(iter(kept_copy["lhs_embedding_ids"]))
  freed = _data_ptr(kept.sparse_dense_matmul_input.lhs_embedding_ids[name])
  del kept
  gc.collect()
  third, _ = scp.preprocess_sparse_dense_matmul_input(other, None, specs, **opts)
  reused = third.sparse_dense_matmul_input.lhs_embedding_ids[name]
  assert type(reused.base).__name__ == "PooledBuffer" and _data_ptr(reused) == freed
  _assert_same_output(fresh_other, _whole_output(third))
  # And the arrays are ordinary, writable numpy arrays.
  arr = third.sparse_dense_matmul_input.lhs_gains[name]
  assert arr.flags.writeable and arr.dtype == np.float32
  # A batch that writes nothing (every row empty) into the freed memory of that one: what the
  # larger batch wrote is rewritten, so every segment is all tail, all zeros.
  empty = [array([[] for _ in f["ids"]], np.int64, False) for f in case_a["features"]]
  del third, reused, arr
  gc.collect()
  fourth, _ = scp.preprocess_sparse_dense_matmul_input(empty, None, specs, **opts)
  assert _data_ptr(fourth.sparse_dense_matmul_input.lhs_embedding_ids[name]) == freed
  for field, stacks in _whole_output(fourth).items():
    for stack, a in stacks.items():
      assert not a.any(), f"{field}[{stack}] holds {a[a != 0][:8]} in an empty batch"


def _stub(name):
  import ast

  with open(os.path.join(os.path.dirname(scp.__file__), name)) as fh:
    return ast.parse(fh.read())


def test_stubs_cover_the_public_api():
  """__init__.pyi declares every name of __all__, with the runtime signatures of the functions;
  _native.pyi declares every class and function of the extension and their methods."""
  import ast
  import inspect

  tree = _stub("__init__.pyi")
  declared = {}
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      declared[node.name] = node
    elif isinstance(node, ast.ImportFrom):
      for alias in node.names:
        declared[alias.asname or alias.name] = node
  assert set(scp.__all__) <= set(declared), set(scp.__all__) - set(declared)
  for name in scp.__all__:
    node, obj = declared[name], getattr(scp, name)
    if isinstance(node, ast.FunctionDef):
      a = node.args
      stub = [p.arg for p in a.args] + ["*"] + [p.arg for p in a.kwonlyargs]
      params = inspect.signature(obj).parameters.values()
      runtime = [p.name for p in params if p.kind != p.KEYWORD_ONLY] + ["*"] + [
          p.name for p in params if p.kind == p.KEYWORD_ONLY]
      assert stub == runtime, name
      stub_defaults = [ast.literal_eval(d) for d in a.defaults]
      runtime_defaults = [p.default for p in params if p.kind != p.KEYWORD_ONLY and p.default is not p.empty]
      assert stub_defaults == runtime_defaults, name
  body = _stub("_native.pyi").body
  native = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  # Module constants, declared with their type; each must be an int at run time.
  constants = {n.target.id for n in body if isinstance(n, ast.AnnAssign) and not n.target.id.startswith("_")}
  public = {n for n in dir(scp._native) if not n.startswith("_")}
  assert public == set(native) | constants, public ^ (set(native) | constants)
  assert all(isinstance(getattr(scp._native, c), int) for c in constants), constants
  for name, node in native.items():
    if isinstance(node, ast.ClassDef):
      methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
      runtime = {m for m in dir(getattr(scp._native, name)) if not m.startswith("_")}
      assert methods == runtime, (name, methods ^ runtime)
