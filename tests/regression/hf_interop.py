#!/usr/bin/python3
"""Hugging Face interop through the real binaries (docs/INTEROP.md).

1. Four small models trained 3 steps, one per target type: dense reordered with GQA (olmo2),
   dense pre-norm without QK-norm and with tied embeddings (llama), MoE reordered (flex_olmo),
   MoE pre-norm with normalized top-k and tied embeddings (olmoe). Each is exported (fp32) and
   imported back: every tensor bit-identical, kmoe-eval's loss on the imported checkpoint equal
   to the original's bit for bit, and tests/reference/hf_reference.py (an independent float64
   reading of config.json and the safetensors files under Hugging Face's semantics) within
   1e-5 of kmoe-eval's loss on the same validation instances, and kmoe-generate's logits at
   every position of a generated sequence within 1e-5 of the reading's. The imported MoE deck
   trains on two expert-parallel ranks from the imported weights.
2. A sharded export (--max-shard-size below the model's size): several shards and the index,
   the reference reads them, and the import from them is bit-identical too. A bf16 export holds
   each value rounded to bf16 (imported back: exactly the rounded values).
3. Bad input, each an error naming the feature, key, file or tensor: exporting Engram, shared
   experts, sigmoid scores, a router bias, a dense block in an MoE model, pre-norm with QK-norm;
   an existing export without --overwrite; exporting a NaN or Inf weight (no directory left);
   importing a NaN weight (no checkpoint or temporary left); importing rope scaling, a sliding window, biases,
   another model type, another activation; config.json values kmoe's deck refuses (a negative
   vocab_size, num_experts_per_tok above num_experts, an eos_token_id outside the vocabulary or
   not an id, a negative max_position_embeddings), named by their config.json key; safetensors files with a header length past the end,
   overlapping or out-of-range offsets, a shape that does not fit its bytes, a tensor of another
   shape than config.json's, an extra tensor, a missing shard.
Usage: hf_interop.py BIN_DIR WORK_DIR MPIEXEC SOURCE_DIR
"""
import json
import os
import shutil
import struct
import sys
import traceback

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness, counting_documents, rel  # noqa: E402

bin_dir, work, mpiexec, source = sys.argv[1:5]
h = Harness(bin_dir, work, mpiexec)
# The independent reading (tests/reference/hf_reference.py), in this process: torch is
# imported once for its ten readings.
sys.path.insert(0, os.path.join(source, "tests", "reference"))
import hf_reference  # noqa: E402
T, EVAL = 32, 6

h.prepare_corpus(counting_documents(1500))
h.write("base.deck", f"""
[model]
vocab_size = 320
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 96
[train]
seq_len = {T}
global_batch = 4
micro_batch = 2
max_steps = 3
eval_every = 0
eval_instances = {EVAL}
[optimizer]
lr = 3e-3
[data]
paths = data/train.bin
val_paths = data/val.bin
[checkpoint]
resume = none
""")
MOE = ["--moe.experts=4", "--moe.top_k=2", "--moe.expert_hidden=48"]
MODELS = {
    "olmo2": [],
    "llama": ["--model.block_norm=pre", "--model.qk_norm=false", "--model.tie_embeddings=true"],
    "flex_olmo": MOE,
    "olmoe": MOE + ["--model.block_norm=pre", "--moe.normalize_topk=true",
                    "--model.tie_embeddings=true", "--model.n_kv_heads=4"],
}


def train(name, *extra, steps=3):
    h.run(["kmoe-train", "-i", "base.deck", f"--output.dir={name}", f"--checkpoint.dir={name}/ck",
           f"--train.max_steps={steps}", *extra])
    return f"{name}/ck/step{steps:08d}.h5"


def model_tensors(path):
    with h5py.File(h.path(path)) as f:
        out = {}
        f["model"].visititems(lambda n, o: out.__setitem__(n, o[:]) if isinstance(o, h5py.Dataset)
                              else None)
        return out


def eval_loss(deck, ckpt, *extra):
    p = h.run(["kmoe-eval", "-i", deck, "--checkpoint", ckpt, *extra])
    return p.stdout.split()[-3] if "eval_loss" in p.stdout else "nan"


def reference_loss(model_dir):
    """The independent reading's loss on the first EVAL validation sequences ("nan" if it
    fails: the checks that use it fail, the others still run)."""
    try:
        return repr(hf_reference.hf_loss(h.path(model_dir), h.path("data/val.bin"), T, EVAL)[0])
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return "nan"


