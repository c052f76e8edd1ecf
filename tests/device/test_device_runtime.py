"""The simulated NeuronCore's runtime: torch.neuron, HBM accounting and OOM, configuration, device
specs, the cost model and the timeline."""
import gc
import json
import math

import pytest
import torch

import tilewise
from tilewise.config import SETTINGS
from tilewise.device import TRN2, TRN3
from tilewise.device.cost import kernel_seconds

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.fixture
def device_spec():
    """Restore the device's spec (and HBM capacity) that a test switches."""
    saved = tilewise.DEVICE.spec
    yield tilewise.DEVICE
    tilewise.DEVICE.use_spec(saved)


@pytest.fixture
def small_hbm():
    """HBM with 64 KiB free beyond what is in use now."""
    gc.collect()
    hbm = tilewise.DEVICE.hbm
    saved = hbm.capacity
    hbm.capacity = hbm.in_use + 64 * KiB
    yield hbm
    hbm.capacity = saved


@pytest.fixture
def timeline():
    tl = tilewise.DEVICE.timeline
    tl.reset()
    return tl


# ---- torch.neuron ------------------------------------------------------------------------------

def test_torch_neuron_mirrors_torch_cuda_surface():
    assert torch.neuron.is_available() is True
    assert torch.neuron.device_count() == 8  # a Trainium2 chip's NeuronCores
    assert torch.neuron.current_device() == 0
    assert torch.neuron.synchronize() is None
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == torch.neuron.max_memory_allocated()
    assert torch.device("neuron").type == "neuron"


def test_memory_allocated_follows_tensor_lifetimes_including_views():
    gc.collect()
    start = torch.neuron.memory_allocated()
    a = torch.empty(1000, device="neuron")
    assert torch.neuron.memory_allocated() == start + 4000
    b = torch.ones(10, 10, dtype=torch.float64, device="neuron")
    assert torch.neuron.memory_allocated() == start + 4000 + 800
    view = a[100:200].view(10, 10)
    assert torch.neuron.memory_allocated() == start + 4800  # a view allocates nothing
    del a
    assert torch.neuron.memory_allocated() == start + 4800  # the view keeps the base's buffer
    del view
    assert torch.neuron.memory_allocated() == start + 800
    c = torch.randn(8, 8).to("neuron") @ torch.randn(8, 8).to("neuron")  # inputs die at once
    assert torch.neuron.memory_allocated() == start + 800 + 256
    del b, c
    assert torch.neuron.memory_allocated() == start


def test_peak_and_reset_peak_memory_stats():
    gc.collect()
    torch.neuron.reset_peak_memory_stats()
    start = torch.neuron.memory_allocated()
    assert torch.neuron.max_memory_allocated() == start
    big = torch.empty(10_000, device="neuron")
    del big
    assert torch.neuron.max_memory_allocated() == start + 40_000
    assert torch.neuron.memory_allocated() == start
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == start
    assert torch.neuron.memory_stats()["hbm_capacity_bytes"] == tilewise.DEVICE.hbm.capacity


# ---- torch.accelerator: the device-generic API, with neuron as the accelerator -------------------

def test_accelerator_synchronize_computes_pending_lazy_work_and_checks_the_device():
    x = torch.randn(64).to("neuron")
    with tilewise.engine(mode="adaptive"):
        y = x * 2 + 1
        assert tilewise.DEVICE.lazy_pending
        torch.accelerator.synchronize()
        assert not tilewise.DEVICE.lazy_pending
        torch.accelerator.synchronize("neuron:1")
        torch.accelerator.synchronize(0)
    torch.testing.assert_close(y.cpu(), x.cpu() * 2 + 1)
    with pytest.raises(tilewise.DeviceError, match="invalid device ordinal"):
        torch.accelerator.synchronize("neuron:99")
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.synchronize("cuda:0")


