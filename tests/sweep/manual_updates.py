"""6. Hand-written update loops: `p.data = p.data - lr * p.grad`, an EMA of the weights through
`.data.mul_().add_()`, `p.data.copy_()`, gradient accumulation over two micro-batches, `loss.item()`
read before `backward()`, parameter edits under `torch.no_grad()`, `zero_grad(set_to_none=False)`."""
import torch
from torch import nn

from sweep.harness import Outcome

STEPS, WARMUP, LR = 8, 5, 0.05


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))


def run(device, probe):
    net = model().to(device)
    ema = model().to(device)
    g = torch.Generator().manual_seed(6)
    data = [[(torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)) for _ in range(2)] for _ in range(STEPS)]
    losses = []
    for step, micro in enumerate(data):
        if step == WARMUP:
            probe.warm()
        net.zero_grad(set_to_none=False)
        for x, y in micro:  # gradient accumulation
            loss = nn.functional.mse_loss(net(x.to(device)), y.to(device)) / len(micro)
            losses.append(loss.item())  # read before backward
            loss.backward()
        for i, p in enumerate(net.parameters()):
            if i % 2 == 0:
                p.data = p.data - LR * p.grad
            else:
                p.data.copy_(p.data - LR * p.grad)
        with torch.no_grad():
            net[0].weight.clamp_(-0.5, 0.5)
            net[2].bias.mul_(0.99)
        for e, p in zip(ema.parameters(), net.parameters()):
            e.data.mul_(0.9).add_(0.1 * p.data)
    tensors = {f"net.{k}": v.detach().cpu() for k, v in net.state_dict().items()}
    tensors.update({f"ema.{k}": v.detach().cpu() for k, v in ema.state_dict().items()})
    tensors.update({f"grad.{i}": p.grad.cpu() for i, p in enumerate(net.parameters())})
    return Outcome(losses, tensors)
