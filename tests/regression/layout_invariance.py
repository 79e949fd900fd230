#!/usr/bin/python3
"""The layout-invariance contract of RUNTIME.md section 2 on the 3D grid (pp, dp, ep).

The tiny MoE + Engram test deck (D 64, L 4, T 64, E 8, G 16, b 2, lr 3e-3, warmup 20, no bias
updates, no capacity) trains 20 steps on 1 rank and on every layout below; each must give
  1. step 1: loss within 1e-6 and global gradient norm within 1e-5 of the single-rank run,
  2. steps 1-3: every loss within 1e-5,
  3. all 20 steps (and the final validation loss) within 5e-3,
  4. the same layout twice: bit-identical losses ((2,2,2) the second time with transfers that
     complete only when matched, which change no arithmetic; (2,1,2) with router-bias updates
     and capacity drops).
Also: document masking with sliding windows, Engram sharding (ep, stage), GPipe, pipeline transfers that complete only when matched
(as NCCL's on one stream), tied embeddings across stages, the watchdog on a rank
that stops taking part (a test-only hook), and clear errors for bad grids before any
allocation.
Usage: layout_invariance.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import grid_harness, grid_train, rel  # noqa: E402

h = grid_harness(sys.argv)


def train(name, pp=1, dp=1, ep=1, *extra, **kw):
    # No checkpoint at the end: nothing here reads one (checkpoint_layouts saves and resumes on
    # these layouts), and the saves were a sixth of the runs' time.
    return grid_train(h, name, pp, dp, ep, *extra, "--checkpoint.at_end=false", **kw)


def compare(name, base, steps=20):
    a, b = h.metrics(name), h.metrics(base)
    if not h.check(len(a) == len(b) == steps, f"{name}: {len(a)} steps logged"):
        return
    r = [rel(x["loss"], y["loss"]) for x, y in zip(a, b)]
    g1 = rel(a[0]["grad_norm"], b[0]["grad_norm"])
    ok = r[0] <= 1e-6 and g1 <= 1e-5 and max(r[:3]) <= 1e-5 and max(r) <= 5e-3
    # 10 validation instances = 5 batches of 2: replicas without a batch in the last round run
    # a discarded one (R = 2, 4, 8), which must not change the result.
    val = rel(a[-1]["val_loss"], b[-1]["val_loss"]) if a[-1]["val_loss"] and b[-1]["val_loss"] \
        else float("inf")
    h.check(ok and val <= 5e-3,
            f"{name} vs {base}: step 1 loss {r[0]:.1e} norm {g1:.1e}, steps 1-3 "
            f"{max(r[:3]):.1e}, {steps} steps {max(r):.1e}, val {val:.1e}")


train("l111")
LAYOUTS = [(2, 1, 1), (4, 1, 1), (1, 2, 1), (1, 4, 1), (1, 1, 2), (1, 1, 4), (2, 2, 1),
           (2, 1, 2), (1, 2, 2), (2, 2, 2)]
for pp, dp, ep in LAYOUTS:
    name = f"l{pp}{dp}{ep}"
    train(name, pp, dp, ep)
    compare(name, "l111")

# Variants on the (2, 2, 2) grid and others: the same function again.
train("gpipe", 2, 2, 2, "--parallel.schedule=gpipe")
compare("gpipe", "l111")
train("shard_ep", 1, 2, 2, "--parallel.engram_shard=ep")
compare("shard_ep", "l111")
train("shard_stage", 2, 2, 2, "--parallel.engram_shard=stage", "--parallel.pp_layers=1,3")
compare("shard_stage", "l111")
# Transfers that complete only when their receive is posted, one at a time in issue order
# (NCCL's on one stream; over MPI a test-only switch): every pipeline schedule still completes
# (the watchdog would name a deadlock) with the same losses. rdv_l222 is also the same layout
# run twice: bit-identical losses need every run of it to compute alike.
RDV = dict(h.env, KMOE_P2P_RENDEZVOUS="1")
for name, grid, extra, base in (("rdv_l411", (4, 1, 1), [], "l411"),
                                ("rdv_l222", (2, 2, 2), [], "l222"),
                                ("rdv_gpipe", (2, 2, 2), ["--parallel.schedule=gpipe"], "gpipe")):
    train(name, *grid, *extra, "--parallel.watchdog_seconds=60", env=RDV)
    h.check(h.losses(name) == h.losses(base),
            f"{name}: rendezvous transfers, losses bit-identical to {base}")
# Document masking and sliding windows (blocks 0 and 2; Engram at 1 and 2 stops at documents
# too): the same function on every layout.
MASK = ["--train.document_mask=true", "--model.sliding_window=12", "--model.window_layers=0,2"]
train("mask111", 1, 1, 1, *MASK)
h.check(h.losses("mask111") != h.losses("l111"), "document masking and windows change the losses")
for grid in ((2, 1, 2), (1, 2, 2), (2, 2, 1), (2, 2, 2)):
    name = "mask" + "".join(map(str, grid))
    train(name, *grid, *MASK)
    compare(name, "mask111")
# Router-bias updates and capacity drops are discontinuous: same-layout checks only.
SWITCHY = ["--moe.bias_update_rate=0.01", "--moe.capacity_factor=1.0", "--train.max_steps=6",
           "--train.eval_every=0"]
train("switchy", 2, 1, 2, *SWITCHY)
train("switchy_again", 2, 1, 2, *SWITCHY)
drops = [float(r["moe1_drop"]) for r in h.metrics("switchy")]
h.check(h.losses("switchy") == h.losses("switchy_again") and len(drops) == 6 and max(drops) > 0,
        f"(2,1,2) with router-bias updates and capacity drops ({max(drops or [0]):.3f}) twice: "
        "bit-identical")

# Tied embeddings across stages: the last stage's replica stays in sync with stage 0's.
TIED = ["--model.tie_embeddings=true", "--train.max_steps=3", "--train.eval_every=0"]
train("tied1", 1, 1, 1, *TIED)
train("tied_pp", 2, 1, 2, *TIED)
a, b = h.metrics("tied_pp"), h.metrics("tied1")
r = [rel(x["loss"], y["loss"]) for x, y in zip(a, b)]
g = [rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(a, b)]  # the tie sum and its count
h.check(len(r) == 3 and r[0] <= 1e-6 and max(r) <= 1e-5 and max(g) <= 1e-5,
        f"tied embeddings over pp=2: losses {max(r):.1e}, gradient norms {max(g):.1e}")

# Engram row blocks so small that a holder has none (R = 5 rows over 4 ranks: 2, 2, 1, 0).
TINY = ["--engram.max_ngram=2", "--engram.heads=1", "--engram.embed_per_ngram=16",
        "--engram.table_size=5", "--train.max_steps=3", "--train.eval_every=0"]
train("tiny_rows1", 1, 1, 1, *TINY)
train("tiny_rows_stage", 1, 4, 1, *TINY, "--parallel.engram_shard=stage")
a, b = h.metrics("tiny_rows_stage"), h.metrics("tiny_rows1")
r = [rel(x["loss"], y["loss"]) for x, y in zip(a, b)]
h.check(len(r) == 3 and max(r) <= 1e-5, f"Engram shards with an empty holder: {r}")

# The watchdog names the axis and the rank that stopped taking part.
env = dict(h.env, KMOE_FAULT="stall:1:2")
p = train("stall", 1, 1, 2, "--parallel.watchdog_seconds=2", "--train.max_steps=3",
          expect_rc=1, env=env)
said = [line for line in p.stderr.splitlines() if "watchdog:" in line]
h.check(any("world rank(s) 1 did not arrive" in s and "ep axis" in s for s in said),
        "the watchdog names the axis and the missing rank: " + (said[0][:160] if said else "-"))

# Bad grids: clear errors before any allocation.
for args, ranks, text in [
        (["--parallel.dp=2"], 1, "launched on 1 ranks"),
        (["--parallel.ep=3"], 3, "moe.experts (8) must be divisible by parallel.ep (3)"),
        (["--parallel.pp=8"], 8, "parallel.pp (8) exceeds model.n_layers"),
        (["--parallel.dp=3"], 3, "must be divisible by train.micro_batch * parallel.dp"),
        (["--parallel.pp=2", "--parallel.pp_layers=1,2"], 2, "parallel.pp_layers sums to 3")]:
    p = h.run(["kmoe-train", "-i", "grid.deck", "--output.dir=bad", *args], expect_rc=1,
              ranks=ranks)
    h.check(text in p.stderr, f"{' '.join(args)}: error names it")
h.finish()
