#!/usr/bin/env bash
# gpu_check.sh: kmoe on one NVIDIA GPU, from a bundle (scripts/bundle.sh), on a machine with the
# driver, the CUDA toolkit and Python but no MPI, HDF5, Boost or Kokkos. One command under a
# deadline (GPU_CHECK_DEADLINE seconds, default 510), the most valuable checks first, each with
# its own time limit; a step the deadline cuts is reported "not run (deadline)":
#   1. train_check: 8 single-rank training steps against the same steps computed by a CPU build
#      (relative 1e-4 at step 1, 2e-3 after: other summation orders, near-ties in MoE routing);
#      offload_check: the same with the Engram table in host memory (engram.offload = host;
#      GPU bundles); fused_check: the same with the fused attention core (train.attention =
#      fused; GPU bundles: the CPU build's losses are the tiled core's);
#   2. bench_moe_{bf16,fp32}: tokens/s, MFU, time per phase and device memory of a 16-block,
#      64-expert top-8 MoE (bf16: grouped expert GEMMs on the tensor cores);
#   3. peer_moe_*: the same model in plain PyTorch (bench/torch_peer.py: SDPA, experts as a
#      Hugging Face style loop, and grouped with torch._grouped_mm), where PyTorch sees the GPU;
#   4. bench_dense_bf16, peer_dense_bf16: a dense model (D 2048, 8 blocks, T 2048) against it;
#      bench_dense_bf16_fused: the same kmoe model with the fused attention core;
#   5. memcheck, racecheck: compute-sanitizer on a 2-step run of a small deck;
#   6. hf_parity: the bundle's small exports (olmo2, llama, flex_olmo, olmoe) under
#      transformers' AutoModelForCausalLM against kmoe's own logits, where transformers exists;
#   7. unit_tests: every one-rank unit test of the bundle;
#   8. variants: tf32, per-expert vendor GEMMs (fp32, bf16), and the Kokkos Tools counter's
#      launches, fences, copies and named waits per step.
# Exit status: 0 when 1 (both checks) and 7 pass (the rest report figures). OUT/summary.txt is written line by
# line, OUT/figures.tsv holds one row per step (name, status, seconds, figure); both survive a
# kill. On a CPU bundle (bundle_check in ctest), step 1 is a relocation check (the bundle
# against the build it came from), 2 runs shrunk (GPU_CHECK_BENCH_ARGS) in fp32 with the counter,
# and every GPU-only step is reported skipped by name.
#
#   gpu_check.sh --prepare CPU_BUILD BUNDLE   (here) adds BUNDLE/check: the decks, a token file,
#                                             the CPU build's losses, the PyTorch peer and the
#                                             small Hugging Face exports with kmoe's logits
#   gpu_check.sh BUNDLE [OUT]                 (there) runs the steps; logs under OUT
#                                             (default ./gpu_check_out)
# GPU_CHECK_BENCH_ARGS / GPU_CHECK_DENSE_ARGS: deck overrides for the benchmarks.
# GPU_CHECK_REFERENCE_ARGS (at --prepare): deck overrides of the reference training steps,
# kept in BUNDLE/check/reference.args so that the check trains the same model.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

