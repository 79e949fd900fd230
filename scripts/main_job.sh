#!/usr/bin/env bash
# The main job: install dependencies, build, prepare the fortunes corpus, train
# inputs/tiny_moe_engram.deck, plot its metrics and print a few fortunes the model writes. Extra
# arguments are deck overrides (e.g. --train.max_steps=50).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
bash scripts/build.sh
bin=${KMOE_BUILD_DIR:-$root/build}/drivers
if [ ! -f data/fortunes/train.bin ] || [ ! -f data/fortunes/val.bin ]; then
  "$bin/kmoe-prep" --fortunes --out-dir data/fortunes
fi
# Two expert-parallel ranks (the deck's parallel.ep = 2), one core and one BLAS thread each.
# A fresh run each time, replacing the previous one (checkpoint.resume = none, checkpoint.overwrite
# = true); to continue a run, leave both out.
mpiexec --allow-run-as-root -n 2 -x OPENBLAS_NUM_THREADS=1 "$bin/kmoe-train" -i inputs/tiny_moe_engram.deck \
  --checkpoint.resume=none --checkpoint.overwrite=true "$@"
/usr/bin/python3 bench/plot_metrics runs/tiny_moe_engram/metrics.csv -o runs/tiny_moe_engram/metrics.png
# A few fortunes from the trained model: each starts after an end-of-document id (256) and runs
# to the next, sampled at temperature 0.8 from the 40 most likely bytes.
ckpt=runs/tiny_moe_engram/checkpoints/$(cat runs/tiny_moe_engram/checkpoints/latest)
echo "fortunes from $ckpt:"
mpiexec --allow-run-as-root -n 2 -x OPENBLAS_NUM_THREADS=1 "$bin/kmoe-generate" --checkpoint "$ckpt" \
  --prompt-ids 256 --samples 3 --max-new-tokens 255 --temperature 0.8 --top-k 40 --seed 1
