"""Checkpoints of a model and its optimizer trained on `neuron`: torch.save / torch.load round trips,
with map_location "neuron", "cpu" and a dict, and training resumed from a checkpoint."""
import copy
import io

import pytest
import torch
from torch import nn

import tilewise

from .helpers import MODES, assert_same_training, train

NEURON = torch.device("neuron", 0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _step_loss():
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)

    def loss(model):
        device = next(model.parameters()).device
        return nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    return loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _save(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _trained_checkpoint(model):
    """The model trained two steps where it is, and its checkpoint: model, optimizer, step."""
    optimizer = _adamw(model.parameters())
    for _ in range(2):
        _step_loss()(model).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2}


def _tensors(checkpoint):
    return list(checkpoint["model"].values()) + [t for state in checkpoint["optimizer"]["state"].values()
                                                 for t in state.values()]


@pytest.mark.parametrize("mode", MODES)
def test_resumed_training_matches_cpu(mode):
    """Save, load (default map_location: where it was saved), resume: the same as on the CPU."""
    def resume(device):
        _, checkpoint = _trained_checkpoint(_model().to(device))
        loaded = torch.load(_save(checkpoint))
        model = _model().to(device)
        model.load_state_dict(loaded["model"])
        optimizers = []

        def make_optimizer(params):
            optimizers.append(_adamw(params))
            optimizers[0].load_state_dict(loaded["optimizer"])
            return optimizers[0]
        return train(model, _step_loss(), make_optimizer, steps=3)

    reference = resume("cpu")
    with tilewise.engine(mode=mode):
        run = resume("neuron")
    assert_same_training(run, reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("location", ["cpu", {"neuron:0": "cpu"}], ids=["cpu", "dict"])
def test_neuron_checkpoint_loads_onto_cpu(location, mode):
    neuron_model = _model().to("neuron")
    with tilewise.engine(mode=mode):
        model, checkpoint = _trained_checkpoint(neuron_model)
        loaded = torch.load(_save(checkpoint), map_location=location)
    assert {t.device for t in _tensors(loaded)} == {torch.device("cpu")}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded["model"][name], value.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_checkpoint_loads_onto_neuron(mode):
    model, checkpoint = _trained_checkpoint(_model())
    with tilewise.engine(mode=mode):
        loaded = torch.load(_save(checkpoint), map_location="neuron")
        assert {t.device for t in _tensors(loaded)} == {NEURON}
        values = {name: value.cpu() for name, value in loaded["model"].items()}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(values[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_module_to_inside_the_engine_block(mode):
    """Moving and converting a module inside a lazy block (parameters swapped in place)."""
    reference = _model()
    with tilewise.engine(mode=mode):
        model = copy.deepcopy(reference).to("neuron")
        _step_loss()(model).backward()
        model.to(torch.bfloat16)
        assert all(p.device == NEURON and p.dtype == torch.bfloat16 for p in model.parameters())
        values = {name: p.detach().cpu() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(values[name], p.detach().to(torch.bfloat16), rtol=0, atol=0)
