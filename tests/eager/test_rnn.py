"""Recurrent layers on neuron: LSTM, GRU, RNN and their cells, in every mode, against CPU.

ATen's RNNs branch on the device: CPU projects a sequence's input at once (and runs oneDNN's LSTM
layer), an accelerator steps fused cells that have no CPU kernel (`_thnn_fused_lstm_cell`,
`_thnn_fused_gru_cell` and their backward ops). On neuron the layers and cells take CPU's branch
(tilewise/eager/cpu_rnn.py): CPU's values and gradients bitwise. The fused cells, computed as the
aten ops they fuse (still called under autocast, CUDA's policy), agree with CPU's unfused cell to
float32 rounding.
"""
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tilewise
from tilewise.eager.composite import COMPOSITES

MODES = ["eager", "adaptive", "compiled"]
TOL = dict(atol=0, rtol=0)  # bitwise
FUSED_TOL = dict(atol=1e-5, rtol=1e-4)  # a fused cell against CPU's unfused one
T, B, F, H = 5, 3, 4, 6


def _flat_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, torch.nn.utils.rnn.PackedSequence):
        return [out.data]
    return [t for o in out for t in _flat_outputs(o)]


def _forward_backward(make, inputs, device, mode=None):
    """Outputs, input grads and parameter grads of one forward and backward, on the host."""
    torch.manual_seed(0)
    module = make().to(device)
    xs = [x.detach().to(device).requires_grad_(x.is_floating_point()) for x in inputs]
    with tilewise.engine(mode=mode or "eager"):
        outs = _flat_outputs(module(*xs))
        # weights of the loss: every output element gets a different gradient
        loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(device)).sum() for o in outs)
        loss.backward()
        result = ([o.detach().cpu() for o in outs], [x.grad.cpu() for x in xs if x.requires_grad],
                  [p.grad.cpu() for p in module.parameters()])
    return result


def _assert_matches_cpu(make, inputs, mode):
    expected = _forward_backward(make, inputs, "cpu")
    got = _forward_backward(make, inputs, "neuron", mode)
    for kind, e, g in zip(("outputs", "input grads", "parameter grads"), expected, got):
        assert len(e) == len(g), kind
        for a, b in zip(e, g):
            assert a.dtype == b.dtype and a.shape == b.shape, kind
            torch.testing.assert_close(b, a, **TOL, msg=kind)


def _seq(batch_first=False):
    torch.manual_seed(1)
    return torch.randn(B, T, F) if batch_first else torch.randn(T, B, F)


class WithState(torch.nn.Module):
    """An RNN given an initial state, so the state's gradient is checked too."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, *state):
        return self.rnn(x, tuple(state) if len(state) > 1 else state[0])


LAYERS = {
    "lstm": lambda: torch.nn.LSTM(F, H),
    "lstm_2layer_bidirectional": lambda: torch.nn.LSTM(F, H, num_layers=2, bidirectional=True),
    "lstm_batch_first_no_bias": lambda: torch.nn.LSTM(F, H, batch_first=True, bias=False),
    "lstm_proj_size": lambda: torch.nn.LSTM(F, H, num_layers=2, proj_size=3, bidirectional=True),
    "lstm_dropout_between_layers": lambda: torch.nn.LSTM(F, H, num_layers=3, dropout=0.4),
    "gru": lambda: torch.nn.GRU(F, H),
    "gru_2layer_bidirectional_batch_first": lambda: torch.nn.GRU(F, H, num_layers=2, bidirectional=True,
                                                                 batch_first=True),
    "gru_no_bias_dropout": lambda: torch.nn.GRU(F, H, num_layers=2, bias=False, dropout=0.3),
    "rnn_tanh": lambda: torch.nn.RNN(F, H, num_layers=2),
    "rnn_relu_bidirectional": lambda: torch.nn.RNN(F, H, nonlinearity="relu", bidirectional=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_recurrent_layer_forward_and_backward_match_cpu(name, mode):
    _assert_matches_cpu(LAYERS[name], [_seq(batch_first="batch_first" in name)], mode)


@pytest.mark.parametrize("mode", MODES)
def test_lstm_with_initial_state_gives_state_gradients_like_cpu(mode):
    torch.manual_seed(2)
    h0, c0 = torch.randn(4, B, 3), torch.randn(4, B, H)  # 2 layers x 2 directions, proj_size 3
    make = lambda: WithState(torch.nn.LSTM(F, H, num_layers=2, bidirectional=True, proj_size=3))  # noqa: E731
    _assert_matches_cpu(make, [_seq(), h0, c0], mode)


@pytest.mark.parametrize("mode", MODES)
def test_gru_with_initial_state_gives_state_gradients_like_cpu(mode):
    torch.manual_seed(2)
    _assert_matches_cpu(lambda: WithState(torch.nn.GRU(F, H, num_layers=2)), [_seq(), torch.randn(2, B, H)], mode)


CELLS = {
    "lstm_cell": lambda: torch.nn.LSTMCell(F, H),
    "lstm_cell_no_bias": lambda: torch.nn.LSTMCell(F, H, bias=False),
    "gru_cell": lambda: torch.nn.GRUCell(F, H),
    "gru_cell_no_bias": lambda: torch.nn.GRUCell(F, H, bias=False),
    "rnn_cell_tanh": lambda: torch.nn.RNNCell(F, H),
    "rnn_cell_relu": lambda: torch.nn.RNNCell(F, H, nonlinearity="relu"),
}


class Unrolled(torch.nn.Module):
    """A cell stepped over the sequence by hand, as a decoder loop does."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x):
        state, outs = None, []
        for step in x:
            state = self.cell(step, state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CELLS))
