#!/usr/bin/env bash
# Runs the real pilot on the lent H200 (host mode) and packs what it wrote into $OUT.
# Needs the bundle from ../shared/device/make-bundle.sh in .device/ (carried with the call).
#   scripts/h200-pilot.sh [pilot args...]      e.g. --cases 'gemm/*'
set -uo pipefail
git fetch -q .device/repo.bundle HEAD && git reset -q FETCH_HEAD
mkdir -p /tmp/s && tar -C /tmp/s -xJf .device/site.tar.xz
export PYTHONPATH=$PWD:/tmp/s/site PYTHONUNBUFFERED=1
export TILEPILOT_CACHE=/tmp/tilepilot-cache
start=$(date +%s)
timeout "${PILOT_TIMEOUT:-540}" python3 -m nox --no-venv -s pilot-sm90 -- --host "$@" 2>&1 | tee "$OUT/pilot.log"
rc=${PIPESTATUS[0]}
echo "pilot rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$OUT/pilot.log"
tar -czf "$OUT/results.tgz" results/records results/asv
exit "$rc"
