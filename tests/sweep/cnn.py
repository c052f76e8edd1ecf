"""3. A hand-written CNN: SGD + momentum, CosineAnnealingLR, eval-mode validation every 2 steps,
torch.save of model + optimizer + schedule mid-training and torch.load(map_location=device) to
resume. The reference is one uninterrupted CPU run."""
import io

import torch
from torch import nn

from sweep.harness import Outcome

STEPS, SAVE_AT, WARMUP = 8, 4, 5  # resuming rebuilds the model: its first steps after load warm up again


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def data():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(STEPS, 8, 3, 16, 16, generator=g), torch.randint(0, 10, (STEPS, 8), generator=g),
            torch.randn(6, 3, 16, 16, generator=g), torch.randint(0, 10, (6,), generator=g))


def fresh(device):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return model, opt, sched


def validate(model, device, xv, yv):
    model.eval()
    with torch.no_grad():
        logits = model(xv.to(device))
        loss = nn.functional.cross_entropy(logits, yv.to(device)).item()
        correct = (logits.argmax(1) == yv.to(device)).sum().item()
    model.train()
    return loss, correct


def run(device, probe):
    x, y, xv, yv = data()
    model, opt, sched = fresh(device)
    losses, val_losses, corrects = [], [], []
    for step in range(STEPS):
        if step == WARMUP:
            probe.warm()
        if step == SAVE_AT and device != "cpu":
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
            buffer.seek(0)
            del model, opt, sched
            state = torch.load(buffer, map_location=device)
            model, opt, sched = fresh(device)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
        loss = nn.functional.cross_entropy(model(x[step].to(device)), y[step].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 2 == 1:
            v, c = validate(model, device, xv, yv)
            val_losses.append(v)
            corrects.append(c)
    tensors = {f"param.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    tensors.update({f"momentum.{i}": s["momentum_buffer"].cpu() for i, s in enumerate(opt.state.values())})
    return Outcome(losses + val_losses, tensors, {"correct": corrects, "lr": sched.get_last_lr()})
