#!/usr/bin/python3
"""The process grid on this machine: tokens/s, memory per rank and the communication vs compute
split per step for layouts (pp, dp, ep) of the main job's deck (inputs/tiny_moe_engram.deck:
MoE in every block, Engram at block 1).

Each layout trains --steps steps (no evaluation, one checkpoint at the end); the figures are
averages over the steps after the first --skip. `comm` is the time rank 0 waited on
communication inside the step (all-to-alls, pipeline transfers, gradient reductions, including
waiting for slower ranks); `compute` is the rest of the step. `est MiB` is the dry run's memory
estimate for the layout (the largest rank's, runtime included) beside the measured high-water
`MiB/rank`. Prints figures; asserts nothing.
Layouts with more ranks than cores oversubscribe the cores (their tokens/s then measures
correctness of the machinery, not speed).

usage: bench/bench_layouts.py [--build build] [--steps 20] [--layouts 1,1,1 1,2,1 ...]
"""
import argparse
import csv
import os
import re
import subprocess
import sys

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ["1,1,1", "1,2,1", "1,1,2", "2,1,1", "2,2,2"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--deck", default="inputs/tiny_moe_engram.deck")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=DEFAULT)
    ap.add_argument("--global-batch", type=int, default=16, help="the deck's train.global_batch")
    ap.add_argument("--extra", nargs="*", default=[], help="more deck overrides")
    a = ap.parse_args()
    ensure_fortunes(a.build)  # the decks read data/fortunes
    print(f"bench_layouts: {a.deck}, {a.steps} steps (first {a.skip} left out), "
          f"{os.cpu_count()} cores, one BLAS thread per rank")
    print(f"{'pp,dp,ep':>9} {'ranks':>5} {'b':>3} {'tokens/s':>9} {'tok/s/rank':>10} {'MiB/rank':>8} "
          f"{'est MiB':>8} {'step ms':>8} {'comm ms':>8} {'compute ms':>10} {'comm %':>6}")
    for layout in a.layouts:
        pp, dp, ep = (int(v) for v in layout.split(","))
        n = pp * dp * ep
        # Micro-batches of at most the deck's 8 sequences; a pipeline gets at least 2*pp per
        # rank so its bubble stays small: b = G / (dp*ep) capped at 8, or G / (dp*ep*2*pp).
        b = min(8, a.global_batch // (dp * ep * (2 * pp if pp > 1 else 1)))
        run = f"/tmp/kmoe_bench_layouts/{pp}{dp}{ep}"
        train = [os.path.join(a.build, "drivers", "kmoe-train"), "-i", a.deck,
                 f"--parallel.pp={pp}", f"--parallel.dp={dp}", f"--parallel.ep={ep}",
                 f"--train.max_steps={a.steps}", f"--train.micro_batch={b}",
                 "--train.eval_every=0", "--data.val_paths=", f"--output.dir={run}",
                 "--output.log_every=1", f"--checkpoint.dir={run}/ckpt",
                 "--checkpoint.resume=none", "--checkpoint.overwrite=true", *a.extra]
        dry = subprocess.run(train + ["--dry-run"], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        found = re.search(r"([0-9.]+) MiB with the runtime", dry.stdout)
        est = float(found.group(1)) if found else float("nan")
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), "-x",
               "OPENBLAS_NUM_THREADS=1"] + train
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{layout:>9} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
            continue
        with open(os.path.join(run, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))[a.skip:]
        t = sum(float(r["step_time_s"]) for r in rows) / len(rows)
        c = sum(float(r["comm_s"]) for r in rows) / len(rows)
        tps = sum(float(r["tokens_per_s"]) for r in rows) / len(rows)
        mem = max(float(r["mem_hwm_mib"]) for r in rows)
        print(f"{layout:>9} {n:>5} {b:>3} {tps:>9.0f} {tps / n:>10.0f} {mem:>8.0f} {est:>8.0f} "
              f"{1e3 * t:>8.1f} {1e3 * c:>8.1f} {1e3 * (t - c):>10.1f} {100 * c / t:>6.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
