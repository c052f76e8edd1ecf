"""What the differential fuzzer puts into the engine besides plain runs: lazily made buffers that
start poisoned (NaN or a sentinel), so a value read before anything wrote it cannot pass for zeros,
and a KeyboardInterrupt raised at a chosen step of a flush. Both patch engine modules from outside,
only inside their `with` blocks. `fuzzing.check()` applies them (`Features.poison`,
`Features.interrupts`) and judges what the engine then computes (`fuzzing.check_interrupted`); they
need nothing of the fuzzer's programs or checks, so this module imports none of them and the checker
imports it.
"""
from __future__ import annotations

import torch


# -- garbage made visible --------------------------------------------------------------------------
def _poison(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else -123_456_789


class _PoisonedTorch:
    """`torch` as the lazy segment sees it, except that `empty_strided` (the buffer every recorded
    op's result gets at record time, filled at the flush) comes back poisoned."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_strided(*args, **kwargs):
        buffer = torch.empty_strided(*args, **kwargs)
        return buffer.fill_(_poison(buffer.dtype))


class poisoned_buffers:
    """Context manager: with `on`, lazily made buffers start poisoned (see _PoisonedTorch)."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        from tilewise.adaptive import segment
        self.module, self.saved = segment, segment.torch
        if self.on:
            segment.torch = _PoisonedTorch()
        return self

    def __exit__(self, *exc):
        self.module.torch = self.saved


# -- interrupts ------------------------------------------------------------------------------------
class Interrupter:
    """Counts the engine's steps at a flush (a recorded node replayed, a compiled region run) and,
    when armed, raises KeyboardInterrupt before step `at` runs or just after it. "Just after" is
    between that step and the next: a Ctrl-C is only delivered between a flush's steps
    (adaptive/interrupts.py), never after a step's work and before its return, so it fires as the
    next step starts. Wraps regions.replay and CompiledEntry.run from outside."""

    def __init__(self):
        self.steps, self.at, self.before, self.fired = 0, None, True, False

    def arm(self, at: int | None, before: bool = True) -> None:
        self.steps, self.at, self.before, self.fired = 0, at, before, False

    def _step(self, original, *args):
        step = self.steps
        self.steps += 1
        if self.at is not None and step == (self.at if self.before else self.at + 1):
            self._fire()
        return original(*args)

    def _fire(self):
        self.fired = True
        raise KeyboardInterrupt(f"fuzz: interrupted at engine step {self.at}")

    def __enter__(self):
        from tilewise.adaptive import regions
        self.saved = regions.replay, regions.CompiledEntry.run
        replay, run = self.saved
        regions.replay = lambda node: self._step(replay, node)
        regions.CompiledEntry.run = lambda entry, segment, region: self._step(run, entry, segment, region)
        return self

    def __exit__(self, *exc):
        from tilewise.adaptive import regions
        regions.replay, regions.CompiledEntry.run = self.saved
