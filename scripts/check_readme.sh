#!/usr/bin/env bash
# Runs README.md's shell blocks verbatim, and docs/output.md's Python read-back snippet on the
# files they produce, so that the documented commands keep working. (README's Rust example is a
# doctest of the library: `cargo test` runs it; python/README.md's blocks run in the Python
# tests.)
#
# The blocks run in a scratch worktree of HEAD (so they may write data.arrow, out/ and friends
# freely), building in this checkout's target/ directory, or in SPARSECORE_README_TARGET's:
# .ci/run gives the blocks their own, so that they build beside its other stages instead of
# waiting for target/'s lock (their release programs' feature sets share little with the Python
# build's release profile anyway). The one line CI already runs verbatim as its main step,
# README's test command, is not run again here.
#
# For .ci/run, which starts this in the background in a session of its own: the process group
# to stop is written to SPARSECORE_README_GROUP_FILE, and the pyarrow check waits until
# SPARSECORE_README_WAIT_FILE (the venv setup's exit status) is written.
#
# Usage: bash scripts/check_readme.sh        (needs python3; the pyarrow check uses the venv
#        scripts/ci_python.sh sets up, or the reference's from ../shared/peer/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
test_command='bash scripts/ci_redis.sh && cargo test'
[ -z "${SPARSECORE_README_GROUP_FILE:-}" ] || echo "$$" >"$SPARSECORE_README_GROUP_FILE"
work=$(mktemp -d)
# The last block's Redis is stopped too, in case the blocks were stopped between its start and
# its shutdown (a daemon is no child of theirs).
cleanup() {
  redis-cli -p 6399 shutdown nosave >/dev/null 2>&1 || true
  git worktree remove --force "$work/tree" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
git worktree add --detach --quiet "$work/tree" HEAD
target_dir="${SPARSECORE_README_TARGET:-$repo/target}"
mkdir -p "$target_dir"
ln -s "$target_dir" "$work/tree/target"
export CARGO_TARGET_DIR="$target_dir"

# The ```sh blocks of README.md, one script each, minus the test command.
python3 - "$repo/README.md" "$work" "$test_command" <<'PY'
import pathlib, re, sys
text = pathlib.Path(sys.argv[1]).read_text()
work, test_command = pathlib.Path(sys.argv[2]), sys.argv[3]
blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
for i, block in enumerate(blocks):
    lines = []
    for line in block.splitlines():
        if line.split("#")[0].strip() == test_command:
            lines.append(f"echo 'readme: skipped (run by .ci/run itself): {test_command}'")
        else:
            lines.append(line)
    (work / f"block_{i}.sh").write_text("set -euxo pipefail\n" + "\n".join(lines) + "\n")
print(f"readme: {len(blocks)} shell blocks")
PY
n=0
for block in "$work"/block_*.sh; do
  echo "readme: running $(basename "$block")"
  (cd "$work/tree" && bash "$block" >"$work/log" 2>&1) || { cat "$work/log"; echo "readme: $(basename "$block") failed" >&2; exit 1; }
  n=$((n + 1))
done

# docs/output.md's pyarrow snippet, on the out/ directory the CLI block wrote.
if [ -n "${SPARSECORE_README_WAIT_FILE:-}" ]; then
  while [ ! -s "$SPARSECORE_README_WAIT_FILE" ]; do sleep 1; done
fi
# The Python stage's venv (as .ci/run leaves it), else the reference's own.
py=""
for venv in "${SPARSECORE_PY_VENV:-$HOME/.cache/sparsecore-python-venv}" "$HOME/.cache/sparsecore-peer-venv"; do
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import pyarrow, numpy' 2>/dev/null; then
    py=$venv/bin/python
    break
  fi
done
if [ -n "$py" ]; then
  python3 - "$repo/docs/output.md" >"$work/output_snippet.py" <<'PY'
import pathlib, re, sys
print(re.findall(r"^```python\n(.*?)^```", pathlib.Path(sys.argv[1]).read_text(), flags=re.S | re.M)[0])
PY
  (cd "$work/tree" && "$py" "$work/output_snippet.py")
  n=$((n + 1))
elif [ -n "${SPARSECORE_README_REQUIRE_PY:-}" ]; then
  echo "readme: no Python with pyarrow for docs/output.md's snippet (run scripts/ci_python.sh first)" >&2
  exit 1
else
  echo "readme: no Python with pyarrow (../shared/peer/setup.sh installs one); docs/output.md's snippet not run"
fi
echo "readme: $n blocks ran verbatim"
