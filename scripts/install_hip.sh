#!/usr/bin/env bash
# Installs Debian 12's ROCm 5.2 toolchain for compile checks of kmoe's HIP build (as root),
# skipping the apt run when all are present: hipcc (a wrapper around Debian's clang 15 with
# --offload-arch), the HIP runtime's headers and library, and the device bitcode libraries.
# Debian has no rocBLAS, hipBLAS, rocThrust or rocPRIM: docs/BUILDING.md ("HIP on Debian 12")
# says what a ROCm install adds. Not part of install_deps.sh's list: CI does not build HIP.
set -euo pipefail
KMOE_INSTALL_NAME=install_hip exec "$(dirname "$0")/install_deps.sh" \
  hipcc libamdhip64-dev rocm-device-libs
