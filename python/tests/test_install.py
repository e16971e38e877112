"""sparsecore_prep.install(): the reference's two preprocessing calls routed to ours, inside real
training code: keras-rs's own `create_feature_samples` + `stack_and_shard_samples` and the Flax
linen `SparseCoreEmbed.preprocess_inputs` give the same buffers and stats as without it.

REQUIRE_REFERENCE=1 (CI) turns a missing reference or keras-rs into a failure instead of a skip.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from reference import compare, require_module
import sparsecore_prep as scp
import sparsecore_prep._dropin as dropin

NAMES = ("preprocess_sparse_dense_matmul_input", "preprocess_sparse_dense_matmul_input_from_sparse_tensor")
REFERENCE_MODULE = "jax_tpu_embedding.sparsecore.lib.nn.embedding"


@pytest.fixture
def embedding():
  mod = require_module(REFERENCE_MODULE)
  originals = {n: getattr(mod, n) for n in NAMES}
  yield mod
  # A failed test must not leave ours installed for the next one.
  while scp.is_installed():
    scp.uninstall()
  assert {n: getattr(mod, n) for n in NAMES} == originals


def _public(mod) -> dict:
  return {k: v for k, v in vars(mod).items() if not k.startswith("__")}


def test_install_swaps_the_two_calls_and_nothing_else(embedding):
  before = _public(embedding)
  scp.install()
  after = _public(embedding)
  assert {k for k in before if after[k] is not before[k]} == set(NAMES)
  assert set(after) == set(before)
  for n in NAMES:
    assert after[n] is getattr(dropin, n)
  assert scp.is_installed()
  scp.uninstall()
  assert all(_public(embedding)[k] is v for k, v in before.items())
  assert not scp.is_installed()


def test_installs_nest_and_uninstall_restores(embedding):
  originals = {n: getattr(embedding, n) for n in NAMES}
  scp.install()
  scp.install()  # idempotent: still ours, and the originals are kept, not ours recorded as them
  assert embedding.preprocess_sparse_dense_matmul_input is dropin.preprocess_sparse_dense_matmul_input
  scp.uninstall()
  assert embedding.preprocess_sparse_dense_matmul_input is dropin.preprocess_sparse_dense_matmul_input
  scp.uninstall()
  assert {n: getattr(embedding, n) for n in NAMES} == originals
  scp.uninstall()  # without an open install: nothing
  assert {n: getattr(embedding, n) for n in NAMES} == originals

  with scp.installed():
    with scp.installed():
      assert embedding.preprocess_sparse_dense_matmul_input is dropin.preprocess_sparse_dense_matmul_input
    assert embedding.preprocess_sparse_dense_matmul_input is dropin.preprocess_sparse_dense_matmul_input
    assert (embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor
            is dropin.preprocess_sparse_dense_matmul_input_from_sparse_tensor)
  assert {n: getattr(embedding, n) for n in NAMES} == originals

  with pytest.raises(KeyError):
    with scp.installed():
      raise KeyError("inside")
  assert {n: getattr(embedding, n) for n in NAMES} == originals


def test_concurrent_installs_leave_the_originals(embedding):
  originals = {n: getattr(embedding, n) for n in NAMES}
  barrier = threading.Barrier(8)
  seen = []

  def worker():
    barrier.wait()
    for _ in range(200):
      with scp.installed():
        # Inside any open install, both names are ours (never one of each, never the reference's).
        seen.append(tuple(getattr(embedding, n) is getattr(dropin, n) for n in NAMES))

  threads = [threading.Thread(target=worker) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(seen) == 1600 and set(seen) == {(True, True)}
  assert {n: getattr(embedding, n) for n in NAMES} == originals
  assert not scp.is_installed()


def test_missing_reference_is_a_typed_error(monkeypatch):
  # A None entry in sys.modules makes the import fail as it does when the package is absent.
  monkeypatch.setitem(sys.modules, REFERENCE_MODULE, None)
  with pytest.raises(scp.ReferenceNotInstalledError) as info:
    scp.install()
  e = info.value
  assert isinstance(e, ImportError) and isinstance(e, scp.SparseCorePrepError)
  assert e.module == REFERENCE_MODULE
  assert REFERENCE_MODULE in str(e) and "pip install jax-tpu-embedding" in str(e)
  assert not scp.is_installed()
  again = pickle.loads(pickle.dumps(e))
  assert type(again) is scp.ReferenceNotInstalledError and again.module == e.module and str(again) == str(e)


# ---- keras-rs ----------------------------------------------------------------------------------

L, G, S = 2, 2, 4  # two local devices of a two-device job, v5p's four SparseCores each


def _specs(embedding, g: int = G):
  """Three features over two tables, auto-stacked as keras-rs's DistributedEmbedding does."""
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

  tables = [
      embedding_spec.TableSpec(vocabulary_size=v, embedding_dim=d, initializer=jax.nn.initializers.zeros,
                               optimizer=embedding_spec.SGDOptimizerSpec(), combiner=c, name=n,
                               max_ids_per_partition=m, max_unique_ids_per_partition=m)
      for n, v, d, c, m in (("users", 1000, 16, "sum", 64), ("items", 300, 8, "mean", 32))
  ]
  batch = 64  # global batch: one host of 64 samples
  specs = {
      "user": embedding_spec.FeatureSpec(name="user", table_spec=tables[0], input_shape=[batch, 4],
                                         output_shape=[batch, 16]),
      "item": embedding_spec.FeatureSpec(name="item", table_spec=tables[1], input_shape=[batch, 1],
                                         output_shape=[batch, 8]),
      "history": embedding_spec.FeatureSpec(name="history", table_spec=tables[1], input_shape=[batch, 8],
                                            output_shape=[batch, 8]),
  }
  embedding.auto_stack_tables(specs, global_device_count=g, num_sc_per_device=S)
  embedding.prepare_feature_specs_for_training(specs, global_device_count=g, num_sc_per_device=S)
  return specs


