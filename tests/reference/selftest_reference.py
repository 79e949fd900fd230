#!/usr/bin/python3
"""Checks of the float64 reference (kmoe_reference.py) against itself, no kmoe involved:
RoPE against its per-element formula, the MoE layer against a per-token loop written from
MODEL.md section 3, the Engram layer against a per-token loop written from section 4, finite
differences of the step loss for dense and MoE decks, a tiny training
run that must learn, and an autograd gradcheck. Exit code 0 when all pass."""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kmoe_reference as ref  # noqa: E402
from kmoe_reference import DT, Config, Model  # noqa: E402

TEST_DECK = """
[model]
vocab_size = 16
d_model = 8
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_hidden = 12
block_norm = {block_norm}
tie_embeddings = {tie}
output_z_coef = {z}
[train]
seq_len = 6
global_batch = 4
micro_batch = 2
max_steps = 60
[optimizer]
lr = 1e-2
warmup_steps = 5
{moe}
"""

MOE_SOFTMAX = """[moe]
experts = 4
top_k = 2
expert_hidden = 6
dense_layers = 0
shared_experts = 2
shared_hidden = 3
lb_coef = 0.1
z_coef = 0.01
"""
MOE_SIGMOID_CAPACITY = """[moe]
experts = 4
top_k = 2
expert_hidden = 6
score = sigmoid
normalize_topk = true
capacity_factor = 0.5
lb_coef = 0.1
z_coef = 0.01
"""

ENGRAM_SIGMOID = """[engram]
layers = 1
max_ngram = 3
heads = 2
embed_per_ngram = 4
table_size = 7, 11
kernel = 2
"""
ENGRAM_SIGNED_SQRT = """[engram]
layers = 0, 1
max_ngram = 2
heads = 2
embed_per_ngram = 6
table_size = 5
kernel = 3
gate = signed_sqrt
seed = 9
"""

VARIANTS = [  # (block_norm, tie, output z, [moe] and [engram] sections)
    ("reordered", "false", "0", ""),
    ("pre", "true", "0.01", ""),
    ("reordered", "false", "0", MOE_SOFTMAX),
    ("pre", "false", "0.01", MOE_SIGMOID_CAPACITY),
    ("reordered", "false", "0", ENGRAM_SIGMOID + MOE_SOFTMAX),
    ("pre", "false", "0", ENGRAM_SIGNED_SQRT),
]


def report(good, what):
    print(what, "ok" if good else "FAIL", flush=True)
    return bool(good)


def check_rope():
    cos, sin = ref.rope_tables(5, 8, 500000.0)
    u = torch.randn(1, 5, 1, 8, dtype=DT)
    r = ref.apply_rope(u, cos, sin)
    ok = True
    for p in range(5):
        for i in range(4):
            a = p * 500000.0 ** (-2 * i / 8)
            e0 = u[0, p, 0, i] * math.cos(a) - u[0, p, 0, i + 4] * math.sin(a)
            e1 = u[0, p, 0, i + 4] * math.cos(a) + u[0, p, 0, i] * math.sin(a)
            ok &= abs(float(r[0, p, 0, i] - e0)) < 1e-6 and abs(float(r[0, p, 0, i + 4] - e1)) < 1e-6
    return report(ok, "rope formula:")


def naive_moe(moe, x):
    """MODEL.md section 3 token by token: (y [N, D], LB, RZ, dropped assignments)."""
    c = moe.cfg
    N = x.shape[0]
    cap = math.ceil(c.capacity_factor * N * c.k / c.E) if c.capacity_factor > 0 else N * c.k
    used, count, psum = [0] * c.E, [0] * c.E, [0.0] * c.E
    ys, rz, dropped = [], 0.0, 0
    for t in range(N):
        z = [float(x[t] @ moe.router[e]) for e in range(c.E)]
        lse = max(z) + math.log(sum(math.exp(v - max(z)) for v in z))
        rz += lse * lse / N
        p = [math.exp(v - lse) if c.score == "softmax" else 1 / (1 + math.exp(-v)) for v in z]
        sel = sorted(range(c.E), key=lambda e: (-p[e], e))[:c.k]
        w = [p[e] for e in sel]
        if c.normalize_topk:
            w = [v / sum(w) for v in w]
        y = moe.shared(x[t:t + 1])[0] if c.S > 0 else torch.zeros(c.D, dtype=DT)
        for e, we in zip(sel, w):
            count[e] += 1
            if used[e] < cap:
                used[e] += 1
                y = y + we * moe.experts(e, x[t:t + 1])[0]
            else:
                dropped += 1
        for e in range(c.E):
            psum[e] += p[e]
        ys.append(y)
    lb = c.E / c.k * sum(count[e] / N * psum[e] / N for e in range(c.E))
    return torch.stack(ys), lb, rz, dropped


