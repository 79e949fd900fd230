#!/usr/bin/env bash
# The unit tests under AddressSanitizer (by hand, outside CI): configures build-asan (the
# host compiler with -fsanitize=address; the Workspace's free memory and the gap after each
# buffer are poisoned there, core/workspace.cpp), builds the unit-test binaries and runs them,
# the MPI ones at 1, 2 and 4 ranks, with LeakSanitizer's suppressions for Open MPI
# (tests/asan/lsan.supp). Extra arguments go to ctest (e.g. -R test_moe). About 10 minutes on
# 2 cores, most of it the build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KMOE_ASAN_BUILD_DIR:-$root/build-asan}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="-fsanitize=address -fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address"
fi
tests=(test_gemm test_deck test_data test_model_grad test_train_units test_step_stats test_ops
       test_ops_attention test_moe test_precision test_engram_hash test_engram test_parallel
       test_row_exchange test_execution)
cmake --build "$build" -j "$(nproc)" --target "${tests[@]}"
# Open MPI's shared-memory transport maps memory ASan does not track; its leaks at exit are
# suppressed, kmoe's are reported. A finding fails the test (exit code 1).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:exitcode=1:strict_string_checks=1:detect_stack_use_after_return=0}
# Full stacks for leaks (the libraries have no frame pointers): a suppression matches any frame,
# and Open MPI's components, unloaded at MPI_Finalize, leave no module name in their own frames.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/asan/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0}
cd "$build"
regex=$(IFS='|'; echo "^(${tests[*]})(_np[0-9]+)?(_device_paths)?$")
ctest --output-on-failure -j "$(nproc)" -R "$regex" "$@"
