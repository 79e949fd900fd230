#!/usr/bin/python3
"""kmoe under hostile but realistic conditions: every failure ends in a clear error (or the
documented exit code), never a crash, a hang or silently lost output.

 1. a full checkpoint disk (a small tmpfs, where the test may mount one; else injected write
    failures): the free-space check refuses the save; writes that meet the full disk end with
    exit 1 on 1 and 2 ranks (no crash, no hang); a write failing on one rank only, or on every
    rank; the partial file is removed, `latest` and its checkpoint stay good;
 2. a full output disk: the run stops with a checkpoint and an error naming metrics.csv; an
    unwritable metrics.csv is refused at the start;
 3. non-finite values in a checkpoint are refused naming the tensor (kmoe-eval and resume);
    a non-finite evaluation loss makes kmoe-eval exit 3;
 4. a token file truncated under a running job ends it with an error naming the file;
 5. stop signals: SIGTERM, SIGINT and `timeout --preserve-status` to scripts/kmoe-mpirun give
    exit 86 after a checkpoint, a second SIGINT aborts, but not a job already exiting after its
    checkpoint; SIGINT to one process gives 86, a SIGUSR1 during start-up gives 85 after the
    first step, a SIGTERM during the save a SIGUSR1 asked for gives 86; SIGTERM to a bare
    mpiexec: a note at the start, and a checkpoint though mpirun no longer reads the output;
    SIGTERM to the mpirun inside kmoe-mpirun of a run that finishes: exit 0, not mpirun's 1;
 6. the run lock: a second run on a directory is refused naming the first; stale locks (old
    heartbeat, gone process, this Slurm job's own) are taken over;
 7. the dry run checks token ids and the checkpoint it would resume; an overflowing model size
    and a model larger than the machine are errors naming the keys; `latest` with CR-LF;
    stale temporaries of an interrupted save are removed at the next start;
 8. a checkpoint directory whose path is longer than 300 characters saves and resumes;
 9. a save flushes the checkpoint file and `latest`'s temporary to the disk before renaming
    each into place, and their directory after (strace);
10. a failure names the rank, the node and the phase: a rank that does not join within
    KMOE_STARTUP_TIMEOUT ends the others with exit 75 (transient, reported to KMOE_STOP_FILE),
    a crash in start-up is reported as 75, a crash in step N names step N and is not.
Usage: hostile.py BIN_DIR WORK_DIR MPIEXEC SCRIPTS_DIR
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness, counting_documents, grid_test_deck  # noqa: E402

bin_dir, work, mpiexec, scripts = sys.argv[1:5]
h = Harness(bin_dir, work, mpiexec)
h.prepare_corpus(counting_documents(3000))
h.write("h.deck", grid_test_deck("max_steps = 6\n", """
val_paths = data/val.bin
[checkpoint]
every = 2
[output]
log_every = 1
"""))
TRAIN = os.path.join(bin_dir, "kmoe-train")
WRAPPER = os.path.join(scripts, "kmoe-mpirun")
MPI = [mpiexec, "--allow-run-as-root", "--oversubscribe"]
h.env["KMOE_MPIRUN"] = mpiexec  # the wrapper's launcher
# What a checkpoint directory may hold after a failed save: a multi-rank job ends in MPI_Abort,
# which leaves its lock (taken over by the next run: its process is gone).
INTACT = (["latest", "step00000002.h5"], ["kmoe.lock", "latest", "step00000002.h5"])


def train(name, *extra, ranks=1, expect_rc=0, env=None, ckpt=None):
    e = dict(h.env, **(env or {}))
    return h.run(["kmoe-train", "-i", "h.deck", f"--output.dir={name}",
                  f"--checkpoint.dir={ckpt or name + '/ckpt'}", f"--parallel.dp={ranks}",
                  *extra], expect_rc=expect_rc, ranks=ranks, env=e)


def latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


def evaluates(ckpt_file):
    p = subprocess.run([os.path.join(bin_dir, "kmoe-eval"), "-i", "h.deck",
                        f"--checkpoint={ckpt_file}"], cwd=work, env=h.env, capture_output=True,
                       text=True)
    return p.returncode == 0 and "eval_loss" in p.stdout


# ------------------------------------------------------------------ 1. a full checkpoint disk
mounts = []


def tmpfs(name, size):
    """A fresh tmpfs of `size` at work/name, or None where the test may not mount one."""
    path = h.path(name)
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                      capture_output=True).returncode != 0:
        return None
    mounts.append(path)
    return path


try:
    full = tmpfs("fulldisk", "6m")
    if full:
        print("ok   tmpfs mounted: the disk really fills")
        ckpt = os.path.join(full, "ckpt")
        # 3.6 MiB a checkpoint: step 2 fits, step 4 does not.
        p = train("room", expect_rc=1, ckpt=ckpt)
        h.check("no room for step00000004.h5" in p.stderr and latest(ckpt) == "step00000002.h5"
                and evaluates(os.path.join(ckpt, "step00000002.h5")),
                f"a save the disk cannot hold is refused, step 2 stays good: {p.stderr[-200:]}")
        for ranks in (1, 2):
            shutil.rmtree(ckpt)
            p = train(f"enospc{ranks}", ranks=ranks, expect_rc=1, ckpt=ckpt,
                      env={"KMOE_FAULT": "no_space_check"})
            left = sorted(os.listdir(ckpt))
            h.check("step00000004.h5 not saved" in p.stderr and "partial file is removed" in
                    p.stderr and left in INTACT,
                    f"{ranks} rank(s): writes into the full disk end with exit 1, partial file "
                    f"gone, files {left}")
    else:
        h.skip("a checkpoint disk that really fills (tmpfs)",
               "this machine lets the test mount no tmpfs (injected write failures only)")
    # The writing rank's data write fails (rank 0 writes the dense tensors): the others made
    # the same collective calls and must follow it out.
    for fault, what in (("save_fails:0:4", "the writing rank"), ("save_fails:-1:4", "every rank")):
        name = "inject_one" if fault.startswith("save_fails:0") else "inject_all"
        p = train(name, ranks=2, expect_rc=1, env={"KMOE_FAULT": fault})
        ckpt = h.path(name, "ckpt")
        h.check("not saved" in p.stderr and "KMOE_FAULT" in p.stderr and
                sorted(os.listdir(ckpt)) in INTACT,
                f"a save failing on {what} of 2 ends the job, step 2 intact: {p.stderr[-200:]}")

    # A rank that stops before a save's collective close leaves the others inside HDF5, where
    # only the I/O watchdog sees them: it ends the job, naming the file.
    p = train("stall", "--parallel.watchdog_seconds=5", ranks=2, expect_rc=1,
              env={"KMOE_FAULT": "stall_save:1"})
    h.check("made no progress for 5 s (parallel.watchdog_seconds) writing" in p.stderr,
            f"a rank stuck before a save's collective close ends the job through the I/O "
            f"watchdog: {p.stderr[-300:]}")

    # ------------------------------------------------------------- 2. a full output disk
    out = tmpfs("fullout", "16k")
    if not out:
        h.skip("an output disk that really fills (tmpfs)",
               "this machine lets the test mount no tmpfs (an injected row failure only)")
    if out:
        p = h.run(["kmoe-train", "-i", "h.deck", "--train.max_steps=400",
                   f"--output.dir={out}/run", "--checkpoint.dir=fullout_ckpt",
                   "--checkpoint.every=0"], expect_rc=1)
        m = re.search(r"cannot write the row of step (\d+)", p.stderr)
        step = int(m.group(1)) if m else -1
        h.check(m and f"stopped after step {step} with checkpoint fullout_ckpt/" in p.stderr and
                latest(h.path("fullout_ckpt")) == f"step{step:08d}.h5" and 1 < step < 400,
                f"a full output disk stops the run at step {step} with its checkpoint: "
                f"{p.stderr[-250:]}")
    # The same without a tmpfs: the row of step 3 cannot be written.
    p = train("rowfail", "--train.max_steps=400", "--checkpoint.every=0", expect_rc=1,
              env={"KMOE_FAULT": "metrics_fails:3"})
    h.check("cannot write the row of step 3" in p.stderr and
            latest(h.path("rowfail", "ckpt")) == "step00000003.h5",
            f"a metrics row that cannot be written stops the run after its checkpoint: "
            f"{p.stderr[-200:]}")
    os.makedirs(h.path("devfull"), exist_ok=True)
    os.symlink("/dev/full", h.path("devfull", "metrics.csv"))
    p = train("devfull", expect_rc=1)
    h.check("output.dir: cannot write its header" in p.stderr and "metrics.csv" in p.stderr,
            f"an unwritable metrics.csv is an error at the start: {p.stderr[-200:]}")
finally:
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", m])

# ------------------------------------------------------------ 3. non-finite checkpoints
train("good")
good = h.path("good", "ckpt", "step00000006.h5")


def poisoned(name, dataset, index, value):
    path = h.path(name + ".h5")
    shutil.copy(good, path)
    with h5py.File(path, "r+") as f:
        d = f[dataset]
        a = d[()]
        a[index] = value
        d[...] = a
    return path


# Byte-level ids stop at 256: embedding row 300 is never looked up, yet refused.
bad = poisoned("nan_row", "model/embed/weight", (300, 3), np.nan)
p = h.run(["kmoe-eval", "-i", "h.deck", f"--checkpoint={bad}"], expect_rc=1)
h.check("/model/embed/weight holds nan at row 300, element 3" in p.stderr,
        f"kmoe-eval refuses a NaN in an unused row, naming it: {p.stderr[-200:]}")
p = train("nan_resume", f"--checkpoint.resume={bad}", "--train.max_steps=8", expect_rc=1)
h.check("/model/embed/weight holds nan" in p.stderr, "a resume refuses it too")
bad = poisoned("inf_moment", "optimizer/exp_avg_sq/blocks/1/attn/wq", (0, 0), np.inf)
p = train("inf_resume", f"--checkpoint.resume={bad}", "--train.max_steps=8", expect_rc=1)
h.check("/optimizer/exp_avg_sq/blocks/1/attn/wq holds inf" in p.stderr,
        f"an Inf in an AdamW moment is refused on resume: {p.stderr[-200:]}")
huge = poisoned("huge_head", "model/lm_head/weight", (slice(None), slice(None)), 3e38)
p = h.run(["kmoe-eval", "-i", "h.deck", f"--checkpoint={huge}"], expect_rc=3)
h.check("evaluation loss is not finite" in p.stderr, "a non-finite evaluation loss exits 3")

# ----------------------------------------------- 4. a token file truncated under a running job
shutil.copytree(h.path("data"), h.path("data_cut"))
proc = subprocess.Popen([TRAIN, "-i", "h.deck", "--train.max_steps=100000", "--output.dir=cut",
                         "--checkpoint.dir=cut/ckpt", "--checkpoint.every=0",
                         "--data.paths=data_cut/train.bin"], cwd=work, env=h.env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
deadline = time.time() + 120
while time.time() < deadline and not (os.path.exists(h.path("cut", "metrics.csv")) and
                                      len(h.metrics("cut")) >= 3):
    time.sleep(0.1)
os.truncate(h.path("data_cut", "train.bin"), 100)
try:
    _, err = proc.communicate(timeout=120)
except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
h.check(proc.returncode == 1 and "data_cut/train.bin" in err and
        "changed or truncated while in use" in err,
        f"a token file truncated during the run: exit {proc.returncode}, {err[-250:]}")


# ---------------------------------------------------------------------- 5. stop signals
def launched(name, cmd, signals, wait_rows=3, delay=0.3, gap=0.5, env=None):
    """Starts cmd, waits for wait_rows logged steps (0: `delay` seconds), sends the signals
    `gap` seconds apart; returns (exit code, its output, the files of its checkpoint
    directory)."""
    # SIGINT at its default in the child, even where this test runs in the background (a shell
    # cannot trap a signal ignored when it started).
    p = subprocess.Popen(cmd + ["-i", "h.deck", "--train.max_steps=100000",
                                "--checkpoint.every=0", f"--output.dir={name}",
                                f"--checkpoint.dir={name}/ckpt"],
                         cwd=work, env=dict(h.env, **(env or {})), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if wait_rows:
        deadline = time.time() + 120
        while time.time() < deadline and not (os.path.exists(h.path(name, "metrics.csv")) and
                                              len(h.metrics(name)) >= wait_rows):
            time.sleep(0.1)
    else:
        time.sleep(delay)
    for s in signals:
        p.send_signal(s)
        time.sleep(gap)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        err += "\n(hung: killed)"
    files = sorted(os.listdir(h.path(name, "ckpt"))) if os.path.isdir(h.path(name, "ckpt")) else []
    return p.returncode, out + err, files


def stopped_with_checkpoint(files):
    return "latest" in files and any(f.startswith("step") for f in files)


wrapped = [WRAPPER, *MPI[1:], "-n", "2", "-x", "OPENBLAS_NUM_THREADS=1", TRAIN,
           "--parallel.dp=2"]
for sig, what in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT (Ctrl-C)")):
    rc, log, files = launched(f"wrap_{sig}", wrapped, [sig])
    h.check(rc == 86 and stopped_with_checkpoint(files),
            f"{what} to kmoe-mpirun: exit {rc}, checkpoint {files}")
rc, log, files = launched("wrap_int2", wrapped, [signal.SIGINT, signal.SIGINT], gap=0.02)
h.check(rc == 130 and "(hung" not in log,
        f"a second SIGINT aborts the job (exit {rc}, 130 wanted)")
rc, log, files = launched("timeout", ["timeout", "--preserve-status", "-s", "TERM", "6"] + wrapped,
                          [], wait_rows=0, delay=0)
h.check(rc == 86 and stopped_with_checkpoint(files),
        f"timeout --preserve-status ... kmoe-mpirun: exit {rc}, checkpoint {files}")
# A second Ctrl-C while the job is already exiting with its checkpoint must leave it alone:
# Open MPI's mpirun can crash when signalled then (in PMIx_Finalize, exit 139). A stand-in
# mpirun makes the moment exact: on SIGUSR2 it reports 86 as kmoe would, then takes 2 s to
# exit, and dies by SIGSEGV if signalled in that time.
h.write("fake_mpirun", """#!/bin/bash
stopping=0
trap 'echo 86 > "$KMOE_STOP_FILE"; stopping=1' USR2
trap '[ $stopping = 1 ] && kill -SEGV $$; exit 1' TERM
while [ $stopping = 0 ]; do sleep 0.05 & wait $!; done
sleep 2 & wait $!
exit 86
""")
os.chmod(h.path("fake_mpirun"), 0o755)
p = subprocess.Popen([WRAPPER, "-n", "2", TRAIN], cwd=work, env=dict(h.env, KMOE_MPIRUN=h.path(
    "fake_mpirun")), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
time.sleep(0.5)
p.send_signal(signal.SIGINT)
time.sleep(0.5)
p.send_signal(signal.SIGINT)
_, err = p.communicate(timeout=60)
h.check(p.returncode == 86 and "kmoe has checkpointed and is exiting" in err,
        f"a second Ctrl-C while the job exits after its checkpoint: exit {p.returncode}, "
        f"{err.strip()[-120:]}")

# SIGUSR1, then SIGTERM while the save it asked for is being written (a preemption notice
# followed by a cancel; KMOE_FAULT=slow_save makes each save 2 s longer): the cancel wins.
rc, log, files = launched("usr1_term", [TRAIN], [signal.SIGUSR1, signal.SIGTERM],
                          env={"KMOE_FAULT": "slow_save:2000"})
h.check(rc == 86 and stopped_with_checkpoint(files) and "stopped by SIGTERM" in log,
        f"SIGUSR1, then SIGTERM during the save: exit {rc} (the cancel wins), checkpoint {files}")

# SIGTERM to a bare mpiexec (Open MPI 4.x): mpirun stops reading the ranks' output at once,
# sends them SIGTERM odls_base_sigkill_timeout seconds later and SIGKILL as long after that.
# Rank 0 says so at the start; blocked on its unread output by the time SIGTERM comes, it must
# still reach its checkpoint. mpirun's own exit code is 1 whatever the ranks did.
bare = MPI + ["-n", "2", "-x", "OPENBLAS_NUM_THREADS=1", "--mca", "odls_base_sigkill_timeout",
              "5", TRAIN, "--parallel.dp=2"]
rc, log, files = launched("bare_term", bare, [signal.SIGTERM])
h.check("odls_base_sigkill_timeout = 5 s" in log,
        "a run under a bare mpirun notes at the start what a SIGTERM to mpirun leaves it")
h.check(stopped_with_checkpoint(files) and "kmoe.lock" not in files and "(hung" not in log,
        f"SIGTERM to a bare mpiexec (odls_base_sigkill_timeout 5): checkpoint {files}, "
        f"mpirun's exit {rc}")


# SIGTERM straight to the mpirun inside kmoe-mpirun (KMOE_STOP_GRACE = 4) of a run that
# finishes before mpirun passes the signal on: mpirun returns 1, the wrapper reports the
# finished run (kmoe's 0 through KMOE_STOP_FILE), not a failure.
def inner_mpirun(wrapper_pid):
    pids = subprocess.run(["pgrep", "-P", str(wrapper_pid)], capture_output=True,
                          text=True).stdout.split()
    return int(pids[0]) if pids else None


p = subprocess.Popen(wrapped + ["-i", "h.deck", "--train.max_steps=12", "--output.log_every=1000",
                                "--checkpoint.every=0", "--output.dir=grace_done",
                                "--checkpoint.dir=grace_done/ckpt"],
                     cwd=work, env=dict(h.env, KMOE_STOP_GRACE="4"), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
deadline = time.time() + 60
while time.time() < deadline and not os.path.exists(h.path("grace_done", "ckpt", "kmoe.lock")):
    time.sleep(0.05)
inner = inner_mpirun(p.pid)
if inner:
    os.kill(inner, signal.SIGTERM)
_, err = p.communicate(timeout=120)
h.check(inner is not None and p.returncode == 0 and
        "mpirun returned 1; kmoe finished with exit code 0" in err and
        latest(h.path("grace_done", "ckpt")) == "step00000012.h5",
        f"SIGTERM to the mpirun inside kmoe-mpirun, run finished: exit {p.returncode}, "
        f"{err.strip()[-120:]}")

rc, log, files = launched("int1", [TRAIN], [signal.SIGINT])
h.check(rc == 86 and stopped_with_checkpoint(files) and "stopped by SIGINT" in log,
        f"SIGINT to kmoe-train: exit {rc}, checkpoint {files}")
# SIGUSR1 during start-up, at a known moment: the process sends it to itself right after it
# installs its handlers, before MPI, Kokkos and the model start (KMOE_FAULT=signal_at_start);
# the stop comes after step 1 only if the start-up kept the signal.
rc, log, files = launched("startup", [TRAIN], [], wait_rows=0, delay=0,
                          env={"KMOE_FAULT": f"signal_at_start:{int(signal.SIGUSR1)}"})
h.check(rc == 85 and files == ["latest", "step00000001.h5"],
        f"SIGUSR1 during start-up: exit {rc}, stopped after the first step {files}")
# SIGTERM while the ranks join (held in the first barrier for 60 s: KMOE_FAULT=startup_pause):
# the process ends at once, named, 128 + 15, without a checkpoint.
t0 = time.time()
rc, log, files = launched("joining", [TRAIN], [signal.SIGTERM], wait_rows=0, delay=1.5, gap=0,
                          env={"KMOE_FAULT": "startup_pause:0:60000"})
h.check(rc == 143 and "SIGTERM during start-up: " in log and "ending now" in log and
        not files and time.time() - t0 < 30,
        f"SIGTERM while the ranks join: exit {rc} after {time.time() - t0:.1f} s, checkpoint "
        f"{files}: {log.strip()[-200:]}")

# ----------------------------------------------------------------------- 6. the run lock
p1 = subprocess.Popen([TRAIN, "-i", "h.deck", "--train.max_steps=100000", "--output.dir=lock_a",
                       "--checkpoint.dir=shared_ckpt"], cwd=work, env=h.env,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 60
while time.time() < deadline and not os.path.exists(h.path("shared_ckpt", "kmoe.lock")):
    time.sleep(0.1)
p = train("lock_b", expect_rc=1, ckpt="shared_ckpt")
h.check(f"belongs to another run: host {os.uname().nodename}, pid {p1.pid}" in p.stderr,
        f"a second run on a locked directory is refused naming the first: {p.stderr[-200:]}")
p1.send_signal(signal.SIGTERM)
p1.wait(timeout=120)
h.check(not os.path.exists(h.path("shared_ckpt", "kmoe.lock")), "a run that ends removes its lock")


def fake_lock(name, host, pid, age, job=""):
    os.makedirs(h.path(name), exist_ok=True)
    with open(h.path(name, "kmoe.lock"), "w") as f:
        f.write(f"kmoe run lock\nhost {host}\npid {pid}\nstarted 2026-01-01T00:00:00Z\n"
                f"slurm_job {job}\nheartbeat {int(time.time() - age)}\n")
    return name


p = train("stale", ckpt=fake_lock("stale_ckpt", "elsewhere", 4242, 3600))
h.check("taking over the run lock of host elsewhere, pid 4242: its last heartbeat is" in p.stdout,
        "a lock without a heartbeat for an hour is taken over")
p = train("alive", expect_rc=1, ckpt=fake_lock("alive_ckpt", os.uname().nodename, os.getpid(), 5))
h.check("belongs to another run" in p.stderr, "a live process's fresh lock is respected")
p = train("gone", ckpt=fake_lock("gone_ckpt", os.uname().nodename, 2 ** 22 + 7, 5))
h.check("is gone" in p.stdout, "the lock of a process gone from this host is taken over")
p = train("job", ckpt=fake_lock("job_ckpt", "elsewhere", 4242, 5, job="777"),
          env={"SLURM_JOB_ID": "777"})
h.check("this Slurm job's own lock" in p.stdout, "a requeued Slurm job takes over its own lock")

# ------------------------------------------------ 7. dry run, sizes, latest, stale temporaries
with open(h.path("data", "train.bin"), "rb") as f:
    tokens = bytearray(f.read())
tokens[1000:1002] = (1000).to_bytes(2, "little")  # an id beyond model.vocab_size = 320
os.makedirs(h.path("badids"), exist_ok=True)
with open(h.path("badids", "train.bin"), "wb") as f:
    f.write(tokens)
p = h.run(["kmoe-train", "-i", "h.deck", "--dry-run", "--data.paths=badids/train.bin",
           "--train.max_steps=2000"], expect_rc=1)
h.check("token id 1000 >= model.vocab_size 320" in p.stderr,
        f"the dry run finds a bad token id: {p.stderr[-150:]}")
p = h.run(["kmoe-train", "-i", "h.deck", "--dry-run", "--checkpoint.resume=missing.h5"],
          expect_rc=1)
h.check("checkpoint.resume = missing.h5: no such file" in p.stderr, "the dry run checks resume")
p = h.run(["kmoe-train", "-i", "h.deck", "--dry-run", f"--checkpoint.resume={good}",
           "--model.d_model=128"], expect_rc=1)
h.check("does not match the checkpoint" in p.stderr and "model.d_model" in p.stderr,
        "the dry run compares the deck with the checkpoint it would resume")
p = h.run(["kmoe-train", "-i", "h.deck", "--dry-run", "--model.d_model=1000000000",
           "--model.n_heads=1", "--model.n_kv_heads=1"], expect_rc=1)
h.check("overflow 64-bit" in p.stderr and "model.d_model" in p.stderr,
        f"an overflowing size is an error naming the keys: {p.stderr[-150:]}")
p = train("toolarge", "--model.ffn_hidden=400000000", expect_rc=1)
h.check("memory: the 1 rank(s) on this node" in p.stderr and "model.ffn_hidden" in p.stderr,
        f"a model larger than the machine is refused: {p.stderr[-200:]}")
shutil.copytree(h.path("good", "ckpt"), h.path("crlf", "ckpt"))
with open(h.path("crlf", "ckpt", "latest"), "w") as f:
    f.write("step00000006.h5\r\n")
with open(h.path("crlf", "ckpt", ".step00000008.h5.tmp"), "wb") as f:
    f.write(b"\0" * 4096)
p = train("crlf", "--train.max_steps=8")
h.check("resuming from crlf/ckpt/step00000006.h5" in p.stdout, "a latest ending in CR-LF resumes")
h.check("removing crlf/ckpt/.step00000008.h5.tmp" in p.stdout and
        not os.path.exists(h.path("crlf", "ckpt", ".step00000008.h5.tmp")),
        "the stale temporary of an interrupted save is removed at the start")

# ------------------------------------------------- 8. a checkpoint path of over 300 characters
deep = h.path("deep", *(["a directory level with a long name"] * 9))
os.makedirs(deep)
h.check(len(os.path.abspath(deep)) > 300, f"the deep path has {len(os.path.abspath(deep))} chars")
train("deep", "--train.max_steps=4", ranks=2, ckpt=deep)
p = train("deep", "--train.max_steps=6", ranks=2, ckpt=deep)
h.check("resuming from" in p.stdout and latest(deep) == "step00000006.h5",
        "checkpoints under a path of over 300 characters save and resume")


# ------------------------------------------- 9. a save reaches the disk before its name does
def fsync_order(trace):
    """From `strace -f` output: (path of each fsync'ed file, in order, and each rename's
    (source, target)) as one list of events."""
    fds, events = {}, []
    for line in trace.splitlines():
        m = re.search(r'openat\(AT_FDCWD, "([^"]+)", [^)]*\)\s+= (\d+)$', line)
        if m:
            fds[(line.split()[0], m.group(2))] = m.group(1)
            continue
        m = re.search(r"fsync\((\d+)\)\s+= 0", line)
        if m and (line.split()[0], m.group(1)) in fds:
            events.append(("fsync", fds[(line.split()[0], m.group(1))]))
        m = re.search(r'rename(?:at2?)?\((?:AT_FDCWD, )?"([^"]+)", (?:AT_FDCWD, )?"([^"]+)"', line)
        if m:
            events.append(("rename", m.group(1), m.group(2)))
    return events


def durable(events, target):
    """Whether `target` was renamed into place after its source was fsync'ed, and its
    directory fsync'ed after the rename."""
    for i, e in enumerate(events):
        if e[0] == "rename" and e[2].endswith(target):
            return (("fsync", e[1]) in events[:i] and
                    ("fsync", os.path.dirname(e[2])) in events[i + 1:])
    return False


