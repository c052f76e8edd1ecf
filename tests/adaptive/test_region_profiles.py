"""Per-region profiles in stats(): where a compiled region's device time goes (busiest engine, each
engine's active share, the roofline point), the very Profile the cost pass made and explain() prints."""
import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import compile_graph
from tilewise.compiler.cache import regions as cache
from tilewise.device import timing
from tilewise.device.runtime import DEVICE


def matmul_step(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def elementwise_step(x, y):
    return (x * 2 + y) * y


def _compiled_once(fn, *cpu_args):
    with tilewise.engine(mode="compiled"):
        got = fn(*[a.to("neuron") for a in cpu_args]).cpu()
    return got


def _only_region():
    (region,) = tilewise.stats().regions.values()
    return region


def test_a_matmul_region_profile_is_its_launches_profile_and_shows_the_tensor_engine():
    x, w1, w2 = torch.randn(256, 512), torch.randn(512, 512), torch.randn(512, 256)
    got = _compiled_once(matmul_step, x, w1, w2)
    torch.testing.assert_close(got, matmul_step(x, w1, w2))
    stats = tilewise.stats()
    assert stats.compiles == 1 and stats.ops_compiled >= 3
    region = _only_region()
    profile = region.profile
    assert isinstance(profile, timing.Profile)
    shares = dict(profile.shares)
    assert shares["TensorEngine"] > 0.05 and all(0 <= s <= 1 for s in shares.values())
    assert profile.busiest == max(shares, key=shares.get)
    assert 0 < profile.flops_share <= 1 and 0 < profile.hbm_share <= 1
    peak = DEVICE.spec.tensor_flops_fp32
    assert abs(profile.flops_per_s / peak - profile.flops_share) < 1e-9
    # one source of truth: the cost pass's launch profiles, which explain() prints
    text = tilewise.explain(region.name)
    launches = [line.strip().removeprefix("#").strip() for line in text.splitlines() if line.strip().startswith("#   busiest")]
    assert launches and (len(launches) > 1 or launches[0] == str(profile))
    # one run's time: the region's simulated seconds per run
    assert abs(profile.seconds - region.simulated_seconds) <= 1e-12 + 1e-9 * profile.seconds


def test_an_elementwise_region_is_dma_or_vector_bound_with_no_flops():
    x, y = torch.randn(512, 1024), torch.randn(512, 1024)
    got = _compiled_once(elementwise_step, x, y)
    assert torch.equal(got, elementwise_step(x, y))
    assert tilewise.stats().compiles == 1
    profile = _only_region().profile
    shares = dict(profile.shares)
    assert "TensorEngine" not in shares and profile.flops_per_s == 0 and profile.flops_share == 0
    assert profile.busiest in ("DMA", "VectorEngine") and shares["VectorEngine"] > 0
    assert 0 < profile.hbm_share <= 1 and all(0 <= s <= 1 for s in shares.values())


def test_profiles_are_in_the_report_and_the_exported_dict():
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    _compiled_once(elementwise_step, x, y)
    stats = tilewise.stats()
    region = _only_region()
    assert f"{region.name}: {region.profile}" in stats.report()
    exported = json.loads(json.dumps(stats.to_dict()))["regions"][region.name]["profile"]
    assert timing.Profile.from_dict(exported) == region.profile
    assert exported["busiest"] == region.profile.busiest and set(exported["shares"]) == set(dict(region.profile.shares))


def test_a_region_from_the_disk_cache_keeps_its_launch_profiles():
    x, w = torch.randn(130, 20), torch.randn(20, 7)
    gm = make_fx(lambda x, w: (torch.softmax(x * 2, -1), torch.relu(x @ w)))(x, w)
    compiled = compile_graph(gm, [x, w])
    assert compiled.profiles and all(p is not None for p in compiled.profiles)
    decoded = cache._decode(cache.entry_payload("key", compiled), "key", compiled.spec, gm, [x, w])
    assert decoded is not None and decoded.profiles == compiled.profiles
