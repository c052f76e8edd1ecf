"""A small GPT-style character language model, trained on a text this script ships.

Embedding, causal self-attention, layer norm, a GELU MLP and AdamW: the whole step repeats with the
same shapes, so the engine compiles it after a few steps and serves it from its cache.

    python examples/tiny_gpt.py                  # mode from TILEWISE_MODE, default "adaptive"
    TILEWISE_MODE=compiled python examples/tiny_gpt.py --steps 60
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise

TEXT = """\
The engine watches the stream of operations. What repeats is compiled into fused kernels and kept
in a cache; what changes keeps running eagerly, one operation at a time. A training step repeats:
the same layers, the same shapes, the same optimizer update, step after step after step.
"""


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, context):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("causal", torch.ones(context, context, dtype=torch.bool).tril())

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.causal[:length, :length], float("-inf"))
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, dim, heads, context):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim=32, heads=2, layers=2, context=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, context) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def batches(ids, steps, batch=8, context=16):
    """Random windows of the text: inputs and the same windows shifted by one character."""
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - context - 1, (batch,))
        x = torch.stack([ids[s:s + context] for s in starts])
        y = torch.stack([ids[s + 1:s + context + 1] for s in starts])
        yield x, y


def main():
    parser = argparse.ArgumentParser(description="Train a tiny GPT on the neuron device.")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    steps = parser.parse_args().steps

    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    model = GPT(vocab=len(chars)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    with tilewise.engine():
        for step, (x, y) in enumerate(batches(ids, steps), 1):
            logits = model(x.to("neuron"))
            loss = F.cross_entropy(logits.flatten(0, 1), y.to("neuron").flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = loss.item()  # one read per step: every step is the same segment
            if step % 10 == 0 or step == steps:
                print(f"step {step:3d}  loss {value:.4f}")
    print(tilewise.stats().report())


if __name__ == "__main__":
    main()
