"""The engine's mode belongs to the engine block of each thread: two threads in different modes
at once each get their own policy, and both compute what CPU computes."""
import threading

import torch

import tilewise
from tilewise.adaptive.engine import RUNTIME
from tilewise.adaptive.regions import CompiledEntry


def _loop(op, mode, threshold, x_cpu, results, barrier, steps=12):
    x = x_cpu.to("neuron")
    with tilewise.engine(mode=mode, threshold=threshold):
        barrier.wait(timeout=60)  # both blocks are open before either runs an op
        out = []
        for step in range(steps):
            out.append(op(x * (step + 1)).sum().item())
        barrier.wait(timeout=60)  # neither block closes while the other still runs
    results[mode] = out


def test_two_threads_in_different_modes_keep_their_own_policy():
    tilewise.reset_caches()
    x_cpu = torch.randn(16, 16)
    barrier, results = threading.Barrier(2), {}
    # adaptive with a threshold it never reaches: its sin never compiles; compiled: its cos does
    threads = [threading.Thread(target=_loop, args=(torch.sin, "adaptive", 1000, x_cpu, results, barrier)),
               threading.Thread(target=_loop, args=(torch.cos, "compiled", 3, x_cpu, results, barrier))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    for mode, op in (("adaptive", torch.sin), ("compiled", torch.cos)):
        expected = [op(x_cpu * (step + 1)).sum().item() for step in range(12)]
        torch.testing.assert_close(results[mode], expected, rtol=1e-5, atol=1e-4)
    compiled_ops = {name for entry in RUNTIME.memory.regions.values() if isinstance(entry, CompiledEntry)
                    for name in entry.op_names}
    assert "cos" in compiled_ops, compiled_ops
    assert "sin" not in compiled_ops, compiled_ops


def test_an_engine_block_closed_in_one_thread_leaves_the_others_mode_alone():
    tilewise.reset_caches()
    inner_open, outer_closed, seen = threading.Event(), threading.Event(), {}

    def short_block():
        with tilewise.engine(mode="eager"):
            inner_open.wait(timeout=60)
        outer_closed.set()

    thread = threading.Thread(target=short_block)
    thread.start()
    x = torch.randn(8, 8).to("neuron")
    with tilewise.engine(mode="compiled"):
        inner_open.set()
        outer_closed.wait(timeout=60)  # the other thread's block has closed: ours still compiles
        tilewise.stats().reset()
        for step in range(3):
            seen[step] = (x * step).tanh().sum().item()
        compiles = tilewise.stats().compiles
    thread.join(timeout=60)
    assert compiles >= 1, tilewise.stats().report()


def test_a_thread_without_a_block_runs_its_ops_eagerly_while_another_records():
    """What docs/guide/sync-points.md says of a thread with no engine block: its ops run at once,
    whatever mode another thread's block has; the other thread's recorded work is computed first."""
    tilewise.reset_caches()
    block_open, done, seen = threading.Event(), threading.Event(), {}
    x_cpu = torch.randn(8, 8)

    def outside():
        block_open.wait(timeout=60)
        x = x_cpu.to("neuron")
        y = x.exp()  # no block here: computed now, nothing recorded for it
        seen["pending"] = RUNTIME.is_pending(y._data)
        seen["value"] = y._data.clone()
        done.set()

    thread = threading.Thread(target=outside)
    thread.start()
    a = torch.randn(8, 8)
    with tilewise.engine(mode="compiled"):
        b = a.to("neuron") * 3  # recorded in this thread's segment
        block_open.set()
        done.wait(timeout=60)
        assert torch.equal(b.cpu(), a * 3)
    thread.join(timeout=60)
    assert seen["pending"] is False
    assert torch.equal(seen["value"], x_cpu.exp())


def _counted_loop(mode, x_cpu, results, barrier, steps=12):
    x = x_cpu.to("neuron")
    with tilewise.engine(mode=mode, threshold=1000 if mode == "adaptive" else 3) as stats:
        barrier.wait(timeout=60)  # both blocks are open before either runs an op
        out = []
        for step in range(steps):
            y = (x * (step + 1)).tanh().add(1.0)
            out.append(y.cpu())  # 3 ops recorded, then a read: each step a segment of its own
        barrier.wait(timeout=60)  # neither block closes while the other still runs
    results[mode] = (out, stats, tilewise.stats())


def test_two_threads_in_different_modes_keep_their_own_statistics():
    tilewise.reset_caches()
    x_cpu = torch.randn(16, 16)
    barrier, results = threading.Barrier(2), {}
    threads = [threading.Thread(target=_counted_loop, args=(mode, x_cpu, results, barrier))
               for mode in ("adaptive", "compiled")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    expected = [(x_cpu * (step + 1)).tanh().add(1.0) for step in range(12)]
    (adaptive, in_block, after), (compiled, ours, ours_after) = results["adaptive"], results["compiled"]
    for values in (adaptive, compiled):
        assert all(torch.equal(got, want) for got, want in zip(values, expected))
    assert in_block is after and ours is ours_after and in_block is not ours
    assert in_block is not tilewise.stats() and ours is not tilewise.stats()
    for stats in (in_block, ours):  # each thread's ops alone: mul, tanh, add and the copy to the host, 12 times
        assert stats.ops_seen == 48, stats.report()
        assert stats.transfers == 12, stats.report()
    # adaptive with a threshold it never reaches compiles nothing; compiled mode compiles at once.
    # The engine's caches are the process's: the adaptive thread may run a region the compiled one
    # compiled, so its own ops split between eager and compiled as the two threads interleave
    assert in_block.compiles == 0, in_block.report()
    assert ours.compiles >= 1 and ours.ops_compiled >= 3 * 10, ours.report()
    assert in_block.ops_eager + in_block.ops_compiled == 36, in_block.report()


def test_a_thread_without_a_block_gets_statistics_that_count_nothing():
    """A thread with no engine block: its tilewise.stats() is its own and counts nothing; the
    segment its op flushes counts in the statistics of the thread that recorded it."""
    tilewise.reset_caches()
    block_open, done, seen = threading.Event(), threading.Event(), {}

    def outside():
        block_open.wait(timeout=60)
        stats = tilewise.stats()
        tilewise.sync()  # computes the other thread's segment
        seen["stats"], seen["counted"] = stats, stats.to_dict()
        done.set()

    thread = threading.Thread(target=outside)
    thread.start()
    a = torch.randn(8, 8)
    with tilewise.engine(mode="compiled") as stats:
        stats.reset()
        b = a.to("neuron") * 3
        block_open.set()
        done.wait(timeout=60)
        assert not RUNTIME.is_pending(b._data)  # the other thread's sync computed it
        assert torch.equal(b.cpu(), a * 3)
    thread.join(timeout=60)
    assert seen["stats"] is not stats
    assert seen["counted"]["ops_seen"] == 0 and seen["counted"]["segments"] == 0, seen["counted"]
    assert stats.flush_reasons["tilewise.sync()"] == 1, stats.report()
    assert stats.ops_seen == 3, stats.report()  # the upload, the mul, the copy back


def test_regions_compiled_in_two_threads_have_names_of_their_own():
    """Region names are the process's: explain(name) finds the region the thread's stats() names."""
    tilewise.reset_caches()
    x_cpu = torch.randn(16, 16)
    barrier, results = threading.Barrier(2), {}

    def compile_one(op):
        x = x_cpu.to("neuron")
        with tilewise.engine(mode="compiled") as stats:
            barrier.wait(timeout=60)
            for step in range(4):
                op(x * (step + 1)).cpu()
        results[op.__name__] = stats

    threads = [threading.Thread(target=compile_one, args=(op,)) for op in (torch.sin, torch.cos)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    # the segment is the process's: ops the two threads record at once may share a segment and its
    # region, counted where the segment's first op was recorded; names never collide
    sin_names, cos_names = set(results["sin"].regions), set(results["cos"].regions)
    assert sin_names | cos_names and not sin_names & cos_names, (sin_names, cos_names)
    texts = {name: tilewise.explain(name) for name in sin_names | cos_names}
    assert all(text.startswith(f"# {name}: ") for name, text in texts.items()), texts
    assert any("sin.default" in text for text in texts.values()) and any("cos.default" in text for text in texts.values())