def test_cell_unrolled_forward_and_backward_match_cpu(name, mode):
    _assert_matches_cpu(lambda: Unrolled(CELLS[name]()), [_seq()], mode)


class Packed(torch.nn.Module):
    """Variable-length sequences through pack_padded_sequence and back."""

    def __init__(self, rnn, lengths, enforce_sorted):
        super().__init__()
        self.rnn, self.lengths, self.enforce_sorted = rnn, lengths, enforce_sorted

    def forward(self, x):
        packed = pack_padded_sequence(x, self.lengths, enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed)
        padded, lengths = pad_packed_sequence(out, total_length=x.shape[0])
        return padded, state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_packed_sequences_match_cpu(kind, enforce_sorted, mode):
    lengths = torch.tensor([5, 3, 2]) if enforce_sorted else torch.tensor([2, 5, 3])
    rnn = {"lstm": lambda: torch.nn.LSTM(F, H, num_layers=2, bidirectional=True),
           "gru": lambda: torch.nn.GRU(F, H, bidirectional=True)}[kind]
    _assert_matches_cpu(lambda: Packed(rnn(), lengths, enforce_sorted), [_seq()], mode)


def _train_lstm(device, mode, steps):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(F, H, num_layers=2).to(device)
    head = torch.nn.Linear(H, 2).to(device)
    params = [*lstm.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = _seq().to(device), torch.randn(B, 2).to(device)
    losses = []
    with tilewise.engine(mode=mode):
        for _ in range(steps):
            out, _ = lstm(x)
            loss = torch.nn.functional.mse_loss(head(out[-1]), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in params]


@pytest.fixture
def deterministic_algorithms():
    """Compiled regions on their recorded graphs, CPU's kernels, however the C tier's timing goes."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_static_lstm_training_loop_compiles_and_matches_cpu(mode, deterministic_algorithms):
    steps = 6
    cpu_losses, cpu_params = _train_lstm("cpu", "eager", steps)
    losses, params = _train_lstm("neuron", mode, steps)
    torch.testing.assert_close(losses, cpu_losses, **TOL)
    for p, e in zip(params, cpu_params):
        torch.testing.assert_close(p, e, **TOL)
    stats = tilewise.stats()
    assert stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()
    # after warm-up the steps are served from the cache, the cell's ops among them
    assert stats.cache_hits >= steps - tilewise.config.threshold - 1, stats.report()
    assert "_thnn_fused_lstm_cell" not in stats.report()


@pytest.mark.parametrize("mode", MODES)
def test_lstm_and_gru_under_inference_mode_match_cpu(mode):
    torch.manual_seed(0)
    lstm, gru = torch.nn.LSTM(F, H, num_layers=2), torch.nn.GRU(F, H, bidirectional=True)
    x = _seq()
    with torch.inference_mode():
        expected = [lstm(x)[0], gru(x)[0]]
    lstm, gru = lstm.to("neuron"), gru.to("neuron")
    with tilewise.engine(mode=mode), torch.inference_mode():
        got = [lstm(x.to("neuron"))[0].cpu(), gru(x.to("neuron"))[0].cpu()]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_packed_sequences_under_inference_mode_match_cpu(mode):
    """Without autograd the packed-sequence ops reach the device whole, CPU batch_sizes and all."""
    torch.manual_seed(0)
    model = Packed(torch.nn.LSTM(F, H, num_layers=2, bidirectional=True), torch.tensor([2, 5, 3]), False)
    x = _seq()
    with torch.inference_mode():
        expected, _ = model(x)
    model = model.to("neuron")
    with tilewise.engine(mode=mode), torch.inference_mode():
        got, _ = model(x.to("neuron"))
        torch.testing.assert_close(got.cpu(), expected, **TOL)


def _gates(n_gates, seed):
    torch.manual_seed(seed)
    return torch.randn(B, n_gates * H), torch.randn(B, n_gates * H)


@pytest.mark.parametrize("has_bias", [True, False])
def test_fused_lstm_backward_op_equals_autograd_of_the_fused_forward(has_bias):
    """The backward op, called directly, against autograd through the forward composite on CPU."""
    igates, hgates = _gates(4, 3)
    cx, grad_hy, grad_cy = torch.randn(B, H), torch.randn(B, H), torch.randn(B, H)
    bias = torch.randn(4 * H) if has_bias else None
    leaves = [t.clone().requires_grad_() for t in (igates, cx)]
    hy, cy, workspace = COMPOSITES[torch.ops.aten._thnn_fused_lstm_cell.default](leaves[0], hgates, leaves[1],
                                                                                bias, bias)
    torch.autograd.backward([hy, cy], [grad_hy, grad_cy])
    dev = lambda t: t.to("neuron")  # noqa: E731
    grad_gates, grad_cx, grad_bias = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
        dev(grad_hy), dev(grad_cy), dev(cx), dev(cy.detach()), dev(workspace.detach()), has_bias)
    torch.testing.assert_close(grad_gates.cpu(), leaves[0].grad, **TOL)
    torch.testing.assert_close(grad_cx.cpu(), leaves[1].grad, **TOL)
    if has_bias:
        torch.testing.assert_close(grad_bias.cpu(), leaves[0].grad.sum(0), **TOL)
    else:
        assert grad_bias is None


def test_fused_gru_backward_op_equals_autograd_of_the_fused_forward():
    igates, hgates = _gates(3, 4)
    hx, grad_hy = torch.randn(B, H), torch.randn(B, H)
    leaves = [t.clone().requires_grad_() for t in (igates, hgates, hx)]
    hy, workspace = COMPOSITES[torch.ops.aten._thnn_fused_gru_cell.default](*leaves)
    hy.backward(grad_hy)
    grads = torch.ops.aten._thnn_fused_gru_cell_backward(grad_hy.to("neuron"), workspace.detach().to("neuron"), True)
    for got, leaf in zip(grads[:3], leaves):
        torch.testing.assert_close(got.cpu(), leaf.grad, **FUSED_TOL)
    torch.testing.assert_close(grads[3].cpu(), leaves[0].grad.sum(0), **FUSED_TOL)
    torch.testing.assert_close(grads[4].cpu(), leaves[1].grad.sum(0), **FUSED_TOL)


def test_fused_lstm_cell_forward_matches_cpu_unfused_cell():
    """The composite against CPU's own cell (which never calls the fused op)."""
    torch.manual_seed(5)
    cell = torch.nn.LSTMCell(F, H)
    x, h, c = torch.randn(B, F), torch.randn(B, H), torch.randn(B, H)
    expected = cell(x, (h, c))
    hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(
        (x @ cell.weight_ih.t()).to("neuron"), (h @ cell.weight_hh.t()).to("neuron"), c.to("neuron"),
        cell.bias_ih.to("neuron"), cell.bias_hh.to("neuron"))
    torch.testing.assert_close(hy.cpu(), expected[0], **FUSED_TOL)
    torch.testing.assert_close(cy.cpu(), expected[1], **FUSED_TOL)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_an_op_without_cpu_kernel_or_composite_still_says_so(mode):
    """Only the listed ops get a composite; another device-only op (`_masked_scale`, CUDA's
    dropout helper) keeps PyTorch's error, also from the lazy replay."""
    x = torch.randn(4, 4).to("neuron")
    with pytest.raises(NotImplementedError, match="_masked_scale"):
        with tilewise.engine(mode=mode):
            torch.ops.aten._masked_scale(x, x > 0, 2.0).cpu()


def test_a_compiled_regions_recorded_graph_runs_host_only_ops_as_the_eager_replay_does():
    """The replay tier runs a region's recorded aten ops on host buffers: a fused RNN cell (no CPU
    kernel) runs as its composite, and autograd's ZeroTensor factory makes real zeros (a
    ZeroTensor read by the next op crashed the process)."""
    from tilewise.compiler.driver import source_graph
    from tilewise.eager.composite import COMPOSITES

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    gates, hidden, cell = graph.placeholder("gates"), graph.placeholder("hidden"), graph.placeholder("cell")
    fused = graph.call_function(aten._thnn_fused_lstm_cell.default, (gates, hidden, cell))
    zeros = graph.call_function(aten._efficientzerotensor.default, ([B, H],), {"dtype": torch.float32})
    graph.output((fused, graph.call_function(aten.add.Tensor, (zeros, 1.0))))
    recorded = source_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    inputs = [*_gates(4, 0), torch.randn(B, H)]
    got = recorded(*inputs)
    for value, want in zip(got[0], COMPOSITES[aten._thnn_fused_lstm_cell.default](*inputs), strict=True):
        assert torch.equal(value, want)
    assert torch.equal(got[1], torch.ones(B, H))
