#!/usr/bin/env bash
# Every deck in inputs/ resolves, fits its grid and finds its data (kmoe-train --dry-run, on one
# process whatever the deck's pp*dp*ep: the dry run plans the grid without its ranks, with the
# fortunes corpus prepared by kmoe-prep); a 512-rank grid is planned on one process in seconds,
# its expert state divided by ep and (optimizer.shard) its moments by the replicas; --plan lists the layouts of N ranks, best first by its cost
# model, keeps those within --memory-per-rank, and its bad inputs are clear errors.
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

# The 100B-parameter Engram deck (inputs/plans, for planning only): with its tables in host
# memory each of its 32 ranks keeps 1/32 of the 100B table elements there, and its device
# memory falls by more than half; the figure "without offload" is the same deck's own plan
# with engram.offload = none.
if dry plan100b.log "$inputs/plans/engram_100b_offload.deck" &&
   dry plan100b_none.log "$inputs/plans/engram_100b_offload.deck" --engram.offload=none; then
  read -r host_elements without freed < <(awk '/device without offload/ { getline;
    print $2, $5, $6; exit }' plan100b.log)
  none_total=$(awk '/stage  blocks/ { getline; print $NF; exit }' plan100b_none.log)
  if [ -n "$host_elements" ] && [ $((host_elements * 32)) -ge 100000000000 ] &&
     [ "$without" = "$none_total" ] &&
     awk -v f="$freed" -v w="$without" 'BEGIN { exit !(f > 0.5 * w) }'; then
    echo "ok   100B-parameter Engram tables in host memory: $host_elements table elements per" \
         "rank on the host, $freed of $without MiB of device memory freed per rank"
  else
    echo "FAIL the 100B plan: '$host_elements' host elements, '$freed' of '$without' MiB" \
         "freed (offload none: '$none_total' MiB)"; status=1
  fi
else
  echo "FAIL the 100B plan:"; tail -5 plan100b.log plan100b_none.log; status=1
fi

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
if grep -q "pp 4 x dp 16 x ep 8 = 512 ranks" plan512.log &&
   [ -n "$e8" ] && [ -n "$e1" ] && [ $((e8 * 4)) -lt "$e1" ]; then
  echo "ok   512 ranks planned on one process in ${took} s; stage 0 holds $e8 tensor elements" \
       "per rank at ep 8, $e1 at ep 1"
else
  echo "FAIL the 512-rank plan (${took} s; stage 0 elements at ep 8: '$e8', at ep 1: '$e1')"
  status=1
fi

# The same 512 ranks with sharded moments and recompute: stage 0's AdamW column falls to about
# 1/16 (dense over dp*ep = 128 ranks, experts over dp = 16) of its parameters+gradients column,
# and its activations fall.
adamw() {  # params+grads MiB, AdamW MiB and activations MiB of stage 0
  awk '/stage  blocks/ { getline; print $4, $5, $7; exit }' "$1"
}
dry plan512_zero.log "$inputs/olmoe_shape.deck" --parallel.pp=4 --parallel.dp=16 \
  --parallel.ep=8 --train.global_batch=256 --optimizer.shard=replicas --train.recompute=block ||
  { echo "FAIL the sharded 512-rank plan:"; tail -5 plan512_zero.log; exit 1; }
read -r pg0 m0 a0 < <(adamw plan512.log)
read -r pg1 m1 a1 < <(adamw plan512_zero.log)
if awk -v pg="$pg1" -v m="$m1" -v a0="$a0" -v a1="$a1" \
     'BEGIN { exit !(m > 0 && m * 10 < pg && a1 < a0) }'; then
  echo "ok   512 ranks, sharded moments and recompute: stage 0 AdamW $m0 -> $m1 MiB" \
       "(params+grads $pg1 MiB), activations $a0 -> $a1 MiB"
else
  echo "FAIL sharded 512-rank plan: AdamW $m0 -> $m1 MiB (params+grads $pg1), activations" \
       "$a0 -> $a1"
  status=1
fi

# --plan 8 on the main deck with 64 sequences a step: pp 1, 2, 4 (pp 8 exceeds its 4 blocks)
# times every dp x ep; step times non-decreasing; a limit keeps only the layouts within it.
main="$inputs/tiny_moe_engram.deck"
plan() {  # plan LOG [arguments...]
  local log=$1
  shift
  "$mpiexec" --allow-run-as-root --oversubscribe -n 1 -x OPENBLAS_NUM_THREADS=1 \
    "$bin/kmoe-train" -i "$main" --train.global_batch=64 "$@" > "$log" 2>&1
}
rows() {  # the layout rows of a plan's table
  awk '/step s$/ { on = 1; next }
       on && NF == 6 && $1 ~ /^[0-9]+$/ { print }
       on && NF != 6 { on = 0 }' "$1"
}
if plan plan8.log --plan 8 && [ "$(rows plan8.log | wc -l)" -eq 9 ] &&
   rows plan8.log | awk '{ if (NR > 1 && $6 < last) exit 1; last = $6 }' &&
   grep -q "1 rejected by the deck, e.g. pp 8 dp 1 ep 1" plan8.log; then
  echo "ok   --plan 8: 9 layouts, best first"
else
  echo "FAIL --plan 8:"; cat plan8.log; status=1
fi
# The 5th smallest memory, printed to 0.01 GiB: half a print step above it.
limit=$(rows plan8.log | sort -k4 -n | awk 'NR == 5 { printf "%.3f", $4 + 0.005 }')
if plan plan8_limit.log --plan 8 --memory-per-rank "$limit" &&
   [ "$(rows plan8_limit.log | wc -l)" -ge 5 ] && [ "$(rows plan8_limit.log | wc -l)" -lt 9 ] &&
   rows plan8_limit.log | awk -v m="$limit" '{ if ($4 > m) exit 1 }'; then
  echo "ok   --plan 8 --memory-per-rank $limit keeps $(rows plan8_limit.log | wc -l) layouts"
else
  echo "FAIL --memory-per-rank $limit:"; cat plan8_limit.log; status=1
fi
expect_error() {  # expect_error TEXT [arguments...]: exit 1 and TEXT in the message
  local text=$1
  shift
  if plan bad.log "$@"; then
    echo "FAIL $*: accepted"; status=1
  elif grep -qF -- "$text" bad.log; then
    echo "ok   $*: $(grep -F -- "$text" bad.log | head -1 | cut -c1-110)"
  else
    echo "FAIL $*: no '$text' in:"; cat bad.log; status=1
  fi
}
expect_error "the deck accepts no layout of 7 ranks" --plan 7
expect_error "--memory-per-rank 0.01: none of the 9 layouts of 8 ranks" --plan 8 --memory-per-rank 0.01
expect_error "--plan 0: expected a positive number" --plan 0
expect_error "--plan x: expected a positive number" --plan x
expect_error "--plan 2.5: expected a rank count" --plan 2.5
expect_error "--memory-per-rank is a --plan option" --memory-per-rank 10
expect_error "separate modes" --plan 8 --dry-run
exit $status
