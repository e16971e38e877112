#!/usr/bin/env bash
# Side-by-side throughput against the reference (jax-tpu-embedding 0.1.0), in one run, as ratios.
# Usage: [ROUNDS=5] [REPEAT=5] [WORKLOADS="long ..."] [BASE_BIN=path] scripts/compare_peer.sh [THREADS...]   (default: 1 2)
# BASE_BIN: another build of the CLI (e.g. the commit before a refactor) run in the same rounds;
# the table then also gives its ratio to the reference and ours/base, for before/after checks.
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
REPEAT=${REPEAT:-5}
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
# Untuned twins (a first run before FDO, the reference's default path): the same batches under
# every table's limits at 65536 (or the tuned limit, where a partition needs more: `long`'s
# hottest holds about 75,000 ids) and no suggested buffer, so each COO buffer is sized for the
# worst case while the batch writes a small part of it.
untuned() { # name of a generated workload
  [ -f "$D/$1_untuned.json" ] || python3 - "$D/$1.json" "$D/$1_untuned.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
for t in cfg["tables"]:
    for limit in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        t[limit] = max(65536, t[limit])
    t["suggested_coo_buffer_size_per_device"] = None
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
PY
  ln -sf "$1.arrow" "$D/$1_untuned.arrow"
}
untuned criteo_444
untuned long

# The reference's own benchmark shape, from its Python benchmark
# (jax_tpu_embedding/sparsecore/lib/nn/tests/preprocess_input_benchmarks.py, whose published
# per-call times are 43-57 ms ragged/COO and 494 ms with minibatching forced): 100 features,
# each on its own table (vocabulary 1024, dim 16, sum), 16,000 samples, ragged, ids per sample
# uniform in 1..31, ids uniform over the vocabulary: about 25.6M ids. The generator below draws
# them as the benchmark does (numpy seed 0, same calls in the same order), so the ids are the
# benchmark's own; make_workload.py has no profile of this shape. Limits and buffers are FDO'd
# as the benchmark does after its first call: the exact observed maxima and buffer need
# (`stats`, then `fdo tune --headroom 1.0`), at the benchmark's layout 4/16/4.
# ref_shape_mb forces minibatching as the benchmark does: the observed maxima times 0.5
# (rounded up), "enable_minibatching": true. The benchmark runs it as 4 hosts of 4/16/4 over
# an all-reduce; both run_peer.py and our CLI run one host, where minibatching needs L = G, so
# it is 4/4/4: the same samples per SparseCore and work per host, 16 partitions instead of 64
# (4 minibatches on this batch; the benchmark's 64 partitions give it at least 5).
# Its buffer is the exact need without minibatching times 1.1: minibatching splits partitions
# into aligned pieces, and at 1.0 both sides drop ids (919 on this batch).
ref_shape() { # name layout limit_factor buffer_headroom minibatching
  local name=$1 layout=$2 factor=$3 headroom=$4 mb=$5
  [ -f "$D/$name.json" ] && return
  [ -f "$D/ref_shape.arrow" ] || "$PY" - "$D/ref_shape.arrow" <<'PY'
import json, sys
import numpy as np
import pyarrow as pa
features, samples, vocab = 100, 16000, 1024
np.random.seed(0)
columns = []
for _ in range(features):
    counts = np.random.randint(1, 32, size=samples)
    ids = np.random.randint(vocab, size=(int(counts.sum()),), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)))
meta = {"workload": "ref_shape", "source": "preprocess_input_benchmarks.py", "seed": 0,
        "features": features, "samples": samples, "vocabulary_size": vocab}
schema = pa.schema([pa.field(f"f{i:02d}", pa.list_(pa.int32())) for i in range(features)],
                   metadata={"sparsecore_workload": json.dumps(meta)})
with pa.OSFile(sys.argv[1], "wb") as fh, pa.ipc.new_file(fh, schema) as w:
    w.write_batch(pa.record_batch(columns, schema=schema))
PY
  python3 - "$layout" "$D/$name.first.json" <<'PY'
