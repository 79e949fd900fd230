#!/usr/bin/python3
"""Checks kmoe-train against the independent float64 PyTorch reference (kmoe_reference.py).

Runs a tiny 3-step training with kmoe (initial and final checkpoints, dumps of steps 1-3), then:
  1. the step-0 weights follow CONVENTIONS.md's initialization bit for bit;
  2. step 1: loss (and its CE/aux parts, lr, grad norm) within 1e-4 relative of the reference
     on the same weights and tokens, and every gradient tensor within 1e-4 with RUNTIME.md
     section 5's measure ||a - b|| / max(||b||, 1e-6 ||g_global||);
  3. 3 reference AdamW steps from the step-0 checkpoint on the dumped batches: the losses of
     steps 2 and 3 within 1e-4 relative, and per tensor theta_3 - theta_0 (and the step-3
     AdamW moments) within 1e-3 of kmoe's step-3 checkpoint, same measure.
With --experts E > 0 the deck gets a [moe] section. The reference then routes every step with
kmoe's dumped choices (/route/<layer>) and checks them against its own float64 top-k: a token
may be routed differently only where the scores involved are within 1e-5 (RUNTIME.md section 5).
Usage: check_reference.py BIN_DIR WORK_DIR [--block-norm reordered|pre] [--kv-heads N] [--tie]
         [--z-coef X] [--experts E --top-k K --expert-hidden FE [--score softmax|sigmoid]
         [--normalize] [--capacity X] [--shared S --shared-hidden FS] [--dense-layers L,..]
         [--lb-coef X] [--router-z-coef X]]
         [--engram-layers L,.. [--engram-gate sigmoid|signed_sqrt] [--engram-ngram N]
         [--engram-heads K] [--engram-embed DE] [--engram-table-size S,..] [--engram-kernel W]
         [--engram-fold M]] [--precision fp32|bf16] [--document-mask]
         [--sliding-window W [--window-layers L,..]] [--attention auto|tiled|fused] [--reuse]
   or: check_reference.py BIN_DIR WORK_DIR --case NAME OPTIONS... [--case NAME OPTIONS...]
       (each case in WORK_DIR/NAME, one process: ctest's reference groups)
With --engram-layers the deck gets an [engram] section; --engram-fold M writes a compression map
folding token ids mod M (engram.compression_map).
With --precision bf16 (train.precision, MODEL.md section 8) the reference rounds the same
products' inputs. A bf16 product amplifies any difference in its inputs that moves a value
across a rounding boundary, so two correct bf16 runs differ by far more than two fp32 runs, and
by how much depends on the data, the model and the machine's summation orders. The tolerances
are therefore measured in each run: the reference against itself, BF16_SAMPLES times with its
step-0 weights perturbed by fp32's rounding (relative 2^-24, random signs), gives the noise
floor of each compared quantity (the largest tensor error of the step-1 gradients, of
theta_3 - theta_0 and of the step-3 moments); kmoe must stay within BF16_MARGIN x that floor
(4-5e-3 measured for the step-1 gradients, 3e-2 to 1e-1 for the step-3 quantities, which
AdamW's normalized steps and the routes of near-ties spread). A route may differ from the
reference's top-k where the two scores are within 2 x BF16_MARGIN x the router scores' measured
spread (a near-tie). kmoe must also sit at most BF16_POWER x as far from the bf16
reference as from the fp32 one (largest tensor error), so the check fails for a run that did not
compute in bf16.
"""
import argparse
import math
import os
import sys
import traceback

import h5py
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
import kmoe_reference as ref  # noqa: E402
from kmoe_testlib import Harness, counting_documents  # noqa: E402

GRAD_TOL, LOSS_TOL, DELTA_TOL = 1e-4, 1e-4, 1e-3
BF16_LOSS_TOL, BF16_POWER = 2e-4, 0.5
BF16_SAMPLES, BF16_MARGIN = 2, 5.0  # perturbed reference runs; tolerance = margin x their floor
# Near-ties of a bf16 run (RUNTIME.md section 5): 2 x BF16_MARGIN x the router scores' measured
# spread between the perturbed references.
h = None  # the Harness, set in main()


