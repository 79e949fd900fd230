#!/usr/bin/python3
"""End-to-end training checks on a small synthetic corpus, driven through the real binaries.

1. a 50-step run lowers the loss substantially;
2. the same deck and seed twice gives bit-identical losses;
3. data parallelism over 2 ranks computes the same losses (RUNTIME.md section 2 contract),
   dense and MoE (with the same routes and MoE metrics columns);
4. a bad deck key exits 1 naming the key and its line; a diverging run exits 3 naming the step.
Usage: train_regression.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import shutil
import sys

import h5py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness, counting_documents  # noqa: E402

h = Harness(sys.argv[1], sys.argv[2], mpiexec=sys.argv[3])
h.prepare_corpus(counting_documents(6000))
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
h.write("small.deck", DECK)


def train(run_dir, *overrides, **kw):
    # Each run checkpoints into its own directory (checkpoint.resume = auto would resume).
    return h.run(["kmoe-train", "-i", "small.deck", f"--output.dir={run_dir}",
                  f"--checkpoint.dir={run_dir}/checkpoints", *overrides], **kw)


train("run_a")
a = h.losses("run_a")
h.check(len(a) == 50, "50 logged steps")
h.check(float(a[-1][1]) < 0.6 * float(a[0][1]), f"loss drops: step 1 {a[0][1]} -> step 50 {a[-1][1]}")
train("run_b")
h.check(a == h.losses("run_b"), "same seed twice: bit-identical losses")

train("run_dp", "--train.max_steps=3", "--parallel.dp=2", ranks=2)
train("run_1", "--train.max_steps=3")
one, dp = h.losses("run_1"), h.losses("run_dp")
rel = [abs(float(x[1]) - float(y[1])) / abs(float(y[1])) for x, y in zip(dp, one)]
h.check(rel[0] <= 1e-6, f"dp=2 step-1 loss within 1e-6 of 1 rank (rel {rel[0]:.2e})")
h.check(max(rel) <= 1e-5, f"dp=2 steps 1-3 within 1e-5 of 1 rank (max rel {max(rel):.2e})")

MOE = ["--moe.experts=4", "--moe.expert_hidden=32", "--moe.dense_layers=0",
       "--moe.shared_experts=1", "--moe.shared_hidden=16", "--moe.capacity_factor=1.0",
       "--train.max_steps=3", "--output.dump_step=1"]
train("moe_1", *MOE)
train("moe_dp", *MOE, "--parallel.dp=2", ranks=2)
one, dp = h.losses("moe_1"), h.losses("moe_dp")
rel = [abs(float(x[1]) - float(y[1])) / abs(float(y[1])) for x, y in zip(dp, one)]
h.check(rel[0] <= 1e-6 and max(rel) <= 1e-5, f"MoE dp=2 matches 1 rank (max rel {max(rel):.2e})")
cols = h.metrics("moe_1")[0]
h.check(all(f"moe1_{c}" in cols for c in ("lb", "rz", "load_max_mean", "drop")) and
        "moe0_lb" not in cols, "MoE metrics columns for block 1 only")
h.check(0.9 < float(cols["moe1_lb"]) < 2.0, f"LB near 1 at init ({cols['moe1_lb']})")
with h5py.File(h.path("moe_1", "dump_step1.h5")) as a, h5py.File(h.path("moe_dp", "dump_step1.h5")) as b:
    h.check(a["route/1"].shape == (8 * 64, 2) and (a["route/1"][:] == b["route/1"][:]).all(),
            "dumped routes [G*T, k], identical on 1 and 2 ranks")

p = h.run(["kmoe-eval", "-i", "small.deck", *MOE[:-2], "--checkpoint",
           "moe_1/checkpoints/step00000003.h5"])
h.check(p.stdout.split()[-3] == h.metrics("moe_1")[-1]["val_loss"],
        "kmoe-eval on an MoE checkpoint reproduces the trainer's val_loss")

# Aux-loss-free balancing: the router bias is a checkpointed buffer without AdamW moments, and a
# resume continues bit for bit.
BIAS = MOE[:-2] + ["--moe.bias_update_rate=0.01", "--checkpoint.every=2"]
train("bias_full", *BIAS, "--train.max_steps=4")
with h5py.File(h.path("bias_full", "checkpoints", "step00000004.h5")) as f:
    b = f["model/blocks/1/moe/router_bias"][:]
    h.check(b.shape == (4,) and abs(b).max() > 0 and
            "router_bias" not in f["optimizer/exp_avg/blocks/1/moe"] and
            "router" in f["optimizer/exp_avg/blocks/1/moe"],
            f"router_bias saved ({b}), without AdamW moments")
shutil.copytree(h.path("bias_full", "checkpoints"), h.path("bias_resume", "checkpoints"))
os.remove(h.path("bias_resume", "checkpoints", "step00000004.h5"))
h.write("bias_resume/checkpoints/latest", "step00000002.h5\n")
train("bias_resume", *BIAS, "--train.max_steps=4")
h.check(h.losses("bias_resume") == h.losses("bias_full")[2:],
        "resume with router biases continues bit for bit")

# Engram at block 1 with a compression map (ids folded mod 64): 1 rank against 2.
with open(h.path("fold64.bin"), "wb") as f:
    f.write(b"".join((v % 64).to_bytes(4, "little") for v in range(320)))
ENGRAM = ["--engram.layers=1", "--engram.heads=2", "--engram.embed_per_ngram=16",
          "--engram.table_size=97,101", "--engram.compression_map=fold64.bin", "--train.max_steps=3"]
train("engram_1", *ENGRAM)
train("engram_dp", *ENGRAM, "--parallel.dp=2", ranks=2)
one, dp = h.losses("engram_1"), h.losses("engram_dp")
rel = [abs(float(x[1]) - float(y[1])) / abs(float(y[1])) for x, y in zip(dp, one)]
h.check(rel[0] <= 1e-6 and max(rel) <= 1e-5, f"Engram dp=2 matches 1 rank (max rel {max(rel):.2e})")
row = h.metrics("engram_1")[-1]
h.check(0.0 < float(row["engram1_gate"]) < 1.0 and 0.0 < float(row["engram1_rows_touched"]) <= 1.0,
        f"Engram metrics: gate {row['engram1_gate']}, rows touched {row['engram1_rows_touched']}")

h.write("bad.deck", DECK.replace("ffn_hidden = 128", "ffn_hidden = 128\nffn_hiden = 5"))
p = h.run(["kmoe-train", "-i", "bad.deck"], expect_rc=1)
h.check("ffn_hiden" in p.stderr and "bad.deck:9" in p.stderr, "bad key named with file:line")

p = train("run_nan", "--optimizer.lr=1e30", "--optimizer.clip=0", "--optimizer.warmup_steps=0",
          expect_rc=3)
h.check("non-finite" in p.stderr and "at step" in p.stderr, "diverging run stops with exit 3")
h.finish()
