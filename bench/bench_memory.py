#!/usr/bin/python3
"""Memory modes on this machine: memory per rank and tokens/s with optimizer.shard and
train.recompute off and on, and the planner's figures for an OLMoE-1B-7B-shaped deck.

1. Measured: each of none / sharded (optimizer.shard = replicas) / recompute (train.recompute =
   block) / both trains --steps steps of
   - the main job's deck (inputs/tiny_moe_engram.deck) on its 2 expert-parallel ranks, and
   - a larger MoE deck (D 512, 8 blocks of 32 experts top-2, expert hidden 512, T 256,
     micro-batch 4, 16 sequences a step) on 4 ranks (ep 4),
   alternating the modes round after round (--rounds) so that a slow spell of the machine
   spreads over all of them. Printed: the measured high-water memory per rank (mem_hwm_mib,
   the largest over ranks and steps), the dry run's estimate, tokens/s (the mean over the steps
   after the first --skip, the best round), and the change against none.
2. Planned (one process, nothing allocated): the OLMoE-1B-7B shape (V 50304, D 2048, 16
   blocks, 64 experts top-8, expert hidden 1024, T 4096, micro-batch 1, 1024 sequences a step,
   bf16) on 64 and 256 ranks: memory per rank of a few layouts in each mode, and which of them
   fit 80 GiB.
Prints figures; asserts nothing.

usage: bench/bench_memory.py [--build build] [--steps 12] [--rounds 2] [--skip 2] [--no-measure]
                             [--decks main,larger]
"""
import argparse
import csv
import os
import re
import subprocess
import sys

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"none": [], "sharded": ["--optimizer.shard=replicas"],
         "recompute": ["--train.recompute=block"],
         "both": ["--optimizer.shard=replicas", "--train.recompute=block"]}
LARGER = ["--model.d_model=512", "--model.n_layers=8", "--model.n_heads=8",
          "--model.ffn_hidden=1024", "--moe.experts=32", "--moe.expert_hidden=512",
          "--moe.shared_experts=0", "--engram.layers=", "--train.micro_batch=4",
          "--parallel.ep=4"]
OLMOE = ["--model.vocab_size=50304", "--model.d_model=2048", "--model.n_layers=16",
         "--model.n_heads=16", "--model.ffn_hidden=8192", "--moe.experts=64", "--moe.top_k=8",
         "--moe.expert_hidden=1024", "--train.seq_len=4096", "--train.micro_batch=1",
         "--train.global_batch=1024", "--train.precision=bf16"]


def dry_estimate(cmd):
    p = subprocess.run(cmd + ["--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    found = re.search(r"([0-9.]+) MiB with the runtime", p.stdout)
    return float(found.group(1)) if found else float("nan"), p


def measure(a, name, ranks, extra):
    train = [os.path.join(a.build, "drivers", "kmoe-train"), "-i", "inputs/tiny_moe_engram.deck",
             f"--train.max_steps={a.steps}", "--train.eval_every=0", "--data.val_paths=",
             "--output.log_every=1", "--checkpoint.every=0", "--checkpoint.resume=none",
             "--checkpoint.overwrite=true", *extra]
    results = {m: {"tps": 0.0, "mem": 0.0} for m in MODES}
    for _ in range(a.rounds):
        for mode, keys in MODES.items():
            run = f"/tmp/kmoe_bench_memory/{name}_{mode}"
            cmd = train + keys + [f"--output.dir={run}", f"--checkpoint.dir={run}/ckpt"]
            results[mode]["est"] = dry_estimate(cmd)[0]
            p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n",
                                str(ranks), "-x", "OPENBLAS_NUM_THREADS=1"] + cmd, cwd=ROOT,
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{name} {mode} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
                return
            with open(os.path.join(run, "metrics.csv")) as f:
                rows = list(csv.DictReader(f))
            steady = rows[a.skip:]
            tps = sum(float(r["tokens_per_s"]) for r in steady) / len(steady)
            results[mode]["tps"] = max(results[mode]["tps"], tps)
            results[mode]["mem"] = max(results[mode]["mem"],
                                       max(float(r["mem_hwm_mib"]) for r in rows))
            results[mode]["loss"] = rows[-1]["loss"]
    base = results["none"]
    print(f"\n{name} on {ranks} ranks ({a.steps} steps, best of {a.rounds} rounds):")
    print(f"{'mode':>10} {'MiB/rank':>9} {'est MiB':>8} {'vs none':>8} {'tokens/s':>9} "
          f"{'vs none':>8}  final loss")
    for mode, r in results.items():
        print(f"{mode:>10} {r['mem']:>9.0f} {r['est']:>8.0f} "
              f"{100 * (r['mem'] / base['mem'] - 1):>+7.1f}% {r['tps']:>9.0f} "
              f"{100 * (r['tps'] / base['tps'] - 1):>+7.1f}%  {r['loss']}")
    sys.stdout.flush()


def plan(a):
    train = [os.path.join(a.build, "drivers", "kmoe-train"), "-i", "inputs/olmoe_shape.deck",
             *OLMOE]
    print("\nOLMoE-1B-7B shape, planned on one process by --plan (GiB per rank, the largest "
          "stage, runtime included; * above 80 GiB; the planner's best layout of each mode "
          "that fits 80 GiB last):")
    print(f"{'ranks':>5} {'pp,dp,ep':>9} " + " ".join(f"{m:>10}" for m in MODES))
    for n in (64, 256):
        table, best = {}, {}
        for mode, keys in MODES.items():
            p = subprocess.run(train + keys + ["--plan", str(n)], cwd=ROOT, capture_output=True,
                               text=True)
            rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+$",
                              p.stdout, re.M)
            for pp, dp, ep, gib in rows:
                table.setdefault((int(pp), int(dp), int(ep)), {})[mode] = float(gib)
            fits = [r for r in rows if float(r[3]) <= 80]
            best[mode] = ",".join(fits[0][:3]) if fits else "none"
        for pp, ep in ((1, 8), (2, 8), (4, 8), (1, 64), (4, 1), (8, 1)):
            cells = table.get((pp, n // (pp * ep), ep))
            if not cells:
                continue
            text = " ".join(f"{cells[m]:>9.1f}{'*' if cells[m] > 80 else ' '}" if m in cells
                            else f"{'-':>10}" for m in MODES)
            print(f"{n:>5} {f'{pp},{n // (pp * ep)},{ep}':>9} " + text)
        print(f"{n:>5} {'best':>9} " + " ".join(f"{best[m]:>10}" for m in MODES))
        sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--no-measure", action="store_true", help="the planner's table only")
    ap.add_argument("--decks", default="main,larger", help="which decks to measure")
    a = ap.parse_args()
    ensure_fortunes(a.build)
    print(f"bench_memory: {os.cpu_count()} cores, one BLAS thread per rank")
    if not a.no_measure:
        decks = a.decks.split(",")
        if "main" in decks:
            measure(a, "main deck", 2, [])
        if "larger" in decks:
            measure(a, "larger MoE deck", 4, LARGER)
    plan(a)


if __name__ == "__main__":
    main()