def check(cond, what):
    return h.check(cond, what)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def tensor_errors(a, b):
    """{name: ||a - b|| / max(||b||, 1e-6 ||b_global||)} (b the reference)."""
    glob = math.sqrt(sum(float(t.pow(2).sum()) for t in b.values()))
    return {n: float((a[n] - b[n]).norm()) / max(float(b[n].norm()), 1e-6 * glob) for n in b}


def table(title, errs, a, b, tol):
    """Prints each tensor's error against its tolerance (a number, or {name: tolerance}) and
    returns the largest ratio error / tolerance."""
    print(f"  {title}:\n    {'tensor':<32} {'|kmoe|':>11} {'|ref|':>11} {'rel err':>9} "
          f"{'tolerance':>9}")
    worst = 0.0
    for n, e in errs.items():
        t = tol[n] if isinstance(tol, dict) else tol
        flag = "" if e <= t else "  <-- over"
        print(f"    {n:<32} {float(a[n].norm()):11.4e} "
              f"{float(b[n].norm()):11.4e} {e:9.2e} {t:9.2e}{flag}")
        worst = max(worst, e / t)
    return worst


def read_tensors(f, group, names):
    return ref.read_group(f, group, names)


def read_routes(f, cfg, what):
    """{MoE layer: int64 [G*T, k]} of a dump's /route/<layer> (MoE decks only)."""
    routes = {}
    for l in cfg.moe_layers:
        key = f"route/{l}"
        if not check(key in f, f"{what} has /{key}"):
            continue  # the reference routes by its own top-k; the other checks still run
        r = torch.from_numpy(np.asarray(f[key], dtype=np.int64))
        check(tuple(r.shape) == (cfg.G * cfg.T, cfg.k), f"{what} /{key} shape {tuple(r.shape)}")
        routes[l] = r
    return routes


def check_routes(step, stats, cfg):
    """kmoe's routes are valid and agree with the reference's top-k except at near-ties."""
    for l in cfg.moe_layers:
        st = stats.get(l, ref.RouteStats())
        print(f"  step {step} layer {l} routes: {st}")
        check(st.invalid == 0 and st.unexplained == 0,
              f"step-{step} layer-{l} routes: {st.differ} of {st.tokens} tokens differ from the "
              f"reference's top-k, {st.unexplained} beyond a {ref.TIE_TOL:g} near-tie, "
              f"{st.invalid} invalid")
        if step == 1 and cfg.capacity_factor > 0:  # the test exercises the capacity path
            check(st.dropped > 0, f"step-1 layer-{l} capacity drops {st.dropped} of "
                  f"{st.assignments} assignments")


def reference_run(ck0, dump, names, perturb_seed=None):
    """The reference's step-1 gradients and its state after 3 AdamW steps on kmoe's dumped
    batches and routes, from the step-0 checkpoint; perturb_seed: the weights first moved by
    fp32's rounding (relative 2^-24, random signs)."""
    _, model, opt, _ = ref.load_checkpoint(ck0)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    if perturb_seed is not None:
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for _, p in model.named_parameters():
                sign = torch.randint(0, 2, p.shape, generator=g, dtype=p.dtype) * 2 - 1
                p.mul_(1 + sign * 2.0 ** -24)
    grads1 = None
    ref.SCORES = []
    for s in (1, 2, 3):
        _, grads = ref.step_loss_and_grads(model, dump[s - 1]["tokens"], dump[s - 1]["routes"], {})
        grads1 = grads1 or grads
        opt.step(s, grads)
    scores, ref.SCORES = ref.SCORES, None
    delta = {n: p.detach() - theta0[n] for n, p in model.named_parameters()}
    return grads1, delta, opt.m, opt.v, scores


def bf16_noise_floor(ck0, dump, names):
    """Each tensor's error, per compared quantity, between the unperturbed reference and
    BF16_SAMPLES perturbed ones (the largest over the samples), and the step-1 gradient norm's
    relative difference."""
    base = reference_run(ck0, dump, names)
    floor = {"grad": {}, "delta": {}, "exp_avg": {}, "exp_avg_sq": {}, "norm": 0.0, "score": 0.0}
    norm = lambda g: math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))  # noqa: E731
    for seed in range(1, BF16_SAMPLES + 1):
        other = reference_run(ck0, dump, names, perturb_seed=seed)
        for key, a, b in zip(("grad", "delta", "exp_avg", "exp_avg_sq"), other, base):
            for n, e in tensor_errors(a, b).items():
                floor[key][n] = max(floor[key].get(n, 0.0), e)
        floor["norm"] = max(floor["norm"], rel(norm(other[0]), norm(base[0])))
        for a, b in zip(other[4], base[4]):  # router scores, every MoE forward of the 3 steps
            floor["score"] = max(floor["score"], float((a - b).abs().max()))
    return floor


