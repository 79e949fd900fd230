"""Shared harness of kmoe's script-driven tests (regression and reference): running the real
binaries in a work directory, a small learnable corpus, metrics, and pass/fail bookkeeping that
ends in a `N passed, M failed` line (`, K skipped` after it when a subject could not be
exercised here: each skip is printed as `skip WHAT: WHY`, and scripts/test.sh lists them)."""
import csv
import os
import shutil
import subprocess
import sys


class Harness:
    def __init__(self, bin_dir, work, mpiexec="mpiexec", fresh=True):
        self.bin_dir, self.work, self.mpiexec = bin_dir, work, mpiexec
        # One BLAS thread per rank unless scripts/test_matrix.sh asks for more.
        blas = os.environ.get("KMOE_TEST_BLAS_THREADS", "1")
        self.env = dict(os.environ, OPENBLAS_NUM_THREADS=blas)
        self.results = []
        self.skipped = []
        if fresh:
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)

    def check(self, cond, what):
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        self.results.append(bool(cond))
        return bool(cond)

    def skip(self, what, why):
        """A subject this machine or build cannot exercise: reported, never counted as passed."""
        print(f"skip {what}: {why}", flush=True)
        self.skipped.append(what)

    def run(self, args, expect_rc=0, ranks=1, env=None):
        """Runs BIN_DIR/args[0] with args[1:] in the work directory (under mpiexec for ranks > 1)
        and checks its exit code."""
        cmd = [os.path.join(self.bin_dir, args[0])] + list(args[1:])
        if ranks > 1:
            forward = [a for k in sorted(env or {}) if k.startswith("KMOE_") for a in ("-x", k)]
            cmd = [self.mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
                   "-x", "OPENBLAS_NUM_THREADS=" + self.env["OPENBLAS_NUM_THREADS"]] + forward + cmd
        p = subprocess.run(cmd, cwd=self.work, env=env or self.env, capture_output=True,
                           text=True, timeout=900)
        if p.returncode != expect_rc:
            print(p.stdout[-3000:], p.stderr[-3000:])
        self.check(p.returncode == expect_rc,
                   f"{' '.join(args[:4])} ... exits {expect_rc} (got {p.returncode})")
        return p

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def write(self, name, text):
        with open(self.path(name), "w") as f:
            f.write(text)

    def prepare_corpus(self, documents, out="data"):
        """kmoe-prep of one text document per item (separated by '%' lines) into OUT/train.bin
        and OUT/val.bin (every 20th document)."""
        self.write("corpus.txt", "".join(doc + "\n%\n" for doc in documents))
        self.run(["kmoe-prep", "--out-dir", out, "--separator", "%", "--val-every", "20",
                  "corpus.txt"])

    def metrics(self, run_dir):
        with open(self.path(run_dir, "metrics.csv")) as f:
            return list(csv.DictReader(f))

    def losses(self, run_dir):
        """[(step, loss text)] of a run: the text compares bit for bit."""
        return [(r["step"], r["loss"]) for r in self.metrics(run_dir)]

    def finish(self):
        n_fail = self.results.count(False)
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        print(f"{len(self.results) - n_fail} passed, {n_fail} failed{skipped}")
        sys.exit(1 if n_fail else 0)


def counting_documents(n):
    """Sentences with learnable structure."""
    return [f"number {i} is {'odd' if i % 2 else 'even'}, and {i} + 1 = {i + 1}." for i in range(n)]


def grid_harness(argv):
    """The harness of RUNTIME.md section 2's grid tests: BIN_DIR WORK_DIR MPIEXEC from argv, the
    counting corpus, and grid.deck (20 steps, validation at the end on 10 instances, no resume,
    a metrics row each step)."""
    bin_dir, work, mpiexec = argv[1:4]
    h = Harness(bin_dir, work, mpiexec)
    h.prepare_corpus(counting_documents(4000))
    h.write("grid.deck", grid_test_deck("""
max_steps = 20
eval_every = 20
eval_instances = 10
""", """
val_paths = data/val.bin
[checkpoint]
resume = none
[output]
log_every = 1
"""))
    return h


def grid_train(h, name, pp=1, dp=1, ep=1, *extra, expect_rc=0, env=None):
    """grid.deck on (pp, dp, ep) into the run directory `name`."""
    args = ["kmoe-train", "-i", "grid.deck", f"--parallel.pp={pp}", f"--parallel.dp={dp}",
            f"--parallel.ep={ep}", f"--output.dir={name}", f"--checkpoint.dir={name}/ckpt",
            *extra]
    return h.run(args, expect_rc=expect_rc, ranks=pp * dp * ep, env=env)


def rel(a, b):
    return abs(float(a) - float(b)) / abs(float(b))


def h5_datasets(path):
    """Every dataset of an HDF5 file (a checkpoint, a dump) as {path: numpy array}."""
    import h5py
    import numpy as np
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, np.asarray(v)) if isinstance(v, h5py.Dataset)
                     else None)
    return out


def same_datasets(a, b):
    """(whether two HDF5 files hold the same datasets, bit for bit; the first differing names)."""
    import numpy as np
    da, db = h5_datasets(a), h5_datasets(b)
    diff = [k for k in da if k not in db or da[k].shape != db[k].shape or
            not np.array_equal(da[k].view(np.uint8), db[k].view(np.uint8))]
    return sorted(da) == sorted(db) and len(da) > 0 and not diff, diff[:3]


def grid_test_deck(train="", sections=""):
    """RUNTIME.md section 2's test deck for the process grid: the tiny MoE + Engram model
    (D 64, L 4, T 64, E 8 top-2 + a shared expert after a dense block 0, Engram at blocks 1 and
    2), G 16, b 2 (divisible by R*b for every power-of-two R <= 8), lr 3e-3 with warmup 20, no
    router-bias updates, no capacity. `train` adds [train] lines (max_steps, ...); `sections`
    follows the [data] section: more [data] lines first, then whole sections ([checkpoint],
    [output], [parallel], ...)."""
    return """
[model]
vocab_size = 320
d_model = 64
n_layers = 4
n_heads = 4
n_kv_heads = 2
ffn_hidden = 128
[moe]
experts = 8
top_k = 2
expert_hidden = 32
dense_layers = 0
shared_experts = 1
shared_hidden = 32
[engram]
layers = 1, 2
heads = 2
embed_per_ngram = 16
table_size = 97, 101
[train]
seq_len = 64
global_batch = 16
micro_batch = 2
seed = 3
""" + train.strip() + """
[optimizer]
lr = 3e-3
warmup_steps = 20
[data]
paths = data/train.bin
""" + sections.strip() + "\n"
