"""Fault injection: compiler failures, user exceptions, interrupts, out-of-memory, corrupt cache
entries and threads. After each fault the results must still equal plain CPU PyTorch, and the
engine must keep working."""
import threading

import pytest
import torch

import tilewise
from tilewise.adaptive import RUNTIME
from tilewise.adaptive import regions as adaptive_regions
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import driver
from tilewise.device.runtime import DEVICE


def step(x, w):
    """One small segment: matmul, elementwise chain, reduction."""
    return ((x @ w).tanh() * 2 + 1).sum(0)


def cpu_step(x, w):
    return step(x.cpu(), w.cpu())


@pytest.fixture
def memory_only_cache(monkeypatch):
    """No disk cache and an empty compile cache: every region really runs the passes."""
    cache.clear_memory()
    with tilewise.config.patch(cache_dir=None):
        yield
    cache.clear_memory()


def assert_pending_state_clear():
    assert len(RUNTIME.segment) == 0 and not DEVICE.lazy_pending and not RUNTIME._flushing


# -- a compiler pass fails -------------------------------------------------------------------------
@pytest.mark.parametrize("failing_pass", [name for name, _ in driver.PASSES])
def test_compiler_pass_failure_falls_back_to_eager_with_reason(failing_pass, monkeypatch, memory_only_cache):
    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure in {failing_pass}")

    monkeypatch.setattr(driver, "PASSES", tuple((name, boom if name == failing_pass else fn)
                                                for name, fn in driver.PASSES))
    x, w = torch.randn(129, 7).to("neuron"), torch.randn(7, 5).to("neuron")
    with tilewise.engine(mode="adaptive", threshold=2):
        for _ in range(4):
            got = step(x, w).cpu()
            torch.testing.assert_close(got, cpu_step(x, w))
    stats = tilewise.stats()
    reasons = [reason for (op, reason) in stats.fallbacks if op == "<region>"]
    assert any(f"compile failed: RuntimeError: injected failure in {failing_pass}" in r for r in reasons), \
        stats.report()
    assert stats.compiles == 0 and stats.ops_compiled == 0
    # Fixed compiler: the engine compiles again once its caches are reset.
    monkeypatch.undo()
    tilewise.reset_caches()
    with tilewise.engine(mode="compiled"):
        torch.testing.assert_close(step(x, w).cpu(), cpu_step(x, w))
    assert tilewise.stats().compiles >= 1


def test_a_device_op_on_the_compiler_thread_fails_the_compile_instead_of_hanging(monkeypatch, memory_only_cache):
    """The compiler traces host buffers: a device tensor reaching it (a nested wrapper once did)
    made its thread flush, waiting for the lock of the flush that waits for the compile."""
    def touching_the_device(region):
        (torch.ones(2, device="neuron") + 1).sum()
        return region

    monkeypatch.setattr(driver, "PASSES", (("touch", touching_the_device), *driver.PASSES))
    x, w = torch.randn(129, 7).to("neuron"), torch.randn(7, 5).to("neuron")
    with tilewise.engine(mode="compiled"):
        for _ in range(2):
            torch.testing.assert_close(step(x, w).cpu(), cpu_step(x, w))
    reasons = [reason for (op, reason) in tilewise.stats().fallbacks if op == "<region>"]
    assert any("the compiler met a device tensor" in r for r in reasons), tilewise.stats().report()
    assert_pending_state_clear()


# -- user code raises halfway through a segment ----------------------------------------------------
def test_user_exception_mid_segment_leaves_no_pending_state():
    x, w = torch.randn(16, 8).to("neuron"), torch.randn(8, 4).to("neuron")
    results = []
    for iteration in range(5):
        try:
            with tilewise.engine(mode="adaptive", threshold=2):
                y = (x @ w).relu()
                if iteration == 2:
                    raise ValueError("user error halfway through a segment")
                results.append(y.sum(0).cpu())
        except ValueError:
            assert_pending_state_clear()
            torch.testing.assert_close(y.cpu(), (x.cpu() @ w.cpu()).relu())  # computed at block exit
    for got in results:
        torch.testing.assert_close(got, (x.cpu() @ w.cpu()).relu().sum(0))
    assert tilewise.stats().compiles >= 1 and tilewise.stats().cache_hits >= 1, tilewise.stats().report()


def test_user_exception_caught_inside_the_block_keeps_later_steps_correct():
    x, w = torch.randn(16, 8).to("neuron"), torch.randn(8, 4).to("neuron")
    with tilewise.engine(mode="adaptive", threshold=2):
        for iteration in range(6):
            try:
                y = (x @ w).relu()
                if iteration == 2:
                    raise KeyError("skipped step")
                z = (y * 3).sum()
            except KeyError:
                continue
            torch.testing.assert_close(z.cpu(), ((x.cpu() @ w.cpu()).relu() * 3).sum())
    assert_pending_state_clear()


