"""A compiled region's recorded graph calls PyTorch's Python bindings where each one dispatches the
recorded overload (compiler/bindings.py), and computes what the OpOverloads compute."""
from __future__ import annotations

import contextlib
import copy
import types

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

import tilewise
from tilewise.compiler.native import bindings
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import driver

aten = torch.ops.aten


def recorded(fn, *inputs) -> torch.fx.GraphModule:
    """fn's aten ops as a graph of OpOverload calls, as a recorded region's are."""
    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    graph.output(fn(*placeholders, graph=graph))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def targets(gm: torch.fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def is_binding(target) -> bool:
    """A Python binding of PyTorch's (torch.add, Tensor.view), not operator.getitem."""
    return isinstance(target, (types.BuiltinFunctionType, types.MethodDescriptorType)) and \
        getattr(target, "__module__", None) != "_operator"


def program(x, y, graph):
    call = graph.call_function
    summed = call(aten.sum.dim_IntList, (x, [1], True))           # sum has three overloads
    added = call(aten.add.Tensor, (summed, y))
    shifted = call(aten.add.Scalar, (added, 2))                    # torch.add(t, 2) is add.Tensor
    viewed = call(aten.view.default, (shifted, [-1]))              # a method binding
    call(aten.mul_.Scalar, (y, 3.0))                               # Tensor.mul_(y, 3.0) is mul_.Tensor
    scaled = call(aten.mul.Tensor, (viewed, 0.5))
    return (scaled, call(aten.gelu.default, (x,)))                  # torch._C._nn.gelu


def test_each_node_calls_its_binding_only_where_that_dispatches_the_recorded_overload():
    x, y = torch.randn(6, 5), torch.randn(6, 1)
    gm = recorded(program, x, y)
    bound = bindings.bound(gm, [x, y])
    assert targets(bound) == [torch.sum, torch.add, aten.add.Scalar, torch._C.TensorBase.view, aten.mul_.Scalar,
                              torch.mul, torch._C._nn.gelu]
    ours, theirs = [x.clone(), y.clone()], [x.clone(), y.clone()]
    for got, expected in zip(bound(*ours), gm(*theirs)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(ours[1], theirs[1])  # mul_ wrote y alike


def test_a_programs_torch_function_mode_neither_sees_nor_redirects_the_bound_calls():
    """Bindings are torch functions: a program's TorchFunctionMode would see each call, and
    `with torch.device(...)` puts its device into factories called without one; the bound graph
    runs with torch function handling off."""
    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4)
    ones = {"dtype": torch.float32, "device": torch.device("cpu"), "pin_memory": False}
    gm = recorded(lambda x, graph: (graph.call_function(aten.add.Tensor, (
        graph.call_function(aten.full.default, ([3, 4], 1.0), ones), x)),), x)
    bound = bindings.bound(gm, [x])
    assert targets(bound) == [torch.full, torch.add]
    with torch.device("meta"), Counting():
        out = bound(x)[0]
    assert Counting.calls == 0 and out.device.type == "cpu" and torch.equal(out, 1 + x)


def test_a_binding_that_hands_on_other_arguments_keeps_the_op():
    """torch._C._nn.mse_loss(a, b) dispatches aten.mse_loss.default with reduction=0 (none), where
    the op called as recorded takes its default, the mean (a bfloat16 model's loss came out
    [32, 4] instead of a scalar)."""
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    gm = recorded(lambda a, b, graph: (graph.call_function(aten.mse_loss.default, (a, b)),), a, b)
    bound = bindings.bound(gm, [a, b])
    assert targets(bound) == [aten.mse_loss.default]
    assert torch.equal(bound(a, b)[0], torch.nn.functional.mse_loss(a, b))


def test_a_0_dim_argument_is_checked_as_0_dim():
    """A Scalar parameter takes a 0-dim tensor: the check runs on the inputs' own dims."""
    x, s = torch.randn(4), torch.tensor(3.0)
    gm = recorded(lambda x, s, graph: (graph.call_function(aten.mul.Tensor, (x, s)),), x, s)
    bound = bindings.bound(gm, [x, s])
    assert targets(bound) == [torch.mul]
    assert torch.equal(bound(x, s)[0], x * 3)


def test_graphs_traced_on_fake_tensors_keep_their_overloads():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3))
    gm = recorded(lambda x, graph: (graph.call_function(aten.neg.default, (x,)),), x)
    assert bindings.bound(gm, [x]) is gm


def test_a_compiled_regions_recorded_graph_is_bound_and_trains_as_cpu():
    """An adaptive MLP's regions run bound recorded graphs (host_backend=torch: no C), and its
    losses and parameters after eight SGD steps are CPU's, bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))

    def train(device, block):
        net = copy.deepcopy(model).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        with block:
            for _ in range(8):
                loss = torch.nn.functional.cross_entropy(net(x.to(device)), y.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses, [p.detach().cpu() for p in net.parameters()]

    expected = train("cpu", contextlib.nullcontext())
    cache.clear_memory()  # only this test's regions
    with tilewise.config.patch(host_backend="torch"):
        got = train("neuron", tilewise.engine(mode="adaptive"))
    regions = list(cache._memory.values())
    assert regions and tilewise.stats().compiled_fraction > 0.5
    # the optimizer's step is a region of its own (engine.py), of foreach ops, which have no binding
    stepping = [r for r in regions if all("_foreach_" in str(t) for t in targets(r.source))]
    assert len(stepping) == 1 and all(any(map(is_binding, targets(r.source))) for r in regions if r not in stepping)
    assert got[0] == expected[0]
    for g, e in zip(got[1], expected[1]):
        assert torch.equal(g, e)


def test_source_graph_without_example_inputs_is_unbound():
    x = torch.randn(3)
    gm = recorded(lambda x, graph: (graph.call_function(aten.neg.default, (x,)),), x)
    assert targets(driver.source_graph(gm)) == [aten.neg.default]
    assert targets(driver.source_graph(gm, [x])) == [torch.neg]
