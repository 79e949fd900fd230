#!/usr/bin/env bash
# gpu_profile.sh: where a GPU step's time goes, in one command of at most 8 minutes
# (GPU_PROFILE_DEADLINE seconds, default 470), from a bundle that gpu_check.sh --prepare made
# (its decks, token file and PyTorch peer); the most valuable steps first, each under its own
# limit, a step the deadline cuts reported "not run (deadline)":
#   1. versions: GPU, driver, the bundle's CUDA, PyTorch with its CUDA, cuDNN and cuBLAS;
#   2. targets through PyTorch: bf16 cuBLAS at kmoe's dense shapes (every projection's forward
#      and both backward products) and scaled-dot-product attention forward / backward at the
#      bench shape per backend (cuDNN, flash, memory-efficient): what the kernels can reach;
#   3. kmoe's dense bench deck (tiled and fused attention cores) and MoE deck under the CUPTI
#      tracer (the bundle's lib/libkmoe_cupti_tracer.so, loaded as the Kokkos Tools library:
#      kernels named by their Kokkos labels, cuBLAS by theirs): per-kernel calls and time per
#      step, GPU busy and idle time, copies;
#   4. the PyTorch peer on the same shapes, timed, then once more under torch.profiler;
#   5. larger micro-batches (the dense deck's whole global batch of 8 in 4 and in 1
#      micro-batch, the MoE deck's 16 in 8): whether taller GEMMs and fewer launches change
#      tokens/s;
#   6. the summary: per traced run, time per step in GEMMs, attention, element-wise kernels,
#      copies and idle; tokens/s of every run.
# OUT/summary.txt is written line by line; OUT/<run>.kernels.csv and .steps.csv are the
# tracer's tables, OUT/peer_*.csv torch.profiler's. On a CPU bundle every GPU step is
# reported skipped by name (ctest bundle_check runs it so).
#
#   gpu_profile.sh BUNDLE [OUT]   (default OUT ./gpu_profile_out)
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_profile.sh BUNDLE [OUT]" >&2; exit 2; }
bundle=$(cd "$1" && pwd)
out=$(mkdir -p "${2:-gpu_profile_out}" && cd "${2:-gpu_profile_out}" && pwd)
kmoe=$bundle/kmoe
[ -d "$bundle/check" ] || { echo "gpu_profile.sh: $bundle/check missing: run gpu_check.sh --prepare first" >&2; exit 2; }
deadline=${GPU_PROFILE_DEADLINE:-470}
start=$(date +%s)
: > "$out/summary.txt"
log() { echo "$*" | tee -a "$out/summary.txt"; }
skip() { log "skip $1: $2"; }
left() { echo $(( deadline - ($(date +%s) - start) )); }
budget() {  # budget LIMIT: the step's time limit within what the deadline leaves (0: not run)
  local l
  l=$(left)
  if [ "$l" -lt 15 ]; then echo 0; elif [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}

# 1. Versions.
cuda=$(awk '/^cuda_runtime_major:/{print $2}' "$bundle/MANIFEST")
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
log "gpu_profile: ${gpu:-no GPU visible to nvidia-smi}; bundle built for CUDA $cuda; deadline ${deadline} s"
log "versions: $(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "cudnn", torch.backends.cudnn.version(), "cuda device", torch.cuda.is_available())' 2>&1 | tail -1)"
on_gpu=1
if [ "$cuda" = none ] || [ -z "$gpu" ]; then
  on_gpu=0
  why=$([ "$cuda" = none ] && echo "a CPU bundle" || echo "no GPU visible to nvidia-smi")
fi

# The tracer needs CUPTI: the toolkit's, or the one NVIDIA's Python wheels bring (found by its
# file). Only the traced kmoe runs get this library path (PyTorch keeps its own libraries).
tracer=$bundle/lib/libkmoe_cupti_tracer.so
cupti_path=""
for d in /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64 /usr/local/cuda/lib \
         $(python3 -c 'import glob, os, site
print(" ".join(sorted({os.path.dirname(p) for sp in site.getsitepackages() for p in glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libcupti.so*"))})))' 2>/dev/null); do
  [ -d "$d" ] && cupti_path="${cupti_path:+$cupti_path:}$d"
done
if [ ! -f "$tracer" ]; then
  tracer="" why_tracer="the bundle has no lib/libkmoe_cupti_tracer.so (a build without CUPTI)"
elif LD_LIBRARY_PATH="$cupti_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$tracer" | grep -q "not found"; then
  why_tracer="its libraries do not resolve: $(LD_LIBRARY_PATH="$cupti_path" ldd "$tracer" | grep 'not found' | tr -s ' \t\n' ' ')"
  tracer=""
fi
[ -n "$tracer" ] || log "note: kmoe runs untraced: $why_tracer"

work=$out/work && rm -rf "$work" && cp -r "$bundle/check" "$work"

# 2. Targets through PyTorch.
if [ $on_gpu -eq 0 ]; then
  skip targets "$why"
else
  lim=$(budget 60)
  timeout "$lim" python3 - > "$out/targets.txt" 2>&1 <<'PY'
import torch, torch.nn.functional as F
dev, bf = "cuda", torch.bfloat16
def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps
# The dense bench deck's products per block and micro-batch: N = 2 x 2048 rows, D 2048,
# 16 heads of 128, F 5632 (w1|w3 fused), V 320; forward y = x W^T, backward dx = dy W, dW = dy^T x.
N, D, F_, V = 4096, 2048, 5632, 320
total = 0.0
for name, n_in, n_out in [("qkv", D, 3 * D), ("out", D, D), ("up", D, 2 * F_), ("down", F_, D),
                          ("head", D, V)]:
    x = torch.randn(N, n_in, device=dev, dtype=bf); w = torch.randn(n_out, n_in, device=dev, dtype=bf)
    dy = torch.randn(N, n_out, device=dev, dtype=bf)
    for kind, fn in [("fwd", lambda: x @ w.t()), ("dx", lambda: dy @ w), ("dW", lambda: dy.t() @ x)]:
        ms = timed(fn)
        total += ms if name != "head" else 0.0
        print(f"gemm {name:5s} {kind:3s} {N}x{n_in}->{n_out}: {ms:7.3f} ms, "
              f"{2 * N * n_in * n_out / ms / 1e9:6.1f} TFLOP/s")
print(f"gemm: one block's six products forward and backward: {total:.2f} ms")
from torch.nn.attention import SDPBackend, sdpa_kernel
q, k, v = (torch.randn(2, 16, 2048, 128, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
flops = 4 * 2 * 16 * 2048 * 2048 * 128 / 2  # causal: half the band
for b in ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"]:
    try:
        with sdpa_kernel([getattr(SDPBackend, b)]):
            f = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            def fb():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(do)
            fbm = timed(fb, 10)
        print(f"sdpa {b}: forward {f:.3f} ms ({flops / f / 1e9:.0f} TFLOP/s), forward + "
              f"backward {fbm:.3f} ms ({3.5 * flops / fbm / 1e9:.0f} TFLOP/s)")
    except Exception as e:
        print(f"sdpa {b}: not available ({str(e).splitlines()[0][:100]})")
PY
  rc=$?
  sed 's/^/     /' "$out/targets.txt" | tee -a "$out/summary.txt" > /dev/null
  [ $rc -eq 0 ] && log "ok   targets ($out/targets.txt)" || log "FAIL targets (exit $rc): $(tail -1 "$out/targets.txt")"
fi

# 3-5. A kmoe run: NAME DECK LIMIT TRACED(0|1) [KEY=VALUE ...]; its tokens/s from metrics.csv.
rate() {  # rate METRICS_CSV: median tokens/s and s/step of the steps after the first two
  python3 - "$1" <<'PY' 2>&1
import csv, statistics, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError:
    rows = []
t = rows[2:] or rows[1:]
print(f"{statistics.median(float(r['tokens_per_s']) for r in t):,.0f} tokens/s, "
      f"{statistics.median(float(r['step_time_s']) for r in t):.3f} s/step" if t else "no timed step")
PY
}
run_kmoe() {
  local name=$1 deck=$2 limit=$3 traced=$4 lim keys=() env=()
  shift 4
  if [ $on_gpu -eq 0 ]; then skip "$name" "$why"; return; fi
  lim=$(budget "$limit")
  [ "$lim" -gt 0 ] || { skip "$name" "not run (deadline)"; return; }
  for kv in "$@"; do keys+=("--$kv"); done
  if [ "$traced" = 1 ] && [ -n "$tracer" ]; then
    env=(KOKKOS_TOOLS_LIBS="$tracer" KOKKOS_PROFILE_LIBRARY="$tracer" KMOE_CUPTI_OUT="$out/$name"
         LD_LIBRARY_PATH="$cupti_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  fi
  (cd "$work" && env ${env[@]+"${env[@]}"} timeout "$lim" "$kmoe" kmoe-train -i "$deck" \
     --output.dir="run_$name" --checkpoint.dir="run_$name/ckpt" --checkpoint.at_end=false \
     --train.precision=bf16 --output.phase_timing=true ${keys[@]+"${keys[@]}"} > "$out/$name.log" 2>&1)
  local rc=$?
  log "$([ $rc -eq 0 ] && echo "ok  " || echo "FAIL") $name: $(rate "$work/run_$name/metrics.csv")$([ $rc -eq 0 ] || echo " (exit $rc: $(tail -1 "$out/$name.log"))")"
}
run_peer() {  # run_peer NAME LIMIT ARGS...
  local name=$1 limit=$2 lim
  shift 2
  if [ $on_gpu -eq 0 ]; then skip "$name" "$why"; return; fi
  lim=$(budget "$limit")
  [ "$lim" -gt 0 ] || { skip "$name" "not run (deadline)"; return; }
  timeout "$lim" python3 "$bundle/torch_peer.py" --tokens "$work/data/train.bin" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  log "$([ $rc -eq 0 ] && echo "ok  " || echo "FAIL") $name: $(grep '^torch_peer:' "$out/$name.log" | tail -1 | sed 's/^torch_peer: //')$([ $rc -eq 0 ] || echo " (exit $rc)")"
}
DENSE_SHAPE=(--d-model 2048 --n-layers 8 --n-heads 16 --ffn-hidden 5632 --seq-len 2048
             --global-batch 8 --micro-batch 2 --precision bf16)
MOE_SHAPE=(--d-model 1024 --n-layers 16 --n-heads 16 --experts 64 --top-k 8 --expert-hidden 512
           --seq-len 1024 --global-batch 16 --micro-batch 4 --precision bf16)
run_kmoe dense_tiled dense.deck 70 1 train.attention=tiled train.max_steps=5
run_kmoe dense_fused dense.deck 70 1 train.attention=fused train.max_steps=5
run_peer peer_dense 45 "${DENSE_SHAPE[@]}" --steps 5
run_kmoe moe moe.deck 80 1 train.max_steps=5
run_peer peer_moe_grouped 50 "${MOE_SHAPE[@]}" --expert-impl grouped --steps 5
run_peer peer_dense_profiled 40 "${DENSE_SHAPE[@]}" --steps 4 --skip 2 --profile "$out/peer_dense"
run_kmoe dense_micro4 dense.deck 50 0 train.micro_batch=4 train.max_steps=4
run_kmoe dense_micro8 dense.deck 50 0 train.micro_batch=8 train.max_steps=4
run_kmoe moe_micro8 moe.deck 50 0 train.micro_batch=8 train.max_steps=4

# 6. The summary of the traced runs (and the profiled peer): time per step by kind.
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, glob, os, re, sys
out = sys.argv[1]
def kind(name):
    n = name.lower()
    if re.search(r"gemm|xmma|cutlass|cublas|sm\d+_|gemv|matmul|aten::(add|b)?mm|grouped", n):
        return "gemm"
    if re.search(r"attn|fmha|flash|cudnn|sdpa|attention", n):
        return "attention"
    if re.search(r"memcpy|memset|copy", n):
        return "copies"
    return "element-wise"
for path in sorted(glob.glob(os.path.join(out, "*.kernels.csv"))) + \
        sorted(glob.glob(os.path.join(out, "peer_*.csv"))):
    run = os.path.basename(path).split(".")[0]
    rows = list(csv.DictReader(open(path)))
    by = {}
    for r in rows:
        by[kind(r["name"])] = by.get(kind(r["name"]), 0.0) + float(r["total_us"])
    steps_path = path.replace(".kernels.csv", ".steps.csv")
    line = ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(by.items(), key=lambda x: -x[1]))
    if os.path.exists(steps_path) and steps_path != path:
        st = list(csv.DictReader(open(steps_path)))
        if st:
            mean = lambda k: sum(float(s[k]) for s in st) / len(st) / 1e3
            line += (f"; copies {mean('copy_us'):.1f} ms, idle {mean('idle_us'):.1f} ms of "
                     f"{mean('wall_us'):.1f} ms wall, {sum(int(s['kernels']) for s in st) / len(st):.0f} "
                     f"kernels per step")
    top = ", ".join(f"{r['name'][:48]} {float(r['total_us']) / 1e3:.1f} ms" for r in rows[:5])
    print(f"profile {run}: per step: {line}\n     busiest: {top}")
PY
log "gpu_profile: done in $(( $(date +%s) - start )) s; tables in $out"
