#!/usr/bin/env bash
# A library user's default build of sparsecore-prep must compile none of the side systems'
# dependencies: no random generators (test kit), no Redis client (kernel), no CLI crates.
# Without default features it must not compile the TCP all-reduce's HMAC either: the `tcp`
# feature owns that dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
forbidden='^(rand|rand_core|rand_distr|redis|clap|indicatif|criterion|proptest)$'
deps=$(cargo tree -p sparsecore-prep -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u)
if bad=$(grep -E "$forbidden" <<<"$deps"); then
  echo "sparsecore-prep's default build pulls in: $bad" >&2
  exit 1
fi
echo "default build of sparsecore-prep: $(wc -l <<<"$deps") crates, none of rand, redis, clap, indicatif"
bare=$(cargo tree -p sparsecore-prep --no-default-features -e normal --prefix none --format '{p}' |
  awk '{print $1}' | sort -u)
if grep -qx hmac <<<"$bare"; then
  echo "sparsecore-prep without default features pulls in hmac (the \`tcp\` feature owns it)" >&2
  exit 1
fi
echo "sparsecore-prep without default features: $(wc -l <<<"$bare") crates, no hmac"
