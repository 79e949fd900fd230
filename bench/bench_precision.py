#!/usr/bin/python3
"""The main job in each train.precision: the deck's whole run (250 steps, validation every 50)
once per precision, on the deck's 2 ranks. Prints the validation losses, the gap to the first
precision's, median tokens/s (steps after the first --skip logged) and the memory high-water
per rank; asserts nothing.

usage: bench/bench_precision.py [--build build] [--deck inputs/tiny_moe_engram.deck]
                                [--precisions fp32 bf16] [--steps 250]
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
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--skip", type=int, default=1, help="logged rows left out of tokens/s")
    a = ap.parse_args()
    ensure_fortunes(a.build)  # the decks read data/fortunes
    print(f"bench_precision: {a.deck}, {a.steps} steps on {a.ranks} ranks, one BLAS thread each")
    first = None
    with tempfile.TemporaryDirectory(prefix="kmoe_prec") as tmp:
        for prec in a.precisions:
            run = os.path.join(tmp, prec)
            cmd = ["mpiexec", "--allow-run-as-root", "-n", str(a.ranks), "-x",
                   "OPENBLAS_NUM_THREADS=1", os.path.join(a.build, "drivers", "kmoe-train"),
                   "-i", a.deck, f"--train.precision={prec}", f"--train.max_steps={a.steps}",
                   f"--output.dir={run}", f"--checkpoint.dir={run}/ckpt",
                   "--checkpoint.resume=none", "--checkpoint.every=0"]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{prec} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
                continue
            rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))
            val = {int(r["step"]): float(r["val_loss"]) for r in rows if r["val_loss"]}
            tps = statistics.median(float(r["tokens_per_s"]) for r in rows[a.skip:])
            mem = max(float(r["mem_hwm_mib"]) for r in rows)
            first = first or val
            vals = "  ".join(f"{s}: {v:.4f} ({v - first.get(s, v):+.4f})" for s, v in val.items())
            print(f"{prec:>5}: validation {vals}")
            print(f"{'':>5}  {tps:,.0f} tokens/s, {mem:.0f} MiB per rank")


if __name__ == "__main__":
    main()