def check_moe_layer():
    ok = True
    for moe_deck in (MOE_SOFTMAX, MOE_SIGMOID_CAPACITY):
        cfg = Config(TEST_DECK.format(block_norm="reordered", tie="false", z="0", moe=moe_deck))
        model = Model(cfg)
        ref.init_model(model, seed=5)
        moe = model.blocks[1].moe
        with torch.no_grad():
            for p in moe.parameters():
                p.mul_(20.0)
            h = torch.randn(2, cfg.T, cfg.D, dtype=DT)
            ctx = ref.MoEContext()
            y = moe(h, ctx)
            yn, lb, rz, dropped = naive_moe(moe, h.reshape(-1, cfg.D))
        err = float((y.reshape(-1, cfg.D) - yn).abs().max())
        aux_err = abs(float(ctx.aux) - (cfg.lb_coef * lb + cfg.z_coef * rz))
        st = ctx.stats[1]
        good = err < 1e-12 and aux_err < 1e-12 and st.dropped == dropped
        if cfg.capacity_factor > 0:
            good &= dropped > 0  # the capacity path is exercised
        ok &= report(good, f"MoE {cfg.score} capacity {cfg.capacity_factor:g}: per-token loop "
                     f"y err {err:.1e}, aux err {aux_err:.1e}, {dropped} dropped:")
    return ok


def naive_engram(eng, x, tokens, doc):
    """MODEL.md section 4 steps 6-10 for one sequence, position by position: [T, D]."""
    c = eng.cfg
    T, D = x.shape
    rows = eng.rows(tokens[None], doc[None])[0]
    rms = lambda v, g: g * v / math.sqrt(float(v.pow(2).mean()) + c.norm_eps)  # noqa: E731
    vs, us, out = [], [], []
    for t in range(T):
        e = torch.cat([eng.table[int(r)] for r in rows[t]])
        key, val = eng.wk @ e + eng.bk, eng.wv @ e + eng.bv
        s = float((rms(key, eng.k_norm.weight) * rms(x[t], eng.q_norm.weight)).sum()) / math.sqrt(D)
        if c.gate == "signed_sqrt":
            s = math.copysign(math.sqrt(max(abs(s), 1e-6)), s)
        vs.append(val / (1 + math.exp(-s)))
        us.append(rms(vs[t], eng.conv_norm.weight))
    for t in range(T):
        conv = torch.zeros(D, dtype=DT)
        for i in range(c.kernel):
            src = t - (c.kernel - 1 - i) * c.N
            if src >= 0 and doc[src] == doc[t]:
                conv = conv + eng.conv[:, i] * us[src]
        out.append(vs[t] + conv * torch.sigmoid(conv))
    return torch.stack(out)


def masked_deck(extra=""):
    """TEST_DECK with document masking at id 3 (and `extra` [model] keys)."""
    return (TEST_DECK.replace("max_steps = 60", "max_steps = 60\ndocument_mask = true")
            .replace("output_z_coef = {z}", "output_z_coef = {z}\n" + extra) + "[data]\neod_id = 3\n")


def check_engram_layer():
    ok = True
    for eng_deck in (ENGRAM_SIGMOID, ENGRAM_SIGNED_SQRT):
        for masked in (False, True):
            deck = masked_deck() if masked else TEST_DECK
            cfg = Config(deck.format(block_norm="reordered", tie="false", z="0", moe=eng_deck))
            model = Model(cfg)
            ref.init_model(model, seed=4)
            eng = model.blocks[1].engram
            with torch.no_grad():
                for p in eng.parameters():
                    p.add_(0.5 * torch.randn_like(p))
                x = torch.randn(2, cfg.T, cfg.D, dtype=DT)
                tokens = torch.randint(4, cfg.V, (2, cfg.T))
                tokens[0, 1], tokens[1, 3] = 3, 3  # documents end inside both sequences
                doc = ref.document_ids(tokens, cfg.eod)
                y = eng(x, tokens, doc)
                err = max(float((y[i] - naive_engram(eng, x[i], tokens[i], doc[i])).abs().max())
                          for i in range(2))
            ok &= report(err < 1e-12, f"Engram {cfg.gate} N={cfg.N} kernel={cfg.kernel} document "
                         f"mask {masked}: per-position loop err {err:.1e}:")
    return ok


def check_attention_masks():
    """Which inputs each attention output reads, by perturbing one position at a time: exactly
    the keys j <= t of t's document within the window (MODEL.md section 1)."""
    ok = True
    for window in (0, 2):
        cfg = Config(masked_deck(f"sliding_window = {window}\nwindow_layers = 0,1").format(
            block_norm="reordered", tie="false", z="0", moe=""))
        attn = Model(cfg).blocks[0].attn
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn_like(p))
            T = cfg.T
            tokens = torch.tensor([[5, 3, 7, 8, 3, 9]])
            doc = ref.document_ids(tokens, cfg.eod)
            cos, sin = ref.rope_tables(T, cfg.dh, cfg.rope_theta)
            x = torch.randn(1, T, cfg.D, dtype=DT)
            y = attn(x, cos, sin, doc)
            for j in range(T):
                xp = x.clone()
                xp[0, j] += 1.0
                moved = (attn(xp, cos, sin, doc) - y).abs().amax(-1)[0] > 1e-12
                want = [j <= t and int(doc[0, j]) == int(doc[0, t]) and (not window or t - j < window)
                        for t in range(T)]
                ok &= report(moved.tolist() == want, f"attention window {window} documents "
                             f"{doc[0].tolist()}: position {j} reaches {moved.tolist()}:")
    return ok


