#!/usr/bin/env bash
# Installs Debian's redis-server (and redis-benchmark) for the dynamic-table tests, which start
# and stop their own servers on random loopback ports (the test kit's `redis_server`). Installs
# only; starts nothing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    redis-server --version
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
redis-server --version
