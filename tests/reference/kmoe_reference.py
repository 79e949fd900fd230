#!/usr/bin/python3
"""Independent float64 PyTorch reference of kmoe's model, loss and optimizer.

Written from docs/spec/MODEL.md (sections 1, 2, 3, 5, 6, 7, 8), docs/spec/RUNTIME.md (sections 4-5)
and docs/CONVENTIONS.md only, never from kmoe's C++ code. It covers the dense model, the
mixture of experts (`MoE`, without aux-loss-free bias updates) and Engram (`Engram`, section 4;
its hashing comes from engram_hash_reference.py, also written from the spec alone).

The module tree mirrors MODEL.md section 5, so `named_parameters()` yields exactly kmoe's
parameter names (`blocks.0.attn.wq`, ...) and a checkpoint dataset is `/model/` + name with
dots as slashes.

Usage as a library: see check_reference.py. `selftest_reference.py` checks the reference
against itself (finite differences, RoPE, a per-token MoE loop, a tiny training run).
"""
import configparser
import math

import numpy as np
import torch
from torch import nn

import engram_hash_reference as ehash

DT = torch.float64


# ----------------------------------------------------------------------------- precision

def round_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even, through fp32 as kmoe's values are),
    back in x's dtype."""
    return x.to(torch.float32).to(torch.bfloat16).to(x.dtype)


class Bf16Matmul(torch.autograd.Function):
    """MODEL.md section 8: C = R(A) R(B); the gradient products round their inputs too."""

    @staticmethod
    def forward(ctx, a, b):
        ra, rb = round_bf16(a), round_bf16(b)
        ctx.save_for_backward(ra, rb)
        return ra @ rb

    @staticmethod
    def backward(ctx, g):
        ra, rb = ctx.saved_tensors
        rg = round_bf16(g)
        if rb.dim() == 2:  # a weight: its gradient sums over every leading dimension of a
            gb = ra.reshape(-1, ra.shape[-1]).transpose(0, 1) @ rg.reshape(-1, rg.shape[-1])
        else:
            gb = ra.transpose(-1, -2) @ rg
        return rg @ rb.transpose(-1, -2), gb


class Bf16Softmax(torch.autograd.Function):
    """MODEL.md section 8: the attention probabilities kept as R(P), the softmax backward reading
    them back: dS = R(P) (dP - sum_j R(P) dP)."""

    @staticmethod
    def forward(ctx, s):
        p = round_bf16(torch.softmax(s, dim=-1))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return p * (g - (p * g).sum(dim=-1, keepdim=True))


class Bf16Keep(torch.autograd.Function):
    """A product's output kept as R(x) for the element-wise code after it (the SwiGLU
    pre-activations): forward and backward read R(x); the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return round_bf16(x)

    @staticmethod
    def backward(ctx, g):
        return g


PRECISION = "fp32"  # train.precision of the model last built (Model.__init__ sets it)


def mm(a, b):
    """A matrix product in the run's precision (the router's stays a @ b)."""
    return Bf16Matmul.apply(a, b) if PRECISION == "bf16" else a @ b


def attention_softmax(s):
    """The causal softmax of attention in the run's precision (the router's stays fp32)."""
    return Bf16Softmax.apply(s) if PRECISION == "bf16" else torch.softmax(s, dim=-1)


def swiglu(x, w1, w3):
    """silu(x W1^T) * (x W3^T), the pre-activations kept (and read back) in the run's precision."""
    a, b = mm(x, w1.T), mm(x, w3.T)
    if PRECISION == "bf16":
        a, b = Bf16Keep.apply(a), Bf16Keep.apply(b)
    return nn.functional.silu(a) * b


# ----------------------------------------------------------------------------- configuration

def _get(cp, section, key, default=None, kind=str):
    """A deck value with RUNTIME.md's default; `kind` converts the string."""
    if cp.has_section(section) and cp.has_option(section, key):
        raw = cp.get(section, key).strip()
        if kind is bool:
            return raw.lower() in ("1", "true", "yes", "on")
        if kind is list:
            return [t.strip() for t in raw.split(",") if t.strip()]
        return kind(raw)
    if default is None:
        raise KeyError(f"deck has no [{section}] {key} and it has no default")
    return default