def test_op_error_mid_segment_raises_like_cpu_and_keeps_earlier_values():
    x = torch.randn(4, 5).to("neuron")
    with tilewise.engine(mode="compiled"):
        a = x * 2
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            a @ torch.randn(4, 4).to("neuron")  # wrong inner size, as on the CPU
        b = a + 1
    torch.testing.assert_close(b.cpu(), x.cpu() * 2 + 1)
    assert_pending_state_clear()


# -- KeyboardInterrupt during a flush --------------------------------------------------------------
def _interrupt_once(monkeypatch, owner, name):
    original = getattr(owner, name)
    state = {"armed": True}

    def interrupted(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return state


@pytest.mark.parametrize("where", ["compiled region", "eager replay"])
def test_keyboard_interrupt_during_flush_leaves_tensors_and_engine_usable(where, monkeypatch):
    x, w = torch.randn(32, 16).to("neuron"), torch.randn(16, 8).to("neuron")
    expected = cpu_step(x, w)
    with tilewise.engine(mode="adaptive", threshold=2):
        for _ in range(3):  # warm up and compile: the segment is served by its compiled region
            torch.testing.assert_close(step(x, w).cpu(), expected)
        before = step(x, w).cpu()  # an earlier result, already on the host
        kept = x * 1  # computed by the flush below, before the interrupted step
        tilewise.sync()
        if where == "compiled region":
            state = _interrupt_once(monkeypatch, adaptive_regions.CompiledEntry, "run")
        else:
            state = _interrupt_once(monkeypatch, adaptive_regions, "replay")
            x2 = x[:5]  # a new segment: eager while warming up
        with pytest.raises(KeyboardInterrupt):
            y = step(x, w) if where == "compiled region" else (x2 * 3).sum(0)
            y.cpu()
        assert not state["armed"]
        assert RUNTIME.unfinished and DEVICE.lazy_pending  # the interrupted work is kept pending
        # and computed by the next read, so the interrupted step's tensors hold their values
        if where == "compiled region":
            torch.testing.assert_close(y.cpu(), expected)
        else:
            torch.testing.assert_close(y.cpu(), (x.cpu()[:5] * 3).sum(0))
        assert_pending_state_clear()
        torch.testing.assert_close(before, expected)
        torch.testing.assert_close(kept.cpu(), x.cpu())
        for _ in range(3):
            torch.testing.assert_close(step(x, w).cpu(), expected)
            if where == "eager replay":
                torch.testing.assert_close((x2 * 3).sum(0).cpu(), (x.cpu()[:5] * 3).sum(0))
    assert tilewise.stats().cache_hits >= 2


# -- out of memory halfway through a segment -------------------------------------------------------
@pytest.fixture
def small_hbm():
    """HBM with 1 MiB free beyond what is in use now; restored afterwards."""
    hbm = tilewise.DEVICE.hbm
    saved = hbm.capacity
    hbm.capacity = hbm.in_use + 2**20
    yield hbm
    hbm.capacity = saved


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_out_of_memory_mid_segment_raises_and_keeps_earlier_tensors(mode, small_hbm):
    x_host = torch.randn(64, 64)  # 16 KiB
    x = x_host.to("neuron")
    with tilewise.engine(mode=mode, threshold=1):
        a = x * 2
        b = a.relu() + 1
        with pytest.raises(tilewise.NeuronOutOfMemoryError, match="out of memory"):
            torch.empty(1024, 1024, device="neuron") + b.sum()  # 4 MiB: does not fit
        with pytest.raises(tilewise.NeuronOutOfMemoryError):
            b.expand(512, 64, 64) * 1.0  # 8 MiB result of a deferred op: refused at record time
        c = b - a
    torch.testing.assert_close(a.cpu(), x_host * 2)
    torch.testing.assert_close(b.cpu(), (x_host * 2).relu() + 1)
    torch.testing.assert_close(c.cpu(), (x_host * 2).relu() + 1 - x_host * 2)
    assert_pending_state_clear()
    # Memory is back once the big request is gone; the engine keeps working.
    with tilewise.engine(mode=mode, threshold=1):
        torch.testing.assert_close((x * 3).sum().cpu(), (x_host * 3).sum())


def _gelu_norm(x):
    y = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
    mean = y.mean(-1, keepdim=True)
    return (y - mean) / torch.sqrt(((y - mean) ** 2).mean(-1, keepdim=True) + 1e-5)


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_lazy_modes_run_what_fits_eagerly_computing_the_segment_when_hbm_is_full(mode, small_hbm):
    """Eager frees each temporary as the program drops it; a segment holds every buffer it recorded
    until it is computed (17 of 128 KiB here, 2 MiB, against eager's peak of about 0.8): an op that
    does not fit computes the segment first, and is recorded again."""
    from tilewise.adaptive.runtime import OUT_OF_MEMORY
    x_host = torch.randn(128, 256)  # 128 KiB
    x = x_host.to("neuron")
    tilewise.stats().reset()
    with tilewise.engine(mode=mode, threshold=1):
        for _ in range(4):
            torch.testing.assert_close(_gelu_norm(x).cpu(), _gelu_norm(x_host))
    stats = tilewise.stats()
    if mode != "eager":
        assert stats.flush_reasons[OUT_OF_MEMORY] >= 4 and stats.compiled_fraction > 0.5, stats
    assert_pending_state_clear()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_training_loop_that_fits_eagerly_fits_in_the_lazy_modes(mode):
    """TinyGPT with AdamW in HBM 15% above eager's peak: the lazy modes ran out of it (the step's
    segment held every temporary of forward and backward) before they computed segments early.
    Six steps: adaptive mode runs its first two eagerly (warming up), and over four steps the
    compiled fraction said more about the warm-up than about the steps under pressure (every op
    after the warm-up compiles: 416 of 838 compute ops over four steps, 1,044 of 1,466 over six)."""
    import gc

    from tilewise.adaptive.runtime import OUT_OF_MEMORY
    from tilewise.workloads import train_gpt
    steps = 6
    cpu_losses, cpu_params = train_gpt("cpu", steps=steps)
    hbm = tilewise.DEVICE.hbm
    gc.collect()
    hbm.reset_peak()
    base = hbm.in_use
    train_gpt("neuron", "eager", steps=steps)
    eager_peak = hbm.peak - base
    gc.collect()
    saved = hbm.capacity
    hbm.capacity = hbm.in_use + int(eager_peak * 1.15)
    tilewise.stats().reset()
    try:
        losses, params = train_gpt("neuron", mode, steps=steps)
    finally:
        hbm.capacity = saved
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-5)
    for got, expected in zip(params, cpu_params):  # AdamW: see PARAM_ATOL in test_adaptive.py
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-2)
    stats = tilewise.stats()
    assert stats.flush_reasons[OUT_OF_MEMORY] > 0 and stats.compiled_fraction > 0.5, stats
    assert_pending_state_clear()