def parse_case(argv):
    """One case's options (everything after BIN_DIR WORK_DIR, or after --case NAME)."""
    ap = argparse.ArgumentParser(prog="check_reference.py")
    ap.add_argument("--block-norm", default="reordered", choices=["reordered", "pre"])
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--z-coef", type=float, default=0.0, help="model.output_z_coef")
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=32)
    ap.add_argument("--score", default="softmax", choices=["softmax", "sigmoid"])
    ap.add_argument("--normalize", action="store_true", help="moe.normalize_topk")
    ap.add_argument("--capacity", type=float, default=0.0, help="moe.capacity_factor")
    ap.add_argument("--shared", type=int, default=0, help="moe.shared_experts")
    ap.add_argument("--shared-hidden", type=int, default=32)
    ap.add_argument("--dense-layers", default="", help="moe.dense_layers")
    ap.add_argument("--lb-coef", type=float, help="moe.lb_coef (omitted: kmoe's default)")
    ap.add_argument("--router-z-coef", type=float, help="moe.z_coef (omitted: kmoe's default)")
    ap.add_argument("--engram-layers", default="", help="engram.layers")
    ap.add_argument("--engram-gate", default="sigmoid", choices=["sigmoid", "signed_sqrt"])
    ap.add_argument("--engram-ngram", type=int, default=3, help="engram.max_ngram")
    ap.add_argument("--engram-heads", type=int, default=2)
    ap.add_argument("--engram-embed", type=int, default=16, help="engram.embed_per_ngram")
    ap.add_argument("--engram-table-size", default="", help="engram.table_size (small: collisions)")
    ap.add_argument("--engram-kernel", type=int, default=4)
    ap.add_argument("--engram-fold", type=int, default=0, help="compression map: id mod M")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="train.precision")
    ap.add_argument("--init", default="normal", choices=["normal", "fan_in"], help="model.init")
    ap.add_argument("--init-depth-scale", action="store_true", help="model.init_depth_scale")
    ap.add_argument("--init-gain", type=float, default=1.0, help="model.init_gain")
    ap.add_argument("--embed-init-std", type=float, help="model.embed_init_std (omitted: default)")
    ap.add_argument("--document-mask", action="store_true", help="train.document_mask")
    ap.add_argument("--attention", default="auto", choices=["auto", "tiled", "fused"],
                    help="train.attention (the attention core)")
    ap.add_argument("--seq-len", type=int, default=32, help="train.seq_len")
    ap.add_argument("--sliding-window", type=int, default=0, help="model.sliding_window")
    ap.add_argument("--window-layers", default="", help="model.window_layers (omitted: default)")
    ap.add_argument("--reuse", action="store_true",
                    help="skip kmoe-prep/kmoe-train and check the outputs already in WORK_DIR")
    return ap.parse_args(argv)


DEFAULTS = (LOSS_TOL, ref.TIE_TOL)  # what a bf16 case widens, restored for the next case


def run_case(bin_dir, work, args):
    """Trains and checks one case in WORK; ends in Harness.finish (SystemExit 0 or 1)."""
    global h, LOSS_TOL
    LOSS_TOL, ref.TIE_TOL = DEFAULTS
    ref.SCORES = None
    work = os.path.abspath(work)
    h = Harness(bin_dir, work, fresh=not args.reuse)
    if not args.reuse:
        prepare_and_train(args)
    os.chdir(work)  # deck paths (engram.compression_map) are relative to the run directory
    check_outputs(work)