def _inputs(seed: int):
  """This host's batch (global batch / hosts = 64 samples): dense, 1-D and ragged features as
  keras-rs users pass them (lists and numpy arrays), with weights for two of them."""
  rng = np.random.default_rng(seed)
  n = 64
  ids = {
      "user": rng.integers(0, 1000, size=(n, 4)),
      "item": [int(x) for x in rng.integers(0, 300, size=n)],
      "history": [list(rng.zipf(1.5, size=int(k)) % 300) for k in rng.integers(1, 9, size=n)],
  }
  weights = {
      "user": rng.random((n, 4)).astype(np.float32),
      "item": np.ones(n, np.float32),
      "history": [list(rng.random(len(h))) for h in ids["history"]],
  }
  return ids, weights


def _as_case_dicts(out, stats):
  """keras-rs's ShardedCooMatrix per stack and the stats, in reference.compare's form."""
  d = {
      "row_pointers": {k: v.shard_ends for k, v in out.items()},
      "embedding_ids": {k: v.col_ids for k, v in out.items()},
      "sample_ids": {k: v.row_ids for k, v in out.items()},
      "gains": {k: v.values for k, v in out.items()},
      "num_minibatches": np.zeros(1),
      "max_ids_per_partition": stats.max_ids_per_partition,
      "max_unique_ids_per_partition": stats.max_unique_ids_per_partition,
      "required_buffer_size_per_sc": stats.required_buffer_size_per_sc,
      "id_drop_counters": stats.id_drop_counters,
  }
  starts = {k: v.shard_starts for k, v in out.items()}
  return d, starts


def _stack_and_shard(embedding_utils, specs, ids, weights):
  samples = embedding_utils.create_feature_samples(specs, ids, weights)
  return embedding_utils.stack_and_shard_samples(specs, samples, L, G, S)


