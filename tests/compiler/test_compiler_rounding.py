"""Compiled regions round 16-bit values exactly as CPU's kernels do, in-place ops included."""
import pytest
import torch

import tilewise


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scalars", ["one", "list", "changing"])
def test_in_place_foreach_mul_by_a_number_rounds_the_number_as_cpu(mode, dtype, scalars):
    """CPU's in-place `_foreach_mul_` multiplies a 16-bit list by the number rounded to the dtype;
    the functional form it became in a compiled region multiplied by it in float32, one ulp off
    in a third of the elements (SGD momentum drifted from step 2); so did the float64 0-dim
    tensors the lazy modes give a list of numbers or a changing number as."""
    generator = torch.Generator().manual_seed(0)
    host = [torch.randn(64, 33, generator=generator).to(dtype), torch.randn(7, generator=generator).to(dtype)]
    tilewise.reset_caches()
    stats = tilewise.stats()
    stats.reset()
    with tilewise.engine(mode=mode, threshold=1):
        for step in range(4):
            factor = {"one": 0.9123, "list": [0.9123, 0.37], "changing": 0.9123 + step / 7}[scalars]
            expected = [t.clone() for t in host]
            torch._foreach_mul_(expected, factor)
            on_device = [t.to("neuron") * 1 for t in host]
            torch._foreach_mul_(on_device, factor)
            for got, want in zip(on_device, expected):
                assert torch.equal(got.cpu(), want), f"step {step}"
    assert stats.ops_compiled > 0


def test_in_place_foreach_mul_of_float32_and_integers_is_unchanged():
    host = [torch.randn(5, 3), torch.arange(6)]
    expected = [t.clone() for t in host]
    torch._foreach_mul_(expected, 3)
    tilewise.reset_caches()
    stats = tilewise.stats()
    stats.reset()
    with tilewise.engine(mode="compiled"):
        on_device = [t.to("neuron") * 1 for t in host]
        torch._foreach_mul_(on_device, 3)
        got = [t.cpu() for t in on_device]
    assert stats.ops_compiled > 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e) and g.dtype == e.dtype