if shutil.which("strace") and subprocess.run(["strace", "-o", "/dev/null", "true"],
                                             capture_output=True).returncode == 0:
    h.run([shutil.which("strace"), "-f", "-qq", "-o", "save.trace", "-e", "trace=openat,fsync,rename,renameat,"
           "renameat2", TRAIN, "-i", "h.deck", "--train.max_steps=2", "--output.dir=synced",
           "--checkpoint.dir=synced/ckpt"])
    with open(h.path("save.trace")) as f:
        events = fsync_order(f.read())
    h.check(durable(events, "ckpt/step00000002.h5") and durable(events, "ckpt/latest"),
            "a save flushes the checkpoint and latest's temporary before each rename and the "
            "directory after it: " + str([e for e in events if "synced" in str(e)][-6:]))
else:
    h.skip("the order of fsync and rename in a save (strace)",
           "strace is missing or may not trace here")


# ------------------------------------------ 10. a failure names the rank, the node, the phase
def failing(name, fault, *env_extra):
    """2 ranks under mpiexec with KMOE_FAULT=fault; (exit code, output, what the ranks wrote
    to KMOE_STOP_FILE)."""
    stop = h.path(f"{name}.exit")
    env = dict(h.env, KMOE_FAULT=fault, KMOE_STOP_FILE=stop, **dict(env_extra))
    forward = [a for k in sorted(env) if k.startswith("KMOE_") for a in ("-x", k)]
    p = subprocess.run(MPI + ["-n", "2", *forward, TRAIN, "-i", "h.deck", "--parallel.dp=2",
                              f"--output.dir={name}", f"--checkpoint.dir={name}/ckpt"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    reported = open(stop).read().strip() if os.path.exists(stop) else ""
    return p.returncode, p.stdout + p.stderr, reported


node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename  # as kmoe names it
# A rank that does not join: the others' start-up watchdog ends the run, named, exit 75.
t = time.time()
rc, out, reported = failing("join", "startup_pause:1:60000", ("KMOE_STARTUP_TIMEOUT", "2"))
h.check(rc == 75 and reported == "75" and time.time() - t < 50 and
        f"kmoe: world rank 0 of 2 on node {node}: start-up: the first barrier did not finish "
        "in 2 s (KMOE_STARTUP_TIMEOUT)" in out,
        f"a rank that does not join: the other names itself, the node and the phase and exits "
        f"75 (transient) in {time.time() - t:.1f} s: exit {rc}, reported '{reported}'\n"
        + out[-1500:])
# A crash while the ranks join (as in a transport that fails): named, reported as transient.
rc, out, reported = failing("joincrash", "startup_crash:1")
h.check(rc != 0 and reported == "75" and
        f"kmoe: world rank 1 of 2 on node {node}: SIGSEGV (Segmentation fault) during start-up: "
        "the first barrier (start-up failed" in out,
        f"a crash in start-up names the rank, the node and the phase, reported 75: exit {rc}, "
        f"reported '{reported}'\n" + out[-1500:])
# A crash in training: named with its step, not transient.
rc, out, reported = failing("stepcrash", "crash:1:3")
h.check(rc != 0 and rc != 75 and reported == "" and
        f"kmoe: world rank 1 of 2 on node {node}: SIGSEGV (Segmentation fault) during step 3\n"
        in out,
        f"a crash in step 3 names the rank, the node and the step, not transient: exit {rc}, "
        f"reported '{reported}'\n" + out[-1500:])
h.finish()
