"""The reference's own tests of the preprocessing calls pass with ours swapped in
(`sparsecore_prep.install()`): every test that passes against the installed jax-tpu-embedding
passes again with our calls (tests/reference_suite.py extracts and runs them).

REQUIRE_REFERENCE=1 (CI) turns a missing reference or an unknown version into a failure instead
of a skip. The test sources are not in the reference's wheel or sdist, and CI reaches neither
GitHub nor a clone of the reference, so unreachable sources are a skip there; they fail only under
REQUIRE_REFERENCE_SUITE=1 or when SPARSECORE_REF_GIT names a git directory explicitly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

import reference_suite as rs

REQUIRED = os.environ.get("REQUIRE_REFERENCE") == "1"
SUITE_REQUIRED = os.environ.get("REQUIRE_REFERENCE_SUITE") == "1" or bool(os.environ.get("SPARSECORE_REF_GIT"))

# How many of the reference's tests reach the two calls and pass on a CPU, per version: fewer
# would mean the suite lost tests (a moved file, a changed deselection), not that ours passed.
MIN_REACHING = {"0.1.0": 9, "0.2.0": 12}


def _missing(what: str, required: bool = REQUIRED, flag: str = "REQUIRE_REFERENCE=1"):
  if required:
    raise RuntimeError(f"{flag} but {what}")
  pytest.skip(what)


def test_reference_suite_passes_with_our_calls(tmp_path):
  if importlib.util.find_spec("jax_tpu_embedding") is None:
    _missing("jax_tpu_embedding is not importable")
  version = rs.reference_version()
  if version not in rs.COMMITS:
    _missing(f"no commit of jax-tpu-embedding {version} is known (tests/reference_suite.py, COMMITS)")
  try:
    tests = rs.extract(tmp_path, version)
  except (OSError, subprocess.CalledProcessError) as e:
    _missing(f"the reference's tests at {rs.COMMITS[version][:12]} are not available from {rs.default_git_dir()} "
             f"or GitHub ({e}); set SPARSECORE_REF_GIT to a clone of {rs.REPO}",
             required=SUITE_REQUIRED, flag="REQUIRE_REFERENCE_SUITE=1 or SPARSECORE_REF_GIT")
  assert sorted(tests) == sorted(rs.TESTS)
  ref = rs.run(tmp_path, tests, ours=False)
  ours = rs.run(tmp_path, tests, ours=True)
  regressions, counts = rs.compare(ref, ours)
  print(f"jax-tpu-embedding {version}: {json.dumps(counts)}")
  assert counts["passed_reference_reaching_the_calls"] >= MIN_REACHING[version], counts
  assert counts["calls_ours"] > 0, counts
  log = (tmp_path / "log-ours.txt").read_text()
  assert not regressions, (f"pass on the reference, fail with sparsecore_prep: {regressions}\n{counts}\n"
                           f"{log[-6000:]}")
