"""Results are JAX pytrees whenever jax can be imported, with or without the reference: our
classes flatten to the reference's leaves, in its order and under its key paths."""

import os
import subprocess
import sys

import pytest

import reference as ref

HERE = os.path.dirname(os.path.abspath(__file__))

# In a fresh interpreter: the result is made before jax is imported (as a loader worker that
# never imports jax would make it), then jax is imported and walks it.
CHILD = r"""
import pickle, sys, warnings
sys.path.insert(0, HERE)
import numpy as np
import sparsecore_prep as scp
import pickle_cases
out, stats = pickle_cases._drop_in_result()
assert "jax" not in sys.modules and type(out) is scp.PreprocessedInput
import jax
from jax import tree_util

def paths(tree):
  return [(tree_util.keystr(p), leaf) for p, leaf in tree_util.tree_flatten_with_path(tree)[0]]

ours = paths(out)
assert [p for p, _ in ours] == [
    ".sparse_dense_matmul_input.lhs_row_pointers['t0']", ".sparse_dense_matmul_input.lhs_embedding_ids['t0']",
    ".sparse_dense_matmul_input.lhs_sample_ids['t0']", ".sparse_dense_matmul_input.lhs_gains['t0']",
    ".num_minibatches"], ours
assert ours[0][1] is out.lhs_row_pointers["t0"] and ours[4][1] is out.num_minibatches
assert [p for p, _ in paths(stats)] == [
    ".max_ids_per_partition['t0']", ".max_unique_ids_per_partition['t0']", ".required_buffer_size_per_sc['t0']",
    ".id_drop_counters['t0']"]
# tree.map reaches the arrays and rebuilds our classes.
doubled = jax.tree.map(lambda a: np.asarray(a) * 2, out)
assert type(doubled) is scp.PreprocessedInput
np.testing.assert_array_equal(doubled.lhs_gains["t0"], out.lhs_gains["t0"] * 2)
maxed = jax.tree.map(np.max, stats)
assert type(maxed) is scp.SparseDenseMatmulInputStats
assert int(maxed.max_ids_per_partition["t0"]) == int(np.max(stats.max_ids_per_partition["t0"]))
# Still pickles, small (the arrays and the field names, nothing of jax).
blob = pickle.dumps(out)
assert len(blob) < 8192 and b"jax" not in blob, len(blob)
# The reference's __iter__: the four mappings, with its DeprecationWarning.
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  assert list(out) == list(out.sparse_dense_matmul_input)
assert any(issubclass(w.category, DeprecationWarning) for w in caught)
if WITH_REFERENCE:
  from jax_tpu_embedding.sparsecore.lib.nn import embedding
  ref_out = embedding.PreprocessedInput(embedding.SparseDenseMatmulInput(*out.sparse_dense_matmul_input),
                                        out.num_minibatches)
  ref_stats = embedding.SparseDenseMatmulInputStats(*(getattr(stats, f.name) for f in
                                                      __import__("dataclasses").fields(stats)))
  for a, b in ((out, ref_out), (stats, ref_stats)):
    pa, pb = paths(a), paths(b)
    assert [p for p, _ in pa] == [p for p, _ in pb], (pa, pb)
    assert all(x is y for (_, x), (_, y) in zip(pa, pb))
    assert tree_util.tree_structure(a).num_leaves == tree_util.tree_structure(b).num_leaves
print("ok")
"""


def run_child(with_reference: bool):
  code = f"HERE = {HERE!r}\nWITH_REFERENCE = {with_reference!r}\n" + CHILD
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_results_are_pytrees_when_jax_comes_later():
  pytest.importorskip("jax")
  run_child(False)


def test_results_flatten_like_the_reference():
  if not ref.reference_available():
    if os.environ.get("REQUIRE_REFERENCE") == "1":
      raise RuntimeError("REQUIRE_REFERENCE=1 but jax_tpu_embedding is not importable")
    pytest.skip("the reference (jax-tpu-embedding) is not installed")
  run_child(True)
