#!/usr/bin/env bash
# Every deck in inputs/ resolves, fits its grid and finds its data (kmoe-train --dry-run, on one
# process whatever the deck's pp*dp*ep: the dry run plans the grid without its ranks, with the
# fortunes corpus prepared by kmoe-prep); a 512-rank grid is planned on one process in seconds,
# its expert state divided by ep.
# Usage: decks_dry_run.sh BIN_DIR WORK_DIR MPIEXEC INPUTS_DIR
set -euo pipefail
bin=$1 work=$2 mpiexec=$3 inputs=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work"
"$bin/kmoe-prep" --fortunes --out-dir data/fortunes > prep.log
status=0
dry() {  # dry LOG DECK [overrides...]
  local log=$1
  shift
  "$mpiexec" --allow-run-as-root --oversubscribe -n 1 -x OPENBLAS_NUM_THREADS=1 \
    "$bin/kmoe-train" -i "$@" --dry-run > "$log" 2>&1
}
for deck in "$inputs"/*.deck; do
  world=1
  for axis in pp dp ep; do
    n=$(sed -n "s/^[[:space:]]*$axis[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p" "$deck" | tail -1)
    world=$((world * ${n:-1}))
  done
  log="$(basename "$deck").log"
  if dry "$log" "$deck" && grep -q "= $world ranks (planned on one process" "$log"; then
    echo "ok   $(basename "$deck"): its $world-rank grid planned on one process"
  else
    echo "FAIL $(basename "$deck") ($world ranks):"; tail -5 "$log"; status=1
  fi
done

# The OLMoE-shaped deck on pp 4 x dp 16 x ep 8 = 512 ranks, and with ep 1: stage 0's tensor
# elements (its experts' share) fall with ep.
elements() {  # the tensor elements of stage 0 in a dry run's log
  awk '/stage  blocks/ { getline; print $3; exit }' "$1"
}
start=$(date +%s)
dry plan512.log "$inputs/olmoe_shape.deck" --parallel.pp=4 --parallel.dp=16 --parallel.ep=8 \
  --train.global_batch=256 || { echo "FAIL the 512-rank plan:"; tail -5 plan512.log; exit 1; }
took=$(($(date +%s) - start))
dry plan_ep1.log "$inputs/olmoe_shape.deck" --parallel.pp=4 --parallel.dp=128 --parallel.ep=1 \
  --train.global_batch=256 || { echo "FAIL the ep 1 plan:"; tail -5 plan_ep1.log; exit 1; }
e8=$(elements plan512.log) e1=$(elements plan_ep1.log)
if grep -q "pp 4 x dp 16 x ep 8 = 512 ranks" plan512.log && [ "$took" -le 30 ] &&
   [ -n "$e8" ] && [ -n "$e1" ] && [ $((e8 * 4)) -lt "$e1" ]; then
  echo "ok   512 ranks planned on one process in ${took} s; stage 0 holds $e8 tensor elements" \
       "per rank at ep 8, $e1 at ep 1"
else
  echo "FAIL the 512-rank plan (${took} s; stage 0 elements at ep 8: '$e8', at ep 1: '$e1')"
  status=1
fi
exit $status
