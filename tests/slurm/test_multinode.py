#!/usr/bin/python3
"""kmoe across nodes: slurm/train.sbatch on a Slurm cluster of network-namespace nodes
(tests/slurm/slurm_cluster.py), Open MPI held to its TCP transport:
  1. the nodes are separate: one task per node sees its own network namespace and address;
  2. a job across all nodes completes, and its losses equal the same deck's on one node
     (mpiexec, the same layout), bit for bit: on 2 nodes a dp 2 x ep 2 grid at 2 ranks a node,
     launched with srun --mpi=pmix and again with Open MPI's mpirun inside the allocation
     (KMOE_LAUNCH=mpirun); on 3 nodes dp 3 at one rank a node (global batch 12);
  3. nothing is left afterwards: no namespace, bridge, daemon or /run directory.
Skipped, by name, where network namespaces cannot be made (not root, a container without the
capability). Usage: test_multinode.py BIN_DIR WORK_DIR MPIEXEC [NODES (2 or 3)]
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from kmoe_testlib import Harness, counting_documents, grid_test_deck  # noqa: E402
from slurm_cluster import NETNS_NET, SlurmCluster, netns_available  # noqa: E402

bin_dir, work, mpiexec = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
nodes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
h = Harness(bin_dir, work, mpiexec)
why = netns_available()
if why:
    h.skip(f"the {nodes}-node Slurm job", why)
    h.finish()

h.prepare_corpus(counting_documents(4000))
# 2 nodes: dp 2 x ep 2 at 2 ranks a node; 3 nodes: dp 3 at one rank a node (the global batch
# a multiple of dp x micro-batch).
per_node, grid, extra = (2, "dp = 2\nep = 2", []) if nodes == 2 else \
    (1, f"dp = {nodes}", ["--train.global_batch=12"])
h.write("job.deck", grid_test_deck("max_steps = 12", f"""
[parallel]
{grid}
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

c = SlurmCluster(os.path.join(work, "cluster"), nodes=nodes)
try:
    c.start()
    # 1. One task a node: each in its own namespace, with its node's address.
    p = c.run(["srun", f"-N{nodes}", f"-n{nodes}", "sh", "-c",
               "echo $SLURMD_NODENAME $(readlink /proc/self/ns/net) "
               "$(ip -4 -o addr show eth0 | awk '{print $4}')"], check=False)
    seen = sorted(line for line in p.stdout.split("\n") if line.strip())
    h.check(p.returncode == 0 and len({line.split()[1] for line in seen}) == nodes and
            [line.split()[0] for line in seen] == [f"n{i}" for i in range(1, nodes + 1)],
            f"srun -N{nodes}: one task in each node's own network namespace ({seen})")

    # 2. The grid across the nodes, against the same deck on one node.
    h.run(["kmoe-train", "-i", "job.deck", "--output.dir=one", "--checkpoint.dir=one/ckpt",
           *extra], ranks=nodes * per_node)

    def losses(name):
        return h.losses(name) if os.path.exists(h.path(name, "metrics.csv")) else []

    one = losses("one")
    launches = [("srun", {})] + ([("mpirun", {"KMOE_LAUNCH": "mpirun"})] if nodes == 2 else [])
    for name, launch in launches:
        j = c.sbatch([f"-N{nodes}", f"--ntasks-per-node={per_node}", f"--job-name={name}",
                      f"--output={name}.out", SBATCH, "job.deck", f"--output.dir={name}",
                      f"--checkpoint.dir={name}/ckpt", *extra], cwd=work, env=dict(ENV, **launch))
        info = c.wait(j, timeout=600)
        text = open(h.path(f"{name}.out")).read() if os.path.exists(h.path(f"{name}.out")) else ""
        ok = info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0"
        h.check(ok, f"{nodes}-node job launched with {name}: {info.get('JobState')} exit "
                    f"{info.get('ExitCode')} on {info.get('NodeList')}" +
                    ("" if ok else "\n" + text[-2000:]))
        h.check(info.get("NodeList") == f"n[1-{nodes}]",
                f"it ran on every node ({info.get('NodeList')})")
        got = losses(name)
        h.check(len(got) == 12 and got == one,
                f"its losses equal the one-node run's, bit for bit ({len(got)} steps, last "
                f"{got[-1] if got else None} / {one[-1] if one else None})")
finally:
    c.stop()
left = c.leftovers()
h.check(left == "", f"nothing left after the cluster stopped ({left or 'clean'})")
h.finish()
