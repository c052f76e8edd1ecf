"""Why: every fallback of the engine and every refusal of the compiler carries one typed reason."""
from __future__ import annotations

import enum
from typing import NamedTuple


class Why(enum.Enum):
    """Why something ran eagerly (the engine), or why a fusion was refused or an op left opaque
    (the compiler). Transfers are no fallback: moving data is what they are for."""
    WARMING_UP = "warming up"
    DYNAMIC = "dynamic: its input shapes or constants change"
    NOT_RECURRED = "waiting: the region has not recurred yet"
    DATA_DEPENDENT_SHAPE = "data-dependent output shape"
    RANDOM = "random op reads pending data"
    UNRECORDABLE = "cannot be deferred"
    MIXED_DTYPE_VIEWS = "writes a storage its inputs view in different dtypes"
    RECOMPILE_LIMIT = "recompile limit"
    GENERALISE_LIMIT = "generalise limit"  # a region site's sizes changed past its generic compiles
    ZERO_ONE_SIZE = "a size that changes is 0 or 1 here (PyTorch specialises those)"
    GENERIC_LAYOUT = "the generic region's output layout differs from eager's"
    COMPILE_FAILED = "compile failed"
    READS_DEVICE_DATA = "reads device data on the host"
    COPY_TO_HOST = "copy to host"
    HOST_TENSOR = "host tensor argument"
    BETWEEN_CORES = "tensors on two NeuronCores"
    NO_EFFECT = "nothing to do on a device that runs each op as it is issued"  # neither recorded nor run
    KERNEL_DOES_NOT_APPLY = "the hand-written kernel does not apply"  # an op a tile kernel takes over elsewhere
    # the compiler's refusals
    FUSION_KINDS = "kind"        # two kernel kinds that do not fuse (matmul with matmul)
    CYCLE = "cycle"              # the fusion would make the kernel graph cyclic
    DOMAIN = "domain"            # the ops tile over different iteration domains
    BROADCAST = "broadcast"
    PROLOGUE = "prologue"
    REDUCTION = "reduction"
    VIEW = "view"
    SBUF = "sbuf"                # does not fit in SBUF
    OPAQUE = "opaque"            # no tile lowering: runs as its own kernel
    NOT_PARAMETRIC = "no parametric tile program"  # a generic region's sizes made per size instead

    @property
    def is_transfer(self) -> bool:
        return self in _TRANSFERS


_TRANSFERS = frozenset({Why.READS_DEVICE_DATA, Why.COPY_TO_HOST, Why.HOST_TENSOR, Why.BETWEEN_CORES})


class Reason(NamedTuple):
    """A typed reason: `why` is stable for counting, `detail` says which value or op."""
    why: Why
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.why.value}: {self.detail}" if self.detail else self.why.value
