"""The on-disk compile cache: a second process compiles nothing; corrupt entries are recompiled."""
import os
import stat
import subprocess
import sys
import textwrap

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import cache, compile_graph

SCRIPT = textwrap.dedent("""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from tilewise.compiler import cache, compile_graph
    fn = lambda x, w: (torch.softmax(x * 2, -1), torch.relu(x @ w))
    x, w = torch.randn(130, 20), torch.randn(20, 7)
    compiled = compile_graph(make_fx(fn)(x, w), [x, w])
    got, tiles = compiled.run(x, w), compiled.interpret(x, w)
    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, fn(x, w))) and \\
        all(torch.allclose(a, b, atol=1e-5) for a, b in zip(tiles, got))
    s = cache.stats
    print(s.compiles, s.disk_hits, s.corrupt, ok, len(compiled.kernels))
""")


def _run(cache_dir) -> list[str]:
    env = {**os.environ, "TILEWISE_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_second_process_compiles_nothing_and_corruption_is_recompiled(tmp_path):
    cache_dir = tmp_path / "cache"
    assert _run(cache_dir) == ["1", "0", "0", "True", "2"]
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert _run(cache_dir) == ["0", "1", "0", "True", "2"]
    (entry,) = [p for p in cache_dir.iterdir() if p.suffix == ".twc"]
    entry.write_bytes(entry.read_bytes()[:-40])  # truncated
    assert _run(cache_dir) == ["1", "0", "1", "True", "2"]
    assert _run(cache_dir) == ["0", "1", "0", "True", "2"]  # the recompiled entry was written back


def test_tampered_payload_with_stale_digest_is_rejected(tmp_path):
    fn = lambda x: torch.exp(x) + 1
    x = torch.randn(4, 5)
    gm = make_fx(fn)(x)
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        compile_graph(gm, [x])
        cache.clear_memory()
        (entry,) = list(tmp_path.glob("*.twc"))
        entry.write_bytes(entry.read_bytes().replace(b"exp", b"log"))
        corrupt = cache.stats.corrupt
        compiled = compile_graph(gm, [x])
    assert cache.stats.corrupt == corrupt + 1
    torch.testing.assert_close(compiled.run(x)[0], fn(x))
