#!/usr/bin/env bash
# gpu_check.sh: kmoe on one NVIDIA GPU, from a bundle (scripts/bundle.sh), on a machine with the
# driver, the CUDA toolkit and Python but no MPI, HDF5, Boost or Kokkos. In under 8 minutes:
#   1. every unit test of the bundle that runs on one rank;
#   2. single-rank training steps against the same steps precomputed on a CPU build: the loss
#      of each step within a relative 2e-3 (fp32 on both; the GPU sums in other orders, and
#      a near-tie in MoE routing may go the other way), the first step's within 1e-4;
#   3. a short benchmark: tokens/s and MFU in fp32, tf32 and bf16 (each against the GPU's dense
#      peak for that precision, as output.peak_flops), time per phase, and kernel launches,
#      fences and named host waits per step (the bundle's Kokkos Tools counter).
#
#   gpu_check.sh --prepare CPU_BUILD BUNDLE   (here) adds BUNDLE/check: the decks, a token file
#                                             and the CPU build's losses for step 2
#   gpu_check.sh BUNDLE [OUT]                 (there) runs 1-3; figures and logs under OUT
#                                             (default ./gpu_check_out); exit 0 when 1 and 2 pass
# GPU_CHECK_BENCH_ARGS: deck overrides for the benchmark (e.g. a smaller model to try the
# script on a CPU bundle).
set -uo pipefail
STEPS=8
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

deck_tail() {  # the sections both decks share
  cat <<'DECK'
[data]
paths = data/train.bin
dtype = uint16
[checkpoint]
every = 0
[output]
log_every = 1
DECK
}

check_deck() {  # the main job's model on one rank, shortened
  cat <<'DECK'
[model]
vocab_size = 320
d_model = 256
n_layers = 4
n_heads = 4
ffn_hidden = 768
[moe]
experts = 8
top_k = 2
expert_hidden = 256
shared_experts = 1
shared_hidden = 256
[engram]
layers = 1
[train]
seq_len = 256
global_batch = 16
micro_batch = 8
max_steps = 8
seed = 0
[optimizer]
lr = 3e-3
warmup_steps = 4
DECK
  deck_tail
}

bench_deck() {  # a deeper, wider MoE for throughput: 16 blocks, 64 experts, top-8
  cat <<'DECK'
[model]
vocab_size = 320
d_model = 1024
n_layers = 16
n_heads = 16
ffn_hidden = 2048
[moe]
experts = 64
top_k = 8
expert_hidden = 512
[train]
seq_len = 1024
global_batch = 16
micro_batch = 4
max_steps = 6
[optimizer]
lr = 1e-3
warmup_steps = 2
DECK
  deck_tail
}

