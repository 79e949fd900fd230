"""Shared by the counter's tests: a small model deck and a training run with the Kokkos Tools
counter loaded, read back as one dict of integer counts per step."""
import csv
import os

SMALL_DECK = """
[model]
vocab_size = 320
d_model = 32
n_layers = 2
n_heads = 2
ffn_hidden = 64
[train]
seq_len = 32
global_batch = 4
micro_batch = 2
max_steps = 3
[optimizer]
lr = 1e-3
[data]
paths = data/train.bin
[checkpoint]
every = 0
"""


def counted_run(h, lib, name, *overrides, deck="small.deck"):
    """kmoe-train on `deck` with the counter (lib) loaded; the per-step rows, or None when the
    counter wrote nothing."""
    out = h.path(name + ".csv")
    env = dict(h.env, KOKKOS_TOOLS_LIBS=lib, KOKKOS_PROFILE_LIBRARY=lib, KMOE_KOKKOS_COUNTS=out)
    h.run(["kmoe-train", "-i", deck, f"--output.dir={name}", f"--checkpoint.dir={name}/ckpt",
           *overrides], env=env)
    if not h.check(os.path.exists(out), f"{name}: the counter wrote {os.path.basename(out)}"):
        return None
    with open(out) as f:
        return [{k: int(v) for k, v in row.items()} for row in csv.DictReader(f)]
