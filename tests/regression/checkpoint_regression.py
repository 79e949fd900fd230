#!/usr/bin/python3
"""Checkpoint, resume and kmoe-eval through the real binaries (RUNTIME.md sections 3-4).

1. a run resumed from its step-25 checkpoint reproduces the uninterrupted 50-step run's losses
   bit for bit; checkpoint.keep prunes; `latest` names the newest file;
2. kmoe-eval on the final checkpoint prints the trainer's last validation loss exactly;
3. truncated file, wrong format attribute, missing dataset, shape mismatch, changed model
   section: each a clear error naming the file (and dataset or key), exit code 1;
4. a process killed in the middle of a save leaves the previous checkpoint and `latest` intact.
Usage: checkpoint_regression.py BIN_DIR WORK_DIR
"""
import os
import shutil
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness  # noqa: E402

h = Harness(sys.argv[1], sys.argv[2])
WORK, ENV, check, run, losses, rows = h.work, h.env, h.check, h.run, h.losses, h.metrics
h.prepare_corpus([f"line {i}: {i * 7 % 13} apples and {i % 5} pears." for i in range(4000)])
with open(os.path.join(WORK, "small.deck"), "w") as f:
    f.write("""
[model]
vocab_size = 320
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 96
[train]
seq_len = 64
global_batch = 8
micro_batch = 2
max_steps = 50
eval_every = 25
eval_instances = 24
[optimizer]
lr = 3e-3
warmup_steps = 5
[data]
paths = data/train.bin
val_paths = data/val.bin
[checkpoint]
dir = ck_full
every = 10
keep = 3
""")

# 1. Uninterrupted run, then a resume from its step-20 file (kept by keep = 3: 30, 40, 50 remain,
#    so copy step 20 aside while it exists by saving every 25 instead).
run(["kmoe-train", "-i", "small.deck", "--output.dir=full", "--checkpoint.every=25"])
ck = sorted(os.listdir(os.path.join(WORK, "ck_full")))
check(ck == ["latest", "step00000025.h5", "step00000050.h5"], f"checkpoint files {ck}")
with open(os.path.join(WORK, "ck_full", "latest")) as f:
    check(f.read().strip() == "step00000050.h5", "latest names the newest checkpoint")
run(["kmoe-train", "-i", "small.deck", "--output.dir=pruned", "--checkpoint.dir=ck_pruned",
     "--checkpoint.keep=2", "--train.max_steps=40"])
check(sorted(os.listdir(os.path.join(WORK, "ck_pruned"))) ==
      ["latest", "step00000030.h5", "step00000040.h5"], "checkpoint.keep = 2 keeps the newest two")

os.makedirs(os.path.join(WORK, "ck_resume"))
shutil.copy(os.path.join(WORK, "ck_full", "step00000025.h5"), os.path.join(WORK, "ck_resume"))
with open(os.path.join(WORK, "ck_resume", "latest"), "w") as f:
    f.write("step00000025.h5\n")
p = run(["kmoe-train", "-i", "small.deck", "--output.dir=resumed", "--checkpoint.dir=ck_resume"])
check("resuming from" in p.stdout and "after step 25" in p.stdout, "resume=auto picks up latest")
full, resumed = losses("full"), losses("resumed")
check(resumed == full[25:], "steps 26-50 after resume are bit-identical to the uninterrupted run")

# 2. kmoe-eval reproduces the trainer's validation loss.
p = run(["kmoe-eval", "-i", "small.deck", "--checkpoint", "ck_full/step00000050.h5"])
last = p.stdout.strip().splitlines()[-1].split()
check(last[0] == "eval_loss" and last[2] == "tokens" and last[3] == str(24 * 63),
      f"kmoe-eval last line: {' '.join(last)}")
check(float(last[1]) == float(rows("full")[-1]["val_loss"]),
      f"kmoe-eval {last[1]} equals the trainer's val_loss {rows('full')[-1]['val_loss']}")


# 3. Damaged checkpoints and incompatible decks.
def damaged(name, edit):
    path = os.path.join(WORK, name)
    shutil.copy(os.path.join(WORK, "ck_full", "step00000050.h5"), path)
    edit(path)
    return run(["kmoe-eval", "-i", "small.deck", "--checkpoint", name], expect_rc=1).stderr


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def set_format(path):
    with h5py.File(path, "r+") as f:
        f.attrs["format"] = "not-kmoe"


def drop_dataset(path):
    with h5py.File(path, "r+") as f:
        del f["model/blocks/1/mlp/w2"]


def reshape_dataset(path):
    with h5py.File(path, "r+") as f:
        del f["model/final_norm/weight"]
        f["model/final_norm/weight"] = np.ones(32, dtype=np.float32)


err = damaged("truncated.h5", truncate)
check("truncated.h5" in err and ("truncated" in err or "not an HDF5" in err), f"truncated: {err.strip()}")
err = damaged("format.h5", set_format)
check("format.h5" in err and "not-kmoe" in err and "kmoe-checkpoint" in err, f"format: {err.strip()}")
err = damaged("missing.h5", drop_dataset)
check("missing.h5" in err and "/model/blocks/1/mlp/w2" in err and "missing" in err,
      f"missing dataset: {err.strip()}")
err = damaged("shape.h5", reshape_dataset)
check("shape.h5" in err and "/model/final_norm/weight" in err and "[32]" in err and "[64]" in err,
      f"shape mismatch: {err.strip()}")
p = run(["kmoe-train", "-i", "small.deck", "--output.dir=bad", "--checkpoint.dir=ck_resume",
         "--model.ffn_hidden=128", "--train.max_steps=60"], expect_rc=1)
check("model.ffn_hidden: 96 -> 128" in p.stderr and "ck_resume/step00000050.h5" in p.stderr,
      f"changed model section: {p.stderr.strip()}")
p = run(["kmoe-train", "-i", "small.deck", "--output.dir=lr", "--checkpoint.dir=ck_lr",
         "--checkpoint.resume=ck_full/step00000025.h5", "--optimizer.lr=1e-3",
         "--train.max_steps=27"])
check("optimizer.lr: 0.003 -> 0.001" in p.stdout and len(losses("lr")) == 2,
      "a changed learning rate resumes, is printed, and trains steps 26-27")

# 4. Killed in the middle of a save: the previous checkpoint and latest survive.
os.makedirs(os.path.join(WORK, "ck_kill"))
shutil.copy(os.path.join(WORK, "ck_full", "step00000025.h5"), os.path.join(WORK, "ck_kill"))
with open(os.path.join(WORK, "ck_kill", "latest"), "w") as f:
    f.write("step00000025.h5\n")
p = run(["kmoe-train", "-i", "small.deck", "--output.dir=kill", "--checkpoint.dir=ck_kill",
         "--train.max_steps=30"], expect_rc=-9, env=dict(ENV, KMOE_FAULT="kill_during_save"))
with open(os.path.join(WORK, "ck_kill", "latest")) as f:
    check(f.read().strip() == "step00000025.h5", "after the kill, latest still names step 25")
check(not os.path.exists(os.path.join(WORK, "ck_kill", "step00000030.h5")), "no step-30 file")
p = run(["kmoe-train", "-i", "small.deck", "--output.dir=after_kill", "--checkpoint.dir=ck_kill"])
check(losses("after_kill") == full[25:], "the resume after the kill continues bit-identically")

h.finish()
