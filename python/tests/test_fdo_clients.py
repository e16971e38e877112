"""The FDO loop with the reference's own clients and our stats.

`NPZFileFDOClient` and `CSVFileFDOClient` (jax_tpu_embedding.sparsecore.lib.fdo) record, publish
and load the stats our drop-in returns, `embedding.update_preprocessing_parameters` takes what
they load, and preprocessing run again with the raised limits drops nothing. keras-rs's
update_stats step (process_allgather, max, update, run again) is the same loop without files.
Every step is compared with the same loop on the reference alone.

REQUIRE_REFERENCE=1 (CI) turns a missing reference into a failure instead of a skip.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from reference import compare, require_module
import sparsecore_prep as scp

L, G, S = 2, 2, 4


@pytest.fixture
def embedding():
  mod = require_module("jax_tpu_embedding.sparsecore.lib.nn.embedding")
  yield mod
  while scp.is_installed():
    scp.uninstall()


def _specs(embedding):
  """Two tables stacked into one, with limits far below what the batches need (8 ids per
  partition, no suggested buffer), so that the first pass drops ids."""
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

  tables = [
      embedding_spec.TableSpec(vocabulary_size=v, embedding_dim=8, initializer=jax.nn.initializers.zeros,
                               optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum", name=n,
                               max_ids_per_partition=8, max_unique_ids_per_partition=8)
      for n, v in (("a", 500), ("b", 200))
  ]
  specs = {
      f: embedding_spec.FeatureSpec(name=f, table_spec=t, input_shape=[128, 1], output_shape=[128, 8])
      for f, t in (("fa", tables[0]), ("fb", tables[1]), ("fb2", tables[1]))
  }
  embedding.auto_stack_tables(specs, global_device_count=G, num_sc_per_device=S,
                              stack_to_max_ids_per_partition=lambda name, batch: 8,
                              stack_to_max_unique_ids_per_partition=lambda name, batch: 8)
  embedding.prepare_feature_specs_for_training(specs, global_device_count=G, num_sc_per_device=S)
  return specs


def _batch(seed: int):
  """One host's 128 samples: skewed ids (a few hot ones), ragged for fb2."""
  rng = np.random.default_rng(seed)
  return {
      "fa": (rng.zipf(1.3, size=(128, 3)) % 500).astype(np.int32),
      "fb": (rng.zipf(1.6, size=(128, 1)) % 200).astype(np.int32),
      "fb2": np.array([(rng.zipf(1.4, size=int(k)) % 200).astype(np.int32) for k in rng.integers(1, 6, size=128)],
                      dtype=object),
  }


def _preprocess(embedding, specs, features):
  return embedding.preprocess_sparse_dense_matmul_input(
      features, None, specs, local_device_count=L, global_device_count=G, num_sc_per_device=S,
      allow_id_dropping=True)


def _limits(embedding, specs):
  return {name: (s.max_ids_per_partition, s.max_unique_ids_per_partition, s.suggested_coo_buffer_size_per_device)
          for name, s in embedding.get_stacked_table_specs(specs).items()}


def _as_case_dict(pre, stats):
  return {
      "row_pointers": pre.lhs_row_pointers, "embedding_ids": pre.lhs_embedding_ids,
      "sample_ids": pre.lhs_sample_ids, "gains": pre.lhs_gains, "num_minibatches": np.asarray(pre.num_minibatches),
      "max_ids_per_partition": stats.max_ids_per_partition,
      "max_unique_ids_per_partition": stats.max_unique_ids_per_partition,
      "required_buffer_size_per_sc": stats.required_buffer_size_per_sc, "id_drop_counters": stats.id_drop_counters,
  }


CASE = {"local_device_count": L, "global_device_count": G, "num_sc_per_device": S}


def _client(kind: str, base_dir):
  require_module("jax_tpu_embedding.sparsecore.lib.fdo")
  if kind == "npz":
    from jax_tpu_embedding.sparsecore.lib.fdo import file_fdo_client
    return file_fdo_client.NPZFileFDOClient(base_dir)
  from jax_tpu_embedding.sparsecore.lib.fdo import csv_file_fdo_client
  return csv_file_fdo_client.CSVFileFDOClient(base_dir)


def _fdo_round(embedding, kind, base_dir, ours: bool):
  """Record three batches' stats, publish, load, update the specs, run the batches again.
  Returns the loaded stats, the limits after the update, and the second pass's results."""
  specs = _specs(embedding)
  client = _client(kind, base_dir)
  batches = [_batch(seed) for seed in range(3)]
  if ours:
    scp.install()
  try:
    first = [_preprocess(embedding, specs, b) for b in batches]
    assert sum(int(n) for _, st in first for n in st.id_drop_counters.values()) > 0, "the limits must drop ids"
    for _, st in first:
      client.record(st)
    client.publish()
    loaded = client.load()
    embedding.update_preprocessing_parameters(specs, loaded, S)
    second = [_preprocess(embedding, specs, b) for b in batches]
  finally:
    if ours:
      scp.uninstall()
  return first, loaded, _limits(embedding, specs), second


