#!/usr/bin/python3
"""A plain PyTorch version of kmoe's dense model (docs/spec/MODEL.md), trained on the same token
files with the same hyperparameters, for the speed and loss baseline. Not a reference for exact
numerics (tests/reference/ is); this is a reasonably efficient nn.Module training loop.

usage: torch_baseline.py --train data/fortunes/train.bin --val data/fortunes/val.bin [--steps 250]
"""
import argparse
import math
import resource
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope_tables(T, dh, theta):
    inv = theta ** (-2.0 * torch.arange(dh // 2, dtype=torch.float64) / dh)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope(u, cos, sin):  # u: (b, h, T, dh)
    h = u.shape[-1] // 2
    a, b = u[..., :h], u[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, H, Hkv = a.d_model, a.n_heads, a.n_kv_heads
        self.H, self.Hkv, self.dh = H, Hkv, D // H
        self.wq = nn.Linear(D, H * self.dh, bias=False)
        self.wk = nn.Linear(D, Hkv * self.dh, bias=False)
        self.wv = nn.Linear(D, Hkv * self.dh, bias=False)
        self.wo = nn.Linear(H * self.dh, D, bias=False)
        self.q_norm = RMSNorm(H * self.dh, a.eps)
        self.k_norm = RMSNorm(Hkv * self.dh, a.eps)
        self.attn_norm = RMSNorm(D, a.eps)
        self.ffn_norm = RMSNorm(D, a.eps)
        self.w1 = nn.Linear(D, a.ffn_hidden, bias=False)
        self.w3 = nn.Linear(D, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, D, bias=False)
        self.pre = a.block_norm == "pre"

    def attn(self, x, cos, sin, mask):
        b, T, _ = x.shape
        q = self.q_norm(self.wq(x)).view(b, T, self.H, self.dh).transpose(1, 2)
        k = self.k_norm(self.wk(x)).view(b, T, self.Hkv, self.dh).transpose(1, 2)
        v = self.wv(x).view(b, T, self.Hkv, self.dh).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        g = self.H // self.Hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.dh) + mask
        o = torch.softmax(s, dim=-1) @ v
        return self.wo(o.transpose(1, 2).reshape(b, T, -1))

    def mlp(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x, cos, sin, mask):
        if self.pre:
            h = x + self.attn(self.attn_norm(x), cos, sin, mask)
            return h + self.mlp(self.ffn_norm(h))
        h = x + self.attn_norm(self.attn(x, cos, sin, mask))
        return h + self.ffn_norm(self.mlp(h))


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.blocks = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.final_norm = RMSNorm(a.d_model, a.eps)
        self.lm_head = nn.Linear(a.d_model, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.seq_len, a.d_model // a.n_heads, a.rope_theta)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        mask = torch.full((a.seq_len, a.seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask)
        for name, p in self.named_parameters():  # MODEL.md section 7: N(0, std) cut at 3 std
            if p.dim() == 2 and not a.torch_default_init:
                nn.init.trunc_normal_(p, std=a.init_std, a=-3 * a.init_std, b=3 * a.init_std)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin, self.mask)
        return self.lm_head(self.final_norm(x))


def loss_fn(model, ids):
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-instances", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=320)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-kv-heads", type=int, default=0)
    ap.add_argument("--ffn-hidden", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block-norm", default="reordered")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-default-init", action="store_true",
                    help="keep PyTorch's default Linear/Embedding init instead of MODEL.md's")
    a = ap.parse_args()
    a.n_kv_heads = a.n_kv_heads or a.n_heads
    a.eps, a.rope_theta, a.init_std = 1e-6, 500000.0, 0.02
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    T = a.seq_len
    train = np.fromfile(a.train, dtype=np.uint16)
    val = np.fromfile(a.val, dtype=np.uint16)
    train = torch.from_numpy(train[: len(train) // T * T].astype(np.int64)).view(-1, T)
    val = torch.from_numpy(val[: len(val) // T * T].astype(np.int64)).view(-1, T)[: a.eval_instances]
    model = Model(a)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embed")]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith("embed"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    lr_min = 0.1 * a.lr

    def lr_at(s):
        if s <= a.warmup:
            return a.lr * s / a.warmup
        return lr_min + (a.lr - lr_min) * 0.5 * (1 + math.cos(math.pi * (s - a.warmup) / (a.steps - a.warmup)))

    gen = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(train.shape[0], generator=gen)
    pos, n_micro = 0, a.global_batch // a.micro_batch
    t_train, tokens = 0.0, 0
    for s in range(1, a.steps + 1):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(n_micro):
            idx = order[(pos + torch.arange(a.micro_batch) + j * a.micro_batch) % len(order)]
            loss = loss_fn(model, train[idx]) / n_micro
            loss.backward()
            total += loss.item()
        pos += a.global_batch
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if s > 2:  # skip warm-up steps in the throughput
            t_train += dt
            tokens += a.global_batch * T
        if s % a.eval_every == 0 or s == a.steps:
            with torch.no_grad():
                vl = sum(loss_fn(model, val[i:i + a.micro_batch]).item() * len(val[i:i + a.micro_batch])
                         for i in range(0, len(val), a.micro_batch)) / len(val)
            print(f"torch step {s:4d} loss {total:.4f} gnorm {gnorm:.3f} val_loss {vl:.4f}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch tokens_per_s {tokens / t_train:.0f} peak_rss_mib {rss:.0f}", flush=True)


if __name__ == "__main__":
    main()
