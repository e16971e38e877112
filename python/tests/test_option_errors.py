"""The drop-in's option errors are jax-tpu-embedding 0.2.0's ValueErrors, in its order and with its
texts (0.1.0 aborted the process on most of them). The texts below were printed by 0.2.0 itself
for the same calls; with 0.2.0 installed, the test also makes each call there."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import sparsecore_prep as scp

HERE = os.path.dirname(os.path.abspath(__file__))

# (local_device_count, global_device_count, num_sc_per_device, sharding_strategy) -> 0.2.0's text.
CASES = [
    ((0, 1, 4, "MOD"), "local_device_count must be greater than 0, but got 0"),
    ((-1, 1, 4, "MOD"), "local_device_count must be greater than 0, but got -1"),
    ((1, 0, 4, "MOD"), "global_device_count must be greater than 0, but got 0"),
    ((1, -2, 4, "MOD"), "global_device_count must be greater than 0, but got -2"),
    ((1, 1, 0, "MOD"), "Invalid num_sc_per_device: 0"),
    ((1, 3, 4, "MOD"), "Total number of SparseCores (12) must be a power of 2."),
    ((2, 1, 4, "MOD"), "global_device_count must be greater than or equal to local_device_count, but got 1 vs 2"),
    ((1, 1, 4, "DIV"), "Unsupported sharding strategy: DIV. Only MOD is supported."),
    # Several wrong at once: the first of 0.2.0's checks wins.
    ((0, 1, 4, "DIV"), "Unsupported sharding strategy: DIV. Only MOD is supported."),
    ((0, 0, 4, "MOD"), "local_device_count must be greater than 0, but got 0"),
    ((0, 1, 3, "MOD"), "Invalid num_sc_per_device: 3"),
    ((4, 3, 4, "MOD"), "global_device_count must be greater than or equal to local_device_count, but got 3 vs 4"),
    ((2, 0, 4, "MOD"), "global_device_count must be greater than 0, but got 0"),
]


def duck_spec(batch=8):
  stacked = SimpleNamespace(combiner="sum", max_ids_per_partition=64, max_unique_ids_per_partition=64,
                            suggested_coo_buffer_size_per_device=None)
  table = SimpleNamespace(name="t", vocabulary_size=64, embedding_dim=8, stacked_table_spec=stacked,
                          setting_in_stack=SimpleNamespace(stack_name="t"))
  # 0.2.0's specs also carry these; preprocessing reads neither.
  table.activation_mem_bytes_limit = 2097152
  table.quantization_config = None
  return SimpleNamespace(name="f", table_spec=table, output_shape=[batch, 8], _id_transformation=None)


def rows(n):
  r = np.empty(n, dtype=object)
  for i in range(n):
    r[i] = np.array([i % 64], np.int32)
  return r


@pytest.mark.parametrize("options,text", CASES, ids=[str(c[0]) for c in CASES])
def test_option_errors_are_the_reference_texts(options, text):
  local, global_, sc, strategy = options
  with pytest.raises(ValueError) as e:
    scp.preprocess_sparse_dense_matmul_input({"f": rows(8)}, None, {"f": duck_spec()}, local, global_, sc,
                                             sharding_strategy=strategy)
  assert isinstance(e.value, scp.ConfigError)
  assert str(e.value) == text
  with pytest.raises(scp.ConfigError) as e:
    scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        {"f": np.zeros((0, 2), np.int64)}, {"f": np.zeros(0, np.int32)}, {"f": np.array([8, 1])},
        {"f": duck_spec()}, local, global_, sc, sharding_strategy=strategy)
  assert str(e.value) == text


def test_empty_input():
  for call in (lambda: scp.preprocess_sparse_dense_matmul_input({}, None, {}, 1, 1, 4),
               lambda: scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor({}, {}, {}, {}, 1, 1, 4)):
    with pytest.raises(scp.ConfigError) as e:
      call()
    assert str(e.value) == "input_batches cannot be empty."


def test_too_many_rows_per_device():
  n = 2**26  # one more than the sort key's 26-bit payload holds
  with pytest.raises(scp.InvalidInputError) as e:
    scp.preprocess_sparse_dense_matmul_input({"f": np.zeros((n, 1), np.int32)}, None, {"f": duck_spec(n)}, 1, 1, 4)
  assert str(e.value) == ("The total local batch size for device (including stacked tables) exceeds the maximum "
                          "limit supported by the SparseCore CooFormat sorting key (67108863).")


def test_num_sc_per_device_none_on_a_cpu():
  jax = pytest.importorskip("jax")
  if jax.devices()[0].platform != "cpu":
    pytest.skip("runs where the first device is a CPU")
  with pytest.raises(scp.ConfigError) as e:
    scp.preprocess_sparse_dense_matmul_input({"f": rows(8)}, None, {"f": duck_spec()}, 1, 1)
  assert isinstance(e.value, ValueError)
  # The installed reference's own text (0.2.0 appends the device kinds it knows), else 0.1.0's.
  try:
    from jax_tpu_embedding.sparsecore.utils import utils
  except ImportError:
    want = "Unknown sparsecore count for device kind: cpu"
  else:
    with pytest.raises(ValueError) as ref_error:
      utils.num_sparsecores_per_device()
    want = str(ref_error.value)
  assert str(e.value) == want
  assert want.startswith("Unknown sparsecore count for device kind: cpu")


def test_same_texts_as_the_installed_reference_020():
  try:
    from importlib.metadata import version

    if version("jax-tpu-embedding") != "0.2.0":
      pytest.skip("needs jax-tpu-embedding 0.2.0 (0.1.0 aborts on these)")
  except Exception:
    pytest.skip("needs jax-tpu-embedding 0.2.0")
  from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

  table = embedding_spec.TableSpec(vocabulary_size=64, embedding_dim=8, initializer=lambda *a: None,
                                   optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum", name="t",
                                   max_ids_per_partition=64, max_unique_ids_per_partition=64)
  feat = embedding_spec.FeatureSpec(table_spec=table, input_shape=(8, 1), output_shape=(8, 8), name="f")
  embedding.prepare_feature_specs_for_training(feat, global_device_count=1, num_sc_per_device=4)
  for (local, global_, sc, strategy), text in CASES:
    for call in (embedding.preprocess_sparse_dense_matmul_input, scp.preprocess_sparse_dense_matmul_input):
      with pytest.raises(ValueError) as e:
        call({"f": rows(8)}, None, {"f": feat}, local_device_count=local, global_device_count=global_,
             num_sc_per_device=sc, sharding_strategy=strategy)
      assert str(e.value) == text, call
