#!/usr/bin/python3
"""Tokenizers of kmoe-prep and kmoe-generate (RUNTIME.md section 3, data.tokenizer).

1. --train-sentencepiece on a corpus with UTF-8 text, bytes that are not UTF-8 and runs of
   spaces, in a directory whose name has a space: text -> ids -> text (--decode) gives every
   document back byte for byte; --sentencepiece with the trained model gives the same ids; the
   byte-level tokenizer's --decode gives the documents back too.
2. A model trained on the SentencePiece ids (data.tokenizer = sentencepiece): kmoe-generate
   encodes a text prompt with the model and prints decoded text that starts with the prompt.
3. Bad input: a missing or corrupt model file, both tokenizer options, a deck without
   data.tokenizer_model or data.eod_id, or a data.tokenizer_model that is missing or not a model
   (kmoe-train refuses it before training): errors naming the file or key.
Usage: tokenizer.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness  # noqa: E402

bin_dir, work, mpiexec = sys.argv[1:4]
h = Harness(bin_dir, work, mpiexec)

# Documents as kmoe-prep splits them: lines ending in '\n', separated by lines holding '%'.
docs = [b"Hello world, caf\xc3\xa9 \xe2\x82\xac 12345.\nsecond line\n",
        b"bad bytes \xff\xfe here, a cut character \xc3 and an overlong \xc0\xaf end\n",
        "\u65e5\u672c\u8a9e text   three spaces, a tab\there\n".encode(),
        b"\xe2\x96\x81 is SentencePiece's space sign, written in the text\n"]
docs += [f"number {i} is {'odd' if i % 2 else 'even'}, and {i} + 1 = {i + 1}.\n".encode()
         for i in range(600)]
corpus = b"".join(d + b"%\n" for d in docs)
os.makedirs(h.path("in dir"), exist_ok=True)
with open(h.path("in dir", "corpus.txt"), "wb") as f:
    f.write(corpus)
src = os.path.join("in dir", "corpus.txt")



def decoded(*args):
    """kmoe-prep --decode's standard output as bytes (the text need not be UTF-8)."""
    p = subprocess.run([os.path.join(bin_dir, "kmoe-prep"), "--decode", *args], cwd=h.work,
                       capture_output=True, timeout=300)
    h.check(p.returncode == 0, f"kmoe-prep --decode {' '.join(args)} exits 0: {p.stderr[-300:]}")
    return p.stdout


# 1. Round trips.
p = h.run(["kmoe-prep", "--out-dir", "sp out", "--separator", "%", "--val-every", "0",
           "--train-sentencepiece", "500", src])
model = os.path.join("sp out", "sentencepiece.model")
m = re.search(r"vocab_size (\d+) \(model.vocab_size\)", p.stdout)
e = re.search(r"eod_id = (\d+)", p.stdout)
h.check(m is not None and e is not None and os.path.exists(h.path(model)),
        f"--train-sentencepiece: a model, the deck lines: {p.stdout.strip()[-300:]!r}")
vocab, eod = int(m.group(1)), int(e.group(1))
ids = np.fromfile(h.path("sp out", "train.bin"), dtype="<u2")
h.check(len(ids) < 0.9 * len(corpus) and int(ids.max()) < vocab and
        int((ids == eod).sum()) == len(docs),
        f"{len(ids)} ids for {len(corpus)} bytes, all below {vocab}, {len(docs)} documents ended")
h.check(decoded(os.path.join("sp out", "train.bin"), "--sentencepiece", model) == corpus,
        "SentencePiece text -> ids -> text: every document byte for byte")
h.run(["kmoe-prep", "--out-dir", "sp again", "--separator", "%", "--val-every", "0",
       "--sentencepiece", model, src])
again = np.fromfile(h.path("sp again", "train.bin"), dtype="<u2")
h.check(np.array_equal(ids, again), "--sentencepiece with the trained model: the same ids")
h.run(["kmoe-prep", "--out-dir", "bytes", "--separator", "%", "--val-every", "0", src])
h.check(decoded(os.path.join("bytes", "train.bin")) == corpus,
        "byte-level text -> ids -> text: every document byte for byte")

# 2. Training on SentencePiece ids and generating from a text prompt.
deck = f"""
[model]
vocab_size = {vocab}
d_model = 64
n_layers = 2
n_heads = 4
ffn_hidden = 96
[train]
seq_len = 64
global_batch = 4
micro_batch = 2
max_steps = 40
document_mask = true
[optimizer]
lr = 3e-3
[data]
paths = sp out/train.bin
tokenizer = sentencepiece
tokenizer_model = {model}
eod_id = {eod}
[checkpoint]
resume = none
dir = sp_run/ck
[output]
dir = sp_run
"""
h.write("sp.deck", deck)
h.run(["kmoe-train", "-i", "sp.deck"])
p = h.run(["kmoe-generate", "--checkpoint", "sp_run/ck/step00000040.h5", "--prompt", "number 4",
           "--max-new-tokens", "12"])
sample = re.search(r"^sample 0 \([^)]*\):\n(.*)", p.stdout, re.M)
h.check(sample is not None and sample.group(1).startswith("number 4") and
        len(sample.group(1)) > len("number 4"),
        f"kmoe-generate with the SentencePiece model: {sample.group(1) if sample else p.stdout!r}")

# 3. Bad input.
with open(h.path("corrupt.model"), "wb") as f:
    f.write(b"\x00\x01 this is not a model" * 10)


def refused(args, words, what):
    p = h.run(args, expect_rc=1)
    h.check(all(w in p.stderr for w in words), f"{what}: {p.stderr.strip()[-200:]}")


refused(["kmoe-prep", "--out-dir", "x", "--sentencepiece", "missing.model", src],
        ["missing.model", "cannot open"], "a missing model")
refused(["kmoe-prep", "--out-dir", "x", "--sentencepiece", "corrupt.model", src],
        ["corrupt.model", "not a SentencePiece model"], "a corrupt model")
refused(["kmoe-prep", "--decode", "bytes/train.bin", "--sentencepiece", "corrupt.model"],
        ["corrupt.model"], "--decode with a corrupt model")
refused(["kmoe-prep", "--out-dir", "x", "--sentencepiece", model, "--train-sentencepiece", "500",
         src], ["not both"], "both tokenizer options")
refused(["kmoe-train", "-i", "sp.deck", "--data.tokenizer_model="], ["data.tokenizer_model"],
        "sentencepiece without a model")
refused(["kmoe-train", "-i", "sp.deck", "--data.eod_id=-1"], ["data.eod_id"],
        "sentencepiece without an end-of-document id")
# The model the checkpoints would name must load before anything trains.
for bad, words in [("missing.model", ["data.tokenizer_model = missing.model", "cannot open"]),
                   ("corrupt.model", ["data.tokenizer_model = corrupt.model",
                                      "not a SentencePiece model"])]:
    refused(["kmoe-train", "-i", "sp.deck", f"--data.tokenizer_model={bad}",
             "--checkpoint.dir=sp_bad/ck", "--output.dir=sp_bad", "--checkpoint.overwrite=true"],
            words, f"training with data.tokenizer_model = {bad}")
    h.check(not os.path.exists(h.path("sp_bad", "ck", "latest")), f"{bad}: no checkpoint written")
h.finish()
