#!/usr/bin/env bash
# System packages the bandwidth benchmark (benchmarks/network) needs: iproute2 (`ip`, `tc`).
#
# Usage: scripts/install_system_deps.sh
#
# Installs iproute2 with apt-get only when `ip` or `tc` is missing and we are root on a machine
# with apt-get. Otherwise it says why and exits 0: without them the benchmark (and its test)
# runs over an unlimited link, outside any network namespace. Idempotent.
set -euo pipefail

log() { printf '[install_system_deps] %s\n' "$*" >&2; }

if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    log "ip/tc (iproute2) missing and not root: the bandwidth benchmark will run unlimited only."
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    log "ip/tc (iproute2) missing and no apt-get: install iproute2 by hand for rate limits."
    exit 0
fi
log "installing iproute2 (ip, tc) with apt-get"
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends iproute2 &&
    command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
    log "iproute2 installed"
else
    log "could not install iproute2: the bandwidth benchmark will run unlimited only."
fi
