"""`nn.RNN`, `nn.LSTM` and `nn.GRU` on `neuron` as CPU computes them.

ATen's RNN composites (aten/src/ATen/native/RNN.cpp) branch on the input's device: CPU projects
the whole sequence's input at once and steps the cells on the projections, and its LSTM runs
oneDNN's layer kernel (`mkldnn_rnn_layer`) where oneDNN applies; any other device projects the
input step by step and calls the fused cells (eager/composite.py). The results differ in their
last bits (~1e-6), forward and backward. These functions, registered at AutogradPrivateUse1 for
the RNNs (packed sequences too) and the LSTM and GRU cells, are CPU's branch in aten ops: the same
ops on the same values, so the device computes CPU's outputs and gradients bitwise. PyTorch's own
decompositions (torch._decomp) follow CPU's order too but drop the dropout between layers.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..device.tensor import NeuronTensor

aten = torch.ops.aten
_LSTM_MODE = 2  # ideep::rnn_kind::LSTM, as CPU's lstm passes it to mkldnn_rnn_layer


class _Cell:
    """One layer and direction's weights, as ATen's CellParams: linear_ih, linear_hh, matmul_hr."""

    def __init__(self, params: list, has_biases: bool, has_projections: bool):
        self.w_ih, self.w_hh = params[0], params[1]
        self.b_ih, self.b_hh = (params[2], params[3]) if has_biases else (None, None)
        self.w_hr = params[-1] if has_projections else None

    def linear_ih(self, x):
        return aten.linear.default(x, self.w_ih, self.b_ih)

    def linear_hh(self, h):
        return aten.linear.default(h, self.w_hh, self.b_hh)

    def matmul_hr(self, h):
        return h if self.w_hr is None else aten.matmul.default(h, aten.t.default(self.w_hr))


def _tanh_cell(x, h, cell):
    return aten.tanh.default(aten.add_.Tensor(cell.linear_hh(h), x))


def _relu_cell(x, h, cell):
    return aten.relu.default(aten.add_.Tensor(cell.linear_hh(h), x))


def _lstm_cell(x, hidden, cell):
    hx, cx = hidden
    gates = aten.add_.Tensor(cell.linear_hh(hx), x)
    ingate, forgetgate, cellgate, outgate = aten.unsafe_chunk.default(gates, 4, 1)
    ingate, forgetgate = aten.sigmoid_.default(ingate), aten.sigmoid_.default(forgetgate)
    cellgate, outgate = aten.tanh_.default(cellgate), aten.sigmoid_.default(outgate)
    cy = aten.add_.Tensor(aten.mul.Tensor(forgetgate, cx), aten.mul.Tensor(ingate, cellgate))
    hy = aten.mul.Tensor(outgate, aten.tanh.default(cy))
    return cell.matmul_hr(hy), cy


def _gru_cell(x, h, cell):
    ir, ii, in_ = aten.unsafe_chunk.default(x, 3, 1)
    hr, hi, hn = aten.unsafe_chunk.default(cell.linear_hh(h), 3, 1)
    reset = aten.sigmoid_.default(aten.add_.Tensor(hr, ir))
    update = aten.sigmoid_.default(aten.add_.Tensor(hi, ii))
    new = aten.tanh_.default(aten.add.Tensor(in_, aten.mul_.Tensor(hn, reset)))
    return aten.add_.Tensor(aten.mul_.Tensor(aten.sub.Tensor(h, new), update), new)


def _output_of(hidden):
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _steps(step_cell, steps, hidden, cell):
    outputs = []
    for x in steps:
        hidden = step_cell(x, hidden, cell)
        outputs.append(_output_of(hidden))
    return outputs, hidden


def _layer(step_cell, x, hidden, cells, bidirectional: bool):
    """ATen's FullLayer / FullBidirectionalLayer on the CPU: the sequence's input projected at once."""
    forward, forward_hidden = _steps(step_cell, aten.unbind.int(cells[0].linear_ih(x)), hidden[0], cells[0])
    output = aten.stack.default(forward, 0)
    if not bidirectional:
        return output, [forward_hidden]
    backward, backward_hidden = _steps(step_cell, aten.unbind.int(cells[1].linear_ih(x))[::-1], hidden[1], cells[1])
    output = aten.cat.default([output, aten.stack.default(backward[::-1], 0)], output.dim() - 1)
    return output, [forward_hidden, backward_hidden]


def _cells(params, num_layers: int, bidirectional: bool, has_biases: bool, has_projections: bool) -> list:
    """One _Cell per layer and direction, in ATen's order (layer by layer, forward first)."""
    per_cell = len(params) // (num_layers * (2 if bidirectional else 1))
    return [_Cell(params[i:i + per_cell], has_biases, has_projections) for i in range(0, len(params), per_cell)]