class Config:
    """The [model], [moe], [engram], [train] and [optimizer] keys the reference needs."""

    def __init__(self, deck_text):
        cp = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#",),
                                       comment_prefixes=("#", ";"))
        cp.read_string(deck_text)
        self.text = deck_text
        g = lambda k, d=None, t=str: _get(cp, "model", k, d, t)  # noqa: E731
        self.V, self.D, self.L = g("vocab_size", t=int), g("d_model", t=int), g("n_layers", t=int)
        self.H = g("n_heads", t=int)
        self.Hkv = g("n_kv_heads", self.H, int)
        self.F = g("ffn_hidden", t=int)
        self.norm_eps = g("norm_eps", 1e-6, float)
        self.rope_theta = g("rope_theta", 500000.0, float)
        self.qk_norm = g("qk_norm", True, bool)
        self.block_norm = g("block_norm", "reordered")
        self.tie = g("tie_embeddings", False, bool)
        self.init_std = g("init_std", 0.02, float)
        self.init = g("init", "normal")
        assert self.init in ("normal", "fan_in"), self.init
        self.init_gain = g("init_gain", 1.0, float)
        self.init_depth_scale = g("init_depth_scale", False, bool)
        self.embed_std = g("embed_init_std", self.init_std, float)
        self.output_z_coef = g("output_z_coef", 0.0, float)
        # Sliding windows (MODEL.md section 1): OLMo 3's pattern unless listed.
        self.window = g("sliding_window", 0, int)
        self.window_layers = (_layers(g("window_layers", [], list))
                              or [l for l in range(self.L) if l % 4 != 3]) if self.window else []
        assert self.D % self.H == 0 and self.H % self.Hkv == 0
        self.dh = self.D // self.H
        assert self.block_norm in ("reordered", "pre"), self.block_norm

        self._moe(cp)
        self._engram(cp)

        t = lambda k, d=None, ty=int: _get(cp, "train", k, d, ty)  # noqa: E731
        self.T, self.G, self.b = t("seq_len"), t("global_batch"), t("micro_batch")
        self.max_steps, self.seed = t("max_steps"), t("seed", 0)
        self.precision = t("precision", "fp32", str)
        assert self.precision in ("fp32", "bf16"), self.precision  # tf32 is GPU-only
        # Document masking: documents end at data.eod_id (byte-level ids: 256).
        eod = _get(cp, "data", "eod_id", -1, int)
        if eod < 0 and _get(cp, "data", "tokenizer", "bytes") == "bytes" and self.V > 256:
            eod = 256
        self.eod = eod if t("document_mask", False, bool) else None

        o = lambda k, d=None, ty=float: _get(cp, "optimizer", k, d, ty)  # noqa: E731
        self.lr, self.beta1, self.beta2 = o("lr"), o("beta1", 0.9), o("beta2", 0.95)
        self.eps, self.weight_decay, self.clip = o("eps", 1e-8), o("weight_decay", 0.1), o("clip", 1.0)
        self.schedule = o("schedule", "cosine", str)
        self.warmup = o("warmup_steps", 0, int)
        self.final_lr_ratio = o("final_lr_ratio", 0.1)
        self.decay_steps = o("decay_steps", 0, int)

    def _moe(self, cp):
        """MODEL.md sections 1 and 3: which blocks are MoE layers, and their [moe] keys."""
        m = lambda k, d=None, t=str: _get(cp, "moe", k, d, t)  # noqa: E731
        self.E = m("experts", 0, int)
        self.moe_layers = []
        if self.E == 0:
            return
        self.k, self.Fe = m("top_k", 2, int), m("expert_hidden", t=int)
        dense = _layers(m("dense_layers", [], list))
        self.moe_layers = _layers(m("layers", [], list)) or [l for l in range(self.L) if l not in dense]
        assert not set(self.moe_layers) & set(dense), "moe.layers and moe.dense_layers overlap"
        self.score = m("score", "softmax")
        assert self.score in ("softmax", "sigmoid"), self.score
        self.normalize_topk = m("normalize_topk", False, bool)
        self.lb_coef, self.z_coef = m("lb_coef", 0.01, float), m("z_coef", 0.001, float)
        self.capacity_factor = m("capacity_factor", 0.0, float)
        self.S = m("shared_experts", 0, int)
        self.Fs = m("shared_hidden", t=int) if self.S > 0 else 0
        if m("bias_update_rate", 0.0, float) > 0:
            raise NotImplementedError("the reference does not cover moe.bias_update_rate > 0 yet")


    def _engram(self, cp):
        """MODEL.md section 4: the [engram] keys, the compression map and the hash moduli."""
        e = lambda k, d=None, t=str: _get(cp, "engram", k, d, t)  # noqa: E731
        self.engram_layers = _layers(e("layers", [], list))
        self.engram_lr_mult = e("lr_mult", 5.0, float)
        if not self.engram_layers:
            return
        self.N, self.Ke = e("max_ngram", 3, int), e("heads", 8, int)
        self.De = e("embed_per_ngram", 512, int)
        assert self.De % self.Ke == 0
        self.dhe, self.d_mem = self.De // self.Ke, (self.N - 1) * self.De
        self.engram_seed, self.kernel = e("seed", 0, int), e("kernel", 4, int)
        self.pad_id, self.gate = e("pad_id", 0, int), e("gate", "sigmoid")
        assert self.gate in ("sigmoid", "signed_sqrt"), self.gate
        self.engram_std = e("init_std", self.init_std, float)
        path = e("compression_map", "")
        self.compress = read_compression_map(path, self.V) if path else None
        self.Vc = self.V if self.compress is None else 1 + max(self.compress)
        sizes = [int(v) for v in e("table_size", [], list)] or [5 * self.Vc] * (self.N - 1)
        assert len(sizes) == self.N - 1, f"engram.table_size needs {self.N - 1} values: {sizes}"
        self.moduli = ehash.moduli(self.engram_layers, self.N, self.Ke,
                                   {n: sizes[n - 2] for n in range(2, self.N + 1)})


