"""Python floats that change from flush to flush become inputs of compiled regions.

Static first, generalise on change (Dynamo's "automatic dynamic"): a node's floats are constants of
any region compiled from it until the same op, at the same place of a segment, comes with another
value (a learning-rate schedule's `alpha=-lr`, a loss scale, a step counter). From then on its
floats are left out of its fingerprint and enter the region as 0-dim CPU tensors, so one
compiled region serves every value. How a float becomes a tensor depends on where the schema takes
it (`Lift`); an op whose floats none of these fit keeps them as constants and runs eagerly while
they change.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

aten = torch.ops.aten


class How(enum.Enum):
    TENSOR_ARG = "a Tensor argument given a number: the same number as a 0-dim tensor"
    TENSOR_OVERLOAD = "a Scalar argument of an overload with a Tensor twin: the twin, given a tensor"
    SCALE_OTHER = "alpha of add/sub: addcmul of the other operand and alpha (sub: -alpha)"
    LIST_OVERLOAD = "the weight of _foreach_lerp: the List overload, given the tensor once per element"
    SCALE_FIRST = "value of addcmul/addcdiv: the first factor times value, then the op with value 1"
    FILL = "fill_value of full: full of zeros, then fill with the number as a 0-dim tensor"


class Lift(NamedTuple):
    position: int | str       # index into args, or the keyword's name
    how: How
    dtype: torch.dtype        # of the 0-dim CPU tensor the float enters as


class _Fused(NamedTuple):
    op: object        # addcmul's overload taking the same operands
    negated: bool     # sub: x - alpha * y is x + y * (-alpha), negation exact
    per_tensor: bool  # a _foreach_ op: alpha once per tensor of the list


# Ops whose `alpha` scales their second operand (add(x, y, alpha) == x + alpha * y). CPU's kernels
# compute x + alpha * y as one fused multiply-add, and so does addcmul(x, y, alpha) with alpha a
# 0-dim tensor: bitwise equal in float32 and float64 (a product, then a sum, rounds twice: an ulp
# off in a tenth of the elements, compounding in an optimizer whose learning rate is scheduled).
_SCALED_BY_ALPHA = {
    "add": _Fused(aten.addcmul.default, False, False), "add_": _Fused(aten.addcmul_.default, False, False),
    "sub": _Fused(aten.addcmul.default, True, False), "sub_": _Fused(aten.addcmul_.default, True, False),
    "_foreach_add": _Fused(aten._foreach_addcmul.Scalar, False, True),
    "_foreach_add_": _Fused(aten._foreach_addcmul_.Scalar, False, True),
    "_foreach_sub": _Fused(aten._foreach_addcmul.Scalar, True, True),
    "_foreach_sub_": _Fused(aten._foreach_addcmul_.Scalar, True, True),
}
# Ops whose `value` scales their first factor: CPU's kernels compute self + value * t1 * t2 (addcmul)
# and self + value * t1 / t2 (addcdiv) with value * t1 first, so the op with t1 * value (value a
# 0-dim tensor of the inputs' dtype) and value 1 is bitwise the same in float32 and float64 (checked
# on 200 random cases each). Adam's and NAdam's per-parameter loops give a new value every step
# (`param.addcdiv_(exp_avg, denom, value=-step_size)`), the loop NAdam runs on neuron as on CPU.
_SCALED_FIRST = frozenset({"addcmul", "addcmul_", "addcdiv", "addcdiv_"})
_TWINS = {"Scalar": "Tensor", "Tensor_Scalar": "Tensor_Tensor"}
# Scalar overloads with no Tensor twin whose List overload takes a tensor per element instead (Adam's
# `_foreach_lerp_(exp_avgs, grads, 1 - beta1)`, whose beta1 a OneCycleLR schedule changes every
# step; an EMA update). Bitwise equal to the Scalar kernel in float32 and float64 only: in 16 bits
# CPU's two kernels round the weight differently, so there the weight stays a constant.
_LIST_TWINS = {aten._foreach_lerp_.Scalar: aten._foreach_lerp_.List, aten._foreach_lerp.Scalar: aten._foreach_lerp.List}


def lifts_of(func, args, kwargs, inputs) -> tuple[Lift, ...] | None:
    """How each float argument of the op enters a region as a tensor; None where one cannot."""
    if func is aten.full.default and len(args) > 1 and type(args[1]) is float:
        # a tensor made every step filled with a number that changes (a diffusion sampler's noise
        # level): `fill` converts a 0-dim tensor's double to the dtype as `full` converts its number
        return (Lift(1, How.FILL, torch.float64),)
    dtype = _scalar_dtype(inputs)
    if dtype is None:
        return None
    schema_args = func._schema.arguments
    by_name = {a.name: a for a in schema_args}
    found = [(i, schema_args[i]) for i, v in enumerate(args) if type(v) is float and i < len(schema_args)]
    found += [(k, by_name.get(k)) for k, v in kwargs.items() if type(v) is float]
    if not found:
        return None
    if func in ROUNDED_TO_THE_TENSORS and dtype is torch.float64:
        dtype = _sixteen_bit(inputs) or dtype
    twin = twin_of(func)
    lifts = []
    for position, argument in found:
        how = _how(func, argument, twin)
        if how is None or how in (How.SCALE_OTHER, How.LIST_OVERLOAD, How.SCALE_FIRST) and not _wide(inputs):
            return None
        lifts.append(Lift(position, how, dtype))
    return tuple(lifts)


def _scalar_dtype(inputs) -> torch.dtype | None:
    """The dtype of a tensor that computes as a number does among these inputs, or None. CPU kernels
    convert a number to the inputs' compute type: float32 for float32 (and 16-bit) inputs, float64
    for float64, so a float32 or float64 0-dim tensor of that dtype computes alike; it leaves the
    result's dtype alone too. For 16-bit inputs the number must stay wider than the inputs: a
    float64 0-dim tensor, which a dimensioned 16-bit tensor outranks in type promotion (a 0-dim
    one would not). Integer inputs: a number makes their result float32, a tensor would not."""
    dtypes = {t.dtype for t in inputs if isinstance(t, torch.Tensor)}
    if len(dtypes) != 1 or not all(isinstance(t, torch.Tensor) for t in inputs):
        return None
    dtype = next(iter(dtypes))
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in (torch.bfloat16, torch.float16) and all(t.dim() > 0 for t in inputs):
        return torch.float64
    return None


# In-place ops whose CPU kernel rounds the number to a 16-bit tensor's dtype before multiplying
# (`_foreach_mul_(bf16 list, 0.9)` multiplies by bfloat16(0.9); `mul` and the functional
# `_foreach_mul` multiply by 0.9 in float32): lifted for 16-bit tensors as a 0-dim tensor of their
# dtype, which holds the number rounded alike and multiplies as the kernel does.
ROUNDED_TO_THE_TENSORS = frozenset({aten._foreach_mul_.Scalar, aten._foreach_mul_.ScalarList})
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


# Scalar overloads whose CPU kernel special-cases values that their Tensor twin computes the general
# way: pow by a number is x * x at 2, sqrt at 0.5, a reciprocal at -1 (ATen's pow_tensor_scalar),
# pow by a 0-dim tensor std::pow throughout, an ulp apart. Their floats stay constants.
_SPECIAL_CASED = frozenset({aten.pow.Tensor_Scalar, aten.pow_.Scalar})


def _sixteen_bit(inputs) -> torch.dtype | None:
    dtypes = {t.dtype for t in inputs if isinstance(t, torch.Tensor)}
    return next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= set(_SIXTEEN_BIT) else None


def _wide(inputs) -> bool:
    """Whether alpha may enter as a tensor: in bfloat16 or float16, addcmul rounds a 0-dim alpha
    to the inputs' dtype where CPU's add keeps it in float32, so those keep alpha constant."""
    return all(t.dtype in (torch.float32, torch.float64) for t in inputs)


def _how(func, argument, twin) -> How | None:
    if argument is None:
        return None
    if isinstance(argument.type, torch.TensorType):
        return How.TENSOR_ARG
    fused = _SCALED_BY_ALPHA.get(func._overloadpacket.__name__)
    if argument.name == "alpha" and fused is not None:
        # addcmul takes tensors: add.Tensor's other, _foreach_add.List's others (not add.Scalar's number)
        other = func._schema.arguments[1].type
        if fused.per_tensor:
            return How.SCALE_OTHER if isinstance(other, torch.ListType) and \
                isinstance(other.getElementType(), torch.TensorType) else None
        return How.SCALE_OTHER if isinstance(other, torch.TensorType) else None
    if argument.name == "value" and func._overloadpacket.__name__ in _SCALED_FIRST:
        return How.SCALE_FIRST
    index = func._schema.arguments.index(argument)
    if func in _SPECIAL_CASED:
        return None
    if twin is not None and isinstance(twin._schema.arguments[index].type, torch.TensorType):
        return How.TENSOR_OVERLOAD
    if func in _LIST_TWINS and argument.name == "weight":
        return How.LIST_OVERLOAD
    return None


def twin_of(func):
    """add.Scalar -> add.Tensor, pow.Tensor_Scalar -> pow.Tensor_Tensor, _foreach_mul_.Scalar ->
    _foreach_mul_.Tensor: the overload taking the same arguments, a Tensor where this one takes a
    Scalar."""
    name = _TWINS.get(func._overloadname)
    twin = getattr(func._overloadpacket, name, None) if name else None
    if twin is None or len(twin._schema.arguments) != len(func._schema.arguments):
        return None
    for mine, theirs in zip(func._schema.arguments, twin._schema.arguments):
        if mine.name != theirs.name and not isinstance(theirs.type, torch.TensorType):
            return None
    return twin


def lifted_call(graph, func, args: list, kwargs: dict, lifts: tuple[Lift, ...], scalars: list):
    """Add the op to an FX graph with its lifted floats taken from `scalars` (placeholders, one
    per lift, in order)."""
    for lift, scalar in zip(lifts, scalars):
        if lift.how is How.SCALE_OTHER:  # alpha: the last argument, so the last lift
            _pop(args, kwargs, lift.position)
            fused = _SCALED_BY_ALPHA[func._overloadpacket.__name__]
            alpha = graph.call_function(aten.neg.default, (scalar,)) if fused.negated else scalar
            return graph.call_function(fused.op, (args[0], args[1], [alpha] * len(args[1]) if fused.per_tensor
                                                  else alpha), kwargs)
        if lift.how is How.SCALE_FIRST:  # value: the only float of these ops
            _pop(args, kwargs, lift.position)
            args[1] = graph.call_function(aten.mul.Tensor, (args[1], scalar))
            return graph.call_function(func, tuple(args), kwargs)
        if lift.how is How.FILL:  # full's only float
            zeros = graph.call_function(func, (args[0], 0.0), kwargs)  # 0.0: the dtype a float fill infers
            return graph.call_function(aten.fill.Tensor, (zeros, scalar))
        if lift.how is How.LIST_OVERLOAD:
            _put(args, kwargs, lift.position, [scalar] * len(args[0]))
        elif lift.how is How.TENSOR_OVERLOAD and _packs_scalars(func, lift.position):
            packed = graph.call_function(aten.expand.default, (scalar, [len(args[0])]))
            _put(args, kwargs, lift.position, graph.call_function(aten.clone.default, (packed,),
                                                                  {"memory_format": torch.contiguous_format}))
        else:
            _put(args, kwargs, lift.position, scalar)
    if any(lift.how is How.TENSOR_OVERLOAD for lift in lifts):
        func = twin_of(func)
    elif any(lift.how is How.LIST_OVERLOAD for lift in lifts):
        func = _LIST_TWINS[func]
    return graph.call_function(func, tuple(args), kwargs)


def _packs_scalars(func, position) -> bool:
    """Whether the Tensor twin takes the number at `position` as `scalars`, one per element of its
    lists in a contiguous 1-d tensor (`_foreach_addcdiv_.Tensor`: RMSprop's update under a
    schedule; CPU's kernel refuses a 0-dim one), not as a 0-dim tensor."""
    return isinstance(position, int) and twin_of(func)._schema.arguments[position].name == "scalars"


def tensors_of(args, kwargs, lifts: tuple[Lift, ...]) -> list[torch.Tensor]:
    """This flush's values of the lifted floats, as the region takes them."""
    return [torch.tensor(args[lift.position] if isinstance(lift.position, int) else kwargs[lift.position],
                         dtype=lift.dtype) for lift in lifts]


def _pop(args: list, kwargs: dict, position) -> None:
    if isinstance(position, int):
        args[position] = 1  # alpha given positionally: the scaled operand carries it now
    else:
        del kwargs[position]


def _put(args: list, kwargs: dict, position, value) -> None:
    if isinstance(position, int):
        args[position] = value
    else:
        kwargs[position] = value


def _list_overloads() -> dict:
    """ScalarList overload -> (the overload taking the same numbers as tensors, their form)."""
    table = {}
    for name, form in (("add", "zero-dim"), ("sub", "zero-dim"), ("mul", "zero-dim"), ("div", "zero-dim"),
                       ("addcdiv", "vector"), ("addcmul", "vector")):
        for packet in (getattr(aten, f"_foreach_{name}_"), getattr(aten, f"_foreach_{name}")):
            table[packet.ScalarList] = (packet.List if form == "zero-dim" else packet.Tensor, form)
    return table


# Optimizer ops whose list of Python floats changes every step (Adam's bias corrections): each has
# an overload taking the same numbers as CPU tensors, which PyTorch computes identically. They are
# recorded that way from the first step (not only once they change): Adam changes them every step.
SCALAR_LISTS = _list_overloads()


def lift_scalar_list(func, args, kwargs, lift):
    """The op and its arguments with a list of floats given as CPU tensors (where they are floats
    applied to floating tensors)."""
    scalars = args[-1]
    if type(scalars) not in (list, tuple) or not all(type(v) is float for v in scalars) \
            or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in args[0]):
        return func, args, kwargs  # ints keep their integer arithmetic; leave those as they are
    overload, form = lift
    if form == "zero-dim":
        rounded = func in ROUNDED_TO_THE_TENSORS
        lifted = [torch.tensor(v, dtype=t.dtype if rounded and t.dtype in _SIXTEEN_BIT else torch.float64)
                  for v, t in zip(scalars, args[0])]
    else:
        lifted = torch.tensor(scalars, dtype=torch.float64)
        lifted.tilewise_scalars = True  # a host vector the segment may take as a region input
    return overload, (*args[:-1], lifted), kwargs


# The fused optimizers' ops (`fused=True`) with a float learning rate -> their overload taking it as
# a tensor: a schedule changes it every step, and as a float it kept the op eager while it changed.
# Recorded that way from the first step, as a float64 0-dim CPU tensor (a region input): CPU's
# kernels read the tensor as a double, so they compute the same values bitwise (checked on 100
# random rates for each of the four).
FUSED_LR = {getattr(aten, name).default: getattr(aten, name).tensor_lr
            for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")}


def lr_as_tensor(func, args, kwargs):
    lr = kwargs.get("lr")
    if type(lr) is not float:
        return func, args, kwargs
    return FUSED_LR[func], args, {**kwargs, "lr": torch.tensor(lr, dtype=torch.float64)}