# 1. Round trips and the independent reading, one model per type.
for arch, extra in MODELS.items():
    ckpt = train(arch, *extra)
    p = h.run(["kmoe-export", ckpt, f"{arch}_hf"])
    with open(h.path(f"{arch}_hf", "config.json")) as f:
        config = json.load(f)
    h.check(config["model_type"] == arch and f"as {arch}" in p.stdout,
            f"{arch}: exported as model_type {config['model_type']}")
    h.run(["kmoe-import", f"{arch}_hf", "--deck", f"{arch}_in.deck", "--checkpoint",
           f"{arch}_in.h5", "--data.paths=data/train.bin", "--data.val_paths=data/val.bin",
           f"--train.eval_instances={EVAL}", "--train.micro_batch=2"])  # evaluated alike
    a, b = model_tensors(ckpt), model_tensors(f"{arch}_in.h5")
    same = sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)
    h.check(same and len(a) >= 9, f"{arch}: kmoe -> HF -> kmoe, {len(a)} tensors bit-identical")
    mine = eval_loss(f"{arch}/deck.resolved", ckpt)
    again = eval_loss(f"{arch}_in.deck", f"{arch}_in.h5")
    h.check(mine == again, f"{arch}: kmoe-eval on the imported checkpoint {again} == {mine}")
    ref = reference_loss(f"{arch}_hf")
    h.check(rel(ref, mine) <= 1e-5, f"{arch}: the Hugging Face reading of the export {ref} vs "
            f"kmoe-eval {mine} ({rel(ref, mine):.1e}, tolerance 1e-5)")
    # Logits at every position of a generated sequence: kmoe-generate's against the reading.
    h.run(["kmoe-generate", "--checkpoint", ckpt, "--prompt", "number 12 is", "--max-new-tokens",
           "16", "--dump-logits", f"{arch}_gen"])
    mine_l = np.load(h.path(f"{arch}_gen.logits.npy")).astype(np.float64)
    ref_l = hf_reference.hf_logits(h.path(f"{arch}_hf"), h.path(f"{arch}_gen.ids.npy"))
    worst = float(np.abs(mine_l - ref_l).max() / max(np.abs(ref_l).max(), 1.0))
    h.check(mine_l.shape == ref_l.shape and worst <= 1e-5,
            f"{arch}: kmoe-generate's logits at {len(ref_l)} positions vs the reading of the "
            f"export: {worst:.1e} of the largest (tolerance 1e-5)")

# The imported deck trains on another layout, from the imported weights (step 0 resumed): two
# expert-parallel ranks.
p = h.run(["kmoe-train", "-i", "flex_olmo_in.deck", "--parallel.ep=2", "--train.max_steps=2",
           "--train.global_batch=4", "--output.dir=continued", "--checkpoint.dir=continued/ck",
           "--checkpoint.every=0"], ranks=2)
rows = h.metrics("continued")
h.check("resuming from flex_olmo_in.h5 after step 0" in p.stdout and len(rows) == 2 and
        all(float(r["loss"]) < 5.6 for r in rows),  # a fresh model starts at ln 320 = 5.77
        f"the imported flex_olmo trains on (1,1,2) from its weights: losses "
        f"{[r['loss'][:6] for r in rows]}")

# 2. Shards and bf16.
p = h.run(["kmoe-export", "flex_olmo/ck/step00000003.h5", "sharded_hf", "--max-shard-size", "0.1"])
with open(h.path("sharded_hf", "model.safetensors.index.json")) as f:
    index = json.load(f)
files = sorted(set(index["weight_map"].values()))
h.check(len(files) >= 3 and not os.path.exists(h.path("sharded_hf", "model.safetensors")) and
        all(os.path.getsize(h.path("sharded_hf", n)) < 0.1 * 2**20 + 60000 for n in files),
        f"sharded export: {len(files)} shards, {len(index['weight_map'])} tensors in the index")
h.check(rel(reference_loss("sharded_hf"), reference_loss("flex_olmo_hf")) == 0,
        "sharded export: the reference reads the same model")
h.run(["kmoe-import", "sharded_hf", "--deck", "sharded_in.deck", "--checkpoint", "sharded_in.h5"])
a, b = model_tensors("flex_olmo/ck/step00000003.h5"), model_tensors("sharded_in.h5")
h.check(all(np.array_equal(a[n], b[n]) for n in a), "sharded export: imported bit-identical")
h.run(["kmoe-export", "olmo2/ck/step00000003.h5", "bf16_hf", "--dtype", "bf16"])
with open(h.path("bf16_hf", "config.json")) as f:
    dtype = json.load(f)["torch_dtype"]
