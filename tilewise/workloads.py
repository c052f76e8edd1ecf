"""Small reference training loops, shared by the tests, the examples and the benchmarks.

Each loop builds its model on the CPU under a seed, moves it to `device`, and trains for `steps`
steps, returning the losses and the final parameters on the CPU (`on_step(step)` is called after each step),
so a run on "neuron" under any
engine mode can be compared with a plain CPU run of the same function.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim // self.heads)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attention = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((attention @ v).transpose(1, 2).reshape(batch, length, dim)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=2, layers=2, max_len=32, dropout=0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class SeqClassifier(nn.Module):
    """Embeds a sequence of any length, mixes it with a GRU-free MLP and pools over time."""

    def __init__(self, vocab=50, dim=32, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.out(self.mix(self.embed(tokens)).mean(dim=1))


def _finish(model, losses):
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def _notify(on_step, step):
    if on_step is not None:
        on_step(step)


def _engine(device, mode):
    if mode is None or device == "cpu":
        return contextlib.nullcontext()
    import tilewise
    return tilewise.engine(mode=mode)


def _train(model, opt, data, device, mode, on_step, loss_of):
    """The usual step: loss, backward, step, zero_grad, then read the loss (the sync point)."""
    losses = []
    with _engine(device, mode):
        for batch in data:
            loss = loss_of(model, *(t.to(device) for t in batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            _notify(on_step, len(losses))
    return _finish(model, losses)


def _classify(model, x, y):
    return F.cross_entropy(model(x), y)


def train_mlp(device="cpu", mode=None, steps=20, seed=0, batch=16, on_step=None):
    torch.manual_seed(seed)
    model = MLP()
    data = [(torch.randn(batch, 32), torch.randint(0, 10, (batch,))) for _ in range(steps)]
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return _train(model, opt, data, device, mode, on_step, _classify)


def text_batches(steps, batch=4, length=16, vocab=64, seed=0):
    """Next-token batches from a text the function writes itself (a repeating pseudo-grammar)."""
    generator = torch.Generator().manual_seed(seed)
    words = ["the", "engine", "compiles", "stable", "regions", "and", "runs", "dynamic", "ops", "eagerly"]
    text = " ".join(words[i] for i in torch.randint(0, len(words), (4000,), generator=generator).tolist())
    ids = torch.tensor([ord(c) % vocab for c in text])
    starts = torch.randint(0, len(ids) - length - 1, (steps, batch), generator=generator)
    return [(torch.stack([ids[s:s + length] for s in row]), torch.stack([ids[s + 1:s + length + 1] for s in row]))
            for row in starts.tolist()]


def train_gpt(device="cpu", mode=None, steps=20, seed=0, on_step=None):
    torch.manual_seed(seed)
    model = TinyGPT()
    data = text_batches(steps)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(seed + 1)  # dropout masks: the same stream on every device
    return _train(model, opt, data, device, mode, on_step, _next_token_loss)


def train_gpt_at_lengths(device="cpu", mode=None, steps=20, seed=0, low=4, high=16, on_step=None):
    """TinyGPT at a new sequence length (uniform in low..high) most steps: a transformer whose
    sizes change, as batches of text of unequal lengths make it."""
    torch.manual_seed(seed)
    model = TinyGPT()
    lengths = random_lengths(steps, low, high, seed)
    data = [(x[:, :n].contiguous(), y[:, :n].contiguous()) for (x, y), n in zip(text_batches(steps, length=high), lengths)]
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(seed + 1)
    return _train(model, opt, data, device, mode, on_step, _next_token_loss)


def _next_token_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def seq_batches(steps, lengths=(5, 9, 12, 7), batch=8, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, lengths[i % len(lengths)]), generator=generator),
             torch.randint(0, 4, (batch,), generator=generator)) for i in range(steps)]


def train_seq(device="cpu", mode=None, steps=20, seed=0, lengths=(5, 9, 12, 7), on_step=None):
    """The batch length changes every step: the forward and backward are dynamic, the optimizer is not."""
    torch.manual_seed(seed)
    model = SeqClassifier()
    data = seq_batches(steps, lengths)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with _engine(device, mode):
        for tokens, labels in data:
            loss = F.cross_entropy(model(tokens.to(device)), labels.to(device))
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            _sync_point(device)
            opt.step()
            _notify(on_step, len(losses))
    return _finish(model, losses)


def random_lengths(steps, low=4, high=64, seed=0):
    """A new length (or batch size) most steps, uniform in low..high, from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(int(n) for n in torch.randint(low, high + 1, (steps,), generator=generator))


def infer_mlp(device="cpu", mode=None, steps=50, seed=0, low=1, high=64):
    """MLP inference under inference_mode with a batch size that changes every step; the outputs."""
    torch.manual_seed(seed)
    model = MLP().eval().to(device)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randn(n, 32, generator=generator) for n in random_lengths(steps, low, high, seed)]
    outputs = []
    with torch.inference_mode(), _engine(device, mode):
        for x in batches:
            outputs.append(model(x.to(device)).cpu())
    return outputs


def _sync_point(device):
    # The loop reads the loss before stepping; the optimizer step then starts a segment of its own.
    if device != "cpu":
        import tilewise
        tilewise.sync()


def train_branchy(device="cpu", mode=None, steps=20, seed=0, on_step=None):
    """Data-dependent control flow: an extra regularised step whenever the loss is high."""
    torch.manual_seed(seed)
    model = MLP()
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(steps)]
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return _train(model, opt, data, device, mode, on_step, _loss_with_branch)


def _loss_with_branch(model, x, y):
    loss = F.cross_entropy(model(x), y)
    if loss.item() > 2.2:  # reads the loss on the host: the segment so far is computed first
        loss = loss + 1e-3 * sum((p * p).sum() for p in model.parameters())
    return loss


WORKLOADS = {"mlp": train_mlp, "gpt": train_gpt, "seq": train_seq, "branchy": train_branchy}
