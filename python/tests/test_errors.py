"""The package's exceptions: classes in `sparsecore_prep`, picklable with their fields (so that a
`ProcessPoolExecutor`, Ray or Spark worker's error reaches the parent as itself), strict configs
and stats files, feature specs missing an attribute, and unsigned ids reported as given.

Each error is raised for real (by the Rust core or the drop-in call), never built by hand, except
where a test says so.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

import sparsecore_prep as scp
from test_api import arrow_config, load, record_batch, spec_example_ids, spec_example_specs

CLASSES = [scp.SparseCorePrepError, scp.ConfigError, scp.InvalidInputError, scp.LimitExceededError, scp.InputTypeError,
           scp.FeatureSpecError]


def _typo_config():
  """case_001's config with `max_ids_per_partitions` (sic) in table t0."""
  case, _ = load("case_001_single_sum_weights_g1")
  cfg = arrow_config(case)
  cfg["tables"][0]["max_ids_per_partitions"] = cfg["tables"][0].pop("max_ids_per_partition")
  return cfg


def raise_one(kind: str):
  """Makes the library raise one kind of error; returns None if it does not (a test failure)."""
  specs, ids = spec_example_specs(), spec_example_ids()
  if kind == "config":
    scp.Preprocessor(_typo_config())
  elif kind == "invalid_input":
    ids["f"][1] = np.array([1, 9], dtype=np.int32)  # vocabulary_size is 8
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  elif kind == "limit":
    specs["f"].table_spec.stacked_table_spec.max_ids_per_partition = 2
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  elif kind == "input_type":
    scp.preprocess_sparse_dense_matmul_input({"f": np.ones((2, 2), np.float32)}, None, specs, 1, 1, 2)
  elif kind == "arrow_column_type":
    import pyarrow as pa

    case, _ = load("case_001_single_sum_weights_g1")
    bad = pa.RecordBatch.from_arrays([pa.array([1.0, 2.0]), pa.array([[1.0], [1.0]], type=pa.list_(pa.float32()))],
                                     names=["f0", "f0__w"])
    scp.Preprocessor(arrow_config(case))(bad)
  elif kind == "feature_spec":
    del specs["f"].table_spec.vocabulary_size
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2)
  elif kind == "base":  # the base class is never raised by the library: built by hand
    raise scp.SparseCorePrepError("the base class")
  return None


def catch(kind: str):
  """The exception `raise_one(kind)` raises, in this process."""
  try:
    raise_one(kind)
  except scp.SparseCorePrepError as e:
    return e
  raise AssertionError(f"{kind}: nothing raised")


KINDS = {
    "config": scp.ConfigError,
    "invalid_input": scp.InvalidInputError,
    "limit": scp.LimitExceededError,
    "input_type": scp.InputTypeError,
    "arrow_column_type": scp.InputTypeError,
    "feature_spec": scp.FeatureSpecError,
    "base": scp.SparseCorePrepError,
}


def test_every_class_is_the_packages_and_a_standard_exception():
  assert set(KINDS.values()) == set(CLASSES)
  for cls in CLASSES:
    assert cls.__module__ == "sparsecore_prep" and getattr(scp, cls.__name__) is cls and cls.__name__ in scp.__all__
  for cls in (scp.ConfigError, scp.InvalidInputError, scp.LimitExceededError):
    assert issubclass(cls, ValueError)
  for cls in (scp.InputTypeError, scp.FeatureSpecError):
    assert issubclass(cls, TypeError)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_errors_pickle_with_message_and_fields(kind):
  e = catch(kind)
  assert type(e) is KINDS[kind]
  back = pickle.loads(pickle.dumps(e))
  assert type(back) is type(e) and str(back) == str(e) and back.args == e.args
  assert back.field_values() == e.field_values()


