"""The on-disk compile cache trusts no file: entries are authenticated with a per-user key, read
only from this user's private regular files, and rebuilt from checked data. Every tampering below
is refused or neutralised: nothing it plants runs (a sentinel file stays absent) and results still
equal CPU PyTorch."""
import hashlib
import hmac
import json
import os
import stat
import threading
import warnings
from typing import NamedTuple

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler.cache import regions as cache, serialize
from tilewise.compiler import compile_graph
from tilewise.compiler.cache import disk as disk_files  # `disk` is the fixture below
from tilewise.compiler.passes.decompose import RECORDED_STRIDES

def _fn(x):
    return torch.abs(x) * 2 + 1


class Disk(NamedTuple):
    cache_dir: object  # pathlib.Path
    key_file: object
    sentinel: object   # a file the planted code would create

    def entry(self):
        (entry,) = self.cache_dir.glob("*.twc")
        return entry

    def sign(self, payload: bytes, key: bytes | None = None) -> bytes:
        """The entry a writer holding `key` (default: this user's key) would write."""
        key = self.key_file.read_bytes() if key is None else key
        return hmac.new(key, payload, hashlib.sha256).hexdigest().encode() + b"\n" + payload


@pytest.fixture(autouse=True)
def fresh_cache():
    cache.stats.reset()
    cache.clear_memory()
    yield
    cache.clear_memory()


@pytest.fixture
def disk(tmp_path):
    """A cache directory and key of this test's own; a first compile has written one entry."""
    disk = Disk(tmp_path / "cache", tmp_path / "config" / "tilewise" / "cache.key", tmp_path / "pwned")
    with tilewise.config.patch(cache_dir=str(disk.cache_dir), cache_key_file=str(disk.key_file)):
        x = torch.randn(6, 3)
        first = compile_graph(make_fx(_fn)(x), [x])
        assert cache.stats.compiles == 1 and cache.stats.disk_writes == 1 and first.kernels
        cache.clear_memory()
        yield disk


def _load_again(x=None) -> tuple:
    """Compile `_fn` with a cleared memory cache: served from disk or recompiled. Returns the
    region and how the counters moved."""
    x = torch.randn(6, 3) if x is None else x
    before = dict(vars(cache.stats))
    cache.clear_memory()
    compiled = compile_graph(make_fx(_fn)(x), [x])
    moved = {name: value - before[name] for name, value in vars(cache.stats).items() if value != before[name]}
    torch.testing.assert_close(compiled.run(x)[0], _fn(x))
    torch.testing.assert_close(compiled.interpret(x)[0], _fn(x))
    assert compiled.kernels
    return compiled, moved


def _edit(disk: Disk, change) -> None:
    """Rewrite the entry's payload with `change(entry dict)` and sign it with the user's key: what
    an attacker holding the key could do, so what the loader must survive on its own."""
    entry = disk.entry()
    payload = json.loads(entry.read_bytes().partition(b"\n")[2])
    change(payload)
    entry.write_bytes(disk.sign(json.dumps(payload).encode()))


def _nodes(payload: dict, op: str) -> list:
    return [n for n in payload["graph"]["nodes"] if n["op"] == op]


def _plant(disk: Disk) -> str:
    return f"__import__('pathlib').Path({str(disk.sentinel)!r}).touch()"


# -- a legitimate entry -------------------------------------------------------------------------------

def test_a_legitimate_entry_round_trips_from_disk(disk):
    compiled, moved = _load_again()
    assert moved == {"disk_hits": 1}  # no compile: the passes did not run again
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(disk.entry()) == 0o600 and mode(disk.cache_dir) == 0o700
    assert mode(disk.key_file) == 0o600 and mode(disk.key_file.parent) == 0o700
    assert len(disk.key_file.read_bytes()) == disk_files.KEY_BYTES
    assert not [p for p in disk.cache_dir.iterdir() if p.suffix != ".twc"]  # no temporary file left


