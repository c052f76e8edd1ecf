"""7. Ctrl-C at a random point: a timer signal raises KeyboardInterrupt wherever the loop happens to
be (recording an op, flushing, compiling, in the user's own code). Every statement also runs on a
CPU mirror, disarmed; after each interrupt every tensor the program holds must read as the mirror's,
and the loop goes on. The CPU reference run does the same, so the outcome compared is the list of
disagreements (none); that interrupts were really delivered is checked of the run under test."""
import random
import signal
from dataclasses import dataclass
from typing import Callable

import torch

from sweep.harness import Outcome

ROUNDS, MIN_INTERRUPTS, WARMUP = 150, 20, 10


@dataclass(frozen=True)
class Statement:
    """One line of the loop: either `state[key] = make(state)` or in-place ops on `state[key]`."""
    key: str
    make: Callable[[dict], torch.Tensor]
    in_place: bool = False


LOOP = [
    Statement("h", lambda s: s["x"] @ s["w"]),
    Statement("h", lambda s: torch.relu(s["h"]) + s["b"]),
    Statement("w", lambda s: s["w"].add_(0.01 * (s["x"].t() @ s["h"])), in_place=True),
    Statement("w", lambda s: s["w"].div_(s["w"].norm() + 1.0), in_place=True),
    Statement("w", lambda s: s["w"][1].mul_(0.5), in_place=True),  # through a view
    Statement("ema", lambda s: s["ema"].mul_(0.9), in_place=True),
    Statement("ema", lambda s: s["ema"].add_(0.1 * s["w"]), in_place=True),
    Statement("x", lambda s: torch.tanh(s["x"] + s["h"][:, :6].mean(1, keepdim=True))),
    Statement("c", lambda s: torch.cat([s["x"], s["h"]], 1).softmax(1)),
    Statement("total", lambda s: s["c"].sum() + s["ema"].abs().sum()),
]


def initial(device):
    g = torch.Generator().manual_seed(7)
    values = {"x": torch.randn(5, 6, generator=g), "w": torch.randn(6, 6, generator=g) / 3,
              "b": torch.randn(6, generator=g), "ema": torch.zeros(6, 6),
              "h": torch.zeros(5, 6), "c": torch.zeros(5, 12), "total": torch.zeros(())}
    return {k: v.to(device) for k, v in values.items()}


class Alarm:
    """SIGALRM every 0.2-3 ms. `as_sigint`: it sends SIGINT, whose handler raises KeyboardInterrupt
    (Ctrl-C exactly; the engine defers SIGINT during a flush); else the SIGALRM handler raises
    KeyboardInterrupt itself (any handler that raises). Only while armed; raising disarms."""

    def __init__(self, rng, as_sigint: bool):
        self.rng, self.as_sigint, self.armed, self.delivered, self.stopped = rng, as_sigint, False, 0, False
        self.previous = (signal.signal(signal.SIGALRM, self._tick), signal.signal(signal.SIGINT, self._interrupt))

    def _tick(self, signum, frame):
        if self.stopped:  # a tick pending as stop() ran must not start the timer again
            return
        signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(2e-4, 3e-3))
        if self.as_sigint:
            if self.armed:
                signal.raise_signal(signal.SIGINT)
        else:
            self._interrupt(signum, frame)

    def _interrupt(self, signum, frame):
        if self.armed:
            self.armed = False
            self.delivered += 1
            raise KeyboardInterrupt

    def start(self):
        signal.setitimer(signal.ITIMER_REAL, 1e-3)

    def stop(self):
        self.stopped = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous[0])
        signal.signal(signal.SIGINT, self.previous[1])


def disagreements(state, mirror, where):
    found = []
    for key, want in mirror.items():
        got = state[key].cpu()
        if got.dtype != want.dtype or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            found.append(f"{where}: {key} max diff {(got - want).abs().max().item():.3g}")
    return found


def settle(statement, state, mirror, where):
    """After an interrupt in `statement`: the program's tensors must read as the CPU's either before
    or after the whole statement (an op is not half done, nothing else is touched). Returns the
    mirror that matched (the statement applied to it or not) and the disagreements."""
    after = {k: v.clone() for k, v in mirror.items()}
    result = statement.make(after)
    if not statement.in_place:
        after[statement.key] = result
    if not disagreements(state, after, where):
        return after, []
    found = disagreements(state, mirror, where)
    return mirror, [f"{line} (before the statement; after it: {disagreements(state, after, where)[:2]})" for line in found]


def attempt(statement, state, alarm) -> bool:
    """Run one statement armed; True if it was interrupted."""
    try:
        alarm.armed = True
        result = statement.make(state)
        if not statement.in_place:
            state[statement.key] = result
        alarm.armed = False
        return False
    except KeyboardInterrupt:
        alarm.armed = False
        return True


def run(device, probe, as_sigint: bool = True):
    import tilewise
    state, mirror = initial(device), initial("cpu")
    alarm = Alarm(random.Random(8), as_sigint)
    found = []
    alarm.start()
    try:
        for round_ in range(ROUNDS):
            if round_ == WARMUP:
                probe.warm()
            for index, statement in enumerate(LOOP):
                if attempt(statement, state, alarm):
                    mirror, wrong = settle(statement, state, mirror, f"round {round_} statement {index}")
                    found += wrong
                else:
                    result = statement.make(mirror)
                    if not statement.in_place:
                        mirror[statement.key] = result
            if device != "cpu":
                alarm.armed = True
                try:
                    tilewise.sync()  # a step boundary, so the segment repeats (and gets interrupted too)
                    alarm.armed = False
                except KeyboardInterrupt:
                    found += disagreements(state, mirror, f"round {round_} sync")
    finally:
        alarm.stop()
    found += disagreements(state, mirror, "end")
    return Outcome([], {}, {"disagreements": found[:5]},
                   checks={f"at least {MIN_INTERRUPTS} interrupts delivered": alarm.delivered >= MIN_INTERRUPTS})
