"""A private one-node Slurm for tests: munged, slurmctld and slurmd from Debian's slurm-wlm and
munge, with every file (key, sockets, configuration, state, logs) in a temporary directory and
only loopback traffic. Needs root (slurmd runs jobs as their users). `stop()` ends exactly the
daemons this object started. Unix socket paths may not exceed 107 bytes and slurm.conf values
may not hold spaces, so the daemons' files live in a short directory under /tmp, whatever the
work directory's path; `stop()` copies their logs to <work>/log and removes it.

    with SlurmCluster(work_dir) as c:
        job = c.sbatch(["slurm/train.sbatch", "deck"], cwd=...)
        c.wait(job)

With nodes=N (N >= 2) the cluster has N nodes n1..nN, each a network namespace
(kmoe-ns-n<i>, one veth into a bridge that exists only for the test, an address of
10.211.0.0/24) whose slurmd is started with nsenter (`ip netns exec` remounts /sys and hides the
cgroup tree slurmd needs); each node has its own TmpFS (Slurm's PMIx directories would collide
in a shared /tmp). munged and slurmctld run outside, on the bridge's address. Their files live
under /run/kmoe-ns-*, by which the daemons, namespaces and bridge an earlier run left (a ctest
timeout kills without cleanup) are found and removed at start; `stop()` removes this run's and
`leftovers()` says what remains.
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


NETNS_TAG = "kmoe-ns"  # namespace kmoe-ns-n<i>, bridge kmoe-ns-br, daemon dirs /run/kmoe-ns-*
NETNS_NET = "10.211.0"


def _sh(cmd, check=True):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p


def netns_available():
    """'' when this process may create network namespaces and bridges, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"{NETNS_TAG}-probe"
    p = _sh(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return "ip netns add: " + p.stderr.strip()
    _sh(["ip", "netns", "del", probe], check=False)
    p = _sh(["ip", "link", "add", f"{NETNS_TAG}-pb", "type", "bridge"], check=False)
    if p.returncode != 0:
        return "ip link add type bridge: " + p.stderr.strip()
    _sh(["ip", "link", "del", f"{NETNS_TAG}-pb"], check=False)
    return ""


def _netns_processes():
    """pids of daemons started from a /run/kmoe-ns-* directory."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/run/{NETNS_TAG}-" in cmd and os.path.basename(cmd.split(" ")[0]) in (
                "munged", "slurmctld", "slurmd", "slurmstepd"):
            pids.append(int(pid))
    return pids


def _netns_names():
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NETNS_TAG + "-")]


def _netns_links():
    """The test's links left in this namespace: the bridge, and node veths whose namespace
    outlives its name while the kernel still holds it (sockets of a cut connection)."""
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.split(":")[1].strip().startswith(NETNS_TAG + "-")]


def sweep_netns():
    """Removes what an earlier namespace cluster left: daemons, namespaces, bridge, files."""
    for pid in _netns_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for ns in _netns_names():
        _sh(["ip", "netns", "del", ns], check=False)
    for link in _netns_links():
        _sh(["ip", "link", "del", link], check=False)
    for d in os.listdir("/run"):
        if d.startswith(NETNS_TAG + "-"):
            shutil.rmtree(os.path.join("/run", d), ignore_errors=True)


class SlurmCluster:
    def __init__(self, work, cpus=None, nodes=None, kill_wait=30, failover=None):
        self.work = os.path.abspath(work)
        self.kill_wait = kill_wait  # seconds between a job's SIGTERM and its SIGKILL
        # A lost node seen in seconds: {slurmd_timeout (before slurmctld marks a silent node
        # DOWN; Slurm's default 300), message_timeout (an RPC's; 10), requeue_delay (before a
        # requeued job may start; AuthInfo's cred_expire, 120), sched_interval (between passes
        # of the scheduler; 60)}; None: Slurm's defaults.
        self.failover = failover
        self.dir = None  # the short directory, made by start()
        self.cpus = cpus or os.cpu_count()
        self.nodes = nodes  # None: one node on loopback; N: N namespace nodes
        self.procs = {}  # name -> pid file
        self.env = None

    # -------------------------------------------------------------------- daemons
    def _make_network(self):
        sweep_netns()
        br = f"{NETNS_TAG}-br"
        _sh(["ip", "link", "add", br, "type", "bridge"])
        _sh(["ip", "addr", "add", f"{NETNS_NET}.1/24", "dev", br])
        _sh(["ip", "link", "set", br, "up"])
        for i in range(1, self.nodes + 1):
            ns, veth = f"{NETNS_TAG}-n{i}", f"{NETNS_TAG}-v{i}"
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "link", "set", veth, "master", br])
            _sh(["ip", "link", "set", veth, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{NETNS_NET}.{10 + i}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])

    def leftovers(self, work=None):
        """What a stopped namespace cluster left behind, as text ('' when nothing); with `work`,
        processes whose working directory is in it count too."""
        left = []
        if work:
            stray = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                except OSError:
                    continue
                if cwd == work or cwd.startswith(work.rstrip("/") + "/"):
                    stray.append(pid)
            if stray:
                left.append("processes " + " ".join(stray))
        if _netns_names():
            left.append("namespaces " + " ".join(_netns_names()))
        if _netns_processes():
            left.append("daemons " + " ".join(map(str, _netns_processes())))
        if _netns_links():
            left.append("links " + " ".join(_netns_links()))
        if any(d.startswith(NETNS_TAG + "-") for d in os.listdir("/run")):
            left.append("a /run directory")
        return ", ".join(left)

    def start(self):
        if self.nodes:
            self._make_network()
            d = self.dir = tempfile.mkdtemp(prefix=NETNS_TAG + "-", dir="/run")
        else:
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
        fo = self.failover
        if self.nodes:
            names = [f"n{i}" for i in range(1, self.nodes + 1)]
            ctld_addr, spool, slurmd_pid, slurmd_log = (f"{NETNS_NET}.1", f"{d}/spool-%n",
                                                        f"{d}/slurmd-%n.pid",
                                                        f"{d}/log/slurmd-%n.log")
            node_lines = "".join(
                f"NodeName={n} NodeAddr={NETNS_NET}.{10 + i} CPUs={self.cpus} "
                f"RealMemory={mem} State=UNKNOWN\n" for i, n in enumerate(names, 1))
            tmpfs = f"{d}/%n/tmp"
            partition = f"PartitionName=test Nodes={','.join(names)} Default=YES " \
                        "MaxTime=INFINITE State=UP OverSubscribe=NO"
        else:
            ctld_addr, spool, slurmd_pid, slurmd_log = ("127.0.0.1", f"{d}/spool",
                                                        f"{d}/slurmd.pid", f"{d}/log/slurmd.log")
            node_lines = (f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} "
                          f"RealMemory={mem} State=UNKNOWN\n")
            tmpfs = "/tmp"
            partition = f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE " \
                        "State=UP OverSubscribe=NO"
        with open(conf, "w") as f:
            f.write(f"""# kmoe test cluster ({self.nodes or 1} node(s))
ClusterName=kmoetest
SlurmctldHost={host}({ctld_addr})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}{f",cred_expire={fo['requeue_delay']}" if fo else ""}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={spool}
TmpFS={tmpfs}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={slurmd_pid}
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={slurmd_log}
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
KillWait={self.kill_wait}
{f"SlurmdTimeout={fo['slurmd_timeout']}" if fo else ""}
{f"MessageTimeout={fo['message_timeout']}" if fo else ""}
{f"SchedulerParameters=sched_interval={fo['sched_interval']}" if fo else ""}
MinJobAge=3600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldParameters=enable_configless
{node_lines}{partition}
""")
        self.env = dict(os.environ, SLURM_CONF=conf)
        self._daemon("slurmctld", ["slurmctld", "-f", conf, "-i"], os.path.join(d, "slurmctld.pid"))
        if self.nodes:
            for i, n in enumerate(names, 1):
                tmp = os.path.join(d, n, "tmp")
                os.makedirs(tmp, mode=0o1777)
                os.chmod(tmp, 0o1777)
                self._daemon(f"slurmd {n}", [
                    "nsenter", f"--net=/var/run/netns/{NETNS_TAG}-n{i}", "slurmd", "-f", conf,
                    "-N", n], os.path.join(d, f"slurmd-{n}.pid"))
        else:
            self._daemon("slurmd", ["slurmd", "-f", conf], os.path.join(d, "slurmd.pid"))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.split()
            if out and all(t in ("idle", "mix", "alloc") for t in out):
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
        """Stops the daemons this cluster started (slurmd, slurmctld, munged), nothing else, and
        removes its namespaces and bridge."""
        slurmds = [n for n in self.procs if n.startswith("slurmd")]
        for name in (*slurmds, "slurmctld", "munged"):
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
        if self.nodes:
            sweep_netns()

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