def test_error_fields():
  e = catch("limit")
  # The first SparseCore over a limit is reported (SparseCore 0 sends 3 ids to partition 0; 1
  # sends 4 to partition 1), as the reference checks its SparseCores in order.
  assert e.field_values() == {"stack": "t", "limit_name": "max_ids_per_partition", "observed": 3, "limit": 2,
                              "device": 0, "sparsecore": 0, "partition": 0}
  assert "Observed max ids per partition: 3" in str(e)
  e = catch("invalid_input")
  assert e.field_values() == {"feature": "f", "row": 1, "id": 9}
  assert str(e) == "feature `f` (table `t`), sample row 1: id 9 is outside [0, vocabulary_size 8)"
  e = catch("config")
  assert e.field_values() == {"field": "max_ids_per_partitions", "location": "table `t0`",
                              "suggestion": "max_ids_per_partition"}
  e = catch("arrow_column_type")
  assert e.feature == "f0" and e.column == "f0" and "f0" in str(e)
  e = catch("feature_spec")
  assert e.field_values() == {"feature": "f", "attribute": "table_spec.vocabulary_size"}
  e = catch("input_type")
  assert e.feature == "f" and e.column is None


def _remote(context: str, kinds):
  """(kind, exception raised in a worker process) pairs, from a pool of `context` processes.

  A worker that hangs (a thread pool that did not survive fork) fails the test after a timeout
  instead of blocking it.
  """
  ex = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(context))
  try:
    futures = {kind: ex.submit(raise_one, kind) for kind in kinds}
    out = []
    for kind, fut in futures.items():
      exc = fut.exception(timeout=120)
      assert exc is not None, f"{kind}: the worker raised nothing (returned {fut.result()!r})"
      out.append((kind, exc))
    return out
  finally:
    for p in list(getattr(ex, "_processes", {}).values()):
      p.kill()
    ex.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_errors_cross_a_process_pool(context):
  """Raised in a ProcessPoolExecutor worker, each error reaches the parent as the same class with
  the same message and fields. With `fork` (Linux's default before Python 3.14), the parent has
  already preprocessed batches (its thread pool is running): the child starts its own."""
  local = {kind: catch(kind) for kind in KINDS}
  remote = _remote(context, sorted(KINDS))
  assert len(remote) == len(KINDS)
  for kind, exc in remote:
    want = local[kind]
    assert type(exc) is type(want), (kind, exc)
    assert str(exc) == str(want) and exc.field_values() == want.field_values(), kind


def _ok_in_worker():
  out, stats = scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, spec_example_specs(), 1, 1, 2)
  return out.lhs_row_pointers["t"].tolist(), stats.max_ids_per_partition["t"].tolist()


def _preprocessor_in_worker(prep, rb):
  _, stats = prep(rb)
  return stats.max_ids_per_partition["t0"].tolist()


def test_calls_work_in_a_forked_child():
  """A child forked after the parent preprocessed (and built a Preprocessor with its own pool)
  computes the same results as the parent."""
  want = _ok_in_worker()
  case, _ = load("case_001_single_sum_weights_g1")
  prep = scp.Preprocessor(arrow_config(case), threads=2)
  rb = record_batch(case)
  want_prep = _preprocessor_in_worker(prep, rb)
  ex = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
  try:
    results = [ex.submit(_ok_in_worker) for _ in range(3)]
    # `prep` is inherited by the fork, not pickled: its pool's threads are not.
    inherited = [ex.submit(_preprocessor_in_worker, prep, rb) for _ in range(2)]
    assert [f.result(timeout=120) for f in results] == [want] * 3
    assert [f.result(timeout=120) for f in inherited] == [want_prep] * 2
    assert want[1] == [3, 4]
  finally:
    for p in list(getattr(ex, "_processes", {}).values()):
      p.kill()
    ex.shutdown(wait=True, cancel_futures=True)


# -----------------------------------------------------------------------------
# Strict configs and stats files
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dict", "json", "path"])
def test_config_typo_names_the_field_the_table_and_the_fix(form, tmp_path):
  cfg = _typo_config()
  arg = {"dict": cfg, "json": json.dumps(cfg), "path": tmp_path / "cfg.json"}[form]
  if form == "path":
    arg.write_text(json.dumps(cfg))
  with pytest.raises(scp.ConfigError) as e:
    scp.Preprocessor(arg)
  assert str(e.value) == ("unknown field `max_ids_per_partitions` in table `t0`; "
                          "did you mean `max_ids_per_partition`?")
  assert isinstance(e.value, ValueError)