@pytest.mark.parametrize("weighted", [True, False])
def test_keras_rs_stack_and_shard_samples(embedding, weighted):
  embedding_utils = require_module("keras_rs.src.layers.embedding.jax.embedding_utils")
  import jax
  from jax.experimental import multihost_utils

  specs = _specs(embedding)
  case = {"local_device_count": L, "global_device_count": G, "num_sc_per_device": S}
  for seed in range(3):
    ids, weights = _inputs(seed)
    weights = weights if weighted else None
    want_out, want_stats = _stack_and_shard(embedding_utils, specs, ids, weights)
    with scp.installed():
      got_out, got_stats = _stack_and_shard(embedding_utils, specs, ids, weights)
    assert type(got_stats) is type(want_stats) is embedding.SparseDenseMatmulInputStats
    want, want_starts = _as_case_dicts(want_out, want_stats)
    got, got_starts = _as_case_dicts(got_out, got_stats)
    assert sorted(got["row_pointers"]) == sorted(embedding.get_stacked_table_specs(specs))
    compare(case, want, got)
    for stack in want_starts:
      np.testing.assert_array_equal(got_starts[stack], want_starts[stack])
    assert sum(int(v) for v in got_stats.id_drop_counters.values()) == 0

    # keras-rs's update_stats step gathers the stats over processes (one here) and takes maxima.
    gathered = {name: jax.tree.map(np.max, multihost_utils.process_allgather(s))
                for name, s in (("want", want_stats), ("got", got_stats))}
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
      w, g = getattr(gathered["want"], field), getattr(gathered["got"], field)
      assert sorted(w) == sorted(g)
      for stack in w:
        assert int(g[stack]) == int(w[stack]) == int(np.max(getattr(want_stats, field)[stack])), (field, stack)


# ---- Flax linen SparseCoreEmbed.preprocess_inputs -----------------------------------------------


def test_flax_linen_preprocess_inputs(embedding, monkeypatch):
  linen = require_module("jax_tpu_embedding.sparsecore.lib.flax.linen.embed")
  import jax
  from jax_tpu_embedding.sparsecore.utils import utils

  # The layer asks its first device for the SparseCore count, which a CPU does not have: it is
  # given v5p's here. Its mesh is all devices (one CPU), so L = G = 1.
  monkeypatch.setitem(utils.NUM_SC_PER_DEVICE_MAP, jax.devices()[0].device_kind, S)
  specs = _specs(embedding, g=jax.device_count())
  layer = linen.SparseCoreEmbed(feature_specs=specs)
  l, g, s = layer.mesh.local_mesh.size, layer.mesh.size, layer.num_sc_per_device
  assert s == S
  case = {"local_device_count": l, "global_device_count": g, "num_sc_per_device": s}
  ids, weights = _inputs(7)
  features = {
      "user": np.asarray(ids["user"], np.int32),
      "item": np.asarray(ids["item"], np.int32).reshape(-1, 1),
      "history": np.array([np.asarray(h, np.int32) for h in ids["history"]], dtype=object),
  }
  feature_weights = {
      "user": weights["user"],
      "item": weights["item"].reshape(-1, 1),
      "history": np.array([np.asarray(w, np.float32) for w in weights["history"]], dtype=object),
  }
  for step, w in ((0, feature_weights), (1, None)):
    want = layer.preprocess_inputs(step, features, w)
    with scp.installed():
      got = layer.preprocess_inputs(step, features, w)
    assert type(got) is type(want)
    as_dict = lambda p: {  # noqa: E731
        "row_pointers": p.lhs_row_pointers, "embedding_ids": p.lhs_embedding_ids, "sample_ids": p.lhs_sample_ids,
        "gains": p.lhs_gains, "num_minibatches": np.asarray(p.num_minibatches), "max_ids_per_partition": {},
        "max_unique_ids_per_partition": {}, "required_buffer_size_per_sc": {}, "id_drop_counters": {}}
    compare(case, as_dict(want), as_dict(got))