def test_accelerator_memory_functions_answer_as_torch_neuron():
    gc.collect()
    start = torch.accelerator.memory_allocated()
    assert start == torch.neuron.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    big = torch.empty(10_000, device="neuron")
    assert torch.accelerator.memory_allocated() == torch.accelerator.memory_reserved() == start + 40_000
    del big
    assert torch.accelerator.memory_allocated() == start
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.max_memory_reserved() == start + 40_000
    stats = torch.accelerator.memory_stats()
    assert stats == dict(sorted(torch.neuron.memory_stats().items()))  # PyTorch's flattening of ours
    assert stats["allocation.all.allocated"] >= 1
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocation.all.allocated"] == 0
    free, total = torch.accelerator.get_memory_info()
    assert (free, total) == torch.neuron.mem_get_info() and total == tilewise.DEVICE.hbm.capacity
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()  # crashed the interpreter (no host allocator)
    assert torch.accelerator.memory_allocated("neuron:1") == torch.neuron.memory_allocated(1)


def test_accelerator_capability_lists_dtypes_a_neuron_tensor_holds_and_converts():
    dtypes = torch.accelerator.get_device_capability()["supported_dtypes"]
    assert torch.float32 in dtypes and torch.bfloat16 in dtypes and torch.qint8 not in dtypes
    for dtype in dtypes:
        host = torch.arange(6).reshape(2, 3).to(dtype)
        on_device = host.to("neuron")
        assert on_device.dtype == dtype
        torch.testing.assert_close(on_device.cpu(), host)


def test_benchmark_timer_works_with_tilewise_imported():
    """torch.utils.benchmark synchronizes the accelerator around each measurement: importing
    tilewise made it raise for every program, CPU-only ones included."""
    from torch.utils.benchmark import Timer

    a = torch.randn(8)
    assert Timer("a + a", globals={"a": a}).timeit(10).mean > 0
    assert Timer("a + a", globals={"a": a.to("neuron")}).timeit(10).mean > 0


def test_accelerator_entries_pass_through_when_neuron_is_not_the_accelerator(monkeypatch):
    from tilewise import patches
    from tilewise.device.accelerator import answer_accelerator_api

    entry = torch._C._accelerator_getDeviceCapability
    answer_accelerator_api()
    assert torch._C._accelerator_getDeviceCapability is entry  # one layer, however often installed
    assert patches.original("torch._C:_accelerator_getDeviceCapability") is not entry
    monkeypatch.setattr(torch._C, "_accelerator_getAccelerator", lambda: None)
    with pytest.raises(RuntimeError, match="doesn't support getting device capabilities"):
        torch._C._accelerator_getDeviceCapability(0)  # PyTorch's own, which knows no neuron


# ---- simulated HBM out of memory ----------------------------------------------------------------

def _check_oom(error, hbm, requested):
    assert isinstance(error, torch.OutOfMemoryError)
    assert isinstance(error, tilewise.NeuronOutOfMemoryError)
    assert (error.requested, error.in_use, error.capacity) == (requested, hbm.in_use, hbm.capacity)
    message = str(error)
    assert "tried to allocate" in message and "in use" in message and "capacity" in message


def test_factory_oom_reports_request_usage_capacity_and_keeps_tensors(small_hbm):
    x = torch.randn(256)
    keep = x.to("neuron")
    in_use = small_hbm.in_use
    with pytest.raises(tilewise.NeuronOutOfMemoryError) as info:
        torch.zeros(64 * KiB, device="neuron")  # 256 KiB of float32
    _check_oom(info.value, small_hbm, 256 * KiB)
    assert "256.00 KiB" in str(info.value)
    assert small_hbm.in_use == in_use
    assert torch.equal(keep.cpu(), x)
    assert torch.equal((keep * 2).cpu(), x * 2)
    assert torch.ones(1024, device="neuron").sum().item() == 1024  # what fits still fits


def test_transfer_oom(small_hbm):
    with pytest.raises(tilewise.NeuronOutOfMemoryError) as info:
        torch.ones(128 * KiB, dtype=torch.uint8).to("neuron")
    _check_oom(info.value, small_hbm, 128 * KiB)


