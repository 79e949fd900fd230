#!/usr/bin/python3
"""A plain PyTorch peer of a kmoe deck's model (docs/spec/MODEL.md) for throughput and memory on
one GPU: the same shapes, the same global and micro batches, AdamW, trained on random windows of
a kmoe token file. Not a numerics reference (tests/reference/ is): it is what a researcher would
write in eager PyTorch, so kmoe's tokens/s and memory have something to stand beside.

- Attention: torch.nn.functional.scaled_dot_product_attention (causal), QK-norm and RoPE as in
  MODEL.md section 1; block norm "reordered" (OLMo2) or "pre" (Llama).
- Experts (--experts > 0): "loop" is the Hugging Face style (one masked gather, SwiGLU and
  index_add per expert, with the host waits that implies); "grouped" sorts the (token, slot)
  pairs by expert and runs torch._grouped_mm over all experts at once (bf16 only, where this
  PyTorch has it). Router in fp32, softmax top-k, load-balancing and router z-losses.
- Precision: "fp32" (TF32 off: the same products as kmoe's fp32) or "bf16" (fp32 weights,
  autocast bf16 products, as kmoe's train.precision = bf16).

Prints one line "torch_peer: ..." with tokens/s (median of the timed steps), the step time and
the peak device memory PyTorch allocated, and writes the same as JSON with --json. Asserts
nothing.

usage: torch_peer.py --tokens train.bin [--d-model 1024 --n-layers 16 ... --experts 64]
"""
import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def rms(x, g, eps):
    return g * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype))


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, self.H, self.Hkv = a.d_model, a.n_heads, a.n_kv_heads or a.n_heads
        self.dh = D // self.H
        self.wq = nn.Linear(D, self.H * self.dh, bias=False)
        self.wkv = nn.Linear(D, 2 * self.Hkv * self.dh, bias=False)
        self.wo = nn.Linear(self.H * self.dh, D, bias=False)
        self.gq = nn.Parameter(torch.ones(self.H * self.dh))
        self.gk = nn.Parameter(torch.ones(self.Hkv * self.dh))
        self.eps = a.eps

    def forward(self, x, cos, sin):
        b, T, _ = x.shape
        k, v = self.wkv(x).split(self.Hkv * self.dh, dim=-1)
        q = rms(self.wq(x), self.gq, self.eps).view(b, T, self.H, self.dh).transpose(1, 2)
        k = rms(k, self.gk, self.eps).view(b, T, self.Hkv, self.dh).transpose(1, 2)
        v = v.reshape(b, T, self.Hkv, self.dh).transpose(1, 2)
        half = self.dh // 2

        def rotate(u):
            u1, u2 = u[..., :half], u[..., half:]
            return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], dim=-1).to(v.dtype)

        q, k = rotate(q), rotate(k)
        if self.Hkv != self.H:
            k = k.repeat_interleave(self.H // self.Hkv, dim=1)
            v = v.repeat_interleave(self.H // self.Hkv, dim=1)
        if hasattr(F, "scaled_dot_product_attention"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch before 2.0 (CPU trials only)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(self.dh)
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1),
                              float("-inf"))
            o = torch.softmax(s.float(), dim=-1).to(v.dtype) @ v
        return self.wo(o.transpose(1, 2).reshape(b, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, D, F_):
        super().__init__()
        self.w13 = nn.Linear(D, 2 * F_, bias=False)
        self.w2 = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        g, u = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class Moe(nn.Module):
    def __init__(self, a):
        super().__init__()
        E, D, Fe = a.experts, a.d_model, a.expert_hidden
        self.E, self.k, self.impl = E, a.top_k, a.expert_impl
        self.router = nn.Parameter(torch.randn(E, D) / math.sqrt(D))
        self.w1 = nn.Parameter(torch.randn(E, 2 * Fe, D) * 0.02)  # [W1_e; W3_e]
        self.w2 = nn.Parameter(torch.randn(E, D, Fe) * 0.02)
        self.aux = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            z = x.float() @ self.router.t()
            p = torch.softmax(z, dim=-1)
            w, sel = torch.topk(p, self.k, dim=-1)
            counts = torch.bincount(sel.reshape(-1), minlength=self.E)
            lb = (self.E / self.k) * ((counts.float() / N) * p.mean(0)).sum()
            rz = torch.logsumexp(z, dim=-1).pow(2).mean()
            self.aux = 0.01 * lb + 0.001 * rz
        return (self.grouped(x, w, sel, counts) if self.impl == "grouped"
                else self.loop(x, w, sel)).reshape(shape)

    def loop(self, x, w, sel):
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = torch.where(sel == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(x[tok], self.w1[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.w2[e])
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out

    def grouped(self, x, w, sel, counts):
        order = torch.argsort(sel.reshape(-1), stable=True)
        tok = order // self.k
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok].to(torch.bfloat16)
        # Right operands [E, K, N] column-major, as the grouped product wants them.
        h = torch._grouped_mm(xs, self.w1.to(torch.bfloat16).transpose(1, 2), offs=offs)
        g, u = h.chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(g) * u).contiguous(),
                              self.w2.to(torch.bfloat16).transpose(1, 2), offs=offs)
        y = y.float() * w.reshape(-1)[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(
            0, tok, y).to(x.dtype)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn = Attention(a)
        self.ffn = Moe(a) if a.experts > 0 else SwiGLU(a.d_model, a.ffn_hidden)
        self.g_attn = nn.Parameter(torch.ones(a.d_model))
        self.g_ffn = nn.Parameter(torch.ones(a.d_model))
        self.pre, self.eps = a.block_norm == "pre", a.eps

    def forward(self, x, cos, sin):
        if self.pre:
            h = x + self.attn(rms(x, self.g_attn, self.eps), cos, sin)
            return h + self.ffn(rms(h, self.g_ffn, self.eps))
        h = x + rms(self.attn(x, cos, sin), self.g_attn, self.eps)
        return h + rms(self.ffn(h), self.g_ffn, self.eps)


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.g_final = nn.Parameter(torch.ones(a.d_model))
        self.lm_head = nn.Linear(a.d_model, a.vocab_size, bias=False)
        dh = a.d_model // a.n_heads
        inv = a.rope_theta ** (-2.0 * torch.arange(dh // 2, dtype=torch.float64) / dh)
        ang = torch.arange(a.seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", torch.cos(ang).float())
        self.register_buffer("sin", torch.sin(ang).float())
        self.eps = a.eps

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.lm_head(rms(x, self.g_final, self.eps))[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        for blk in self.blocks:
            if isinstance(blk.ffn, Moe):
                loss = loss + blk.ffn.aux
        return loss


def write_profile(prof, path, steps, cuda):
    """The profiled steps' operations and kernels per step: device time where a GPU ran them
    (self time, so nothing is counted twice), host time otherwise."""
    def self_us(e):
        for k in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + \
                ["self_cpu_time_total"]:
            if hasattr(e, k):
                return float(getattr(e, k))
        return 0.0
    rows = sorted(((self_us(e), e.key, e.count) for e in prof.key_averages()), reverse=True)
    with open(path + ".csv", "w") as f:
        f.write("name,calls,total_us\n")
        for us, name, count in rows:
            if us > 0:
                f.write(f"{name.replace(',', ';')[:160]},{count / steps:.2f},{us / steps:.1f}\n")
    with open(path + ".txt", "w") as f:
        f.write(f"# {steps} steps profiled\n")
        for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + \
                ["self_cpu_time_total"]:
            try:
                f.write(prof.key_averages().table(sort_by=key, row_limit=60))
                break
            except Exception:  # a key this PyTorch does not know
                continue


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True, help="a kmoe token file (uint16)")
    for name, default in [("vocab-size", 320), ("d-model", 1024), ("n-layers", 16),
                          ("n-heads", 16), ("n-kv-heads", 0), ("ffn-hidden", 2048),
                          ("experts", 0), ("top-k", 8), ("expert-hidden", 512),
                          ("seq-len", 1024), ("global-batch", 16), ("micro-batch", 4),
                          ("steps", 6), ("skip", 2)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--expert-impl", choices=["loop", "grouped"], default="loop")
    ap.add_argument("--block-norm", choices=["reordered", "pre"], default="reordered")
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="also write the timed steps' kernels (torch.profiler) to "
                    "PROFILE.csv (name,calls,us per step, device time) and PROFILE.txt")
    ap.add_argument("--device", default="cuda", help="cpu: a trial of the script itself")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("torch_peer: skipped (PyTorch sees no CUDA device)")
        sys.exit(3)
    if a.expert_impl == "grouped" and (a.precision != "bf16" or not hasattr(torch, "_grouped_mm")):
        print("torch_peer: skipped (grouped experts need bf16 and torch._grouped_mm)")
        sys.exit(3)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = Model(a).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    data = np.fromfile(a.tokens, dtype=np.uint16)
    rng = np.random.default_rng(0)
    n_micro = a.global_batch // a.micro_batch
    times = []
    prof, first_profiled = None, min(a.skip, a.steps - 1)
    for step in range(a.steps):
        if a.profile and step == first_profiled:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        starts = rng.integers(0, len(data) - a.seq_len, size=a.global_batch)
        batch = torch.from_numpy(np.stack([data[s:s + a.seq_len] for s in starts]).astype(
            np.int64)).to(dev)
        sync()
        t0 = time.perf_counter()
        for m in range(n_micro):
            ids = batch[m * a.micro_batch:(m + 1) * a.micro_batch]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
                loss = model(ids) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
        write_profile(prof, a.profile, a.steps - first_profiled, cuda)
    timed = times[a.skip:] or times
    step_s = statistics.median(timed)
    r = {"tokens_per_s": a.global_batch * a.seq_len / step_s, "step_s": step_s,
         "peak_alloc_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
         "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else 0.0,
         "params": sum(p.numel() for p in model.parameters()), "loss": float(loss) * n_micro,
         "precision": a.precision, "experts": a.experts,
         "expert_impl": a.expert_impl if a.experts else "dense", "torch": torch.__version__}
    print(f"torch_peer: {r['expert_impl']} {a.precision}: {r['tokens_per_s']:,.0f} tokens/s, "
          f"{step_s * 1e3:.1f} ms/step, peak {r['peak_alloc_mib']:,.0f} MiB allocated "
          f"({r['peak_reserved_mib']:,.0f} reserved), {r['params'] / 1e6:.1f} M parameters, "
          f"torch {torch.__version__}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()
