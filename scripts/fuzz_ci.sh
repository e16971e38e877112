#!/usr/bin/env bash
# Builds every fuzz target and runs each for FUZZ_SECONDS (default 30) from the committed seeds
# in fuzz/corpus/<target>, failing on any crash, leak, timeout or out-of-memory.
#
#   scripts/fuzz_ci.sh                 # all targets, 30 s each
#   FUZZ_SECONDS=900 scripts/fuzz_ci.sh ragged
#
# Only the stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it take the -Z flags cargo-fuzz
# passes. New inputs found during the run go to a scratch corpus (fuzz/work/<target>), never
# into the committed seeds; crashing inputs land in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

export RUSTC_BOOTSTRAP=1
export RUSTUP_TOOLCHAIN="${RUSTUP_TOOLCHAIN:-stable}"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-30}"
# Build flags, shared with RELIABILITY-fuzz.md: release, overflow checks and debug assertions on,
# AddressSanitizer off (see there why).
BUILD_FLAGS=(-O -a -s none)
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

failed=()
for t in "${targets[@]}"; do
  work="fuzz/work/$t"
  mkdir -p "$work" "fuzz/artifacts/$t"
  dict=()
  if [ -f "fuzz/dicts/$t.dict" ]; then dict=(-dict="fuzz/dicts/$t.dict"); fi
  echo "fuzz_ci: $t for ${SECONDS_PER_TARGET}s"
  if ! cargo fuzz run "${BUILD_FLAGS[@]}" "$t" "$work" "fuzz/corpus/$t" -- \
      "${RUN_FLAGS[@]}" "${dict[@]}" -max_total_time="$SECONDS_PER_TARGET" 2>&1 | tail -n 25; then
    failed+=("$t")
  fi
done

echo "fuzz_ci: total $(( $(date +%s) - start )) s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz_ci: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz_ci: no crash in ${#targets[@]} targets"
