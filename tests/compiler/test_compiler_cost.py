"""The cost model of compiled regions: launches and HBM passes, from meta (shape-only) inputs."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.compiler import compile_graph
from tilewise.device.spec import TRN2


def gelu_normalise(x):
    # GELU written out as ~8 ops, then mean/var normalisation over the last dim
    y = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
    mean = y.mean(-1, keepdim=True)
    var = ((y - mean) * (y - mean)).mean(-1, keepdim=True)
    return (y - mean) / torch.sqrt(var + 1e-5)


def test_memory_bound_chain_moves_at_most_three_tensor_passes():
    x = torch.empty(4096, 1024, device="meta")
    gm = make_fx(gelu_normalise)(x)
    eager_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    compiled = compile_graph(gm, [x], spec=TRN2)
    tensor_bytes = 4096 * 1024 * 4
    passes = sum(entry[3] for entry in compiled.cost) / tensor_bytes
    assert len(compiled.cost) == len(compiled.kernels) == 1
    assert passes <= 3, compiled.cost
    assert eager_ops >= 15  # eager: about two tensor passes per op
    compiled.check_tile_limits()
    name, engine, seconds, hbm_bytes, flops = compiled.cost[0]
    dma_only = hbm_bytes / TRN2.hbm_bandwidth
    assert seconds >= dma_only + TRN2.launch_overhead_s  # one launch, DMA bound at best


def test_matmul_cost_counts_flops_and_respects_tensor_engine_limits():
    a, w = torch.empty(1000, 700, device="meta"), torch.empty(700, 1500, device="meta")
    compiled = compile_graph(make_fx(lambda a, w: torch.relu(a @ w))(a, w), [a, w], spec=TRN2)
    assert [k.kind for k in compiled.kernels] == ["matmul"]
    assert compiled.cost[0][4] == 2 * 1000 * 700 * 1500
    assert compiled.cost[0][1] == "TensorEngine"
    compiled.check_tile_limits()
    text = str(compiled.kernels[0])
    assert "range(0, 700, 128)" in text and "range(0, 1500, 512)" in text
