#!/usr/bin/python3
"""An independent reading of a Hugging Face model directory: the model types kmoe exports
(olmo2, llama, olmoe, flex_olmo) as their Hugging Face definitions compute them, built from
config.json and the safetensors files alone (its own safetensors reader: the 8-byte header
length, the JSON header, the raw little-endian data), in float64.

The semantics relied on (docs/INTEROP.md lists them):
- RMSNorm: w * x / sqrt(mean(x^2) + rms_norm_eps).
- olmo2 and flex_olmo: h = x + post_attention_layernorm(attn(x)); x = h +
  post_feedforward_layernorm(mlp(h)). llama and olmoe: h = x + attn(input_layernorm(x));
  x = h + mlp(post_attention_layernorm(h)).
- Attention: q, k, v projections without biases; olmo2, olmoe and flex_olmo apply q_norm over
  the whole projected q (width heads * head_dim) and k_norm over the whole k before splitting
  into heads, llama none; RoPE with inv_freq = rope_theta^(-2i/head_dim) on the two halves of
  each head (rotate_half); causal softmax with scale 1/sqrt(head_dim); query head h reads kv head
  h // (heads / kv_heads); o_proj.
- MLP: down_proj(silu(gate_proj(x)) * up_proj(x)). MoE (olmoe, flex_olmo): router logits
  gate(x), softmax over all experts, the num_experts_per_tok largest, renormalized to sum 1 when
  norm_topk_prob, the experts' MLP outputs weighted by them.
- logits = lm_head(norm(x)), or the embedding matrix when tie_word_embeddings.

usage: hf_reference.py MODEL_DIR TOKENS.bin SEQ_LEN INSTANCES [uint16|uint32]
         prints `hf_loss <mean CE over the instances' targets> tokens <targets>`;
       hf_reference.py MODEL_DIR --logits IDS.npy OUT.npy
         writes the logits (float64) of one sequence's positions.
Imported, hf_loss() and hf_logits() give the same (tests/regression/hf_interop.py: one torch
import for all its readings).
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

DTYPES = {"F32": (np.float32, 4), "BF16": (None, 2), "F16": (np.float16, 2)}


def read_safetensors(path):
    """{name: float64 tensor} of one file, from the bytes as the format lays them out."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        raw = data[base + begin:base + end]
        kind, size = DTYPES[t["dtype"]]
        if t["dtype"] == "BF16":  # the upper 16 bits of a float32
            words = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            values = words.view(np.float32)
        else:
            values = np.frombuffer(raw, dtype=np.dtype(kind).newbyteorder("<"))
        out[name] = torch.from_numpy(values.astype(np.float64).reshape(t["shape"]))
    return out


def read_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(model_dir, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(model_dir, name)))
    return weights


def rmsnorm(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(u, theta):
    """u: (heads, T, dh); the two halves of each head rotated by position."""
    T, dh = u.shape[1], u.shape[2]
    half = dh // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / dh)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = u[..., :half], u[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class HfModel:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.c = json.load(f)
        self.w = read_weights(model_dir)
        self.type = self.c["model_type"]
        assert self.type in ("olmo2", "llama", "olmoe", "flex_olmo"), self.type

    def attention(self, x, p):
        c, w = self.c, self.w
        H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
        dh = c["hidden_size"] // H
        eps = c["rms_norm_eps"]
        q = x @ w[p + "self_attn.q_proj.weight"].T
        k = x @ w[p + "self_attn.k_proj.weight"].T
        v = x @ w[p + "self_attn.v_proj.weight"].T
        if self.type != "llama":
            q = rmsnorm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rmsnorm(k, w[p + "self_attn.k_norm.weight"], eps)
        T = x.shape[0]
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        q = rope(q.reshape(T, H, dh).transpose(0, 1), theta)
        k = rope(k.reshape(T, Hkv, dh).transpose(0, 1), theta)
        v = v.reshape(T, Hkv, dh).transpose(0, 1)
        k = k.repeat_interleave(H // Hkv, dim=0)
        v = v.repeat_interleave(H // Hkv, dim=0)
        s = q @ k.transpose(1, 2) / math.sqrt(dh)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        s = s.masked_fill(mask, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return o.transpose(0, 1).reshape(T, H * dh) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(self, x, p):
        w = self.w
        g = x @ w[p + "gate_proj.weight"].T
        u = x @ w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(g) * u) @ w[p + "down_proj.weight"].T

    def ffn(self, x, p):
        if self.type in ("olmo2", "llama"):
            return self.mlp(x, p + "mlp.")
        c = self.c
        probs = torch.softmax(x @ self.w[p + "mlp.gate.weight"].T, dim=-1)
        top, sel = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
        if c.get("norm_topk_prob", False):
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(c["num_experts"]):
            rows, slot = torch.nonzero(sel == e, as_tuple=True)
            if len(rows):
                out[rows] += top[rows, slot, None] * self.mlp(x[rows], f"{p}mlp.experts.{e}.")
        return out

    def logits(self, tokens):
        c, w = self.c, self.w
        eps = c["rms_norm_eps"]
        x = w["model.embed_tokens.weight"][tokens]
        reordered = self.type in ("olmo2", "flex_olmo")
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            if reordered:
                h = x + rmsnorm(self.attention(x, p), w[p + "post_attention_layernorm.weight"], eps)
                x = h + rmsnorm(self.ffn(h, p), w[p + "post_feedforward_layernorm.weight"], eps)
            else:
                h = x + self.attention(rmsnorm(x, w[p + "input_layernorm.weight"], eps), p)
                x = h + self.ffn(rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps), p)
        x = rmsnorm(x, w["model.norm.weight"], eps)
        head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
        return x @ head.T


def hf_loss(model_dir, tokens_path, T, n, dtype="uint16"):
    """(mean CE over the targets of the first n sequences of T tokens, the number of targets)."""
    ids = np.fromfile(tokens_path, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)
    model = HfModel(model_dir)
    total, count = 0.0, 0
    for i in range(n):
        seq = torch.from_numpy(ids[i * T:(i + 1) * T])
        lp = torch.log_softmax(model.logits(seq), dim=-1)
        total -= lp[torch.arange(T - 1), seq[1:]].sum().item()
        count += T - 1
    return total / count, count


def hf_logits(model_dir, ids_path):
    """The float64 logits [positions, vocab] of the sequence in IDS.npy."""
    ids = torch.from_numpy(np.load(ids_path).astype(np.int64))
    return HfModel(model_dir).logits(ids).numpy()


def main():
    if len(sys.argv) == 5 and sys.argv[2] == "--logits":
        np.save(sys.argv[4], hf_logits(sys.argv[1], sys.argv[3]))
        return
    model_dir, tokens_path, T, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dtype = sys.argv[5] if len(sys.argv) > 5 else "uint16"
    loss, count = hf_loss(model_dir, tokens_path, T, n, dtype)
    print(f"hf_loss {loss:.17g} tokens {count}")


if __name__ == "__main__":
    main()
