"""Models that route or look up rather than multiply everything: a DLRM-style recommender
(EmbeddingBag tables, a fixed bag layout, pairwise feature interactions) and a top-2
mixture-of-experts layer (every expert computed densely, the chosen two gathered), trained on
`neuron` in every mode against the CPU."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .helpers import (BITWISE, FLOAT32_TOLERANCE, MODES, assert_compiled_if_lazy, assert_same_training,
                      train_on_cpu_and_neuron)

STEPS = 5  # adaptive mode compiles after 3 identical steps
DIM = 8


class DLRM(nn.Module):
    def __init__(self, dense_features=4, table_sizes=(20, 30, 10)):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense_features, 16), nn.ReLU(), nn.Linear(16, DIM), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum") for n in table_sizes)
        features = 1 + len(table_sizes)
        self.pairs = torch.triu_indices(features, features, offset=1)
        self.top = nn.Sequential(nn.Linear(DIM + self.pairs.shape[1], 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        embedded = [table(indices, offsets) for table, (indices, offsets) in zip(self.tables, sparse)]
        features = torch.stack([x, *embedded], dim=1)  # [batch, features, DIM]
        interactions = torch.bmm(features, features.transpose(1, 2))
        pairs = interactions[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def _dlrm_batch(batch=6, table_sizes=(20, 30, 10)):
    """Each table's bags: a fixed number of indices per sample (2, 3, 1), so the layout is fixed."""
    generator = torch.Generator().manual_seed(11)
    dense = torch.randn(batch, 4, generator=generator)
    sparse = []
    for n, per_bag in zip(table_sizes, (2, 3, 1)):
        indices = torch.randint(0, n, (batch * per_bag,), generator=generator)
        sparse.append((indices, torch.arange(0, batch * per_bag, per_bag)))
    clicks = torch.randint(0, 2, (batch,), generator=generator).float()
    return dense, sparse, clicks


def _dlrm_loss():
    dense, sparse, clicks = _dlrm_batch()

    def loss(model):
        device = next(model.parameters()).device
        on_device = [(i.to(device), o.to(device)) for i, o in sparse]
        return F.binary_cross_entropy_with_logits(model(dense.to(device), on_device), clicks.to(device))
    return loss


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_dlrm_with_embedding_bags_trains_like_cpu(mode):
    torch.manual_seed(0)
    run, reference = train_on_cpu_and_neuron(DLRM(), _dlrm_loss(), _sgd, mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)


class Top2MoE(nn.Module):
    """Softmax router, top-2 experts per token with renormalised weights, a load-balancing loss."""
    def __init__(self, experts=4, hidden=16):
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, hidden), nn.GELU(), nn.Linear(hidden, DIM))
                                     for _ in range(experts))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)  # [tokens, experts]
        weights, chosen = probs.topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        every = torch.stack([expert(x) for expert in self.experts], dim=1)  # [tokens, experts, DIM]
        picked = every.gather(1, chosen[:, :, None].expand(-1, -1, DIM))  # [tokens, 2, DIM]
        y = x + (weights[:, :, None] * picked).sum(dim=1)
        load = F.one_hot(chosen, probs.shape[-1]).float().sum(dim=1).mean(dim=0)
        balance = probs.shape[-1] * (load * probs.mean(dim=0)).sum()
        return self.head(y), balance


def _moe_loss():
    generator = torch.Generator().manual_seed(12)
    x, y = torch.randn(16, DIM, generator=generator), torch.randint(0, 3, (16,), generator=generator)

    def loss(model):
        device = next(model.parameters()).device
        logits, balance = model(x.to(device))
        return F.cross_entropy(logits, y.to(device)) + 0.01 * balance
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_top2_moe_trains_like_cpu(mode):
    torch.manual_seed(0)
    run, reference = train_on_cpu_and_neuron(Top2MoE(), _moe_loss(), lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-5),
                                             mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)
