#!/usr/bin/env bash
# kmoe's HIP compile check (ctest hip_compile, label hip; docs/BUILDING.md, "HIP"): configures
# this source tree with hipcc against a Kokkos + Kokkos Kernels install built for HIP, compiles
# the library and the given targets (default kmoe-train), and checks that the driver carries
# device code for the install's AMD GPU architecture. Nothing runs: no AMD GPU is needed.
# Without rocBLAS in Kokkos Kernels the build takes its native GEMM (KMOE_ALLOW_NATIVE_GEMM).
#   compile_check.sh HIPCC SOURCE_DIR BUILD_DIR KOKKOS_PREFIX [TARGET...]
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: compile_check.sh HIPCC SOURCE_DIR BUILD_DIR KOKKOS_PREFIX [TARGET...]" >&2
  exit 2
fi
hipcc=$1 src=$2 build=$3 kokkos=$4
shift 4
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kmoe-train)
arch=$(sed -n 's/^#define KOKKOS_ARCH_AMD_\(GFX[0-9A-Z]*\).*/\1/p' "$kokkos/include/KokkosCore_config.h" |
       head -n 1 | tr 'A-Z' 'a-z')
if [ -z "$arch" ]; then
  echo "hip_compile: $kokkos/include/KokkosCore_config.h names no AMD GPU architecture" \
       "(Kokkos_ARCH_AMD_GFX...): not a Kokkos built for HIP" >&2
  exit 1
fi
mkdir -p "$build"
# (-U: a build directory reused with another prefix forgets the packages it found before)
cmake -S "$src" -B "$build" -UKokkos_DIR -UKokkosKernels_DIR \
      -DCMAKE_CXX_COMPILER="$hipcc" -DKokkos_ROOT="$kokkos" \
      -DKokkosKernels_ROOT="$kokkos" -DCMAKE_BUILD_TYPE=Release -DKMOE_ALLOW_NATIVE_GEMM=ON \
      -DKMOE_ENABLE_TESTS=OFF > "$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
grep "kmoe: Kokkos .* backends" "$build/configure.log" || true
start=$(date +%s)
cmake --build "$build" --target "${targets[@]}" -j "${KMOE_HIP_JOBS:-2}" > "$build/compile.log" 2>&1 ||
  { (grep -B2 -A8 "error" "$build/compile.log" | head -n 200) || true
    echo "hip_compile: build failed (log: $build/compile.log)"; exit 1; }
seconds=$(( $(date +%s) - start ))
warnings=$(grep -c "warning:" "$build/compile.log" || true)
echo "hip_compile: ${targets[*]} built for $arch in $seconds s, $warnings compiler warnings" \
     "(log: $build/compile.log)"
grep "warning:" "$build/compile.log" | sort | uniq -c | head -n 40 || true
for t in "${targets[@]}"; do
  bin=$(find "$build" -type f -name "$t" -perm -u+x | head -n 1)
  if [ -z "$bin" ]; then
    echo "hip_compile: $t was not built" >&2
    exit 1
  fi
  if ! grep -aq "amdgcn-amd-amdhsa--$arch" "$bin"; then  # the offload bundle's target id
    echo "hip_compile: $bin carries no device code for $arch" >&2
    exit 1
  fi
  echo "hip_compile: $bin carries device code for $arch"
done
