#!/usr/bin/env bash
# Builds every fuzz target and runs each for FUZZ_SECONDS (default 30) from the committed seeds
# in fuzz/corpus/<target>, failing on any crash, leak, timeout or out-of-memory.
#
#   scripts/fuzz_ci.sh                 # all targets, 30 s each
#   FUZZ_SECONDS=900 scripts/fuzz_ci.sh ragged
#   FUZZ_BUILD_ONLY=1 scripts/fuzz_ci.sh   # build the targets, run nothing (.ci/run builds them early)
#
# Only the stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it take the -Z flags cargo-fuzz
# passes. New inputs found during the run go to a scratch corpus that is deleted afterwards,
# never into the committed seeds; crashing inputs land in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

export RUSTC_BOOTSTRAP=1
export RUSTUP_TOOLCHAIN="${RUSTUP_TOOLCHAIN:-stable}"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-30}"
# Dev build (overflow checks and debug assertions on), no AddressSanitizer: a clean release
# build forces one codegen unit per crate and takes too long for CI on two cores; the long
# local runs in RELIABILITY.md use `-O -a` with AddressSanitizer.
BUILD_FLAGS=(--dev -s none)
# libFuzzer limits: 2 GB RSS, no single allocation above 512 MB, 10 s per input.
RUN_FLAGS=(-rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1)

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

start=$(date +%s)
cargo fuzz build "${BUILD_FLAGS[@]}"
echo "fuzz_ci: build took $(( $(date +%s) - start )) s"
[ -n "${FUZZ_BUILD_ONLY:-}" ] && exit 0

# One target's run: new inputs go to a scratch corpus (deleted afterwards), so that only the
# committed seeds are loaded and the run stays near FUZZ_SECONDS.
run_one() {
  local t=$1 work log
  work=$(mktemp -d)
  log="$logs/$t.log"
  mkdir -p "fuzz/artifacts/$t"
  local dict=()
  if [ -f "fuzz/dicts/$t.dict" ]; then dict=(-dict="fuzz/dicts/$t.dict"); fi
  local rc=0
  cargo fuzz run "${BUILD_FLAGS[@]}" "$t" "$work" "fuzz/corpus/$t" -- \
    "${RUN_FLAGS[@]}" "${dict[@]}" -max_total_time="$SECONDS_PER_TARGET" >"$log" 2>&1 || rc=$?
  rm -rf "$work"
  return "$rc"
}

# Two targets at a time (CI machines have two cores); each prints its summary when done.
logs=$(mktemp -d)
failed=()
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  pids=()
  for t in "${targets[@]:i:2}"; do
    echo "fuzz_ci: $t for ${SECONDS_PER_TARGET}s"
    run_one "$t" &
    pids+=("$!:$t")
  done
  for p in "${pids[@]}"; do
    if ! wait "${p%%:*}"; then failed+=("${p#*:}"); fi
    t="${p#*:}"
    echo "--- $t"
    grep -E "^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)|panicked|ERROR|Test unit written" "$logs/$t.log" || tail -n 30 "$logs/$t.log"
  done
done

echo "fuzz_ci: total $(( $(date +%s) - start )) s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz_ci: FAILED: ${failed[*]} (inputs in fuzz/artifacts/, logs in $logs)" >&2
  exit 1
fi
echo "fuzz_ci: no crash in ${#targets[@]} targets"
rm -rf "$logs"