def read_compression_map(path, V):
    """engram.compression_map: V canonical ids, headerless little-endian uint32 or a .npy."""
    a = np.load(path) if path.endswith(".npy") else np.fromfile(path, dtype="<u4")
    assert a.shape == (V,), f"{path}: {a.shape[0]} ids, model.vocab_size is {V}"
    return [int(v) for v in a]


def _layers(items):
    """Block indices of a deck list; `none` means no block."""
    return [int(t) for t in items if t.lower() != "none"]


# ----------------------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    """y = g * x / sqrt(mean(x^2) + eps) over the last dimension."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=DT))

    def forward(self, x):
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Weight(nn.Module):
    """A bare `weight` parameter (embedding, untied LM head)."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=DT))


def rope_tables(T, dh, theta):
    """cos/sin [T, dh/2]: angles in double, rounded to fp32 once (as kmoe), used as float64."""
    i = np.arange(dh // 2, dtype=np.float64)
    inv_freq = np.power(theta, -2.0 * i / dh)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    to = lambda a: torch.from_numpy(a.astype(np.float32).astype(np.float64))  # noqa: E731
    return to(np.cos(ang)), to(np.sin(ang))


def apply_rope(u, cos, sin):
    """NeoX half split. u: [b, T, heads, dh]; cos/sin: [T, dh/2]."""
    half = u.shape[-1] // 2
    u1, u2 = u[..., :half], u[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([u1 * c - u2 * s, u2 * c + u1 * s], dim=-1)


def document_ids(tokens, eod):
    """[b, T] int64: the index of each position's document in its sequence (an end-of-document
    id belongs to the document it ends); all 0 without document masking."""
    if eod is None:
        return torch.zeros_like(tokens)
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def attention_mask(doc, window):
    """[b, 1, T, T] bool, True where query t may not read key j: j > t, another document, or
    t - j >= window (window > 0)."""
    T = doc.shape[1]
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    masked = (j > t)[None] | (doc[:, :, None] != doc[:, None, :])
    if window:
        masked = masked | (t - j >= window)[None]
    return masked[:, None]


class Attention(nn.Module):
    def __init__(self, cfg, window=0):
        super().__init__()
        self.cfg, self.window = cfg, window
        D, H, Hkv, dh = cfg.D, cfg.H, cfg.Hkv, cfg.dh
        self.wq = nn.Parameter(torch.zeros(H * dh, D, dtype=DT))
        self.wk = nn.Parameter(torch.zeros(Hkv * dh, D, dtype=DT))
        self.wv = nn.Parameter(torch.zeros(Hkv * dh, D, dtype=DT))
        self.wo = nn.Parameter(torch.zeros(D, H * dh, dtype=DT))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H * dh, cfg.norm_eps)
            self.k_norm = RMSNorm(Hkv * dh, cfg.norm_eps)

    def forward(self, x, cos, sin, doc):
        c = self.cfg
        b, T, _ = x.shape
        q, k, v = mm(x, self.wq.T), mm(x, self.wk.T), mm(x, self.wv.T)
        if c.qk_norm:  # over the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.view(b, T, c.H, c.dh), cos, sin)
        k = apply_rope(k.view(b, T, c.Hkv, c.dh), cos, sin)
        v = v.view(b, T, c.Hkv, c.dh)
        rep = c.H // c.Hkv  # query head h reads kv head h // rep
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, H, T, dh]
        scores = mm(q, k.transpose(-1, -2)) / math.sqrt(c.dh)
        scores = scores.masked_fill(attention_mask(doc, self.window), float("-inf"))
        o = mm(attention_softmax(scores), v)  # [b, H, T, dh]
        return mm(o.transpose(1, 2).reshape(b, T, c.H * c.dh), self.wo.T)


class DenseMLP(nn.Module):
    """SwiGLU: (silu(x W1^T) * (x W3^T)) W2^T."""

    def __init__(self, D, F):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(F, D, dtype=DT))
        self.w3 = nn.Parameter(torch.zeros(F, D, dtype=DT))
        self.w2 = nn.Parameter(torch.zeros(D, F, dtype=DT))

    def forward(self, x):
        return mm(swiglu(x, self.w1, self.w3), self.w2.T)


TIE_TOL = 1e-5  # RUNTIME.md section 5: closer k-th/(k+1)-th scores may select differently
SCORES = None  # a list: every MoE forward appends its router scores (check_reference's floor)


class RouteStats:
    """One MoE layer's routing, summed over micro-batches: how often kmoe's route (when given)
    differs from the reference's own top-k, and whether a near-tie explains it."""

    def __init__(self):
        self.tokens = self.differ = self.unexplained = self.invalid = 0
        self.assignments = self.dropped = 0
        self.max_gap = 0.0  # largest score gap of a differing slot

    def __str__(self):
        s = (f"{self.tokens} tokens, {self.differ} routed differently from the reference's top-k "
             f"({self.unexplained} not a near-tie, max score gap {self.max_gap:.1e}), "
             f"{self.invalid} invalid")
        return s + (f", {self.dropped} of {self.assignments} assignments dropped" if self.dropped else "")


