#!/usr/bin/python3
"""Initialization schemes at equal steps (MODEL.md section 7): validation loss at steps 50, 150
and 250 of a deck (default: inputs/tiny.deck, the dense tiny model on fortunes, 2 ranks) under
each scheme of --schemes. The losses do not depend on the machine's speed or load (the runs are
deterministic); the table goes to docs/PERFORMANCE.md. Prints figures; asserts nothing.

usage: bench/bench_init.py [--build build] [--deck inputs/tiny.deck] [--ranks 2]
                           [--schemes normal,normal_depth,fan_in,...] [--extra --key=value ...]
"""
import argparse
import csv
import os
import subprocess
import sys

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each scheme sets every init key, whatever the deck says (the decks use fan_in_g0.58_embed1).
BASE = {"init": "normal", "init_gain": "1.0", "init_depth_scale": "false",
        "embed_init_std": "0.02"}
VARIANTS = {
    "normal": {},
    "normal_depth": {"init_depth_scale": "true"},
    "normal_embed1": {"embed_init_std": "1.0"},
    "fan_in": {"init": "fan_in"},
    "fan_in_depth": {"init": "fan_in", "init_depth_scale": "true"},
    "fan_in_embed1": {"init": "fan_in", "embed_init_std": "1.0"},
    "fan_in_depth_embed1": {"init": "fan_in", "init_depth_scale": "true",
                            "embed_init_std": "1.0"},
    # gain 1/sqrt(3): the variance of PyTorch's nn.Linear default (uniform in +-1/sqrt(fan_in))
    "fan_in_g0.58": {"init": "fan_in", "init_gain": "0.577"},
    "fan_in_g0.58_embed1": {"init": "fan_in", "init_gain": "0.577", "embed_init_std": "1.0"},
    "fan_in_g0.58_depth_embed1": {"init": "fan_in", "init_gain": "0.577",
                                  "init_depth_scale": "true", "embed_init_std": "1.0"},
}
SCHEMES = {name: [f"--model.{k}={v}" for k, v in dict(BASE, **over).items()]
           for name, over in VARIANTS.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--deck", default="inputs/tiny.deck")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--extra", nargs="*", default=[], help="more deck overrides")
    a = ap.parse_args()
    ensure_fortunes(a.build)
    name = os.path.splitext(os.path.basename(a.deck))[0]
    print(f"bench_init: {a.deck} on {a.ranks} ranks, 250 steps, validation at 50/150/250")
    print(f"{'scheme':>22} {'val 50':>8} {'val 150':>8} {'val 250':>8}")
    for scheme in a.schemes.split(","):
        run = f"/tmp/kmoe_bench_init/{name}_{scheme}"
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(a.ranks), "-x",
               "OPENBLAS_NUM_THREADS=1", os.path.join(a.build, "drivers", "kmoe-train"), "-i",
               a.deck, "--train.max_steps=250", "--train.eval_every=50",
               "--checkpoint.every=0", "--checkpoint.resume=none", "--checkpoint.overwrite=true",
               f"--output.dir={run}", f"--checkpoint.dir={run}/ckpt", *SCHEMES[scheme],
               *a.extra]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{scheme}: failed\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
            continue
        with open(os.path.join(run, "metrics.csv")) as f:
            val = {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"]}
        print(f"{scheme:>22} {val.get(50, float('nan')):>8.3f} {val.get(150, float('nan')):>8.3f} "
              f"{val.get(250, float('nan')):>8.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
