"""Adaptive mode compiling in the background (`background_compile="on"`): the steps go on eagerly
while the compile process compiles, the region switches when its code is there, and every value
is CPU's throughout; a compile process that cannot start or dies costs the background, not the
region."""
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.errors import CompileError
from tilewise.compiler.process import background, remote, worker
from tilewise.compiler.cache import regions as cache, disk
from tilewise.compiler import compile_graph, compile_in_background, finish
from tilewise.compiler.generic import symbolic
from tilewise.compiler.cache.serialize import graph_to_json
from tilewise.workloads import MLP, random_lengths, train_gpt, train_seq

TIMEOUT = 240  # seconds a compile process may take to start and compile on a loaded machine


@pytest.fixture
def process(monkeypatch):
    """A compile process of the test's own (a broken one must not outlive the test), nothing in the
    compiler's memory cache, and its warnings not yet given."""
    fresh = background.CompileProcess()
    monkeypatch.setattr(background, "PROCESS", fresh)
    monkeypatch.setattr(disk, "_warned", set())
    cache.clear_memory()
    with tilewise.config.patch(background_compile="on"):
        yield fresh
    fresh.close()


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(steps)]


def _trainer(device):
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        return loss.item()

    return model, step


def _train_cpu(batches):
    model, step = _trainer("cpu")
    return [step(x, y) for x, y in batches], model


def test_training_runs_eagerly_while_compiling_then_switches_and_matches_cpu(process):
    batches = _data(12)
    model, step = _trainer("neuron")
    losses = []
    with tilewise.engine(mode="adaptive", threshold=2):
        for x, y in batches[:6]:
            losses.append(step(x, y))
        sent = tilewise.stats().background_compiles
        assert sent >= 1 and tilewise.stats().compiling_ops > 0
        assert tilewise.wait_for_compiles(timeout=TIMEOUT)
        for x, y in batches[6:]:
            losses.append(step(x, y))
    stats = tilewise.stats()
    assert stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()
    # every compile came back from the compile process (its seconds are its own, not this process's)
    assert stats.background_seconds > 0 and stats.compiles <= stats.background_compiles, stats.report()
    assert "sent to the compile process" in stats.report()
    expected, reference = _train_cpu(batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)


def test_tiny_gpt_switches_to_its_compiled_step_mid_training_and_matches_cpu(process):
    """The whole training step (dropout, attention, AdamW) as one region: eager while it compiles,
    compiled after, CPU's losses and weights throughout."""
    def on_step(step):
        if step == 4:
            assert tilewise.stats().background_compiles >= 1
            assert tilewise.wait_for_compiles(timeout=TIMEOUT)

    losses, params = train_gpt("neuron", "adaptive", steps=8, on_step=on_step)
    stats = tilewise.stats()
    assert stats.compiles >= 1 and stats.compiling_ops > 0 and stats.ops_compiled > 0, stats.report()
    want_losses, want_params = train_gpt("cpu", steps=8)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    for got, want in zip(params, want_params):  # AdamW: see PARAM_ATOL in test_adaptive.py
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)


