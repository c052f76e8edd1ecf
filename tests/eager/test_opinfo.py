"""PyTorch's OpInfo samples on neuron against CPU, bitwise in eager mode (conformance.tolerance_of):
a deterministic subset (the full sweep, every op, sample, kind and engine mode, is
scripts/opinfo_sweep.py). Each sample is its own test; excluded ops skip with their reason
(tilewise/testing/opinfo_exclusions.py), samples that fail on CPU too skip as not run. In the lazy engine
modes each sample starts from empty caches and compiles at first sight.

Subset, per (engine mode, kind): the first samples of every op, or of evenly spread ops (SUBSET).
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import pytest

import torch

from tilewise.testing import conformance as c
import tilewise


class Subset(NamedTuple):
    ops: int | None      # evenly spread ops; None: every op the kind applies to
    samples: int         # first samples of each


SUBSET = {
    ("eager", "float32"): Subset(None, 2),
    ("eager", "grad"): Subset(120, 2),
    ("eager", "bfloat16"): Subset(60, 2),
    ("eager", "float16"): Subset(60, 2),
    ("eager", "int64"): Subset(60, 2),
    ("compiled", "float32"): Subset(200, 1),
    ("compiled", "grad"): Subset(40, 1),
    ("compiled", "bfloat16"): Subset(40, 1),
    ("compiled", "float16"): Subset(40, 1),
    ("adaptive", "float32"): Subset(80, 1),
}
# The target is 99.5%; the known failures of tilewise/testing/opinfo_exclusions.py (engine bugs reported to
# their layers) count as failures and hold the subset at 97.9% (eager) and 99.0% (compiled) today.
MIN_FLOAT32_PASS_RATE = 0.975


def _spread(keys: list, count: int | None) -> list:
    if count is None or len(keys) <= count:
        return keys
    return [keys[i * len(keys) // count] for i in range(count)]


_samples: dict = {}
_outcomes: dict = collections.defaultdict(collections.Counter)
_compiled: dict = collections.defaultdict(collections.Counter)  # passed samples: ran a compiled region?


def _cases():
    cases = []
    for (engine, kind), subset in SUBSET.items():
        keys = [key for key in sorted(c.OPS) if c.applies(c.OPS[key], kind)]
        for key in _spread(keys, subset.ops):
            if (key, kind) not in _samples or len(_samples[key, kind]) < subset.samples:
                _samples[key, kind] = c.samples(c.OPS[key], kind, subset.samples)
            cases += [pytest.param(key, engine, kind, i, id=f"{engine}-{kind}-{key}-{i}")
                      for i in range(min(subset.samples, len(_samples[key, kind])))]
    return cases


@pytest.mark.parametrize("key,engine,kind,index", _cases())
def test_sample(key, engine, kind, index):
    outcome = c.run_sample(c.OPS[key], _samples[key, kind][index], kind, engine)
    _outcomes[engine, kind][outcome.status] += 1
    if outcome.status == c.PASS:
        _compiled[engine, kind][outcome.ops_compiled > 0] += 1
    if outcome.status == c.EXCLUDED_:
        pytest.skip(f"excluded: {outcome.message}")
    if outcome.status == c.NOT_RUN:
        pytest.skip(f"not run: {outcome.message}")
    known = c.known_failure(key, kind, engine)
    if outcome.status == c.FAIL and known:
        pytest.xfail(f"known failure: {known}")
    if outcome.status == c.FAIL:
        pytest.fail(f"{key} [{engine} {kind}] sample {index}: {outcome.message}", pytrace=False)


@pytest.mark.parametrize("engine", ["eager", "compiled", "adaptive"])
def test_float32_pass_rate(engine):
    """Excluded samples and known failures count against the rate."""
    counts = _outcomes[engine, "float32"]
    ran = counts[c.PASS] + counts[c.FAIL] + counts[c.EXCLUDED_]
    if ran == 0:
        pytest.skip("no float32 samples ran in this session (deselected)")
    rate = counts[c.PASS] / ran
    print(f"\n{engine} float32 samples: {ran} run on CPU, {counts[c.PASS]} passed, {counts[c.FAIL]} failed, "
          f"{counts[c.EXCLUDED_]} excluded, {counts[c.NOT_RUN]} not run; pass rate {rate:.2%}")
    assert rate >= MIN_FLOAT32_PASS_RATE, f"float32 pass rate {rate:.2%} < {MIN_FLOAT32_PASS_RATE:.1%}"


def test_lazy_modes_really_compile_the_samples():
    """The compiled-mode samples are no eager run in disguise: most of them ran a compiled region."""
    compiled = _compiled["compiled", "float32"]
    if not compiled:
        pytest.skip("no compiled float32 samples ran in this session (deselected)")
    assert compiled[True] > 0.8 * sum(compiled.values()), compiled


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_a_zero_gradient_on_neuron_is_real_zeros(mode):
    """sgn's gradient is autograd's ZeroTensor (no memory); wrapped as a device buffer, the first
    op that read it crashed the process. The device makes real zeros instead (eager/executor.py)."""
    host = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    with tilewise.engine(mode=mode, threshold=1):
        x = host.to("neuron").requires_grad_()
        grad, = torch.autograd.grad(torch.sgn(x * 2), x, torch.ones(4, 5, device="neuron"))
        total = (grad.abs() * 3).sum().cpu()
        values = grad.cpu()
    assert torch.equal(values, torch.zeros(4, 5)) and total.item() == 0.0