def test_missing_directories_are_created_0700_whatever_the_umask(tmp_path):
    x = torch.randn(4, 3)
    cache_dir, key_file = tmp_path / "a" / "b" / "cache", tmp_path / "c" / "d" / "cache.key"
    old_umask = os.umask(0o002)
    try:
        with tilewise.config.patch(cache_dir=str(cache_dir), cache_key_file=str(key_file)):
            assert compile_graph(make_fx(_fn)(x), [x]).kernels
    finally:
        os.umask(old_umask)
    assert cache.stats.compiles == 1 and cache.stats.disk_writes == 1
    for directory in (tmp_path / "a", tmp_path / "a" / "b", cache_dir, tmp_path / "c", key_file.parent):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600


def test_the_key_is_made_once_even_when_threads_race_for_it(tmp_path):
    key_file = tmp_path / "keys" / "cache.key"
    keys, barrier = [], threading.Barrier(8)

    def make():
        barrier.wait()
        keys.append(disk_files._secret(str(key_file)))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and keys[0] == key_file.read_bytes()
    assert os.listdir(key_file.parent) == ["cache.key"]  # the losers' temporary files are gone


# -- entries written without the key ----------------------------------------------------------------

@pytest.mark.parametrize("forgery", ["op swapped, sha256 rehashed", "op swapped, signed with another key",
                                     "truncated", "mac edited", "not utf-8"])
def test_an_entry_written_without_the_key_is_refused(forgery, disk):
    entry = disk.entry()
    payload = entry.read_bytes().partition(b"\n")[2]
    swapped = payload.replace(b'"aten.abs.default"', b'"aten.neg.default"')
    assert swapped != payload
    entry.write_bytes({
        "op swapped, sha256 rehashed": hashlib.sha256(swapped).hexdigest().encode() + b"\n" + swapped,
        "op swapped, signed with another key": disk.sign(swapped, key=os.urandom(disk_files.KEY_BYTES)),
        "truncated": entry.read_bytes()[:-40],
        "mac edited": b"0" * 64 + b"\n" + payload,
        "not utf-8": disk.sign(b"\xff\xfe" + payload, key=os.urandom(disk_files.KEY_BYTES)),
    }[forgery])
    with pytest.warns(RuntimeWarning, match="not written with this user's key"):
        _, moved = _load_again()  # abs, not the planted neg
    assert moved == {"corrupt": 1, "compiles": 1, "disk_writes": 1}
    _, moved = _load_again()
    assert moved == {"disk_hits": 1}  # the recompiled entry was written back


