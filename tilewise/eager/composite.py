"""Device-only fused ops, computed as the aten ops they fuse.

ATen sends some ops only to accelerators: its RNN cells call `_thnn_fused_lstm_cell` /
`_thnn_fused_gru_cell` when the input is on CUDA, XPU or PrivateUse1 (aten/src/ATen/native/RNN.cpp),
and their backward formulas call `_thnn_fused_lstm_cell_backward_impl` / `_thnn_fused_gru_cell_backward`.
None has a CPU kernel, so the executor cannot run them on the host buffers; nor can it run
`_pack_padded_sequence`, which takes and returns CPU tensors next to device data. Each gets here the
computation of CUDA's kernel (aten/src/ATen/native/cuda/RNN.cu) written in aten ops; torch._decomp
has none for them (it decomposes whole `lstm`/`gru` calls, not the cells that LSTMCell and GRUCell
also use). `record_stream`, which CPU has no kernel for either, has nothing to do on a device that
runs each op as it is issued (the lazy modes drop it: adaptive/policy.NO_EFFECT).

Two ways in:
- the forward cells are registered at the AutogradPrivateUse1 key, so on `neuron` they are
  replaced, above autograd, by their aten ops: every mode records those ops one by one (the LSTM
  step compiles like any other) and autograd differentiates them, as it differentiates CPU's
  unfused cells, so the backward ops never reach the device;
- below autograd (under `torch.inference_mode`, or a direct call of a backward op) the executor
  runs the op's composite from `COMPOSITES` on the device tensors; a lazy replay of a recorded
  fused cell runs it on the host buffers. Under inference_mode the packed-sequence forms of the
  RNNs arrive whole, with the CPU `batch_sizes`; they run as CPU computes them (cpu_rnn.py), and
  the composite ops that may return a view or name a device (`reshape`, `to`: eager/plan.py) as
  PyTorch's own decomposition.

Where autograd is on, `nn.RNN/LSTM/GRU` and `LSTMCell`/`GRUCell` take CPU's branch (cpu_rnn.py) and
call no fused cell; the cells come here under autocast, whose policy for the device is CUDA's.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import op_facts
from . import cpu_rnn, sync_batch_norm

aten = torch.ops.aten


def _with_biases(gates: torch.Tensor, *biases) -> torch.Tensor:
    for bias in biases:
        if bias is not None:
            gates = aten.add.Tensor(gates, bias)
    return gates


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace): workspace holds the activated gates [i, f, g, o], as CUDA's kernel."""
    gates = _with_biases(aten.add.Tensor(input_gates, hidden_gates), input_bias, hidden_bias)
    i, f, g, o = aten.chunk.default(gates, 4, 1)
    i, f, g, o = aten.sigmoid.default(i), aten.sigmoid.default(f), aten.tanh.default(g), aten.sigmoid.default(o)
    cy = aten.add.Tensor(aten.mul.Tensor(f, cx), aten.mul.Tensor(i, g))
    hy = aten.mul.Tensor(o, aten.tanh.default(cy))
    return hy, cy, aten.cat.default([i, f, g, o], 1)


def fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad of the gates before activation, grad of cx, grad of the bias or None)."""
    i, f, g, o = aten.chunk.default(workspace, 4, 1)
    tanh_cy = aten.tanh.default(cy)
    grad_hy = grad_hy if grad_hy is not None else aten.zeros_like.default(cy)
    grad_c = aten.tanh_backward.default(aten.mul.Tensor(grad_hy, o), tanh_cy)
    if grad_cy is not None:
        grad_c = aten.add.Tensor(grad_c, grad_cy)
    grad_gates = aten.cat.default([
        aten.sigmoid_backward.default(aten.mul.Tensor(grad_c, g), i),
        aten.sigmoid_backward.default(aten.mul.Tensor(grad_c, cx), f),
        aten.tanh_backward.default(aten.mul.Tensor(grad_c, i), g),
        aten.sigmoid_backward.default(aten.mul.Tensor(grad_hy, tanh_cy), o),
    ], 1)
    grad_bias = aten.sum.dim_IntList(grad_gates, [0]) if has_bias else None
    return grad_gates, aten.mul.Tensor(grad_c, f), grad_bias


def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace): workspace holds [r, z, n, hx, hn] (hn with its bias), as CUDA's kernel."""
    ir, ii, in_ = aten.chunk.default(_with_biases(input_gates, input_bias), 3, 1)
    hr, hi, hn = aten.chunk.default(_with_biases(hidden_gates, hidden_bias), 3, 1)
    r = aten.sigmoid.default(aten.add.Tensor(ir, hr))
    z = aten.sigmoid.default(aten.add.Tensor(ii, hi))
    n = aten.tanh.default(aten.add.Tensor(in_, aten.mul.Tensor(r, hn)))
    hy = aten.add.Tensor(n, aten.mul.Tensor(z, aten.sub.Tensor(hx, n)))
    return hy, aten.cat.default([r, z, n, hx, hn], 1)


