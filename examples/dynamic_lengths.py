"""Dynamic shapes: a sequence classifier trained on batches of a different length every step.

The forward and backward see a new sequence length each batch. Once the same ops have come at
two lengths, the engine compiles them once for every length: the length becomes a symbolic size
of one shape-generic region (compiled mode compiles the first length as it is, then generalises),
and each new length gets its tile programs by evaluating the region's parametric program
(`evaluated` in the statistics; `specialised` counts those the compiler's passes made).
The optimizer step, whose shapes never change, runs in the same region. The statistics say how
many compiles each region site took (at most two) and what ran eagerly, and why.

    python examples/dynamic_lengths.py           # mode from TILEWISE_MODE, default "adaptive"
    TILEWISE_MODE=compiled python examples/dynamic_lengths.py
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise


class SequenceClassifier(nn.Module):
    """Embeds each token, mixes features per position, averages over time, classifies."""

    def __init__(self, vocab=10, dim=32, classes=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.out(self.mix(self.embed(tokens)).mean(dim=1))


def batch(length, size=16):
    """Digit sequences; the label says whether their mean is above 4.5."""
    tokens = torch.randint(0, 10, (size, length))
    return tokens, (tokens.float().mean(dim=1) > 4.5).long()


def main():
    parser = argparse.ArgumentParser(description="Train on sequences whose length changes every batch.")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    steps = parser.parse_args().steps

    torch.manual_seed(0)
    model = SequenceClassifier().to("neuron")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    lengths = torch.randint(4, 33, (steps,)).tolist()

    with tilewise.engine():
        for step, length in enumerate(lengths, 1):
            tokens, labels = batch(length)
            loss = F.cross_entropy(model(tokens.to("neuron")), labels.to("neuron"))
            opt.zero_grad()
            loss.backward()
            value = loss.item()  # forward and backward end here: the optimizer step is a segment of its own
            opt.step()
            if step % 10 == 0 or step == steps:
                print(f"step {step:3d}  length {length:2d}  loss {value:.4f}")

    stats = tilewise.stats()
    print(f"{len(set(lengths))} different lengths; {100 * stats.compiled_fraction:.0f}% of compute ops ran "
          "compiled; the statistics say what ran eagerly, and why")
    print(stats.report())


if __name__ == "__main__":
    main()
