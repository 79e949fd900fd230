#!/usr/bin/python3
"""kmoe across nodes: slurm/train.sbatch on a Slurm cluster of 2 network-namespace nodes
(tests/slurm/slurm_cluster.py, nodes=2), Open MPI held to its TCP transport:
  1. the nodes are separate: one task per node sees its own network namespace and address;
  2. a dp 2 x ep 2 job at 2 ranks a node (srun --mpi=pmix) completes, and its losses equal the
     same deck's on one node (mpiexec, the same layout), bit for bit;
  3. nothing is left afterwards: no namespace, bridge, daemon or /run directory.
Skipped, by name, where network namespaces cannot be made (not root, a container without the
capability). Usage: test_multinode.py BIN_DIR WORK_DIR MPIEXEC
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from kmoe_testlib import Harness, counting_documents, grid_test_deck  # noqa: E402
from slurm_cluster import NETNS_NET, SlurmCluster, netns_available  # noqa: E402

bin_dir, work, mpiexec = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
h = Harness(bin_dir, work, mpiexec)
why = netns_available()
if why:
    h.skip("the 2-node Slurm job", why)
    h.finish()

h.prepare_corpus(counting_documents(4000))
h.write("job.deck", grid_test_deck("max_steps = 12", """
[parallel]
dp = 2
ep = 2
[checkpoint]
every = 6
[output]
log_every = 1
"""))
# TCP only, on the test's network: between namespaces there is no other way, and Open MPI,
# seeing one host name everywhere, would otherwise take shared memory for the node's pairs.
TCP = {"OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": f"{NETNS_NET}.0/24",
       "OMPI_MCA_oob_tcp_if_include": f"{NETNS_NET}.0/24"}
ENV = dict(TCP, KMOE_BUILD=os.path.dirname(bin_dir))  # bin_dir is <build>/drivers
SBATCH = os.path.join(ROOT, "slurm", "train.sbatch")

c = SlurmCluster(os.path.join(work, "cluster"), nodes=2)
try:
    c.start()
    # 1. One task a node: two namespaces, the nodes' addresses.
    p = c.run(["srun", "-N2", "-n2", "sh", "-c",
               "echo $SLURMD_NODENAME $(readlink /proc/self/ns/net) "
               "$(ip -4 -o addr show eth0 | awk '{print $4}')"], check=False)
    seen = sorted(p.stdout.split("\n")[:2])
    h.check(p.returncode == 0 and len({line.split()[1] for line in seen if line}) == 2 and
            [line.split()[0] for line in seen] == ["n1", "n2"],
            f"srun -N2: one task in each node's own network namespace ({seen})")

    # 2. The grid across both nodes.
    j = c.sbatch(["-N2", "--ntasks-per-node=2", "--job-name=two", "--output=two.out", SBATCH,
                  "job.deck", "--output.dir=two", "--checkpoint.dir=two/ckpt"], cwd=work, env=ENV)
    info = c.wait(j, timeout=600)
    text = open(h.path("two.out")).read() if os.path.exists(h.path("two.out")) else ""
    h.check(info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0",
            f"2-node job {j}: {info.get('JobState')} exit {info.get('ExitCode')} "
            f"on {info.get('NodeList')}" + ("" if info.get("JobState") == "COMPLETED"
                                            else "\n" + text[-2000:]))
    h.check(info.get("NodeList") == "n[1-2]", f"it ran on both nodes ({info.get('NodeList')})")
    h.run(["kmoe-train", "-i", "job.deck", "--output.dir=one", "--checkpoint.dir=one/ckpt"],
          ranks=4)
    def losses(name):
        return h.losses(name) if os.path.exists(h.path(name, "metrics.csv")) else []
    two, one = losses("two"), losses("one")
    h.check(len(two) == 12 and two == one,
            "the 2-node run's losses equal the one-node run's, bit for bit "
            f"({len(two)} steps, last {two[-1] if two else None} / {one[-1] if one else None})")
finally:
    c.stop()
left = c.leftovers()
h.check(left == "", f"nothing left after the cluster stopped ({left or 'clean'})")
h.finish()
