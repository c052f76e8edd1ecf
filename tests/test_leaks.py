"""No leaks: device memory and resident memory stay flat over a training run in adaptive mode, and
the engine's caches of compiled regions and plans are bounded (config region_cache_size, least
recently used evicted). scripts/soak.py runs the same loop for 1,000 steps and prints the figures."""

import torch

import tilewise
from tilewise.adaptive import RUNTIME

from tilewise.testing import soak

# Resident memory may move by allocator noise only: the timeline takes its rings whole at their
# first record (tests/device/test_timeline.py), before step 50 (0.1 MiB from step 50 to 200 measured).
RESIDENT_TOLERANCE = 8 * 2**20


def test_training_steps_keep_memory_flat_after_warmup():
    points = {p["step"]: p for p in soak.soak(steps=200, every=50, report=lambda line: None)}
    warm, last = points[50], points[200]
    assert last["device"] == warm["device"], (warm, last)   # exactly: same tensors every step
    assert last["resident"] - warm["resident"] < RESIDENT_TOLERANCE, (warm, last)
    for key in ("regions", "plans", "fingerprints", "meta signatures"):
        assert last[key] == warm[key], (key, warm, last)
    assert tilewise.stats().compiled_fraction > 0.9, tilewise.stats().report()


def test_segment_buffers_are_freed_when_the_program_drops_them():
    x = torch.randn(256, 256).to("neuron")
    base = torch.neuron.memory_allocated()
    with tilewise.engine(mode="adaptive", threshold=2):
        for _ in range(10):
            y = ((x * 2).relu() @ x).sum()
            y.item()
            del y
    assert torch.neuron.memory_allocated() == base


def test_region_cache_is_bounded_and_evicts_least_recently_used():
    shapes = [(n, 8) for n in (3, 5, 7, 9, 11)]
    inputs = {s: torch.randn(*s) for s in shapes}
    with tilewise.config.patch(region_cache_size=2, generalise_limit=0):  # one static region per shape
        with tilewise.engine(mode="compiled"):
            for s in shapes:
                x = inputs[s].to("neuron")
                torch.testing.assert_close((x.tanh() * 3).sum(0).cpu(), (inputs[s].tanh() * 3).sum(0))
                assert len(RUNTIME.memory.regions) <= 2 and len(RUNTIME.memory.plans) <= 2
            compiles = tilewise.stats().compiles
            # The last two shapes are cached: no compile. The first was evicted: compiled again.
            for s in shapes[-2:] + shapes[:1]:
                x = inputs[s].to("neuron")
                torch.testing.assert_close((x.tanh() * 3).sum(0).cpu(), (inputs[s].tanh() * 3).sum(0))
    assert compiles == len(shapes)
    assert tilewise.stats().compiles == compiles + 1, tilewise.stats().report()
    assert len(RUNTIME.memory.regions) <= 2
