"""Autocast on neuron: CUDA's cast policy, registered from Python at the AutocastPrivateUse1 key.

`torch.autocast(device_type="neuron", dtype=...)` switches the AutocastPrivateUse1 key on for the
thread; every op on a neuron tensor then passes through that key. Core registers no policy for it,
so this module does, per op, what CUDA's (aten/src/ATen/autocast_mode.h, the AT_FORALL_* lists of
torch 2.13) does, and a fallthrough for every other op. The kernels run only while autocast is on
for neuron: without it the key is excluded and nothing here is on the path of an op.

One difference from CUDA: ATen caches the cast of an fp32 weight for the duration of the autocast
block and clears the cache when the outermost block exits, which Python cannot observe; so each use
of a weight casts it again. Values and gradients are the same, at the cost of one cast per use.
"""
from __future__ import annotations

import enum
import functools

import torch

aten = torch.ops.aten
_KEY = "AutocastPrivateUse1"
_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


class CastPolicy(enum.Enum):
    LOWER_PRECISION_FP = "cast floating inputs to the autocast dtype"
    FP32 = "cast floating inputs to float32"
    FP32_SET_OPT_DTYPE = "compute in float32 through the op's own dtype argument, unless one is given"
    FP32_APPEND_DTYPE = "call the overload taking a dtype, with float32"
    PROMOTE = "cast floating inputs to the widest floating type among them"
    BANNED = "refused: unsafe to autocast"


# CUDA's lists, op name -> overload names ("" is the overload without a name).
_LISTS = {
    CastPolicy.LOWER_PRECISION_FP: {
        "_convolution": ("deprecated", ""), "conv1d": ("",), "conv2d": ("",), "conv3d": ("",),
        "conv_tbc": ("",), "conv_transpose1d": ("",), "conv_transpose2d": ("input",),
        "conv_transpose3d": ("input",), "convolution": ("",), "prelu": ("",), "addmm": ("",),
        "addmv": ("",), "addr": ("",), "matmul": ("",), "einsum": ("",), "mm": ("",), "mv": ("",),
        "linalg_vecdot": ("",), "linear": ("",), "addbmm": ("",), "baddbmm": ("",), "bmm": ("",),
        "chain_matmul": ("",), "linalg_multi_dot": ("",), "_thnn_fused_lstm_cell": ("",),
        "_thnn_fused_gru_cell": ("",), "lstm_cell": ("",), "gru_cell": ("",), "rnn_tanh_cell": ("",),
        "rnn_relu_cell": ("",), "_scaled_dot_product_flash_attention": ("",),
        "scaled_dot_product_attention": ("",),
    },
    CastPolicy.FP32: {
        **dict.fromkeys(("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
                         "reciprocal", "rsqrt", "sinh", "tan", "softplus", "layer_norm", "native_layer_norm",
                         "rms_norm", "group_norm", "cosine_similarity", "poisson_nll_loss",
                         "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
                         "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
                         "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
                         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
                         "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
                         "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
                         "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                         "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
                         "_upsample_bicubic2d_aa"), ("",)),
        "pow": ("Tensor_Scalar", "Tensor_Tensor", "Scalar"), "frobenius_norm": ("dim",),
        "nuclear_norm": ("", "dim"),
    },
    CastPolicy.FP32_SET_OPT_DTYPE: {
        "prod": ("", "dim_int"), "softmax": ("int",), "log_softmax": ("int",), "cumprod": ("",),
        "cumsum": ("",), "linalg_vector_norm": ("",), "linalg_matrix_norm": ("", "str_ord"),
        "sum": ("", "dim_IntList"),
    },
    CastPolicy.FP32_APPEND_DTYPE: {"norm": ("Scalar", "ScalarOpt_dim")},
    CastPolicy.PROMOTE: dict.fromkeys(("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                                       "grid_sampler", "index_put", "tensordot", "scatter_add"), ("",)),
    CastPolicy.BANNED: {"binary_cross_entropy": ("",)},
}

# norm's overloads without a dtype -> the overload CUDA calls instead, with dtype appended.
_WITH_DTYPE = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


def policy_of(op: torch._ops.OpOverload) -> CastPolicy | None:
    """The cast policy of an aten overload on neuron, or None: it runs as it is."""
    name, overload = op._schema.name.split("::")[1], op._schema.overload_name
    for policy, ops in _LISTS.items():
        if overload in ops.get(name, ()):
            return policy
    return None


def _eligible(value) -> bool:
    # ATen's is_eligible: a floating tensor on this device, float64 left alone
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype is not torch.float64 \
        and value.device.type == "neuron"


def _cast(value, dtype: torch.dtype):
    if _eligible(value):
        return value if value.dtype is dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _widest(values, dtype: torch.dtype) -> torch.dtype:
    """ATen's promote_type: float32 wins over the autocast dtype; other types are ignored."""
    for value in values:
        if isinstance(value, (list, tuple)):
            dtype = _widest(value, dtype)
        elif _eligible(value) and value.dtype is torch.float32:
            return torch.float32
    return dtype


def _with_float32_dtype(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the op's optional `dtype` argument float32 unless the caller gave one."""
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    if index < len(args):
        if args[index] is None:
            args = (*args[:index], torch.float32, *args[index + 1:])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


def _autocast_kernel(op, policy: CastPolicy, *args, **kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        if policy is CastPolicy.LOWER_PRECISION_FP:
            dtype = torch.get_autocast_dtype("neuron")
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))
        if policy is CastPolicy.FP32:
            return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
        if policy is CastPolicy.FP32_SET_OPT_DTYPE:
            if _eligible(args[0]):  # else as called: an explicit dtype could upset implicit promotion
                args, kwargs = _with_float32_dtype(op, args, kwargs)
            return op(*args, **kwargs)
        if policy is CastPolicy.FP32_APPEND_DTYPE:
            dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
            return getattr(aten.norm, _WITH_DTYPE[op._overloadname])(*args, **kwargs, dtype=dtype)
        if policy is CastPolicy.PROMOTE:
            dtype = _widest((*args, *kwargs.values()), torch.get_autocast_dtype("neuron"))
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))
        raise RuntimeError(_BANNED_MESSAGE)


_libraries: list[torch.library.Library] = []


def install() -> None:
    """Register the policy at AutocastPrivateUse1 (idempotent)."""
    if _libraries:
        return
    every_op = torch.library.Library("_", "IMPL")
    every_op.fallback(torch.library.fallthrough_kernel, _KEY)
    policy_ops = torch.library.Library("aten", "IMPL")
    for policy, ops in _LISTS.items():
        for name, overloads in ops.items():
            for overload in overloads:
                op = getattr(getattr(aten, name), overload or "default")
                policy_ops.impl(f"{name}.{overload}" if overload else name,
                                functools.partial(_autocast_kernel, op, policy), _KEY)
    _libraries.extend((every_op, policy_ops))