def test_a_refused_mac_stops_before_the_payload_is_parsed(disk, monkeypatch):
    entry = disk.entry()
    payload = entry.read_bytes().partition(b"\n")[2]
    entry.write_bytes(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    parsed = []
    monkeypatch.setattr(cache.json, "loads", lambda *a, **k: parsed.append(a))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        _, moved = _load_again()
    assert parsed == [] and moved["corrupt"] == 1


def test_an_authentic_entry_under_another_key_name_is_refused(disk):
    """An entry moved to another region's file name verifies, but it is for another key."""
    entry = disk.entry()
    other = torch.randn(5, 2)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        entry.rename(disk.cache_dir / f"{cache.cache_key(make_fx(_fn)(other), [other], tilewise.DEVICE.spec)}.twc")
        _, moved = _load_again(other)
    assert moved == {"corrupt": 1, "compiles": 1, "disk_writes": 1}


# -- entries signed with the key: the loader checks on its own ----------------------------------------

def _inject_kwarg(disk):
    def change(payload):
        node = next(n for n in _nodes(payload, "call_function") if n["target"] == {"op": "aten.abs.default"})
        node["kwargs"] = {"dict": {f"x={_plant(disk)},y": 1}}
    return change


def _inject_node_name(disk):
    def change(payload):
        text = json.dumps(payload).replace('"abs_1"', json.dumps(f"abs_1 = {_plant(disk)}; abs_1"))
        payload.update(json.loads(text))
    return change


def _inject_placeholder(disk):
    def change(payload):
        (placeholder,) = _nodes(payload, "placeholder")
        placeholder["target"] = f"x={_plant(disk)}"
    return change


def _inject_placeholder_default(disk):
    def change(payload):
        (placeholder,) = _nodes(payload, "placeholder")
        placeholder["args"] = {"tuple": [_plant(disk)]}  # FX prints a placeholder's args as its default
    return change


def _inject_module_call(disk):
    def change(payload):
        node = next(n for n in _nodes(payload, "call_function") if n["target"] == {"op": "aten.abs.default"})
        node["op"], node["target"] = "call_method", f"__class__; {_plant(disk)}"
    return change


def _inject_foreign_op(disk):
    def change(payload):
        node = next(n for n in _nodes(payload, "call_function") if n["target"] == {"op": "aten.abs.default"})
        node["target"] = {"op": "aten.__class__.__init__"}
    return change


# what the loader does with each: refuse the entry (recompile), or rename and serve it
INJECTIONS = {"kwargs name": (_inject_kwarg, "refused"),
              "node name": (_inject_node_name, "renamed"),
              "placeholder target": (_inject_placeholder, "renamed"),
              "placeholder default": (_inject_placeholder_default, "refused"),
              "call_method node": (_inject_module_call, "refused"),
              "op outside the registry": (_inject_foreign_op, "refused")}


@pytest.mark.parametrize("injection", INJECTIONS)
def test_code_planted_in_a_signed_entry_never_runs(injection, disk):
    make, outcome = INJECTIONS[injection]
    _edit(disk, make(disk))
    assert b"pathlib" in disk.entry().read_bytes() or injection == "op outside the registry"
    if outcome == "refused":
        with pytest.warns(RuntimeWarning, match="corrupt"):
            compiled, moved = _load_again()
        assert moved == {"corrupt": 1, "compiles": 1, "disk_writes": 1}
    else:
        compiled, moved = _load_again()
        assert moved == {"disk_hits": 1}
    assert "pathlib" not in compiled.gm.code and "__import__" not in compiled.gm.code
    assert not disk.sentinel.exists()


@pytest.mark.parametrize("injection", INJECTIONS)
def test_the_loader_rebuilds_planted_graphs_without_running_them(injection, disk):
    """The graph loader alone: refuses the entry or renames what was planted."""
    make, outcome = INJECTIONS[injection]
    payload = json.loads(disk.entry().read_bytes().partition(b"\n")[2])
    make(disk)(payload)
    if outcome == "refused":
        with pytest.raises(tilewise.TilewiseError):
            serialize.graph_from_json(payload["graph"])
    else:
        gm, renamed = serialize.graph_from_json(payload["graph"])
        x = torch.randn(6, 3)
        torch.testing.assert_close(gm(x)[0], _fn(x))
        assert all(name.isidentifier() and name in {n.name for n in gm.graph.nodes} for name in renamed.values())
        assert "pathlib" not in gm.code
    assert not disk.sentinel.exists()


@pytest.mark.parametrize("consistent", [True, False])
def test_a_planted_constant_name_never_runs(consistent, tmp_path):
    """Constants (get_attr nodes) are renamed on load; one the graph names but the entry does not
    hold is refused."""
    constant, sentinel = torch.tensor([0.5, -1.0, 2.0]), tmp_path / "pwned"
    stored = serialize.graph_to_json(make_fx(lambda x: torch.tanh(x) + constant)(torch.randn(2, 3)))
    (node,) = [n for n in stored["nodes"] if n["op"] == "get_attr"]
    planted = f"{node['target']}; __import__('pathlib').Path({str(sentinel)!r}).touch()"
    stored["constants"][planted if consistent else node["target"]] = stored["constants"].pop(node["target"])
    node["target"] = planted if consistent else f"{node['target']}_other"
    if consistent:
        gm, _ = serialize.graph_from_json(stored)
        x = torch.randn(2, 3)
        torch.testing.assert_close(gm(x), torch.tanh(x) + constant)
        assert "pathlib" not in gm.code
    else:
        with pytest.raises(tilewise.TilewiseError, match="not a plain 'get_attr'"):
            serialize.graph_from_json(stored)
    assert not sentinel.exists()


def test_keywords_must_be_the_ops_own_arguments():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.div.Tensor_mode, (x, x), {"rounding_mode": "floor"}))
    stored = serialize.graph_to_json(torch.fx.GraphModule(torch.nn.Module(), g))
    gm, _ = serialize.graph_from_json(stored)
    t = torch.randn(3, 4) + 5
    torch.testing.assert_close(gm(t), torch.div(t, t, rounding_mode="floor"))
    for bad in ({"rounding": "floor"}, {"self": {"node": "x"}}):
        stored["nodes"][1]["kwargs"] = {"dict": bad}
        with pytest.raises(tilewise.TilewiseError, match="no keyword argument"):
            serialize.graph_from_json(stored)
    stored["nodes"][1]["kwargs"], stored["nodes"][1]["args"] = {"dict": {}}, {"tuple": [{"node": "x"}] * 4}
    with pytest.raises(tilewise.TilewiseError, match="positional"):
        serialize.graph_from_json(stored)