deck_tail() {  # the sections every deck shares
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

moe_deck() {  # a deeper, wider MoE for throughput: 16 blocks, 64 experts, top-8
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
max_steps = 5
[optimizer]
lr = 1e-3
warmup_steps = 2
DECK
  deck_tail
}

dense_deck() {  # a dense model of a size where the GEMMs dominate
  cat <<'DECK'
[model]
vocab_size = 320
d_model = 2048
n_layers = 8
n_heads = 16
ffn_hidden = 5632
[train]
seq_len = 2048
global_batch = 8
micro_batch = 2
max_steps = 5
[optimizer]
lr = 1e-3
warmup_steps = 2
DECK
  deck_tail
}

hf_base_deck() {  # the small models exported for transformers (tests/regression/hf_interop.py)
  cat <<'DECK'
[model]
vocab_size = 320
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 96
[train]
seq_len = 32
global_batch = 4
micro_batch = 2
max_steps = 3
eval_every = 0
[optimizer]
lr = 3e-3
DECK
  deck_tail
}
HF_MODELS=(
  "olmo2:"
  "llama:--model.block_norm=pre --model.qk_norm=false --model.tie_embeddings=true"
  "flex_olmo:--moe.experts=4 --moe.top_k=2 --moe.expert_hidden=48"
  "olmoe:--moe.experts=4 --moe.top_k=2 --moe.expert_hidden=48 --model.block_norm=pre --moe.normalize_topk=true --model.tie_embeddings=true --model.n_kv_heads=4"
)

if [ "${1:-}" = "--prepare" ]; then
  [ $# -eq 3 ] || { echo "usage: gpu_check.sh --prepare CPU_BUILD BUNDLE" >&2; exit 2; }
  cpu=$(cd "$2" && pwd) bundle=$(cd "$3" && pwd)
  dir=$bundle/check
  rm -rf "$dir" && mkdir -p "$dir/data" "$dir/hf"
  check_deck > "$dir/check.deck"
  moe_deck > "$dir/moe.deck"
  dense_deck > "$dir/dense.deck"
  "$cpu/drivers/kmoe-prep" --fortunes --out-dir "$dir/data" > /dev/null 2>&1
  echo "${GPU_CHECK_REFERENCE_ARGS:-}" > "$dir/reference.args"
  read -ra ref < "$dir/reference.args"  # split as the check splits it
  (cd "$dir" && OPENBLAS_NUM_THREADS=1 "$cpu/drivers/kmoe-train" -i check.deck \
     --output.dir=cpu_run --checkpoint.dir=cpu_run/ckpt ${ref[@]+"${ref[@]}"} > cpu_run.log 2>&1) ||
    { echo "gpu_check.sh: the CPU reference run failed: $dir/cpu_run.log" >&2; exit 1; }
  cp "$dir/cpu_run/metrics.csv" "$dir/cpu_metrics.csv"
  rm -rf "$dir/cpu_run"
  # Small exports of each Hugging Face type with kmoe-generate's logits on a fixed prompt.
  hf_base_deck > "$dir/hf/base.deck"
  for m in "${HF_MODELS[@]}"; do
    arch=${m%%:*} extra=${m#*:}
    # shellcheck disable=SC2086
    (cd "$dir" && OPENBLAS_NUM_THREADS=1 "$cpu/drivers/kmoe-train" -i hf/base.deck \
       --output.dir="hf/run_$arch" --checkpoint.dir="hf/run_$arch/ck" $extra > /dev/null 2>&1 &&
     "$cpu/drivers/kmoe-export" "hf/run_$arch/ck/step00000003.h5" "hf/$arch" > /dev/null &&
     "$cpu/drivers/kmoe-generate" --checkpoint "hf/run_$arch/ck/step00000003.h5" \
       --prompt "Fortune: " --max-new-tokens 23 --dump-logits "hf/$arch/kmoe" > /dev/null) ||
      { echo "gpu_check.sh: the $arch export failed" >&2; exit 1; }
    rm -rf "$dir/hf/run_$arch"
  done
  cp "$here/gpu_check.sh" "$bundle/gpu_check.sh"
  cp "$here/gpu_profile.sh" "$bundle/gpu_profile.sh"
  cp "$here/../bench/torch_peer.py" "$bundle/torch_peer.py"
  echo "gpu_check.sh: $dir ready ($(du -sh "$dir" | cut -f1)); on the GPU machine: $bundle/gpu_check.sh $bundle"
  exit 0
fi

[ $# -ge 1 ] || { echo "usage: gpu_check.sh BUNDLE [OUT]  |  gpu_check.sh --prepare CPU_BUILD BUNDLE" >&2; exit 2; }
bundle=$(cd "$1" && pwd)
out=$(mkdir -p "${2:-gpu_check_out}" && cd "${2:-gpu_check_out}" && pwd)
kmoe=$bundle/kmoe
[ -d "$bundle/check" ] || { echo "gpu_check.sh: $bundle/check missing: run --prepare first" >&2; exit 2; }
deadline=${GPU_CHECK_DEADLINE:-510}
start=$(date +%s)
status=0
: > "$out/summary.txt"
printf 'step\tstatus\tseconds\tfigure\n' > "$out/figures.tsv"
log() { echo "$*" | tee -a "$out/summary.txt"; }
figure() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$out/figures.tsv"; }
skip() { log "skip $1: $2"; figure "$1" skipped 0 "$2"; }
left() { echo $(( deadline - ($(date +%s) - start) )); }
# budget LIMIT: the step's time limit within what the deadline leaves (0: not run).
budget() {
  local l
  l=$(left)
  if [ "$l" -lt 15 ]; then echo 0; elif [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}
not_run() { log "skip $1: not run (deadline)"; figure "$1" "not run (deadline)" 0 ""; }

cuda=$(awk '/^cuda_runtime_major:/{print $2}' "$bundle/MANIFEST")
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
if [ "$cuda" = none ]; then
  log "gpu_check: a CPU bundle (GPU-only steps skipped); deadline ${deadline} s"
else
  log "gpu_check: ${gpu:-no GPU visible to nvidia-smi}; bundle built for CUDA $cuda; deadline ${deadline} s"
fi
gpu_only() {  # gpu_only NAME: 0 (and a skip line) where this bundle or machine has no GPU
  if [ "$cuda" = none ]; then skip "$1" "a CPU bundle"; return 0; fi
  if [ -z "$gpu" ]; then skip "$1" "no GPU visible to nvidia-smi"; return 0; fi
  return 1
}

# Device memory high-water of one command: nvidia-smi sampled every 100 ms, less the level
# before it started.
mem_watch_start() {
  mem_base=0 mem_pid=""
  [ -n "$gpu" ] || return 0
  mem_base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/.mem" 2>&1 &
  mem_pid=$!
}
mem_watch_stop() {  # prints the high-water in MiB above the level before (or "n/a")
  [ -n "$mem_pid" ] || { echo "n/a"; return; }
  kill "$mem_pid" 2> /dev/null; wait "$mem_pid" 2> /dev/null
  awk -v b="$mem_base" '$1 ~ /^[0-9]+$/ && $1 > m {m = $1} END {print (m > b ? m - b : 0)}' "$out/.mem"
}

# Peak dense FLOP/s per precision (output.peak_flops is the peak of the run's train.precision).
case "$gpu" in
  *H200*|*H100*) bf16=989e12 tf32=494e12 fp32=67e12 ;;
  *A100*) bf16=312e12 tf32=156e12 fp32=19.5e12 ;;
  *L40S*) bf16=362e12 tf32=183e12 fp32=91.6e12 ;;
  *) bf16=0 tf32=0 fp32=0 ;;
esac
peak_of() { case "$1" in *bf16*) echo $bf16 ;; *tf32*) echo $tf32 ;; *) echo $fp32 ;; esac; }

