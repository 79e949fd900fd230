#!/usr/bin/env bash
# The test command: install dependencies, build, run every ctest suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
bash scripts/build.sh
cd "${KMOE_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 1500
