#!/usr/bin/env bash
# The flake finder: runs one ctest label's tests N times on a fresh clone and prints each test's
# pass count and times (docs/TESTING.md, "Flakes").
#
#   bash scripts/test_repeat.sh LABEL N [--load]
#
# LABEL is a ctest label regular expression (-L), e.g. slurm or 'slurm|mpi|regression|checkpoint';
# the long tests (-L long) are left out as in scripts/test.sh. The clone is of this checkout's
# HEAD (commit first), built with scripts/build.sh under a short temporary directory
# (KMOE_REPEAT_DIR to choose it; it is kept for a look at the logs). --load runs another build
# of kmoe beside the tests the whole time (a clean rebuild in a loop, KMOE_REPEAT_LOAD_JOBS
# compile jobs, default 1), as on a machine where someone is building. Each run's ctest output
# and failing tests' logs are kept under DIR/runs/. Exit code 0 only when every test passed
# every time.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/test_repeat.sh LABEL N [--load]   (N >= 1 runs of ctest -L LABEL)" >&2
  exit 2
fi
label=$1
runs=$2
load=0
[ "${3:-}" = "--load" ] && load=1
if [ $# -gt 2 ] && [ "$3" != "--load" ]; then
  echo "scripts/test_repeat.sh: unknown option '$3' (expected --load)" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${KMOE_REPEAT_DIR:-$(mktemp -d /tmp/kmoe-repeat.XXXXXX)}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

bash "$root/scripts/install_deps.sh"
rm -rf "$dir/runs"
# A clone of this very commit that built to the end (a DIR given again) is used as it is.
head=$(git -C "$root" rev-parse HEAD)
if [ -f "$dir/src/build/.test_repeat_built" ] &&
   [ "$(git -C "$dir/src" rev-parse HEAD 2>/dev/null)" = "$head" ] &&
   [ -z "$(git -C "$dir/src" status --porcelain --untracked-files=no)" ]; then
  echo "test_repeat: using the clone and build of $head in $dir/src"
else
  rm -rf "$dir/src"
  git clone -q "$root" "$dir/src"
  KMOE_BUILD_DIR="$dir/src/build" bash "$dir/src/scripts/build.sh" >"$dir/build.log" 2>&1 || {
    tail -30 "$dir/build.log"
    echo "test_repeat: the build failed ($dir/build.log)" >&2
    exit 1
  }
  touch "$dir/src/build/.test_repeat_built"
fi
echo "test_repeat: $(git -C "$dir/src" log -1 --format='%h %s'), label '$label', $runs runs" \
     "$([ $load = 1 ] && echo "beside a build (load)"), in $dir"
# The same configuration test.sh gives (NCCL where found): the build's cache decides.
cd "$dir/src/build"
source "$dir/src/scripts/ctest_env.sh"  # the suite's MPI settings and ctest slots, as in test.sh
names=$(ctest -N -L "$label" -LE long | sed -n 's/^ *Test *#[0-9]*: //p')
if [ -z "$names" ]; then
  echo "test_repeat: no test has a label matching '$label'" >&2
  exit 2
fi

loader=0
stop_load() {
  if [ "$loader" -ne 0 ]; then
    kill -- -"$loader" 2>/dev/null || kill "$loader" 2>/dev/null || true
    wait "$loader" 2>/dev/null || true
    loader=0
  fi
}
trap stop_load EXIT
if [ $load = 1 ]; then
  rm -rf "$dir/load"
  git clone -q "$root" "$dir/load"
  cmake -S "$dir/load" -B "$dir/load/build" -DCMAKE_BUILD_TYPE=Release >"$dir/load.log" 2>&1
  set -m
  ( while :; do
      cmake --build "$dir/load/build" --target clean >/dev/null 2>&1
      cmake --build "$dir/load/build" -j "${KMOE_REPEAT_LOAD_JOBS:-1}" >>"$dir/load.log" 2>&1
    done ) &
  loader=$!
  set +m
fi

mkdir -p "$dir/runs"
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  t=$(date +%s)
  rc=0
  ctest --timeout 1500 -j "$KMOE_CTEST_JOBS" -L "$label" -LE long \
    >"$dir/runs/run$i.txt" 2>&1 || rc=$?
  failed=$(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) .*(\(Failed\|Timeout\|SEGFAULT\|Subprocess.*\|Exception\|Child aborted\)).*$/\1/p' \
             "$dir/runs/run$i.txt" | tr '\n' ' ')
  [ -f Testing/Temporary/LastTest.log ] && cp Testing/Temporary/LastTest.log "$dir/runs/run$i.log"
  echo "test_repeat: run $i of $runs: $(( $(date +%s) - t )) s," \
       "$( [ $rc = 0 ] && echo "all passed" || echo "failed: ${failed:-see $dir/runs/run$i.txt}")"
done
stop_load

# Each test: passes out of runs, mean and longest time (ctest's "Test #k: name ... Passed  x sec").
echo "test_repeat: $runs runs of label '$label' in $(( $(date +%s) - start )) s" \
     "$([ $load = 1 ] && echo "(beside a build)")"
printf '  %-34s %7s %9s %9s\n' test passed "mean s" "max s"
all=0
for name in $names; do
  line=$(cat "$dir"/runs/run*.txt | awk -v n="$name" '
    $0 ~ /Test +#[0-9]+: / {
      split($0, a, /Test +#[0-9]+: /); split(a[2], b, " "); if (b[1] != n) next
      sec = $(NF - 1); runs++; total += sec; if (sec > max) max = sec
      if ($0 ~ / Passed +[0-9.]+ sec/) ok++
    }
    END { printf "%d %d %.1f %.1f", ok, runs, runs ? total / runs : 0, max }')
  read -r ok seen mean max <<<"$line"
  [ "$ok" != "$runs" ] && all=1
  printf '  %-34s %3d/%-3d %9s %9s\n' "$name" "$ok" "$runs" "$mean" "$max"
  [ "$seen" != "$runs" ] && echo "    ($name ran $seen times of $runs: a run ended early)"
done
[ $all = 0 ] && echo "test_repeat: every test passed $runs of $runs" ||
  echo "test_repeat: some tests failed at least once (logs: $dir/runs/)"
exit $all
