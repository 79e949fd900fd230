#!/usr/bin/env bash
# test_matrix.sh [BUILD_DIR]: the unit and reference tests under every OpenBLAS kernel this CPU
# can execute (OPENBLAS_CORETYPE) and with 1, 2 and 4 BLAS threads, so that no verdict depends on
# which kernel rounds last. Run by hand (not in CI: about 25 x the unit and reference labels).
# Prints one line per (kernel, threads) with ctest's summary and the failed tests, and the worst
# margin of each finite-difference check (KMOE_FD_LOG: |fd - analytic| against its bound) over
# the whole matrix; exit 1 if any combination failed. docs/BUILDING.md's tested table records
# what it found.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]]; }
kernels=(Prescott Nehalem)
has avx && kernels+=(Sandybridge)
has avx2 && kernels+=(Haswell Zen)
has avx512f && kernels+=(SkylakeX)
has avx512_bf16 && kernels+=(Cooperlake)
log_dir=$(mktemp -d "${TMPDIR:-/tmp}/kmoe-matrix.XXXXXX")
fd_log=$log_dir/fd.tsv
status=0
trap 'cmake "$build" -DKMOE_TEST_BLAS_THREADS=1 > /dev/null' EXIT
echo "test_matrix: kernels ${kernels[*]}; threads 1 2 4; logs in $log_dir"
for k in "${kernels[@]}"; do
  for t in 1 2 4; do
    out=$log_dir/$k-$t.log
    # The tests' BLAS threads are a configure setting (their ctest environment).
    cmake "$build" -DKMOE_TEST_BLAS_THREADS=$t > /dev/null
    # The planted-fault tests (label planted) run after, without the margin log: their checks
    # fail on purpose.
    (cd "$build" && OPENBLAS_CORETYPE=$k KMOE_FD_LOG=$fd_log \
       ctest -j "$(nproc)" -L 'unit|reference' -LE planted --timeout 1500 > "$out" 2>&1)
    rc=$?
    # The reference tests' worst error / tolerance ratios of this combination.
    sed -n 's/.*(\(max error [^,]*\), worst error \/ tolerance \([0-9.]*\)).*/\2/p;
            s/.*(worst error \/ tolerance \([0-9.]*\)).*/\1/p' \
      "$build/Testing/Temporary/LastTest.log" >> "$log_dir/ref_ratios.txt"
    (cd "$build" && OPENBLAS_CORETYPE=$k ctest -j "$(nproc)" -L planted --timeout 1500 \
       >> "$out" 2>&1) || rc=1
    summary=$(grep -E '^[0-9]+% tests passed' "$out" | tr '\n' ' ')
    failed=$(sed -n '/The following tests FAILED/,$p' "$out" | grep -E '^\s+[0-9]+ - ' |
             awk '{print $3}' | tr '\n' ' ')
    echo "$k, $t thread(s): ${summary:-no summary} ${failed:+(failed: $failed)}"
    [ $rc -eq 0 ] || status=1
  done
done
if [ -s "$fd_log" ]; then
  echo "finite-difference checks, the worst ratio |fd - analytic| / bound over the matrix:"
  sort -t$'\t' -k1,1 "$fd_log" | awk -F'\t' '{r = $3 > 0 ? $2 / $3 : 0; if (!($1 in w) || r > w[$1]) w[$1] = r}
    END {for (n in w) printf "  %-40s %.3f\n", n, w[n]}' | sort -k2 -nr | head -15
fi
if [ -s "$log_dir/ref_ratios.txt" ]; then
  echo "reference tests, the worst error / tolerance over the matrix: $(sort -n "$log_dir/ref_ratios.txt" | tail -1)"
fi
exit $status
