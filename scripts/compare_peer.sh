#!/usr/bin/env bash
# Side-by-side throughput against the reference (jax-tpu-embedding 0.1.0), in one run, as ratios.
# Usage: scripts/compare_peer.sh [THREADS...]   (default: 1 2)
# Generates the issue's workloads with ../shared/peer/make_workload.py into target/peer, then
# runs `sparsecore-prep bench --json` and `run_peer.py` on the same files, interleaved.
set -euo pipefail
cd "$(dirname "$0")/.."
P=../shared/peer
D=target/peer
mkdir -p "$D"
PY=$(bash "$P/setup.sh")
cargo build --release --quiet
BIN=target/release/sparsecore-prep
REPEAT=${REPEAT:-7}
THREADS=("${@:-1 2}")
[ $# -eq 0 ] && THREADS=(1 2)

gen() { # name profile layout [extra args]
  local name=$1 profile=$2 layout=$3; shift 3
  [ -f "$D/$name.arrow" ] || "$PY" "$P/make_workload.py" --profile "$profile" --layout "$layout" "$@" \
      --out "$D/$name.arrow" --config-out "$D/$name.json" >/dev/null
}
gen criteo_444 criteo 4/4/4
gen long long 1/1/4
gen long_w long 1/1/4 --weights
gen large_vocab large-vocab 1/1/4
gen high_mv high-multivalency 1/1/4
gen moderate_mv moderate-multivalency 1/1/4

printf '%-12s %7s %12s %12s %7s\n' workload threads ours_Mids/s peer_Mids/s ratio
for w in ${WORKLOADS:-criteo_444 long long_w large_vocab high_mv moderate_mv}; do
  for t in "${THREADS[@]}"; do
    ours=$("$BIN" bench --config "$D/$w.json" --input "$D/$w.arrow" --threads "$t" --repeat "$REPEAT" --json)
    peer=$("$PY" "$P/run_peer.py" --config "$D/$w.json" --input "$D/$w.arrow" --threads "$t" --repeat "$REPEAT" 2>/dev/null)
    python3 - "$w" "$t" "$ours" "$peer" <<'PY'
import json, sys
w, t, ours, peer = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
a, b = ours["ids_per_sec"] / 1e6, peer["ids_per_sec"] / 1e6
print(f"{w:<12} {t:>7} {a:>12.1f} {b:>12.1f} {a / b:>6.2f}x")
PY
  done
done
