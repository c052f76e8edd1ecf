"""A ResNet-like CNN written by hand (the PyPI torchvision wheel does not load here): trained with
SGD momentum and a learning-rate schedule, then validated in eval mode, on `neuron` in every mode;
and trained channels-last under bf16 autocast."""
import copy

import pytest
import torch
from torch import nn

import tilewise

from .helpers import MODES, assert_compiled_if_lazy, assert_same_training, train_on_cpu_and_neuron

STEPS = 5
BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1e-5)  # torch.testing's default for bfloat16


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    def __init__(self, channels=8, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.MaxPool2d(2))
        self.block = Block(channels)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def _data(memory_format):
    generator = torch.Generator().manual_seed(2)
    images = torch.randn(4, 3, 8, 8, generator=generator).contiguous(memory_format=memory_format)
    labels = torch.randint(0, 4, (4,), generator=generator)
    return images, labels


def _build(memory_format):
    torch.manual_seed(0)
    return TinyResNet().to(memory_format=memory_format)


def _step_loss(memory_format):
    images, labels = _data(memory_format)

    def loss(model):
        device = next(model.parameters()).device
        return nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
    return loss


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _schedule(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _validate(model, memory_format):
    images, _ = _data(memory_format)
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        return model(images.to(device)).cpu()


FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", sorted(FORMATS))
def test_training_with_momentum_and_schedule_matches_cpu(layout, mode):
    memory_format = FORMATS[layout]
    run, reference = train_on_cpu_and_neuron(_build(memory_format), _step_loss(memory_format), _sgd, mode,
                                             STEPS, scheduler=_schedule)
    assert_same_training(run, reference)
    assert_compiled_if_lazy(mode)
    buffers = dict(run.model.named_buffers())
    for name, value in reference.model.named_buffers():  # BatchNorm's running statistics
        torch.testing.assert_close(buffers[name].cpu(), value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", sorted(FORMATS))
def test_eval_mode_validation_matches_cpu(layout, mode):
    memory_format = FORMATS[layout]
    run, reference = train_on_cpu_and_neuron(_build(memory_format), _step_loss(memory_format), _sgd, "eager",
                                             2, scheduler=_schedule)
    expected = _validate(reference.model, memory_format)
    with tilewise.engine(mode=mode):
        logits = _validate(run.model, memory_format)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_eval_mode_forward_with_autograd_on_matches_cpu(mode):
    """model.eval() without no_grad (a frozen-statistics fine-tune): autograd keeps batch norm's outputs."""
    model = _build(torch.contiguous_format).eval()
    images, _ = _data(torch.contiguous_format)
    neuron_model = copy.deepcopy(model).to("neuron")
    expected = model(images)
    with tilewise.engine(mode=mode):
        logits = neuron_model(images.to("neuron")).cpu()
    torch.testing.assert_close(logits, expected.detach(), rtol=1e-4, atol=1e-5)


def _amp_step_loss():
    images, labels = _data(torch.channels_last)

    def loss(model):
        device = next(model.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(images.to(device))
        return nn.functional.cross_entropy(logits.float(), labels.to(device))
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_channels_last_training_under_bf16_autocast_matches_cpu_autocast(mode):
    """The channels-last model's forward under torch.autocast(bfloat16) on both devices: for its ops
    (convolutions and the linear in bf16, batch norm, pooling and ReLU in their input's dtype) the
    CPU's cast policy is CUDA's, which neuron follows. Eager mode runs CPU's kernels: bitwise."""
    run, reference = train_on_cpu_and_neuron(_build(torch.channels_last), _amp_step_loss(), _sgd, mode, STEPS,
                                             scheduler=_schedule)
    assert_same_training(run, reference, **(dict(rtol=0, atol=0) if mode == "eager" else BF16_TOLERANCE))
    assert run.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert_compiled_if_lazy(mode)
