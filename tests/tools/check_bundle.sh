#!/usr/bin/env bash
# The relocatable bundle and the GPU check, tried on this (CPU) build: scripts/bundle.sh packs
# the build, the launcher runs a program, scripts/gpu_check.sh --prepare computes the reference
# steps and the Hugging Face exports, and the check itself runs end to end under its deadline:
# the bundle's training steps against the build it came from (a relocation check: the same
# build, not a cross-build comparison), a benchmark shrunk to CPU size with its per-step counts,
# and every GPU-only step reported skipped by name (the build's own ctest runs the unit tests).
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
# The reference steps shrunk to a CPU's size (the relocation check trains the same model).
GPU_CHECK_REFERENCE_ARGS="--train.seq_len=64 --model.d_model=128" \
  "$scripts/gpu_check.sh" --prepare "$build" "$tmp/b" | tail -1
GPU_CHECK_BENCH_ARGS="--model.d_model=64 --model.n_layers=2 --model.n_heads=2 --moe.experts=4 \
--moe.top_k=2 --moe.expert_hidden=32 --train.seq_len=64" \
  "$tmp/b/gpu_check.sh" "$tmp/b" "$tmp/out" > "$tmp/check.log" 2>&1 || { cat "$tmp/check.log"; fail "gpu_check.sh"; }
tail -5 "$tmp/check.log"
sum=$tmp/out/summary.txt
grep -q "ok   training from the bundle against the build it came from (a relocation check): 8 steps" "$sum" ||
  fail "no relocation check"
grep -q "^ok   bench_moe_fp32: .* tokens/s" "$sum" || fail "no benchmark figure"
grep -q "^ok   counter: per step: .* named host waits" "$sum" || fail "no per-step counts"
for s in bench_moe_bf16 peer_moe_bf16_grouped peer_moe_bf16_loop peer_moe_fp32_loop bench_dense_bf16 \
         peer_dense_bf16 memcheck racecheck unit_tests bench_moe_tf32 bench_moe_per_expert_fp32 \
         bench_moe_per_expert_bf16 offload_check fused_check bench_dense_bf16_fused; do
  grep -q "^skip $s: a CPU bundle" "$sum" || fail "$s is not reported skipped by name"
done
grep -q "^skip hf_parity: \|^ok   hf_parity" "$sum" || fail "hf_parity neither ran nor was skipped"
[ "$(tail -n +2 "$tmp/out/figures.tsv" | wc -l)" -ge 16 ] || fail "figures.tsv lacks steps"
for arch in olmo2 llama flex_olmo olmoe; do
  [ -f "$tmp/b/check/hf/$arch/config.json" ] && [ -f "$tmp/b/check/hf/$arch/kmoe.logits.npy" ] ||
    fail "no $arch export with kmoe's logits in the bundle"
done
grep -q "gpu_check: passed" "$sum" || fail "the check did not pass"
echo "ok   gpu_check.sh runs end to end on this build, GPU-only steps skipped by name"
# The profiling script of the GPU window: on a CPU bundle every GPU step skipped by name.
"$tmp/b/gpu_profile.sh" "$tmp/b" "$tmp/prof" > "$tmp/prof.log" 2>&1 || { cat "$tmp/prof.log"; fail "gpu_profile.sh"; }
for s in targets dense_tiled dense_fused peer_dense moe peer_moe_grouped peer_dense_profiled \
         dense_micro4 dense_micro8 moe_micro8; do
  grep -q "^skip $s: a CPU bundle" "$tmp/prof/summary.txt" || fail "gpu_profile: $s is not reported skipped by name"
done
grep -q "^gpu_profile: done" "$tmp/prof/summary.txt" || fail "gpu_profile.sh did not finish"
echo "ok   gpu_profile.sh runs on this build, GPU steps skipped by name"
