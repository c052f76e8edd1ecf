"""Attention written with F.scaled_dot_product_attention in each of its forms (causal, boolean and
additive masks, dropout in training, grouped-query heads, an explicit scale), and a block stack
under activation checkpointing (torch.utils.checkpoint, reentrant or not), trained on `neuron` in
every mode against the CPU."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .helpers import (BITWISE, FLOAT32_TOLERANCE, MODES, assert_compiled_if_lazy, assert_same_training,
                      train_on_cpu_and_neuron)

STEPS = 5  # adaptive mode compiles after 3 identical steps
BATCH, LENGTH, WIDTH, HEADS, KV_HEADS = 2, 6, 16, 4, 2


def _masks():
    keep = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    keep[:, 0] = True  # every row keeps a key
    additive = torch.zeros(LENGTH, LENGTH).masked_fill(~keep, float("-inf")) + torch.linspace(-1, 1, LENGTH)
    return keep, additive


BOOL_MASK, FLOAT_MASK = _masks()
VARIANTS = {
    "causal": dict(is_causal=True),
    "bool_mask": dict(attn_mask=BOOL_MASK),
    "float_mask": dict(attn_mask=FLOAT_MASK),
    "dropout": dict(dropout_p=0.25),
    "gqa": dict(enable_gqa=True),
    "scale": dict(scale=0.3, is_causal=True),
}


class Attention(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.kwargs = VARIANTS[variant]
        self.kv_heads = KV_HEADS if variant == "gqa" else HEADS
        head_dim = WIDTH // HEADS
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * self.kv_heads * head_dim)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q = self.q(x).unflatten(-1, (HEADS, -1)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2 * self.kv_heads, -1)).transpose(1, 2).chunk(2, dim=1)
        kwargs = dict(self.kwargs)
        if "attn_mask" in kwargs:
            kwargs["attn_mask"] = kwargs["attn_mask"].to(x.device)
        if not self.training:
            kwargs.pop("dropout_p", None)
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.out(y.transpose(1, 2).flatten(2))


def _data():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, LENGTH, WIDTH, generator=generator), torch.randn(BATCH, LENGTH, WIDTH,
                                                                               generator=generator)


def _step_loss(model_input=_data):
    x, y = model_input()

    def loss(model):
        device = next(model.parameters()).device
        return F.mse_loss(model(x.to(device)), y.to(device))
    return loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sdpa_variant_trains_like_cpu(variant, mode):
    """Eager mode runs CPU's SDPA kernel (flash or math, as CPU picks): bitwise. Dropout draws its
    mask from the seeded generator on both devices."""
    torch.manual_seed(0)
    run, reference = train_on_cpu_and_neuron(Attention(variant), _step_loss(), _adamw, mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class CheckpointedStack(nn.Module):
    """Each block's activations are recomputed in the backward (with its dropout mask: the RNG state
    is saved and restored)."""
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _checkpoint_input():
    x, y = _data()
    return x.requires_grad_(), y  # reentrant checkpointing needs an input that requires grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_trains_like_cpu(use_reentrant, mode):
    torch.manual_seed(0)
    model = CheckpointedStack(use_reentrant)
    run, reference = train_on_cpu_and_neuron(model, _step_loss(_checkpoint_input), _adamw, mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)