def test_config_typos_elsewhere():
  case, _ = load("case_001_single_sum_weights_g1")
  cfg = arrow_config(case)
  cfg["config"]["allow_id_droping"] = True
  with pytest.raises(scp.ConfigError, match=r"unknown field `allow_id_droping` in `config`; did you mean "
                                            r"`allow_id_dropping`\?") as e:
    scp.Preprocessor(cfg)
  assert e.value.location == "`config`" and e.value.suggestion == "allow_id_dropping"
  cfg = arrow_config(case)
  cfg["features"][0]["weight_column"] = cfg["features"][0].pop("weights_column")
  with pytest.raises(scp.ConfigError, match="unknown field `weight_column` in feature `f0`; did you mean "
                                            "`weights_column`"):
    scp.Preprocessor(cfg)
  # Nothing close: no suggestion.
  cfg = arrow_config(case)
  cfg["colour"] = "blue"
  with pytest.raises(scp.ConfigError) as e:
    scp.Preprocessor(cfg)
  assert e.value.field == "colour" and e.value.suggestion is None and "did you mean" not in str(e.value)
  # tune() reads the config strictly too.
  prep = scp.Preprocessor(arrow_config(case))
  stats = prep.fdo_stats(record_batch(case))
  with pytest.raises(scp.ConfigError, match="max_ids_per_partitions"):
    stats.tune(_typo_config())


def test_stats_file_typo_names_the_field_and_the_stack():
  case, _ = load("case_001_single_sum_weights_g1")
  stats = scp.Preprocessor(arrow_config(case)).fdo_stats(record_batch(case))
  d = stats.to_dict()
  assert scp.FdoStats.from_json(json.dumps(d)) == stats
  d["stacks"]["t0"]["max_id_per_partition"] = d["stacks"]["t0"].pop("max_ids_per_partition")
  with pytest.raises(scp.ConfigError) as e:
    scp.FdoStats.from_json(json.dumps(d))
  assert e.value.field == "max_id_per_partition" and e.value.suggestion == "max_ids_per_partition"
  assert "t0" in e.value.location and "t0" in str(e.value)
  with pytest.raises(scp.ConfigError, match="FDO stats"):
    scp.FdoStats.from_json("{not json")


# -----------------------------------------------------------------------------
# Duck-typed feature specs
# -----------------------------------------------------------------------------

REQUIRED = ["name", "table_spec.name", "table_spec.vocabulary_size", "table_spec.setting_in_stack.stack_name",
            "table_spec.stacked_table_spec.combiner", "table_spec.stacked_table_spec.max_ids_per_partition",
            "table_spec.stacked_table_spec.max_unique_ids_per_partition",
            "table_spec.stacked_table_spec.suggested_coo_buffer_size_per_device"]
OPTIONAL = ["_id_transformation", "table_spec.embedding_dim", "output_shape"]


def _without(dotted: str):
  specs = spec_example_specs()
  *parents, last = dotted.split(".")
  obj = specs["f"]
  for p in parents:
    obj = getattr(obj, p)
  delattr(obj, last)
  return specs


@pytest.mark.parametrize("attribute", REQUIRED)
def test_a_missing_spec_attribute_names_the_feature_and_the_attribute(attribute):
  with pytest.raises(scp.FeatureSpecError) as e:
    scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, _without(attribute), 1, 1, 2)
  feature = "feature_specs['f']" if attribute == "name" else "f"
  assert e.value.field_values() == {"feature": feature, "attribute": attribute}
  assert f"`{attribute}` is missing" in str(e.value) and "feature_specs['f']" in str(e.value)
  assert isinstance(e.value, TypeError) and not isinstance(e.value, AttributeError)


@pytest.mark.parametrize("attribute", OPTIONAL)
def test_optional_spec_attributes(attribute):
  """The attributes the output does not depend on may be absent; the output is the SPEC 3.9
  example's either way."""
  out, stats = scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, _without(attribute), 1, 1, 2)
  np.testing.assert_array_equal(out.lhs_row_pointers["t"][:8], [3, 9, 16, 16, 16, 16, 16, 16])
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 4])


