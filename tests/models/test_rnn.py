"""Recurrent models (nn.RNN, nn.LSTM, nn.GRU) trained on `neuron` in every mode against CPU."""
import pytest
import torch
from torch import nn

from .helpers import (BITWISE, FLOAT32_TOLERANCE, MODES, assert_compiled_if_lazy, assert_same_training,
                      train_on_cpu_and_neuron)

STEPS = 5
CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}



class SequenceClassifier(nn.Module):
    def __init__(self, cell, features=6, hidden=12, classes=3):
        super().__init__()
        self.rnn = cell(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _step_loss():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 6, generator=generator)
    y = torch.randint(0, 3, (4,), generator=generator)

    def loss(model):
        device = next(model.parameters()).device
        return nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    return loss


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_training_matches_cpu(cell, mode):
    """Eager mode: CPU's values bitwise (the RNNs take CPU's branch: tilewise/eager/cpu_rnn.py); by
    default a lazy mode may run a region's C, within float32's tolerance."""
    torch.manual_seed(0)
    model = SequenceClassifier(CELLS[cell])
    run, reference = train_on_cpu_and_neuron(model, _step_loss(), _adam, mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)
