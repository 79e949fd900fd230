#!/usr/bin/python3
"""Experts at fixed active parameters: the main job's deck with 8, 32 and 128 experts, top-4,
expert hidden 128 (each token always meets 4 x 128 expert units, as the main job's top-2 x 256),
on 2 expert-parallel ranks. Total parameters (and optimizer state) grow with the experts; the
tokens/s should not fall much. Prints median tokens/s over steps after the first --skip and
the memory high-water per rank; asserts nothing.

usage: bench/bench_experts.py [--build build] [--deck inputs/tiny_moe_engram.deck]
                              [--steps 20] [--experts 8 32 128]
"""
import argparse
import csv
import os
import statistics
import subprocess
import tempfile

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--deck", default="inputs/tiny_moe_engram.deck")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    a = ap.parse_args()
    ensure_fortunes(a.build)  # the decks read data/fortunes
    print(f"bench_experts: {a.deck}, top-4, expert hidden 128, ep 2, {a.steps} steps "
          f"(first {a.skip} left out), one BLAS thread per rank")
    print(f"{'experts':>7} {'tokens/s':>9} {'vs first':>8} {'MiB/rank':>8}")
    first = None
    with tempfile.TemporaryDirectory(prefix="kmoe_experts") as tmp:
        for e in a.experts:
            run = os.path.join(tmp, str(e))
            cmd = ["mpiexec", "--allow-run-as-root", "-n", "2", "-x", "OPENBLAS_NUM_THREADS=1",
                   os.path.join(a.build, "drivers", "kmoe-train"), "-i", a.deck,
                   "--parallel.ep=2", f"--moe.experts={e}", "--moe.top_k=4",
                   "--moe.expert_hidden=128", f"--train.max_steps={a.steps}",
                   "--train.eval_every=0", "--data.val_paths=", f"--output.dir={run}",
                   "--output.log_every=1", f"--checkpoint.dir={run}/ckpt",
                   "--checkpoint.resume=none", "--checkpoint.every=0"]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{e:>7} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
                continue
            rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))[a.skip:]
            tps = statistics.median(float(r["tokens_per_s"]) for r in rows)
            mem = max(float(r["mem_hwm_mib"]) for r in rows)
            first = first or tps
            print(f"{e:>7} {tps:>9,.0f} {tps / first - 1:>+8.1%} {mem:>8.0f}")


if __name__ == "__main__":
    main()