@pytest.mark.parametrize("kind", ["npz", "csv"])
def test_reference_fdo_clients_take_our_stats(embedding, kind, tmp_path):
  (tmp_path / "ref").mkdir()
  (tmp_path / "ours").mkdir()
  want_first, want_loaded, want_limits, want_second = _fdo_round(embedding, kind, tmp_path / "ref", ours=False)
  got_first, got_loaded, got_limits, got_second = _fdo_round(embedding, kind, tmp_path / "ours", ours=True)
  for (wp, ws), (gp, gs) in zip(want_first, got_first):
    compare(CASE, _as_case_dict(wp, ws), _as_case_dict(gp, gs))
  # What the client loaded back (from its files) is the same, field by field and stack by stack.
  for field in dataclasses.fields(want_loaded):
    w, g = getattr(want_loaded, field.name), getattr(got_loaded, field.name)
    assert sorted(w) == sorted(g), field.name
    for stack in w:
      np.testing.assert_array_equal(np.asarray(g[stack]), np.asarray(w[stack]), err_msg=f"{field.name} {stack}")
  assert got_limits == want_limits
  # The limits were raised to the observed maxima, so the second pass drops nothing.
  (stack, (max_ids, max_unique, buffer)), = got_limits.items()
  assert max_ids == max(int(np.max(s.max_ids_per_partition[stack])) for _, s in got_first) > 8
  assert max_unique == max(int(np.max(s.max_unique_ids_per_partition[stack])) for _, s in got_first)
  assert buffer == max(int(np.max(s.required_buffer_size_per_sc[stack])) for _, s in got_first) * S
  for (wp, ws), (gp, gs) in zip(want_second, got_second):
    assert all(int(n) == 0 for n in gs.id_drop_counters.values())
    compare(CASE, _as_case_dict(wp, ws), _as_case_dict(gp, gs))


def _update_stats_loop(embedding, ours: bool):
  """keras-rs's DistributedEmbedding update_stats step, batch after batch: gather the stats
  over processes, take maxima, raise the specs' limits where they were exceeded (never lower
  them), and preprocess the batch again with the new limits."""
  import jax
  from jax.experimental import multihost_utils

  specs = _specs(embedding)
  out = []
  if ours:
    scp.install()
  try:
    for seed in range(4):
      features = _batch(10 + seed)
      _, stats = _preprocess(embedding, specs, features)
      all_stats = jax.tree.map(np.max, multihost_utils.process_allgather(stats))
      stacked = embedding.get_stacked_table_specs(specs)
      changed = any(
          all_stats.max_ids_per_partition[n] > s.max_ids_per_partition
          or all_stats.max_unique_ids_per_partition[n] > s.max_unique_ids_per_partition
          or all_stats.required_buffer_size_per_sc[n] * S > (s.suggested_coo_buffer_size_per_device or 0)
          for n, s in stacked.items())
      if changed:
        for n, s in stacked.items():
          all_stats.max_ids_per_partition[n] = np.max([all_stats.max_ids_per_partition[n], s.max_ids_per_partition])
          all_stats.max_unique_ids_per_partition[n] = np.max(
              [all_stats.max_unique_ids_per_partition[n], s.max_unique_ids_per_partition])
          all_stats.required_buffer_size_per_sc[n] = np.max(
              [all_stats.required_buffer_size_per_sc[n], ((s.suggested_coo_buffer_size_per_device or 0) + S - 1) // S])
        embedding.update_preprocessing_parameters(specs, all_stats, S)
      pre, again = _preprocess(embedding, specs, features)
      out.append((changed, _limits(embedding, specs), pre, again))
  finally:
    if ours:
      scp.uninstall()
  return out


def test_keras_rs_update_stats_loop(embedding):
  want = _update_stats_loop(embedding, ours=False)
  got = _update_stats_loop(embedding, ours=True)
  assert want[0][0] and got[0][0], "the first batch must exceed the initial limits"
  for (wc, wl, wp, ws), (gc, gl, gp, gs) in zip(want, got):
    assert (gc, gl) == (wc, wl)
    assert all(int(n) == 0 for n in gs.id_drop_counters.values())
    compare(CASE, _as_case_dict(wp, ws), _as_case_dict(gp, gs))


def test_npz_client_loads_the_maxima_of_our_stats(embedding, tmp_path):
  """What the NPZ client loads after recording our stats of three batches is their element-wise
  maxima."""
  specs = _specs(embedding)
  client = _client("npz", tmp_path)
  with scp.installed():
    stats = [_preprocess(embedding, specs, _batch(seed))[1] for seed in range(3)]
  for st in stats:
    client.record(st)
  client.publish()
  loaded = client.load()
  (stack,) = loaded.max_ids_per_partition
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    want = np.max(np.stack([np.asarray(getattr(s, field)[stack]) for s in stats]), axis=0)
    got = np.asarray(getattr(loaded, field)[stack])
    np.testing.assert_array_equal(np.max(got.reshape(-1, want.size), axis=0), want, err_msg=field)