def test_oom_in_a_compute_op_keeps_inputs_and_accounting(small_hbm):
    col, row = torch.randn(200, 1), torch.randn(1, 200)
    a, b = col.to("neuron"), row.to("neuron")
    in_use = small_hbm.in_use
    with pytest.raises(torch.OutOfMemoryError) as info:
        a @ b  # 200 x 200 float32 = 160000 B > 64 KiB free
    _check_oom(info.value, small_hbm, 200 * 200 * 4)
    assert small_hbm.in_use == in_use
    assert torch.equal(a.cpu(), col) and torch.equal(b.cpu(), row)
    torch.testing.assert_close((b @ a).cpu(), row @ col)


def test_buffers_freed_but_not_yet_settled_change_no_usage_peak_or_fit(small_hbm):
    """The HBM uncounts dead storages at the next allocation (hbm.track); in use, peak and what fits
    stay exact."""
    small_hbm.reset_peak()
    base = small_hbm.in_use
    x = torch.ones(1024, device="neuron")  # 4 KiB
    for _ in range(200):  # each op frees the buffer before, often at the same address
        x = x + 1
    assert small_hbm.in_use == base + 4 * KiB
    assert small_hbm.stats()["allocated_bytes.all.peak"] == base + 8 * KiB  # input and output at most
    assert torch.equal(x.cpu(), torch.full((1024,), 201.0))
    free = small_hbm.capacity - small_hbm.in_use
    for _ in range(20):  # dead buffers again, left counted until an allocation needs their room
        x = x + 1
    filler = torch.zeros(free, dtype=torch.uint8).to("neuron")  # exactly what is free: fits
    assert small_hbm.in_use == small_hbm.capacity
    with pytest.raises(tilewise.NeuronOutOfMemoryError):
        x + 1
    del filler
    assert torch.equal((x + 1).cpu(), torch.full((1024,), 222.0))


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2**40, 2**20, device="neuron"),
    lambda: torch.empty(2**62, dtype=torch.uint8, device="neuron"),
    lambda: torch.zeros(10**13, device="neuron"),
    lambda: torch.randn(10**13, device="neuron"),
    lambda: torch.full((10**13,), 1.0, device="neuron"),
    lambda: torch.arange(10**13, device="neuron"),
    lambda: torch.empty_strided((10**7, 10**7), (1, 10**7), device="neuron"),
])
def test_absurd_factory_sizes_fail_with_device_oom_before_the_host_allocates(make):
    in_use = tilewise.DEVICE.hbm.in_use
    with pytest.raises(tilewise.NeuronOutOfMemoryError, match="tried to allocate"):
        make()  # a host allocation of this size would raise a different error or exhaust RAM
    assert tilewise.DEVICE.hbm.in_use == in_use


# ---- configuration -----------------------------------------------------------------------------

def test_bad_tilewise_device_env_is_rejected_listing_the_presets(monkeypatch, device_spec):
    x = torch.randn(3)
    n = x.to("neuron")
    monkeypatch.setenv("TILEWISE_DEVICE", "trn9")
    with pytest.raises(tilewise.ConfigError, match="trn9") as info:
        tilewise.config.device
    assert "trn2" in str(info.value) and "trn3" in str(info.value)
    with pytest.raises(tilewise.ConfigError) as info:
        tilewise.DEVICE.refresh_from_config()
    assert "trn2" in str(info.value) and "trn3" in str(info.value)
    assert tilewise.DEVICE.spec is TRN2 and tilewise.DEVICE.hbm.capacity == 96 * GiB // 8
    assert torch.equal((n + 1).cpu(), x + 1)


