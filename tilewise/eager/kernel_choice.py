"""Where PyTorch picks an op's kernel by device type, `neuron` gets the kernel CPU gets.

The device runs every op on its host buffers with CPU's kernels, so it computes CPU's values
bitwise, as long as the ops that reach it are the ones CPU runs. Six places in PyTorch send a
PrivateUse1 tensor (or a tensor subclass) elsewhere than a CPU tensor, above the Python dispatch
key the device sees ops at, one derivative formula branches on the device, and three more places
pick an algorithm by device type in Python (found by comparing the ops and values CPU and neuron
give for PyTorch's OpInfo samples, Hugging Face models, RNNs, CNNs and optimizers, and by reading
PyTorch's Python and derivatives.yaml for device-type branches); `install` sets up all ten:

- Ops with a CPU kernel and a CompositeImplicitAutograd one for every other backend
  (`silu_backward`, `mish_backward`, `native_channel_shuffle`): the dispatcher gives a backend
  without a kernel of its own the composite, at the autograd key. On `neuron` they arrived as their
  decompositions (silu_backward as sigmoid, sub, mul...), whose rounding is not the fused kernel's:
  Hugging Face Llama's gradients (SiLU) were off CPU's by ~3e-8. A kernel registered for
  PrivateUse1 makes the dispatcher pass them through autograd (their derivative formulas) to the
  Python key whole, where the device runs CPU's kernel; the kernel itself is never reached there.
- `scaled_dot_product_attention`, a CompositeImplicitAutograd kernel that asks a C++ per-device stub
  which fused kernel to use. CPU's answers with its flash-attention kernel wherever that applies (no
  dropout, 4-D inputs, a supported dtype and head size); the stub has no entry for PrivateUse1, so
  `neuron` always took the math path (matmul, softmax, matmul; bf16 in float32). Hugging Face GPT-2
  and Llama, whose default attention is SDPA, computed other values than on the CPU (bf16: the loss
  off in its fifth digit, most gradients by bf16 ulps). The op is registered at AutogradPrivateUse1
  with CPU's own decision: `aten._fused_sdp_choice` asked on the host buffers, which carry the device
  tensors' metadata (its checks read metadata and the `torch.nn.attention.sdpa_kernel` switches
  only). Where CPU takes its flash kernel the device runs that op, and autograd its backward;
  elsewhere the op runs as its composite, as before. Under inference_mode the op reaches the
  device whole and runs on the host buffers (eager/plan.py), where CPU's composite decides itself.
- `dropout`, a CompositeImplicitAutograd kernel that sends accelerators (PrivateUse1 included) to
  `native_dropout` (input * mask * float32(1 / (1 - p))) and CPU to its own composite (noise =
  bernoulli(1 - p) / float32(1 - p), input * noise). The two round differently for 15 of the 99 p
  in 0.01..0.99 (0.15, 0.45...): every kept element one ulp off, forward and backward. Registered at
  AutogradPrivateUse1 too, it makes CPU's noise at once (random numbers in eager's order, as the
  lazy modes draw them) and multiplies by it, so autograd saves the noise as CPU's does.
- the RNNs (`lstm`, `gru`, `rnn_tanh`, `rnn_relu`, their packed forms, `lstm_cell`, `gru_cell`),
  whose composites branch on `is_cpu()`: cpu_rnn.py.
- `linalg_svdvals` and `linalg_eigvalsh`, composites that compute the singular or eigen vectors too
  where a gradient may be asked for, which ATen assumes of every Python tensor subclass, the
  neuron tensor included: LAPACK then takes another path, whose values differ in their last bits
  (`linalg.svdvals`, `eigvalsh`, `cond`, the nuclear norm). Registered at AutogradPrivateUse1,
  they ask for the vectors where CPU does (grad mode on and the input requiring grad, or a
  forward-mode gradient).
- `matmul` of two 3-d tensors whose batch sizes differ, one of them 1: ATen's composite squeezes
  that batch dimension away and folds the other into one `mm` where the tensor requires grad *or is
  a tensor subclass*, else it expands it and runs `bmm`. The neuron tensor is a subclass, so a
  (5, 5, 5) @ (1, 5, 5) product without gradients took `mm` where CPU takes `bmm`: 1.5e-5 apart
  (MKL's two kernels sum otherwise; the OpInfo sweep's matmul sample 14). Registered at
  AutogradPrivateUse1 (`matmul` is a composite), that case runs CPU's expand and `bmm`.
- `group_norm`'s gradient (derivatives.yaml): on CPU, `native_group_norm_backward` gets the
  gradient and the input in the input's memory format, on any other device (XPU aside) both made
  contiguous first. CPU's kernel has a channels-last path that sums in another order, so a
  channels-last CNN with GroupNorm had input and weight gradients off CPU's (weight 3.8e-6 in one
  layer). Registered at AutogradPrivateUse1 (`group_norm` is a composite), a channels-last neuron
  input that needs a gradient gets CPU's formula (`_GroupNormAsOnCpu`); anything else the composite.
- `F.linear_cross_entropy` with `options`: its "auto" accumulation policy, dtype and chunking are
  looked up by device type (`LinearCrossEntropyOptions._adjust`); CPU's entry accumulates float16
  and bfloat16 logits in float32 ("accurate", chunks of the batch by aspect ratio), a device
  without an entry in the 16-bit dtype itself ("compact", half those chunks): bfloat16 and float16
  losses and gradients were off CPU's by 16-bit ulps. `neuron` resolves "auto" as CPU does.
- The optimizers' default implementation: the multi-tensor one (`foreach`) for the devices listed
  as having foreach kernels, PrivateUse1 among them, the per-parameter loop for CPU. Most compute
  the same values either way in float32, but NAdam, RAdam and ASGD round otherwise (5 steps of a
  small MLP: parameters off CPU's by up to 7.5e-8), and in float16 and bfloat16 most do (SGD with
  momentum by one bfloat16 step). Those three, and every optimizer of reduced-precision parameters,
  default to the loop on `neuron` as on CPU; the others keep `foreach`, one recorded op per
  parameter group instead of one per parameter (the tests hold every optimizer to CPU's values, so
  one that starts to differ is found). Likewise
  `AveragedModel`'s default (SWA) average: `_foreach_lerp_` on a device with foreach kernels,
  `avg + (p - avg) / (n + 1)` per parameter on CPU (one ulp apart); neuron averages as CPU.
- `F.interpolate` in bilinear and trilinear mode while `torch.use_deterministic_algorithms(True)`
  is on: any input but a CPU one takes PyTorch's decomposition (`_upsample_linear_vec`, whose
  backward is index_put's), which rounds otherwise than the kernel (outputs and gradients up to
  1.4e-6 off). A neuron input runs the kernel, as a CPU input does.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch._prims_common import suggest_memory_format
from torch.nn.attention import SDPBackend
from torch.optim import adadelta, adagrad, adam, adamax, asgd, nadam, radam, rmsprop, rprop, sgd
from torch.utils._python_dispatch import _disable_current_modes

from .. import op_facts, patches
from ..config import config
from ..device import tile_kernels
from ..device.tensor import TRACED, NeuronTensor
from ..errors import DeviceError
from ..reasons import Reason
from . import cpu_rnn
from .executor import run

aten = torch.ops.aten
_FLASH = int(SDPBackend.FLASH_ATTENTION)
_library: torch.library.Library | None = None


def ops_cpu_runs_whole() -> list[str]:
    """aten ops with a CPU kernel of their own besides a CompositeImplicitAutograd kernel, read
    from the dispatcher."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return sorted(name for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("aten::") and has_kernel(name, "CPU")
                  and has_kernel(name, "CompositeImplicitAutograd"))


