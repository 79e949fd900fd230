#!/usr/bin/python3
"""Host synchronizations per training step (docs/ARCHITECTURE.md "Host synchronizations"), on
one rank (pp = dp = ep = 1), counted by the Kokkos Tools counter (kokkos_counter.cpp): the
waits kmoe names (core/device_sync.hpp, reported on every backend) and, where Kokkos reports
them (Kokkos >= 4), every fence.

- A dense model, and one with an Engram layer: the same number of waits per step with twice
  the micro-batches and with twice the layers.
- An MoE model with grouped expert GEMMs (moe.expert_gemm = grouped): the
  same number of waits per step with twice the micro-batches and with twice the MoE layers.
- With per-expert GEMMs (the CPU default): exactly 1 more per MoE layer and micro-batch (the
  expert row offsets that size the vendor GEMMs on the host) and nothing else.
- With the Engram table in host memory (engram.offload = host): exactly 1 more per Engram layer
  and micro-batch (the row gradients read back; 2 where the row copies go on a side stream of
  the device, which the lookup waits for) and nothing else, and no allocation after step 1.
Usage: check_host_syncs.py BIN_DIR WORK_DIR COUNTER_LIB
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kmoe_testlib import Harness, counting_documents  # noqa: E402
from counting import SMALL_DECK, counted_run  # noqa: E402

h = Harness(sys.argv[1], sys.argv[2])
lib = sys.argv[3]
h.prepare_corpus(counting_documents(400))
h.write("small.deck", SMALL_DECK)
ENGRAM = ["--engram.layers=1", "--engram.heads=2", "--engram.embed_per_ngram=16"]
MOE = ["--moe.experts=4", "--moe.top_k=2", "--moe.expert_hidden=32"]


def per_step(name, *overrides):
    """The counts of step 2 (step 1 also sizes buffers); step 3's must agree."""
    rows = counted_run(h, lib, name, *overrides)
    s2, s3 = rows[1], rows[2]
    h.check((s2["kmoe_syncs"], s2["fences"]) == (s3["kmoe_syncs"], s3["fences"]),
            f"{name}: steps 2 and 3 wait alike ({s2['kmoe_syncs']} named, {s2['fences']} fences)")
    return s2


engram_waits, engram_rows = {}, {}
for label, extra in (("dense", []), ("engram", ENGRAM)):
    base = per_step(label, *extra)
    engram_waits[label] = base["kmoe_syncs"]
    engram_rows[label] = base
    h.check(base["kmoe_syncs"] > 0, f"{label}: the step's waits are seen ({base['kmoe_syncs']})")
    for variant, more in (("micro", ["--train.global_batch=8"]), ("layers", ["--model.n_layers=4"])):
        r = per_step(f"{label}_{variant}", *extra, *more)
        engram_waits[f"{label}_{variant}"] = r["kmoe_syncs"]
        engram_rows[f"{label}_{variant}"] = r
        h.check(r["kmoe_syncs"] == base["kmoe_syncs"] and r["fences"] == base["fences"],
                f"{label}, twice the {variant}: {base['kmoe_syncs']} -> {r['kmoe_syncs']} named "
                f"waits, {base['fences']} -> {r['fences']} fences per step")

# Engram tables in host memory: + 1 per Engram layer and micro-batch (+ 2 where the device has
# a side stream for the copies), no allocation after step 1.
for name, micro, layers, more in (("engram", 2, 1, []),
                                  ("engram_micro", 4, 1, ["--train.global_batch=8"])):
    rows = counted_run(h, lib, name + "_offload", *ENGRAM, "--engram.offload=host", *more)
    ref = engram_rows.get(name)
    if not rows or ref is None:
        continue
    # A build whose device memory is not host memory reports copies from the host (the token
    # ids); there the row copies go on a side stream and the lookup waits for them.
    device = ref["copies_from_host"] > 0
    per = 2 if device else 1
    got, want = rows[1]["kmoe_syncs"], engram_waits[name] + per * layers * micro
    h.check(got == want and rows[2]["kmoe_syncs"] == got,
            f"{name}, tables in host memory: {got} named waits = {engram_waits[name]} + {per} x "
            f"{layers} Engram layer x {micro} micro-batches")
    h.check(all(r["allocations"] == 0 for r in rows[1:]),
            f"{name}, tables in host memory: no allocation after step 1 "
            f"({[r['allocations'] for r in rows]})")
    # Per Engram layer and micro-batch, 2 more copies from the host (rows, slots) and 1 more
    # to it (the row gradients).
    if not device:
        h.skip(f"{name}, tables in host memory: copies by direction",
               "this build's device memory is host memory (no copies from the host reported)")
    else:
        d_from = rows[1]["copies_from_host"] - ref["copies_from_host"]
        d_to = rows[1]["copies_to_host"] - ref["copies_to_host"]
        h.check((d_from, d_to) == (2 * layers * micro, layers * micro),
                f"{name}, tables in host memory: {d_from} more copies from the host, {d_to} "
                f"more to it per step (want {2 * layers * micro}, {layers * micro})")

# MoE, grouped: no growth; per expert: 1 per MoE layer per micro-batch on top of grouped.
for name, micro, layers, more in (("moe", 2, 2, []), ("moe_micro", 4, 2, ["--train.global_batch=8"]),
                                  ("moe_layers", 2, 4, ["--model.n_layers=4"])):
    g = per_step(name, *MOE, "--moe.expert_gemm=grouped", *more)
    if name == "moe":
        base = g
    else:
        h.check(g["kmoe_syncs"] == base["kmoe_syncs"] and g["fences"] == base["fences"],
                f"{name}, grouped: {base['kmoe_syncs']} -> {g['kmoe_syncs']} named waits, "
                f"{base['fences']} -> {g['fences']} fences per step")
    r = per_step(name + "_per_expert", *MOE, "--moe.expert_gemm=per_expert", *more)
    want = g["kmoe_syncs"] + layers * micro
    h.check(r["kmoe_syncs"] == want,
            f"{name}, per expert: {r['kmoe_syncs']} named waits = grouped {g['kmoe_syncs']} + "
            f"{layers} MoE layers x {micro} micro-batches")
h.finish()