work=$out/work && rm -rf "$work" && cp -r "$bundle/check" "$work"

# 1. Training steps against the CPU build's: NAME LIMIT WHAT [KEY=VALUE ...].
train_against_cpu() {
  local name=$1 limit=$2 what=$3 lim t0 rc keys=() ref=()
  shift 3
  [ -f "$work/reference.args" ] && read -ra ref < "$work/reference.args"
  keys=(${ref[@]+"${ref[@]}"})
  for kv in "$@"; do keys+=("--$kv"); done
  t0=$(date +%s)
  lim=$(budget "$limit")
  if [ "$lim" -eq 0 ]; then not_run "$name"; status=1; return; fi
  if (cd "$work" && timeout "$lim" "$kmoe" kmoe-train -i check.deck --output.dir="${name}_run" \
        --checkpoint.dir="${name}_run/ckpt" ${keys[@]+"${keys[@]}"} > "$out/$name.log" 2>&1); then
    python3 - "$work/cpu_metrics.csv" "$work/${name}_run/metrics.csv" "$what" <<'PY' > "$out/.train"
import csv, sys
cpu = list(csv.DictReader(open(sys.argv[1]))); mine = list(csv.DictReader(open(sys.argv[2])))
ok = len(cpu) == len(mine) and len(cpu) > 0
worst = 0.0
for c, g in zip(cpu, mine):
    r = abs(float(g["loss"]) - float(c["loss"])) / abs(float(c["loss"]))
    worst = max(worst, r)
    tol = 1e-4 if c["step"] == "1" else 2e-3
    ok = ok and r <= tol
    print(f"{'ok  ' if r <= tol else 'FAIL'} step {c['step']}: loss cpu {float(c['loss']):.6f} "
          f"here {float(g['loss']):.6f} (rel {r:.1e}, tolerance {tol:.0e})")
print(f"{'ok  ' if ok else 'FAIL'} {sys.argv[3]}: {len(mine)} steps, worst relative loss "
      f"difference {worst:.1e}")
sys.exit(0 if ok else 1)
PY
    rc=$?
    tee -a "$out/summary.txt" < "$out/.train"
    figure "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" $(( $(date +%s) - t0 )) \
      "$(tail -1 "$out/.train")"
    [ $rc -eq 0 ] || status=1
  else
    rc=$?
    log "FAIL $name: kmoe-train exit $rc: $(tail -3 "$out/$name.log" | tr '\n' ' ')"
    figure "$name" FAIL $(( $(date +%s) - t0 )) "kmoe-train exit $rc"
    status=1
  fi
}
what="training on the GPU against the CPU build"
[ "$cuda" = none ] && what="training from the bundle against the build it came from (a relocation check)"
train_against_cpu train_check 150 "$what"
# The same with the Engram table in host memory (row cache on a side stream, host AdamW;
# RUNTIME.md section 8): the CPU build's losses are the same either way. (On a CPU bundle the
# build's own ctest, engram_offload, checks that path bit for bit.)
gpu_only offload_check ||
  train_against_cpu offload_check 60 "$what, Engram table in host memory" engram.offload=host
