"""Quickstart: train a small MLP classifier on the simulated NeuronCore.

    python examples/quickstart.py              # mode from TILEWISE_MODE, default "adaptive"
    TILEWISE_MODE=eager python examples/quickstart.py --steps 40
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise

parser = argparse.ArgumentParser(description="Train a small MLP classifier on the neuron device.")
parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
steps = parser.parse_args().steps

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).to("neuron")
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(steps)]

losses = []
with tilewise.engine():
    for step, (x, y) in enumerate(data, 1):
        loss = F.cross_entropy(model(x.to("neuron")), y.to("neuron"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # reading the loss ends the step's segment: each step is one
        if step % 5 == 0 or step == steps:
            print(f"step {step:2d}  loss {losses[-1]:.4f}")

stats = tilewise.stats()
print(f"simulated device time {stats.simulated_seconds * 1e3:.3f} ms, "
      f"device memory in use {torch.neuron.memory_allocated() / 1024:.1f} KiB "
      f"(peak {torch.neuron.max_memory_allocated() / 1024:.1f} KiB)")
print(stats.report())