def test_tilewise_device_trn3_switches_the_spec(monkeypatch, device_spec):
    x = torch.randn(3)
    n = x.to("neuron")
    monkeypatch.setenv("TILEWISE_DEVICE", "trn3")
    assert tilewise.config.device == "trn3"
    tilewise.DEVICE.refresh_from_config()
    assert tilewise.DEVICE.spec.name == "trn3"
    assert tilewise.DEVICE.hbm.capacity == 144 * GiB // 8 == torch.neuron.memory_stats()["hbm_capacity_bytes"]
    assert torch.equal((n * 3).cpu(), x * 3)


BAD_SETTINGS = [
    ("mode", "bogus", ["eager", "adaptive", "compiled"]),
    ("mode", 3, ["eager", "adaptive", "compiled"]),
    ("threshold", 0, [">= 1"]),
    ("threshold", "many", [">= 1"]),
    ("threshold", 2.5, [">= 1"]),
    ("threshold", True, [">= 1"]),
    ("device", "trn9", ["trn2", "trn3"]),
    ("cache_dir", 3, ["directory path"]),
    ("recompile_limit", -1, [">= 0"]),
    ("max_segment_ops", 0, [">= 1"]),
    ("region_cache_size", 0, [">= 1"]),
    ("timeline_events", -5, [">= 0"]),
]


@pytest.mark.parametrize("name,value,allowed", BAD_SETTINGS)
def test_every_setting_rejects_bad_values_listing_what_is_allowed(name, value, allowed):
    before = tilewise.config.as_dict()
    with pytest.raises(tilewise.ConfigError) as info:
        with tilewise.config.patch(**{name: value}):
            pytest.fail("patch accepted a bad value")
    for text in [name, *allowed]:
        assert text in str(info.value)
    assert tilewise.config.as_dict() == before


@pytest.mark.parametrize("env,value,allowed", [
    ("TILEWISE_MODE", "fast", "eager, adaptive, compiled"),
    ("TILEWISE_THRESHOLD", "0", ">= 1"),
    ("TILEWISE_RECOMPILE_LIMIT", "lots", ">= 0"),
])
def test_bad_environment_values_are_rejected(monkeypatch, env, value, allowed):
    monkeypatch.setenv(env, value)
    name = next(n for n, s in SETTINGS.items() if s.env == env)
    with pytest.raises(tilewise.ConfigError, match=env) as info:
        getattr(tilewise.config, name)
    assert allowed in str(info.value)


def test_config_patch_sets_and_restores_and_unknown_setting_is_named():
    with tilewise.config.patch(mode="EAGER ", threshold=5):
        assert tilewise.config.mode == "eager" and tilewise.config.threshold == 5
    assert tilewise.config.threshold == 3
    with pytest.raises(tilewise.ConfigError, match="known: mode"):
        with tilewise.config.patch(nonsense=1):
            pass
    with pytest.raises(AttributeError):
        tilewise.config.nonsense


# ---- device specs ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,sbuf_partition,hbm_core,bandwidth_core", [
    (TRN2, 192 * KiB, 96 * GiB // 8, 2.9e12 / 8),
    (TRN3, 256 * KiB, 144 * GiB // 8, 4.9e12 / 8),
])
def test_device_spec_presets_follow_the_published_figures(spec, sbuf_partition, hbm_core, bandwidth_core):
    assert spec.partitions == 128
    assert spec.sbuf_partition_bytes == sbuf_partition
    assert spec.psum_bytes == 2 * MiB and spec.psum_banks == 8 and spec.psum_bank_bytes == 2 * KiB
    assert spec.psum_bytes // spec.partitions == 16 * KiB
    assert spec.matmul_stationary_free == 128 and spec.matmul_moving_free == 512
    assert spec.matmul_moving_free * 4 == spec.psum_bank_bytes  # one bank of fp32
    assert spec.hbm_bytes == hbm_core and spec.hbm_bandwidth == pytest.approx(bandwidth_core)
    assert spec.tensor_flops_bf16 == pytest.approx(79e12) and spec.tensor_flops_fp32 == pytest.approx(20e12)
    assert spec.scalar_hz == pytest.approx(1.2e9) and spec.scalar_elems_per_cycle == 128
    assert spec.vector_elems_per_cycle == 256
    assert spec.launch_overhead_s > 0
    assert tilewise.device.PRESETS[spec.name] is spec
    with pytest.raises(tilewise.ConfigError, match="trn1, trn2, trn3"):
        tilewise.device.preset("trn4")