h.run(["kmoe-import", "bf16_hf", "--deck", "bf16_in.deck", "--checkpoint", "bf16_in.h5"])
a, b = model_tensors("olmo2/ck/step00000003.h5"), model_tensors("bf16_in.h5")


def bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16  # nearest, ties to even
    return u.astype(np.uint32).view(np.float32)


h.check(dtype == "bfloat16" and all(np.array_equal(bf16(a[n]), b[n]) for n in a) and
        any(not np.array_equal(a[n], b[n]) for n in a),
        "bf16 export: every value rounded to bf16, nearest even")

# 3. Bad input.
def refused(args, words, what):
    p = h.run(args, expect_rc=1)
    text = p.stdout + p.stderr
    h.check(all(w in text for w in words), f"{what}: {text.strip().splitlines()[-1][:170]}")


for name, extra, words in [
        ("engram", ["--engram.layers=1", "--engram.heads=2", "--engram.embed_per_ngram=16",
                    "--engram.table_size=97,101"], ["engram.layers"]),
        ("shared", MOE + ["--moe.shared_experts=1", "--moe.shared_hidden=16"],
         ["moe.shared_experts"]),
        ("sigmoid", MOE + ["--moe.score=sigmoid"], ["moe.score = sigmoid"]),
        ("bias", MOE + ["--moe.bias_update_rate=0.01"], ["moe.bias_update_rate"]),
        ("dense_block", MOE + ["--moe.dense_layers=0"], ["block 0 is dense"]),
        ("pre_qk", ["--model.block_norm=pre"], ["model.qk_norm = true", "llama"]),
        ("window", ["--model.sliding_window=8"], ["model.sliding_window = 8"])]:
    ckpt = train(f"bad_{name}", *extra, steps=1)
    refused(["kmoe-export", ckpt, f"bad_{name}_hf"], words, f"export with {name}")
refused(["kmoe-export", "olmo2/ck/step00000003.h5", "olmo2_hf"], ["--overwrite"],
        "export over an existing one")
# Non-finite weights: refused naming the dataset, row and element, before OUT_DIR exists.
for name, dataset, index, value in [("nan_norm", "model/final_norm/weight", 3, np.nan),
                                    ("inf_embed", "model/embed/weight", (5, 2), np.inf)]:
    shutil.copy(h.path("olmo2", "ck", "step00000003.h5"), h.path(f"{name}.h5"))
    with h5py.File(h.path(f"{name}.h5"), "r+") as f:
        a = f[dataset][()]
        a[index] = value
        f[dataset][...] = a
    row, element = (index, 0) if isinstance(index, int) else index  # a vector: one per row
    refused(["kmoe-export", f"{name}.h5", f"{name}_hf"],
            [f"/{dataset} holds {'nan' if np.isnan(value) else 'inf'} at row {row}, "
             f"element {element}", "refusing to export"], f"export of a {name} checkpoint")
    h.check(not os.path.exists(h.path(f"{name}_hf")), f"{name}: no export directory left")
h.run(["kmoe-export", "olmo2/ck/step00000003.h5", "olmo2_hf", "--overwrite"])


def variant(name, edit_config=None, edit_files=None, base="olmo2_hf"):
    """A copy of olmo2_hf (or base) with its config.json or files changed."""
    shutil.rmtree(h.path(name), ignore_errors=True)
    shutil.copytree(h.path(base), h.path(name))
    if edit_config:
        with open(h.path(name, "config.json")) as f:
            c = json.load(f)
        edit_config(c)
        with open(h.path(name, "config.json"), "w") as f:
            json.dump(c, f)
    if edit_files:
        edit_files(h.path(name))
    return name


def imported(name, words, what):
    refused(["kmoe-import", name, "--deck", f"{name}.deck", "--checkpoint", f"{name}.h5"], words,
            what)


for key, value, words in [("rope_scaling", {"type": "linear", "factor": 2.0}, ["rope_scaling"]),
                          ("sliding_window", 16, ["sliding_window"]),
                          ("attention_bias", True, ["attention_bias"]),
                          ("model_type", "gpt2", ["model_type = gpt2"]),
                          ("hidden_act", "gelu", ["hidden_act"])]:
    imported(variant(f"cfg_{key}", lambda c, k=key, v=value: c.__setitem__(k, v)), words,
             f"import with {key} = {value}")
