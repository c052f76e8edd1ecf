"""A flush is a transaction: whatever stops it, no value a program holds exposes unwritten memory.

Each test injects an exception at one step of a flush (an eager node's replay, or a compiled
region's run) and then reads every tensor the program holds: each equals what CPU computes.
"""
import dis
import signal
import sys
import threading

import pytest
import torch

import tilewise
from tilewise.adaptive import regions as regions_module
from tilewise.adaptive.engine import RUNTIME
from tilewise.adaptive.runtime import Runtime
from tilewise.adaptive.steps import StepRunner
from tilewise.adaptive.segment import Segment
from tilewise.device.hbm import HBM
from tilewise.device.timeline import Timeline
from tilewise.adaptive.regions import CompiledEntry


def _program(x):
    a = x * 2
    b = a + 1
    c = b * 3
    d = c.exp()
    return [a, b, c, d]


class _Injected(BaseException):
    """Stands for KeyboardInterrupt without tripping pytest's own handling of it."""


def _inject_at(monkeypatch, target, name, call_number, error):
    original = getattr(target, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call_number:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    return calls


@pytest.mark.parametrize("error", [KeyboardInterrupt(), _Injected(), SystemExit(3)],
                         ids=["KeyboardInterrupt", "BaseException", "SystemExit"])
@pytest.mark.parametrize("at", range(1, 5))
def test_an_interrupt_at_any_node_of_an_eager_flush_leaves_the_rest_pending_not_garbage(monkeypatch, at, error):
    x_cpu = torch.randn(5)
    expected = _program(x_cpu)
    with tilewise.engine(mode="adaptive"):
        held = _program(x_cpu.to("neuron"))
        calls = _inject_at(monkeypatch, regions_module, "replay", at, error)
        with pytest.raises(type(error)):
            held[-1].sum().item()
        monkeypatch.undo()
        assert calls[0] == at
        values = [t.cpu() for t in held]
    for value, want in zip(values, expected):
        torch.testing.assert_close(value, want)


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_an_interrupt_before_a_compiled_region_runs_keeps_its_work_pending(monkeypatch, mode):
    x_cpu = torch.randn(5)
    expected = _program(x_cpu)
    with tilewise.engine(mode=mode, threshold=1):
        x = x_cpu.to("neuron")
        for _ in range(2):  # compile the region, then hit it
            [t.cpu() for t in _program(x)]
        held = _program(x)
        _inject_at(monkeypatch, CompiledEntry, "run", 1, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            held[0].cpu()
        monkeypatch.undo()
        values = [t.cpu() for t in held]
    assert tilewise.stats().compiles >= 1 and tilewise.stats().ops_compiled > 0
    for value, want in zip(values, expected):
        torch.testing.assert_close(value, want)


def test_an_op_that_fails_at_flush_raises_and_every_other_value_is_computed():
    weights = torch.randn(4, 3)
    with tilewise.engine(mode="adaptive"):
        w = weights.to("neuron")
        before = w * 2
        bad = torch.nn.functional.embedding(torch.tensor([7]).to("neuron"), w)  # index out of range
        after = w + 1
        with pytest.raises(IndexError):
            bad.cpu()
        torch.testing.assert_close(before.cpu(), weights * 2)
        torch.testing.assert_close(after.cpu(), weights + 1)
        assert torch.isnan(bad.cpu()).all()  # filled, never unwritten memory
        torch.testing.assert_close((w * 3).cpu(), weights * 3)  # the engine goes on


def test_ctrl_c_during_a_flush_arrives_after_it_with_every_value_computed():
    import os
    import signal

    x_cpu = torch.randn(5)
    expected = _program(x_cpu)
    original = regions_module.replay
    sent = []

    def replay_and_signal(node):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in the middle of the flush
        return original(node)

    with tilewise.engine(mode="eager"):
        pass
    with tilewise.engine(mode="adaptive"):
        held = _program(x_cpu.to("neuron"))
        regions_module.replay = replay_and_signal
        try:
            with pytest.raises(KeyboardInterrupt):
                held[-1].sum().item()
        finally:
            regions_module.replay = original
        values = [t.cpu() for t in held]
    assert sent
    for value, want in zip(values, expected):
        torch.testing.assert_close(value, want)


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_data_assignment_of_a_lazy_value_is_computed_when_the_region_compiles(mode):
    t = torch.ones(3).to("neuron")
    with tilewise.engine(mode=mode):
        for step in range(6):
            t.data = t * 2
            tilewise.sync()
            torch.testing.assert_close(t.cpu(), torch.full((3,), 2.0 ** (step + 1)))
    assert tilewise.stats().compiles >= 1 and tilewise.stats().ops_compiled >= 3


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_manual_sgd_through_data_equals_cpu(mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    device_model = torch.nn.Linear(4, 2).to("neuron")
    device_model.load_state_dict({k: v.to("neuron") for k, v in model.state_dict().items()})
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    losses = []
    for m, dev in ((model, "cpu"), (device_model, "neuron")):
        run = []
        with tilewise.engine(mode=mode):
            for _ in range(6):
                loss = torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev))
                loss.backward()
                for p in m.parameters():
                    p.data = p.data - 0.1 * p.grad
                    p.grad = None
                tilewise.sync()
                run.append(loss.item())
        losses.append(run)
    torch.testing.assert_close(losses[1], losses[0])
    assert tilewise.stats().compiles >= 1


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_swap_tensors_with_a_lazy_value_keeps_it(mode):
    with tilewise.engine(mode=mode, threshold=1):
        for _ in range(3):
            a = torch.zeros(3).to("neuron")
            b = torch.ones(3).to("neuron") * 5
            torch.utils.swap_tensors(a, b)
            del b
            tilewise.sync()
            torch.testing.assert_close(a.cpu(), torch.full((3,), 5.0))


def test_a_changing_float_keeps_every_engine_cache_bounded():
    with tilewise.config.patch(signature_cache_size=64):
        tilewise.reset_caches()
        x = torch.randn(4).to("neuron")
        with tilewise.engine(mode="adaptive"):
            for step in range(300):
                (x * (1.0 + step * 1e-4)).sum().item()
        sizes = tilewise.stats().to_dict()["caches"]
    assert all(size["entries"] <= size["limit"] for size in sizes.values()), sizes
    # nothing grows by step: output metadata does not depend on the float's value, and the plan
    # serves every value without analysing the segment again
    assert all(size["entries"] <= 16 for size in sizes.values()), sizes


def test_bounded_caches_forget_the_least_recently_used():
    from tilewise.adaptive.caches import BoundedCache

    limit = [3]
    cache = BoundedCache(lambda: limit[0])
    for key in "abcd":
        cache.put(key, key.upper())
    cache.touch("b")
    cache.put("e", "E")
    assert list(cache) == ["d", "b", "e"] and cache.size() == (3, 3, 2)
    assert cache.count("n") == 1 and cache.count("n") == 2


def test_the_engine_memory_reports_and_forgets_every_cache_it_holds():
    from tilewise.adaptive.caches import BoundedCache
    from tilewise.adaptive.memory import EngineMemory

    memory = EngineMemory()
    caches = {name: value for name, value in vars(memory).items() if isinstance(value, BoundedCache)}
    assert list(memory.cache_info()) == list(caches) and len(caches) == 15
    with tilewise.config.patch(signature_cache_size=1, region_cache_size=1):
        for cache in caches.values():
            cache.put("a", 1)
            cache.put("b", 2)  # evicts "a"
        assert all(info == (1, 1, 1) for info in memory.cache_info().values()), memory.cache_info()
    memory.reset()
    assert all(getattr(memory, name) is not cache and not getattr(memory, name) for name, cache in caches.items())
    assert all(info.entries == 0 and info.evictions == 0 for info in memory.cache_info().values())
    x = torch.randn(4).to("neuron")
    with tilewise.engine(mode="adaptive", threshold=1):
        for _ in range(3):
            (x * 2).sum().item()
    assert tilewise.stats().to_dict()["caches"] == {
        name: info._asdict() for name, info in RUNTIME.memory.cache_info().items()}
    assert RUNTIME.memory.cache_info()["regions"].entries >= 1


def test_an_engine_object_can_be_entered_again_and_nested():
    block = tilewise.engine(mode="adaptive", threshold=1)
    x_cpu = torch.randn(4)
    for _ in range(2):
        with block:
            torch.testing.assert_close((x_cpu.to("neuron") * 2).cpu(), x_cpu * 2)
    with block:
        with block:
            y = x_cpu.to("neuron") + 1
        torch.testing.assert_close(y.cpu(), x_cpu + 1)
    assert "adaptive" in repr(block)


def test_ctrl_c_during_the_first_compile_leaves_later_compiles_working(monkeypatch):
    import os
    import signal

    from tilewise import compiler

    original = compiler.compile_graph

    def compile_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the compiler (and its imports) run
        return original(*args, **kwargs)

    monkeypatch.setattr(compiler, "compile_graph", compile_interrupted)
    x_cpu = torch.randn(8, 4)
    with tilewise.engine(mode="compiled"):
        x = x_cpu.to("neuron")
        with pytest.raises(KeyboardInterrupt):
            (x.tanh() * 2).sum().item()
        monkeypatch.undo()
        torch.testing.assert_close((x.sigmoid() + 1).cpu(), x_cpu.sigmoid() + 1)
        torch.testing.assert_close((x.tanh() * 2).sum().cpu(), (x_cpu.tanh() * 2).sum())
    assert tilewise.stats().compiles >= 2


def test_a_guard_miss_after_stats_reset_counts_and_recomputes():
    x_cpu = torch.randn(6)
    x = x_cpu.to("neuron")
    with tilewise.engine(mode="adaptive", threshold=1):
        for _ in range(3):
            ((x * 2) + 1).sum().item()  # x * 2 never leaves the compiled region
        tilewise.stats().reset()  # forgets the per-region detail, not the compiled regions
        kept = x * 2  # now the intermediate is referenced: the cached plan's guard misses
        total = ((kept) + 1).sum()
        torch.testing.assert_close(total.cpu(), ((x_cpu * 2) + 1).sum())
        torch.testing.assert_close(kept.cpu(), x_cpu * 2)
    assert sum(tilewise.stats().guard_misses.values()) == 1, tilewise.stats().report()


# ---- a KeyboardInterrupt from a signal handler, as an op is being dispatched -------------------

def _where_signals_surface(code) -> list[int]:
    """Offsets of `code` where a signal handler's exception can surface: CPython 3.11 runs pending
    handlers as a call returns, so just after each CALL. A trace hook fires before an instruction,
    so it stands for that point only where the next instruction has the same exception handler as
    the call (not where `return f()` inside `with` unwinds: there the call's own handler applies)."""
    bytecode = dis.Bytecode(code)

    def handler(offset):
        return next(((e.start, e.end, e.target) for e in bytecode.exception_entries if e.start <= offset < e.end), None)

    instructions = list(bytecode)
    return [after.offset for call, after in zip(instructions, instructions[1:])
            if call.opname == "CALL" and handler(call.offset) == handler(after.offset)]


def _interrupt_at(code, offset: int, program, interrupt=None) -> bool:
    """Run `program`, interrupting it the first time `code` reaches `offset`: by raising
    KeyboardInterrupt there, or by calling `interrupt` (a real signal, say)."""
    fired = []

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode" and frame.f_lasti == offset and not fired:
            fired.append(offset)
            if interrupt is None:
                raise KeyboardInterrupt
            interrupt()
        return trace

    sys.settrace(trace)
    try:
        program()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


def _dispatch_program(device):
    x = torch.arange(16.0, device=device).reshape(4, 4) / 10
    y = (x @ x + 1).relu()
    return [y, y.sum(0) * 2]


def _release_held_locks() -> list[str]:
    """The engine's locks this thread left held, released (so that a failure fails, not hangs)."""
    held = []
    for name, lock in (("hbm", tilewise.DEVICE.hbm._lock), ("timeline", tilewise.DEVICE.timeline._lock)):
        if lock.locked():
            held.append(name)
            lock.release()
    while RUNTIME.lock._is_owned():
        held.append("runtime")
        RUNTIME.lock.release()
    return held


def _bounded(work, seconds: float = 120) -> None:
    """Run `work` on a thread of its own; a hang (a lock left held) fails the test instead."""
    errors = []

    def target():
        try:
            work()
        except BaseException as error:  # re-raised by the test's thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        held = _release_held_locks()  # plain locks: any thread may release them, so the worker ends
        thread.join(seconds)
        pytest.fail(f"the program hung ({held} lock held)")
    if errors:
        raise errors[0]


@pytest.mark.parametrize("mode, function", [
    (mode, function) for function in (HBM.track, Timeline.record) for mode in ("eager", "adaptive", "compiled")
] + [(mode, function) for function in (Runtime.dispatch, Segment.record) for mode in ("adaptive", "compiled")])
def test_a_keyboard_interrupt_as_any_call_of_an_ops_dispatch_returns_leaves_the_engine_working(mode, function):
    """A signal handler that raises KeyboardInterrupt (Ctrl-C, a timer) stops an op wherever a call
    returns: no lock may stay held (the next op hung) and no recorded op may be left unplannable
    (every later flush failed); the program goes on and computes what CPU computes."""
    code = function.__code__
    want = _dispatch_program("cpu")
    interrupted = []

    def step():
        with tilewise.engine(mode=mode):
            for value in _dispatch_program("neuron"):
                value.cpu()

    def every_offset():
        for offset in _where_signals_surface(code):
            interrupted.append(_interrupt_at(code, offset, step))
            held = _release_held_locks()
            assert not held, f"an interrupt at offset {offset} left the {held} lock held"
            with tilewise.engine(mode=mode):
                got = [value.cpu() for value in _dispatch_program("neuron")]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)

    _bounded(every_offset)
    assert any(interrupted), "no interrupt was delivered: the test tested nothing"


