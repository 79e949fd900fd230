#!/usr/bin/env bash
# bundle.sh BUILD_DIR OUT: a relocatable copy of a kmoe build for a machine that has only the
# NVIDIA driver and the CUDA toolkit (or nothing at all, for a CPU build): the drivers, the
# benchmarks, the unit tests and the Kokkos Tools counter, every shared library they load that
# is neither the C library nor part of the CUDA toolkit or driver (Kokkos, Kokkos Kernels,
# HDF5, MPI, Boost, GoogleTest, the BLAS, libstdc++ ...), and Open MPI's runtime files (its
# components and help texts, and PMIx's), found through OPAL_PREFIX and PMIX_INSTALL_PREFIX.
#
#   OUT/kmoe PROGRAM [ARGS...]   runs OUT/bin/PROGRAM with the bundle's paths, after checking
#                                that every library resolves and, for a CUDA build, that the
#                                driver supports the CUDA version it was built with
#   OUT/MANIFEST                 what was bundled from where, the build's CUDA version
#   OUT.tar.gz                   the same, to carry (about 40 MiB for a Debian 12 build; most
#                                of it OpenBLAS with kernels for every x86-64 generation)
#
# Libraries from the CUDA toolkit (cudart, cuBLAS; and NCCL where it sits in the toolkit) are
# left to the target's toolkit: OUT/kmoe says which are missing there. One rank per machine
# (no mpirun in the bundle): kmoe starts as an MPI singleton.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: scripts/bundle.sh BUILD_DIR OUT" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
out=$2
[ -x "$build/drivers/kmoe-train" ] || { echo "bundle.sh: $build/drivers/kmoe-train not found" >&2; exit 2; }
cuda_root=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}" 2>/dev/null || true)
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/ompi"
out=$(cd "$out" && pwd)

programs=("$build"/drivers/kmoe-{train,eval,prep,export,import,generate} "$build"/bench/bench_{gemm,layers})
for t in "$build"/tests/unit/test_* "$build"/tests/test_nccl_link; do
  [ -f "$t" ] && [ -x "$t" ] && programs+=("$t")
