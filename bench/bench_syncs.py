#!/usr/bin/python3
"""What one training step asks of the device, counted by the Kokkos Tools library
tests/tools/kokkos_counter (built as <build>/tests/tools/libkmoe_kokkos_counter.so): kernel
launches, fences (explicit, and those Kokkos issues inside deep copies and reductions to host
values), deep copies by direction, and kmoe's named host waits (core/device_sync.hpp: counted on
every backend), per step. Each deck runs on one rank (pp = ep = 1) as given,
then with twice the micro-batches per step and with twice the layers, so the table shows what
grows with micro-batches and layers; `per micro` and `per layer` are those growths.

Which events a build reports depends on Kokkos: Kokkos 4.x reports every fence on every
backend; Kokkos 3.4 (Debian) reports no fences of its Serial backend and no host-to-host
copies, so its fence column stays 0 there (kmoe_syncs is the column to read). Phase timing is
off (the deck's output.phase_timing is overridden), as in a production run. Prints figures;
asserts nothing.

usage: bench/bench_syncs.py [--build build] [--steps 4] [--decks inputs/x.deck ...]
                            [--set section.key=value ...]
e.g. --set moe.expert_gemm=grouped counts the grouped MoE path on a CPU build.
"""
import argparse
import csv
import os
import statistics
import subprocess
import tempfile

from benchlib import ensure_fortunes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECKS = ["inputs/tiny_moe_engram.deck", "inputs/olmoe_shape.deck"]
COLUMNS = ["kernels", "fences", "deep_copies", "copies_to_host", "copies_from_host", "kmoe_syncs"]


def deck_value(deck, section, key, default):
    current = None
    for line in open(os.path.join(ROOT, deck)):
        line = line.split("#")[0].strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif "=" in line and current == section and line.split("=")[0].strip() == key:
            return int(line.split("=")[1])
    return default


def count(build, deck, steps, extra, tmp):
    out = os.path.join(tmp, "counts.csv")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", KMOE_KOKKOS_COUNTS=out)
    lib = os.path.join(build, "tests", "tools", "libkmoe_kokkos_counter.so")
    env["KOKKOS_TOOLS_LIBS"] = env["KOKKOS_PROFILE_LIBRARY"] = lib
    cmd = [os.path.join(build, "drivers", "kmoe-train"), "-i", deck, "--parallel.ep=1",
           "--parallel.pp=1", "--parallel.dp=1", f"--train.max_steps={steps}",
           "--train.eval_every=0", "--data.val_paths=", f"--output.dir={tmp}/run",
           f"--checkpoint.dir={tmp}/ckpt", "--checkpoint.resume=none",
           "--checkpoint.every=0", "--checkpoint.overwrite=true", "--output.phase_timing=false",
           *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_syncs: {' '.join(cmd)} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
    rows = list(csv.DictReader(open(out)))[1:]  # the first step also sizes buffers
    return {c: statistics.median(float(r[c]) for r in rows) for c in COLUMNS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--decks", nargs="+", default=DECKS)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="deck overrides for every run")
    a = ap.parse_args()
    sets = [f"--{kv}" for kv in a.set]
    ensure_fortunes(a.build)  # the decks read data/fortunes
    print(f"bench_syncs: per step, median of steps 2..{a.steps}, one rank"
          + (f", {' '.join(a.set)}" if a.set else ""))
    print(f"{'deck':<28} {'variant':<18} " + " ".join(f"{c:>16}" for c in COLUMNS))
    with tempfile.TemporaryDirectory(prefix="kmoe_syncs") as tmp:
        for deck in a.decks:
            G = deck_value(deck, "train", "global_batch", 1)
            b = deck_value(deck, "train", "micro_batch", 1)
            L = deck_value(deck, "model", "n_layers", 1)
            base = count(a.build, deck, a.steps, sets, tmp)
            micro = count(a.build, deck, a.steps, [*sets, f"--train.global_batch={2 * G}"], tmp)
            layers = count(a.build, deck, a.steps, [*sets, f"--model.n_layers={2 * L}"], tmp)
            m = G // b
            name = os.path.basename(deck)
            for label, r in ((f"{m} micro, {L} layers", base), (f"{2 * m} micro", micro),
                             (f"{2 * L} layers", layers)):
                print(f"{name:<28} {label:<18} " + " ".join(f"{r[c]:16.0f}" for c in COLUMNS))
            print(f"{name:<28} {'per micro':<18} " +
                  " ".join(f"{(micro[c] - base[c]) / m:16.1f}" for c in COLUMNS))
            print(f"{name:<28} {'per layer':<18} " +
                  " ".join(f"{(layers[c] - base[c]) / L:16.1f}" for c in COLUMNS))


if __name__ == "__main__":
    main()
