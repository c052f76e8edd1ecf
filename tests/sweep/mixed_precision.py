"""5. Mixed precision: a float32 MLP trained under torch.autocast(bfloat16) (the CPU reference under
the CPU's autocast: linear and relu have the same policy on both); a bf16 model with LayerNorm
(`model.to(torch.bfloat16)`); a float32 model under autocast(float16) with GradScaler."""
import torch
from torch import nn

from sweep.harness import Outcome, Tolerance

STEPS, WARMUP = 6, 4
TOLERANCE = Tolerance(rtol=1.6e-2, atol=1e-5)  # torch.testing's bfloat16 default


def batches(dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=g).to(dtype), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def autocast_bf16(device, probe):
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    losses = []
    for step, (x, y) in enumerate(batches()):
        if step == WARMUP:
            probe.warm()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x.to(device))
        loss = nn.functional.cross_entropy(logits.float(), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {f"autocast.{k}": v.detach().cpu() for k, v in model.state_dict().items()}, logits.dtype


def bf16_layernorm(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    losses = []
    for x, y in batches(torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x.to(device)).float(), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {f"bf16.{k}": v.detach().cpu() for k, v in model.state_dict().items()}


def fp16_grad_scaler(device):
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 14, growth_interval=2)
    losses, scales = [], []
    for x, y in batches():
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x.to(device)).float(), y.to(device))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, {f"fp16.{k}": v.detach().cpu() for k, v in model.state_dict().items()}, scales


def run(device, probe):
    a_losses, a_state, a_dtype = autocast_bf16(device, probe)
    b_losses, b_state = bf16_layernorm(device)
    f_losses, f_state, scales = fp16_grad_scaler(device)
    return Outcome(a_losses + b_losses + f_losses, {**a_state, **b_state, **f_state},
                   {"autocast_logits_dtype": str(a_dtype), "grad_scales": scales})