def test_recorded_strides_travel_with_the_graph_as_integers_only():
    """A compile process traces the graph it is sent: the strides CPU's kernels gave its ops'
    outputs go with it (decompose.recorded_layouts), and come back as integers or not at all."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    total = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    total.meta[RECORDED_STRIDES] = (4, 1)
    g.output((total,))
    stored = serialize.graph_to_json(torch.fx.GraphModule(torch.nn.Module(), g))
    gm, _ = serialize.graph_from_json(stored)
    (add,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
    assert add.meta[RECORDED_STRIDES] == (4, 1)
    for bad in ([4, "1; import os"], {"tuple": [4, 1]}, [4.0, 1]):
        stored["nodes"][1]["strides"] = bad
        with pytest.raises(tilewise.TilewiseError, match="malformed strides"):
            serialize.graph_from_json(stored)
    stored["nodes"][1].pop("strides")
    stored["nodes"][1]["layout"] = [4, 1]
    with pytest.raises(tilewise.TilewiseError, match="malformed node"):
        serialize.graph_from_json(stored)

# -- files and directories that are not the user's private ones ---------------------------------------

def _symlink_to_a_valid_copy(disk, entry):
    elsewhere = disk.cache_dir.parent / "elsewhere.twc"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)  # it verifies, but someone else may control where a link points


ENTRY_TAMPERING = {
    "symlinked entry": _symlink_to_a_valid_copy,
    "group-writable entry": lambda disk, entry: entry.chmod(0o620),
    "world-writable entry": lambda disk, entry: entry.chmod(0o606),
    "world-readable entry": lambda disk, entry: entry.chmod(0o644),
    "entry owned by another uid": lambda disk, entry: os.chown(entry, 12345, 12345),
    "fifo in place of the entry": lambda disk, entry: (entry.unlink(), os.mkfifo(entry)),
    "directory in place of the entry": lambda disk, entry: (entry.unlink(), entry.mkdir(mode=0o700)),
}


@pytest.mark.parametrize("tampering", ENTRY_TAMPERING)
def test_an_entry_that_is_not_a_private_regular_file_is_refused(tampering, disk):
    if tampering == "entry owned by another uid" and os.getuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    entry = disk.entry()
    ENTRY_TAMPERING[tampering](disk, entry)
    with pytest.warns(RuntimeWarning, match="entry refused"):
        _, moved = _load_again()
    if tampering == "directory in place of the entry":  # and the new entry cannot replace it
        assert moved == {"untrusted": 1, "compiles": 1, "disk_errors": 1}
        return
    assert moved == {"untrusted": 1, "compiles": 1, "disk_writes": 1}
    assert stat.S_ISREG(os.lstat(entry).st_mode) and stat.S_IMODE(os.lstat(entry).st_mode) == 0o600
    _, moved = _load_again()
    assert moved == {"disk_hits": 1}  # the entry written in its place is trusted


def _make_key_readable(disk):
    disk.key_file.chmod(0o644)


def _link_key(disk):
    elsewhere = disk.key_file.parent.parent / "elsewhere.key"
    disk.key_file.rename(elsewhere)
    disk.key_file.symlink_to(elsewhere)


DISK_TAMPERING = {
    "key readable by others": (_make_key_readable, "cache key"),
    "key writable by the group": (lambda disk: disk.key_file.chmod(0o620), "cache key"),
    "key a symlink": (_link_key, "symbolic link"),
    "key of the wrong length": (lambda disk: disk.key_file.write_bytes(b"short"), "32-byte key"),
    "key owned by another uid": (lambda disk: os.chown(disk.key_file, 12345, 12345), "owned by uid 12345"),
    "key directory world-writable": (lambda disk: disk.key_file.parent.chmod(0o777), "not private"),
    "cache directory group-writable": (lambda disk: disk.cache_dir.chmod(0o770), "not private"),
    "cache directory world-writable": (lambda disk: disk.cache_dir.chmod(0o777), "not private"),
    "cache directory owned by another uid": (lambda disk: os.chown(disk.cache_dir, 12345, 12345), "owned by uid"),
}


@pytest.mark.parametrize("tampering", DISK_TAMPERING)
def test_an_untrusted_key_or_directory_keeps_the_cache_in_memory(tampering, disk):
    if "another uid" in tampering and os.getuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    change, reason = DISK_TAMPERING[tampering]
    change(disk)
    files = sorted(os.listdir(disk.cache_dir))
    with pytest.warns(RuntimeWarning, match=reason):
        _, moved = _load_again()
    assert moved == {"untrusted": 1, "compiles": 1}  # the valid entry on disk is not read
    assert sorted(os.listdir(disk.cache_dir)) == files  # nor anything written


def test_a_symlinked_cache_directory_is_refused(disk):
    linked = disk.cache_dir.parent / "linked"
    linked.symlink_to(disk.cache_dir)
    with tilewise.config.patch(cache_dir=str(linked)), pytest.warns(RuntimeWarning, match="symbolic link"):
        _, moved = _load_again()
    assert moved == {"untrusted": 1, "compiles": 1}


def test_a_key_inside_the_cache_directory_is_refused(disk):
    with tilewise.config.patch(cache_key_file=str(disk.cache_dir / "sub" / "cache.key")), \
            pytest.warns(RuntimeWarning, match="inside the cache directory"):
        _, moved = _load_again()
    assert moved == {"untrusted": 1, "compiles": 1}
    assert not (disk.cache_dir / "sub").exists()


def test_the_warning_is_given_once_and_every_refusal_counted(disk):
    disk.cache_dir.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="not private"):
        _load_again()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, moved = _load_again()
    assert moved == {"untrusted": 1, "compiles": 1}


# -- the memory cache ---------------------------------------------------------------------------------

def test_the_cache_key_covers_everything_an_entry_depends_on():
    x = torch.randn(6, 3)
    gm, spec = make_fx(_fn)(x), tilewise.DEVICE.spec
    key = lambda inputs, s=spec: cache.cache_key(gm, inputs, s)  # noqa: E731
    base = torch.randn(7, 3)
    variants = {
        "requires_grad": key([x.clone().requires_grad_()]),
        "storage offset": key([base[1:]]),
        "strides": key([torch.randn(3, 6).t()]),
        "dtype": key([x.double()]),
        "device": key([torch.empty(6, 3, device="meta")]),
        "another spec": key([x], s=tilewise.device.PRESETS["trn3"]),
    }
    assert key([x]) == key([x.clone()])
    assert len({key([x]), *variants.values()}) == len(variants) + 1
    y = torch.randn(6, 3)
    two = make_fx(lambda a, b: a + b)(x, y)
    assert cache.cache_key(two, [x, x], spec) != cache.cache_key(two, [x, y], spec)  # aliased inputs


def test_a_region_served_under_another_name_is_labelled_with_it(disk):
    x = torch.randn(6, 3)
    first = compile_graph(make_fx(_fn)(x), [x], name="first")
    assert cache.stats.disk_hits == 1 and first.name == "first"
    second = compile_graph(make_fx(_fn)(x), [x], name="second")
    assert cache.stats.memory_hits == 1 and cache.stats.compiles == 1  # the fixture's compile only
    assert second.name == "second" and second.gm is first.gm and first.name == "first"
    assert second.passes_text[0].startswith("# second after pass: decompose")
    assert first.passes_text[0].startswith("# first after pass: decompose")


@pytest.mark.parametrize("name", ["os.system.default", "aten.__class__.__init__", "aten.not_an_op.default",
                                  "aten.add.Tensor.out", "aten.add", "builtins.eval.default", "aten.add.__call__"])
def test_an_op_name_resolves_only_to_a_registered_overload(name):
    with pytest.raises(tilewise.TilewiseError, match="not allowed|not registered"):
        serialize.decode({"op": name})


def test_stored_op_names_resolve_to_the_same_overloads():
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten._softmax.default, torch.ops.prims.convert_element_type.default):
        assert serialize.decode(json.loads(json.dumps(serialize.encode(op)))) is op
