#!/usr/bin/env bash
# Runs the real pilot on the lent H200 (host mode) and packs what it wrote into $OUT.
# Needs the bundle from scripts/device-bundle.sh in .device/ (carried with the call), and the checkout
# without the history (the sparse checkout that device-bundle.sh prints).
#   scripts/h200-pilot.sh [pilot args...]      e.g. --cases 'gemm/*'
#   PROFILE=1: then Nsight Compute over scripts/h200-profile.py, into $OUT/ncu.csv
# A first run starts from an empty compile cache (cold); when time is left (REPEAT_IF_LEFT seconds
# of LIMIT), the same commit is measured again, warm, for the reproducibility and warm-time figures.
# The pages are published where the results are merged (--no-publish here).
# RUNS=cold or RUNS=warm runs one of them: a pilot too long for both in one call's 600 s is measured
# cold in one call and warm in the next, made while the machine is still warm (its /tmp cache kept).
# An A/B side on its own stack: BUNDLE=.device-0.1.14 SESSION=ab-sm90 scripts/h200-pilot.sh --tilelang 0.1.14
# (the side's site directory is handed to the session with --site; the bundle carries the same commit).
set -uo pipefail
bundle=${BUNDLE:-.device}
session=${SESSION:-pilot-sm90}
# The history stays home (scripts/device-tree.py): the carried tree is checked file by file against
# the bundle's manifest, and a tree that is not the commit's stops here, before any device time goes
# to a dirty run, which the gate never judges (2026-12-05: a bundle one test commit behind the
# checkout). The pilot is told its commit (TILEPILOT_GIT); asv finds it in a one-commit shallow repo.
ident=$(python3 scripts/device-tree.py check "$bundle") || exit 2
export TILEPILOT_GIT=$ident
# One site and one compile cache per bundle: a warm machine keeps /tmp, and two stacks must never mix.
tag=$(basename "$bundle")
site=/tmp/s$tag/site
mkdir -p "/tmp/s$tag" && tar -C "/tmp/s$tag" -xJf "$bundle/site.tar.xz"
export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1
export TILEPILOT_CACHE=/tmp/tilepilot-cache$tag
extra=()
[ "$session" = pilot-sm90 ] || extra=(--site "$site")
# One case that hangs fails alone, in its supervised child, instead of holding the whole call (the pilot's
# own default is 600 s, a call's whole length: 2026-12-05's H100 run lost its call so).
export TILEPILOT_CASE_TIMEOUT=${CASE_TIMEOUT:-120}
# Minimizing a failed case's reproducer compiles and runs it again and again: bounded for the whole run,
# so that a wrong kernel costs seconds of the call, not all of it (2026-12-05: 8 silent minutes).
export TILEPILOT_REPRO_BUDGET_S=${REPRO_BUDGET:-30}
# Only what this call wrote goes back (a call returns files of at most 16 MiB: the whole history is 23 MB);
# `tilepilot merge` takes such a partial tree. Each run's log, without TileLang's INFO lines, beside it.
marker=$(mktemp)
pack() {
  { find results/records results/asv results/repro -type f -newer "$marker" 2>/dev/null
    find results/asv -name machine.json; } | sort -u > /tmp/pack.list
  tar -czf "$OUT/results.tgz" -T /tmp/pack.list
  for log in $(find results/records -name pilot.log -newer "$marker"); do
    grep -v 'INFO' "$log" | tail -60 > "$OUT/tail-$(basename "$(dirname "$log")").log"
  done
}
limit=${LIMIT:-570}
t0=$(date +%s)
for run in ${RUNS:-cold warm}; do
  left=$(( limit - ($(date +%s) - t0) ))
  if [ "$run" = warm ] && [ "${RUNS:-}" != warm ] && [ "$left" -lt "${REPEAT_IF_LEFT:-260}" ]; then echo "no time left for a warm run ($left s)"; break; fi
  s=$(date +%s)
  # --line-buffered: a run cut short by the timeout still leaves its last lines in the log.
  timeout "$left" python3 -m nox --no-venv -s "$session" -- --host --no-publish "${extra[@]+"${extra[@]}"}" "$@" 2>&1 | grep --line-buffered -v 'tilelang.jit.kernel:INFO' | tee "$OUT/pilot-$run.log"
  rc=${PIPESTATUS[0]}
  echo "pilot $run rc=$rc wall=$(( $(date +%s) - s ))s" | tee -a "$OUT/pilot-$run.log"
  pack  # after every run: a call cut short still brings back what finished
  [ "$rc" -eq 0 ] || break
done
# The reproducer's GPU path (minimizing a wrong-values kernel by running it), when time is left.
left=$(( limit - ($(date +%s) - t0) ))
if [ "${GPU_TESTS:-1}" = 1 ] && [ "$left" -gt 90 ]; then
  timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_repro.py tests/test_model.py tests/test_decode_kernel.py tests/test_compiled.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.log"
fi
# Nsight Compute on the pinned kernels and their framework ops (PROFILE=1), when time is left.
left=$(( limit - ($(date +%s) - t0) ))
if [ "${PROFILE:-0}" = 1 ] && [ "$left" -gt 60 ]; then
  timeout "$left" ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --csv --page details \
    python3 scripts/h200-profile.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$? lines=$(wc -l < "$OUT/ncu.csv")"
fi
pack
exit "$rc"