import json, sys
L, G, S = map(int, sys.argv[1].split("/"))
cfg = {"config": {"local_device_count": L, "global_device_count": G, "num_sc_per_device": S,
                  "allow_id_dropping": False, "stacking": "feature"},
       "tables": [{"name": f"table_{i}", "vocabulary_size": 1024, "embedding_dim": 16,
                   "combiner": "sum", "max_ids_per_partition": 1024,
                   "max_unique_ids_per_partition": 1024} for i in range(100)],
       "features": [{"name": f"f{i:02d}", "table": f"table_{i}"} for i in range(100)]}
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
PY
  "$BIN" stats --config "$D/$name.first.json" --input "$D/ref_shape.arrow" --out "$D/$name.stats.json" >/dev/null
  "$BIN" fdo tune --config "$D/$name.first.json" --stats "$D/$name.stats.json" --headroom "$headroom" \
      --out "$D/$name.tuned.json" >/dev/null
  python3 - "$D/$name.tuned.json" "$D/$name.stats.json" "$factor" "$mb" "$D/$name.json" <<'PY'
import json, math, sys
cfg, stats = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["stacks"]
factor, cfg["config"]["enable_minibatching"] = float(sys.argv[3]), sys.argv[4] == "true"
for t in cfg["tables"]:
    for limit in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        t[limit] = math.ceil(max(stats[t["name"]][limit]) * factor)
json.dump(cfg, open(sys.argv[5], "w"), indent=1)
PY
  rm "$D/$name.first.json" "$D/$name.tuned.json"
  [ "$name" = ref_shape ] || ln -sf ref_shape.arrow "$D/$name.arrow"
}
ref_shape ref_shape 4/16/4 1 1.0 false
ref_shape ref_shape_mb 4/4/4 0.5 1.1 true

# Each (workload, threads) pair runs ROUNDS rounds; a round runs ours and then the reference,
# each for REPEAT passes, and its ratio is ours/reference of the two median ids/s. The table
# gives the median of the rounds' ratios (and their range), which cancels the machine's slow
# phases (a shared VM: a neighbour can halve memory bandwidth for seconds), since both sides of
# a round see the same phase. At one thread both sides are pinned to the same CPU
# (PIN_CPU, default 1): the VM's two vCPUs are not equally fast, and an unpinned run lands
# on either.
ROUNDS=${ROUNDS:-5}
PIN_CPU=${PIN_CPU:-1}
printf '%-18s %7s %12s %12s %7s %15s\n' workload threads ours_Mids/s peer_Mids/s ratio ratio_range
for w in ${WORKLOADS:-criteo_444 criteo_444_untuned long long_untuned long_w large_vocab high_mv moderate_mv ref_shape ref_shape_mb}; do
  for t in "${THREADS[@]}"; do
    pin=()
    [ "$t" = 1 ] && pin=(taskset -c "$PIN_CPU")
    rounds=()
    for _ in $(seq "$ROUNDS"); do
      ours=$("${pin[@]}" "$BIN" bench --config "$D/$w.json" --input "$D/$w.arrow" --threads "$t" --repeat "$REPEAT" --json)
      peer=$("${pin[@]}" "$PY" "$P/run_peer.py" --config "$D/$w.json" --input "$D/$w.arrow" --threads "$t" --repeat "$REPEAT" 2>/dev/null)
      base='{}'
      [ -n "${BASE_BIN:-}" ] && base=$("${pin[@]}" "$BASE_BIN" bench --config "$D/$w.json" --input "$D/$w.arrow" --threads "$t" --repeat "$REPEAT" --json)
      rounds+=("$ours" "$peer" "$base")
    done
    python3 - "$w" "$t" "${rounds[@]}" <<'PY'
import json, statistics, sys
w, t, runs = sys.argv[1], sys.argv[2], [json.loads(r) for r in sys.argv[3:]]
ours = [r["ids_per_sec"] / 1e6 for r in runs[0::3]]
peer = [r["ids_per_sec"] / 1e6 for r in runs[1::3]]
ratios = [a / b for a, b in zip(ours, peer)]
line = (f"{w:<18} {t:>7} {statistics.median(ours):>12.1f} {statistics.median(peer):>12.1f} "
        f"{statistics.median(ratios):>6.2f}x {min(ratios):>6.2f}-{max(ratios):.2f}x")
if runs[2]:
    base = [r["ids_per_sec"] / 1e6 for r in runs[2::3]]
    base_ratios = [a / b for a, b in zip(base, peer)]
    ours_over_base = [a / b for a, b in zip(ours, base)]
    line += (f"   base {statistics.median(base_ratios):>5.2f}x  ours/base {statistics.median(ours_over_base):.3f}"
             f" ({min(ours_over_base):.3f}-{max(ours_over_base):.3f})")
print(line)
PY
  done
done
