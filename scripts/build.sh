#!/usr/bin/env bash
# Configures (once) and builds kmoe into ${KMOE_BUILD_DIR:-build}. Extra arguments go to the
# first cmake configure, e.g. scripts/build.sh -DKokkos_ROOT=/opt/kokkos.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KMOE_BUILD_DIR:-$root/build}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$build" -j "$(nproc)"