class MoEContext:
    """What one micro-batch's forward pass shares with its MoE layers: the routes to use
    ({layer: int64 [N, k]}, kmoe's; a missing layer uses the reference's own top-k), the summed
    aux terms sum_l (lb_coef LB_l + z_coef RZ_l), and the RouteStats to add to ({layer: ...})."""

    def __init__(self, routes=None, stats=None):
        self.routes, self.stats = routes or {}, stats if stats is not None else {}
        self.aux = 0.0


def top_k(scores, k):
    """Indices of the k largest scores per row, descending, the lower index first on ties."""
    return torch.sort(-scores, dim=1, stable=True)[1][:, :k]


def capacity_keep(sel, E, cap):
    """bool [N, k]: assignment (t, j) is within its expert's first `cap`, in token order."""
    onehot = nn.functional.one_hot(sel, E)  # [N, k, E]; an expert appears once per token
    rank = onehot.reshape(-1, E).cumsum(0).view_as(onehot)  # 1-based position in token order
    return (rank * onehot).sum(-1) <= cap


class Experts(nn.Module):
    """E stacked SwiGLU experts: w1, w3 [E, Fe, D], w2 [E, D, Fe]."""

    def __init__(self, E, D, Fe):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(E, Fe, D, dtype=DT))
        self.w3 = nn.Parameter(torch.zeros(E, Fe, D, dtype=DT))
        self.w2 = nn.Parameter(torch.zeros(E, D, Fe, dtype=DT))

    def forward(self, e, x):
        """Expert e on the rows of x."""
        return mm(swiglu(x, self.w1[e], self.w3[e]), self.w2[e].T)


