#!/usr/bin/env bash
# The Python package's CI: builds python/ with maturin into a venv that also holds the
# reference (jax-tpu-embedding, via ../shared/peer/setup.sh) and Ray, then runs python/tests:
# the API and error tests, the golden cases through both drop-in calls, the differential tests
# against the reference (DIFF_CASES random cases per entry point, default 240), the Ray Data
# example against the CLI, and python/README.md's code blocks.
#
# It also runs the reference's own tests of the two calls with ours swapped in
# (python/tests/test_reference_suite.py) where their sources are reachable: a clone of the
# reference (SPARSECORE_REF_GIT, or the mirror beside ../shared) or GitHub.
#
#   scripts/ci_python.sh                 # from the repository root (or anywhere): debug build
#   SPARSECORE_PY_RELEASE=1 scripts/ci_python.sh   # optimised, as CI runs it
#   SPARSECORE_PY_VENV=DIR scripts/ci_python.sh
#   REF_VERSION=0.2.0 scripts/ci_python.sh   # against jax-tpu-embedding 0.2.0 (CPython 3.12 or
#                                        # 3.13; venv $HOME/.cache/sparsecore-python-venv-0.2.0,
#                                        # without Ray): a fixed subset of the tests
#   SPARSECORE_PY_BUILD_PYTHON=PY scripts/ci_python.sh   # the abi3 wheel built for PY, installed
#   SPARSECORE_PY_SETUP_ONLY=1 scripts/ci_python.sh   # step 1 only: the venv
#   SPARSECORE_PY_BUILD_ONLY=1 scripts/ci_python.sh   # steps 1 and 2: the venv and the build
#   scripts/ci_python.sh -k coo          # extra arguments go to pytest: one file, -k, -x, ...
#   scripts/ci_python.sh python/tests/test_errors.py::test_error_fields
#
# The venv is kept under $HOME/.cache and reused; a run that finds it complete installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
shared="${SPARSECORE_SHARED:-$root/../shared}"
ref_version="${REF_VERSION:-0.1.0}"
case "$ref_version" in
  0.1.0) venv="${SPARSECORE_PY_VENV:-$HOME/.cache/sparsecore-python-venv}"; constraints="$shared/peer/constraints.txt" ;;
  0.2.0) venv="${SPARSECORE_PY_VENV:-$HOME/.cache/sparsecore-python-venv-0.2.0}"; constraints="$shared/peer/constraints-0.2.0.txt" ;;
  *) printf 'ci_python: REF_VERSION must be 0.1.0 or 0.2.0, not %s\n' "$ref_version" >&2; exit 1 ;;
esac
log() { printf 'ci_python: %s\n' "$*" >&2; }
t0=$(date +%s)

# 1. The reference and its pinned numpy/pyarrow (idempotent), then our tools, pinned. The 0.2.0
# venv runs a subset of the tests (step 3) that needs no Ray.
py=$(REF_VERSION="$ref_version" bash "$shared/peer/setup.sh" "$venv")
requirements=python/requirements-ci.txt
if [ "$ref_version" != 0.1.0 ]; then
  requirements=$(mktemp)
  trap 'rm -f "$requirements"' EXIT
  grep -v '^ray' python/requirements-ci.txt >"$requirements"
fi
if ! "$py" - "$requirements" >/dev/null 2>&1 <<'PYEOF'
import importlib.metadata as md, sys
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, want = line.split("==")
        if md.version(name.split("[")[0]) != want:
            sys.exit(1)
PYEOF
then
  log "installing $(tr '\n' ' ' < "$requirements")"
  "$py" -m pip install --disable-pip-version-check --no-input -q \
    -c "$constraints" -c python/constraints-ci.txt -r "$requirements" >&2
fi
t1=$(date +%s)
# .ci/run does this step alone first, in the background while Rust compiles: a fresh venv is
# mostly downloads (about 300 MB of wheels, 3 minutes).
if [ -n "${SPARSECORE_PY_SETUP_ONLY:-}" ]; then
  log "setup $((t1 - t0)) s"
  exit 0
fi

