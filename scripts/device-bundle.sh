#!/usr/bin/env bash
# Packs what the lent GPU machine lacks (../shared/device/make-bundle.sh), then drops from the site what
# a CUDA pilot never loads, so that the site and the tree fit the 64 MiB a device call carries.
#   scripts/device-bundle.sh                       # .device/ (the pinned TileLang)
#   TILELANG=0.1.14 OUT_DIR=.device-0.1.14 scripts/device-bundle.sh    # an A/B side's stack
# Dropped: TVM's C++ sources and CUTLASS's tools (TileLang compiles against the headers alone), the
# Ascend/ROCm/Metal/WebGPU backends' C++ templates, and virtualenv (nox runs with --no-venv there, asv
# with the "existing" environment). Never a Python module of TileLang: `import tilelang` imports its
# Ascend cache classes on every backend (2026-12-05: dropping tilelang/ascend broke the pilot there).
# The history does not travel (results/ is 24 MB packed and grows with each pilot; session 17 found
# 316 KB left): scripts/device-tree.py writes the commit's identity, its file manifest and a pack of
# its trees instead, which h200-pilot.sh checks the carried tree against.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
out=${OUT_DIR:-.device}
# The shared script's own size check (60 MiB untrimmed) is the one failure tolerated: the trim below is
# what brings the bundle under the limit, and the check at the end is this script's.
log=$(mktemp)
if ! "$root/../shared/device/make-bundle.sh" "$@" >"$log" 2>&1; then
  if ! grep -q 'over the 60 MiB' "$log"; then
    grep -v '^WARNING: Location' "$log" >&2; rm -f "$log"
    echo "device-bundle: ../shared/device/make-bundle.sh failed (above)" >&2; exit 1
  fi
fi
rm -f "$log" "$out/repo.bundle"  # the shared script's bundle of the whole history: see the header
[ -s "$out/site.tar.xz" ] || { echo "device-bundle: $out/site.tar.xz was not built (run ../shared/device/make-bundle.sh to see why)" >&2; exit 1; }
if [ ! -f "$out/.trimmed" ] || [ "$out/site.tar.xz" -nt "$out/.trimmed" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  tar -C "$work" -xJf "$out/site.tar.xz"
  s="$work/site"
  drop=()
  for d in "$s"/tilelang/3rdparty/tvm/src "$s"/tilelang/src/{ascend,rocm,metal,webgpu}; do
    [ -e "$d" ] && drop+=("$d")
  done
  py=$( ((${#drop[@]})) && find "${drop[@]}" -name '*.py' -print -quit || true)
  if [ -n "$py" ]; then
    echo "device-bundle: a Python file would be dropped ($py): TileLang's layout changed; mend this script" >&2
    exit 1
  fi
  rm -rf "${drop[@]+"${drop[@]}"}" "$s"/tilelang/3rdparty/cutlass/tools "$s"/virtualenv "$s"/virtualenv-*.dist-info
  tar -C "$work" -cf - site | xz -9 -T0 > "$out/site.tar.xz.new"
  mv "$out/site.tar.xz.new" "$out/site.tar.xz"
  touch "$out/.trimmed"
fi
rm -f "$out/site.tar.xz.new"
python3 scripts/device-tree.py write "$out"
size=$(du -sb "$out" | cut -f1)  # everything the call carries of it
# The tree that travels: tracked files but results/, save what asv's run reads there (device-tree.py).
sparse="'/*' '!/results/' '/results/asv/benchmarks.json' '/results/asv/*/machine.json'"
tree=$(cut -d' ' -f3- "$out/manifest" | tr '\n' '\0' | du -cb --files0-from=- | tail -1 | cut -f1)
ls -l "$out/site.tar.xz" "$out/manifest" "$out"/pack-*.pack
if [ $((size + tree)) -ge $((64 * 1024 * 1024)) ]; then
  echo "device-bundle: $out ($size bytes) and the tree that travels ($tree) pass the 64 MiB a call carries" >&2
  exit 1
fi
echo "ok: $((size + tree)) bytes with the tree; make the call with the history out of the checkout:"
echo "  git sparse-checkout set --no-cone $sparse   (undo: git sparse-checkout disable)"
