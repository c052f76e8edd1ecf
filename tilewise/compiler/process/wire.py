"""A size's tile programs as they cross between this process and the compile process (JSON):
what worker.py sends and remote.py receives, below both, so neither imports the other."""
from __future__ import annotations

import torch

from ...errors import CompileError
from ...reasons import Reason, Why
from ..cache.regions import cost_from_json
from ..generic.parametric import Made
from ..cache.serialize import launch_from_json, launch_to_json
from ..generic.symbolic import Specialisation


def made_to_json(made: Specialisation, launches: bool = True) -> dict:
    """A size's tile programs as JSON; `launches=False`: only what the cost model charges and the
    output layouts (a new size's reply: the launches of a step region are ~1 MB of JSON, 15-20 ms
    each way, and only explain() prints them)."""
    return {"launches": [launch_to_json(launch) for launch in made.launches] if launches else [],
            "cost": list(made.cost),
            "outputs": [[list(shape), list(stride), str(dtype)[6:]] for shape, stride, dtype in made.outputs],
            "seconds": made.seconds, "made": made.made.value,
            "why": None if made.why is None else [made.why.why.value, made.why.detail]}


def made_from_json(data: dict) -> Specialisation:
    why = data["why"]
    return Specialisation(
        tuple(launch_from_json(launch, None) for launch in data["launches"]), tuple(cost_from_json(c) for c in data["cost"]),
        tuple((tuple(shape), tuple(stride), _dtype(dtype)) for shape, stride, dtype in data["outputs"]),
        float(data["seconds"]), Made(data["made"]), None if why is None else Reason(Why(why[0]), str(why[1])))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CompileError(f"not a dtype: {name!r}")
    return dtype