# 2. The extension module, installed into the venv: the dev profile by default, which reuses
# the dependencies `cargo test` just compiled (for quick local runs); SPARSECORE_PY_RELEASE=1
# builds it optimised, as .ci/run and python/bench.py do (about 3 minutes from nothing on
# 2 cores).
profile=()
[ -n "${SPARSECORE_PY_RELEASE:-}" ] && profile=(--release)
# The extension is abi3 (one wheel for every CPython >= 3.11): SPARSECORE_PY_BUILD_PYTHON names
# another interpreter to build it for, and the wheel is installed here. .ci/run passes the 0.1.0
# venv's for the 0.2.0 stage: cargo then finds the release build of the stage before and only
# packs the wheel (5 s), where building for this venv's interpreter recompiled pyo3 and the
# crates above it (about 100 s on 2 cores).
build_py="${SPARSECORE_PY_BUILD_PYTHON:-}"
if [ -n "$build_py" ] && [ "$build_py" != "$py" ]; then
  wheels=$(mktemp -d)
  log "maturin build ${profile[*]:-} for $build_py, installed into $venv"
  (cd python && PATH="$venv/bin:$PATH" maturin build "${profile[@]}" --quiet -i "$build_py" -o "$wheels" >&2)
  "$py" -m pip install --disable-pip-version-check --no-input -q --no-deps --force-reinstall "$wheels"/*.whl >&2
  rm -rf "$wheels"
else
  log "maturin develop ${profile[*]:-}"
  (cd python && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop "${profile[@]}" --quiet >&2)
fi
# The CLI that the Ray example is compared with (debug is enough for the tiny dataset). CI passes
# the binary `cargo test` built for the CLI's own tests (SPARSECORE_PREP_CLI): building the binary
# alone here resolves other features than the tests' build and recompiled 29 crates (about a
# minute on 2 cores) to get an equivalent program.
cli="${SPARSECORE_PREP_CLI:-}"
if [ -z "$cli" ] && [ "$ref_version" = 0.1.0 ]; then
  cargo build --quiet --bin sparsecore-prep
  cli="$root/target/debug/sparsecore-prep"
fi
t2=$(date +%s)
if [ -n "${SPARSECORE_PY_BUILD_ONLY:-}" ]; then
  log "setup $((t1 - t0)) s, build $((t2 - t1)) s"
  exit 0
fi

# 3. The tests. Missing pieces are failures here, not skips. A release run also runs the README's
# install command (`pip install ./python`, a release wheel: seconds after the build above, which
# it shares target/ with); a debug run skips it rather than build a second profile.
readme_install=""
[ -n "${SPARSECORE_PY_RELEASE:-}" ] && readme_install=1
# Extra arguments go to pytest, after python/tests unless they name tests under python/. Against
# 0.2.0 a fixed subset runs: the golden cases, the differential tests with DIFF_CASES 40 (unless
# set), the drop-in inside keras-rs, Flax and the FDO clients, and the reference's own tests.
require_ray=1
require_grain=1
tests=(python/tests)
if [ "$ref_version" != 0.1.0 ]; then
  require_ray=""
  require_grain=""
  export DIFF_CASES="${DIFF_CASES:-40}"
  tests=(python/tests/test_golden.py python/tests/test_differential.py python/tests/test_install.py
    python/tests/test_fdo_clients.py python/tests/test_reference_suite.py python/tests/test_option_errors.py
    python/tests/test_pytrees.py)
fi
case " $* " in *" python/"*) ;; *) set -- "${tests[@]}" "$@" ;; esac
log "pytest (jax-tpu-embedding $ref_version) $*"
SPARSECORE_SHARED="$shared" SPARSECORE_PREP_CLI="$cli" \
  REQUIRE_REFERENCE=1 REQUIRE_RAY="$require_ray" REQUIRE_GRAIN="$require_grain" REQUIRE_GOLDEN=1 JAX_PLATFORMS=cpu SPARSECORE_README_INSTALL="$readme_install" \
  "$py" -m pytest -q -p no:cacheprovider -rs "$@"
t3=$(date +%s)
log "setup $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s"