def test_a_region_whose_compile_has_not_come_back_runs_eagerly_and_explain_says_so(process, monkeypatch):
    jobs = []

    def submit(key, gm, example_inputs, spec, name):  # a compile process that never replies
        jobs.append(background.Job(key, name))
        return jobs[-1]

    monkeypatch.setattr(process, "submit", submit)
    batches = _data(6)
    model, step = _trainer("neuron")
    with tilewise.engine(mode="adaptive", threshold=2):
        losses = [step(x, y) for x, y in batches]
    stats = tilewise.stats()
    assert jobs and stats.background_compiles == len(jobs) and stats.compiles == 0 and stats.ops_compiled == 0
    assert stats.compiling_ops > 0
    with pytest.raises(tilewise.ConfigError, match=f"{len(jobs)} compiling in the background"):
        tilewise.explain(jobs[0].name)
    expected, _ = _train_cpu(batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def _explained(region: str) -> str:
    """explain(region), or "" for a region not in the cache yet (each site's generic region has a
    name of its own: a site whose compile has not come back yet has none)."""
    try:
        return tilewise.explain(region)
    except tilewise.ConfigError:
        return ""


def _calls_here(monkeypatch, module, name: str) -> list:
    """The calls of module.name made in this process (a compile process forked from it inherits
    the patch: its calls are not counted)."""
    calls, original, parent = [], getattr(module, name), os.getpid()

    def counted(*args, **kwargs):
        if os.getpid() == parent:
            calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_sizes_that_change_compile_their_generic_region_in_the_compile_process(process, monkeypatch):
    """The shape-generic compile (a symbolic trace and a parametric lowering: seconds for a
    transformer's step) goes to the compile process like a static one: the region's ops run
    eagerly until it is there, then each new length's tile programs are asked of it (eagerly
    again until they come); values CPU's throughout."""
    here = _calls_here(monkeypatch, symbolic, "compile_generic")
    there = _calls_here(monkeypatch, remote, "compile_generic_remotely")
    lengths = random_lengths(24, 4, 24, seed=2)

    asked_early = []  # steps that asked explain() about the generic region before its compile came back

    def on_step(step):
        if there and step < 8:
            asked_early.append(step)
            with pytest.raises(tilewise.ConfigError, match="compiling in the background"):
                tilewise.explain(there[0][4])
        if step in (8, 16):  # the compile process has replied: the next flushes take it in
            assert tilewise.wait_for_compiles(timeout=TIMEOUT)

    losses, params = train_seq("neuron", "adaptive", steps=24, lengths=lengths, on_step=on_step)
    stats = tilewise.stats()
    assert there and not here and asked_early, stats.report()
    assert stats.compiling_ops > 0 and stats.evaluated_sizes + stats.specialisations >= 3, stats.report()
    assert stats.ops_compiled > 0 and any("compiled in the compile process" in _explained(call[4]) for call in there)
    want_losses, want_params = train_seq("cpu", steps=24, lengths=lengths)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_compile_process_that_dies_holding_a_generic_region_leaves_the_site_to_compile_here(process, monkeypatch):
    here = _calls_here(monkeypatch, symbolic, "compile_generic")
    lengths = random_lengths(20, 4, 24, seed=2)

    def on_step(step):
        if step == 8:
            assert tilewise.wait_for_compiles(timeout=TIMEOUT) and not here
            process._child.kill()  # the generic region it compiled is gone with it
            process._child.wait(None)

    with pytest.warns(RuntimeWarning, match="background compile process failed"):
        losses, params = train_seq("neuron", "adaptive", steps=20, lengths=lengths, on_step=on_step)
    stats = tilewise.stats()
    assert process.broken and here and stats.ops_compiled > 0, stats.report()
    want_losses, want_params = train_seq("cpu", steps=20, lengths=lengths)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_guards_from_the_compile_process_are_only_comparisons_of_sizes():
    text = "L['t0'].size()[1] == 8 and L['t0'].stride()[0] == 8 and 2 <= L['t0'].size()[0] and " \
           "L['t1'].storage_offset() == 0 and (L['t0'].size()[0] * 4) // 2 != 64"
    assert remote.checked_guards(text) == text
    for hostile in ("__import__('os').system('true')", "L['t0'].size.__globals__", "open('x') == 1",
                    "L['t0'].size()[0] == (lambda: 1)()", "[x for x in L]"):
        with pytest.raises(CompileError, match="guards"):
            remote.checked_guards(hostile)


def _region():
    fn = lambda x, w: (torch.softmax(x * 2, -1), torch.relu(x @ w))  # noqa: E731
    x, w = torch.randn(130, 20), torch.randn(20, 7)
    return fn, make_fx(fn)(x, w), [x, w]


def test_the_compile_process_compiles_what_this_process_would(process):
    fn, gm, inputs = _region()
    job = compile_in_background(gm, inputs, tilewise.DEVICE.spec, "regionA")
    assert isinstance(job, background.Job) and job.wait(TIMEOUT)
    there = finish(job, gm, tilewise.DEVICE.spec)
    cache.clear_memory()
    here = compile_graph(gm, inputs, name="regionA")
    assert there.name == "regionA" and len(there.kernels) == len(here.kernels) > 0
    assert [c[1:] for c in there.cost] == [c[1:] for c in here.cost]  # engine, seconds, bytes, flops
    for got, tiles, want in zip(there.run(*inputs), there.interpret(*inputs), fn(*inputs)):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(tiles, want, rtol=1e-5, atol=1e-5)
    # once compiled, the region is the cache's: asking again is served at once, with no job
    assert compile_in_background(gm, inputs, tilewise.DEVICE.spec, "regionB").name == "regionB"


def test_a_dead_compile_process_warns_and_the_regions_compile_here(process):
    assert process.start()
    process._child.kill()
    process._child.wait(None)
    batches = _data(8)
    model, step = _trainer("neuron")
    with pytest.warns(RuntimeWarning, match="background compile process failed"):
        with tilewise.engine(mode="adaptive", threshold=2):
            losses = [step(x, y) for x, y in batches]
    stats = tilewise.stats()
    assert process.broken and stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()
    expected, _ = _train_cpu(batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_a_process_that_cannot_start_leaves_compiling_here(process, monkeypatch):
    monkeypatch.setattr(background.threading, "active_count", lambda: 2)  # no fork: a fresh interpreter
    monkeypatch.setattr(sys, "executable", "")
    fn, gm, inputs = _region()
    with pytest.warns(RuntimeWarning, match="sys.executable is empty"):
        compiled = compile_in_background(gm, inputs, tilewise.DEVICE.spec, "region1")
    assert not isinstance(compiled, background.Job) and len(compiled.kernels) > 0
    assert not process.start()


def test_a_graph_of_other_than_aten_ops_compiles_here(process):
    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) + 1)  # torch.sin, not an aten overload
    assert not background.carries(gm)
    assert process.submit("key", gm, [torch.randn(3)], tilewise.DEVICE.spec, "region1") is None
    assert background.carries(make_fx(lambda x: torch.sin(x) + 1)(torch.randn(3)))