# The fused attention core (attention_core.hpp) against the CPU build's tiled one: the same
# function (the unit and reference tests hold the two together on CPUs).
gpu_only fused_check ||
  train_against_cpu fused_check 60 "$what, the fused attention core" train.attention=fused

# A kmoe-train benchmark: NAME DECK LIMIT PRECISION [KEY=VALUE ...] (metrics past 2 steps).
kmoe_bench() {
  local name=$1 deck=$2 limit=$3 prec=$4
  shift 4
  local lim t0 rc keys=() mem
  lim=$(budget "$limit")
  [ "$lim" -gt 0 ] || { not_run "$name"; return; }
  for kv in "$@"; do keys+=("--$kv"); done
  t0=$(date +%s)
  mem_watch_start
  # shellcheck disable=SC2086
  (cd "$work" && timeout "$lim" "$kmoe" kmoe-train -i "$deck" --output.dir="run_$name" \
     --checkpoint.dir="run_$name/ckpt" --checkpoint.at_end=false --output.phase_timing=true \
     --train.precision="$prec" \
     --output.peak_flops="$(peak_of "$prec")" ${keys[@]+"${keys[@]}"} \
     $([ "$deck" = dense.deck ] && echo "${GPU_CHECK_DENSE_ARGS:-}" || echo "${GPU_CHECK_BENCH_ARGS:-}") \
     > "$out/$name.log" 2>&1)
  rc=$?
  mem=$(mem_watch_stop)
  local fig
  fig=$(python3 - "$work/run_$name/metrics.csv" "$mem" <<'PY' 2>&1
import csv, statistics, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError:
    rows = []
timed = rows[2:] or rows[1:]
if not timed:
    print("no timed step"); sys.exit(1)
tps = statistics.median(float(r["tokens_per_s"]) for r in timed)
flops = statistics.median(float(r["model_flops_per_s"]) for r in timed)
mfu = statistics.median(float(r["mfu"] or 0) for r in timed)
print(f"{tps:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s (model), MFU {mfu:.1%} of the "
      f"precision's peak, {statistics.median(float(r['step_time_s']) for r in timed):.3f} s/step "
      f"over {len(timed)} steps, device memory {sys.argv[2]} MiB, host {max(float(r['mem_hwm_mib']) for r in rows):.0f} MiB, "
      f"loss {float(rows[-1]['loss']):.4f}")
PY
)
  local ok=$?
  if [ $rc -eq 0 ] && [ $ok -eq 0 ]; then
    log "ok   $name: $fig"
    figure "$name" ok $(( $(date +%s) - t0 )) "$fig"
    grep "time per phase" "$out/$name.log" | tail -1 | sed "s/^/     $name: /" | tee -a "$out/summary.txt"
  else
    log "FAIL $name (exit $rc): $fig; $(tail -2 "$out/$name.log" | tr '\n' ' ')"
    figure "$name" FAIL $(( $(date +%s) - t0 )) "exit $rc; $fig"
  fi
}

