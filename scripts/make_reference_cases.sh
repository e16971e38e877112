#!/usr/bin/env bash
# Remakes the repository's reference cases, testdata/reference/{golden,golden_mb,golden_mh}, by
# running the reference (jax-tpu-embedding) through ../shared/peer: its setup.sh installs the
# reference into a venv, and scripts/make_reference_cases.py runs the peer tools on the inputs it
# defines, then checks every single-host case again with check_case.py. Running it again gives
# the same cases, but for an abort's whole `message`, which tests do not compare: it keeps the
# reference's log header (time, process id) and the count the reference met first, which
# depends on its threads (`message_contains` is the same).
#
#   bash scripts/make_reference_cases.sh [VENV_DIR]    # VENV_DIR: setup.sh's default if omitted
#
# Needs ../shared beside the checkout (or SPARSECORE_SHARED=DIR) and CPython 3.11 to 3.13;
# about 5 minutes on 2 cores once the venv exists (setup.sh: about 300 MB of downloads the
# first time).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${SPARSECORE_SHARED:-../shared}
if [ ! -f "$shared/peer/setup.sh" ]; then
  echo "make_reference_cases: $shared/peer/setup.sh not found (set SPARSECORE_SHARED)" >&2
  exit 1
fi
py=$(bash "$shared/peer/setup.sh" ${1:+"$1"})
JAX_PLATFORMS=cpu exec "$py" scripts/make_reference_cases.py --peer "$shared/peer" --out testdata/reference
