#!/usr/bin/env bash
# omp_threads.sh BUILD_DIR [THREADS]: an OpenMP build's tests at many threads, by hand
# (docs/BUILDING.md's tested table records what it found). Under the device memory check:
#   1. every single-rank unit-test program at THREADS threads (default 8) with device paths
#      (KMOE_DEVICE_PATHS=1: teams of up to 4 threads, GPU vector lanes and column chunks);
#   2. the reference tests' device-path twins at THREADS threads;
#   3. the single-rank unit-test programs at THREADS threads without device paths (the
#      strided batches' products side by side on the threads);
#   4. the MPI unit tests' device-path twins at one thread per rank.
# OMP_WAIT_POLICY=passive: threads beyond the cores sleep at OpenMP's barriers instead of
# spinning (8 threads on 2 cores otherwise take many minutes per kernel-heavy test). Prints one
# line per program or ctest run; exit 1 if any failed.
set -uo pipefail
build=$(cd "${1:?usage: omp_threads.sh BUILD_DIR [THREADS]}" && pwd)
threads=${2:-8}
logs=$(mktemp -d "${TMPDIR:-/tmp}/kmoe-omp.XXXXXX")
status=0
export OMP_PROC_BIND=false OMP_WAIT_POLICY=passive OPENBLAS_NUM_THREADS=1
export KMOE_CHECK_DEVICE_MEMORY=1
single=(test_gemm test_deck test_data test_step_stats test_ops test_ops_attention test_moe
        test_precision test_engram_hash test_engram test_train_units test_device_memory
        test_execution test_row_exchange test_model_grad)
echo "omp_threads: $threads threads, logs in $logs"

programs() {  # programs DEVICE_PATHS
  for t in "${single[@]}"; do
    local log=$logs/$t-dp$1.log start end
    start=$(date +%s)
    OMP_NUM_THREADS=$threads KMOE_DEVICE_PATHS=$1 "$build/tests/unit/$t" > "$log" 2>&1
    local rc=$?
    end=$(date +%s)
    printf '%-20s device paths %s: exit %d in %4d s, %s\n' "$t" "$1" "$rc" $((end - start)) \
      "$(grep -aoE '(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || status=1
  done
}

ctest_run() {  # ctest_run WHAT OMP_THREADS REGEX
  local log=$logs/ctest-$1.log
  (cd "$build" && OMP_NUM_THREADS=$2 ctest -R "$3" --timeout 3000 > "$log" 2>&1)
  local rc=$?
  echo "$1: $(grep -E '^[0-9]+% tests passed' "$log")"
  [ $rc -eq 0 ] || status=1
}

programs 1
ctest_run "reference twins at $threads threads" "$threads" '^reference_.*_device_paths$'
programs 0
ctest_run "MPI unit twins at 1 thread per rank" 1 '_np[0-9]+_device_paths$'
exit $status
