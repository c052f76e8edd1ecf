"""The recorded graph's foreach ops one list element at a time (compiler/passes/foreach_parts.py):
the same bits as the foreach calls over whole lists, one parameter's temporaries alive at a time."""
import operator
import weakref

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.compiler.passes.foreach_parts import foreach_in_turn

SHAPES = [(64, 33), (33,), (5, 7, 3), (128,)]
N = len(SHAPES)


def _inputs(lists: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=generator) + 0.1 for _ in range(lists) for shape in SHAPES]


def adamw(*flat):
    """torch.optim.AdamW's foreach step (capturable=False), as the engine records it."""
    ps, gs, ms, vs, bias2 = [list(flat[k * N:(k + 1) * N]) for k in range(5)]
    step_sizes = flat[5 * N]
    torch._foreach_mul_(ps, 0.99)
    torch._foreach_lerp_(ms, gs, 0.1)
    torch._foreach_mul_(vs, 0.999)
    torch._foreach_addcmul_(vs, gs, gs, 0.001)
    denominators = torch._foreach_sqrt(vs)
    torch._foreach_div_(denominators, bias2)
    torch._foreach_add_(denominators, 1e-8)
    torch._foreach_addcdiv_(ps, ms, denominators, step_sizes)
    return ()


def _run_both(fn, inputs):
    gm = make_fx(fn)(*[t.clone() for t in inputs])
    split = foreach_in_turn(gm)
    whole, parts = [t.clone() for t in inputs], [t.clone() for t in inputs]
    got_whole, got_parts = gm(*whole), split(*parts)
    return gm, split, whole + list(got_whole), parts + list(got_parts)


def _foreach_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("aten._foreach_")]


def test_an_adamw_step_split_per_parameter_computes_the_same_bits():
    inputs = _inputs(5) + [torch.tensor([-1e-3 * (k + 1) for k in range(N)], dtype=torch.float64)]
    gm, split, whole, parts = _run_both(adamw, inputs)
    assert len(_foreach_calls(gm)) == 8 and len(_foreach_calls(split)) == 8 * N
    assert all(len(a) == 1 for n in _foreach_calls(split) for a in n.args if isinstance(a, list))
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


def test_the_split_step_runs_parameter_after_parameter():
    """Each parameter's eight calls are contiguous, in the step's order: its temporary (the
    square root of its second moment) is freed before the next parameter's is made."""
    inputs = _inputs(5) + [torch.full((N,), -1e-3, dtype=torch.float64)]
    split = foreach_in_turn(make_fx(adamw)(*[t.clone() for t in inputs]))
    owners = []
    for node in _foreach_calls(split):
        (tensor,) = next(a for a in node.args if isinstance(a, list))
        owners.append(tensor.name if tensor.op == "placeholder" else None)
    parameters = [name for name in owners if name is not None]
    assert parameters == sorted(parameters, key=lambda name: int(name[3:-2]) % N)

    alive, most = weakref.WeakSet(), [0]
    real_sqrt = torch.ops.aten._foreach_sqrt.default

    class Count(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node.target is real_sqrt:
                alive.update(result)
            most[0] = max(most[0], len(alive))
            return result

    Count(split).run(*[t.clone() for t in inputs])
    assert most[0] == 1


def test_a_step_that_needs_every_element_first_waits_for_them():
    """Gradient clipping's norms are all computed before any gradient is scaled (the total norm
    reads every one), then the update goes parameter by parameter."""
    def clip_and_step(*flat):
        ps, gs = list(flat[:N]), list(flat[N:])
        norms = torch._foreach_norm(gs, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coefficient = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        torch._foreach_mul_(gs, coefficient)
        torch._foreach_add_(ps, gs, alpha=-0.1)
        return (total,)

    gm, split, whole, parts = _run_both(clip_and_step, _inputs(2, seed=3))
    assert len(_foreach_calls(split)) == 3 * N
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


def test_writes_in_place_keep_their_order_with_every_reader():
    """A tensor read, then written, then read again: each reader sees the value it saw before
    the split, across out-of-place results and in-place ops' own results."""
    def fn(*flat):
        xs, ys = list(flat[:N]), list(flat[N:])
        before = torch._foreach_mul(xs, 2.0)
        torch._foreach_add_(xs, ys)
        after = torch._foreach_mul(xs, 3.0)
        torch._foreach_mul_(ys, 0.5)
        x0 = xs[0].add_(1.0)
        return tuple(before) + tuple(after) + (x0 * 2,)

    gm, split, whole, parts = _run_both(fn, _inputs(2, seed=5))
    assert len(_foreach_calls(split)) == 4 * N
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


def test_a_graph_with_views_or_without_foreach_ops_is_left_as_it_is():
    def with_view(*flat):
        xs = list(flat)
        torch._foreach_add_(xs, 1.0)
        return (xs[0].view(-1),)

    def plain(x):
        return (x * 2,)

    inputs = _inputs(1)
    for fn, args in ((with_view, inputs), (plain, inputs[:1])):
        gm = make_fx(fn)(*[t.clone() for t in args])
        assert foreach_in_turn(gm) is gm


def test_one_element_read_under_two_names_leaves_the_graph_as_it_is():
    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(2)]
    roots = graph.call_function(torch.ops.aten._foreach_sqrt.default, (xs,))
    first = graph.call_function(operator.getitem, (roots, 0))
    again = graph.call_function(operator.getitem, (roots, 0))
    graph.call_function(torch.ops.aten._foreach_add_.Scalar, ([first], 1.0))
    graph.output((again,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert foreach_in_turn(gm) is gm