def test_spec_values_of_the_wrong_type():
  specs = spec_example_specs()
  specs["f"].table_spec.stacked_table_spec.max_ids_per_partition = 8.5
  with pytest.raises(scp.FeatureSpecError, match=r"`table_spec.stacked_table_spec.max_ids_per_partition` is 8.5, "
                                                 r"not an integer") as e:
    scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, specs, 1, 1, 2)
  assert e.value.feature == "f"
  specs = spec_example_specs()
  specs["f"]._id_transformation = SimpleNamespace(row_offset=0, col_offset=-8, col_shift=0)
  with pytest.raises(scp.FeatureSpecError, match=r"`_id_transformation.col_offset` is -8, must not be negative"):
    scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, specs, 1, 1, 2)
  # numpy integers are integers.
  specs = spec_example_specs()
  specs["f"].table_spec.vocabulary_size = np.int64(8)
  _, stats = scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, specs, 1, 1, 2)
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 4])
  # A bad value the core rejects is a ConfigError naming where.
  specs["f"].table_spec.stacked_table_spec.combiner = "median"
  with pytest.raises(scp.ConfigError, match="unknown combiner") as e:
    scp.preprocess_sparse_dense_matmul_input(spec_example_ids(), None, specs, 1, 1, 2)
  assert e.value.location == "stack `t`"


def test_option_errors_are_config_errors():
  specs, ids = spec_example_specs(), spec_example_ids()
  with pytest.raises(scp.ConfigError, match="Unsupported sharding strategy") as e:
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, 2, sharding_strategy="DIV")
  assert e.value.field == "sharding_strategy"
  with pytest.raises(scp.ConfigError, match="power of 2") as e:
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 3, 2)
  assert e.value.field == "num_sc_per_device"
  with pytest.raises(scp.ConfigError) as e:
    scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, None)
  assert e.value.field == "num_sc_per_device"
  # As the reference's functions: only the SparseCore counts of real TPUs, with its message.
  for bad in (1, 8, 3):
    with pytest.raises(ValueError, match=f"^Invalid num_sc_per_device: {bad}$") as e:
      scp.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1, bad)
    assert isinstance(e.value, scp.ConfigError) and e.value.field == "num_sc_per_device"


# -----------------------------------------------------------------------------
# Unsigned ids, reported exactly as given
# -----------------------------------------------------------------------------


def _dense(rows, dtype):
  return {"f": np.array(rows, dtype=dtype)}


@pytest.mark.parametrize("bad", [2**63, 2**64 - 1])
def test_dense_uint64_beyond_int64(bad):
  with pytest.raises(scp.InvalidInputError) as e:
    scp.preprocess_sparse_dense_matmul_input(_dense([[1, 2], [3, bad]], np.uint64), None, spec_example_specs(), 1, 1, 2)
  assert str(e.value) == f"feature `f` (table `t`), sample row 1: id {bad} is outside [0, vocabulary_size 8)"
  assert e.value.field_values() == {"feature": "f", "row": 1, "id": bad}


@pytest.mark.parametrize("dtype, bad", [(np.uint64, 2**40), (np.uint64, 2**63 - 1), (np.uint32, 2**32 - 1),
                                        (np.uint16, 65535), (np.uint8, 255), (np.int64, -(2**63))])
def test_dense_ids_out_of_range_are_printed_as_given(dtype, bad):
  with pytest.raises(scp.InvalidInputError) as e:
    scp.preprocess_sparse_dense_matmul_input(_dense([[bad, 2], [3, 4]], dtype), None, spec_example_specs(), 1, 1, 2)
  assert str(e.value) == f"feature `f` (table `t`), sample row 0: id {bad} is outside [0, vocabulary_size 8)"
  assert e.value.id == bad and e.value.row == 0


@pytest.mark.parametrize("bad", [2**31, 2**63, 2**64 - 1])
def test_ragged_uint64_out_of_range(bad):
  ids = np.empty(2, dtype=object)
  ids[0], ids[1] = np.array([1, 2], np.uint64), np.array([3, bad], np.uint64)
  with pytest.raises(scp.InvalidInputError) as e:
    scp.preprocess_sparse_dense_matmul_input({"f": ids}, None, spec_example_specs(), 1, 1, 2)
  assert f"feature `f`, sample row 1: id {bad} is outside" in str(e.value)
  assert e.value.field_values() == {"feature": "f", "row": 1, "id": bad}


def test_ids_in_range_in_any_unsigned_type_match():
  want = scp.preprocess_sparse_dense_matmul_input(_dense([[0, 2, 4], [1, 3, 5]], np.int32), None,
                                                  spec_example_specs(), 1, 1, 2)
  for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
    got = scp.preprocess_sparse_dense_matmul_input(_dense([[0, 2, 4], [1, 3, 5]], dtype), None, spec_example_specs(),
                                                   1, 1, 2)
    for name in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
      np.testing.assert_array_equal(getattr(got[0], name)["t"], getattr(want[0], name)["t"])