def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad of the input gates, of the hidden gates, of hx, of the two biases or None)."""
    r, z, n, hx, hn = aten.chunk.default(workspace, 5, 1)
    one_minus_z = aten.rsub.Scalar(z, 1)
    grad_z = aten.mul.Tensor(aten.mul.Tensor(grad_hy, aten.sub.Tensor(hx, n)), aten.mul.Tensor(one_minus_z, z))
    grad_n = aten.tanh_backward.default(aten.mul.Tensor(grad_hy, one_minus_z), n)
    grad_r = aten.sigmoid_backward.default(aten.mul.Tensor(grad_n, hn), r)
    grad_input_gates = aten.cat.default([grad_r, grad_z, grad_n], 1)
    grad_hidden_gates = aten.cat.default([grad_r, grad_z, aten.mul.Tensor(grad_n, r)], 1)
    grad_hx = aten.mul.Tensor(grad_hy, z)
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, None, None
    return (grad_input_gates, grad_hidden_gates, grad_hx,
            aten.sum.dim_IntList(grad_input_gates, [0]), aten.sum.dim_IntList(grad_hidden_gates, [0]))


def pack_padded_sequence(input, lengths, batch_first=False):
    """(data, batch_sizes) as ATen's CompositeExplicitAutograd kernel makes them (PackedSequence.cpp),
    from device ops: the kernel itself cannot run on the host buffers, as `lengths` and the
    returned `batch_sizes` stay on the CPU next to device data, the one cross-device op here."""
    if lengths.device.type != "cpu" or lengths.dtype != torch.int64 or lengths.dim() != 1:
        raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {lengths.dim()}D "
                           f"{lengths.device} {lengths.dtype} tensor")
    steps_major = aten.transpose.int(input, 0, 1) if batch_first else input
    batch = steps_major.shape[1]
    sizes = lengths.tolist()
    if sizes[-1] <= 0:
        raise RuntimeError("Length of all samples has to be greater than 0, but found an element in "
                           "'lengths' that is <= 0")
    steps, batch_sizes, done = [], [], 0
    for i in range(batch):  # from the shortest sequence: each length band is one block of steps
        length = sizes[batch - 1 - i]
        if length < done:
            raise RuntimeError("'lengths' array must be sorted in decreasing order")
        if length > done:
            block = steps_major[done:length, :batch - i]
            steps.append(aten.reshape.default(block, [-1, *steps_major.shape[2:]]))
            batch_sizes += [batch - i] * (length - done)
            done = length
    return aten.cat.default(steps), torch.tensor(batch_sizes, dtype=torch.int64)


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
    """CTC loss given its lengths as tensors: CUDA reads them on the host, so they may be CPU tensors
    beside device ones. PyTorch's composite keeps them tensors for a tensor subclass and divides the
    device loss by the CPU lengths (a mixed-device error); as lists they take its CPU and CUDA path."""
    return aten.ctc_loss.IntList(log_probs, targets, input_lengths.tolist(), target_lengths.tolist(), blank,
                                 reduction, zero_infinity)


def record_stream(tensor, stream) -> None:
    """Nothing to record: the device runs each op as it is issued, so no stream's later work can
    still be reading a tensor's memory when the tensor is freed (CUDA's reason for the call). CPU
    has no kernel for it."""


# Op overload -> its computation in aten ops, for the ops the executor cannot run on host buffers.
COMPOSITES: dict[torch._ops.OpOverload, Callable] = {
    aten._thnn_fused_lstm_cell.default: fused_lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: fused_lstm_cell_backward_impl,
    aten._thnn_fused_gru_cell.default: fused_gru_cell,
    aten._thnn_fused_gru_cell_backward.default: fused_gru_cell_backward,
    aten._pack_padded_sequence.default: pack_padded_sequence,
    aten.record_stream.default: record_stream,
    aten.ctc_loss.Tensor: ctc_loss,
    # Composite ops that reach the device whole when autograd is off (inference_mode) and carry the
    # CPU `batch_sizes` of a PackedSequence: the RNNs as CPU computes them (cpu_rnn.py), and PyTorch's
    # own CompositeImplicitAutograd kernel for the padding, on the device tensors.
    aten.lstm.data: cpu_rnn.lstm_packed,
    aten.gru.data: cpu_rnn.gru_packed,
    aten.rnn_tanh.data: cpu_rnn.rnn_tanh_packed,
    aten.rnn_relu.data: cpu_rnn.rnn_relu_packed,
    aten._pad_packed_sequence.default: aten._pad_packed_sequence.default.decompose,
    **sync_batch_norm.COMPOSITES,
}
op_facts.COMPOSITE.register(COMPOSITES)

# Ops whose composite also replaces them above autograd on `neuron` (see the module's docstring).
_ABOVE_AUTOGRAD = ("_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_pack_padded_sequence", "record_stream",
                   "ctc_loss.Tensor")
_library: torch.library.Library | None = None


def install() -> None:
    """Register the `_ABOVE_AUTOGRAD` composites at AutogradPrivateUse1; idempotent."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for name in _ABOVE_AUTOGRAD:
        packet, _, overload = name.partition(".")
        _library.impl(name, COMPOSITES[getattr(getattr(aten, packet), overload or "default")], "AutogradPrivateUse1")
