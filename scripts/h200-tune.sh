#!/usr/bin/env bash
# Runs `nox -s tune-sm90` on the lent H200 (host mode) and packs the winners and the search records
# into $OUT. Needs the bundle from scripts/device-bundle.sh in .device/ (carried with the call) and the
# checkout without the history, as for h200-pilot.sh.
#   BUDGET=330 scripts/h200-tune.sh [tune args...]
set -uo pipefail
ident=$(python3 scripts/device-tree.py check .device) || exit 2
export TILEPILOT_GIT=$ident
mkdir -p /tmp/s && tar -C /tmp/s -xJf .device/site.tar.xz
export PYTHONPATH=$PWD:/tmp/s/site PYTHONUNBUFFERED=1 TILELANG_AUTO_TUNING_DISABLE_CACHE=1
export TILELANG_CACHE_DIR=/tmp/tilelang-tune-cache
s=$(date +%s)
python3 -m nox --no-venv -s tune-sm90 -- --budget-s "${BUDGET:-330}" "$@" 2>&1 \
  | grep -v -E 'tilelang.jit.kernel:INFO|it/s\]|Tuned Latency' | tee "$OUT/tune.log"
rc=${PIPESTATUS[0]}
echo "tune rc=$rc wall=$(( $(date +%s) - s ))s" | tee -a "$OUT/tune.log"
tar -czf "$OUT/tune.tgz" kernels/configs/tuned $(ls -d results/tune 2>/dev/null)
exit "$rc"