# Values kmoe's deck checks refuse: the error names config.json's key, not the deck's line.
for key, value, base, words in [
        ("vocab_size", -320, "olmo2_hf", ["config.json: vocab_size gives model.vocab_size = -320"]),
        ("num_experts_per_tok", 9, "olmoe_hf",
         ["config.json: num_experts_per_tok gives moe.top_k = 9"]),
        ("eos_token_id", 5000, "olmo2_hf",
         ["config.json: eos_token_id gives data.eod_id = 5000", "outside the vocabulary"]),
        ("eos_token_id", "</s>", "olmo2_hf", ['eos_token_id = "</s>"', "expected an id"]),
        ("max_position_embeddings", -4, "olmo2_hf", ["max_position_embeddings = -4"])]:
    imported(variant(f"cfg_bad_{key}", lambda c, k=key, v=value: c.__setitem__(k, v), base=base),
             words, f"import with {key} = {value}")


def rewrite(path, header_edit=None, length=None, data=None):
    """Rewrites a safetensors file with its header (and length word, data) changed."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header, body = json.loads(blob[8:8 + n]), blob[8 + n:]
    if header_edit:
        header_edit(header)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length if length is not None else len(text)) + text +
                (data if data is not None else body))


ST = "model.safetensors"
EMB = "model.embed_tokens.weight"


def shift(header, name, delta):
    header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]


def overlap(header):  # the second tensor's range moved back into the first's
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])
    shift(header, names[1], -4)


for name, edit, words in [
        ("header_past_end", lambda d: rewrite(os.path.join(d, ST), length=10**9),
         ["header length", ST]),
        ("out_of_range", lambda d: rewrite(os.path.join(d, ST),
                                           header_edit=lambda hd: shift(hd, EMB, 10**8)),
         ["out of range", EMB]),
        ("overlapping", lambda d: rewrite(os.path.join(d, ST), header_edit=overlap),
         ["overlap", ST]),
        ("bad_shape", lambda d: rewrite(os.path.join(d, ST), header_edit=lambda hd: hd[EMB].__setitem__(
            "shape", [hd[EMB]["shape"][0], hd[EMB]["shape"][1] + 1])), ["shape", EMB]),
        ("bad_dtype", lambda d: rewrite(os.path.join(d, ST), header_edit=lambda hd: hd[EMB].__setitem__(
            "dtype", "I64")), ["dtype I64", EMB])]:
    imported(variant(f"st_{name}", edit_files=edit), words, f"import of a file with {name}")


def other_shape(d):  # a consistent file whose embedding is not config.json's
    rewrite(os.path.join(d, ST), header_edit=lambda hd: hd[EMB].__setitem__(
        "shape", [hd[EMB]["shape"][1], hd[EMB]["shape"][0]]))


imported(variant("st_other_shape", edit_files=other_shape), [EMB, "config.json makes it"],
         "import of a tensor shaped unlike config.json")


def extra_tensor(d):  # a bias appended: the data section grows by 4 bytes
    path = os.path.join(d, ST)
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    end = len(blob) - 8 - n
    rewrite(path, header_edit=lambda hd: hd.__setitem__(
        "model.layers.0.self_attn.q_proj.bias", {"dtype": "F32", "shape": [1],
                                                 "data_offsets": [end, end + 4]}),
        data=blob[8 + n:] + b"\0\0\0\0")


imported(variant("st_extra", edit_files=extra_tensor), ["q_proj.bias", "has no place"],
         "import of a directory with an extra tensor")


def nan_embedding(d):  # the embedding's element 7 a NaN: the file itself stays well formed
    path = os.path.join(d, ST)
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    (n,) = struct.unpack("<Q", blob[:8])
    at = 8 + n + json.loads(blob[8:8 + n])[EMB]["data_offsets"][0] + 7 * 4
    blob[at:at + 4] = struct.pack("<f", float("nan"))
    with open(path, "wb") as f:
        f.write(blob)


imported(variant("st_nan", edit_files=nan_embedding), [EMB, "nan at element 7", "refusing"],
         "import of a NaN weight")
h.check(not os.path.exists(h.path("st_nan.h5")) and not os.path.exists(h.path(".st_nan.h5.tmp")),
        "a refused import leaves no checkpoint and no temporary")
shutil.rmtree(h.path("missing_shard"), ignore_errors=True)
shutil.copytree(h.path("sharded_hf"), h.path("missing_shard"))
os.remove(h.path("missing_shard", files[1]))
imported("missing_shard", [files[1], "missing"], "import with a missing shard")
h.finish()
