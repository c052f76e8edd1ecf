"""4. LSTM and GRU sequence classifiers (batch_first, 2 layers), clip_grad_norm_, a sequence length
that changes from step to step."""
import torch
from torch import nn

from sweep.harness import Outcome

LENGTHS = [5, 7, 5, 9, 6, 7, 5, 8, 9, 6]
WARMUP = 6


class Classifier(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(input_size=8, hidden_size=16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def train(cell, device, probe, seed):
    torch.manual_seed(seed)
    model = Classifier(cell).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed + 10)
    losses, norms = [], []
    for step, length in enumerate(LENGTHS):
        if step == WARMUP and cell is nn.GRU:
            probe.warm()
        x = torch.randn(4, length, 8, generator=g)
        y = torch.randint(0, 3, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).item())
        opt.step()
        losses.append(loss.item())
    return losses + norms, {f"{cell.__name__}.{k}": v.detach().cpu() for k, v in model.state_dict().items()}


def run(device, probe):
    lstm_losses, lstm_state = train(nn.LSTM, device, probe, 0)
    gru_losses, gru_state = train(nn.GRU, device, probe, 1)
    return Outcome(lstm_losses + gru_losses, {**lstm_state, **gru_state})
