#!/usr/bin/python3
"""Checkpoint save and load time and bandwidth on 1, 2, 4 and 8 ranks for the main job's deck
(inputs/tiny_moe_engram.deck: parameters plus both AdamW moments).

For each layout: trains --steps steps saving after every step (the median save is reported),
then resumes from the last file on the same layout without training (the load). Figures come
from kmoe-train's own `checkpoint ...` and `resuming ... loaded ...` lines (rank 0's wall time,
collective). Layouts with more ranks than cores oversubscribe the cores. Prints figures;
asserts nothing.

usage: bench/bench_checkpoint.py [--build build] [--steps 3] [--layouts 1,1,1 1,1,2 2,1,2 2,2,2]
"""
import argparse
import os
import re
import statistics
import subprocess

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--deck", default="inputs/tiny_moe_engram.deck")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "1,1,2", "2,1,2", "2,2,2"])
    a = ap.parse_args()
    ensure_fortunes(a.build)  # the decks read data/fortunes
    print(f"bench_checkpoint: {a.deck}, {os.cpu_count()} cores")
    print(f"{'pp,dp,ep':>9} {'ranks':>5} {'MiB':>7} {'save s':>8} {'save MiB/s':>10} "
          f"{'load s':>8} {'load MiB/s':>10}")
    for layout in a.layouts:
        pp, dp, ep = (int(v) for v in layout.split(","))
        n = pp * dp * ep
        run = f"/tmp/kmoe_bench_checkpoint/{pp}{dp}{ep}"
        base = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), "-x",
                "OPENBLAS_NUM_THREADS=1", os.path.join(a.build, "drivers", "kmoe-train"), "-i",
                a.deck, f"--parallel.pp={pp}", f"--parallel.dp={dp}", f"--parallel.ep={ep}",
                "--train.eval_every=0", "--data.val_paths=", f"--output.dir={run}",
                f"--checkpoint.dir={run}/ckpt", f"--train.max_steps={a.steps}"]
        if pp > 1:  # every stage needs micro-batches: at least one per replica and stage
            base.append("--train.micro_batch=2")
        p = subprocess.run(base + ["--checkpoint.resume=none", "--checkpoint.overwrite=true",
                                   "--checkpoint.every=1"], cwd=ROOT, capture_output=True,
                           text=True)
        saves = re.findall(r"checkpoint \S+: ([\d.]+) MiB in ([\d.]+) s", p.stdout)
        q = subprocess.run(base, cwd=ROOT, capture_output=True, text=True)
        load = re.search(r"loaded ([\d.]+) MiB in ([\d.]+) s", q.stdout)
        if p.returncode or q.returncode or not saves or not load:
            print(f"{layout:>9} failed:\n{p.stderr[-1000:]}{q.stderr[-1000:]}")
            continue
        mib = float(saves[0][0])
        save_s = statistics.median(float(s) for _, s in saves)
        load_s = float(load.group(2))
        print(f"{layout:>9} {n:>5} {mib:>7.1f} {save_s:>8.3f} {mib / save_s:>10.0f} "
              f"{load_s:>8.3f} {mib / load_s:>10.0f}")


if __name__ == "__main__":
    main()