# The PyTorch peer: NAME LIMIT DECK-SHAPE-ARGS...
peer() {
  local name=$1 limit=$2
  shift 2
  gpu_only "$name" && return
  local lim t0 rc
  lim=$(budget "$limit")
  [ "$lim" -gt 0 ] || { not_run "$name"; return; }
  t0=$(date +%s)
  timeout "$lim" python3 "$bundle/torch_peer.py" --tokens "$work/data/train.bin" "$@" \
    --json "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?
  local line
  line=$(grep '^torch_peer:' "$out/$name.log" | tail -1)
  if [ $rc -eq 0 ]; then
    log "ok   $name: ${line#torch_peer: }"
    figure "$name" ok $(( $(date +%s) - t0 )) "${line#torch_peer: }"
  elif [ $rc -eq 3 ]; then
    skip "$name" "${line#torch_peer: }"
  else
    log "FAIL $name (exit $rc): $(tail -2 "$out/$name.log" | tr '\n' ' ')"
    figure "$name" FAIL $(( $(date +%s) - t0 )) "exit $rc"
  fi
}
MOE_SHAPE=(--d-model 1024 --n-layers 16 --n-heads 16 --experts 64 --top-k 8 --expert-hidden 512
           --seq-len 1024 --global-batch 16 --micro-batch 4 --steps 5)
DENSE_SHAPE=(--d-model 2048 --n-layers 8 --n-heads 16 --ffn-hidden 5632 --seq-len 2048
             --global-batch 8 --micro-batch 2 --steps 5)

# 2-4. Throughput: kmoe, then its PyTorch peer on the same shapes.
if [ "$cuda" = none ]; then
  kmoe_bench bench_moe_fp32 moe.deck 120 fp32
  for s in bench_moe_bf16 peer_moe_bf16_grouped peer_moe_bf16_loop peer_moe_fp32_loop \
           bench_dense_bf16 bench_dense_bf16_fused peer_dense_bf16; do
    skip "$s" "a CPU bundle"
  done
else
  kmoe_bench bench_moe_bf16 moe.deck 90 bf16
  kmoe_bench bench_moe_fp32 moe.deck 90 fp32
  peer peer_moe_bf16_grouped 60 "${MOE_SHAPE[@]}" --precision bf16 --expert-impl grouped
  peer peer_moe_bf16_loop 75 "${MOE_SHAPE[@]}" --precision bf16 --expert-impl loop --steps 4 --skip 1
  peer peer_moe_fp32_loop 75 "${MOE_SHAPE[@]}" --precision fp32 --expert-impl loop --steps 4 --skip 1
  kmoe_bench bench_dense_bf16 dense.deck 60 bf16
  kmoe_bench bench_dense_bf16_fused dense.deck 60 bf16 train.attention=fused
  peer peer_dense_bf16 45 "${DENSE_SHAPE[@]}" --precision bf16
