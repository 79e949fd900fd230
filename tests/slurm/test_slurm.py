#!/usr/bin/python3
"""slurm/train.sbatch on a real one-node Slurm started for the test (tests/slurm/slurm_cluster.py):
  1. a job trains the tiny MoE + Engram deck on 2 ranks (ep = 2) and completes with its final
     checkpoint and metrics;
  2. preemption: the same job signalled with SIGUSR1 mid-run checkpoints, exits 85, requeues
     itself, resumes from `latest` and completes with the uninterrupted run's losses, bit for
     bit;
  3. a cancel (scancel: SIGTERM) checkpoints, exits 86 and is not requeued;
  4. KMOE_LAUNCH=mpirun starts the ranks with mpirun inside the allocation instead of srun, and
     a cancel of such a job still checkpoints and reports 86;
  5. a start-up that fails (a rank crashes while the ranks join) names the rank, node and
     phase, exits 75 and is requeued by the script, the rank left waiting ends at the
     launcher's SIGTERM (not its SIGKILL); the restart trains to the end;
  6. an allocation that does not match the deck's grid is refused before launch.
The daemons it started are stopped at the end, whatever happened.
Usage: test_slurm.py BIN_DIR WORK_DIR
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from kmoe_testlib import Harness, counting_documents, grid_test_deck  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

bin_dir, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
h = Harness(bin_dir, work)
h.prepare_corpus(counting_documents(4000))
h.write("job.deck", grid_test_deck("max_steps = 150", """
[parallel]
ep = 2
[checkpoint]
every = 50
[output]
log_every = 1
"""))
SBATCH = os.path.join(ROOT, "slurm", "train.sbatch")
ENV = {"KMOE_BUILD": os.path.dirname(bin_dir)}  # bin_dir is <build>/drivers


def submit(c, name, *extra, sbatch_args=("-n", "2")):
    return c.sbatch([*sbatch_args, f"--job-name={name}", f"--output={name}.out", SBATCH,
                     "job.deck", f"--output.dir={name}", f"--checkpoint.dir={name}/ckpt", *extra],
                    cwd=work, env=ENV)


def log(name):
    path = h.path(f"{name}.out")
    return open(path).read() if os.path.exists(path) else ""


def rows_when(name, n, timeout=300):
    """Waits until run `name` has logged n steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(h.path(name, "metrics.csv")) and len(h.metrics(name)) >= n:
            return True
        time.sleep(0.2)
    return False


def release_requeued(j):
    """Slurm holds a requeued batch job back for about two minutes (Reason=BeginTime) while the
    node cleans up the old run; the test lets it start once the node is idle again."""
    deadline = time.time() + 120
    while time.time() < deadline:
        info = c.job(j)
        idle = c.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip() == "idle"
        if info.get("Restarts") == "1" and info.get("JobState") == "PENDING" and idle:
            time.sleep(3)  # the old step's PMIx directory goes last
            c.run(["scontrol", "update", f"JobId={j}", "StartTime=now"], check=False)
            return
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            return
        time.sleep(0.3)


