"""PyTorch's OpInfo samples on neuron against CPU: a deterministic subset (the full sweep is
scripts/opinfo_sweep.py). Each sample is its own test; excluded ops skip with their reason
(tests/opinfo_exclusions.py), samples that fail on CPU too skip as not run.

Subset: every op's first 2 float32 samples forward; the first 2 samples of evenly spread ops for
gradients (120 ops), bfloat16 (60 ops) and int64 (60 ops).
"""
from __future__ import annotations

import collections

import pytest

import conformance as c

SAMPLES_PER_OP = 2
OPS_PER_MODE = {"float32": None, "grad": 120, "bfloat16": 60, "int64": 60}
MIN_FLOAT32_PASS_RATE = 0.98


def _spread(keys: list, count: int | None) -> list:
    if count is None or len(keys) <= count:
        return keys
    return [keys[i * len(keys) // count] for i in range(count)]


_samples: dict = {}
_outcomes: dict = collections.defaultdict(collections.Counter)


def _cases():
    cases = []
    for mode, count in OPS_PER_MODE.items():
        keys = [key for key in sorted(c.OPS) if c.applies(c.OPS[key], mode)]
        for key in _spread(keys, count):
            _samples[key, mode] = c.samples(c.OPS[key], mode, SAMPLES_PER_OP)
            cases += [pytest.param(key, mode, i, id=f"{mode}-{key}-{i}")
                      for i in range(len(_samples[key, mode]))]
    return cases


@pytest.mark.parametrize("key,mode,index", _cases())
def test_sample(key, mode, index):
    outcome = c.run_sample(c.OPS[key], _samples[key, mode][index], mode)
    _outcomes[mode][outcome.status] += 1
    if outcome.status == c.EXCLUDED_:
        pytest.skip(f"excluded: {outcome.message}")
    if outcome.status == c.NOT_RUN:
        pytest.skip(f"not run: {outcome.message}")
    if outcome.status == c.FAIL:
        pytest.fail(f"{key} [{mode}] sample {index}: {outcome.message}", pytrace=False)


def test_float32_pass_rate():
    """Excluded samples count against the rate: exclusions may not hide more than 2%."""
    counts = _outcomes["float32"]
    ran = counts[c.PASS] + counts[c.FAIL] + counts[c.EXCLUDED_]
    if ran == 0:
        pytest.skip("no float32 samples ran in this session (deselected)")
    rate = counts[c.PASS] / ran
    print(f"\nfloat32 samples: {ran} run on CPU, {counts[c.PASS]} passed, {counts[c.FAIL]} failed, "
          f"{counts[c.EXCLUDED_]} excluded, {counts[c.NOT_RUN]} not run; pass rate {rate:.2%}")
    assert rate >= MIN_FLOAT32_PASS_RATE, f"float32 pass rate {rate:.2%} < {MIN_FLOAT32_PASS_RATE:.0%}"