def _unreachable(*args, **kwargs):
    """The PrivateUse1 kernel of `ops_cpu_runs_whole()`: neuron tensors meet the Python key first."""
    raise DeviceError("an op reached tilewise's PrivateUse1 kernel, which only routes ops to the device's "
                      "dispatch; please report it")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    if config.attention_kernel == "flash":  # tilewise.kernels' FlashAttention, where it applies
        out = op_facts.ROUTE[aten.scaled_dot_product_attention.default](
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if not isinstance(out, Reason):
            return out
        tile_kernels.declined("scaled_dot_product_attention", out)
    if _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) != _FLASH:
        return aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as CPU's composite: 0 where kept, -inf
        keep = aten.scalar_tensor.default(0.0, dtype=query.dtype, device=attn_mask.device)
        drop = aten.scalar_tensor.default(float("-inf"), dtype=query.dtype, device=attn_mask.device)
        attn_mask = aten.where.self(attn_mask, keep, drop)
    output, _ = aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output


def _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The SDPBackend CPU's stub picks for host tensors like these; math for anything that is not
    on the device (the composite then raises PyTorch's own error)."""
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(_on_device(t) for t in tensors):
        return int(SDPBackend.MATH)
    traced = any(type(t) is not NeuronTensor or type(t._data) is not torch.Tensor for t in tensors)
    with _disable_current_modes() if traced else contextlib.nullcontext():
        query, key, value, attn_mask = [None if t is None else _host_like(t, traced)
                                        for t in (query, key, value, attn_mask)]
        return aten._fused_sdp_choice.default(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


def _on_device(tensor) -> bool:
    """A neuron tensor, or a tracer's tensor on neuron (device.tensor.TRACED: a mask made in a traced
    program)."""
    return type(tensor) is NeuronTensor or isinstance(tensor, TRACED) and tensor.device.type == "neuron"


def _host_like(tensor, traced: bool) -> torch.Tensor:
    """The host buffer, requiring grad where the device tensor does (CPU's flash kernel has no
    gradient for a mask, so a mask that requires one takes the math path). Traced (a fake host
    buffer while Dynamo propagates shapes, a functional one while AOTAutograd traces, a tracer's
    own tensor on neuron): a real tensor with its metadata, as a fake tensor's choice is its Meta
    kernel's, always math, and a compiled model computed other values than CPU's flash kernel.
    Symbolic sizes are taken at their hints, without a guard: CPU's checks compare sizes with 0
    and with each other, which a shape-generic trace's sizes (2 and up, equal where they are one
    symbol) all answer alike."""
    data = tensor._data if type(tensor) is NeuronTensor else tensor
    if traced:
        from torch.fx.experimental.symbolic_shapes import optimization_hint  # sympy's 0.4 s: when tracing

        sizes = [optimization_hint(n, fallback=2) for n in data.shape]
        strides = [optimization_hint(n, fallback=1) for n in data.stride()]
        data = torch.empty_strided(sizes, strides, dtype=data.dtype)
    return data.detach().requires_grad_() if tensor.requires_grad else data


def dropout(input, p, train):
    if not (train and 0 < p < 1 and input.numel() > 0 and type(input) is NeuronTensor):
        return aten.dropout.default.decompose(input, p, train)  # input itself, zeros, or a fake tensor's
    # the noise is made now, by the device but outside the lazy modes' recording: a fresh buffer
    # no recorded op reads, so drawing into it needs no flush (adaptive/runtime.py's dropout)
    noise = run(aten.empty_like.default, (input,), {})
    run(aten.bernoulli_.float, (noise, 1 - p), {})
    run(aten.div_.Scalar, (noise, 1 - p), {})
    return aten.mul.Tensor(input, noise)


def linalg_svdvals(A, *, driver=None):
    return aten._linalg_svd.default(A, False, _may_require_grad(A), driver=driver)[1]


def linalg_eigvalsh(A, UPLO="L"):
    return aten._linalg_eigh.default(A, UPLO, _may_require_grad(A))[0]


def _may_require_grad(tensor) -> bool:
    """ATen's `_may_require_fw_or_bw_grad` as it answers for a CPU tensor: its answer for any Python
    subclass (a fake tensor's too) is yes."""
    if type(tensor) is not NeuronTensor:
        return True
    return torch.is_grad_enabled() and tensor.requires_grad or \
        torch.autograd.forward_ad.unpack_dual(tensor).tangent is not None


def matmul(tensor1, tensor2):
    if not _cpu_expands_a_batch_of_one(tensor1, tensor2):
        # ATen's composite, not OpOverload.decompose(): that runs PyTorch's Python matmul, which
        # folds otherwise (a 1-d by 3-d product: 1.5e-5 off CPU's)
        return aten.matmul.default._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, tensor1, tensor2)
    (batch1, n, m), (batch2, _, p) = tensor1.shape, tensor2.shape
    batch = max(batch1, batch2)
    expanded1 = aten.reshape.default(aten.expand.default(tensor1, [batch, n, m]), [batch, n, m])
    expanded2 = aten.reshape.default(aten.expand.default(tensor2, [batch, m, p]), [batch, m, p])
    return aten._unsafe_view.default(aten.bmm.default(expanded1, expanded2), [batch, n, p])


def _cpu_expands_a_batch_of_one(tensor1, tensor2) -> bool:
    """Whether CPU's matmul takes its expand-and-bmm branch where a subclass takes squeeze-and-mm:
    3-d by 3-d, batch sizes apart, the one of size 1 not requiring grad (ATen's _matmul_impl)."""
    if not (type(tensor1) is NeuronTensor and type(tensor2) is NeuronTensor and tensor1.dim() == tensor2.dim() == 3):
        return False
    batch1, batch2 = tensor1.shape[0], tensor2.shape[0]
    if batch1 == batch2:
        return False
    one = tensor1 if batch1 == 1 else tensor2 if batch2 == 1 else None
    return one is not None and not one.requires_grad


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True):
    tensors = [t for t in (input, weight, bias) if t is not None]
    if not (type(input) is NeuronTensor and suggest_memory_format(input) != torch.contiguous_format
            and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return aten.group_norm.default.decompose(input, num_groups, weight, bias, eps, cudnn_enabled)
    return _GroupNormAsOnCpu.apply(input, num_groups, weight, bias, eps)


class _GroupNormAsOnCpu(torch.autograd.Function):
    """`native_group_norm` with the backward derivatives.yaml gives a CPU tensor: the gradient and the
    input in the input's memory format. Under create_graph, CPU's formula is the differentiable one,
    which does not branch on the device: the forward is run again with autograd's own formula."""

    @staticmethod
    def forward(ctx, input, num_groups, weight, bias, eps):
        n, c = input.shape[:2]
        ctx.sizes = (n, c, input.numel() // max(1, n * c), num_groups)
        output, mean, rstd = aten.native_group_norm.default(input, weight, bias, *ctx.sizes, eps)
        ctx.eps = eps
        ctx.save_for_backward(input, weight, bias, mean, rstd)
        return output

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _group_norm_grads_differentiably(grad, input, weight, bias, ctx.sizes, ctx.eps, ctx.needs_input_grad)
        memory_format = suggest_memory_format(input)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        d_input, d_weight, d_bias = aten.native_group_norm_backward.default(
            grad.contiguous(memory_format=memory_format), input.contiguous(memory_format=memory_format),
            mean, rstd, weight, *ctx.sizes, mask)
        return d_input, None, d_weight, d_bias, None


def _group_norm_grads_differentiably(grad, input, weight, bias, sizes, eps, needs_input_grad):
    wanted = [(i, t) for i, t in ((0, input), (2, weight), (3, bias)) if needs_input_grad[i]]
    output = aten.native_group_norm.default(input, weight, bias, *sizes, eps)[0]
    found = torch.autograd.grad(output, [t for _, t in wanted], grad, create_graph=True)
    grads = [None] * 5
    for (i, _), g in zip(wanted, found):
        grads[i] = g
    return tuple(grads)


def _resolved_as_on_cpu(adjust):
    """LinearCrossEntropyOptions._adjust, resolving "auto" for a neuron tensor as for a CPU one."""
    def _adjust(self, num_batches, in_features, num_classes, dtype, device=None):
        if device is not None and torch.device(device).type == "neuron":
            device = torch.device("cpu")
        return adjust(self, num_batches, in_features, num_classes, dtype, device)
    return _adjust


# The optimizers whose multi-tensor implementation rounds otherwise than the per-parameter loop
# CPU runs, in float32 (tests/eager/test_kernel_choice.py compares every torch.optim optimizer with CPU's)
FOREACH_ROUNDS_OTHERWISE = (nadam, radam, asgd)
# ... and every optimizer, in float16 and bfloat16: on CPU the foreach kernels of SGD with momentum,
# Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam and ASGD round otherwise than the loop there
OPTIMIZERS = (adadelta, adagrad, adam, adamax, asgd, nadam, radam, rmsprop, rprop, sgd)  # AdamW is adam.py's
_REDUCED = (torch.float16, torch.bfloat16)


def _loop_on_neuron(default, always: bool):
    """An optimizer module's `_default_to_fused_or_foreach`, answering for neuron parameters what it
    answers for CPU's, the per-parameter loop: `always`, or for parameters in reduced precision."""
    def _default_to_fused_or_foreach(params, differentiable, use_fused=False):
        fused, foreach = default(params, differentiable, use_fused)
        if foreach and any(isinstance(p, NeuronTensor) and (always or p.dtype in _REDUCED) for p in params):
            foreach = False
        return fused, foreach
    return _default_to_fused_or_foreach


def _without_neuron(devices):
    """`_get_foreach_kernels_supported_devices` for a module that is to loop on neuron, as on CPU."""
    def _get_foreach_kernels_supported_devices():
        return [device for device in devices() if device != "neuron"]
    return _get_foreach_kernels_supported_devices


# F.interpolate's linear kernels by input rank, as it calls them for a CPU input
_LINEAR_KERNELS = {4: torch._C._nn.upsample_bilinear2d, 5: torch._C._nn.upsample_trilinear3d}


def _kernel_on_neuron(decomposition):
    """torch._decomp.decompositions._upsample_linear_vec, which F.interpolate calls for inputs not on
    the CPU under deterministic algorithms, running the kernel for a neuron input."""
    def _upsample_linear_vec(input, output_size, align_corners, scale_factors):
        kernel = _LINEAR_KERNELS.get(input.dim()) if isinstance(input, NeuronTensor) else None
        if kernel is None:
            return decomposition(input, output_size, align_corners, scale_factors)
        return kernel(input, output_size, align_corners, scale_factors)
    return _upsample_linear_vec


def install() -> None:
    """Register them all; idempotent."""
    global _library
    if _library is not None:
        return
    # PyTorch's Python that picks by device type
    patches.replace("torch.nn.modules.linear_cross_entropy_options:LinearCrossEntropyOptions._adjust",
                    _resolved_as_on_cpu)
    for module in OPTIMIZERS:
        patches.replace(f"{module.__name__}:_default_to_fused_or_foreach",
                        functools.partial(_loop_on_neuron, always=module in FOREACH_ROUNDS_OTHERWISE))
    patches.replace("torch.optim.swa_utils:_get_foreach_kernels_supported_devices", _without_neuron)
    patches.replace("torch._decomp.decompositions:_upsample_linear_vec", _kernel_on_neuron)
    _library = torch.library.Library("aten", "IMPL")
    for name in ops_cpu_runs_whole():
        _library.impl(name.removeprefix("aten::"), _unreachable, "PrivateUse1")
    _library.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")
    _library.impl("dropout", dropout, "AutogradPrivateUse1")
    _library.impl("group_norm", group_norm, "AutogradPrivateUse1")
    _library.impl("matmul", matmul, "AutogradPrivateUse1")
    _library.impl("linalg_svdvals", linalg_svdvals, "AutogradPrivateUse1")
    _library.impl("linalg_eigvalsh", linalg_eigvalsh, "AutogradPrivateUse1")
    cpu_rnn.install(_library)