def _ctrl_c_at(code, offset: int, program) -> bool:
    """Run `program`, sending a real SIGINT the first time `code` reaches `offset` (its handler
    raises KeyboardInterrupt there, unless the engine defers it)."""
    return _interrupt_at(code, offset, program, lambda: signal.raise_signal(signal.SIGINT))


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("function", [Runtime.flush, Runtime._flush], ids=["flush", "_flush"])
def test_ctrl_c_as_any_call_of_a_flush_returns_loses_no_recorded_op(mode, function):
    """Ctrl-C between taking the segment off the runtime and queueing it lost its nodes: the values
    the program held read as unwritten memory, and no later flush ran."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    x_cpu = torch.randn(5)
    want = _program(x_cpu)
    sent = 0
    for offset in _where_signals_surface(function.__code__):
        with tilewise.engine(mode=mode):
            held = _program(x_cpu.to("neuron"))
            sent += _ctrl_c_at(function.__code__, offset, lambda: held[-1].sum().item())
            got = [t.cpu() for t in held]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=lambda m: f"Ctrl-C at offset {offset}: {m}")
            torch.testing.assert_close(_program(x_cpu.to("neuron"))[-1].cpu(), want[-1])
    assert sent >= 2, "the test sent no Ctrl-C"
    assert tilewise.stats().compiles >= 1  # the later flushes compiled and ran the program's region


@pytest.mark.parametrize("error", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_signal_handler_that_raises_during_a_flush_raises_after_it_with_each_step_run_once(monkeypatch, mode, error):
    """A timer's handler (signal.setitimer, a timeout) that raises as a step of a flush returns: the
    flush went on from that step again, so an in-place update ran twice. Now every signal with a
    Python handler waits for the flush, as SIGINT does."""
    x_cpu = torch.randn(5)
    want = x_cpu * 2 + 1
    original, sent = StepRunner._run_step, []

    def step_then_signal(runner, segment, step, stats):
        original(runner, segment, step, stats)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGALRM)  # its handler raises as the step returns

    def handler(signum, frame):
        raise error("timer")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with tilewise.engine(mode=mode):
            w = x_cpu.to("neuron")
            w.mul_(2).add_(1)
            monkeypatch.setattr(StepRunner, "_run_step", step_then_signal)
            with pytest.raises(error):
                w.sum().item()
            monkeypatch.undo()
            got = w.cpu()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert sent
    torch.testing.assert_close(got, want)