def test_trn1_preset_follows_the_published_figures():
    spec = tilewise.device.PRESETS["trn1"]
    assert spec.tensor_hz == 2.8e9 and spec.tensor_flops_bf16 == pytest.approx(91.75e12, rel=1e-3)
    assert spec.vector_hz == 1.12e9 and spec.vector_elems_per_cycle == 128 and spec.scalar_hz == 1.4e9
    assert spec.hbm_bandwidth == pytest.approx(820e9 / 2) and spec.cores_per_chip == 2
    assert spec.dma_queues == 16 and spec.dma_queue_bandwidth == 17e9


# ---- cost model and timeline -------------------------------------------------------------------

def test_matmul_is_charged_to_the_tensor_engine_with_pytorch_flops(timeline):
    M, K, N = 64, 32, 48
    a, b = torch.randn(M, K).to("neuron"), torch.randn(K, N).to("neuron")
    timeline.reset()
    a @ b
    (kernel,) = timeline.events
    assert kernel.engine == "TensorEngine"
    assert kernel.flops == 2 * M * N * K
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        torch.randn(M, K) @ torch.randn(K, N)
    assert kernel.flops == counter.get_total_flops()
    spec = tilewise.DEVICE.spec
    hbm_bytes = (M * K + K * N + M * N) * 4
    assert kernel.hbm_bytes == hbm_bytes
    # the matmul's tile program played by the timing model: slower than the roofline (DMA fixed
    # costs and efficiency, the matmul start-up), as fast as what it is made of allows
    roofline = spec.launch_overhead_s + max(hbm_bytes / spec.hbm_bandwidth, 2 * M * N * K / spec.tensor_flops_fp32)
    assert kernel.duration == pytest.approx(kernel_seconds(spec, "TensorEngine", (M * K + K * N) * 4, M * N * 4,
                                                           2 * M * N * K, torch.float32, (M, N)))
    assert kernel.duration > roofline


@pytest.mark.parametrize("op,engine", [
    (torch.exp, "ScalarEngine"),
    (torch.tanh, "ScalarEngine"),
    (lambda t: t + t, "VectorEngine"),
    (lambda t: t * 2, "VectorEngine"),
    (lambda t: t.sum(), "VectorEngine"),
    (lambda t: t.clone(), "DMA"),
])
def test_elementwise_ops_are_charged_to_their_engine(timeline, op, engine):
    x = torch.randn(16, 16).to("neuron")
    timeline.reset()
    op(x)
    assert [k.engine for k in timeline.events] == [engine]
    assert timeline.events[0].flops == 0 and timeline.events[0].duration >= tilewise.DEVICE.spec.launch_overhead_s


def test_views_charge_nothing(timeline):
    x = torch.randn(4, 6).to("neuron")
    timeline.reset()
    x.t(); x.view(24); x[1:, ::2]; x.transpose(0, 1); x.as_strided((2, 2), (1, 6)); x.unsqueeze(0); x.expand(2, 4, 6)
    assert timeline.kernels == 0 and timeline.clock == 0.0 and not timeline.events


def test_allocations_and_unsafe_view_charge_nothing_but_a_fill_is_a_kernel(timeline):
    x = torch.randn(4, 6).to("neuron")
    timeline.reset()
    torch.empty(3, 5, device="neuron"); torch.empty_like(x); x.new_empty((2, 2)); torch.empty_strided((2, 3), (1, 2), device="neuron")
    torch.ops.aten._unsafe_view(x, [24])
    assert timeline.kernels == 0 and not timeline.events
    torch.zeros(3, 5, device="neuron")
    assert [k.name for k in timeline.events] == ["zero_"]  # zeros = empty + zero_: one kernel


