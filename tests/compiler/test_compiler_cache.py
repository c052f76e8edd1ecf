"""The on-disk compile cache: a second process compiles nothing (same key, same entry) and runs
the recorded graph as the first did; corrupt or tampered entries are recompiled."""
import os
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import compile_graph

SCRIPT = textwrap.dedent("""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from tilewise.compiler import compile_graph
    from tilewise.compiler.cache import regions as cache
    fn = lambda x, w: (torch.softmax(x * 2, -1), torch.relu(x @ w))
    x, w = torch.randn(130, 20), torch.randn(20, 7)
    compiled = compile_graph(make_fx(fn)(x, w), [x, w])
    got, tiles = compiled.run(x, w), compiled.interpret(x, w)
    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, fn(x, w))) and \\
        all(torch.allclose(a, b, atol=1e-5) for a, b in zip(tiles, got))
    exact = all(torch.equal(a, b) for a, b in zip(got, fn(x, w)))  # the recorded graph runs: CPU's kernels
    s = cache.stats
    print(s.compiles, s.disk_hits, s.corrupt, ok and exact, len(compiled.kernels))
""")


def _run(cache_dir, key_file) -> list[str]:
    env = {**os.environ, "TILEWISE_CACHE_DIR": str(cache_dir), "TILEWISE_CACHE_KEY_FILE": str(key_file)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_second_process_compiles_nothing_and_corruption_is_recompiled(tmp_path):
    cache_dir, key_file = tmp_path / "cache", tmp_path / "config" / "cache.key"
    assert _run(cache_dir, key_file) == ["1", "0", "0", "True", "2"]
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = key_file.read_bytes()
    assert _run(cache_dir, key_file) == ["0", "1", "0", "True", "2"]
    assert key_file.read_bytes() == key  # made once, then used by every process
    (entry,) = [p for p in cache_dir.iterdir() if p.suffix == ".twc"]
    entry.write_bytes(entry.read_bytes()[:-40])  # truncated
    assert _run(cache_dir, key_file) == ["1", "0", "1", "True", "2"]
    assert _run(cache_dir, key_file) == ["0", "1", "0", "True", "2"]  # the recompiled entry was written back


def test_a_second_process_with_another_key_trusts_no_entry(tmp_path):
    cache_dir = tmp_path / "cache"
    assert _run(cache_dir, tmp_path / "mine.key") == ["1", "0", "0", "True", "2"]
    assert _run(cache_dir, tmp_path / "theirs.key") == ["1", "0", "1", "True", "2"]


def test_tampered_payload_with_stale_mac_is_rejected(tmp_path):
    fn = lambda x: torch.exp(x) + 1
    x = torch.randn(4, 5)
    gm = make_fx(fn)(x)
    with tilewise.config.patch(cache_dir=str(tmp_path / "cache"), cache_key_file=str(tmp_path / "cache.key")):
        compile_graph(gm, [x])
        cache.clear_memory()
        (entry,) = list((tmp_path / "cache").glob("*.twc"))
        entry.write_bytes(entry.read_bytes().replace(b"exp", b"log"))
        corrupt, compiles = cache.stats.corrupt, cache.stats.compiles
        with pytest.warns(RuntimeWarning, match="corrupt"):
            compiled = compile_graph(gm, [x])
    assert cache.stats.corrupt == corrupt + 1 and cache.stats.compiles == compiles + 1
    torch.testing.assert_close(compiled.run(x)[0], fn(x))
    cache.clear_memory()


@torch.library.custom_op("tilewise_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_region_naming_ops_an_entry_may_not_is_kept_in_memory_never_written_as_corrupt(tmp_path):
    """What the decoder refuses is never written: such an entry was refused as corrupt by every
    later process (a tensor-parallel step region, before the functional collectives' namespace was
    admitted), with a warning each run."""
    fn = lambda x: _twice(x) + 1  # noqa: E731
    x = torch.randn(4, 5)
    gm = make_fx(fn)(x)
    with tilewise.config.patch(cache_dir=str(tmp_path / "cache"), cache_key_file=str(tmp_path / "cache.key")), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        unstorable = cache.stats.unstorable
        torch.testing.assert_close(compile_graph(gm, [x]).run(x)[0], fn(x))
        assert cache.stats.unstorable == unstorable + 1
        assert not list((tmp_path / "cache").glob("*.twc"))
        cache.clear_memory()
        corrupt = cache.stats.corrupt
        torch.testing.assert_close(compile_graph(gm, [x]).run(x)[0], fn(x))
        assert cache.stats.corrupt == corrupt
    cache.clear_memory()


TRAINING = textwrap.dedent("""
    import torch, tilewise
    from tilewise.compiler.cache import regions as cache
    from tilewise.workloads import MLP

    def train(device):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(16, 32).to(device), torch.randint(0, 10, (16,)).to(device)
        losses = []
        for _ in range(6):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    # CPU's losses bitwise: deterministic algorithms keep the regions on their recorded graphs (by
    # default the trial may pick a region's C by timing, within tolerance for cross_entropy's log_softmax)
    torch.use_deterministic_algorithms(True)
    expected = train("cpu")
    with tilewise.engine(mode="adaptive"):
        got = train("neuron")
    s, engine = cache.stats, tilewise.stats()
    print(tilewise.config.cache_dir, s.compiles, s.disk_hits, s.disk_writes, got == expected,
          engine.ops_compiled > 0, engine.compiles, engine.cached_compiles)
""")


def _train_with_default_settings(home, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TILEWISE_") and not k.startswith("XDG_")}
    out = subprocess.run([sys.executable, "-c", TRAINING], env={**clean, "HOME": str(home), **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_by_default_a_second_run_of_a_program_loads_its_regions_from_the_users_cache(tmp_path):
    home = tmp_path / "home"
    directory = str(home / ".cache" / "tilewise")
    directory_, compiles, hits, writes, same, compiled, regions, cached = _train_with_default_settings(home)
    assert (directory_, hits, same, compiled, cached) == (directory, "0", "True", "True", "0")
    assert int(compiles) >= 1 and writes == compiles == regions  # every region compiled was kept
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / ".config" / "tilewise" / "cache.key").st_mode) == 0o600
    entries = sorted(p.name for p in (home / ".cache" / "tilewise").iterdir())
    assert len([e for e in entries if e.endswith(".twc")]) == int(compiles)
    # the second run of the same program compiles nothing, computes the same losses, and says so
    assert _train_with_default_settings(home) == [directory, "0", compiles, "0", "True", "True", regions, regions]


def test_xdg_cache_home_moves_the_default_and_off_keeps_regions_in_memory(tmp_path):
    xdg = tmp_path / "xdg"
    directory, compiles, hits, writes, same, compiled, _, _ = _train_with_default_settings(
        tmp_path / "home", XDG_CACHE_HOME=str(xdg))
    assert directory == str(xdg / "tilewise") and writes == compiles != "0" and same == compiled == "True"
    home = tmp_path / "home2"
    assert _train_with_default_settings(home, TILEWISE_CACHE_DIR="off")[:4] == ["None", compiles, "0", "0"]
    assert not (home / ".cache").exists()
    # a relative XDG_CACHE_HOME is ignored, as the XDG spec says
    assert _train_with_default_settings(home, XDG_CACHE_HOME="relative")[0] == str(home / ".cache" / "tilewise")


@pytest.mark.parametrize("value", [None, "", "off", "OFF", " off "])
def test_cache_dir_off_none_or_empty_is_memory_only(value):
    with tilewise.config.patch(cache_dir=value):
        assert tilewise.config.cache_dir is None


def _sines(k: int):
    """A different 60-op graph per k: its entry is ~280 KB (mostly the pass log)."""
    def fn(x):
        for i in range(60):
            x = torch.sin(x * (1.0 + k) + i)
        return x
    return fn


def test_the_disk_cache_keeps_within_its_limit_deleting_the_least_recently_used(tmp_path):
    x = torch.randn(8, 8)
    graphs = [make_fx(_sines(k))(x) for k in range(4)]
    directory = tmp_path / "cache"
    names = [f"{cache.cache_key(gm, [x], tilewise.DEVICE.spec)}.twc" for gm in graphs]
    with tilewise.config.patch(cache_dir=str(directory), cache_key_file=str(tmp_path / "cache.key"),
                               cache_limit_mb=1, host_backend="torch"):
        for gm in graphs[:3]:
            compile_graph(gm, [x])
            time.sleep(0.01)  # distinct modification times
        assert sorted(os.listdir(directory)) == sorted(names[:3])
        assert 3 * 200_000 < sum(os.path.getsize(directory / n) for n in names[:3]) <= 2**20
        cache.clear_memory()
        hits, evictions = cache.stats.disk_hits, cache.stats.evictions
        compile_graph(graphs[0], [x])  # read: now the most recently used
        assert cache.stats.disk_hits == hits + 1
        time.sleep(0.01)
        compiled = compile_graph(graphs[3], [x])  # past 1 MiB: the least recently used goes
        assert sorted(os.listdir(directory)) == sorted([names[0], names[2], names[3]])
        assert cache.stats.evictions == evictions + 1
        assert sum(os.path.getsize(directory / n) for n in os.listdir(directory)) <= 0.9 * 2**20
        torch.testing.assert_close(compiled.run(x)[0], _sines(3)(x), rtol=0, atol=0)
        cache.clear_memory()
        compiles = cache.stats.compiles
        compile_graph(graphs[1], [x])  # evicted: compiled again, and kept again
        assert cache.stats.compiles == compiles + 1 and names[1] in os.listdir(directory)
    cache.clear_memory()


def test_a_region_whose_own_ops_refuse_zeros_compiles_and_keeps_its_recorded_graph(tmp_path, monkeypatch):
    """The smoke run feeds zeros; lu_solve refuses zero pivots on the CPU as well, so a zero run
    says nothing of the decomposition: the region compiles (a linalg.solve step's backward failed
    to, and ran eagerly), runs its recorded graph, and never builds C from the unchecked
    decomposed graph, compiled or served from the disk cache."""
    torch.manual_seed(0)
    A, b, x = torch.randn(3, 4, 4) + 4 * torch.eye(4), torch.randn(3, 4, 2), torch.randn(130, 20)
    LU, pivots = torch.linalg.lu_factor(A)
    # with a part the C tier builds a kernel for (it does, were the region checked)
    fn = lambda LU, pivots, b, x: (torch.linalg.lu_solve(LU, pivots, b) * 2, x.tanh() * 2 + x.sin())  # noqa: E731
    inputs = [LU, pivots, b, x]
    monkeypatch.setenv("TILEWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILEWISE_CACHE_KEY_FILE", str(tmp_path / "cache.key"))
    with tilewise.config.patch(host_backend="native"):
        for served_from_disk in (False, True):
            cache.clear_memory()
            disk_hits = cache.stats.disk_hits
            compiled = compile_graph(make_fx(fn)(*inputs), inputs, native_after_runs=1)
            assert compiled.native.kernels
            for _ in range(3):
                got = compiled.run(*inputs)
            assert all(torch.equal(g, e) for g, e in zip(got, fn(*inputs)))
            assert compiled.wait_native(30).value == "torch" and compiled.unchecked
            assert cache.stats.disk_hits == disk_hits + served_from_disk


_SPATIAL_TRANSFORMER = textwrap.dedent("""
    import torch, torch.nn.functional as F, tilewise

    def train(device, mode):
        torch.manual_seed(0)
        loc, head = torch.nn.Linear(64, 6).to(device), torch.nn.Linear(64, 3).to(device)
        optimizer = torch.optim.Adam([*loc.parameters(), *head.parameters()], lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        with tilewise.engine(mode=mode):
            for _ in range(4):
                x = torch.randn(2, 1, 8, 8, generator=generator).to(device)
                grid = F.affine_grid(loc(x.flatten(1)).view(-1, 2, 3), list(x.shape), align_corners=False)
                sampled = F.grid_sample(x, grid, align_corners=False, padding_mode="border")
                F.cross_entropy(head(sampled.flatten(1)), torch.tensor([0, 2]).to(device)).backward()
                optimizer.step()
                optimizer.zero_grad()
        return [p.detach().cpu() for p in [*loc.parameters(), *head.parameters()]]

    torch.use_deterministic_algorithms(True)
    expected = train("cpu", "eager")
    assert all(torch.equal(g, e) for g, e in zip(train("neuron", "compiled"), expected))
    assert tilewise.stats().ops_compiled > 0 and tilewise.stats().ops_eager == 0, tilewise.stats().report()
    print("ok")
""")


def test_the_smoke_run_never_feeds_an_op_the_nan_that_zeros_make():
    """The smoke run's zeros made an Adam step divide by its bias correction at step 0: NaN
    parameters, a NaN sampling grid, and CPU's grid_sampler_2d_backward indexing memory by a NaN
    coordinate took the process down (a segfault on the compiler thread). In a process of its own,
    with the step finder off: its 4 steps that never read are one 256-op segment, which the finder
    would search and run eagerly, and the test is of the smoke run of that segment's compile."""
    done = subprocess.run([sys.executable, "-c", _SPATIAL_TRANSFORMER], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TILEWISE_CACHE_DIR="off", TILEWISE_STEP_SEARCH_OPS="0"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_linalg_solve_step_compiles_with_cpu_s_values(mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 16)
    device_model = torch.nn.Linear(4, 16).to("neuron")
    device_model.load_state_dict(model.state_dict())

    def train(model, device):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        for _ in range(8):
            A = model(torch.randn(3, 4, generator=generator).to(device)).view(3, 4, 4) + 4 * torch.eye(4).to(device)
            loss = torch.linalg.solve(A, torch.ones(3, 4, 1).to(device)).pow(2).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
        return [p.detach().cpu() for p in model.parameters()]

    torch.use_deterministic_algorithms(True)
    try:
        expected = train(model, "cpu")
        with tilewise.engine(mode=mode):
            got = train(device_model, "neuron")
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    stats = tilewise.stats()
    assert stats.ops_compiled > 0
    assert not [reason for (_, reason) in stats.fallbacks if reason.startswith("compile failed")], stats.report()


def test_a_full_disk_costs_the_cache_its_entry_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A 64 KiB file system under the cache left a `.tmp-*` file behind at every write that ran out
    of room, run after run."""
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    fn = lambda x: torch.tanh(x) * 3  # noqa: E731
    x = torch.randn(6, 7)
    with tilewise.config.patch(cache_dir=str(tmp_path / "cache"), cache_key_file=str(tmp_path / "cache.key")):
        compile_graph(make_fx(torch.sin)(x), [x])  # the directory and its key made, one entry written
        monkeypatch.setattr("tilewise.compiler.cache.disk.os.fsync", full)
        errors = cache.stats.disk_errors
        with pytest.warns(RuntimeWarning, match="No space left"):
            compiled = compile_graph(make_fx(fn)(x), [x])
        assert torch.equal(compiled.run(x)[0], fn(x))
    assert cache.stats.disk_errors == errors + 1
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")] == []
    assert len(list((tmp_path / "cache").glob("*.twc"))) == 1
    cache.clear_memory()
