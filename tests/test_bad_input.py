"""Bad input: every setting and public function refuses bad arguments with a message that names what
is allowed, and nothing a user can pass takes the interpreter down (checked in a subprocess)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import compile_graph
from tilewise.config import SETTINGS
from tilewise.device import PRESETS, TRN2, preset

BAD_VALUES = {
    "mode": ["fast", "", 3, None, ["eager"], "eager!", b"eager"],
    "threshold": [0, -1, 1.5, "three", "3", "", None, True, float("inf"), float("nan"), [3]],
    "device": ["trn9", "", 2, None, "cuda"],
    "cache_dir": [5, 1.5, ["/tmp"], object()],
    "cache_key_file": [5, 1.5, ["/tmp/key"], object()],
    "cache_limit_mb": [0, -1, 1.5, "lots", float("inf"), None],
    "recompile_limit": [-1, 0.5, "many", float("inf"), False],
    "generalise_limit": [-1, 1.5, "twice", float("nan"), None],
    "specialisation_limit": [0, -2, 2.5, "all", float("inf")],
    "max_segment_ops": [0, -5, 2.5, "lots", float("-inf")],
    "step_search_ops": [-1, 2.5, "often", float("inf"), None],
    "region_cache_size": [0, -1, 0.5, "big", float("nan")],
    "signature_cache_size": [0, -3, 2.5, "huge", "10", None],
    "timeline_events": [-1, 1.5, "all", float("inf")],
    "host_backend": ["fast", "", 3, None, "cuda", ["native"]],
    "host_allocator": ["cached", "", 0, None, "malloc", ["caching"]],
    "background_compile": ["yes", "", 1, True, None, ["on"]],
    "cores": [0, -2, 1.5, "8", float("nan")],
    "verify_ir": ["yes", "", 1, True, None, ["on"]],
    "attention_kernel": ["fast", "", 1, None, "cuda", ["flash"]],
}
# What the message must name: the allowed values, or the bound.
ALLOWED = {"mode": "eager, adaptive, compiled", "device": "trn2, trn3", "cache_dir": "directory path",
           "cache_key_file": "file path", "cache_limit_mb": ">= 1",
           "threshold": ">= 1", "recompile_limit": ">= 0", "max_segment_ops": ">= 1",
           "step_search_ops": ">= 0",
           "generalise_limit": ">= 0", "specialisation_limit": ">= 1",
           "region_cache_size": ">= 1", "signature_cache_size": ">= 1", "timeline_events": ">= 0",
           "host_backend": "native, torch", "host_allocator": "caching, system", "background_compile": "on, off", "cores": ">= 1",
           "verify_ir": "on, off", "attention_kernel": "cpu, flash"}


def test_every_setting_has_bad_values_listed():
    assert set(BAD_VALUES) == set(SETTINGS) == set(ALLOWED)


@pytest.mark.parametrize("name,value", [(n, v) for n, values in BAD_VALUES.items() for v in values
                                        if not (n in ("mode", "device", "threshold") and v is None)])
def test_config_patch_rejects_bad_values_naming_the_allowed_ones(name, value):
    before = tilewise.config.as_dict()
    with pytest.raises(tilewise.ConfigError) as error:
        with tilewise.config.patch(**{name: value}):
            pass
    assert ALLOWED[name] in str(error.value) and name in str(error.value)
    assert tilewise.config.as_dict() == before  # nothing half applied
    with pytest.raises(tilewise.ConfigError, match=ALLOWED[name]):
        setattr(tilewise.config, name, value)


@pytest.mark.parametrize("name,value", [(n, v) for n, values in BAD_VALUES.items() for v in values
                                        if isinstance(v, str) and v and not v.isdigit()])
def test_bad_environment_values_are_config_errors(name, value, monkeypatch):
    monkeypatch.setenv(SETTINGS[name].env, value)
    with pytest.raises(tilewise.ConfigError, match=ALLOWED[name]):
        getattr(tilewise.config, name)


def test_unknown_setting_lists_the_known_ones():
    with pytest.raises(tilewise.ConfigError, match="known: mode, threshold"):
        with tilewise.config.patch(mdoe="eager"):
            pass
    with pytest.raises(AttributeError, match="known: mode"):
        tilewise.config.speed


@pytest.mark.parametrize("kwargs", [{"mode": v} for v in BAD_VALUES["mode"] if v is not None]
                         + [{"threshold": v} for v in BAD_VALUES["threshold"] if v is not None])
def test_engine_rejects_bad_arguments_and_stays_usable(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(tilewise.ConfigError, match=ALLOWED[name]):
        with tilewise.engine(**kwargs):
            pass
    x = torch.randn(4).to("neuron")
    with tilewise.engine(mode="compiled"):
        torch.testing.assert_close((x * 2).cpu(), x.cpu() * 2)


def test_engine_unknown_argument_and_bad_device_setting():
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        with tilewise.engine(mode="eager", treshold=2):
            pass
    with tilewise.config.patch(device="trn3"):
        with tilewise.engine(mode="eager"):
            assert tilewise.DEVICE.spec.name == "trn3"
    with pytest.raises(tilewise.ConfigError, match="trn1, trn2, trn3"):
        os.environ["TILEWISE_DEVICE"] = "trn4"
        try:
            with tilewise.engine():
                pass
        finally:
            del os.environ["TILEWISE_DEVICE"]
    with tilewise.engine(mode="eager"):
        assert tilewise.DEVICE.spec.name in PRESETS


def test_sync_stats_and_reset_take_no_arguments():
    for fn in (tilewise.sync, tilewise.stats, tilewise.reset_caches):
        with pytest.raises(TypeError):
            fn("now")
    tilewise.sync()  # outside any engine: nothing pending, nothing happens
    assert "tilewise statistics" in tilewise.stats().report()


@pytest.mark.parametrize("device", ["neuron:8", 8, -1, "cuda", "cpu", "bogus", torch.device("cpu"), 1.0, True, [0]])
@pytest.mark.parametrize("fn", ["set_device", "synchronize", "memory_allocated", "max_memory_allocated",
                                "memory_stats", "reset_peak_memory_stats", "get_rng_state"])
def test_torch_neuron_functions_reject_other_devices(fn, device):
    if fn == "set_device" and device == -1:
        pytest.skip("torch.cuda.set_device ignores a negative index; so does torch.neuron's")
    with pytest.raises(tilewise.DeviceError, match="neuron:8|neuron:-1|'neuron'"):
        getattr(torch.neuron, fn)(device)


@pytest.mark.parametrize("device", [None, 0, "neuron", "neuron:0", torch.device("neuron", 0), 3, "neuron:7"])
def test_torch_neuron_functions_accept_the_device(device):
    with torch.neuron.device(0):  # set_device changes this thread's current device: restored after
        torch.neuron.set_device(device)
        torch.neuron.synchronize(device)
        assert torch.neuron.memory_allocated(device) == torch.neuron.memory_stats(device)["allocated_bytes.all.current"]
        torch.neuron.set_rng_state(torch.neuron.get_rng_state(device), device)
    assert torch.neuron.current_device() == 0


def test_torch_neuron_seed_and_state_reject_bad_values():
    with pytest.raises((TypeError, RuntimeError), match="long|int"):
        torch.neuron.manual_seed("seven")
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.neuron.set_rng_state(torch.zeros(3))
    with pytest.raises(tilewise.DeviceError, match="invalid device ordinal neuron:8"):
        torch.randn(3, device="neuron:8")


@pytest.mark.parametrize("name", ["trn4", "", "TRN2 ", None, 2])
def test_unknown_preset_lists_the_presets(name):
    with pytest.raises(tilewise.ConfigError, match="trn1, trn2, trn3"):
        preset(name)


@pytest.mark.parametrize("field,value", [("partitions", 0), ("partitions", 2.5), ("sbuf_bytes", -1),
                                         ("hbm_bandwidth", float("nan")), ("hbm_bytes", float("inf")),
                                         ("launch_overhead_s", -1e-6), ("name", ""), ("psum_banks", True),
                                         ("matmul_moving_free", "512"), ("sbuf_bytes", 1000)])
def test_device_spec_rejects_impossible_figures(field, value):
    with pytest.raises(tilewise.ConfigError, match=field):
        TRN2.replace(**{field: value})


def test_device_spec_presets_are_valid_and_replace_keeps_them_valid():
    for spec in PRESETS.values():
        assert spec.replace() == spec
    assert TRN2.replace(launch_overhead_s=0.0).launch_overhead_s == 0.0


def _graph():
    x = torch.randn(3, 4)
    return make_fx(lambda a: a.exp() + 1)(x), x


@pytest.mark.parametrize("bad,match", [
    (lambda gm, x: compile_graph(lambda a: a, [x]), "GraphModule"),
    (lambda gm, x: compile_graph(gm, x), "list or tuple"),
    (lambda gm, x: compile_graph(gm, []), "takes 1 inputs; got 0"),
    (lambda gm, x: compile_graph(gm, [x, x]), "takes 1 inputs; got 2"),
    (lambda gm, x: compile_graph(gm, ["x"]), "tensors or numbers"),
    (lambda gm, x: compile_graph(gm, [x], "trn2"), "DeviceSpec"),
    (lambda gm, x: compile_graph(gm, [x], TRN2, name=3), "name"),
])
def test_compile_graph_rejects_bad_arguments(bad, match):
    gm, x = _graph()
    with pytest.raises(tilewise.ConfigError, match=match):
        bad(gm, x)
    torch.testing.assert_close(compile_graph(gm, [x]).run(x)[0], x.exp() + 1)


def test_unusable_cache_dir_costs_the_cache_not_the_compile(tmp_path):
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("")
    gm, x = _graph()
    from tilewise.compiler.cache import regions as cache
    for directory in (a_file, a_file / "below"):
        cache.clear_memory()
        with tilewise.config.patch(cache_dir=str(directory)), pytest.warns(RuntimeWarning, match="memory only"):
            compiled = compile_graph(gm, [x])
        torch.testing.assert_close(compiled.run(x)[0], x.exp() + 1)
    cache.clear_memory()


CRASHERS = textwrap.dedent("""
    import torch, tilewise
    from tilewise.compiler import compile_graph
    x = torch.randn(4, 4).to("neuron")
    attempts = [
        lambda: torch.empty(2**62, device="neuron"),
        lambda: torch.zeros(2**40, device="neuron"),
        lambda: torch.randn(-1, device="neuron"),
        lambda: x.view(3, 7),
        lambda: x @ torch.randn(3, 3).to("neuron"),
        lambda: x + torch.randn(4, 4),
        lambda: x.to("neuron:3"),
        lambda: x[10],
        lambda: x.clone().resize_(5, 5),
        lambda: torch.neuron.manual_seed(2**80),
        lambda: compile_graph(None, None),
        lambda: tilewise.config.patch(mode=object()).__enter__(),
    ]
    for mode in ("eager", "adaptive", "compiled"):
        with tilewise.engine(mode=mode, threshold=1):
            for attempt in attempts:
                try:
                    attempt()
                except (RuntimeError, ValueError, TypeError, IndexError, OverflowError) as error:
                    pass
                y = (x * 2 + 1).sum()
                assert abs(y.item() - (x.cpu() * 2 + 1).sum().item()) < 1e-4
    print("survived", torch.neuron.memory_allocated() < 2**20)