class MoE(nn.Module):
    """MODEL.md section 3 for the N = b*T tokens of one micro-batch."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.router = nn.Parameter(torch.zeros(cfg.E, cfg.D, dtype=DT))
        self.experts = Experts(cfg.E, cfg.D, cfg.Fe)
        if cfg.S > 0:  # S stacked SwiGLUs of weight 1 sum to one SwiGLU of hidden S*Fs
            self.shared = DenseMLP(cfg.D, cfg.S * cfg.Fs)

    def forward(self, h, ctx):
        c = self.cfg
        x = h.reshape(-1, c.D)
        N = x.shape[0]
        z = x @ self.router.T  # [N, E]; fp32 in every precision
        p = torch.softmax(z, dim=-1) if c.score == "softmax" else torch.sigmoid(z)
        if SCORES is not None:
            SCORES.append(p.detach().clone())
        sel = self.route(p.detach(), ctx)
        w = p.gather(1, sel)  # [N, k]
        if c.normalize_topk:
            w = w / w.sum(1, keepdim=True)
        keep = torch.ones_like(sel, dtype=torch.bool)
        if c.capacity_factor > 0:
            keep = capacity_keep(sel, c.E, math.ceil(c.capacity_factor * N * c.k / c.E))
        st = ctx.stats.setdefault(self.layer, RouteStats())
        st.assignments += sel.numel()
        st.dropped += int((~keep).sum())
        y = torch.zeros_like(x)
        for e in range(c.E):
            tok, slot = ((sel == e) & keep).nonzero(as_tuple=True)
            if len(tok):
                y = y.index_add(0, tok, w[tok, slot, None] * self.experts(e, x[tok]))
        if c.S > 0:
            y = y + self.shared(x)
        count = torch.bincount(sel.reshape(-1), minlength=c.E).to(DT)  # before any drop
        lb = (c.E / c.k) * ((count / N) * p.mean(0)).sum()
        rz = torch.logsumexp(z, dim=-1).pow(2).mean()
        ctx.aux = ctx.aux + c.lb_coef * lb + c.z_coef * rz
        return y.view_as(h)

    def route(self, p, ctx):
        """The selection to use: kmoe's if given (compared with our own top-k), else our own."""
        own = top_k(p, self.cfg.k)  # + bias, which is 0 without bias_update_rate
        given = ctx.routes.get(self.layer)
        if given is None:
            return own
        st = ctx.stats.setdefault(self.layer, RouteStats())
        st.tokens += own.shape[0]
        E = self.cfg.E
        bad = (given < 0).any(1) | (given >= E).any(1)
        srt = given.sort(1)[0]
        bad |= (srt[:, 1:] == srt[:, :-1]).any(1)  # an expert twice
        st.invalid += int(bad.sum())
        diff = (own != given) & ~bad[:, None]
        st.differ += int(diff.any(1).sum())
        gap = (p.gather(1, own) - p.gather(1, given.clamp(0, E - 1))).abs()
        st.unexplained += int((diff & (gap >= TIE_TOL)).any(1).sum())
        if diff.any():
            st.max_gap = max(st.max_gap, float(gap[diff].max()))
        if bad.any():  # unusable; the check reports it
            return own
        return given


