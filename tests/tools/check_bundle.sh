#!/usr/bin/env bash
# The relocatable bundle and the GPU check, tried on this (CPU) build: scripts/bundle.sh packs
# the build, the launcher runs a program, scripts/gpu_check.sh --prepare computes the reference
# steps, and the check itself passes (unit tests, training steps within tolerance of the
# reference, a benchmark shrunk to CPU size with its per-step counts).
# Usage: check_bundle.sh BUILD_DIR SCRIPTS_DIR
set -euo pipefail
build=$1 scripts=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kmoe-bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL $*"; exit 1; }
"$scripts/bundle.sh" "$build" "$tmp/b" | tail -1
[ -x "$tmp/b/kmoe" ] && [ -f "$tmp/b.tar.gz" ] || fail "no launcher or archive"
size=$(du -sm "$tmp/b.tar.gz" | cut -f1)
[ "$size" -lt 50 ] || fail "the archive is $size MiB (over 50)"
echo "ok   archive $size MiB"
"$tmp/b/kmoe" kmoe-train --help | grep -q "phase_timing" || fail "the launcher does not run kmoe-train"
echo "ok   the launcher runs kmoe-train"
if "$tmp/b/kmoe" no-such-program 2> "$tmp/err"; then fail "an unknown program ran"; fi
grep -q "no program no-such-program" "$tmp/err" || fail "unknown program: $(cat "$tmp/err")"
echo "ok   an unknown program is refused by name"
"$scripts/gpu_check.sh" --prepare "$build" "$tmp/b" | tail -1
GPU_CHECK_BENCH_ARGS="--model.d_model=64 --model.n_layers=2 --model.n_heads=2 --moe.experts=4 \
--moe.top_k=2 --moe.expert_hidden=32 --train.seq_len=64" \
  "$tmp/b/gpu_check.sh" "$tmp/b" "$tmp/out" > "$tmp/check.log" 2>&1 || { cat "$tmp/check.log"; fail "gpu_check.sh"; }
tail -5 "$tmp/check.log"
grep -q "training against the CPU build: 8 steps" "$tmp/out/summary.txt" || fail "no training comparison"
grep -q "bench per step: .* named host waits" "$tmp/out/summary.txt" || fail "no per-step counts"
grep -q "gpu_check: passed" "$tmp/out/summary.txt" || fail "the check did not pass"
echo "ok   gpu_check.sh passes on this build"