# -- the on-disk cache: corrupt and truncated entries ----------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "garbage", "digest of another payload"])
def test_corrupt_disk_cache_entry_is_detected_and_recompiled(damage, tmp_path):
    x, w = torch.randn(20, 6).to("neuron"), torch.randn(6, 3).to("neuron")
    expected = cpu_step(x, w)
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        cache.clear_memory()
        with tilewise.engine(mode="compiled"):
            torch.testing.assert_close(step(x, w).cpu(), expected)
        entries = sorted(tmp_path.glob("*.twc"))
        assert entries
        for entry in entries:
            data = entry.read_bytes()
            entry.write_bytes({
                "truncated": data[: len(data) // 2],
                "flipped byte": data[:-10] + bytes([data[-10] ^ 0x55]) + data[-9:],
                "empty": b"",
                "garbage": b"\x00\xff" * 100,
                "digest of another payload": _rehash(b'{"key": "x", "version": "other"}'),
            }[damage])
        cache.clear_memory()
        tilewise.reset_caches()
        corrupt, compiles = cache.stats.corrupt, cache.stats.compiles
        with tilewise.engine(mode="compiled"):
            torch.testing.assert_close(step(x, w).cpu(), expected)
        assert cache.stats.corrupt == corrupt + len(entries)
        assert cache.stats.compiles == compiles + len(entries)
        cache.clear_memory()
        tilewise.reset_caches()
        hits = cache.stats.disk_hits
        with tilewise.engine(mode="compiled"):  # the recompiled entries were written back
            torch.testing.assert_close(step(x, w).cpu(), expected)
        assert cache.stats.disk_hits == hits + len(entries)
    cache.clear_memory()


def _rehash(payload: bytes) -> bytes:
    import hashlib
    return hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


# -- two threads at once ---------------------------------------------------------------------------
@pytest.mark.parametrize("modes", [("adaptive", "adaptive"), ("compiled", "eager")])
def test_two_threads_using_the_engine_at_once_compute_correctly(modes):
    torch.manual_seed(0)
    data = [(torch.randn(24, 12), torch.randn(12, 6, requires_grad=True)) for _ in modes]
    errors, results = [], {}
    barrier = threading.Barrier(len(modes))

    def worker(index, mode):
        x_host, w_host = data[index]
        x = x_host.to("neuron")
        w = w_host.detach().to("neuron").requires_grad_()
        try:
            barrier.wait()
            with tilewise.engine(mode=mode, threshold=2):
                for _ in range(12):
                    w.grad = None
                    loss = ((x @ w).tanh() ** 2).mean()
                    loss.backward()
                    results[index] = (loss.item(), w.grad.cpu())
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i, m)) for i, m in enumerate(modes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for index, (x_host, w_host) in enumerate(data):
        w = w_host.detach().clone().requires_grad_()
        loss = ((x_host @ w).tanh() ** 2).mean()
        loss.backward()
        got_loss, got_grad = results[index]
        assert got_loss == pytest.approx(loss.item(), rel=1e-5)
        torch.testing.assert_close(got_grad, w.grad)
    assert_pending_state_clear()


# -- errors inside a backward pass ------------------------------------------------------------------
# The autograd engine's stream guard for neuron calls into Python as it unwinds: an exception of an
# op inside backward ended the process ("terminate called without an active exception") in every
# mode. It must reach the program as itself (device/backward_errors.py).

def _forward(x, w):
    return ((x @ w).tanh() @ w).sum()


@pytest.mark.parametrize("mode", [None, "eager", "adaptive", "compiled"])
def test_out_of_memory_in_backward_raises_it_and_a_retry_with_room_matches_cpu(mode):
    import contextlib
    import gc

    x_host, w_host = torch.randn(64, 64), torch.randn(64, 64)
    xc, wc = x_host.clone().requires_grad_(), w_host.clone().requires_grad_()
    _forward(xc, wc).backward()
    hbm = tilewise.DEVICE.hbm
    saved = hbm.capacity
    x, w = x_host.to("neuron").requires_grad_(), w_host.to("neuron").requires_grad_()
    block = tilewise.engine(mode=mode) if mode else contextlib.nullcontext()
    with block:
        loss = _forward(x, w)
        tilewise.sync()  # the lazy modes free what the forward's segment held for it, as eager has
        gc.collect()
        hbm.capacity = hbm.in_use + 20_000  # the forward's buffers fit, the backward's do not
        try:
            with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
                loss.backward()
                tilewise.sync()
        finally:
            hbm.capacity = saved
        assert x.grad is None and w.grad is None  # the failing pass stopped before accumulating
        _forward(x, w).backward()  # a batch-size finder's retry
    torch.testing.assert_close(x.grad.cpu(), xc.grad)
    torch.testing.assert_close(w.grad.cpu(), wc.grad)
    assert_pending_state_clear()


@pytest.mark.parametrize("mode", [None, "eager", "adaptive"])
def test_an_interrupt_inside_backward_reaches_the_program(mode, monkeypatch):
    """Ctrl-C during backward lands in the engine's Python (each op's dispatch): KeyboardInterrupt
    from backward(), the process alive and the engine usable."""
    import contextlib

    from tilewise.adaptive import tracer
    from tilewise.eager import executor

    def interrupting(real):
        def entry(func, *args, **kwargs):
            if func is torch.ops.aten.cos.default:  # sin's backward
                raise KeyboardInterrupt
            return real(func, *args, **kwargs)
        return entry

    if mode is None:
        monkeypatch.setattr(executor, "run", interrupting(executor.run))
    elif mode == "eager":
        monkeypatch.setattr(tracer, "execute", interrupting(tracer.execute))
    else:
        monkeypatch.setattr(RUNTIME, "dispatch", interrupting(RUNTIME.dispatch))
    x = torch.randn(8).to("neuron").requires_grad_()
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        y = (x * 3).sin().sum()
        with pytest.raises(KeyboardInterrupt):
            y.backward()
        monkeypatch.undo()
        (x * 3).sin().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 3 * torch.cos(x.detach().cpu() * 3))


@pytest.mark.parametrize("mode", [None, "eager", "adaptive", "compiled"])
def test_a_sparse_embedding_gradient_is_refused_clearly_in_every_mode(mode):
    """Lazy modes recorded the sparse gradient's constructor into a dense buffer: wrong weights
    after the step, silently. Eager's refusal ended the process from inside backward."""
    import contextlib

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True).to("neuron")
    before = embedding.weight.detach().cpu().clone()
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        loss = embedding(torch.tensor([[1, 2], [3, 1]]).to("neuron")).sum()
        with pytest.raises(tilewise.DeviceError, match="use sparse=False on neuron"):
            loss.backward()
            tilewise.sync()
    assert embedding.weight.grad is None
    assert torch.equal(embedding.weight.detach().cpu(), before)
