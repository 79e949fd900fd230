#!/usr/bin/env bash
# Every deck in inputs/ resolves, fits its grid and finds its data (kmoe-train --dry-run on the
# deck's pp*dp*ep ranks, with the fortunes corpus prepared by kmoe-prep).
# Usage: decks_dry_run.sh BIN_DIR WORK_DIR MPIEXEC INPUTS_DIR
set -euo pipefail
bin=$1 work=$2 mpiexec=$3 inputs=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work"
"$bin/kmoe-prep" --fortunes --out-dir data/fortunes > prep.log
status=0
for deck in "$inputs"/*.deck; do
  world=1
  for axis in pp dp ep; do
    n=$(sed -n "s/^[[:space:]]*$axis[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p" "$deck" | tail -1)
    world=$((world * ${n:-1}))
  done
  if "$mpiexec" --allow-run-as-root --oversubscribe -n "$world" -x OPENBLAS_NUM_THREADS=1 \
       "$bin/kmoe-train" -i "$deck" --dry-run > "$(basename "$deck").log" 2>&1; then
    echo "ok   $(basename "$deck") on $world ranks"
  else
    echo "FAIL $(basename "$deck") on $world ranks:"; tail -5 "$(basename "$deck").log"; status=1
  fi
done
exit $status
