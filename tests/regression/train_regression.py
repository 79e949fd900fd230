#!/usr/bin/python3
"""End-to-end training checks on a small synthetic corpus, driven through the real binaries.

1. a 50-step run lowers the loss substantially;
2. the same deck and seed twice gives bit-identical losses;
3. data parallelism over 2 ranks computes the same step-1 loss (RUNTIME.md section 2 contract);
4. a bad deck key exits 1 naming the key and its line; a diverging run exits 3 naming the step.
Usage: train_regression.py BIN_DIR WORK_DIR MPIEXEC
"""
import csv
import os
import shutil
import subprocess
import sys

BIN, WORK, MPIEXEC = sys.argv[1], sys.argv[2], sys.argv[3]
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, expect_rc=0, ranks=1):
    # Each run checkpoints into its own directory (checkpoint.resume = auto would resume).
    out = [a for a in args if a.startswith("--output.dir=")]
    if out:
        args = args + ["--checkpoint.dir=" + out[0].split("=", 1)[1] + "/checkpoints"]
    cmd = [os.path.join(BIN, args[0])] + args[1:]
    if ranks > 1:
        cmd = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
               "-x", "OPENBLAS_NUM_THREADS=1"] + cmd
    p = subprocess.run(cmd, cwd=WORK, env=ENV, capture_output=True, text=True, timeout=900)
    if p.returncode != expect_rc:
        print(p.stdout[-3000:], p.stderr[-3000:])
    check(p.returncode == expect_rc, f"{' '.join(args[:3])}... exits {expect_rc} (got {p.returncode})")
    return p


def losses(run_dir):
    with open(os.path.join(WORK, run_dir, "metrics.csv")) as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
# A corpus with learnable structure: counting sentences, one document each.
with open(os.path.join(WORK, "corpus.txt"), "w") as f:
    for i in range(6000):
        f.write(f"number {i} is {'odd' if i % 2 else 'even'}, and {i} + 1 = {i + 1}.\n%\n")
run(["kmoe-prep", "--out-dir", "data", "--separator", "%", "--val-every", "20", "corpus.txt"])

DECK = """
[model]
vocab_size = 320
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 128
[train]
seq_len = 64
global_batch = 8
micro_batch = 2
max_steps = 50
eval_every = 25
eval_instances = 32
[optimizer]
lr = 3e-3
warmup_steps = 5
[data]
paths = data/train.bin
val_paths = data/val.bin
[output]
log_every = 1
"""
with open(os.path.join(WORK, "small.deck"), "w") as f:
    f.write(DECK)

run(["kmoe-train", "-i", "small.deck", "--output.dir=run_a"])
a = losses("run_a")
check(len(a) == 50, "50 logged steps")
check(a[-1][1] < 0.6 * a[0][1], f"loss drops: step 1 {a[0][1]:.4f} -> step 50 {a[-1][1]:.4f}")

run(["kmoe-train", "-i", "small.deck", "--output.dir=run_b"])
check(a == losses("run_b"), "same seed twice: bit-identical losses")

run(["kmoe-train", "-i", "small.deck", "--output.dir=run_dp", "--train.max_steps=3",
     "--parallel.dp=2"], ranks=2)
run(["kmoe-train", "-i", "small.deck", "--output.dir=run_1", "--train.max_steps=3"])
one, dp = losses("run_1"), losses("run_dp")
rel = [abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(dp, one)]
check(rel[0] <= 1e-6, f"dp=2 step-1 loss within 1e-6 of 1 rank (rel {rel[0]:.2e})")
check(max(rel) <= 1e-5, f"dp=2 steps 1-3 within 1e-5 of 1 rank (max rel {max(rel):.2e})")

with open(os.path.join(WORK, "bad.deck"), "w") as f:
    f.write(DECK.replace("ffn_hidden = 128", "ffn_hidden = 128\nffn_hiden = 5"))
p = run(["kmoe-train", "-i", "bad.deck"], expect_rc=1)
check("ffn_hiden" in p.stderr and "bad.deck:9" in p.stderr, "bad key named with file:line")

p = run(["kmoe-train", "-i", "small.deck", "--output.dir=run_nan", "--optimizer.lr=1e30",
         "--optimizer.clip=0", "--optimizer.warmup_steps=0"], expect_rc=3)
check("non-finite" in p.stderr and "at step" in p.stderr, "diverging run stops with exit 3")

print(f"{len(failures)} failed" if failures else "all regression checks passed")
sys.exit(1 if failures else 0)