def _layers(layer, x, hidden: list, cells: list, num_layers: int, dropout, train, bidirectional: bool):
    """ATen's _rnn_impl on the CPU: `layer(x, hidden, cells)` per layer, CPU's dropout between
    layers: (output, final hidden state per layer and direction)."""
    directions = 2 if bidirectional else 1
    finals = []
    for index in range(0, num_layers * directions, directions):
        here = slice(index, index + directions)
        x, layer_finals = layer(x, hidden[here], cells[here])
        finals += layer_finals
        if dropout != 0 and train and index + directions < num_layers * directions:
            x = aten.dropout.default(x, dropout, True)
    return x, finals


def _stack(step_cell, x, hidden: list, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
           has_projections=False):
    """An unpacked sequence (batch first or not) through the layers."""
    cells = _cells(params, num_layers, bidirectional, has_biases, has_projections)
    x = aten.transpose.int(x, 0, 1) if batch_first else x
    x, finals = _layers(lambda x, hidden, cells: _layer(step_cell, x, hidden, cells, bidirectional), x, hidden,
                        cells, num_layers, dropout, train, bidirectional)
    return (aten.transpose.int(x, 0, 1) if batch_first else x), finals


def _hidden_slice(hidden, start: int, end: int):
    if isinstance(hidden, tuple):
        return tuple(aten.narrow.default(h, 0, start, end - start) for h in hidden)
    return aten.narrow.default(hidden, 0, start, end - start)


def _hidden_concat(hiddens: list):
    if isinstance(hiddens[0], tuple):
        return tuple(aten.cat.default(list(parts), 0) for parts in zip(*hiddens))
    return aten.cat.default(hiddens, 0)


def _packed_forward(step_cell, data, batch_sizes: list, hidden, cell):
    """ATen's PackedLayer on the CPU: the finished sequences' states set aside as the batch shrinks."""
    projected = cell.linear_ih(data)
    outputs, finished, offset, last = [], [], 0, batch_sizes[0]
    for batch in batch_sizes:
        step = aten.narrow.default(projected, 0, offset, batch)
        offset += batch
        if last > batch:
            finished.append(_hidden_slice(hidden, batch, last))
            hidden = _hidden_slice(hidden, 0, batch)
        last = batch
        hidden = step_cell(step, hidden, cell)
        outputs.append(_output_of(hidden))
    finished.append(hidden)
    return aten.cat.default(outputs, 0), _hidden_concat(finished[::-1])


def _packed_reverse(step_cell, data, batch_sizes: list, hidden_in, cell):
    """ATen's ReversedPackedLayer on the CPU: from the last step, states taken in as the batch grows."""
    projected = cell.linear_ih(data)
    outputs, offset, last = [], data.shape[0], batch_sizes[-1]
    hidden = _hidden_slice(hidden_in, 0, last)
    for batch in batch_sizes[::-1]:
        if batch > last:
            hidden = _hidden_concat([hidden, _hidden_slice(hidden_in, last, batch)])
        step = aten.narrow.default(projected, 0, offset - batch, batch)
        offset -= batch
        last = batch
        hidden = step_cell(step, hidden, cell)
        outputs.append(_output_of(hidden))
    return aten.cat.default(outputs[::-1], 0), hidden


def _packed_layer(step_cell, data, sizes: list, hidden, cells):
    """ATen's PackedBidirectionalLayer (or PackedLayer) on the CPU."""
    output, final = _packed_forward(step_cell, data, sizes, hidden[0], cells[0])
    if len(cells) == 1:
        return output, [final]
    backward, backward_final = _packed_reverse(step_cell, data, sizes, hidden[1], cells[1])
    return aten.cat.default([output, backward], -1), [final, backward_final]