def test_the_worker_replies_with_the_error_and_goes_on_to_the_next_request():
    fn, gm, inputs = _region()
    good = {"id": 7, "kind": "region", "key": "k", "name": "region1", "graph": graph_to_json(gm),
            "spec": dataclasses.asdict(tilewise.DEVICE.spec),
            "inputs": [worker.layout_of(t, {}) for t in inputs]}
    bad = dict(good, id=6, inputs=good["inputs"][:1])  # one input short
    replies = io.BytesIO()
    worker.serve(io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in (bad, good))), replies)
    replies.seek(0)
    first = json.loads(replies.readline())
    assert first["id"] == 6 and first["error"] and first["bytes"] == 0
    second = json.loads(replies.readline())
    assert second["id"] == 7 and second["error"] is None
    entry = json.loads(replies.read(second["bytes"]))
    assert entry["key"] == "k" and entry["name"] == "region1" and entry["launches"]


def test_inputs_sharing_storage_share_it_in_the_compile_process():
    base = torch.randn(40)
    a, b, c = base[:20].view(4, 5), base[10:30], torch.randn(3).expand(2, 3)
    storages, bases = {}, {}
    rebuilt = [worker.input_from(json.loads(json.dumps(worker.layout_of(t, storages))), bases) for t in (a, b, c, 2.5)]
    for got, want in zip(rebuilt, (a, b, c)):
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype)
    assert rebuilt[0].untyped_storage()._cdata == rebuilt[1].untyped_storage()._cdata != \
        rebuilt[2].untyped_storage()._cdata
    assert rebuilt[3] == 2.5


