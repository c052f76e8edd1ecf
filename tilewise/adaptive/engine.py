"""`tilewise.engine()`, `sync()`, `stats()`, `explain()`, `reset_caches()`: the public surface."""
from __future__ import annotations

import multiprocessing
import threading
import time

from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..config import config
from ..device.runtime import DEVICE
from ..errors import ConfigError
from .policy import Mode, Settings, compiles_in_background
from .regions import CompiledEntry
from .compiling import Compiling
from .runtime import ENGINE_EXITED, OPTIMIZER_STEP, OPTIMIZER_STEPPED, Runtime
from .stats import Stats
from .tracer import Tracer

RUNTIME = Runtime()


class engine:
    """Run the block on the adaptive engine: `with tilewise.engine(): ...`.

    mode: "eager", "adaptive" or "compiled"; default TILEWISE_MODE, else "adaptive".
    threshold: flushes a region must be seen in before it is compiled; default TILEWISE_THRESHOLD.
    Engines nest: the inner mode holds inside the inner block. Like `torch.no_grad()`, one engine
    object may be entered again, after its block or inside it. A block belongs to the thread that
    enters it: two threads in blocks of different modes each get their mode, and each its own
    statistics (`as stats`, the same object as `tilewise.stats()` in that thread). A thread with no
    block runs its `neuron` ops eagerly, whatever mode another thread's block has.
    """

    def __init__(self, mode: str | None = None, threshold: int | None = None):
        self.mode = Mode(config.validate("mode", mode) if mode is not None else config.mode)
        self.threshold = config.validate("threshold", threshold) if threshold is not None else config.threshold
        self._entered: list = []  # the tracer pushed per entry (a block may be entered again, nested)

    def __enter__(self) -> Stats:
        config.as_dict()  # a malformed setting fails here, with its allowed values, not later in a thread
        DEVICE.refresh_from_config()
        RUNTIME.flush("engine entered")
        settings = Settings(self.mode, self.threshold, config.max_segment_ops, config.background_compile == "on",
                            config.step_search_ops)
        if compiles_in_background(settings):
            start_compile_process()  # its imports take seconds: they overlap the warm-up steps
        tracer = Tracer(RUNTIME, settings)
        tracer.__enter__()
        self._entered.append(tracer)
        _OPTIMIZER_STEPS.watch()
        return RUNTIME.thread_stats()

    def __exit__(self, *exc_info) -> None:
        tracer = self._entered.pop()
        try:
            RUNTIME.flush(ENGINE_EXITED)
        finally:
            _OPTIMIZER_STEPS.unwatch()
            tracer.__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"tilewise.engine(mode={self.mode.value!r}, threshold={self.threshold})"


class _OptimizerSteps:
    """An optimizer's step is a segment of its own while an engine block is open (global optimizer
    pre- and post-hooks, registered while any block is open, in any thread). A training loop's
    units are then the forward and backward, and the optimizer's step, wherever the program reads a
    value: a read between the step and the next forward falls on a unit's edge and cuts nothing new,
    a loop that reads no value records one unit per segment, and the first step's graph (where the
    optimizer creates its state) differs from later ones only in the optimizer's unit, so the
    forward and backward compile once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.blocks = 0
        self.handles: list = []

    def watch(self) -> None:
        with self.lock:
            self.blocks += 1
            if not self.handles:
                from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
                self.handles = [register_optimizer_step_pre_hook(_before_optimizer_step),
                                register_optimizer_step_post_hook(_after_optimizer_step)]

    def unwatch(self) -> None:
        with self.lock:
            self.blocks -= 1
            if not self.blocks:
                for handle in self.handles:
                    handle.remove()
                self.handles = []


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    _flush_if_lazy(OPTIMIZER_STEP)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _flush_if_lazy(OPTIMIZER_STEPPED)


def _flush_if_lazy(reason: str) -> None:
    mode = _get_current_dispatch_mode()
    if isinstance(mode, Tracer) and mode.lazy:
        RUNTIME.flush(reason)


_OPTIMIZER_STEPS = _OptimizerSteps()


def sync() -> None:
    """Compute everything pending: a step marker for loops that read no value back."""
    RUNTIME.flush("tilewise.sync()")


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Wait until the regions compiling in the background are compiled, and the native C builds
    queued or under way are built (each is put to use at the next flush that meets it); False if
    `timeout` seconds passed first."""
    from ..compiler.native import tiers
    from ..compiler.process.background import PROCESS
    deadline = None if timeout is None else time.monotonic() + timeout
    if not PROCESS.wait_all(timeout):
        return False
    return tiers.wait_for_builds(None if deadline is None else max(0.0, deadline - time.monotonic()))


def start_compile_process() -> None:
    from ..compiler.process.background import PROCESS
    PROCESS.start()


def prepare_background_compiles() -> None:
    """At import: with background compiles on for adaptive mode, the compile process gets ready
    while the program sets up. Not in a daemonic process (a DataLoader worker), which runs no
    engine block; a block starts the process wherever it is needed."""
    if config.background_compile == "on" and config.mode == "adaptive" and not multiprocessing.current_process().daemon:
        start_compile_process()


def stats() -> Stats:
    """The calling thread's statistics: what the engine did for this thread's engine blocks, since
    the thread's first block or the object's `reset()` (`with tilewise.engine() as stats:` gives
    the same object). A segment counts where it was recorded, whichever thread's op flushed it. A
    thread that never opened a block gets an object of its own that counts nothing: its ops run
    eagerly, unseen by the engine. The device's figures (simulated seconds, kernels, HBM bytes)
    and the engine caches are the process's."""
    return RUNTIME.thread_stats()


def explain(region: str | None = None, passes: bool = False) -> str:
    """What the compiler made of the compiled regions in the cache (or of the one named, e.g.
    "region2" from `stats().report()`): the decomposed graph annotated with fusion groups, the tile
    kernels, the launches with what stays in SBUF, their cost, and every refused fusion with its
    reason. `passes=True` shows the region after every pass instead of after the last."""
    # one compile may serve several keys (a region at other input offsets): each entry once
    entries = list(dict.fromkeys(e for e in list(RUNTIME.memory.regions.values()) if isinstance(e, CompiledEntry)))
    if region is not None:
        chosen = [e for e in entries if e.name == region]
        if not chosen:
            names = ", ".join(e.name for e in entries) or "none"
            compiling = sum(1 for e in list(RUNTIME.memory.regions.values()) if isinstance(e, Compiling)) + \
                sum(1 for site in list(RUNTIME.memory.generic_sites.values()) if site.compiling is not None)
            also = f" ({compiling} compiling in the background: tilewise.wait_for_compiles())" if compiling else ""
            raise ConfigError(f"no compiled region named {region!r}; the cache holds: {names}{also}")
        entries = chosen
    return "\n\n".join(f"# {e.name}: {e.ops} ops, {e.runs} runs, {e.kernels} launches per run\n"
                       + (str(e.compiled) if passes else _final_text(e.compiled)) for e in entries)


def _final_text(compiled) -> str:
    """The region after its last pass, and its kernels' C (printed by the pass that made it)."""
    native = getattr(compiled, "native", None)
    return compiled.passes_text[-1] + (f"\n\n{native}" if native is not None else "")


def reset_caches() -> None:
    """Forget compiled regions, plans and fingerprints (the next runs warm up from scratch)."""
    RUNTIME.reset_caches()