def _packed_stack(step_cell, data, batch_sizes, hidden: list, params, has_biases, num_layers, dropout, train,
                  bidirectional, has_projections=False):
    """A PackedSequence's data (and its CPU batch sizes) through the layers."""
    cells = _cells(params, num_layers, bidirectional, has_biases, has_projections)
    sizes = batch_sizes.tolist()
    return _layers(lambda x, hidden, cells: _packed_layer(step_cell, x, sizes, hidden, cells), data, hidden, cells,
                   num_layers, dropout, train, bidirectional)


def _composite(op, *args):
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args)


def _one_state(op, step_cell, packed: bool):
    """The kernel of gru, rnn_tanh or rnn_relu (one hidden state): CPU's branch, or ATen's composite."""
    def kernel(*args):
        if packed:  # (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional)
            data, batch_sizes, hx, params, *flags = args
            if not _plain(data, hx, params, dim=2, hidden_dim=3):
                return _composite(op, *args)
            output, finals = _packed_stack(step_cell, data, batch_sizes, aten.unbind.int(hx), params, *flags)
        else:  # (input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
            input, hx, params, *flags = args
            if not _plain(input, hx, params):
                return _composite(op, *args)
            output, finals = _stack(step_cell, input, aten.unbind.int(hx), params, *flags)
        return output, aten.stack.default(finals, 0)
    return kernel


def _lstm_result(output, finals):
    return output, aten.stack.default([h for h, _ in finals], 0), aten.stack.default([c for _, c in finals], 0)


def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    if not _plain(input, hx, params, states=2):
        return _composite(aten.lstm.input, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                          batch_first)
    has_projections = hx[0].shape[2] != hx[1].shape[2]
    if not has_projections and _cpu_lstm_takes_onednn(input.dtype, torch.is_grad_enabled(), input.numel() > 0,
                                                        torch._C._get_mkldnn_enabled()):
        return _onednn_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    hidden = list(zip(aten.unbind.int(hx[0]), aten.unbind.int(hx[1])))
    return _lstm_result(*_stack(_lstm_cell, input, hidden, params, has_biases, num_layers, dropout, train,
                                bidirectional, batch_first, has_projections))


def lstm_packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    if not _plain(data, hx, params, states=2, dim=2, hidden_dim=3):
        return _composite(aten.lstm.data, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                          bidirectional)
    hidden = list(zip(aten.unbind.int(hx[0]), aten.unbind.int(hx[1])))
    return _lstm_result(*_packed_stack(_lstm_cell, data, batch_sizes, hidden, params, has_biases, num_layers,
                                       dropout, train, bidirectional, hx[0].shape[2] != hx[1].shape[2]))


gru = _one_state(aten.gru.input, _gru_cell, packed=False)
rnn_tanh = _one_state(aten.rnn_tanh.input, _tanh_cell, packed=False)
rnn_relu = _one_state(aten.rnn_relu.input, _relu_cell, packed=False)
gru_packed = _one_state(aten.gru.data, _gru_cell, packed=True)
rnn_tanh_packed = _one_state(aten.rnn_tanh.data, _tanh_cell, packed=True)
rnn_relu_packed = _one_state(aten.rnn_relu.data, _relu_cell, packed=True)


