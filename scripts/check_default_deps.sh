#!/usr/bin/env bash
# A library user's default build of sparsecore-prep must compile none of the side systems'
# dependencies: no random generators (test kit), no Redis client (kernel), no CLI crates.
set -euo pipefail
cd "$(dirname "$0")/.."
forbidden='^(rand|rand_core|rand_distr|redis|clap|indicatif|criterion|proptest)$'
deps=$(cargo tree -p sparsecore-prep -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u)
if bad=$(grep -E "$forbidden" <<<"$deps"); then
  echo "sparsecore-prep's default build pulls in: $bad" >&2
  exit 1
fi
echo "default build of sparsecore-prep: $(wc -l <<<"$deps") crates, none of rand, redis, clap, indicatif"
