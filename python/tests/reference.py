"""Running the reference (jax-tpu-embedding) beside our package, for the differential tests.

A *case* is a plain dict (picklable, no reference objects): device layout, options, tables,
features with their data. Both sides build the reference's own FeatureSpecs from it with the
reference's public API (`TableSpec`, `FeatureSpec`, `auto_stack_tables`,
`prepare_feature_specs_for_training`), so our drop-in is fed exactly what a user would feed it.

The reference aborts the whole process on bad input, so it runs in a child process
(`ref_worker.py`) that reads cases from stdin and answers on stdout; when it dies, the case is
reported as an abort and a new worker is started.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def round_up(x, m):
  return (x + m - 1) // m * m


def reference_available() -> bool:
  try:
    import importlib.util

    return importlib.util.find_spec("jax_tpu_embedding") is not None
  except (ImportError, ValueError):
    return False


def require_module(module: str):
  """`module`, imported; a skip when it is missing, or a failure under REQUIRE_REFERENCE=1 (CI)."""
  import importlib

  import pytest

  try:
    return importlib.import_module(module)
  except ImportError as e:
    if os.environ.get("REQUIRE_REFERENCE") == "1":
      raise RuntimeError(f"REQUIRE_REFERENCE=1 but {module} is not importable: {e}") from e
    pytest.skip(f"{module} is not installed")


def build_specs(case):
  """The reference's FeatureSpecs for a case, stacked as case['stacking'] says."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

  g, s = case["global_device_count"], case["num_sc_per_device"]
  tables = {}
  for t in case["tables"]:
    tables[t["name"]] = embedding_spec.TableSpec(
        name=t["name"],
        vocabulary_size=t["vocabulary_size"],
        embedding_dim=t["embedding_dim"],
        initializer=jax.nn.initializers.zeros,
        optimizer=embedding_spec.SGDOptimizerSpec(),
        combiner=t["combiner"],
        max_ids_per_partition=t["max_ids_per_partition"],
        max_unique_ids_per_partition=t["max_unique_ids_per_partition"],
        suggested_coo_buffer_size_per_device=t.get("suggested_coo_buffer_size_per_device"),
    )
  specs = {}
  for f in case["features"]:
    table = tables[f["table"]]
    gb = f["global_batch_size"]
    specs[f["name"]] = embedding_spec.FeatureSpec(
        name=f["name"], table_spec=table, input_shape=[gb, 1], output_shape=[gb, table.embedding_dim])
  if case["stacking"] == "auto":
    lim = case.get("stack_limits", (256, 256))
    embedding.auto_stack_tables(
        specs, global_device_count=g, num_sc_per_device=s,
        stack_to_max_ids_per_partition=lambda name, batch: lim[0],
        stack_to_max_unique_ids_per_partition=lambda name, batch: lim[1])
  embedding.prepare_feature_specs_for_training(specs, global_device_count=g, num_sc_per_device=s)
  return specs


def coo_inputs(case):
  """(indices, values, dense_shapes) as dicts keyed by feature name, for a sparse COO case
  (`case["coo"]`: every feature has `indices`, `values` and `dense_shape`)."""
  indices = {f["name"]: f["indices"] for f in case["features"]}
  values = {f["name"]: f["values"] for f in case["features"]}
  shapes = {f["name"]: f["dense_shape"] for f in case["features"]}
  return indices, values, shapes


def inputs(case):
  """(features, weights or None) as dicts keyed by feature name (a pytree)."""
  feats, weights = {}, {}
  for f in case["features"]:
    feats[f["name"]] = f["ids"]
    if f.get("weights") is not None:
      weights[f["name"]] = f["weights"]
  return feats, (weights or None)


def call_options(case):
  return dict(
      local_device_count=case["local_device_count"],
      global_device_count=case["global_device_count"],
      num_sc_per_device=case["num_sc_per_device"],
      sharding_strategy="MOD",
      has_leading_dimension=case.get("has_leading_dimension", False),
      allow_id_dropping=case["allow_id_dropping"],
      batch_number=0,
      enable_minibatching=case.get("enable_minibatching", False),
  )


def plain(result):
  """(PreprocessedInput, stats) of either side as plain dicts of numpy arrays."""
  out, stats = result
  m = out.sparse_dense_matmul_input
  return {
      "row_pointers": {k: np.asarray(v) for k, v in m.lhs_row_pointers.items()},
      "embedding_ids": {k: np.asarray(v) for k, v in m.lhs_embedding_ids.items()},
      "sample_ids": {k: np.asarray(v) for k, v in m.lhs_sample_ids.items()},
      "gains": {k: np.asarray(v) for k, v in m.lhs_gains.items()},
      "num_minibatches": np.asarray(out.num_minibatches),
      "max_ids_per_partition": {k: np.asarray(v) for k, v in stats.max_ids_per_partition.items()},
      "max_unique_ids_per_partition": {k: np.asarray(v) for k, v in stats.max_unique_ids_per_partition.items()},
      "required_buffer_size_per_sc": {k: np.asarray(v) for k, v in stats.required_buffer_size_per_sc.items()},
      "id_drop_counters": {k: int(v) for k, v in stats.id_drop_counters.items()},
  }


