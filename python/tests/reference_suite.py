"""The reference's own tests, run once against jax-tpu-embedding and once with our drop-in calls
swapped in by ``sparsecore_prep.install()``.

The test files are not part of the reference's wheel or sdist; they are taken from its git
history at the commit of the installed version (``COMMITS``): from a local git directory
(``SPARSECORE_REF_GIT``, by default the mirror beside ../shared), else from GitHub's archive of
that commit (cached under ``$HOME/.cache``). They are extracted into a temporary directory whose
``conftest.py`` adds the reference's ``tests`` packages to the installed package, counts the
calls that reach the two preprocessing functions per test, and, in the "ours" run, calls
``sparsecore_prep.install()`` first.

    python python/tests/reference_suite.py            # both runs, a summary, exit 1 on a regression
    python python/tests/reference_suite.py --keep DIR # ... and keep the extracted tree and reports
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO = "jax-ml/jax-tpu-embedding"

# The reference's commit per released version. 0.1.0 is its tag v0.1.0. 0.2.0 has no tag in the
# history available here; its commit is the newest one, whose library files differ from the 0.2.0
# wheel's only in type annotations and `int(enum)` versus `int(enum.value)` (checked file by file
# with `git hash-object`).
COMMITS = {
    "0.1.0": "84e4d88b98a624f7370ecbc9693c6645a813d29c",
    "0.2.0": "566086da396606ee54df20e2e08c1d64749ae93c",
}

_PKG = "jax_tpu_embedding/sparsecore"
# The reference's tests that reach embedding.preprocess_sparse_dense_matmul_input (or
# _from_sparse_tensor) and run on a CPU, and the helpers they import. A test that fails on the
# reference here is left out of the comparison by that. The others that reach the calls (Flax's
# embed tests, the primitives' tests, tpu_sparse_dense_matmul's) also run the SparseCore's custom
# calls, which a CPU does not have ("No registered implementation for untyped custom call to
# SparseDenseMatmulOp for Host"); tests/test_install.py runs Flax's preprocess_inputs instead.
TESTS = (
    f"{_PKG}/lib/nn/tests/preprocess_sparse_dense_matmul_input_test.py",
    f"{_PKG}/lib/nn/tests/minibatching_test.py",
    # The one test of the sparse COO entry point; the rest of the file is about specs and tables.
    f"{_PKG}/lib/nn/tests/embedding_test.py::EmbeddingTest::test_preprocess_sparse_dense_matmul_input_from_sparse_tensor",
)
# Left out of both runs: tests that abort the reference's process on a CPU (one device, so the
# limits their inputs were made for are exceeded: "Observed max ids per partition: 2 ... greater
# than the set max ids per partition: 1"), which would end the whole pytest run, and tests of the
# SparseCore's custom calls.
DESELECT = (
    f"{_PKG}/lib/nn/tests/minibatching_test.py::MultiHostMinibatchingTest",
    f"{_PKG}/lib/nn/tests/minibatching_test.py::SingleHostMinibatchingTest::test_single_host_minibatching_forward_pass",
    f"{_PKG}/lib/nn/tests/minibatching_test.py::SingleHostMinibatchingTest::test_single_host_minibatching_backward_pass",
)
HELPERS = (
    f"{_PKG}/lib/core/tests/test_utils.py",
    f"{_PKG}/lib/nn/tests/test_utils.py",
)

# Adds the extracted `tests` packages to the installed reference, gives the CPU a SparseCore
# count, swaps our calls in for the "ours" run, and records per test how many calls reached the
# two functions.
_CONFTEST = r'''
import json
import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent

import jax_tpu_embedding.sparsecore.lib.core as _core
import jax_tpu_embedding.sparsecore.lib.nn as _nn
for _mod, _sub in ((_core, "lib/core"), (_nn, "lib/nn")):
  _mod.__path__.append(str(HERE / "jax_tpu_embedding/sparsecore" / _sub))

from jax_tpu_embedding.sparsecore.lib.nn import embedding
from jax_tpu_embedding.sparsecore.utils import utils as _utils

# Tests that ask the first device for its SparseCore count run on a CPU as on a v5p (4), in both
# runs alike.
_utils.NUM_SC_PER_DEVICE_MAP.setdefault("cpu", 4)

if os.environ.get("SPARSECORE_SUITE_OURS") == "1":
  import sparsecore_prep
  sparsecore_prep.install()
  import sparsecore_prep._dropin as _dropin
  for _name in ("preprocess_sparse_dense_matmul_input", "preprocess_sparse_dense_matmul_input_from_sparse_tensor"):
    assert getattr(embedding, _name) is getattr(_dropin, _name), _name

_calls = {"n": 0}
_per_test = {}


def _counting(fn):
  def wrapper(*args, **kwargs):
    _calls["n"] += 1
    return fn(*args, **kwargs)
  wrapper.__wrapped__ = fn
  return wrapper


for _name in ("preprocess_sparse_dense_matmul_input", "preprocess_sparse_dense_matmul_input_from_sparse_tensor"):
  setattr(embedding, _name, _counting(getattr(embedding, _name)))


@pytest.fixture(autouse=True)
def _count_calls(request):
  before = _calls["n"]
  yield
  _per_test[request.node.nodeid] = _calls["n"] - before


def pytest_sessionfinish(session):
  out = os.environ.get("SPARSECORE_SUITE_CALLS")
  if out:
    pathlib.Path(out).write_text(json.dumps(_per_test))
'''


def default_git_dir() -> pathlib.Path:
  shared = pathlib.Path(os.environ.get("SPARSECORE_SHARED", ROOT.parent / "shared")).resolve()
  return pathlib.Path(os.environ.get("SPARSECORE_REF_GIT", shared.parent / ".mirror" / "jax-ml+jax-tpu-embedding" / "repo"))


def reference_version() -> str:
  import importlib.metadata as md
  return md.version("jax-tpu-embedding")


def _from_git(git_dir: pathlib.Path, commit: str, paths, dest: pathlib.Path) -> list[str]:
  present = subprocess.run(["git", f"--git-dir={git_dir}", "ls-tree", "-r", "--name-only", commit, "--", *paths],
                           check=True, capture_output=True, text=True).stdout.split()
  archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "--format=tar", commit, "--", *present],
                           check=True, capture_output=True).stdout
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(dest, filter="data")
  return present


def _from_github(commit: str, paths, dest: pathlib.Path) -> list[str]:
  cache = pathlib.Path.home() / ".cache" / "sparsecore-reference-tests" / f"{commit}.tar.gz"
  if not cache.exists():
    cache.parent.mkdir(parents=True, exist_ok=True)
    url = f"https://codeload.github.com/{REPO}/tar.gz/{commit}"
    with urllib.request.urlopen(url, timeout=120) as r:
      data = r.read()
    tmp = cache.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, cache)
  present = []
  with tarfile.open(cache) as tar:
    for m in tar.getmembers():
      rel = m.name.split("/", 1)[-1]
      if rel in paths:
        m.name = rel
        tar.extract(m, dest, filter="data")
        present.append(rel)
  return present


def extract(dest: pathlib.Path, version: str, git_dir: pathlib.Path | None = None) -> list[str]:
  """Writes the test files of `version` under `dest` (with the conftest); returns the entries of
  TESTS whose file is there at that commit. OSError or CalledProcessError when neither source has them."""
  commit = COMMITS[version]
  files = tuple(dict.fromkeys(t.split("::")[0] for t in TESTS))
  paths = files + HELPERS
  git_dir = git_dir or default_git_dir()
  if (git_dir / "HEAD").exists() or (git_dir / ".git").exists():
    present = _from_git(git_dir, commit, paths, dest)
  else:
    present = _from_github(commit, paths, dest)
  for sub in ("lib/core/tests", "lib/nn/tests"):
    init = dest / _PKG / sub / "__init__.py"
    if not init.exists():
      init.write_text("")
  (dest / "conftest.py").write_text(_CONFTEST)
  return [t for t in TESTS if t.split("::")[0] in present]


def run(dest: pathlib.Path, tests: list[str], ours: bool, python: str = sys.executable) -> dict:
  """Runs `tests` under pytest in `dest`; returns {nodeid: (outcome, calls)}."""
  tag = "ours" if ours else "reference"
  junit, calls = dest / f"junit-{tag}.xml", dest / f"calls-{tag}.json"
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), SPARSECORE_SUITE_CALLS=str(calls),
             SPARSECORE_SUITE_OURS="1" if ours else "0", KERAS_BACKEND="jax")
  env.pop("PYTEST_ADDOPTS", None)
  proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(dest),
                         f"--junitxml={junit}", "-o", "junit_family=xunit1",
                         *(f"--deselect={d}" for d in DESELECT), *tests],
                        cwd=dest, env=env, capture_output=True, text=True)
  (dest / f"log-{tag}.txt").write_text(proc.stdout + proc.stderr)
  if not junit.exists():
    raise RuntimeError(f"pytest wrote no report ({tag} run, exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                       f"{proc.stderr[-4000:]}")
  per_test = json.loads(calls.read_text()) if calls.exists() else {}
  results = {}
  for case in ET.parse(junit).getroot().iter("testcase"):
    file = case.get("file") or ""
    nodeid = f"{file}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
    outcome = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        outcome = "failed"
        break
      if child.tag == "skipped":
        outcome = "skipped"
    results[nodeid] = [outcome, 0]
  # The conftest's node ids are pytest's (file::Class::test); junit's are matched by suffix.
  for nodeid, n in per_test.items():
    cls_test = "::".join(nodeid.split("::")[-2:])
    for key in results:
      if key.endswith("::" + cls_test) and pathlib.PurePath(nodeid.split("::")[0]).name in key:
        results[key][1] = n
  return {k: tuple(v) for k, v in results.items()}


def compare(ref: dict, ours: dict) -> tuple[list[str], dict]:
  """Tests that pass on the reference but not with ours, and counts for the summary."""
  passed_ref = {k for k, (o, _) in ref.items() if o == "passed"}
  passed_ours = {k for k, (o, _) in ours.items() if o == "passed"}
  reaching = {k for k in passed_ref if ref[k][1] > 0}
  regressions = sorted(passed_ref - passed_ours)
  counts = {
      "tests": len(ref),
      "passed_reference": len(passed_ref),
      "passed_ours": len(passed_ours),
      "passed_reference_reaching_the_calls": len(reaching),
      "passed_ours_of_those": len(reaching & passed_ours),
      "calls_reference": sum(n for _, n in ref.values()),
      "calls_ours": sum(n for _, n in ours.values()),
  }
  return regressions, counts


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--keep", type=pathlib.Path, help="extract into this directory and keep it")
  ap.add_argument("--git", type=pathlib.Path, help="the reference's git directory")
  args = ap.parse_args()
  version = reference_version()
  dest = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="sparsecore-ref-suite-"))
  dest.mkdir(parents=True, exist_ok=True)
  try:
    tests = extract(dest, version, args.git)
    ref = run(dest, tests, ours=False)
    ours = run(dest, tests, ours=True)
    regressions, counts = compare(ref, ours)
    print(f"jax-tpu-embedding {version} at {COMMITS[version][:12]}: {json.dumps(counts)}")
    for k in sorted(ref):
      print(f"  {ref[k][0]:8} {ours.get(k, ('missing', 0))[0]:8} calls {ref[k][1]:3} {k}")
    for k in regressions:
      print(f"REGRESSION: {k} passes on the reference, {ours.get(k, ('missing',))[0]} with sparsecore_prep")
    return 1 if regressions else 0
  finally:
    if not args.keep:
      shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