""")


def test_nothing_a_user_passes_crashes_the_interpreter():
    out = subprocess.run([sys.executable, "-c", CRASHERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["survived", "True"], out.stdout + out.stderr[-2000:]


def _malformed(setting):
    """A value of the setting's environment variable that its check refuses, or None."""
    from tilewise.config import _number_from_environment
    for raw in ("bogus", "-5", "1.5", "1000000000"):
        value = _number_from_environment(raw) if isinstance(setting.default, int) or setting.number else raw
        try:
            setting.check(setting.env, value)
        except tilewise.ConfigError:
            return raw
    return None


@pytest.mark.parametrize("name", sorted(n for n, s in SETTINGS.items() if s.env))
def test_every_malformed_setting_fails_at_the_engine_block_with_its_allowed_values(name, monkeypatch):
    """TILEWISE_HOST_BACKEND=gpu ran a compiled block with no compile and no message (the compile
    read it and fell back to eager), TILEWISE_CACHE_LIMIT_MB=0 killed the native builder thread, and
    TILEWISE_CORES=1000000000 hung at start: each fails where the program enters the block."""
    setting = SETTINGS[name]
    raw = _malformed(setting)
    if raw is None:
        pytest.skip(f"{setting.env} accepts any text (a path)")
    monkeypatch.setenv(setting.env, raw)
    with pytest.raises(tilewise.ConfigError, match=setting.env):
        with tilewise.engine():
            pass


def test_the_core_count_is_bounded_by_what_is_simulated():
    with pytest.raises(tilewise.ConfigError, match="at most 128"):
        tilewise.config.validate("cores", 1_000_000_000)
    assert tilewise.config.validate("cores", 128) == 128
