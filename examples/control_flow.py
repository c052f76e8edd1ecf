"""Data-dependent control flow: the loop reads the loss and chooses what to run next.

While the loss is high, a step adds a weight penalty (an extra branch); once the loss stays below a
target, training stops early. Each `.item()` is a sync point, so every path through the loop is a
segment of its own: the engine compiles each path once it has repeated, whichever the data picks.

    python examples/control_flow.py              # mode from TILEWISE_MODE, default "adaptive"
    TILEWISE_MODE=compiled python examples/control_flow.py --steps 100
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise

parser = argparse.ArgumentParser(description="A training loop that branches on its loss.")
parser.add_argument("--steps", type=int, default=60, help="most training steps (default 60)")
steps = parser.parse_args().steps

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("neuron")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
centres = 2 * torch.randn(4, 16)  # four Gaussian blobs to tell apart
penalised, calm = 0, 0

with tilewise.engine():
    for step in range(1, steps + 1):
        y = torch.randint(0, 4, (32,))
        x = centres[y] + torch.randn(32, 16)
        loss = F.cross_entropy(model(x.to("neuron")), y.to("neuron"))
        if loss.item() > 0.5:  # the branch depends on a value computed on the device
            loss = loss + 1e-3 * sum((p * p).sum() for p in model.parameters())
            penalised += 1
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        calm = calm + 1 if value < 0.05 else 0
        if step % 10 == 0 or calm == 5 or step == steps:
            print(f"step {step:3d}  loss {value:.4f}")
        if calm == 5:  # early exit: five steps in a row below the target
            print(f"early exit at step {step}")
            break

print(f"{penalised} of {step} steps took the penalty branch")
print(tilewise.stats().report())
