#!/usr/bin/python3
"""engram.offload = host (MODEL.md section 4, RUNTIME.md section 6): the Engram tables and their
AdamW moments in host memory, their rows staged per lookup, give the same run as tables in
device memory, bit for bit, on a CPU build:
  1. one rank: every metrics column but the timings, and the checkpoints' every dataset;
  2. the grid deck with tables sharded over ep (1,2,2) and over the stage (2,2,2), the latter
     with bf16 products, block recompute and ZeRO-1 moments;
  3. replicated tables over the 4 ranks of a stage (1,2,2), and over dp = 2 with document
     masks (the host's document starts); with optimizer.shard = replicas the moments of a table
     summed over ranks (replicated, or sharded over ep with dp > 1) stay whole in host memory,
     so there the run keeps to the layout contract instead;
  4. a checkpoint saved with one setting resumes with the other as the uninterrupted run;
  5. generation from the offloaded tables (the decoding path reads its ids back);
  6. engram.offload without Engram layers is refused, naming both keys.
Usage: engram_offload.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import grid_harness, grid_train, rel, same_datasets  # noqa: E402

h = grid_harness(sys.argv)
STEPS = ["--train.max_steps=8", "--train.eval_every=8", "--checkpoint.every=4"]
TIMINGS = {"tokens_per_s", "tokens_per_s_per_rank", "model_flops_per_s", "mfu", "step_time_s",
           "mem_hwm_mib", "comm_s"}


def train(name, layout=(1, 1, 1), *extra, expect_rc=0):
    return grid_train(h, name, *layout, *STEPS, *extra, expect_rc=expect_rc)


def rows(name):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in h.metrics(name)]


def pair(name, layout, *extra, checkpoints=False, exact=True):
    """The same run with the tables in device and in host memory."""
    train(name + "_none", layout, *extra)
    train(name + "_host", layout, "--engram.offload=host", *extra)
    a, b = rows(name + "_none"), rows(name + "_host")
    if not exact:  # the layout contract (RUNTIME.md section 2)
        r = [rel(x["loss"], y["loss"]) for x, y in zip(b, a)]
        h.check(len(r) == 8 and r[0] <= 1e-6 and max(r[:3]) <= 1e-5 and max(r) <= 5e-3,
                f"{name} {layout}: losses within the layout contract ({max(r or [0]):.1e})")
        return
    h.check(len(a) == 8 and a == b,
            f"{name} {layout}: every metrics column of 8 steps bit-identical "
            f"(loss {a[-1]['loss'] if a else None}, rows touched "
            f"{a[-1].get('engram1_rows_touched') if a else None})")
    if checkpoints:
        for step in (4, 8):
            f = f"step{step:08d}.h5"
            ok, diff = same_datasets(h.path(name + "_none", "ckpt", f),
                                        h.path(name + "_host", "ckpt", f))
            h.check(ok, f"{name}: checkpoint of step {step}, every dataset bit for bit {diff}")


pair("one", (1, 1, 1), checkpoints=True)
pair("shard_ep", (1, 2, 2), "--parallel.engram_shard=ep", checkpoints=True)
pair("shard_stage", (2, 2, 2), "--parallel.engram_shard=stage", "--parallel.pp_layers=1,3",
     "--train.precision=bf16", "--train.recompute=block", "--optimizer.shard=replicas")
pair("replicated", (1, 2, 2))
# optimizer.shard splits a replicated table's moments over its replicas on the device; in host
# memory they stay whole: the gradient sum and the norm take another order.
pair("replicated_zero1", (1, 2, 2), "--optimizer.shard=replicas", exact=False)
pair("shard_ep_zero1", (1, 2, 2), "--parallel.engram_shard=ep", "--optimizer.shard=replicas",
     exact=False)
pair("dp_masked", (1, 2, 1), "--train.document_mask=true", "--model.sliding_window=12",
     "--model.window_layers=0,2")

# A checkpoint of either setting resumes under the other as the uninterrupted run.
for saved, resumed in [("none", "host"), ("host", "none")]:
    name = f"resume_{saved}_{resumed}"
    train(name, (1, 1, 1), f"--engram.offload={resumed}",
          f"--checkpoint.resume={h.path('one_' + saved, 'ckpt', 'step00000004.h5')}")
    got, ref = rows(name), rows("one_" + saved)[4:]
    h.check(len(got) == 4 and got == ref,
            f"saved with offload = {saved}, resumed with {resumed}: steps 5-8 bit-identical")

# Generation reads the same tables either way.
outs = {}
for o in ("none", "host"):
    p = h.run(["kmoe-generate", f"--engram.offload={o}",
               "--checkpoint", h.path("one_none", "ckpt", "step00000008.h5"),
               "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12", "--check"])
    outs[o] = "\n".join(l for l in p.stdout.splitlines() if not l.startswith("generated "))
h.check(outs["none"] == outs["host"] and outs["none"].strip() != "",
        f"kmoe-generate: the same tokens with the tables in host memory ({outs['host'].strip()[:60]})")

# No Engram layers: nothing to offload, refused with both keys named.
p = train("no_layers", (1, 1, 1), "--engram.layers=", "--engram.offload=host", expect_rc=1)
h.check("engram.offload" in p.stderr and "engram.layers" in p.stderr,
        f"engram.offload = host without engram.layers refused: {p.stderr.strip()[-160:]}")
h.finish()