def test_clock_is_the_sum_of_kernel_durations_in_order(timeline):
    x = torch.randn(32, 32).to("neuron")
    timeline.reset()
    y = (x @ x).exp() + x
    y.sum()
    events = list(timeline.events)
    assert [k.name for k in events] == ["mm", "exp", "add", "sum"]
    assert timeline.clock == pytest.approx(math.fsum(k.duration for k in events))
    for previous, current in zip(events, events[1:]):
        assert current.start == pytest.approx(previous.start + previous.duration)


def test_chrome_trace_is_valid_trace_event_json_with_one_lane_per_engine(tmp_path, timeline):
    x = torch.randn(16, 16).to("neuron")
    timeline.reset()
    (x @ x).exp().add(1).clone()
    path = timeline.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(lanes) >= {"TensorEngine", "VectorEngine", "ScalarEngine", "DMA"}
    assert len(set(lanes.values())) == len(lanes)
    kernels = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in kernels] == ["mm", "exp", "add", "clone"]
    by_name = {e["name"]: e for e in kernels}
    assert by_name["mm"]["tid"] == lanes["TensorEngine"] and by_name["exp"]["tid"] == lanes["ScalarEngine"]
    assert by_name["add"]["tid"] == lanes["VectorEngine"] and by_name["clone"]["tid"] == lanes["DMA"]
    for e in kernels:
        assert {"pid", "tid", "ts", "dur", "name"} <= set(e) and e["dur"] > 0
    assert kernels[1]["ts"] == pytest.approx(kernels[0]["ts"] + kernels[0]["dur"])  # microseconds


def test_memory_bound_op_is_faster_on_trn3_hbm(timeline, device_spec):
    x = torch.randn(1 << 20).to("neuron")
    durations = {}
    for spec in (TRN2, TRN3):
        device_spec.use_spec(spec)
        timeline.reset()
        x + x
        durations[spec.name] = timeline.events[0].duration
    for spec in (TRN2, TRN3):
        hbm_bytes = 3 * 4 * (1 << 20)
        assert hbm_bytes / spec.hbm_bandwidth > (1 << 20) / (spec.vector_hz * spec.vector_elems_per_cycle)
        # below the HBM roofline: per-transfer DMA costs and efficiency (the timing model)
        assert durations[spec.name] > spec.launch_overhead_s + hbm_bytes / spec.hbm_bandwidth
    assert durations["trn3"] < durations["trn2"]


_FLOP_CALLS = {
    "mm": (torch.ops.aten.mm.default, lambda: (torch.randn(3, 4), torch.randn(4, 5))),
    "addmm": (torch.ops.aten.addmm.default, lambda: (torch.randn(5), torch.randn(3, 4), torch.randn(4, 5))),
    "baddbmm": (torch.ops.aten.baddbmm.default, lambda: (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    "conv stride 1": (torch.ops.aten.convolution.default,
                      lambda: (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),
    "conv stride 2": (torch.ops.aten.convolution.default,
                      lambda: (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)),
    "conv backward, no input grad": (torch.ops.aten.convolution_backward.default,
                                     lambda: (torch.randn(2, 4, 6, 6), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), [4],
                                              [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])),
}


def test_remembered_flop_counts_equal_pytorchs_formulas():
    """The executor remembers each flop count per shapes and arguments (PyTorch's formulas spend
    ~30 us in pytree a call): every call, first or remembered, counts what the formula counts."""
    from torch.utils.flop_counter import flop_registry
    from tilewise.eager.plan import plan_of

    for op, make in _FLOP_CALLS.values():  # the two convolutions share one op's remembered counts
        args = make()
        out = op(*args)
        want = flop_registry[op._overloadpacket](*args, out_val=out)
        assert [plan_of(op).flops(*args, out_val=out) for _ in range(2)] == [want, want]
    assert plan_of(torch.ops.aten.add.Tensor).flops is None  # no formula: charged by elements
