#!/usr/bin/python3
"""The Kokkos Tools counter (kokkos_counter.cpp) on real training steps: it loads into
kmoe-train, writes one row per optimizer step (the "kmoe::step" region), sees the step's
kernel launches, deep copies and allocations, counts the same work the same way step after
step, and grows with the micro-batches of a step and the layers of the model; no step after
the first allocates memory, an MoE with many unevenly loaded experts included. Which fences a build reports
depends on Kokkos (none on Kokkos 3.4 Serial): where the build reports some, steps 2 and 3 must
report the same number; where it reports none, the fence check is reported skipped.
Usage: check_counter.py BIN_DIR WORK_DIR COUNTER_LIB
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kmoe_testlib import Harness, counting_documents  # noqa: E402
from counting import SMALL_DECK, counted_run  # noqa: E402

h = Harness(sys.argv[1], sys.argv[2])
lib = sys.argv[3]

# Every callback the counter defines is exported: a missing kokkosp_request_tool_settings leaves
# Kokkos fencing around every kernel (the counts would be the tool's own), a missing
# kokkosp_begin_deep_copy counts no copies (both seen with an nvcc build).
so = ctypes.CDLL(lib)
callbacks = ["init_library", "finalize_library", "request_tool_settings", "begin_parallel_for",
             "end_parallel_for", "begin_parallel_reduce", "end_parallel_reduce",
             "begin_parallel_scan", "end_parallel_scan", "begin_fence", "end_fence",
             "begin_deep_copy", "end_deep_copy", "profile_event", "push_profile_region",
             "pop_profile_region", "allocate_data", "deallocate_data"]
missing = [c for c in callbacks if not hasattr(so, "kokkosp_" + c)]
h.check(not missing, f"the counter exports its {len(callbacks)} callbacks (missing: {missing})")
h.prepare_corpus(counting_documents(400))
h.write("small.deck", SMALL_DECK + """
[moe]
experts = 4
top_k = 2
expert_hidden = 32
""")


def counts(name, *overrides):
    return counted_run(h, lib, name, *overrides)


base = counts("base")
micro = counts("micro", "--train.global_batch=8")
layers = counts("layers", "--model.n_layers=4")
if base and micro and layers:
    h.check(len(base) == 3 and [r["step"] for r in base] == [1, 2, 3], "one row per step")
    h.check(all(r["kernels"] > 50 for r in base), f"kernel launches seen: {base[1]['kernels']}")
    h.check(all(r["deep_copies"] > 0 for r in base), f"deep copies seen: {base[1]['deep_copies']}")
    h.check(base[1] == base[2] or abs(base[1]["kernels"] - base[2]["kernels"]) <= 4,
            f"steps 2 and 3 alike: {base[1]} / {base[2]}")
    # Micro-batches run the whole forward and backward again; layers add their kernels.
    h.check(micro[1]["kernels"] > 1.6 * base[1]["kernels"],
            f"twice the micro-batches: {base[1]['kernels']} -> {micro[1]['kernels']} launches")
    h.check(layers[1]["kernels"] > 1.3 * base[1]["kernels"],
            f"twice the layers: {base[1]['kernels']} -> {layers[1]['kernels']} launches")
    h.check(all(r["allocations"] > 0 for r in base[:1]) and
            all(r["allocations"] == 0 for r in base[1:] + micro[1:] + layers[1:]),
            f"allocations seen in step 1 ({base[0]['allocations']}), none from step 2 on")
    if any(r["fences"] > 0 for r in base + micro + layers):
        h.check(base[1]["fences"] == base[2]["fences"],
                f"fences alike at steps 2 and 3: {base[1]['fences']} / {base[2]['fences']}")
    else:
        h.skip("fence counts", "this Kokkos reports no fences to Kokkos Tools (Kokkos 3.4)")
# bf16 operands rounded where they are produced (the event "kmoe::rounded <n>" of gemm.cpp
# counts the fp32 elements products still round at their entry). With the fused attention core
# (no products inside it), a dense model and the reordered norm (the default) every operand of
# a product is written as bf16 by the kernel that makes it: the block input by the embedding and
# the previous block's final norm, the MLP's input by the norm forward, d up by the SwiGLU
# backward, d(q|k|v) by the attention backward, the MLP's dy and the attention's d out by the
# norm backwards, the head's normed input by its norm and d logits by the loss kernel. So
# nothing is rounded at a product's entry; were one rounded again, the count would grow by at
# least N x D per micro-batch of N rows.
dense_runs = []
# The same with the tiled core (its softmax backward writes dS, the split of the output
# projection's gradient dO as bf16), with a block's recompute (its own forward rounds its input
# again, outside any product) and with pre-norm blocks (their attention norm writes the
# attention's input).
for name, extra in (("bf16", ("--train.attention=fused",)),
                    ("bf16_tiled", ("--train.attention=tiled",)),
                    ("bf16_recompute", ("--train.attention=fused", "--train.recompute=block")),
                    ("bf16_pre", ("--train.attention=fused", "--model.block_norm=pre"))):
    rows = counts(name, "--train.precision=bf16", "--moe.experts=0", *extra)
    if rows:
        h.check(all(r["rounded_elements"] == 0 for r in rows),
                f"{name}: 0 fp32 elements rounded at products' entry per step (every operand "
                f"written as bf16 by its kernel): {[r['rounded_elements'] for r in rows]}")
        dense_runs.append((name, rows))
# The count's own check: the MoE layers still hand their products fp32 operands (the shared
# expert reads the layer input, the experts' backward the output gradient), the same every step.
moe = counts("bf16_moe", "--train.precision=bf16", "--train.attention=fused")
if moe:
    h.check(len({r["rounded_elements"] for r in moe}) == 1 and moe[0]["rounded_elements"] > 0,
            f"bf16 with MoE layers: their fp32 operands counted, alike every step: "
            f"{[r['rounded_elements'] for r in moe]}")
if base:
    h.check(all(r["rounded_elements"] == 0 for r in base),
            f"fp32: nothing rounded: {[r['rounded_elements'] for r in base]}")

# No kernel of a dense step runs on one thread (a launch on a single index: the event
# "kmoe::one_thread" of core/kokkos_types.hpp's ranges), in fp32 and in the bf16 runs above; the
# MoE deck's layers still have such kernels (their auxiliary-loss sums; the MoE issue's work),
# which is the count's own check.
def one_thread_names(name):
    path = h.path(name + ".csv.one_thread")
    return open(path).read().splitlines() if os.path.exists(path) else []


dense = counts("dense", "--moe.experts=0")
if dense:
    dense_runs.append(("dense", dense))
for name, rows in dense_runs:
    h.check(all(r["one_thread_kernels"] == 0 for r in rows),
            f"{name}: no one-thread kernel in a dense step: "
            f"{[r['one_thread_kernels'] for r in rows]} {one_thread_names(name)}")
if base:
    h.check(all(r["one_thread_kernels"] > 0 for r in base),
            f"MoE deck: its one-thread kernels counted: {[r['one_thread_kernels'] for r in base]} "
            f"{one_thread_names('base')}")

# Many experts and uneven routing (a router that has not learned to balance): the per-expert
# buffers are sized for the most rows an expert can take, so no step after the first allocates.
routed = counts("routed", "--moe.experts=32", "--moe.top_k=1", "--moe.expert_hidden=512",
                "--moe.lb_coef=0", "--train.max_steps=6", "--optimizer.lr=3e-2")
if routed:
    h.check(all(r["allocations"] == 0 for r in routed[1:]),
            "32 experts, top-1, unbalanced: no allocation after step 1: " +
            str([r["allocations"] for r in routed]))
h.finish()
