#!/usr/bin/env bash
# The format and lint gates, run by .ci/run and before any commit:
#   1. rustfmt (rustfmt.toml) over the workspace and the fuzz workspace;
#   2. clippy on every target of every member, warnings as errors, with and without the
#      `internals` feature (clippy's `incompatible_msrv` lint also refuses standard-library
#      items newer than the declared rust-version);
#   3. rustdoc with warnings as errors (broken intra-doc links, bare URLs, ...);
#   4. the declared rust-version against every locked dependency: none may need a newer rustc.
#      (No older toolchain can be installed here, so the compile itself runs on the current one.)
#
#   bash scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf 'lint: %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all --check
cargo fmt --manifest-path fuzz/Cargo.toml --check

step "cargo clippy -D warnings"
cargo clippy --quiet --workspace --all-targets -- -D warnings
# Again with the unstable `internals` feature, which also builds the stage benches, and the
# pipeline without its default `tcp` feature.
cargo clippy --quiet --workspace --all-targets --features sparsecore-prep/internals -- -D warnings
cargo clippy --quiet -p sparsecore-prep --no-default-features --all-targets -- -D warnings

step "cargo doc -D warnings"
RUSTDOCFLAGS=-Dwarnings cargo doc --quiet --workspace --no-deps

step "rust-version against the locked dependencies"
python3 - <<'PY'
import json
import subprocess
import sys

meta = json.loads(subprocess.check_output(["cargo", "metadata", "--format-version", "1", "--locked"]))
members = set(meta["workspace_members"])
version = lambda text: tuple(int(part) for part in text.split(".")[:2])
declared = min(version(p["rust_version"]) for p in meta["packages"] if p["id"] in members)
newer = [
    f"{p['name']} {p['version']} needs rustc {p['rust_version']}"
    for p in meta["packages"]
    if p.get("rust_version") and version(p["rust_version"]) > declared
]
for line in newer:
    print(f"lint: {line}, above the declared rust-version {declared[0]}.{declared[1]}", file=sys.stderr)
print(f"lint: {len(meta['packages'])} locked packages checked against rust-version "
      f"{declared[0]}.{declared[1]}", file=sys.stderr)
sys.exit(1 if newer else 0)
PY
step "ok"
