#!/usr/bin/env python3
"""Every deck key the documentation names exists: `section.key` in README.md, docs/ and the
READMEs of slurm/ and inputs/ must be a key `kmoe-train --help` lists (the schema declares each
key once, with its type, default and help; the documentation points there rather than copying
the table).

    check_documented_keys.py KMOE_TRAIN ROOT            exit 1 listing every unknown key
    check_documented_keys.py KMOE_TRAIN ROOT --planted  a key planted into a copy of README.md
                                                        must be reported
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

SECTIONS = ("model", "moe", "engram", "train", "optimizer", "data", "parallel", "checkpoint",
            "output")
# section.key not preceded by a name character, '.', '/' or '-' (a tensor path such as
# blocks.1.engram.wk, a file such as slurm/train.sbatch, an option such as --train-sentencepiece).
MENTION = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*)\b")
# Names of that shape that are not deck keys, each with what it is.
NOT_KEYS = {
    "model.safetensors": "the Hugging Face weights file",
    "model.layers": "a Hugging Face tensor path (model.layers.<i>...)",
    "model.norm": "a Hugging Face tensor path (model.norm.weight)",
    "model.embed_tokens": "a Hugging Face tensor path",
    "engram.table": "an Engram layer's tensor (blocks.<l>.engram.table)",
    "engram.wk": "an Engram layer's tensor",
    "engram.wv": "an Engram layer's tensor",
    "engram.conv": "an Engram layer's tensor",
    "moe.router": "an MoE layer's tensor (blocks.<l>.moe.router)",
    "moe.shared": "an MoE layer's tensors (blocks.<l>.moe.shared.w1 ...)",
}


def help_keys(kmoe_train):
    text = subprocess.run([kmoe_train, "--help"], check=True, capture_output=True,
                          text=True).stdout
    keys, section = set(), None
    for line in text.splitlines():
        m = re.match(r"^\[(\w+)\]", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^  ([a-z_0-9]+)\s{2,}", line)
        if m and section:
            keys.add(section + "." + m.group(1))
    if len(keys) < 50:
        sys.exit(f"{kmoe_train} --help listed {len(keys)} keys: not the key table")
    return keys


def documents(root):
    files = [os.path.join(root, "README.md")]
    for pattern in ("docs/**/*.md", "slurm/*.md", "inputs/*.md"):
        files += sorted(glob.glob(os.path.join(root, pattern), recursive=True))
    return [f for f in files if os.path.isfile(f)]


def unknown(root, keys):
    out = []
    for path in documents(root):
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                for m in MENTION.finditer(line):
                    name = m.group(1) + "." + m.group(2)
                    if name not in keys and name not in NOT_KEYS:
                        out.append(f"{os.path.relpath(path, root)}:{n}: {name}")
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    kmoe_train, root = sys.argv[1], sys.argv[2]
    keys = help_keys(kmoe_train)
    for name in NOT_KEYS:
        if name in keys:
            sys.exit(f"{name} is a deck key now: take it out of NOT_KEYS")
    if "--planted" in sys.argv[3:]:
        with tempfile.TemporaryDirectory(prefix="kmoe-keys-") as tmp:
            shutil.copy(os.path.join(root, "README.md"), os.path.join(tmp, "README.md"))
            with open(os.path.join(tmp, "README.md"), "a", encoding="utf-8") as fh:
                fh.write("\nSet `train.no_such_key = 3` and `parallel.bucket_mib`.\n")
            found = unknown(tmp, keys)
            want = {"train.no_such_key", "parallel.bucket_mib"}
            got = {f.split(": ")[-1] for f in found}
            if got != want:
                sys.exit(f"planted keys {sorted(want)}, reported {sorted(got)}")
            print("ok   planted unknown keys reported: " + ", ".join(found))
        return
    found = unknown(root, keys)
    for f in found:
        print(f"{f}: not a deck key (kmoe-train --help)")
    print(f"{len(documents(root))} documents checked against {len(keys)} deck keys, "
          f"{len(found)} unknown")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
