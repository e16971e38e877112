"""python/README.md's code blocks, run verbatim, so that the documentation keeps working.

Every fenced block is ```python, ```sh or ```text (anything else fails here, so that a new block
is either run or marked as an excerpt). Each ```python block runs as its own script in a fresh
interpreter (this test's) and an empty directory, as a user pasting it would run it; a block that
imports the reference needs it (REQUIRE_REFERENCE=1 in CI turns its absence into a failure).

The ```sh blocks (the install command) run from the repository root in a throwaway venv, with pip
kept offline: numpy and maturin come from this test's venv (a .pth file), build isolation is off,
and no index is asked. They build a release wheel (sharing target/ with `maturin develop
--release`, so after CI's build it takes seconds), so they run only with
SPARSECORE_README_INSTALL=1, which scripts/ci_python.sh sets for release runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

import reference as ref

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
README = os.path.join(ROOT, "python", "README.md")


def blocks():
  with open(README) as fh:
    text = fh.read()
  return re.findall(r"^```(\S*)\n(.*?)^```[ \t]*$", text, flags=re.S | re.M)


BLOCKS = blocks()
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang == "sh"]


def test_every_block_is_run_or_marked_as_text():
  assert {lang for lang, _ in BLOCKS} <= {"python", "sh", "text"}, [lang for lang, _ in BLOCKS]
  assert len(PYTHON) >= 6 and len(SHELL) == 1


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block(index, tmp_path):
  code = PYTHON[index]
  if "jax_tpu_embedding" in code and not ref.reference_available():
    if os.environ.get("REQUIRE_REFERENCE") == "1":
      raise RuntimeError("REQUIRE_REFERENCE=1 but jax_tpu_embedding is not importable")
    pytest.skip("the block uses the reference (jax-tpu-embedding), which is not installed")
  script = tmp_path / f"block_{index}.py"
  script.write_text(code)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("index", range(len(SHELL)))
def test_sh_block(index, tmp_path):
  if os.environ.get("SPARSECORE_README_INSTALL") != "1":
    pytest.skip("builds a release wheel: set SPARSECORE_README_INSTALL=1 (scripts/ci_python.sh does for release runs)")
  env_dir = tmp_path / "venv"
  venv.EnvBuilder(with_pip=True).create(env_dir)
  try:
    _install_and_check(index, env_dir, tmp_path)
  finally:
    shutil.rmtree(env_dir, ignore_errors=True)  # a venv with a wheel: not worth keeping


def _install_and_check(index, env_dir, tmp_path):
  bin_dir = env_dir / "bin"
  purelib = subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
  with open(os.path.join(purelib, "test_venv.pth"), "w") as fh:
    fh.write(sysconfig.get_path("purelib") + "\n")
  # Offline: no index, and the build backend (maturin) from this venv. PIP_NO_BUILD_ISOLATION="0"
  # is pip's spelling of --no-build-isolation (the variable sets the option's negated value).
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
             VIRTUAL_ENV=str(env_dir), PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
             PIP_DISABLE_PIP_VERSION_CHECK="1")
  env.pop("PYTHONPATH", None)
  code = SHELL[index]
  run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
  assert run.returncode == 0, f"README sh block {index} failed:\n{code}\n--- output:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
  # The package the block installed is the venv's own, and works.
  check = ("import os, sparsecore_prep as s; from sparsecore_prep import _native; "
           "print(os.path.dirname(_native.__file__)); print(s.__version__)")
  out = subprocess.run([str(bin_dir / "python"), "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                       check=True).stdout.split()
  assert out[0].startswith(str(env_dir)), out
  import sparsecore_prep

  assert out[1] == sparsecore_prep.__version__
