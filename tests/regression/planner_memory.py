#!/usr/bin/python3
"""The dry run's memory estimate against the measured high-water memory: every deck in inputs/
runs 2 steps on its own grid (validation at the end on 8 instances), and the largest rank's
estimate with the runtime (`kmoe-train --dry-run`) must be within 15% of the largest
`mem_hwm_mib` the run's metrics.csv reports. Prints both side by side. --skip NAME,...
leaves decks out (CI leaves out the model variants that tiny_moe_engram's MoE + Engram already
covers: tiny_engram, tiny_moe, tiny_moe_hf; ctest planner_memory_long, label long, runs all).
The main job's deck runs a second time with its Engram table in host memory
(engram.offload = host): there the estimate is the device and host parts together.
Usage: planner_memory.py BIN_DIR WORK_DIR MPIEXEC [--skip NAME,...]
"""
import glob
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kmoe_testlib import Harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 0.15

h = Harness(sys.argv[1], sys.argv[2], mpiexec=sys.argv[3])
SKIP = set(sys.argv[5].split(",")) if len(sys.argv) > 5 and sys.argv[4] == "--skip" else set()
h.run(["kmoe-prep", "--fortunes", "--out-dir", "data/fortunes"])
print(f"{'deck':32s} {'ranks':>5s} {'estimate MiB':>12s} {'measured MiB':>12s} {'error':>7s}")
RUNS = [(d, os.path.basename(d)[:-5], []) for d in sorted(glob.glob(os.path.join(ROOT, "inputs",
                                                                                 "*.deck")))]
RUNS.append((os.path.join(ROOT, "inputs", "tiny_moe_engram.deck"), "tiny_moe_engram+offload",
             ["--engram.offload=host"]))
for deck, name, extra in RUNS:
    if name in SKIP:
        continue
    dry = h.run(["kmoe-train", "-i", deck, "--dry-run", *extra])
    estimate = re.search(r"the largest share.* ([0-9.]+) MiB with the runtime", dry.stdout)
    grid = h.run(["kmoe-train", "-i", deck, "--print-grid"])
    ranks = re.search(r"ranks (\d+)", grid.stdout)
    if not h.check(estimate is not None and ranks is not None, f"{name}: estimate and grid"):
        continue
    # No checkpoint at the end: the metrics row with the high-water is written before a save.
    # Two steps: the high-water is reached in the first, where the optimizer's moments are
    # made (olmoe_shape logs steps 1-3 at the same figure; tiny_moe_engram_dp2's step 1 and
    # step 3 both read 505 MiB); the second step shows that nothing grows after it.
    h.run(["kmoe-train", "-i", deck, *extra, "--train.max_steps=2", "--train.eval_instances=8",
           "--train.eval_every=0", "--checkpoint.every=0", "--checkpoint.at_end=false",
           "--checkpoint.resume=none",
           f"--output.dir={name}", f"--checkpoint.dir={name}/ckpt"], ranks=int(ranks.group(1)))
    measured = max(float(r["mem_hwm_mib"]) for r in h.metrics(name))
    est = float(estimate.group(1))
    err = (est - measured) / measured
    print(f"{name:32s} {ranks.group(1):>5s} {est:12.1f} {measured:12.1f} {100 * err:+6.1f}%")
    h.check(abs(err) <= TOLERANCE, f"{name}: the estimate within {TOLERANCE:.0%} of the measured "
            f"high-water ({est:.1f} vs {measured:.1f} MiB)")
h.finish()
