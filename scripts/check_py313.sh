#!/usr/bin/env bash
# The package on CPython 3.13: the abi3 wheel (built for the CI venv's interpreter, whose release
# build scripts/ci_python.sh has just made, so this only packs it) installed into a venv of
# numpy, pyarrow and pytest alone, and every golden case run through the drop-in calls there.
# CPython 3.11 and 3.12 are the two Python stages' own interpreters (jax-tpu-embedding 0.1.0 and
# 0.2.0); 3.13 is the last one the reference ships wheels for.
#
#   scripts/check_py313.sh        # after SPARSECORE_PY_RELEASE=1 scripts/ci_python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
shared="${SPARSECORE_SHARED:-$PWD/../shared}"
build_venv="${SPARSECORE_PY_VENV:-$HOME/.cache/sparsecore-python-venv}"
venv="$HOME/.cache/sparsecore-python-venv-3.13"
log() { printf 'check_py313: %s\n' "$*" >&2; }
# (A pyenv shim on PATH may exist without a 3.13 selected: a candidate must run.)
py313=""
for c in "$(command -v python3.13 2>/dev/null || true)" "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
  if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
    py313=$c
    break
  fi
done
if [ -z "$py313" ]; then
  log "no CPython 3.13 found (python3.13 on PATH or under ~/.pyenv/versions)"
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  log "venv with $py313 in $venv"
  "$py313" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q \
  -c "$shared/peer/constraints.txt" -c python/constraints-ci.txt numpy pyarrow pytest >&2
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
(cd python && PATH="$build_venv/bin:$PATH" maturin build --release --quiet -i "$build_venv/bin/python" -o "$wheels" >&2)
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q --no-deps --force-reinstall "$wheels"/*.whl >&2
log "$("$venv/bin/python" --version) with $(basename "$wheels"/*.whl)"
SPARSECORE_SHARED="$shared" REQUIRE_GOLDEN=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  python/tests/test_golden.py python/tests/test_threads.py
