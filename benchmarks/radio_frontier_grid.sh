#!/usr/bin/env bash
# The radio-map frontier grid of docs/results/radiomap.md, run seed by seed in one process at a time on one torch
# thread (the other core stays free), so that a run cut short still holds whole seeds.
#
#   benchmarks/radio_frontier_grid.sh [OUT_DIR] [SEEDS] [ROUNDS]     (defaults: runs/radio-frontier-grid "0 1 2" 20)
#
# Per seed: none and clip-only (the headroom), then for each noise multiplier z in 0.3 1 3 uniform, steered-uniform
# and grouped-clipping at z, and adaptive at z * sqrt(2) (phi = 0.5: the same epsilon as uniform at z). Attacks at
# round 1 and every 10 rounds with the first-order template attacker. Each seed's data and public pretraining are
# computed by its first run and copied into the others' folders (the cache key is the same), so they are paid once.
# Then: .venv/bin/python benchmarks/radio_frontier.py OUT_DIR/* --plot FRONTIER.png
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/radio-frontier-grid}
seeds=${2:-0 1 2}
rounds=${3:-20}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$out"
run() {  # run NAME SEED ARGS...: one invocation into $out/NAME-s SEED, reusing the seed's cached data
  local name=$1 seed=$2; shift 2
  local dir="$out/$name-s$seed"
  if [ -f "$dir/radiomap.json" ]; then echo "grid: $dir done already"; return; fi
  if [ -d "$out/headroom-s$seed/data" ] && [ "$name" != headroom ]; then
    mkdir -p "$dir" && cp -r "$out/headroom-s$seed/data" "$dir/"
  fi
  echo "grid: $(date -u +%H:%M:%S) $dir"
  .venv/bin/wildfed experiment radiomap --seeds "$seed" --rounds "$rounds" --attack-every 10 --attacker template \
    --out "$dir" "$@" > "$dir.log" 2>&1
}
for seed in $seeds; do
  run headroom "$seed" --defences none,clip-only
  for z in 0.3 1 3; do
    run "z$z" "$seed" --defences uniform,steered-uniform,grouped-clipping --noise-multiplier "$z"
    za=$(python3 -c "import math; print(round($z * math.sqrt(2), 5))")
    run "adaptive-z$z" "$seed" --defences adaptive --noise-multiplier "$za"
  done
done
echo "grid: $(date -u +%H:%M:%S) finished"
