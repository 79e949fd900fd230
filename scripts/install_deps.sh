#!/usr/bin/env bash
# Installs kmoe's Debian 12 packages (as root), skipping the apt run when all are present.
# With arguments, those packages instead (scripts/install_hip.sh).
set -euo pipefail
name=install_deps
packages=(
  g++ make cmake
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev libopenblas-dev
  libopenmpi-dev openmpi-bin libhdf5-openmpi-dev hdf5-tools
  libboost-program-options-dev libgtest-dev nlohmann-json3-dev libsentencepiece-dev
  python3 python3-matplotlib python3-torch python3-h5py
  fortunes
  slurm-wlm munge procps strace
)
if [ $# -gt 0 ]; then
  name=${KMOE_INSTALL_NAME:-install_deps}
  packages=("$@")
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "$name: all ${#packages[@]} packages present"
  exit 0
fi
echo "$name: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