fi

# 5. compute-sanitizer on a small deck: memcheck two steps, racecheck (much slower: shared
# memory accesses) one step of two sequences.
for tool in memcheck racecheck; do
  gpu_only "$tool" && continue
  if ! command -v compute-sanitizer > /dev/null; then skip "$tool" "no compute-sanitizer on PATH"; continue; fi
  if [ $tool = memcheck ]; then lim=$(budget 60) steps=2 seqs=4; else lim=$(budget 120) steps=1 seqs=2; fi
  [ "$lim" -gt 0 ] || { not_run "$tool"; continue; }
  t0=$(date +%s)
  (cd "$work" && timeout "$lim" compute-sanitizer --tool "$tool" --error-exitcode 97 \
     "$kmoe" kmoe-train -i check.deck --train.max_steps=$steps --train.seq_len=64 \
     --train.global_batch=$seqs --train.micro_batch=2 --output.dir="run_$tool" \
     --checkpoint.dir="run_$tool/ckpt" > "$out/$tool.log" 2>&1)
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$tool.log" | tail -1)
  if [ $rc -eq 0 ]; then
    log "ok   $tool: ${summary:-no summary line}"
    figure "$tool" ok $(( $(date +%s) - t0 )) "$summary"
  elif [ $rc -eq 124 ]; then
    log "FAIL $tool: cut at its ${lim} s limit: ${summary:-$(tail -1 "$out/$tool.log")}"
    figure "$tool" "cut at ${lim} s" $(( $(date +%s) - t0 )) "$summary"
  else
    log "FAIL $tool (exit $rc): $(grep -m3 -E 'Invalid|Error|error|hazard' "$out/$tool.log" | tr '\n' ' ')"
    figure "$tool" FAIL $(( $(date +%s) - t0 )) "exit $rc; $summary"
  fi
done

# 6. The exports under transformers against kmoe's logits.
lim=$(budget 90)
if ! python3 -c "import transformers, torch" 2> /dev/null; then
  skip hf_parity "transformers is not installed for python3 here"
elif [ "$lim" -eq 0 ]; then not_run hf_parity
else
  t0=$(date +%s)
  timeout "$lim" python3 - "$work/hf" > "$out/hf_parity.log" 2>&1 <<'PY'
import os, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
root = sys.argv[1]
bad = 0
for arch in sorted(os.listdir(root)):
    d = os.path.join(root, arch)
    if not os.path.exists(os.path.join(d, "config.json")):
        continue
    ids = np.load(os.path.join(d, "kmoe.ids.npy")).astype(np.int64)
    mine = np.load(os.path.join(d, "kmoe.logits.npy")).astype(np.float64)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)[None]).logits[0].double().numpy()
    theirs = theirs[:len(mine)]
    worst = float(np.abs(mine - theirs).max() / max(np.abs(theirs).max(), 1.0))
    agree = float((mine.argmax(-1) == theirs.argmax(-1)).mean())
    ok = mine.shape == theirs.shape and worst <= 1e-4
    bad += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {arch} ({model.config.model_type}): {len(mine)} positions, "
          f"largest difference {worst:.1e} of the largest logit (tolerance 1e-4), greedy "
          f"tokens agree at {agree:.0%}")