def run_reference_inline(case):
  """Runs the reference in this process (the worker's body)."""
  from jax_tpu_embedding.sparsecore.lib.nn import embedding

  specs = build_specs(case)
  if case.get("coo"):
    return plain(embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        *coo_inputs(case), specs, **call_options(case)))
  feats, weights = inputs(case)
  return plain(embedding.preprocess_sparse_dense_matmul_input(feats, weights, specs, **call_options(case)))


class Abort(Exception):
  """The reference killed its process (CHECK / LOG(FATAL)); `message` is its stderr tail."""

  def __init__(self, returncode, message):
    super().__init__(f"reference aborted (returncode {returncode}): {message}")
    self.returncode = returncode
    self.message = message


class ReferenceWorker:
  """One long-lived child process running the reference; restarted after an abort."""

  def __init__(self):
    self.proc = None
    self.stderr = None

  def _start(self):
    self.stderr = tempfile.TemporaryFile()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "ref_worker.py")], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self.stderr, env=env)

  def run(self, case):
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    blob = pickle.dumps(case, protocol=pickle.HIGHEST_PROTOCOL)
    try:
      self.proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
      self.proc.stdin.flush()
      head = self.proc.stdout.read(8)
      if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        kind, payload = pickle.loads(self.proc.stdout.read(n))
        if kind == "ok":
          return payload
        raise RuntimeError(f"the reference raised {payload}")
    except BrokenPipeError:
      pass
    code = self.proc.wait()
    self.stderr.seek(0)
    tail = self.stderr.read().decode(errors="replace")[-2000:]
    self.proc = None
    raise Abort(code, tail)

  def close(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
    self.proc = None


def compare(case, want, got):
  """Asserts equality inside the reference's written ranges and zeros past them (the tails)."""
  l, s = case["local_device_count"], case["num_sc_per_device"]
  n = case["global_device_count"] * s
  rpb = max(n, 8)
  assert sorted(got["row_pointers"]) == sorted(want["row_pointers"])
  np.testing.assert_array_equal(got["num_minibatches"], want["num_minibatches"])
  assert got["num_minibatches"].dtype == want["num_minibatches"].dtype
  for key in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    assert sorted(got[key]) == sorted(want[key]), key
    for stack in want[key]:
      np.testing.assert_array_equal(got[key][stack], want[key][stack], err_msg=f"{stack} {key}")
      assert got[key][stack].dtype == want[key][stack].dtype, key
  assert got["id_drop_counters"] == want["id_drop_counters"]
  for stack in want["row_pointers"]:
    for key in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
      assert got[key][stack].shape == want[key][stack].shape, (stack, key)
      assert got[key][stack].dtype == want[key][stack].dtype, (stack, key)
    rp_w = want["row_pointers"][stack].reshape(-1)
    np.testing.assert_array_equal(got["row_pointers"][stack].reshape(-1), rp_w, err_msg=f"{stack} row_pointers")
    e_w, e_g = want["embedding_ids"][stack].reshape(-1), got["embedding_ids"][stack].reshape(-1)
    s_w, s_g = want["sample_ids"][stack].reshape(-1), got["sample_ids"][stack].reshape(-1)
    g_w = want["gains"][stack].reshape(-1).view(np.uint32)
    g_g = got["gains"][stack].reshape(-1).view(np.uint32)
    c = e_w.size // l
    cs = c // s
    valid = np.zeros(e_w.size, dtype=bool)
    for d in range(l):
      for sc in range(s):
        first_rp = d * (rp_w.size // l) + sc * rpb
        top = int(rp_w[first_rp:first_rp + rpb].max())
        base = d * c + sc * cs
        valid[base:base + min(round_up(top, 8), cs)] = True
    for name, a, b in (("embedding_ids", e_g, e_w), ("sample_ids", s_g, s_w), ("gains bits", g_g, g_w)):
      bad = np.flatnonzero(valid & (a != b))
      assert bad.size == 0, f"{stack} {name} differ at {bad[:10]}: ours {a[bad[:10]]} reference {b[bad[:10]]}"
    # Past each segment's final cursor the reference leaves memory uninitialised; the package
    # writes zeros there (fresh pages: a tail no batch writes is never touched).
    assert np.all(e_g[~valid] == 0) and np.all(s_g[~valid] == 0) and np.all(g_g[~valid] == 0)