if [ "${1:-}" = "--prepare" ]; then
  [ $# -eq 3 ] || { echo "usage: gpu_check.sh --prepare CPU_BUILD BUNDLE" >&2; exit 2; }
  cpu=$(cd "$2" && pwd) bundle=$(cd "$3" && pwd)
  dir=$bundle/check
  rm -rf "$dir" && mkdir -p "$dir/data"
  check_deck > "$dir/check.deck"
  bench_deck > "$dir/bench.deck"
  "$cpu/drivers/kmoe-prep" --fortunes --out-dir "$dir/data" > /dev/null 2>&1
  (cd "$dir" && OPENBLAS_NUM_THREADS=1 "$cpu/drivers/kmoe-train" -i check.deck \
     --output.dir=cpu_run --checkpoint.dir=cpu_run/ckpt > cpu_run.log 2>&1) ||
    { echo "gpu_check.sh: the CPU reference run failed: $dir/cpu_run.log" >&2; exit 1; }
  cp "$dir/cpu_run/metrics.csv" "$dir/cpu_metrics.csv"
  rm -rf "$dir/cpu_run"
  cp "$here/gpu_check.sh" "$bundle/gpu_check.sh"
  echo "gpu_check.sh: $dir ready ($(du -sh "$dir" | cut -f1)); on the GPU machine: $bundle/gpu_check.sh $bundle"
  exit 0
fi

[ $# -ge 1 ] || { echo "usage: gpu_check.sh BUNDLE [OUT]  |  gpu_check.sh --prepare CPU_BUILD BUNDLE" >&2; exit 2; }
bundle=$(cd "$1" && pwd)
out=$(mkdir -p "${2:-gpu_check_out}" && cd "${2:-gpu_check_out}" && pwd)
kmoe=$bundle/kmoe
[ -d "$bundle/check" ] || { echo "gpu_check.sh: $bundle/check missing: run --prepare first" >&2; exit 2; }
start=$(date +%s)
status=0
log() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
log "gpu_check: ${gpu:-no GPU visible to nvidia-smi}; $(grep cuda_runtime_major "$bundle/MANIFEST")"

# 1. Unit tests on one rank (test_parallel is the 4-rank suite).
for t in "$bundle"/bin/test_*; do
  name=$(basename "$t")
  [ "$name" = test_parallel ] && continue
  if timeout 300 "$kmoe" "$name" > "$out/$name.log" 2>&1; then
    log "ok   $name ($(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' "$out/$name.log" | tail -1))"
  else
    log "FAIL $name (exit $?): $(grep -E 'FAILED|error' "$out/$name.log" | head -3 | tr '\n' ' ')"
    status=1
  fi
done

# 2. Training steps against the CPU build's.
work=$out/check && rm -rf "$work" && cp -r "$bundle/check" "$work"
if (cd "$work" && timeout 300 "$kmoe" kmoe-train -i check.deck --output.dir=gpu_run \
      --checkpoint.dir=gpu_run/ckpt > "$out/check_train.log" 2>&1); then
  python3 - "$work/cpu_metrics.csv" "$work/gpu_run/metrics.csv" <<'PY' | tee -a "$out/summary.txt"
import csv, sys
cpu = list(csv.DictReader(open(sys.argv[1]))); gpu = list(csv.DictReader(open(sys.argv[2])))
ok = len(cpu) == len(gpu) and len(cpu) > 0
worst = 0.0
for c, g in zip(cpu, gpu):
    rel = abs(float(g["loss"]) - float(c["loss"])) / abs(float(c["loss"]))
    worst = max(worst, rel)
    tol = 1e-4 if c["step"] == "1" else 2e-3
    good = rel <= tol
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} step {c['step']}: loss cpu {float(c['loss']):.6f} "
          f"gpu {float(g['loss']):.6f} (rel {rel:.1e}, tolerance {tol:.0e})")
print(f"{'ok  ' if ok else 'FAIL'} training against the CPU build: {len(gpu)} steps, "
      f"worst relative loss difference {worst:.1e}")
sys.exit(0 if ok else 1)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  log "FAIL kmoe-train on the check deck: $(tail -3 "$out/check_train.log" | tr '\n' ' ')"
  status=1
fi

# 3. Benchmark: throughput and phases, then the counter's per-step figures.
# Dense peaks per precision (output.peak_flops is the peak of the run's train.precision).
case "$gpu" in
  *H200*|*H100*) bf16=989e12 tf32=494e12 fp32=67e12 ;;
  *A100*) bf16=312e12 tf32=156e12 fp32=19.5e12 ;;
  *L40S*) bf16=362e12 tf32=183e12 fp32=91.6e12 ;;
  *) bf16=0 tf32=0 fp32=0 ;;
esac
bench=$out/bench && rm -rf "$bench" && mkdir -p "$bench" && cp -r "$work/data" "$bench/" &&
  cp "$work/bench.deck" "$bench/"
