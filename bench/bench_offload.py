#!/usr/bin/python3
"""Engram tables in host memory (engram.offload = host) against tables in device memory.

1. Measured: the main job's deck (inputs/tiny_moe_engram.deck, 2 expert-parallel ranks) trains
   --steps steps with offload = none and = host, alternating in --pairs pairs so that a slow
   spell of the machine falls on both. Printed per pair: tokens/s of each (the mean over the
   steps after the first --skip) and their ratio; then the median ratio, the memory high-water
   per rank and the dry run's estimate (device + host), and whether the last losses agree.
2. Planned (one process, nothing allocated): inputs/plans/engram_100b_offload.deck, a
   100B-parameter Engram memory on 32 ranks, with and without offload.
Prints figures; asserts nothing.

usage: bench/bench_offload.py [--build build] [--steps 12] [--pairs 5] [--skip 2]
"""
import argparse
import csv
import os
import re
import statistics
import subprocess

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECK = "inputs/tiny_moe_engram.deck"
PLAN = "inputs/plans/engram_100b_offload.deck"


def train_cmd(a, mode, run):
    return [os.path.join(a.build, "drivers", "kmoe-train"), "-i", DECK,
            f"--engram.offload={mode}", f"--train.max_steps={a.steps}", "--train.eval_every=0",
            "--data.val_paths=", "--output.log_every=1", "--checkpoint.every=0",
            "--checkpoint.at_end=false", "--checkpoint.resume=none", "--checkpoint.overwrite=true",
            f"--output.dir={run}", f"--checkpoint.dir={run}/ckpt"]


def run_once(a, mode):
    run = f"/tmp/kmoe_bench_offload/{mode}"
    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x",
                        "OPENBLAS_NUM_THREADS=1"] + train_cmd(a, mode, run), cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    steady = rows[a.skip:]
    return {"tps": sum(float(r["tokens_per_s"]) for r in steady) / len(steady),
            "mem": max(float(r["mem_hwm_mib"]) for r in rows), "loss": rows[-1]["loss"]}


def dry(a, deck, *extra):
    p = subprocess.run([os.path.join(a.build, "drivers", "kmoe-train"), "-i", deck,
                        "--dry-run", *extra], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2)
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    ensure_fortunes(a.build)
    print(f"{DECK} on 2 ranks, {a.steps} steps, tokens/s over steps {a.skip + 1}-{a.steps}:")
    print(f"{'pair':>4} {'none tok/s':>11} {'host tok/s':>11} {'host/none':>10}")
    res = {"none": [], "host": []}
    for i in range(a.pairs):
        order = ("none", "host") if i % 2 == 0 else ("host", "none")
        got = {m: run_once(a, m) for m in order}
        for m in res:
            res[m].append(got[m])
        print(f"{i + 1:>4} {got['none']['tps']:11.0f} {got['host']['tps']:11.0f} "
              f"{got['host']['tps'] / got['none']['tps']:10.3f}")
    ratios = [h["tps"] / n["tps"] for n, h in zip(res["none"], res["host"])]
    print(f"median host/none: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    for m in res:
        est = re.search(r"([0-9.]+) MiB with the runtime",
                        dry(a, DECK, f"--engram.offload={m}"))
        print(f"offload = {m}: memory high-water {max(r['mem'] for r in res[m]):.1f} MiB per "
              f"rank, estimate {est.group(1) if est else '?'} MiB; last loss "
              f"{res[m][-1]['loss']}")
    print("last losses bit-identical:", res["none"][-1]["loss"] == res["host"][-1]["loss"])

    print(f"\n{PLAN} (planned on one process):")
    out = dry(a, PLAN)
    for line in out.splitlines():
        if "parameters:" in line or "engram.offload" in line or "largest share" in line or \
                "stage  " in line or re.match(r"\s+0\s+\d", line):
            print(line)
    none = dry(a, PLAN, "--engram.offload=none")
    for line in none.splitlines():
        if "largest share" in line:
            print("without offload:" + line.split(":", 1)[1])


if __name__ == "__main__":
    main()
