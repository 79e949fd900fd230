#!/usr/bin/env bash
# The test command: install dependencies, build, run every ctest suite. Where NCCL and the CUDA
# toolkit are installed (nccl.h next to cuda_runtime.h), the build includes the NCCL backend
# (-DKMOE_ENABLE_NCCL=ON), so CI proves that it compiles and links even without a GPU
# (ctest label nccl); KMOE_TEST_NCCL=0 leaves the option alone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
build=${KMOE_BUILD_DIR:-$root/build}

nccl_args=()
if [ "${KMOE_TEST_NCCL:-1}" != 0 ]; then
  for inc in ${NCCL_ROOT:+"$NCCL_ROOT/include"} /usr/local/cuda/include /usr/include; do
    if [ -f "$inc/nccl.h" ] && { [ -f "$inc/cuda_runtime.h" ] ||
                                 [ -f /usr/local/cuda/include/cuda_runtime.h ]; }; then
      nccl_args=(-DKMOE_ENABLE_NCCL=ON)
      echo "test.sh: $inc/nccl.h found: building the NCCL backend"
      break
    fi
  done
fi
# build.sh passes arguments to the first configure only; an existing build directory
# configured without NCCL is switched on once (a second run finds it on and does nothing).
if [ ${#nccl_args[@]} -gt 0 ] && [ -f "$build/CMakeCache.txt" ] &&
   ! grep -q '^KMOE_ENABLE_NCCL:BOOL=ON$' "$build/CMakeCache.txt"; then
  cmake -S "$root" -B "$build" -DKMOE_ENABLE_NCCL=ON
fi
bash scripts/build.sh ${nccl_args[@]+"${nccl_args[@]}"}

cd "$build"
rc=0
mkdir -p Testing
# Every test but the long versions (ctest -L long: precision_long, planner_memory_long), with the
# suite's MPI settings and ctest slots (scripts/ctest_env.sh).
source "$root/scripts/ctest_env.sh"
ctest --output-on-failure --timeout 1500 -j "$KMOE_CTEST_JOBS" -LE long 2>&1 |
  tee Testing/ctest-output.txt || rc=$?
# Subjects a test could not exercise on this machine or build (gtest's SKIPPED, the script
# tests' "skip WHAT: WHY" lines): listed, so a skip is never read as a pass.
log=Testing/Temporary/LastTest.log
if [ -f "$log" ]; then
  skips=$(grep -E '^skip [^:]+: |^\[  SKIPPED \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+ \(' "$log" | sort -u)
  if [ -n "$skips" ]; then
    echo "test.sh: subjects skipped on this machine or build ($(echo "$skips" | wc -l)):"
    echo "$skips" | sed 's/^/  /'
  else
    echo "test.sh: no subject skipped"
  fi
fi
# ctest's closing lines again, last.
grep -E '^[0-9]+% tests passed|^Total Test time' Testing/ctest-output.txt || true
exit $rc