done
for p in "${programs[@]}"; do cp "$p" "$out/bin/"; done
command -v strip > /dev/null && strip --strip-unneeded "$out"/bin/* 2> /dev/null || true
cp "$build/tests/tools/libkmoe_kokkos_counter.so" "$out/lib/"
# The CUPTI tracer of gpu_profile.sh, where the build had CUPTI (libcupti stays the toolkit's).
[ -f "$build/tests/tools/libkmoe_cupti_tracer.so" ] && cp "$build/tests/tools/libkmoe_cupti_tracer.so" "$out/lib/"

# Open MPI's components and help files, and PMIx's, in the layout their prefixes expect.
copy_tree() {  # copy_tree SRC DST_UNDER_OUT
  [ -d "$1" ] && mkdir -p "$out/$2" && cp -a "$1/." "$out/$2/"
}
if command -v ompi_info > /dev/null; then
  prefix=$(ompi_info --path prefix --parsable | cut -d: -f3-)
  pkglib=$(ompi_info --path pkglibdir --parsable | cut -d: -f3-)
  pkgdata=$(ompi_info --path pkgdatadir --parsable | cut -d: -f3-)
  copy_tree "$pkglib" "ompi/${pkglib#"$prefix"/}"
  copy_tree "$pkgdata" "ompi/${pkgdata#"$prefix"/}"
  pmix=$(ldconfig -p | awk '/libpmix.so.2 / && !found {print $NF; found = 1}')
  if [ -n "$pmix" ]; then
    pmix_prefix=$(dirname "$(dirname "$(readlink -f "$pmix")")")
    copy_tree "$pmix_prefix/lib/pmix" "pmix/lib/pmix"
    copy_tree "$pmix_prefix/share/pmix" "pmix/share/pmix"
  fi
fi

# Every library the programs and the components load, but the C library's and CUDA's.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libutil|libresolv|libcuda\.so|libnvidia)'
declare -A seen=()
queue=("$out"/bin/* "$out"/lib/*.so)
while IFS= read -r -d '' f; do queue+=("$f"); done < <(find "$out/ompi" "$out/pmix" -name '*.so' -print0 2>/dev/null)
manifest=()
while [ ${#queue[@]} -gt 0 ]; do
  # One ldd over the whole queue (a few hundred files at the start), each library named once:
  # the new ones form the next round (a readlink for those only: forks were most of the time).
  batch=("${queue[@]}")
  queue=()
  while read -r name path; do
    [ -n "$path" ] && [ "$path" != "not" ] || continue
    [ -n "${seen[$name]:-}" ] && continue
    [[ $name =~ $skip ]] && continue
    real=$(readlink -f "$path")
    if [ -n "$cuda_root" ] && [[ $real == "$cuda_root"/* ]]; then
      seen[$name]=cuda
      continue
    fi
    seen[$name]=$real
    cp -L "$path" "$out/lib/$name"
    manifest+=("$name <- $real")
    queue+=("$out/lib/$name")
  done < <(ldd "${batch[@]}" 2>/dev/null | awk '/=>/ && $3 != "not" && !named[$1]++ {print $1, $3}')
done

cuda_version=""
# A CUDA Kokkos loads the driver library (libcuda): then the driver must support the runtime.
if LD_LIBRARY_PATH="$out/lib" ldd "$out/bin/kmoe-train" | grep -q 'libcuda\.so'; then
  cuda_version=$(ldd "$out/bin/kmoe-train" | awk '/libcudart/{print $1}' | sed 's/libcudart.so.//')
fi
{
  echo "kmoe bundle of $build, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cuda_runtime_major: ${cuda_version:-none}"
  echo "cuda_libraries_from_the_target:"
  for n in "${!seen[@]}"; do if [ "${seen[$n]}" = cuda ]; then echo "  $n"; fi; done | sort
  echo "bundled:"
  printf '  %s\n' "${manifest[@]}" | sort
} > "$out/MANIFEST"

cat > "$out/kmoe" <<'LAUNCH'
#!/usr/bin/env bash
# kmoe PROGRAM [ARGS...]: runs a program of this bundle (bin/) with its libraries and MPI files.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ $# -lt 1 ]; then
  echo "usage: $here/kmoe PROGRAM [ARGS...]; programs: $(ls "$here/bin" | tr '\n' ' ')" >&2
  exit 2
fi
prog=$here/bin/$1
shift
[ -x "$prog" ] || { echo "kmoe bundle: no program $(basename "$prog") in $here/bin" >&2; exit 2; }
cuda_lib=""
for d in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -n "$d" ] && [ -d "$d" ] && cuda_lib="$d/lib64:$d/lib:$d/targets/x86_64-linux/lib" && break
done
export LD_LIBRARY_PATH="$here/lib${cuda_lib:+:$cuda_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$here/ompi" PMIX_INSTALL_PREFIX="$here/pmix"
export OMPI_MCA_ess_singleton_isolated=${OMPI_MCA_ess_singleton_isolated:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
missing=$(ldd "$prog" 2>/dev/null | awk '/not found/{print $1}' | tr '\n' ' ')
if [ -n "$missing" ] && command -v python3 > /dev/null; then
  # CUDA's libraries (NCCL, cuBLAS, the runtime) as NVIDIA's Python wheels install them, e.g.
  # beside PyTorch, where the toolkit lacks them.
  wheels=$(python3 -c 'import glob, os, site
print(":".join(sorted({d for sp in site.getsitepackages() for d in glob.glob(os.path.join(sp, "nvidia", "*", "lib"))})))' 2>/dev/null)
  if [ -n "$wheels" ]; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheels"
    missing=$(ldd "$prog" 2>/dev/null | awk '/not found/{print $1}' | tr '\n' ' ')
  fi
fi
if [ -n "$missing" ]; then
  echo "kmoe bundle: $(basename "$prog") needs libraries this machine lacks: $missing" >&2
  echo "(CUDA's come from the toolkit, CUDA_HOME, or NVIDIA's Python wheels; see $here/MANIFEST)" >&2
  exit 2
fi
need=$(awk '/^cuda_runtime_major:/{print $2}' "$here/MANIFEST")
if [ "$need" != "none" ]; then
  if ! command -v nvidia-smi > /dev/null; then
    echo "kmoe bundle: built for CUDA $need, but nvidia-smi (the NVIDIA driver) is missing" >&2
    exit 2
  fi
  have=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1)
  if [ -z "$have" ] || [ "$have" -lt "$need" ]; then
    echo "kmoe bundle: built for CUDA $need, but the driver supports CUDA ${have:-unknown}" >&2
    exit 2
  fi
fi
exec "$prog" "$@"
LAUNCH
chmod +x "$out/kmoe"
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "bundle.sh: $out: $(du -sh "$out" | cut -f1) ($(ls "$out/bin" | wc -l) programs," \
     "${#manifest[@]} libraries); $out.tar.gz: $(du -sh "$out.tar.gz" | cut -f1)"
