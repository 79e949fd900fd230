#!/usr/bin/python3
"""kmoe-generate through the real binaries (docs/INTEROP.md "Generation").

1. A small MoE + Engram model with GQA (trained 60 steps): on (1,1,1), (1,1,2) and (2,1,1)
   the incremental logits at every position of a sampled continuation are within 1e-5 of one
   pass over the whole sequence (--check), and the seeded sample is the same text on all three
   layouts and on a second run; another seed gives another text.
2. Greedy decoding with --check on a dense pre-norm model without QK-norm and on the MoE model
   trained with a capacity (generation routes without one, as the check's whole pass does);
   a model trained with document masking and sliding windows, prompted across a document
   boundary, on (1,1,1) and (2,1,1): the text after the boundary is the one the second
   document alone gives.
3. --dump-logits writes the first sample's ids and logits as .npy files of the right shapes;
   a --max-new-tokens past train.seq_len stops at the context of train.seq_len, with a note.
4. Bad input: --prompt when the checkpoint's ids are another tool's (data.tokenizer = external),
   an id outside the vocabulary, both prompt forms, a top-p of 0, a context too large for
   memory, a prompt that fills the context: errors naming them.
Usage: generation.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness, counting_documents  # noqa: E402

bin_dir, work, mpiexec = sys.argv[1:4]
h = Harness(bin_dir, work, mpiexec)
h.prepare_corpus(counting_documents(1500))
h.write("gen.deck", """
[model]
vocab_size = 320
d_model = 64
n_layers = 4
n_heads = 4
n_kv_heads = 2
ffn_hidden = 96
[moe]
experts = 4
top_k = 2
expert_hidden = 48
dense_layers = 0
shared_experts = 1
shared_hidden = 16
[engram]
layers = 1, 3
heads = 2
embed_per_ngram = 16
table_size = 97, 101
[train]
seq_len = 64
global_batch = 4
micro_batch = 2
max_steps = 60
eval_every = 0
[optimizer]
lr = 3e-3
[data]
paths = data/train.bin
[checkpoint]
resume = none
""")


def train(name, *extra):
    h.run(["kmoe-train", "-i", "gen.deck", f"--output.dir={name}", f"--checkpoint.dir={name}/ck",
           *extra])
    return f"{name}/ck/step00000060.h5"


def generate(ckpt, *extra, ranks=1, expect_rc=0):
    return h.run(["kmoe-generate", "--checkpoint", ckpt, *extra], ranks=ranks,
                 expect_rc=expect_rc)


def new_tokens(p):
    m = re.search(r"^sample 0 \((\d+) new tokens", p.stdout, re.M)
    return int(m.group(1)) if m else 0


def sample_text(p):
    m = re.search(r"^sample 0 \([^)]*\):\n(.*?)\n(?:sample 1|check:|generated \d+ tokens)", p.stdout,
                  re.S | re.M)
    return m.group(1) if m else None


def check_line(p):
    m = re.search(r"largest \|incremental - whole\| (\S+) \((\S+) of the largest logit", p.stdout)
    return (float(m.group(1)), float(m.group(2))) if m else (None, None)


# 1. Layouts, reproducibility, seeds.
moe = train("moe")
SAMPLE = ["--prompt", "number 17 is", "--max-new-tokens", "40", "--temperature", "0.9",
          "--top-k", "20", "--top-p", "0.95", "--seed", "5", "--check"]
texts, lengths = {}, []
for grid, ranks in [("1,1,1", 1), ("1,1,2", 2), ("2,1,1", 2)]:
    pp, dp, ep = grid.split(",")
    extra = [f"--parallel.pp={pp}", f"--parallel.dp={dp}", f"--parallel.ep={ep}"]
    p = generate(moe, *SAMPLE, *extra, ranks=ranks)
    texts[grid] = sample_text(p)
    lengths.append(new_tokens(p))
    diff, rel = check_line(p)
    h.check(rel is not None and rel <= 1e-5,
            f"({grid}): incremental logits within 1e-5 of the whole sequence's ({diff}, {rel})")
h.check(texts["1,1,1"] is not None and len(set(texts.values())) == 1 and min(lengths) >= 20,
        f"seeded sample identical on (1,1,1), (1,1,2), (2,1,1), {lengths[0]} new tokens: "
        f"{texts['1,1,1']!r}")
again = sample_text(generate(moe, *SAMPLE))
other = sample_text(generate(moe, *SAMPLE[:-3], "--seed", "6"))
h.check(again == texts["1,1,1"] and other != again and other is not None,
        f"the same seed again: the same text; seed 6: {other!r}")

# 2. Greedy, with --check: dense pre-norm without QK-norm; MoE trained with a capacity.
dense = train("dense", "--moe.experts=0", "--engram.layers=", "--model.block_norm=pre",
              "--model.qk_norm=false")
capped = train("capped", "--moe.capacity_factor=1.0")
for name, ckpt in [("dense pre-norm", dense), ("MoE trained with a capacity", capped)]:
    p = generate(ckpt, "--prompt", "number 3", "--max-new-tokens", "30", "--check")
    diff, rel = check_line(p)
    h.check(rel is not None and rel <= 1e-5 and sample_text(p) is not None,
            f"{name}, greedy: within 1e-5 ({diff}, {rel}): {sample_text(p)!r}")

# 2b. Document masking with sliding windows: a prompt holding the end of an earlier document.
# The incremental logits follow the whole pass on one rank and pipelined, and what follows the
# boundary reads nothing before it, so the greedy text is the one the second document alone
# gives (RoPE is relative: positions that do not restart change only the rounding).
masked = train("masked", "--train.document_mask=true", "--model.sliding_window=7",
               "--model.window_layers=0,2,3")
first, second = "number 12 is even.", "number 5"
ids = ",".join(str(b) for b in first.encode()) + ",256," + ",".join(str(b) for b in second.encode())
alone = sample_text(generate(masked, "--prompt", second, "--max-new-tokens", "20"))
for grid, ranks in [("1,1,1", 1), ("2,1,1", 2)]:
    pp, dp, ep = grid.split(",")
    p = generate(masked, "--prompt-ids", ids, "--max-new-tokens", "20", "--check",
                 f"--parallel.pp={pp}", f"--parallel.dp={dp}", f"--parallel.ep={ep}", ranks=ranks)
    diff, rel = check_line(p)
    text = sample_text(p)
    h.check(rel is not None and rel <= 1e-5 and text is not None and alone is not None
            and text == first + second + alone[len(second):],
            f"({grid}) document-masked, windowed: within 1e-5 ({diff}, {rel}); after the "
            f"boundary {text!r} continues as the second document alone: {alone!r}")

# 3. The logits dump.
p = generate(moe, "--prompt", "number 8", "--max-new-tokens", "10", "--dump-logits", "dump",
             "--samples", "2")
ids, logits = np.load(h.path("dump.ids.npy")), np.load(h.path("dump.logits.npy"))
h.check(ids.dtype == np.int32 and logits.dtype == np.float32 and logits.shape == (len(ids), 320)
        and len(ids) == 8 + 10 - 1 and "sample 1" in p.stdout,
        f"--dump-logits: ids {ids.shape}, logits {logits.shape}; two samples printed")

# 3b. The context: a sequence stops at train.seq_len (64) positions, the length the model was
# trained on, with a note when --max-new-tokens asks for more.
p = generate(moe, "--prompt", "number 8", "--max-new-tokens", "100000")
h.check("--max-new-tokens 100000: a sequence stops at 64 positions (train.seq_len" in p.stdout
        and 0 < new_tokens(p) <= 64 - 8,
        f"--max-new-tokens past train.seq_len: a note, {new_tokens(p)} new tokens")

# 4. Bad input.
external = train("external", "--data.tokenizer=external")
for args, words, what in [
        (["--checkpoint", external, "--prompt", "hello"], ["data.tokenizer = external"],
         "--prompt with another tool's ids"),
        (["--checkpoint", moe, "--prompt-ids", "5,999"], ["999", "vocabulary"],
         "an id outside the vocabulary"),
        (["--checkpoint", moe, "--prompt", "a", "--prompt-ids", "5"], ["one of them"],
         "both prompt forms"),
        (["--checkpoint", moe, "--prompt", "a", "--top-p", "0"], ["--top-p"], "top-p 0"),
        (["--checkpoint", moe, "--prompt", "number 8", "--max-new-tokens", "999999",
          "--max-context", "1000000"], ["--max-new-tokens 999992", "needs more memory than there is"],
         "a context whose buffers cannot be allocated"),
        (["--checkpoint", moe, "--prompt", "number 8", "--max-context", "8"],
         ["the prompt has 8 ids", "--max-context"], "a prompt that fills the context")]:
    p = h.run(["kmoe-generate", *args], expect_rc=1)
    h.check(all(w in p.stderr for w in words), f"{what}: {p.stderr.strip()[-150:]}")
h.finish()