class Engram(nn.Module):
    """MODEL.md section 4, steps 6-10, for a [b, T, D] block input and its [b, T] tokens."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        D, d_mem = cfg.D, cfg.d_mem
        self.table = nn.Parameter(torch.zeros(cfg.moduli[layer][2], cfg.dhe, dtype=DT))
        self.wk = nn.Parameter(torch.zeros(D, d_mem, dtype=DT))
        self.wv = nn.Parameter(torch.zeros(D, d_mem, dtype=DT))
        self.bk = nn.Parameter(torch.zeros(D, dtype=DT))
        self.bv = nn.Parameter(torch.zeros(D, dtype=DT))
        self.q_norm = RMSNorm(D, cfg.norm_eps)
        self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.conv_norm = RMSNorm(D, cfg.norm_eps)
        self.conv = nn.Parameter(torch.zeros(D, cfg.kernel, dtype=DT))

    def rows(self, tokens, doc):
        """int64 [b, T, (N-1)*K]: steps 1-6's row of every head (each document hashed alone)."""
        c = self.cfg
        out = []
        for seq, ids in zip(tokens.tolist(), doc.tolist()):
            rows = []
            for d in sorted(set(ids)):
                part = [v for v, i in zip(seq, ids) if i == d]
                rows += ehash.rows(part, self.layer, seed=c.engram_seed, max_ngram=c.N,
                                   heads=c.Ke, vocab_c=c.Vc, pad_id=c.pad_id,
                                   layer_moduli=c.moduli[self.layer], compress=c.compress)[0]
            out.append(rows)
        return torch.tensor(out, dtype=torch.int64)

    def forward(self, x, tokens, doc):
        c = self.cfg
        b, T, D = x.shape
        e = self.table[self.rows(tokens, doc)].reshape(b, T, c.d_mem)  # order-2 heads first
        key, val = mm(e, self.wk.T) + self.bk, mm(e, self.wv.T) + self.bv
        s = (self.k_norm(key) * self.q_norm(x)).sum(-1) / math.sqrt(D)
        if c.gate == "signed_sqrt":
            s = torch.sign(s) * torch.sqrt(s.abs().clamp_min(1e-6))
        v = torch.sigmoid(s)[..., None] * val
        u = self.conv_norm(v)
        conv = torch.zeros_like(u)
        for i in range(c.kernel):  # tap i reads u[t - (kernel-1-i)*N] of the same document
            shift = (c.kernel - 1 - i) * c.N
            if shift < T:
                same = (doc[:, shift:] == doc[:, :T - shift])[..., None]
                conv[:, shift:] = conv[:, shift:] + same * self.conv[:, i] * u[:, :T - shift]
        return v + nn.functional.silu(conv)


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn = Attention(cfg, cfg.window if layer in cfg.window_layers else 0)
        self.attn_norm = RMSNorm(cfg.D, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.D, cfg.norm_eps)
        if layer in cfg.engram_layers:
            self.engram = Engram(cfg, layer)
        if layer in cfg.moe_layers:
            self.moe = MoE(cfg, layer)
        else:
            self.mlp = DenseMLP(cfg.D, cfg.F)

    def ffn(self, h, ctx):
        return self.moe(h, ctx) if self.layer in self.cfg.moe_layers else self.mlp(h)

    def forward(self, x, cos, sin, ctx, tokens, doc):
        if self.layer in self.cfg.engram_layers:  # residual injection before attention
            x = x + self.engram(x, tokens, doc)
        if self.cfg.block_norm == "reordered":
            h = x + self.attn_norm(self.attn(x, cos, sin, doc))
            return h + self.ffn_norm(self.ffn(h, ctx))
        h = x + self.attn(self.attn_norm(x), cos, sin, doc)
        return h + self.ffn(self.ffn_norm(h), ctx)


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        global PRECISION
        PRECISION = cfg.precision
        self.cfg = cfg
        self.embed = Weight(cfg.V, cfg.D)
        self.blocks = nn.ModuleList(Block(cfg, l) for l in range(cfg.L))
        self.final_norm = RMSNorm(cfg.D, cfg.norm_eps)
        if not cfg.tie:
            self.lm_head = Weight(cfg.V, cfg.D)
        self.cos, self.sin = rope_tables(cfg.T, cfg.dh, cfg.rope_theta)

    def forward(self, tokens, ctx=None):
        """tokens [b, T] (int64) -> logits [b, T, V]; MoE layers report to ctx (MoEContext)."""
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        ctx = ctx if ctx is not None else MoEContext()
        x = self.embed.weight[tokens]
        doc = document_ids(tokens, self.cfg.eod)
        for blk in self.blocks:
            x = blk(x, cos, sin, ctx, tokens, doc)
        head = self.embed.weight if self.cfg.tie else self.lm_head.weight
        return mm(self.final_norm(x), head.T)

    def microbatch_loss(self, tokens, routes=None, stats=None):
        """MODEL.md section 2 for one micro-batch: (loss_mb, CE, aux).

        routes: {MoE layer: int64 [b*T, k]} selections to use (kmoe's); stats: {layer: RouteStats}
        to add this micro-batch's route comparison to."""
        ctx = MoEContext(routes, stats)
        logits = self(tokens, ctx)[:, :-1].reshape(-1, self.cfg.V)
        targets = tokens[:, 1:].reshape(-1)
        lse = torch.logsumexp(logits, dim=-1)
        ce = (lse - logits.gather(1, targets[:, None])[:, 0]).mean()
        aux = self.cfg.output_z_coef * lse.pow(2).mean() + ctx.aux
        return ce + aux, ce, aux


