"""DTensor programs in engine blocks, on a one-rank "neuron" mesh in this process: the same values
as plain PyTorch on the CPU, bitwise, in every mode, and compiled regions in the lazy ones. Two ranks
(tensor parallelism, FSDP2) are tests/distributed/test_distributed.py's."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tilewise

MODES = ["eager", "adaptive", "compiled"]


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("neuron", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _host(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _assert_compiled(mode: str) -> None:
    stats = tilewise.stats()
    if mode == "eager":
        assert stats.ops_compiled == 0
    else:
        assert stats.compiles >= 1 and stats.ops_compiled > 0 and not stats.fallbacks, stats.report()


@pytest.mark.parametrize("mode", MODES)
def test_a_foreach_op_on_a_dtensor_and_a_neuron_tensor(mesh, mode):
    """The dispatch mode let DTensor dispatch itself only when no neuron tensor took part: with
    one (the scalar of gradient clipping's `_foreach_mul_`), the engine ran the op on DTensor's
    wrapper and raised 'found at least two devices, neuron:0 and neuron:0'."""
    a = torch.randn(4, 4)
    g = distribute_tensor(a.to("neuron"), mesh, [Shard(0)])
    with tilewise.engine(mode=mode, threshold=2):
        for _ in range(3):
            torch._foreach_mul_([g], torch.tensor(0.5, device="neuron"))
            tilewise.sync()
    assert isinstance(g, DTensor) and torch.equal(_host(g), a * 0.125)
    _assert_compiled(mode)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_an_op_on_a_neuron_tensor_then_a_dtensor_is_dtensor_s(mesh, mode):
    """PyTorch offers an op to the subclasses in argument order: NeuronTensor's handler came first
    in `mul(neuron_scalar, dtensor)` and raised 'found at least two devices, neuron:0 and
    neuron:0', in a block or not. It leaves the op to DTensor, which computes it as on the CPU, or
    refuses a plain tensor beside a DTensor with its own message, as on the CPU."""
    a = torch.randn(4, 4)
    g = distribute_tensor(a.to("neuron"), mesh, [Replicate()])
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        product = torch.mul(torch.tensor(0.5, device="neuron"), g)
        with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
            torch.add(a.to("neuron"), g)
    assert isinstance(product, DTensor) and torch.equal(_host(product), torch.mul(torch.tensor(0.5), a))


def _parameters(device: str, mesh) -> list[torch.nn.Parameter]:
    """Three parameters with gradients; on neuron DTensors sharded on the one-rank mesh."""
    generator = torch.Generator().manual_seed(0)
    made = []
    for shape in ((8, 4), (8,), (3, 5)):
        weight, grad = torch.randn(shape, generator=generator), 3 * torch.randn(shape, generator=generator)
        if device == "neuron":
            weight, grad = (distribute_tensor(t.to("neuron"), mesh, [Shard(0)]) for t in (weight, grad))
        p = torch.nn.Parameter(weight)
        p.grad = grad
        made.append(p)
    return made


def _clip_and_step(params, optimizer_options: dict, steps: int = 4, sync=lambda: None) -> list[torch.Tensor]:
    """Steps of gradient clipping (foreach) then AdamW, the gradients shrunk in between."""
    optimizer = torch.optim.AdamW(params, lr=0.1, **optimizer_options)
    norms = []
    for _ in range(steps):
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))
        optimizer.step()
        torch._foreach_mul_([p.grad for p in params], 0.9)
        sync()
    return norms


@pytest.mark.parametrize("options", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "for-loop", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_clipping_and_adamw_over_dtensor_parameters(mesh, mode, options):
    """torchtitan's optimizer step: clip_grad_norm_ (clip_grad.py's `_foreach_mul_` by the clip
    coefficient) and AdamW (adam.py's `_foreach_*` on DTensors and neuron step counts)."""
    reference = _parameters("cpu", mesh)
    reference_norms = _clip_and_step(reference, options)
    params = _parameters("neuron", mesh)
    with tilewise.engine(mode=mode, threshold=2):
        norms = _clip_and_step(params, options, sync=tilewise.sync)
    for got, expected in zip(params + norms, reference + reference_norms, strict=True):
        assert torch.equal(_host(got), expected)
    _assert_compiled(mode)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_random_init_of_a_sharded_parameter_draws_what_a_cpu_mesh_draws(mesh, mode):
    """DTensor's RNG tracker took the neuron mesh for one with a counter-based generator and
    asserted its 16-byte state (the device's is CPU's, 5,056 bytes): AssertionError in
    torch/distributed/tensor/_random.py."""
    import warnings
    cpu_mesh = init_device_mesh("cpu", (1,))
    drawn = {}
    for device, on in (("cpu", cpu_mesh), ("neuron", mesh)):
        torch.manual_seed(5)
        weight = distribute_tensor(torch.zeros(4, 6, device=device), on, [Shard(0)])
        with warnings.catch_warnings(), tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
            warnings.simplefilter("ignore")  # DTensor's notice that CPU meshes have no RNG tracker
            torch.nn.init.normal_(weight)
            torch.nn.init.uniform_(weight, -1, 1)
        drawn[device] = _host(weight)
    assert torch.equal(drawn["neuron"], drawn["cpu"])
