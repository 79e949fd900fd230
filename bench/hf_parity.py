#!/usr/bin/python3
"""A kmoe export under Hugging Face transformers (>= 4.57: olmo2, llama, olmoe, flex_olmo): its
logits on a fixed batch against kmoe's own, for a machine that has transformers (Debian 12 does
not package it; this script is not part of ctest).

1. kmoe's side: the export imported back (kmoe-import into a temporary directory) and a fixed
   sequence run through it by kmoe-generate --dump-logits (greedy, fp32): the ids and the logits
   at every position.
2. transformers' side: AutoModelForCausalLM.from_pretrained(EXPORT_DIR) in float32 on the same
   ids; with a tokenizer in the export, AutoTokenizer's ids for a text against its bytes.
Prints the largest logit difference (absolute and relative to the largest logit) and whether
the greedy next tokens agree; asserts nothing. Record the figures in docs/PERFORMANCE.md.

usage: bench/hf_parity.py EXPORT_DIR [--build build] [--tokens 48]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--tokens", type=int, default=48, help="new tokens after the prompt")
    a = ap.parse_args()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        print(f"hf_parity: transformers is not available here ({e}); run it where it is")
        sys.exit(2)
    drivers = os.path.join(a.build, "drivers")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        subprocess.run([os.path.join(drivers, "kmoe-import"), a.export_dir, "--deck",
                        os.path.join(tmp, "m.deck"), "--checkpoint", os.path.join(tmp, "m.h5")],
                       check=True, env=env, capture_output=True, text=True)
        p = subprocess.run([os.path.join(drivers, "kmoe-generate"), "--checkpoint",
                            os.path.join(tmp, "m.h5"), "--prompt-ids", "81,58,32,87,104,121",
                            "--max-new-tokens", str(a.tokens), "--dump-logits",
                            os.path.join(tmp, "k")], check=True, env=env, capture_output=True,
                           text=True)
        ids = np.load(os.path.join(tmp, "k.ids.npy")).astype(np.int64)
        mine = np.load(os.path.join(tmp, "k.logits.npy")).astype(np.float64)
        print(f"kmoe: {len(ids)} positions in {time.time() - t0:.1f} s; {p.stdout.splitlines()[0]}")
    model = AutoModelForCausalLM.from_pretrained(a.export_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)[None]).logits[0].double().numpy()
    diff = np.abs(mine - theirs)
    scale = max(float(np.abs(theirs).max()), 1.0)
    agree = float((mine.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"{model.config.model_type}: logits at {len(ids)} positions, largest |kmoe - "
          f"transformers| {diff.max():.3g} ({diff.max() / scale:.3g} of the largest logit), "
          f"mean {diff.mean():.3g}; greedy next token agrees at {100 * agree:.1f}% of positions")
    if os.path.exists(os.path.join(a.export_dir, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(a.export_dir)
        text = "Fortune: café, \u00e9t\u00e9 -- 42!\n"
        got = tok(text)["input_ids"]
        want = list(text.encode("utf-8"))
        back = tok.decode(want)
        print(f"tokenizer: {'bytes' if got == want else 'NOT the bytes'} for {text!r}; decodes "
              f"{'back' if back == text else 'to ' + repr(back)}")


if __name__ == "__main__":
    main()