def main():
    """check_reference.py BIN_DIR WORK_DIR OPTIONS... checks one case in WORK_DIR;
    check_reference.py BIN_DIR WORK_DIR --case NAME OPTIONS... [--case NAME OPTIONS...] checks
    each case in WORK_DIR/NAME in this one process (torch is imported once: 1.5 s of CPU a
    process), every case to its end whatever the others gave, and fails if any case failed."""
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    bin_dir, work, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if "--case" not in rest:
        run_case(bin_dir, work, parse_case(rest))
        return
    if rest[0] != "--case":
        sys.exit(f"check_reference.py: options before the first --case: {' '.join(rest)}")
    cases = []
    for a in rest:
        if a == "--case":
            cases.append([])
        else:
            cases[-1].append(a)
    if any(not c or c[0].startswith("-") for c in cases):
        sys.exit("check_reference.py: every --case needs a NAME before its options")
    names = [c[0] for c in cases]
    if len(set(names)) != len(names):
        sys.exit(f"check_reference.py: a case name given twice: {' '.join(names)}")
    parsed = [parse_case(c[1:]) for c in cases]  # a bad option fails before any case runs
    failed = []
    for case, args in zip(cases, parsed):
        name = case[0]
        print(f"=== case {name}: {' '.join(case[1:])}", flush=True)
        try:
            run_case(bin_dir, os.path.join(work, name), args)
            rc = 0
        except SystemExit as e:  # Harness.finish
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001: a case that raises fails, the others still run
            traceback.print_exc()
            rc = 1
        print(f"=== case {name}: {'passed' if rc == 0 else 'FAILED'}", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"{len(names) - len(failed)} of {len(names)} cases passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


def moe_section(args):
    if args.experts == 0:
        return ""
    lines = ["[moe]", f"experts = {args.experts}", f"top_k = {args.top_k}",
             f"expert_hidden = {args.expert_hidden}", f"score = {args.score}",
             f"normalize_topk = {'true' if args.normalize else 'false'}",
             f"capacity_factor = {args.capacity!r}", f"shared_experts = {args.shared}"]
    if args.shared:
        lines.append(f"shared_hidden = {args.shared_hidden}")
    if args.dense_layers:
        lines.append(f"dense_layers = {args.dense_layers}")
    if args.lb_coef is not None:
        lines.append(f"lb_coef = {args.lb_coef!r}")
    if args.router_z_coef is not None:
        lines.append(f"z_coef = {args.router_z_coef!r}")
    return "\n".join(lines) + "\n"


def engram_section(args):
    if not args.engram_layers:
        return ""
    lines = ["[engram]", f"layers = {args.engram_layers}", f"gate = {args.engram_gate}",
             f"max_ngram = {args.engram_ngram}", f"heads = {args.engram_heads}",
             f"embed_per_ngram = {args.engram_embed}", f"kernel = {args.engram_kernel}"]
    if args.engram_table_size:
        lines.append(f"table_size = {args.engram_table_size}")
    if args.engram_fold:
        with open(h.path("fold.bin"), "wb") as f:
            f.write(b"".join((v % args.engram_fold).to_bytes(4, "little") for v in range(320)))
        lines.append("compression_map = fold.bin")
    return "\n".join(lines) + "\n"


def prepare_and_train(args):
    h.prepare_corpus(counting_documents(3000))
    deck = f"""
[model]
vocab_size = 320
d_model = 64
n_layers = 2
n_heads = 4
n_kv_heads = {args.kv_heads}
ffn_hidden = 96
block_norm = {args.block_norm}
tie_embeddings = {'true' if args.tie else 'false'}
output_z_coef = {args.z_coef!r}
init = {args.init}
init_depth_scale = {'true' if args.init_depth_scale else 'false'}
init_gain = {args.init_gain!r}
{f"embed_init_std = {args.embed_init_std!r}" if args.embed_init_std else ""}
sliding_window = {args.sliding_window}
{f"window_layers = {args.window_layers}" if args.window_layers else ""}
[train]
seq_len = {args.seq_len}
global_batch = 8
micro_batch = 2
max_steps = 3
seed = 7
precision = {args.precision}
document_mask = {'true' if args.document_mask else 'false'}
attention = {args.attention}
[optimizer]
lr = 3e-3
warmup_steps = 2
[data]
paths = data/train.bin
[checkpoint]
dir = ckpt
save_initial = true
every = 3
[output]
dir = run
dump_step = 1, 2, 3
""" + moe_section(args) + engram_section(args)
    h.write("ref.deck", deck)
    if h.run(["kmoe-train", "-i", "ref.deck"]).returncode != 0:
        h.finish()


def check_outputs(work):
    global LOSS_TOL
    ck0, ck3 = (os.path.join(work, "ckpt", f"step{s:08d}.h5") for s in (0, 3))
    dumps = [os.path.join(work, "run", f"dump_step{s}.h5") for s in (1, 2, 3)]
    for p in [ck0, ck3] + dumps:
        check(os.path.exists(p), f"{os.path.relpath(p, work)} written")
    if not all(h.results):
        h.finish()

    cfg, model, opt, step0 = ref.load_checkpoint(ck0)
    check(step0 == 0, f"initial checkpoint has step 0 (got {step0})")
    print(f"train.precision = {cfg.precision}")
    names = [n for n, _ in model.named_parameters()]
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    # 1. initialization (CONVENTIONS.md), exact up to float32 rounding
    init = ref.Model(cfg)
    ref.init_model(init, cfg.seed)
    # CONVENTIONS.md gives float(std * z) computed in double: kmoe must match bit for bit.
    n_diff = n_all = 0
    worst = 0.0
    for n, p in init.named_parameters():
        d = (theta0[n] - p.detach()).abs()
        n_diff, n_all = n_diff + int((d > 0).sum()), n_all + d.numel()
        worst = max(worst, float((d / p.detach().abs().clamp_min(1e-30)).max()))
    check(n_diff == 0, f"step-0 weights equal the CONVENTIONS.md init bit for bit "
          f"({n_diff} of {n_all} elements differ, max rel {worst:.2e})")

    # 2. step 1 on the checkpoint's weights
    dump = []
    for p in dumps:
        with h5py.File(p, "r") as f:
            d = {k: f.attrs[k] for k in ("step", "loss", "ce", "aux", "grad_norm", "lr")}
            d["tokens"] = torch.from_numpy(np.asarray(f["batch/tokens"], dtype=np.int64))
            d["grad"] = read_tensors(f, "grad", names)
            d["routes"] = read_routes(f, cfg, os.path.basename(p))
            dump.append(d)
    d1 = dump[0]
    # Tolerances: fp32 runs the fixed ones above; bf16 runs each tensor's measured floor times
    # BF16_MARGIN, never below the fp32 tolerance.
    norm_tol = GRAD_TOL
    tol = {"grad": GRAD_TOL, "delta": DELTA_TOL, "exp_avg": DELTA_TOL, "exp_avg_sq": DELTA_TOL}
    if cfg.precision == "bf16":
        LOSS_TOL = BF16_LOSS_TOL
        floor = bf16_noise_floor(ck0, dump, names)
        # A route may differ where the two scores are closer than their difference between
        # kmoe and the reference: twice the measured score spread, with the margin.
        if cfg.moe_layers:
            ref.TIE_TOL = max(BF16_MARGIN * 2 * floor["score"], ref.TIE_TOL)
            print(f"bf16 router scores: largest spread {floor['score']:.2e} over the 3 steps; "
                  f"near-tie tolerance {ref.TIE_TOL:.2e}")
        for key in tol:
            tol[key] = {n: max(BF16_MARGIN * e, tol[key]) for n, e in floor[key].items()}
        norm_tol = max(BF16_MARGIN * floor["norm"], GRAD_TOL)
        print(f"bf16 noise floor (the reference against itself, {BF16_SAMPLES} perturbations of "
              f"its weights by fp32 rounding), largest over the tensors: "
              + ", ".join(f"{label} {max(floor[k].values()):.2e}" for k, label in
                          (("grad", "step-1 gradients"), ("delta", "theta_3 - theta_0"),
                           ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")))
              + f"; gradient norm {floor['norm']:.2e}; tolerance {BF16_MARGIN:g} x each "
              f"tensor's floor")
    check(tuple(d1["tokens"].shape) == (cfg.G, cfg.T), f"dump tokens shape {tuple(d1['tokens'].shape)}")
    stats = {}
    (loss, ce, aux), grads = ref.step_loss_and_grads(model, d1["tokens"], d1["routes"], stats)
    check_routes(1, stats, cfg)
    gnorm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    print(f"step 1: kmoe loss {d1['loss']:.10f} ce {d1['ce']:.10f} aux {d1['aux']:.3e} "
          f"norm {d1['grad_norm']:.8f} lr {d1['lr']:.6e}")
    print(f"        ref  loss {loss:.10f} ce {ce:.10f} aux {aux:.3e} "
          f"norm {gnorm:.8f} lr {ref.lr_at(1, cfg):.6e}")
    check(rel(d1["loss"], loss) <= LOSS_TOL, f"step-1 loss rel err {rel(d1['loss'], loss):.2e}")
    check(rel(d1["ce"], ce) <= LOSS_TOL, f"step-1 CE rel err {rel(d1['ce'], ce):.2e}")
    aux_err = abs(d1["aux"] - aux)
    check(aux_err <= LOSS_TOL * max(abs(aux), 1e-6 * abs(loss)), f"step-1 aux abs err {aux_err:.2e}")
    check(rel(d1["grad_norm"], gnorm) <= norm_tol,
          f"step-1 grad norm rel err {rel(d1['grad_norm'], gnorm):.2e} (tolerance {norm_tol:.1e})")
    check(rel(d1["lr"], ref.lr_at(1, cfg)) <= 1e-9, "step-1 lr")
    errs = tensor_errors(d1["grad"], grads)
    ratio = table("step-1 gradients", errs, d1["grad"], grads, tol["grad"])
    mx = max(errs.values())
    check(ratio <= 1.0, f"every step-1 gradient within its tolerance (max error {mx:.2e}, "
          f"worst error / tolerance {ratio:.2f})")
    if cfg.precision == "bf16":  # the same step in fp32 is measurably farther away
        ref.PRECISION = "fp32"
        _, grads32 = ref.step_loss_and_grads(model, d1["tokens"], d1["routes"], {})
        ref.PRECISION = "bf16"
        mx32 = max(tensor_errors(d1["grad"], grads32).values())
        print(f"  kmoe's step-1 gradients against the fp32 reference: largest error {mx32:.2e}")
        check(mx <= BF16_POWER * mx32, f"step-1 gradients nearer the bf16 reference ({mx:.2e}) "
              f"than {BF16_POWER:g} x the fp32 one ({mx32:.2e})")

    # 3. three reference AdamW steps on the dumped batches
    for s in (1, 2, 3):
        d = dump[s - 1]
        check(int(d["step"]) == s, f"dump_step{s}.h5 has step {int(d['step'])}")
        stats = {}
        (loss, ce, aux), grads = ref.step_loss_and_grads(model, d["tokens"], d["routes"], stats)
        if s > 1:
            check_routes(s, stats, cfg)
            print(f"step {s}: kmoe loss {d['loss']:.10f}  ref {loss:.10f}")
            check(rel(d["loss"], loss) <= LOSS_TOL, f"step-{s} loss rel err {rel(d['loss'], loss):.2e}")
            check(rel(d["lr"], ref.lr_at(s, cfg)) <= 1e-9, f"step-{s} lr")
        norm, _ = opt.step(s, grads)
        print(f"        grad norm kmoe {d['grad_norm']:.8f} ref {norm:.8f} "
              f"(clip scale {min(1.0, cfg.clip / (norm + 1e-6)):.6f})")
    with h5py.File(ck3, "r") as f:
        check(int(f.attrs["step"]) == 3, "final checkpoint has step 3")
        k3 = read_tensors(f, "model", names)
        km, kv = read_tensors(f, "optimizer/exp_avg", names), read_tensors(f, "optimizer/exp_avg_sq", names)
    kd = {n: k3[n] - theta0[n] for n in names}
    rd = {n: p.detach() - theta0[n] for n, p in model.named_parameters()}
    ratio = table("theta_3 - theta_0", tensor_errors(kd, rd), kd, rd, tol["delta"])
    check(ratio <= 1.0, f"every theta_3 - theta_0 within its tolerance (worst error / tolerance "
          f"{ratio:.2f})")
    for label, a, b in (("exp_avg", km, opt.m), ("exp_avg_sq", kv, opt.v)):
        errs = tensor_errors(a, b)
        t = tol[label]
        ratio = max(e / (t[n] if isinstance(t, dict) else t) for n, e in errs.items())
        check(ratio <= 1.0, f"step-3 {label} within its tolerance (max error "
              f"{max(errs.values()):.2e}, worst error / tolerance {ratio:.2f})")
    h.finish()


if __name__ == "__main__":
    main()