def check_route_comparison():
    """MoE.route: kmoe's route is used; differences count as near-ties only within TIE_TOL."""
    cfg = Config(TEST_DECK.format(block_norm="reordered", tie="false", z="0", moe=MOE_SOFTMAX))
    moe = Model(cfg).blocks[1].moe
    p = torch.tensor([[0.4, 0.3, 0.3 - 5e-6, 0.0], [0.4, 0.3, 0.2, 0.1],
                      [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], dtype=DT)
    given = torch.tensor([[0, 2], [1, 0], [0, 1], [0, 0]])  # near-tie, far swap, same, invalid
    ctx = ref.MoEContext({1: given})
    used = moe.route(p, ctx)
    st = ctx.stats[1]
    good = (st.tokens, st.differ, st.unexplained, st.invalid) == (4, 2, 1, 1)
    good &= bool((used == ref.top_k(p, 2)).all())  # an invalid route is not used
    ctx = ref.MoEContext({1: given[:3]})
    good &= bool((moe.route(p[:3], ctx) == given[:3]).all())
    return report(good, f"route comparison ({st}):")


def step_loss(model, tokens):
    cfg = model.cfg
    n_mb = cfg.G // cfg.b
    with torch.no_grad():
        return float(sum(model.microbatch_loss(tokens[j * cfg.b:(j + 1) * cfg.b])[0]
                         for j in range(n_mb)) / n_mb)


def check_variant(bn, tie, z, moe):
    cfg = Config(TEST_DECK.format(block_norm=bn, tie=tie, z=z, moe=moe))
    label = f"{bn} tie={tie} z={z}" + (f" MoE {cfg.score} layers {cfg.moe_layers}"
                                        if cfg.moe_layers else "")
    label += f" Engram {cfg.gate} layers {cfg.engram_layers}" if cfg.engram_layers else ""
    model = Model(cfg)
    ref.init_model(model, seed=1)
    with torch.no_grad():  # make norms non-trivial so their gradients are exercised
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif not p.any():  # Engram biases and convolution start at 0
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(20.0)
    tokens = torch.randint(0, cfg.V, (cfg.G, cfg.T))
    _, grads = ref.step_loss_and_grads(model, tokens)
    worst = 0.0
    for n, p in model.named_parameters():
        for idx in [tuple(torch.randint(0, s, (1,)).item() for s in p.shape) for _ in range(3)]:
            h = 1e-6
            with torch.no_grad():
                p[idx] += h
                lp = step_loss(model, tokens)
                p[idx] -= 2 * h
                lm = step_loss(model, tokens)
                p[idx] += h
            fd = (lp - lm) / (2 * h)
            # float64 round-off of the loss (~1e-16 x 3) over 2h leaves ~1e-10 absolute noise
            # in fd, so gradients below 1e-4 are compared absolutely at that scale
            worst = max(worst, abs(fd - float(grads[n][idx])) / max(abs(fd), 1e-4))
    ok = report(worst < 1e-5, f"{label}: finite differences max rel err {worst:.2e}")
    model2 = Model(cfg)  # a tiny model memorises a fixed batch
    ref.init_model(model2, seed=2)
    opt = ref.AdamW(model2)
    first = None
    for s in range(1, cfg.max_steps + 1):
        (loss, _, _), g = ref.step_loss_and_grads(model2, tokens)
        first = loss if first is None else first
        opt.step(s, g)
    return ok & report(loss < 0.5 * first, f"  training: loss {first:.4f} -> {loss:.4f}")


def check_gradcheck():
    cfg = Config(TEST_DECK.format(block_norm="reordered", tie="false", z="0.01", moe=""))
    cfg.L = 1
    model = Model(cfg)
    ref.init_model(model, seed=3)
    tokens = torch.randint(0, cfg.V, (2, cfg.T))
    wq = model.blocks[0].attn.wq
    good = torch.autograd.gradcheck(lambda w: _swap_call(model, "blocks.0.attn.wq", w, tokens),
                                    (wq.detach().clone().requires_grad_(),))
    return report(good, "gradcheck blocks.0.attn.wq:")


def _swap_call(model, name, w, tokens):
    """microbatch_loss with parameter `name` replaced by the differentiable tensor w."""
    mod_name, attr = name.rsplit(".", 1)
    mod = model.get_submodule(mod_name)
    saved = mod._parameters.pop(attr)
    setattr(mod, attr, w)
    try:
        return model.microbatch_loss(tokens)[0]
    finally:
        delattr(mod, attr)
        mod._parameters[attr] = saved


def main():
    torch.manual_seed(0)
    ok = check_rope()
    ok &= check_moe_layer()
    ok &= check_route_comparison()
    ok &= check_engram_layer()
    ok &= check_attention_masks()
    for v in VARIANTS:
        ok &= check_variant(*v)
    ok &= check_gradcheck()
    print("selftest", "passed" if ok else "FAILED")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
