"""torch.compile(model, backend="tilewise"): Dynamo captures the model, tilewise compiles it.

Dynamo hands the forward and backward graphs to tilewise's compiler, which fuses them into tile
kernels once; every later call runs those kernels. The optimizer step, which Dynamo does not see,
runs in tilewise.engine() (mode from TILEWISE_MODE).

    python examples/torch_compile.py
    TILEWISE_MODE=eager python examples/torch_compile.py --steps 40
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise
from tilewise.compiler import backend_stats  # how many graphs the backend compiled and ran

parser = argparse.ArgumentParser(description="Train an MLP compiled with torch.compile(backend='tilewise').")
parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
steps = parser.parse_args().steps

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10)).to("neuron")
compiled = torch.compile(model, backend="tilewise")
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
centres = torch.randn(10, 32)  # ten Gaussian blobs: a task the loss visibly learns

for step in range(1, steps + 1):
    y = torch.randint(0, 10, (32,))
    x = centres[y] + 0.5 * torch.randn(32, 32)
    # The compiled model runs outside the engine block: inside tilewise.engine(), Dynamo does not
    # compile under the engine's dispatch mode (the engine would run the model op by op).
    loss = F.cross_entropy(compiled(x.to("neuron")), y.to("neuron"))
    loss.backward()
    with tilewise.engine():
        opt.step()
        opt.zero_grad()
    if step % 5 == 0 or step == steps:
        print(f"step {step:3d}  loss {loss.item():.4f}")

graphs = backend_stats
print(f"torch.compile: {graphs.graphs_compiled} graphs compiled (forward and backward), "
      f"{graphs.calls} compiled calls")
print(tilewise.stats().report())
