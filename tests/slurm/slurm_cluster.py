"""A private one-node Slurm for tests: munged, slurmctld and slurmd from Debian's slurm-wlm and
munge, with every file (key, sockets, configuration, state, logs) in a temporary directory and
only loopback traffic. Needs root (slurmd runs jobs as their users). `stop()` ends exactly the
daemons this object started. Unix socket paths may not exceed 107 bytes and slurm.conf values
may not hold spaces, so the daemons' files live in a short directory under /tmp, whatever the
work directory's path; `stop()` copies their logs to <work>/log and removes it.

    with SlurmCluster(work_dir) as c:
        job = c.sbatch(["slurm/train.sbatch", "deck"], cwd=...)
        c.wait(job)
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, work, cpus=None):
        self.work = os.path.abspath(work)
        self.dir = None  # the short directory, made by start()
        self.cpus = cpus or os.cpu_count()
        self.procs = {}  # name -> pid file
        self.env = None

    # -------------------------------------------------------------------- daemons
    def start(self):
        d = self.dir = tempfile.mkdtemp(prefix="kmoe-slurm-", dir="/tmp")
        for sub in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(os.path.join(d, "munge"), 0o700)
        self.munge_socket = os.path.join(d, "munge", "munge.socket")
        self._daemon("munged", ["munged", "--key-file", key, "--socket", self.munge_socket,
                                "--pid-file", os.path.join(d, "munge", "munged.pid"),
                                "--log-file", os.path.join(d, "log", "munged.log"),
                                "--seed-file", os.path.join(d, "munge", "seed"), "--force"],
                     os.path.join(d, "munge", "munged.pid"))
        host = socket.gethostname()
        mem = self._memory_mib()
        conf = os.path.join(d, "slurm.conf")
        with open(conf, "w") as f:
            f.write(f"""# kmoe test cluster (one node, loopback only)
ClusterName=kmoetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldParameters=enable_configless
NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        self.env = dict(os.environ, SLURM_CONF=conf)
        self._daemon("slurmctld", ["slurmctld", "-f", conf, "-i"], os.path.join(d, "slurmctld.pid"))
        self._daemon("slurmd", ["slurmd", "-f", conf], os.path.join(d, "slurmd.pid"))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm did not come up (sinfo: {out!r}); logs in {d}/log")

    def _memory_mib(self):
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return max(512, kib // 1024 // 2)

    def _daemon(self, name, cmd, pid_file):
        p = subprocess.run(cmd, env=self.env or os.environ, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{name} failed to start: {p.stderr.strip()}")
        deadline = time.time() + 20
        while time.time() < deadline and not os.path.exists(pid_file):
            time.sleep(0.1)
        if not os.path.exists(pid_file):
            raise RuntimeError(f"{name} wrote no pid file {pid_file}")
        self.procs[name] = pid_file

    def stop(self):
        """Stops the daemons this cluster started (slurmd, slurmctld, munged), nothing else."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.procs.pop(name, None)
            if not pid_file or not os.path.exists(pid_file):
                continue
            with open(pid_file) as f:
                pid = int(f.read().strip())
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        if self.dir:
            shutil.copytree(os.path.join(self.dir, "log"), os.path.join(self.work, "log"),
                            dirs_exist_ok=True)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -------------------------------------------------------------------- clients
    def run(self, cmd, check=True, cwd=None):
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, cwd=cwd)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
        return p

    def sbatch(self, args, cwd, env=None):
        p = subprocess.run(["sbatch", "--parsable", *args], env=dict(self.env, **(env or {})),
                           capture_output=True, text=True, cwd=cwd)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout.strip().split(";")[0]

    def job(self, job_id):
        """scontrol's fields of the job as a dict ({} once it is gone)."""
        p = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        fields = {}
        for item in p.stdout.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields[k] = v
        return fields

    def wait(self, job_id, timeout=600, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                               "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")):
        deadline = time.time() + timeout
        while time.time() < deadline:
            j = self.job(job_id)
            if j.get("JobState") in until:
                return j
            time.sleep(0.5)
        raise RuntimeError(f"job {job_id} still {self.job(job_id).get('JobState')} after "
                           f"{timeout} s")