def _onednn_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """CPU's mkldnn_rnn: oneDNN's LSTM layer kernel per layer and direction."""
    x = (aten.transpose.int(input, 0, 1) if batch_first else input).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = list(zip(aten.unbind.int(h0), aten.unbind.int(c0)))

    def layer(x, hidden, cells):
        outputs, finals = [], []
        for direction, ((h, c), cell) in enumerate(zip(hidden, cells)):
            # without biases CPU passes zeros shaped as the weights; the kernel reads none
            b_ih, b_hh = (cell.b_ih, cell.b_hh) if has_biases else \
                (aten.zeros_like.default(cell.w_ih), aten.zeros_like.default(cell.w_hh))
            out, hy, cy, _ = aten.mkldnn_rnn_layer.default(
                x, cell.w_ih, cell.w_hh, b_ih, b_hh, h, c, direction > 0, [], _LSTM_MODE, hx[0].shape[2],
                num_layers, has_biases, bidirectional, batch_first, train)
            outputs.append(out)
            finals.append((hy, cy))
        return (outputs[0] if len(outputs) == 1 else aten.cat.default(outputs, -1)), finals

    cells = _cells(params, num_layers, bidirectional, has_biases, False)
    x, finals = _layers(layer, x, hidden, cells, num_layers, dropout, train, bidirectional)
    return _lstm_result(aten.transpose.int(x, 0, 1) if batch_first else x, finals)


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """CPU's LSTMCell: linear_hh(hx) + linear_ih(input) into the gates (any other device: the
    products without biases into `_thnn_fused_lstm_cell`)."""
    weights = [w for w in (w_ih, w_hh, b_ih, b_hh) if w is not None]
    if not _plain(input, hx, weights, states=2, dim=2) or len(weights) == 3:
        return _composite(aten.lstm_cell.default, input, hx, w_ih, w_hh, b_ih, b_hh)
    cell = _Cell(weights, len(weights) == 4, False)
    return _lstm_cell(cell.linear_ih(input), (hx[0], hx[1]), cell)


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """CPU's GRUCell (any other device: `_thnn_fused_gru_cell`)."""
    weights = [w for w in (w_ih, w_hh, b_ih, b_hh) if w is not None]
    if not _plain(input, hx, weights, dim=2) or len(weights) == 3:
        return _composite(aten.gru_cell.default, input, hx, w_ih, w_hh, b_ih, b_hh)
    cell = _Cell(weights, len(weights) == 4, False)
    return _gru_cell(cell.linear_ih(input), hx, cell)


def _plain(input, hx, params, states: int = 1, dim: int = 3, hidden_dim: int | None = None) -> bool:
    """Device tensors all, of the ranks ATen expects (anything else takes the composite, which
    raises PyTorch's own error), outside autocast: the device's autocast policy is CUDA's, whose
    casts apply to the fused cells ATen's composite calls (tests/device/test_autocast.py), so autocast
    keeps the composite, as does a fake tensor while tracing."""
    hidden = tuple(hx) if isinstance(hx, (list, tuple)) else (hx,)
    return len(hidden) == states and all(type(t) is NeuronTensor for t in (input, *hidden, *params)) and \
        input.dim() == dim and all(h.dim() == (hidden_dim or dim) for h in hidden) and \
        not torch.is_autocast_enabled(input.device.type)


class _SeesOneDNN(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or func is aten.mkldnn_rnn_layer.default
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=None)
def _cpu_lstm_takes_onednn(dtype: torch.dtype, grad: bool, nonempty: bool, mkldnn_enabled: bool) -> bool:
    """Whether CPU's lstm runs oneDNN's kernel for an input like this: asked of CPU itself, on a
    one-step LSTM of that dtype (its conditions: the dtype, this CPU's bf16/fp16 support, grad mode,
    `torch.backends.mkldnn` switches), once per combination."""
    del mkldnn_enabled  # part of the key: the choice follows torch.backends.mkldnn.flags()
    size = 1 if nonempty else 0
    with torch.set_grad_enabled(grad), _SeesOneDNN() as probe:
        try:
            torch.lstm(torch.zeros(1, size, 1, dtype=dtype), [torch.zeros(1, size, 1, dtype=dtype)] * 2,
                       [torch.zeros(4, 1, dtype=dtype)] * 2, False, 1, 0.0, False, False, False)
        except RuntimeError:  # a dtype CPU's LSTM refuses: it refuses it on the device too
            return False
    return probe.seen


def install(library: torch.library.Library) -> None:
    for name, kernel in (("lstm.input", lstm), ("gru.input", gru), ("rnn_tanh.input", rnn_tanh),
                         ("rnn_relu.input", rnn_relu), ("lstm.data", lstm_packed), ("gru.data", gru_packed),
                         ("rnn_tanh.data", rnn_tanh_packed), ("rnn_relu.data", rnn_relu_packed),
                         ("lstm_cell", lstm_cell), ("gru_cell", gru_cell)):
        library.impl(name, kernel, "AutogradPrivateUse1")