sys.exit(1 if bad else 0)
PY
  rc=$?
  sed 's/^/     hf_parity: /' "$out/hf_parity.log" | grep -E 'ok  |FAIL' | tee -a "$out/summary.txt"
  if [ $rc -eq 0 ]; then
    log "ok   hf_parity: transformers $(python3 -c 'import transformers; print(transformers.__version__)')"
    figure hf_parity ok $(( $(date +%s) - t0 )) "$(grep -c '^ok' "$out/hf_parity.log") exports match"
  else
    log "FAIL hf_parity (exit $rc): $(tail -2 "$out/hf_parity.log" | tr '\n' ' ')"
    figure hf_parity FAIL $(( $(date +%s) - t0 )) "exit $rc"
  fi
fi

# 7. Unit tests on one rank (test_parallel is the 4-rank suite).
if [ "$cuda" = none ]; then
  skip unit_tests "a CPU bundle (the build's own ctest runs them)"
else
  for t in "$bundle"/bin/test_*; do
    name=$(basename "$t")
    [ "$name" = test_parallel ] && continue
    lim=$(budget 60)
    [ "$lim" -gt 0 ] || { not_run "$name"; status=1; continue; }
    t0=$(date +%s)
    if (cd "$work" && timeout "$lim" "$kmoe" "$name" > "$out/$name.log" 2>&1); then
      n=$(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' "$out/$name.log" | tail -1)
      log "ok   $name ($n)"
      figure "$name" ok $(( $(date +%s) - t0 )) "$n"
    else
      rc=$?
      log "FAIL $name (exit $rc): $(grep -E '^\[  FAILED|rror' "$out/$name.log" | head -4 | tr '\n' ' ')"
      figure "$name" FAIL $(( $(date +%s) - t0 )) "exit $rc"
      status=1
    fi
  done
fi

# 8. Variants and the counter.
if [ "$cuda" = none ]; then
  for s in bench_moe_tf32 bench_moe_per_expert_fp32 bench_moe_per_expert_bf16; do
    skip "$s" "a CPU bundle"
  done
else
  kmoe_bench bench_moe_tf32 moe.deck 45 tf32 train.max_steps=4
  kmoe_bench bench_moe_per_expert_fp32 moe.deck 45 fp32 train.max_steps=4 moe.expert_gemm=per_expert
  kmoe_bench bench_moe_per_expert_bf16 moe.deck 45 bf16 train.max_steps=4 moe.expert_gemm=per_expert
fi
lim=$(budget 60)
counter=$bundle/lib/libkmoe_kokkos_counter.so
if [ "$lim" -eq 0 ]; then not_run counter
else
  t0=$(date +%s)
  # shellcheck disable=SC2086
  if (cd "$work" && KOKKOS_TOOLS_LIBS=$counter KOKKOS_PROFILE_LIBRARY=$counter \
        KMOE_KOKKOS_COUNTS=$work/counts.csv KMOE_KOKKOS_COUNTS_NAMES=1 timeout "$lim" "$kmoe" \
        kmoe-train -i moe.deck --train.max_steps=3 --output.dir=run_counts \
        --checkpoint.dir=run_counts/ckpt --checkpoint.at_end=false \
        ${GPU_CHECK_BENCH_ARGS:-} > "$out/counter.log" 2>&1); then
    line=$(python3 - "$work/counts.csv" <<'PY'
import csv, sys
r = list(csv.DictReader(open(sys.argv[1])))[-1]
print(f"per step: {r['kernels']} kernel launches, {r['fences']} fences, "
      f"{r['deep_copies']} deep copies ({r['copies_to_host']} to the host), "
      f"{r['kmoe_syncs']} named host waits")
PY
)
    log "ok   counter: $line"
    figure counter ok $(( $(date +%s) - t0 )) "$line"
    # The most frequent fences and named waits (over the 3 steps), from the counter's names mode.
    grep -E '^ +[0-9]+ ' "$out/counter.log" | head -6 | sed 's/^/     counter: /' |
      tee -a "$out/summary.txt"
  else
    log "FAIL counter: $(tail -2 "$out/counter.log" | tr '\n' ' ')"
    figure counter FAIL $(( $(date +%s) - t0 )) ""
  fi
fi

log "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s; logs in $out"
exit $status
