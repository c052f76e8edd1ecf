"""Run one sweep program on the CPU (the reference) and on `neuron` in one engine mode; compare.

`python tests/sweep/harness.py PROGRAM MODE` prints one JSON line (a `Verdict`); run_all.py runs every
program x mode in a child process of its own, so a crash or a hang is one ERROR row, not the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: tests/, where `sweep` is
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("eager", "adaptive", "compiled")


@dataclass
class Outcome:
    """What a program computed, everything on the CPU: per-step losses, final tensors (parameters,
    optimizer state, validation outputs) and exact values (token ids, counts), all held to the CPU
    run's; and `checks`, what must hold of the run under test alone (interrupts really delivered:
    how many land in the CPU run is a matter of its speed, not of correctness)."""
    losses: list[float]
    tensors: dict[str, torch.Tensor]
    exact: dict[str, object] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Tolerance:
    rtol: float = 1e-4
    atol: float = 1e-5


class Status(enum.Enum):
    OK = "OK"
    MISMATCH = "MISMATCH"
    ERROR = "ERROR"


@dataclass
class Counts:
    """Engine statistics between two points of the run."""
    ops_compiled: int = 0
    ops_eager: int = 0
    compiles: int = 0

    @classmethod
    def now(cls) -> "Counts":
        import tilewise
        s = tilewise.stats()
        return cls(s.ops_compiled, s.ops_eager, s.compiles)

    def since(self, start: "Counts") -> "Counts":
        return Counts(self.ops_compiled - start.ops_compiled, self.ops_eager - start.ops_eager,
                      self.compiles - start.compiles)

    @property
    def fraction(self) -> float:
        ran = self.ops_compiled + self.ops_eager
        return self.ops_compiled / ran if ran else 0.0


class Probe:
    """Handed to a program: `warm()` marks the end of its warm-up steps (stats are split there)."""

    def __init__(self):
        self.start = None
        self.warm_point = None

    def begin(self) -> None:
        self.start = Counts.now()

    def warm(self) -> None:
        if self.start is not None and self.warm_point is None:
            self.warm_point = Counts.now()


@dataclass
class Verdict:
    program: str
    mode: str
    status: Status
    detail: str = ""
    max_abs_diff: float = 0.0
    total: Counts = field(default_factory=Counts)
    after_warmup: Counts = field(default_factory=Counts)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return json.dumps(d)


def compare(got: Outcome, want: Outcome, tol: Tolerance) -> tuple[float, list[str]]:
    """Largest absolute difference and every disagreement (dtype, shape, value, exact value)."""
    problems, worst = [], 0.0
    pairs = [(f"loss[{i}]", torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64)) for i, (g, w) in enumerate(zip(got.losses, want.losses))]
    if len(got.losses) != len(want.losses):
        problems.append(f"{len(got.losses)} losses, CPU has {len(want.losses)}")
    if got.tensors.keys() != want.tensors.keys():
        problems.append(f"tensor names differ: {sorted(got.tensors.keys() ^ want.tensors.keys())[:5]}")
    pairs += [(k, got.tensors[k], want.tensors[k]) for k in want.tensors if k in got.tensors]
    for name, g, w in pairs:
        if g.device.type != "cpu":
            problems.append(f"{name}: outcome left on {g.device}")
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"{name}: {g.dtype}{list(g.shape)} vs CPU {w.dtype}{list(w.shape)}")
            continue
        if g.is_floating_point():
            diff = (g.double() - w.double()).abs().nan_to_num(nan=float("inf"))
            worst = max(worst, diff.max().item() if diff.numel() else 0.0)
            if not torch.allclose(g.double(), w.double(), rtol=tol.rtol, atol=tol.atol, equal_nan=True):
                problems.append(f"{name}: max abs diff {diff.max().item():.3g}")
        elif not torch.equal(g, w):
            problems.append(f"{name}: {g.flatten()[:8].tolist()} vs CPU {w.flatten()[:8].tolist()}")
    for key, value in want.exact.items():
        if got.exact.get(key) != value:
            problems.append(f"{key}: {got.exact.get(key)!r} vs CPU {value!r}")
    problems += [f"not so: {check}" for check, holds in got.checks.items() if not holds]
    return worst, problems


def judge(name: str, mode: str) -> Verdict:
    import tilewise
    module = importlib.import_module(f"sweep.{name}")
    run: Callable[[str, Probe], Outcome] = module.run
    tol: Tolerance = getattr(module, "TOLERANCE", Tolerance())
    want = run("cpu", Probe())
    probe = Probe()
    try:
        with tilewise.engine(mode=mode):
            probe.begin()
            got = run("neuron", probe)
    except BaseException as error:  # noqa: BLE001 - the row reports whatever the program raised
        first = traceback.format_exception_only(type(error), error)[-1].strip()
        return Verdict(name, mode, Status.ERROR, first[:300] + "\n" + traceback.format_exc()[-1500:])
    total = Counts.now().since(probe.start)
    after = Counts.now().since(probe.warm_point or probe.start)
    worst, problems = compare(got, want, tol)
    status = Status.MISMATCH if problems else Status.OK
    if mode == "eager" and total.compiles:
        status, problems = Status.MISMATCH, problems + [f"eager mode compiled {total.compiles} regions"]
    return Verdict(name, mode, status, "; ".join(problems[:6]), worst, total, after)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--report", action="store_true", help="also print tilewise.stats().report()")
    args = parser.parse_args()
    verdict = judge(args.program, args.mode)
    if args.report:
        import tilewise
        print(tilewise.stats().report(), file=sys.stderr)
    print(verdict.to_json(), flush=True)


if __name__ == "__main__":
    main()