c = SlurmCluster(os.path.join(work, "cluster"))
try:
    c.start()
    # 1. A plain job.
    j = submit(c, "plain")
    info = c.wait(j)
    ck = sorted(os.listdir(h.path("plain", "ckpt"))) if os.path.isdir(h.path("plain", "ckpt")) else []
    h.check(info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0",
            f"plain job {j}: {info.get('JobState')} exit {info.get('ExitCode')}")
    h.check("step00000150.h5" in ck and len(h.metrics("plain")) == 150 and
            "training finished" in log("plain"), f"final checkpoint and metrics written: {ck}")

    # 2. Preemption: SIGUSR1 to the batch script mid-run -> checkpoint, 85, requeue, resume.
    j = submit(c, "preempt")
    h.check(rows_when("preempt", 10), "preempt job is training")
    c.run(["scancel", "--batch", "--signal=USR1", j])
    release_requeued(j)
    info = c.wait(j, timeout=900)
    text = log("preempt")
    h.check(info.get("JobState") == "COMPLETED" and info.get("Restarts") == "1",
            f"preempted job {j}: {info.get('JobState')}, restarts {info.get('Restarts')}")
    h.check("exit code 85 (requeue)" in text and "requeueing job" in text and
            "resuming from" in text, "it checkpointed, exited 85, requeued and resumed")
    h.check(h.losses("preempt") == h.losses("plain"),
            "the preempted and requeued run has the uninterrupted run's losses, bit for bit")

    # 3. A cancel: SIGTERM -> checkpoint, 86, no requeue.
    j = submit(c, "cancel")
    h.check(rows_when("cancel", 10), "cancel job is training")
    c.run(["scancel", j])
    info = c.wait(j)
    deadline = time.time() + 60  # the script's last lines land after the job state changes
    while time.time() < deadline and "requeued" not in log("cancel"):
        time.sleep(0.5)
    text = log("cancel")
    latest = open(h.path("cancel", "ckpt", "latest")).read().strip() \
        if os.path.exists(h.path("cancel", "ckpt", "latest")) else ""
    h.check(info.get("JobState") == "CANCELLED" and info.get("Restarts") == "0",
            f"cancelled job {j}: {info.get('JobState')}, restarts {info.get('Restarts')}")
    h.check("exit code 86" in text and "checkpointed after a cancel" in text and
            latest.startswith("step"),
            f"it checkpointed ({latest}) and exited 86 without a requeue")

    # 4. mpirun inside the allocation instead of srun.
    j = c.sbatch(["-n", "2", "--job-name=mpirun", "--output=mpirun.out", SBATCH, "job.deck",
                  "--output.dir=mpirun", "--checkpoint.dir=mpirun/ckpt", "--train.max_steps=20"],
                 cwd=work, env=dict(ENV, KMOE_LAUNCH="mpirun"))
    info = c.wait(j)
    h.check(info.get("JobState") == "COMPLETED" and
            h.losses("mpirun") == h.losses("plain")[:20],
            f"KMOE_LAUNCH=mpirun: {info.get('JobState')}, the plain run's first 20 losses")
    # ... and cancelled: mpirun aborts a job on SIGTERM, so the script sends SIGUSR2, and the
    # exit code kmoe reports is the job's, whatever mpirun returns.
    j = c.sbatch(["-n", "2", "--job-name=mpicancel", "--output=mpicancel.out", SBATCH,
                  "job.deck", "--output.dir=mpicancel", "--checkpoint.dir=mpicancel/ckpt"],
                 cwd=work, env=dict(ENV, KMOE_LAUNCH="mpirun"))
    h.check(rows_when("mpicancel", 10), "the mpirun job is training")
    c.run(["scancel", j])
    info = c.wait(j)
    deadline = time.time() + 60
    while time.time() < deadline and "requeued" not in log("mpicancel"):
        time.sleep(0.5)
    text = log("mpicancel")
    latest = open(h.path("mpicancel", "ckpt", "latest")).read().strip() \
        if os.path.exists(h.path("mpicancel", "ckpt", "latest")) else ""
    # (mpirun, signalled by the cancel too, may drop kmoe's own last lines and return 1.)
    h.check(("exit code 86" in text or "stopped with 86" in text) and
            "checkpointed after a cancel" in text and latest.startswith("step"),
            f"KMOE_LAUNCH=mpirun, cancelled: it checkpointed ({latest}) and the job reports 86: "
            f"{text[-400:]}")

    # 5. A start-up that fails (a rank crashes while the ranks join: KMOE_FAULT=startup_crash,
    # first run only) is transient: exit 75, named, requeued by the script; the restart
    # trains to the end.
    j = c.sbatch(["-n", "2", "--job-name=startup", "--output=startup.out", SBATCH, "job.deck",
                  "--output.dir=startup", "--checkpoint.dir=startup/ckpt", "--train.max_steps=20"],
                 cwd=work, env=dict(ENV, KMOE_FAULT="startup_crash:1"))
    release_requeued(j)
    info = c.wait(j, timeout=600)
    text = log("startup")
    h.check(info.get("JobState") == "COMPLETED" and info.get("Restarts") == "1" and
            "world rank 1 of 2 on node" in text and
            "SIGSEGV (Segmentation fault) during start-up: the first barrier" in text and
            "start-up failed (exit code 75, transient); requeueing job" in text and
            "world rank 0 of 2 on node" in text.split("SIGSEGV", 1)[-1] and
            "ending now (the ranks had not joined" in text and
            h.losses("startup") == h.losses("plain")[:20],
            f"a crash in start-up: named, exit 75, requeued, then trained to the end: "
            f"{info.get('JobState')}, restarts {info.get('Restarts')}\n" + text[-1500:])

    # 6. The allocation must match the grid.
    j = submit(c, "mismatch", sbatch_args=("-n", "1"))
    info = c.wait(j)
    h.check(info.get("JobState") == "FAILED" and "the deck needs 2 ranks" in log("mismatch"),
            f"1 task for a 2-rank grid is refused: {info.get('JobState')}")
finally:
    c.stop()
h.finish()
