"""DTensor's random ops on a neuron mesh draw as on a CPU mesh.

The device draws every random number from CPU's default generator (torch.neuron.manual_seed seeds
it), so that a program gives CPU's values under one seed. DTensor's RNG tracker is for devices
with a counter-based (Philox) generator: it takes any mesh whose device module has
`set_rng_state` for one, and asserts the 16-byte state such generators have; CPU's is 5,056 bytes,
so `torch.nn.init.normal_` of a sharded parameter on a neuron mesh raised AssertionError
(torch/distributed/tensor/_random.py). A neuron mesh is answered as a CPU mesh is: no tracker,
each rank draws its shard from its default generator, which is what the same program on a CPU
mesh computes."""
from __future__ import annotations

import functools

from .. import patches


def _cpu_like(is_rng_supported_mesh):
    @functools.wraps(is_rng_supported_mesh)
    def is_rng_supported(device_mesh) -> bool:
        return device_mesh.device_type != "neuron" and is_rng_supported_mesh(device_mesh)

    return is_rng_supported


def install() -> None:
    """Idempotent; both names DTensor reads it under (the manifest's `also`)."""
    patches.replace("torch.distributed.tensor._random:is_rng_supported_mesh", _cpu_like)