def test_no_compile_process_unless_asked():
    script = textwrap.dedent("""
        import torch, tilewise
        from tilewise.compiler.process import background
        with tilewise.engine(mode="adaptive"):
            (torch.ones(3, device="neuron") * 2).cpu()
        print(background.PROCESS._child is None)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TILEWISE_BACKGROUND_COMPILE"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


def test_opting_in_forks_the_compile_process_at_import():
    """TILEWISE_BACKGROUND_COMPILE=on starts the process when tilewise is imported: a fork (torch and
    tilewise imported already), whose output never reaches the program's."""
    script = textwrap.dedent("""
        print("before", flush=False)
        import torch, tilewise
        from tilewise.compiler.process import background
        child = background.PROCESS._child
        with tilewise.engine(mode="adaptive", threshold=1):
            for _ in range(3):
                x = (torch.ones(64, 64, device="neuron") * 2).sum().item()
        assert tilewise.wait_for_compiles(timeout=240)
        with tilewise.engine(mode="adaptive", threshold=1):
            x = (torch.ones(64, 64, device="neuron") * 2).sum().item()
        s = tilewise.stats()
        print(child is background.PROCESS._child, child.wait(0) is None, s.background_compiles >= 1,
              s.background_seconds > 0, s.ops_compiled > 0, x)
    """)
    env = {**os.environ, "TILEWISE_BACKGROUND_COMPILE": "on", "TILEWISE_MODE": "adaptive"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["before", "True", "True", "True", "True", "True", "8192.0"], out.stderr


def test_a_fresh_interpreter_compile_process_starts_none_of_its_own(monkeypatch):
    """Started as a fresh interpreter (this process has other threads), the compile process imports
    tilewise with background compiles off: it has no child."""
    monkeypatch.setenv("TILEWISE_BACKGROUND_COMPILE", "on")
    monkeypatch.setenv("TILEWISE_MODE", "adaptive")
    child = background._run()
    try:
        time.sleep(20)  # it has imported tilewise by now
        children = [p for p in os.listdir("/proc") if p.isdigit() and
                    open(f"/proc/{p}/stat").read().split(") ")[1].split()[1] == str(child.pid)]
        assert child.wait(0) is None and children == []
    finally:
        child.requests.close()
        if child.wait(10) is None:
            child.kill()


def test_a_daemonic_process_starts_none_at_import_and_one_when_a_block_needs_it(tmp_path):
    """A DataLoader worker (daemonic) imports tilewise without a compile process; a daemonic process
    running an adaptive block (benchmarks/run.py's contenders) gets one when a block needs it."""
    script = textwrap.dedent("""
        import multiprocessing, torch

        def work():
            import tilewise
            from tilewise.compiler.process import background
            at_import = background.PROCESS._child
            for _ in range(2):
                with tilewise.engine(mode="adaptive", threshold=1):
                    for _ in range(3):
                        (torch.ones(64, 64, device="neuron") * 2).sum().item()
                assert tilewise.wait_for_compiles(240)
            s = tilewise.stats()
            print(at_import is None, background.PROCESS.broken is None, s.background_compiles >= 1, s.ops_compiled > 0)

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=work, daemon=True)
            p.start(); p.join(); print(p.exitcode)
    """)
    path = tmp_path / "daemonic.py"
    path.write_text(script)
    env = {**os.environ, "TILEWISE_BACKGROUND_COMPILE": "on", "TILEWISE_MODE": "adaptive"}
    out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["True", "True", "True", "True", "0"], out.stderr


def test_a_fork_of_the_program_compiles_in_itself(process):
    """What a fork of the program (a worker of its own) gets from os.register_at_fork: none of the
    parent's jobs or process, and its compiles made in itself, said once; a fork of a program that
    never started a compile process may start its own."""
    assert process.start()
    child = process._child
    process.after_fork()
    assert process._child is None and not process._jobs and process.broken
    assert child.requests.closed and child.wait(60) is not None  # this test's copy was its only one
    fn, gm, inputs = _region()
    with pytest.warns(RuntimeWarning, match="a fork of the program"):
        compiled = compile_in_background(gm, inputs, tilewise.DEVICE.spec, "region1")
    assert not isinstance(compiled, background.Job) and len(compiled.kernels) > 0
    never = background.CompileProcess()
    never.after_fork()
    assert never.broken is None


def test_a_fork_made_after_compiles_compiles_and_builds_its_own():
    """The engine's compiler thread and native builder are threads: a fork copies neither, and
    before they were made again in the fork its first compile waited forever."""
    script = textwrap.dedent("""
        import os, torch, tilewise
        with tilewise.engine(mode="adaptive", threshold=1):
            for _ in range(3):
                (torch.ones(64, 64, device="neuron") * 2).sum().item()
        assert tilewise.stats().compiles >= 1
        pid = os.fork()
        if pid == 0:
            try:
                tilewise.stats().reset()
                with tilewise.engine(mode="adaptive", threshold=1):
                    for _ in range(3):
                        (torch.ones(32, 8, device="neuron") + 3).relu().sum().item()
                s = tilewise.stats()
                print(s.compiles >= 1 and s.ops_compiled > 0, flush=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True"], out.stderr


def test_a_program_that_compiled_in_the_background_exits_cleanly():
    """The threads that talk to the compile process are joined at exit: the reply thread used to
    end during the interpreter's finalisation, freeing its last job's tensors there, and the
    process aborted ("terminate called without an active exception", exit code 134) in half the
    runs of this TinyGPT training script; so did one whose C was being built as it exited."""
    script = textwrap.dedent("""
        import tilewise
        from tilewise.workloads import train_gpt
        train_gpt("neuron", mode="adaptive", steps=150)
        print(tilewise.stats().background_compiles > 0)
    """)
    env = {**os.environ, "TILEWISE_BACKGROUND_COMPILE": "on", "TILEWISE_CACHE_DIR": "off"}
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert (out.returncode, out.stdout.split()) == (0, ["True"]), out.stderr[-2000:]