def step_loss_and_grads(model, tokens, routes=None, stats=None):
    """Step loss = mean over the G/b micro-batches of loss_mb, and its gradient per parameter.

    tokens: [G, T] int64, micro-batch j = rows j*b..(j+1)*b-1. routes: {MoE layer: [G*T, k]}
    (a dump's /route, token order as tokens.flatten()) to use instead of the reference's own
    top-k; stats: {layer: RouteStats} to add the route comparisons to.
    Returns (loss, ce, aux) as floats and {name: grad tensor}.
    """
    b, T = model.cfg.b, tokens.shape[1]
    n_mb = tokens.shape[0] // b
    assert n_mb * b == tokens.shape[0]
    model.zero_grad(set_to_none=True)
    tot = [0.0, 0.0, 0.0]
    for j in range(n_mb):
        r = {l: t[j * b * T:(j + 1) * b * T] for l, t in (routes or {}).items()}
        loss, ce, aux = model.microbatch_loss(tokens[j * b:(j + 1) * b], r, stats)
        (loss / n_mb).backward()
        for i, t in enumerate((loss, ce, aux)):
            tot[i] += float(t) / n_mb
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    return tuple(tot), grads


# ----------------------------------------------------------------------------- optimizer

DECAY_SUFFIXES = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3",
                  "moe.router", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3",
                  "moe.shared.w1", "moe.shared.w2", "moe.shared.w3", "engram.wk", "engram.wv")
NO_DECAY_SUFFIXES = ("norm.weight", "engram.table", "engram.conv", "engram.bk", "engram.bv")


def param_group(name, cfg):
    """(weight_decay, lr_mult) of parameter `name`, MODEL.md section 6."""
    lr_mult = cfg.engram_lr_mult if name.endswith("engram.table") else 1.0
    if name == "lm_head.weight" or name.endswith(DECAY_SUFFIXES):
        return cfg.weight_decay, lr_mult
    if name == "embed.weight" or name.endswith(NO_DECAY_SUFFIXES):
        return 0.0, lr_mult
    raise KeyError(f"no parameter group rule for {name}")


def lr_at(s, cfg):
    """lr(s) of MODEL.md section 6, s = 1..max_steps."""
    lr, W, n = cfg.lr, cfg.warmup, cfg.max_steps
    if W > 0 and s <= W:
        return lr * s / W
    lr_min = lr * cfg.final_lr_ratio
    if cfg.schedule == "cosine":
        return lr_min + (lr - lr_min) * 0.5 * (1 + math.cos(math.pi * (s - W) / (n - W)))
    if cfg.schedule == "constant":
        return lr
    if cfg.schedule == "wsd":
        if cfg.decay_steps > 0 and s > n - cfg.decay_steps:
            return lr_min + (lr - lr_min) * (n - s) / cfg.decay_steps
        return lr
    raise ValueError(f"unknown schedule {cfg.schedule}")


class AdamW:
    """AdamW with global-norm clipping exactly as MODEL.md section 6 (float64)."""

    def __init__(self, model, exp_avg=None, exp_avg_sq=None):
        self.model, self.cfg = model, model.cfg
        params = dict(model.named_parameters())
        self.m = {n: (exp_avg[n].clone() if exp_avg else torch.zeros_like(p.detach()))
                  for n, p in params.items()}
        self.v = {n: (exp_avg_sq[n].clone() if exp_avg_sq else torch.zeros_like(p.detach()))
                  for n, p in params.items()}

    def step(self, s, grads):
        """Applies step s with the (unclipped) gradients; returns (pre-clip global norm, lr)."""
        c = self.cfg
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        scale = min(1.0, c.clip / (norm + 1e-6)) if c.clip > 0 else 1.0
        lr_s = lr_at(s, c)
        bc1, bc2 = 1 - c.beta1 ** s, 1 - c.beta2 ** s
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                wd, mult = param_group(n, c)
                g = scale * grads[n]
                self.m[n].mul_(c.beta1).add_((1 - c.beta1) * g)
                self.v[n].mul_(c.beta2).add_((1 - c.beta2) * g * g)
                upd = (self.m[n] / bc1) / (torch.sqrt(self.v[n] / bc2) + c.eps)
                p.sub_(lr_s * mult * (wd * p + upd))
        return norm, lr_s


