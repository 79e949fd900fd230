#!/usr/bin/python3
"""Speed baseline: kmoe against a plain PyTorch model on the same tiny dense config and data.

Runs, one after the other on an otherwise idle machine:
  1. bench_gemm with BLAS on every core: the sgemm peak that MFU is quoted against;
  2. kmoe-train on inputs/tiny.deck for --steps steps on --ranks ranks (one BLAS thread each);
  3. bench/torch_baseline.py for the same steps (torch threads 1, BLAS on every core, which is
     PyTorch's best setting on a 2-core machine);
and prints tokens/s of each, their ratio, kmoe's model FLOP/s against the peak, kmoe's time per
phase and both memory high-water marks. Prints figures; asserts nothing.

usage: bench/speed_baseline.py [--build build] [--steps 30] [--ranks 2]
"""
import argparse
import csv
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd, env=None):
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.exit(f"speed_baseline: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the averages")
    a = ap.parse_args()
    cores = str(os.cpu_count())
    data = os.path.join(ROOT, "data", "fortunes")
    if not os.path.exists(os.path.join(data, "train.bin")):
        sh([os.path.join(a.build, "drivers", "kmoe-prep"), "--fortunes", "--out-dir", data])

    out = sh([os.path.join(a.build, "bench", "bench_gemm")], {"OPENBLAS_NUM_THREADS": cores})
    peak = float(re.search(r"sgemm_peak_gflops ([\d.]+)", out).group(1)) * 1e9

    run_dir = "/tmp/kmoe_speed_baseline"
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(a.ranks), "-x",
           "OPENBLAS_NUM_THREADS=1", os.path.join(a.build, "drivers", "kmoe-train"), "-i",
           "inputs/tiny.deck", f"--parallel.dp={a.ranks}", f"--train.max_steps={a.steps}",
           "--data.val_paths=", f"--output.dir={run_dir}", "--output.log_every=1",
           "--output.phase_timing=true",
           f"--checkpoint.dir={run_dir}/checkpoints", "--checkpoint.resume=none",
           "--checkpoint.overwrite=true",
           f"--checkpoint.every={a.steps}", f"--output.peak_flops={peak / a.ranks:.6g}"]
    log = sh(cmd)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f)][a.skip:]
    k_time = sum(float(r["step_time_s"]) for r in rows)
    k_tps = sum(float(r["tokens_per_s"]) * float(r["step_time_s"]) for r in rows) / k_time
    k_flops = sum(float(r["model_flops_per_s"]) * float(r["step_time_s"]) for r in rows) / k_time
    k_mem = max(float(r["mem_hwm_mib"]) for r in rows)
    phases = re.search(r"time per phase.*", log).group(0)

    tlog = sh(["/usr/bin/python3", "bench/torch_baseline.py", "--train", f"{data}/train.bin",
               "--val", f"{data}/val.bin", "--steps", str(a.steps), "--eval-every",
               str(a.steps + 1), "--eval-instances", "8", "--threads", "1"],
              {"OPENBLAS_NUM_THREADS": cores})
    t_tps = float(re.search(r"tokens_per_s (\d+)", tlog).group(1))
    t_mem = float(re.search(r"peak_rss_mib (\d+)", tlog).group(1))

    print(f"speed baseline: tiny dense config (D 256, L 4, H 4, F 768, T 256, V 320), "
          f"16 sequences per step, {a.steps} steps, first {a.skip} left out")
    print(f"  sgemm peak ({cores} threads):        {peak / 1e9:8.1f} GFLOP/s")
    print(f"  kmoe  ({a.ranks} ranks x 1 thread):   {k_tps:8.0f} tokens/s  "
          f"{k_flops / 1e9:6.1f} GFLOP/s = {100 * k_flops / peak:4.1f}% of peak  "
          f"mem {k_mem:.0f} MiB/rank")
    print(f"  torch (1 thread, BLAS x{cores}):     {t_tps:8.0f} tokens/s  mem {t_mem:.0f} MiB")
    print(f"  kmoe / torch:                    {k_tps / t_tps:8.2f}x")
    print(f"  kmoe {phases}")


if __name__ == "__main__":
    main()
