"""The on-disk compile cache: private to the user, and an entry that fails verification is never
decoded, executed or unpickled."""
import hashlib
import json
import os
import pickle
import stat

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import cache, compile_graph, serialize


def _fn(x):
    return torch.exp(x) * 2 + 1


@pytest.fixture
def graph():
    x = torch.randn(5, 6)
    cache.clear_memory()
    yield make_fx(_fn)(x), x
    cache.clear_memory()


def test_cache_directory_is_created_private(tmp_path, graph):
    gm, x = graph
    directory = tmp_path / "a" / "cache"
    old_umask = os.umask(0o022)
    try:
        with tilewise.config.patch(cache_dir=str(directory)):
            compile_graph(gm, [x])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert list(directory.glob("*.twc"))


def test_a_directory_others_can_write_is_not_used(tmp_path, graph):
    gm, x = graph
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with tilewise.config.patch(cache_dir=str(shared)), pytest.warns(RuntimeWarning, match="not private"):
        compiled = compile_graph(gm, [x])
    torch.testing.assert_close(compiled.run(x)[0], _fn(x))
    assert not list(shared.iterdir())  # nothing written where others could swap it


def _tamper(entry, payload_edit):
    digest, _, payload = entry.read_bytes().partition(b"\n")
    entry.write_bytes(digest + b"\n" + payload_edit(payload))


@pytest.mark.parametrize("tampering", ["payload edited, digest stale", "digest edited", "not utf-8"])
def test_tampered_entry_is_never_decoded_executed_or_unpickled(tampering, tmp_path, graph, monkeypatch):
    gm, x = graph
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        compile_graph(gm, [x])
        cache.clear_memory()
        (entry,) = tmp_path.glob("*.twc")
        if tampering == "payload edited, digest stale":
            _tamper(entry, lambda p: p.replace(b"exp", b"log"))
        elif tampering == "digest edited":
            entry.write_bytes(b"0" * 64 + b"\n" + entry.read_bytes().partition(b"\n")[2])
        else:
            _tamper(entry, lambda p: b"\xff\xfe" + p)
        decoded = []
        for name in ("graph_from_json", "launch_from_json"):
            monkeypatch.setattr(cache, name, lambda *a, _n=name: decoded.append(_n))
        monkeypatch.setattr(cache.json, "loads", lambda *a, **k: decoded.append("json.loads"))
        monkeypatch.setattr(pickle, "loads", lambda *a, **k: decoded.append("pickle.loads"))
        monkeypatch.setattr(torch, "load", lambda *a, **k: decoded.append("torch.load"))
        corrupt, compiles = cache.stats.corrupt, cache.stats.compiles
        compiled = compile_graph(gm, [x])
    assert decoded == []  # the digest check refused it before anything read the payload
    assert cache.stats.corrupt == corrupt + 1 and cache.stats.compiles == compiles + 1
    torch.testing.assert_close(compiled.run(x)[0], _fn(x))  # recompiled: exp, not the planted log


def test_a_valid_entry_names_only_aten_and_prims_ops(tmp_path, graph):
    """Even a digest-valid entry holds only data: an op outside aten/prims is refused on load."""
    gm, x = graph
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        compile_graph(gm, [x])
        cache.clear_memory()
        (entry,) = tmp_path.glob("*.twc")
        payload = entry.read_bytes().partition(b"\n")[2].replace(b'"aten.exp.default"', b'"os.system.default"')
        assert b"os.system" in payload
        entry.write_bytes(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        corrupt = cache.stats.corrupt
        compiled = compile_graph(gm, [x])
    assert cache.stats.corrupt == corrupt + 1
    torch.testing.assert_close(compiled.run(x)[0], _fn(x))
    with pytest.raises(tilewise.TilewiseError, match="not allowed"):
        serialize.decode({"op": "os.system.default"})
    json.dumps(serialize.encode(torch.ops.aten.exp.default))  # what a real entry stores
