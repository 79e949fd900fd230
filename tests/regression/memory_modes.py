#!/usr/bin/python3
"""Memory modes: sharded optimizer state (optimizer.shard = replicas) and activation recompute
(train.recompute = block) on RUNTIME.md section 2's test deck.

Sharding keeps the layout contract of RUNTIME.md section 2 (step 1 loss 1e-6 and gradient norm
1e-5, steps 1-3 1e-5, 20 steps and the validation loss 5e-3 against the unsharded single rank)
on (1,2,1), (1,2,2), (2,2,1) and (2,2,2), with tied embeddings across stages too; a checkpoint
saved sharded on (2,2,2) resumes unsharded on (1,1,1) and the reverse, within the same contract
against the uninterrupted single rank; the moments a sharded save writes match an unsharded
save of the same layout (every row written once).
Recompute gives bit-identical losses, MoE and Engram metrics and step dumps (every reduced
gradient) to no recompute on (1,1,1), (1,1,2), (2,1,1), (2,1,1) with GPipe and (1,1,2) in bf16
(whose kept operands share the pool as bf16), with capacity, aux-loss-free router biases and
Engram on.
kmoe-eval runs on the ranks it is launched on when the deck's grid differs and no parallel key
is given (RUNTIME.md section 5), and refuses an explicit grid unlike the launch.
Bad values of both keys are errors naming the key.
Usage: memory_modes.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import grid_harness, grid_train, rel  # noqa: E402

h = grid_harness(sys.argv)
SHARD = "--optimizer.shard=replicas"


def train(name, pp=1, dp=1, ep=1, *extra, **kw):
    # A checkpoint only where one is read (checkpoint.every below): the end-of-run saves were a
    # sixth of each run's time.
    return grid_train(h, name, pp, dp, ep, "--checkpoint.at_end=false", *extra, **kw)


def compare(name, base, first=0):
    """The layout contract of `name` against `base` from step first+1 on (a resumed run: its
    steps after the checkpoint)."""
    a, b = h.metrics(name), h.metrics(base)[first:]
    if not h.check(len(a) == len(b) > 0, f"{name}: {len(a)} steps logged, {len(b)} expected"):
        return
    r = [rel(x["loss"], y["loss"]) for x, y in zip(a, b)]
    g1 = rel(a[0]["grad_norm"], b[0]["grad_norm"])
    tight = first == 0 and (r[0] > 1e-6 or g1 > 1e-5 or max(r[:3]) > 1e-5)
    val = rel(a[-1]["val_loss"], b[-1]["val_loss"])
    h.check(not tight and max(r) <= 5e-3 and val <= 5e-3,
            f"{name} vs {base}: first step loss {r[0]:.1e} norm {g1:.1e}, all {max(r):.1e}, "
            f"val {val:.1e}")


# Sharded optimizer state on four layouts, and with tied embeddings across two stages.
train("l111")
for pp, dp, ep in [(1, 2, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2)]:
    name = f"shard{pp}{dp}{ep}"
    train(name, pp, dp, ep, SHARD)
    compare(name, "l111")
train("tied111", 1, 1, 1, "--model.tie_embeddings=true")
train("tied221", 2, 2, 1, "--model.tie_embeddings=true", SHARD)
compare("tied221", "tied111")

# Resume across the mode and the layout: saved sharded on (2,2,2) at step 10, continued
# unsharded on one rank, and the reverse.
SAVE = ["--checkpoint.every=10"]
train("save_sharded", 2, 2, 2, SHARD, *SAVE, "--train.max_steps=10")
train("save_plain", 2, 2, 2, *SAVE, "--train.max_steps=10")
train("save_one", 1, 1, 1, *SAVE, "--train.max_steps=10")
with h5py.File(h.path("save_sharded", "ckpt", "step00000010.h5")) as a, \
        h5py.File(h.path("save_plain", "ckpt", "step00000010.h5")) as b:
    worst, names = 0.0, []
    a["optimizer"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    for n in names:
        x, y = a["optimizer"][n][:], b["optimizer"][n][:]
        scale = max(float(np.abs(y).max()), 1e-30)
        worst = max(worst, float(np.abs(x - y).max()) / scale)
    h.check(len(names) > 40 and worst < 1e-3,
            f"sharded save on (2,2,2): {len(names)} moment datasets match the unsharded save "
            f"(max difference {worst:.1e} of each dataset's largest value)")
for src, dst, grid, extra in [("save_sharded", "resume_one", (1, 1, 1), []),
                              ("save_one", "resume_sharded", (2, 2, 2), [SHARD])]:
    train(dst, *grid, *extra, f"--checkpoint.resume={src}/ckpt/step00000010.h5")
    compare(dst, "l111", first=10)

# Recompute: bit for bit, with capacity drops, router biases and Engram counters in play.
RC = ["--moe.capacity_factor=1.0", "--moe.bias_update_rate=0.01", "--train.max_steps=6",
      "--output.dump_step=1,6"]
for pp, dp, ep, extra in [(1, 1, 1, []), (1, 1, 2, []), (2, 1, 1, []),
                          (2, 1, 1, ["--parallel.schedule=gpipe"]),
                          (1, 1, 2, ["--train.precision=bf16"])]:
    tag = f"{pp}{dp}{ep}" + "".join("_" + e.split("=")[1] for e in extra)
    train(f"rc_off{tag}", pp, dp, ep, *RC, *extra)
    train(f"rc_on{tag}", pp, dp, ep, *RC, *extra, "--train.recompute=block")
    a, b = h.metrics(f"rc_off{tag}"), h.metrics(f"rc_on{tag}")
    skip = {"tokens_per_s", "tokens_per_s_per_rank", "model_flops_per_s", "mfu", "step_time_s",
            "mem_hwm_mib", "comm_s"}
    same = len(a) == len(b) == 6 and all(
        x[k] == y[k] for x, y in zip(a, b) for k in x if k not in skip)
    cols = [k for k in a[0] if k.startswith(("moe", "engram"))]
    h.check(same and len(cols) >= 8,
            f"recompute on {tag}: losses, norms and {len(cols)} MoE/Engram columns identical")
    for step in (1, 6):
        with h5py.File(h.path(f"rc_off{tag}", f"dump_step{step}.h5")) as x, \
                h5py.File(h.path(f"rc_on{tag}", f"dump_step{step}.h5")) as y:
            names = []
            x["grad"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset)
                                 else None)
            diff = [n for n in names if not np.array_equal(x["grad"][n][:], y["grad"][n][:])]
            routes = all(np.array_equal(x["route"][r][:], y["route"][r][:]) for r in x["route"])
            h.check(len(names) > 40 and not diff and routes,
                    f"recompute on {tag}, step {step}: {len(names)} gradients and the routes "
                    f"bit-identical ({diff[:3]} differ)")
    mem_off = max(float(r["mem_hwm_mib"]) for r in a)
    mem_on = max(float(r["mem_hwm_mib"]) for r in b)
    print(f"     memory per rank {tag}: {mem_off:.0f} MiB without recompute, {mem_on:.0f} with")

# kmoe-eval on any launch: the (2,2,2) checkpoint on 1, 3 and 4 ranks with the deck's grid,
# (1,1,1), left to the launch; an explicit grid that does not match the launch stays an error.
val = h.metrics("save_sharded")[-1]["val_loss"]
for ranks in (1, 3, 4):
    p = h.run(["kmoe-eval", "-i", "grid.deck", "--checkpoint", "save_sharded/ckpt/step00000010.h5"],
              ranks=ranks)
    got = p.stdout.split()[-3] if "eval_loss" in p.stdout else "nan"
    note = [line for line in p.stdout.splitlines() if line.startswith("note: the deck's grid")]
    h.check(rel(got, val) <= 1e-6 and (ranks == 1) == (not note),
            f"kmoe-eval on {ranks} rank(s): {got} vs the trainer's {val}; "
            f"{note[0][6:120] if note else 'the deck grid'}")
p = h.run(["kmoe-eval", "-i", "grid.deck", "--checkpoint", "save_sharded/ckpt/step00000010.h5",
           "--parallel.ep=2"], expect_rc=1)
h.check("2 ranks" in p.stderr and "launched on 1" in p.stderr,
        f"kmoe-eval with an explicit grid unlike the launch: {p.stderr.strip()[:120]}")

# Bad values name the key.
for key, value in [("optimizer.shard", "all"), ("train.recompute", "full")]:
    p = train(f"bad_{value}", 1, 1, 1, f"--{key}={value}", expect_rc=1)
    h.check(key in p.stderr and value in p.stderr, f"--{key}={value}: {p.stderr.strip()[:150]}")
h.finish()
