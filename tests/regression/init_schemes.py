#!/usr/bin/python3
"""Initialization schemes (MODEL.md section 7) through the real binaries, on RUNTIME.md section
2's grid deck (MoE with a shared expert after a dense block, Engram at blocks 1 and 2):

1. model.init = fan_in with model.init_depth_scale and model.embed_init_std: the step-0
   checkpoint (checkpoint.save_initial) holds the same weights, bit for bit, on (1,1,1),
   (1,2,2) and (2,1,2), and a second run on (1,1,1) writes them again; its tensors differ from
   the default scheme's (the keys take effect), and their stds follow the formulas.
2. Bad input: an unknown scheme and non-positive stds (model.init_std, model.embed_init_std,
   engram.init_std) are errors naming the key.
Usage: init_schemes.py BIN_DIR WORK_DIR MPIEXEC
"""
import math
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import grid_harness, grid_train  # noqa: E402

h = grid_harness(sys.argv)
SCHEME = ["--model.init=fan_in", "--model.init_depth_scale=true", "--model.embed_init_std=1.0"]
INITIAL = ["--checkpoint.save_initial=true", "--train.max_steps=1", "--train.eval_every=0"]


def weights(name):
    out = {}
    with h5py.File(h.path(name, "ckpt", "step00000000.h5")) as f:
        f["model"].visititems(lambda n, o: out.__setitem__(n, o[:]) if isinstance(o, h5py.Dataset)
                              else None)
    return out


for name, grid in [("l111", (1, 1, 1)), ("l122", (1, 2, 2)), ("l212", (2, 1, 2)),
                   ("again", (1, 1, 1))]:
    grid_train(h, name, *grid, *SCHEME, *INITIAL)
base = weights("l111")
for name in ("l122", "l212", "again"):
    w = weights(name)
    same = sorted(w) == sorted(base) and all(np.array_equal(w[n], base[n]) for n in base)
    h.check(same and len(base) > 40, f"fan_in init on {name}: {len(w)} tensors bit-identical "
            "to (1,1,1)'s")
grid_train(h, "default", 1, 1, 1, *INITIAL)
plain = weights("default")
changed = [n for n in base if not np.array_equal(base[n], plain[n])]
h.check(len(changed) > 30, f"the scheme changes {len(changed)} tensors of the default's")
# The stds: embedding 1.0; attention wq 1/sqrt(64); wo 1/sqrt(64) / sqrt(2 * 4); an expert's w2
# 1/sqrt(32) / sqrt(8) (truncated at 3 std: the sample std is 0.98658 of it).
for path, want in [("embed/weight", 1.0), ("blocks/0/attn/wq", 1 / 8),
                   ("blocks/0/attn/wo", 1 / 8 / math.sqrt(8)),
                   ("blocks/1/moe/experts/w2", 1 / math.sqrt(32) / math.sqrt(8))]:
    got = float(base["/".join(path.split("/"))].std()) / 0.98658
    h.check(abs(got / want - 1) < 0.05, f"{path}: std {got:.4f}, formula {want:.4f}")

for key, value in [("model.init", "xavier"), ("model.init_std", "0"),
                   ("model.embed_init_std", "-1"), ("engram.init_std", "0")]:
    p = grid_train(h, f"bad_{key}", 1, 1, 1, f"--{key}={value}", expect_rc=1)
    h.check(key in p.stderr and value in p.stderr, f"--{key}={value}: {p.stderr.strip()[:160]}")
h.finish()