# ----------------------------------------------------------------------------- checkpoints

def h5_path(name):
    return name.replace(".", "/")


def read_group(f, group, names):
    return {n: torch.from_numpy(np.asarray(f[group + "/" + h5_path(n)], dtype=np.float64))
            for n in names}


def load_checkpoint(path):
    """(Config, Model with the checkpoint's weights, AdamW with its moments, step)."""
    import h5py
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] in ("kmoe-checkpoint", b"kmoe-checkpoint"), path
        deck = f["input"].attrs["deck"]
        deck = deck.decode() if isinstance(deck, bytes) else str(deck)
        cfg = Config(deck)
        model = Model(cfg)
        names = [n for n, _ in model.named_parameters()]
        extra = []
        f["model"].visit(lambda k: extra.append(k) if isinstance(f["model"][k], h5py.Dataset) else None)
        unknown = sorted(set(extra) - {h5_path(n) for n in names})
        assert not unknown, f"{path}: datasets the reference does not know: {unknown}"
        weights = read_group(f, "model", names)
        m = read_group(f, "optimizer/exp_avg", names)
        v = read_group(f, "optimizer/exp_avg_sq", names)
        step = int(f.attrs["step"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            assert p.shape == weights[n].shape, f"{n}: {tuple(p.shape)} vs {tuple(weights[n].shape)}"
            p.copy_(weights[n])
    return cfg, model, AdamW(model, m, v), step


# ----------------------------------------------------------------------------- initialization

M64 = (1 << 64) - 1


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for byte in s.encode():
        h = ((h ^ byte) * 0x100000001B3) & M64
    return h


def init_normal(name, shape, seed, std):
    """CONVENTIONS.md: counter-based truncated normal, float32 values (as float64 tensor)."""
    key = splitmix64((seed ^ fnv1a64(name)) & M64)
    u = lambda bits: ((bits >> 11) + 0.5) / 2.0 ** 53  # noqa: E731
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.float32)
    for j in range(n):
        for a in range(32):
            c = (j << 6) + 2 * a
            u1, u2 = u(splitmix64((key + c) & M64)), u(splitmix64((key + c + 1) & M64))
            z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
            if abs(z) <= 3.0:
                break
        out[j] = std * z
    return torch.from_numpy(out.astype(np.float64)).view(*shape)


def matrix_std(cfg, name, shape):
    """Section 7: a matrix's std from model.init (normal: model.init_std; fan_in:
    model.init_gain / sqrt of its input width, the last dimension), output projections (attn.wo, every w2) divided by
    sqrt(2 L) under model.init_depth_scale; the embedding's model.embed_init_std; the Engram
    table's engram.init_std, its projections engram.init_std unless fan_in."""
    if name == "embed.weight":
        return cfg.embed_std
    if ".engram." in name and (name.endswith(".table") or cfg.init == "normal"):
        return cfg.engram_std
    std = cfg.init_std if cfg.init == "normal" else cfg.init_gain / math.sqrt(shape[-1])
    if cfg.init_depth_scale and name.endswith((".attn.wo", ".w2")):
        std /= math.sqrt(2.0 * cfg.L)
    return std


def init_model(model, seed):
    """Section 7 init: matrices truncated normal, norms 1; Engram biases and conv 0."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif n.endswith(("engram.bk", "engram.bv", "engram.conv")):
                p.zero_()
            else:
                std = matrix_std(model.cfg, n, tuple(p.shape))
                p.copy_(init_normal(n, tuple(p.shape), seed, std))


if __name__ == "__main__":
    print(__doc__)