if (cd "$bench" && timeout 240 "$kmoe" kmoe-train -i bench.deck --output.dir=run \
      --checkpoint.dir=run/ckpt --output.phase_timing=true --output.peak_flops=$fp32 \
      ${GPU_CHECK_BENCH_ARGS:-} > "$out/bench_train.log" 2>&1); then
  python3 - "$bench/run/metrics.csv" "$bf16" "$tf32" "$fp32" <<'PY' | tee -a "$out/summary.txt"
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))][2:]  # past warm-up
tps = statistics.median(float(r["tokens_per_s"]) for r in rows)
flops = statistics.median(float(r["model_flops_per_s"]) for r in rows)
mem = max(float(r["mem_hwm_mib"]) for r in rows)
bf16, tf32, fp32 = (float(v) for v in sys.argv[2:5])
mfu = (f"MFU {flops / fp32:.1%} of the fp32 peak ({flops / tf32:.1%} of tf32's, "
       f"{flops / bf16:.1%} of bf16's)" if fp32 > 0 else "MFU: peak unknown for this GPU")
print(f"bench, fp32: {tps:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s (model), {mfu}; "
      f"host memory high-water {mem:.0f} MiB")
PY
  grep "time per phase" "$out/bench_train.log" | sed 's/^/bench: /' | tee -a "$out/summary.txt"
  # TF32 and bf16 GEMMs (MFU against their own peaks), and fp32 and bf16 with per-expert vendor
  # GEMMs (cuBLAS) instead of grouped ones (kmoe's kernel; bf16: on the tensor cores).
  for variant in train.precision=tf32:$tf32 train.precision=bf16:$bf16 \
                 moe.expert_gemm=per_expert:$fp32 \
                 train.precision=bf16,moe.expert_gemm=per_expert:$bf16; do
    set_key=${variant%%:*} peak=${variant##*:}
    keys=()
    IFS=, read -ra pairs <<< "$set_key"
    for kv in "${pairs[@]}"; do keys+=("--$kv"); done
    if (cd "$bench" && timeout 120 "$kmoe" kmoe-train -i bench.deck --output.dir="run_$set_key" \
          --checkpoint.dir="run_$set_key/ckpt" --train.max_steps=4 "${keys[@]}" \
          --output.peak_flops=$peak ${GPU_CHECK_BENCH_ARGS:-} > "$out/bench_$set_key.log" 2>&1); then
      python3 - "$bench/run_$set_key/metrics.csv" "$set_key" <<'PY' | tee -a "$out/summary.txt"
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))][2:]
tps = statistics.median(float(r["tokens_per_s"]) for r in rows)
mfu = statistics.median(float(r["mfu"] or 0) for r in rows)
print(f"bench, {sys.argv[2]}: {tps:,.0f} tokens/s, MFU {mfu:.1%} of its precision's peak")
PY
    else
      log "bench, $set_key: kmoe-train failed: $(tail -2 "$out/bench_$set_key.log" | tr '\n' ' ')"
    fi
  done
  counter=$bundle/lib/libkmoe_kokkos_counter.so
  if (cd "$bench" && KOKKOS_TOOLS_LIBS=$counter KOKKOS_PROFILE_LIBRARY=$counter \
        KMOE_KOKKOS_COUNTS=$bench/counts.csv timeout 120 "$kmoe" kmoe-train -i bench.deck \
        --train.max_steps=3 --output.dir=run_counts --checkpoint.dir=run_counts/ckpt \
        ${GPU_CHECK_BENCH_ARGS:-} > "$out/bench_counts.log" 2>&1); then
    python3 - "$bench/counts.csv" <<'PY' | tee -a "$out/summary.txt"
import csv, sys
r = list(csv.DictReader(open(sys.argv[1])))[-1]
print(f"bench per step: {r['kernels']} kernel launches, {r['fences']} fences, "
      f"{r['deep_copies']} deep copies ({r['copies_to_host']} to the host), "
      f"{r['kmoe_syncs']} named host waits")
PY
  fi
else
  log "bench: kmoe-train failed: $(tail -3 "$out/bench_train.log" | tr '\n' ' ')"
fi
log "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s; logs in $out"
exit $status
