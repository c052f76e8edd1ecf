"""A small diffusion UNet written by hand (convolutions, group norm, SiLU, a sinusoidal time
embedding, a strided downsample and a nearest upsample with a skip connection), trained with DDPM's
noise-prediction objective on `neuron` in every mode against the CPU. The timesteps and the noise
are drawn on the model's device, as a training script does."""
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .helpers import (BITWISE, FLOAT32_TOLERANCE, assert_compiled_if_lazy, assert_same_training, train_on_cpu_and_neuron,
                      xfail_modes)

STEPS = 5  # adaptive mode compiles after 3 identical steps
TIMESTEPS = 100


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    frequencies = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * frequencies[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, channels_in, channels_out, time_dim):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, channels_in)
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.time = nn.Linear(time_dim, channels_out)
        self.norm2 = nn.GroupNorm(4, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else nn.Identity()

    def forward(self, x, t_emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(t_emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class UNet(nn.Module):
    def __init__(self, channels=8, time_dim=16):
        super().__init__()
        self.time_dim = time_dim
        self.time_mlp = nn.Sequential(nn.Linear(time_dim, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.down = ResBlock(channels, channels, time_dim)
        self.downsample = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.mid = ResBlock(channels, 2 * channels, time_dim)
        self.upsample = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                      nn.Conv2d(2 * channels, channels, 3, padding=1))
        self.up = ResBlock(2 * channels, channels, time_dim)
        self.out = nn.Sequential(nn.GroupNorm(4, channels), nn.SiLU(), nn.Conv2d(channels, 3, 3, padding=1))

    def forward(self, x, t):
        t_emb = self.time_mlp(time_embedding(t, self.time_dim))
        skip = self.down(self.stem(x), t_emb)
        h = self.mid(self.downsample(skip), t_emb)
        h = self.up(torch.cat([self.upsample(h), skip], dim=1), t_emb)
        return self.out(h)


def _ddpm_loss():
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(13))
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, TIMESTEPS), dim=0)

    def loss(model):
        device = next(model.parameters()).device
        x0, schedule = images.to(device), alphas_cumprod.to(device)
        t = torch.randint(0, TIMESTEPS, (x0.shape[0],), device=device)
        noise = torch.randn_like(x0)
        a = schedule[t][:, None, None, None]
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        return F.mse_loss(model(noisy, t), noise)
    return loss


# compiled mode, ~15 s on 2 cores, is left to the slow run
@pytest.mark.parametrize("mode", xfail_modes({}, slow=("compiled",)))
def test_ddpm_unet_trains_like_cpu(mode):
    torch.manual_seed(0)
    run, reference = train_on_cpu_and_neuron(UNet(), _ddpm_loss(), lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-5),
                                             mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)
