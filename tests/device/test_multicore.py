"""Several NeuronCores in one process: neuron:0 ... neuron:N-1, each with its own HBM, timeline and
statistics; torch.neuron's device API and streams as torch.cuda has them; every mode computes on
neuron:1 what the CPU computes."""
import contextlib
import copy
import gc
import io
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import tilewise
from tilewise.adaptive.runtime import CORE_CHANGE
from tilewise.compiler.backend import backend_stats
from tilewise.testing.conformance import assert_compiled_if_lazy

MODES = ["eager", "adaptive", "compiled"]
STEPS = 4  # adaptive compiles a region after `threshold` (3) identical flushes
CORES = tilewise.DEVICE.cores
SAME_DEVICE = re.escape("Expected all tensors to be on the same device, but found at least two devices, "
                        "neuron:0 and neuron:1!")


@pytest.fixture(autouse=True)
def current_device_restored():
    """set_device changes this thread's current device: every test starts and ends on neuron:0."""
    torch.neuron.set_device(0)
    yield
    torch.neuron.set_device(0)


def _engine(mode):
    """The engine in `mode`; None: no engine block at all."""
    return tilewise.engine(mode=mode) if mode else contextlib.nullcontext()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _train(model, device, steps, mode=None):
    """SGD-momentum steps on a fixed batch; the losses read each step (a sync point)."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with _engine(mode):
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


# ---- torch.neuron's device API -----------------------------------------------------------------

def test_a_process_has_the_eight_cores_of_a_trainium2_chip():
    assert torch.neuron.device_count() == 8 == len(CORES)
    assert torch.neuron.is_initialized() and torch.neuron.is_available()
    assert [core.device for core in CORES] == [torch.device("neuron", i) for i in range(8)]


def test_set_device_and_the_device_context_choose_where_factories_and_transfers_go():
    assert torch.neuron.current_device() == 0
    assert torch.ones(2, device="neuron").device == torch.device("neuron", 0)
    with torch.neuron.device(2):
        assert torch.neuron.current_device() == 2
        assert torch.ones(2, device="neuron").device == torch.device("neuron", 2)
        assert torch.randn(2, device="neuron").device == torch.device("neuron", 2)
        assert torch.arange(3, device=torch.device("neuron")).device == torch.device("neuron", 2)
        assert torch.ones(2).neuron().device == torch.device("neuron", 2)
        assert torch.nn.Linear(2, 2).neuron().weight.device == torch.device("neuron", 2)
        assert torch.ones(2).to("neuron:2").device == torch.device("neuron", 2)
        assert torch.tensor([1.0], device="neuron:2").device == torch.device("neuron", 2)
        with torch.neuron.device("neuron:5"):
            assert torch.zeros(1, device="neuron").device == torch.device("neuron", 5)
        assert torch.neuron.current_device() == 2
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device("neuron:3")
    assert torch.neuron.current_device() == 3
    assert torch.empty(1, device=torch.device("neuron")).device == torch.device("neuron", 3)
    x = torch.ones(1, device="neuron:6")
    with torch.neuron.device_of(x):
        assert torch.neuron.current_device() == 6
    assert torch.neuron.current_device() == 3


def test_where_pytorch_asks_the_device_guard_an_unindexed_neuron_is_neuron_0():
    """A known limit, not CUDA's behaviour: `.to("neuron")` and `torch.tensor(..., device="neuron")`
    get their index in C++ from the device guard, and the Python guard of a PrivateUse1 backend
    (torch/csrc/acc/Module.cpp, PythonDeviceGuard) answers 0 whatever set_device said. Name the
    core ("neuron:2", torch.device("neuron", rank)) there. A tensor's own new_tensor keeps its core."""
    x = torch.ones(1, device="neuron:1")
    with torch.neuron.device(2):
        assert torch.ones(2).to("neuron").device == torch.device("neuron", 0)
        assert torch.tensor([1.0], device="neuron").device == torch.device("neuron", 0)
        assert x.new_tensor([1.0, 2.0]).device == torch.device("neuron", 1)


def test_the_current_device_is_per_thread_as_for_cuda():
    torch.neuron.set_device(4)
    seen = []
    thread = threading.Thread(target=lambda: seen.append((torch.neuron.current_device(),
                                                          torch.ones(1, device="neuron").device)))
    thread.start()
    thread.join(timeout=60)
    assert seen == [(0, torch.device("neuron", 0))]
    assert torch.neuron.current_device() == 4


@pytest.mark.parametrize("mode", [None, *MODES])
def test_one_op_on_two_cores_raises_pytorchs_error_and_loses_nothing(mode):
    a, b = torch.randn(3), torch.randn(3)
    x, y = a.to("neuron:0"), b.to("neuron:1")
    with _engine(mode):
        for op in (torch.add, torch.mul, lambda p, q: torch.cat([p, q]), lambda p, q: p.add_(q)):
            with pytest.raises(RuntimeError, match=SAME_DEVICE):
                op(x, y)
        total = (x * 2 + 1).cpu(), (y - 1).cpu()
    torch.testing.assert_close(total[0], a * 2 + 1, rtol=0, atol=0)
    torch.testing.assert_close(total[1], b - 1, rtol=0, atol=0)
    torch.testing.assert_close(x.cpu(), a, rtol=0, atol=0)


def test_a_core_that_does_not_exist_is_cudas_invalid_device_ordinal():
    for make in (lambda: torch.ones(1, device="neuron:8"), lambda: torch.ones(1).to("neuron:8"),
                 lambda: torch.neuron.set_device(8), lambda: torch.neuron.memory_allocated(8),
                 lambda: torch.neuron.device(8)):
        with pytest.raises(tilewise.DeviceError, match=r"invalid device ordinal neuron:8 "
                                                        r"\(torch.neuron.device_count\(\) == 8\)"):
            make()


# ---- per-core memory and timeline ----------------------------------------------------------------

def test_each_core_counts_its_own_hbm():
    gc.collect()
    before = [torch.neuron.memory_allocated(i) for i in range(8)]
    torch.neuron.reset_peak_memory_stats(1)
    x = torch.empty(1000, device="neuron:1")
    y = torch.empty(250, device="neuron:2")
    assert torch.neuron.memory_allocated(1) == before[1] + 4000
    assert torch.neuron.memory_allocated("neuron:2") == before[2] + 1000
    assert torch.neuron.memory_allocated(0) == before[0]
    assert torch.neuron.memory_stats(1)["allocated_bytes.all.current"] == before[1] + 4000
    z = x.to("neuron:3")  # a copy on neuron:3; neuron:1 keeps its own
    assert torch.neuron.memory_allocated(3) == before[3] + 4000
    assert torch.neuron.memory_allocated(1) == before[1] + 4000
    del x, y, z
    gc.collect()
    assert [torch.neuron.memory_allocated(i) for i in range(8)] == before
    assert torch.neuron.max_memory_allocated(1) == before[1] + 4000
    torch.neuron.reset_peak_memory_stats(1)
    assert torch.neuron.max_memory_allocated(1) == before[1]
    with torch.neuron.device(1):
        assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated() == before[1]


def test_a_cores_out_of_memory_error_leaves_the_other_cores_free():
    gc.collect()
    hbm = CORES[1].hbm
    saved = hbm.capacity
    hbm.capacity = hbm.in_use + 1024
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1024, device="neuron:1")
        assert torch.empty(1024, device="neuron:2").device == torch.device("neuron", 2)
    finally:
        hbm.capacity = saved


def test_moving_between_cores_copies_the_data_and_charges_a_transfer_to_the_receiving_core():
    a = torch.randn(64, 32)
    x = a.to("neuron:1")
    kernels = [core.timeline.kernels for core in CORES]
    y = x.to("neuron:3")
    transfer = CORES[3].timeline.events[-1]
    assert y.device == torch.device("neuron", 3)
    torch.testing.assert_close(y.cpu(), a, rtol=0, atol=0)
    assert transfer.name == "_to_copy neuron:1->neuron:3" and transfer.engine == "DMA"
    assert transfer.hbm_bytes == 2 * a.numel() * a.element_size() and transfer.duration > 0
    # one kernel more on neuron:3 (the transfer; then the read of y back to the host)
    assert [core.timeline.kernels for core in CORES] == [k + 2 * (i == 3) for i, k in enumerate(kernels)]
    y.add_(1)  # a copy, not a view of neuron:1's buffer
    torch.testing.assert_close(x.cpu(), a, rtol=0, atol=0)
    z = torch.zeros(64, 32, device="neuron:2")
    z.copy_(x)
    assert CORES[2].timeline.events[-1].name == "copy_ neuron:1->neuron:2"
    torch.testing.assert_close(z.cpu(), a, rtol=0, atol=0)


def test_each_core_is_a_process_of_its_own_in_the_trace(tmp_path):
    for core in CORES:
        core.timeline.reset()
    torch.ones(4, device="neuron:1").mul(2)
    torch.ones(4, device="neuron:0").mul(3)
    trace = CORES[1].timeline.chrome_trace()["traceEvents"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert "NeuronCore 1 (simulated clock)" in names
    kernels = [e for e in trace if e["ph"] == "X" and e["pid"] == 11]
    assert [e["name"] for e in kernels] == ["fill_", "mul"] and all(e["tid"] > 1000 for e in kernels)
    merged = json.loads(open(tilewise.DEVICE.export_chrome_trace(str(tmp_path / "t.json"))).read())["traceEvents"]
    by_core = {pid: [e["name"] for e in merged if e["ph"] == "X" and e["pid"] == pid] for pid in (1, 11, 12)}
    assert by_core == {1: ["fill_", "mul"], 11: ["fill_", "mul"], 12: []}


# ---- every mode computes on neuron:1 what the CPU computes --------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_training_on_neuron_1_matches_cpu_and_charges_only_neuron_1(mode):
    reference = _mlp()
    want = _train(copy.deepcopy(reference), "cpu", 2 * STEPS)
    model = copy.deepcopy(reference).to("neuron:1")
    assert {p.device for p in model.parameters()} == {torch.device("neuron", 1)}
    kernels, counted = [core.timeline.kernels for core in CORES], tilewise.stats().kernels
    got = _train(model, "neuron:1", 2 * STEPS, mode)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert p.device == torch.device("neuron", 1) and p.grad is None, name
    assert_compiled_if_lazy(mode)
    charged = [core.timeline.kernels - k for core, k in zip(CORES, kernels)]
    assert charged[1] > 0 and sum(charged) == charged[1], charged
    assert tilewise.stats().kernels - counted == charged[1]  # the statistics sum over cores


@pytest.mark.parametrize("mode", MODES)
def test_a_program_using_two_cores_keeps_each_segment_on_one_core(mode):
    """A lazy segment never mixes cores: an op on another core starts a new segment there."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)

    def program(x, y):
        p = (x @ x).relu() + 1         # on x's core
        q = (y * 3).sin().sum(0)       # on y's core
        r = p.sum(0).to(y.device) + q  # a transfer, then on y's core
        return r.cpu()

    want = program(a, b)
    x, y = a.to("neuron:0"), b.to("neuron:1")
    kernels = [core.timeline.kernels for core in CORES]
    with _engine(mode):
        for _ in range(STEPS):
            got = program(x, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    charged = [core.timeline.kernels - k for core, k in zip(CORES, kernels)]
    assert charged[0] > 0 and charged[1] > 0 and sum(charged[2:]) == 0
    if mode != "eager":
        assert tilewise.stats().flush_reasons[CORE_CHANGE] >= STEPS
    assert_compiled_if_lazy(mode)


def test_backward_through_a_transfer_between_cores_gives_cpu_gradients():
    w_cpu = torch.randn(5, 5, requires_grad=True)
    (w_cpu.sin() * 2).sum().backward()
    w = w_cpu.detach().to("neuron:0").requires_grad_()
    (w.to("neuron:2").sin() * 2).sum().backward()
    assert w.grad.device == torch.device("neuron", 0)
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad, rtol=0, atol=0)


def test_torch_compile_on_neuron_1_charges_neuron_1():
    def f(x):
        return (x.sin() * x).sum(-1)

    compiled = torch.compile(f, backend="tilewise", fullgraph=True)
    a = torch.randn(4, 8)
    graphs = backend_stats.graphs_compiled
    kernels = CORES[1].timeline.kernels
    out = compiled(a.to("neuron:1"))
    assert backend_stats.graphs_compiled > graphs
    assert out.device == torch.device("neuron", 1)
    torch.testing.assert_close(out.cpu(), f(a))
    assert CORES[1].timeline.kernels > kernels
    torch._dynamo.reset()


# ---- checkpoints -------------------------------------------------------------------------------

def _saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("weights_only", [True, False])
def test_checkpoints_remember_their_core_and_map_location_moves_them(weights_only):
    a = torch.randn(3, 4)
    saved = _saved({"x": a.to("neuron:1"), "y": a.to("neuron:0")})
    loaded = torch.load(saved, weights_only=weights_only)
    assert (loaded["x"].device, loaded["y"].device) == (torch.device("neuron", 1), torch.device("neuron", 0))
    saved.seek(0)
    moved = torch.load(saved, map_location={"neuron:1": "neuron:2"}, weights_only=weights_only)
    assert (moved["x"].device, moved["y"].device) == (torch.device("neuron", 2), torch.device("neuron", 0))
    cpu = torch.load(_saved(a), map_location="neuron:1", weights_only=weights_only)
    assert cpu.device == torch.device("neuron", 1)
    torch.testing.assert_close(cpu.cpu(), a, rtol=0, atol=0)
    with torch.neuron.device(4):
        assert torch.load(_saved(a), map_location="neuron", weights_only=weights_only).device == \
            torch.device("neuron", 4)


# ---- streams and events ------------------------------------------------------------------------

def test_streams_follow_torch_cuda_semantics():
    default = torch.neuron.current_stream()
    assert default == torch.neuron.default_stream() == torch.neuron.default_stream(0)
    assert default.device == torch.device("neuron", 0) and default.query()
    side = torch.neuron.Stream(device="neuron:1", priority=-1)
    assert side.device == torch.device("neuron", 1) and side != torch.neuron.default_stream(1)
    with torch.neuron.stream(side):
        assert torch.neuron.current_stream(1) is side and torch.neuron.current_device() == 1
        assert torch.ones(1, device="neuron").device == torch.device("neuron", 1)
    assert torch.neuron.current_stream(1) == torch.neuron.default_stream(1)
    assert torch.neuron.current_device() == 0
    side.wait_stream(default)
    event = side.record_event()
    default.wait_event(event)
    event.wait(default)
    assert event.query() and isinstance(event, torch.Event) and isinstance(side, torch.Stream)
    torch.accelerator.current_stream().wait_event(event)  # PyTorch's own stream takes ours
    event.synchronize()
    side.synchronize()
    with torch.neuron.stream(None):
        assert torch.neuron.current_device() == 0


@pytest.mark.parametrize("mode", [None, "adaptive"])
def test_timed_events_measure_the_cores_simulated_time(mode):
    x = torch.randn(128, 128, device="neuron:1")
    stream = torch.neuron.current_stream(1)
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with _engine(mode):
        start.record(stream)
        clock = CORES[1].timeline.clock
        y = (x @ x).relu()
        end.record(stream)
    spent = CORES[1].timeline.clock - clock
    assert spent > 0 and start.elapsed_time(end) == pytest.approx(spent * 1e3)
    untimed = torch.neuron.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        untimed.elapsed_time(end)
    del y


# ---- the `cores` setting -------------------------------------------------------------------------

def test_the_cores_setting_sets_the_number_of_cores():
    code = ("import torch, tilewise\n"
            "print(torch.neuron.device_count(), torch.ones(1, device='neuron:1').device)\n"
            "try:\n    torch.ones(1, device='neuron:2')\n"
            "except tilewise.DeviceError as e:\n    print(e)\n")
    env = {**os.environ, "TILEWISE_CORES": "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(tilewise.__file__))))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert first == "2 neuron:1"
    assert "invalid device ordinal neuron:2 (torch.neuron.device_count() == 2)" in second


def test_dataloader_workers_hand_back_tensors_on_their_core():
    data = torch.arange(12.0).reshape(6, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.to("neuron:1")), batch_size=3,
                                         num_workers=2, timeout=120)
    batches = [batch for batch, in loader]
    assert [b.device for b in batches] == [torch.device("neuron", 1)] * 2
    torch.testing.assert_close(torch.cat([b.cpu() for b in batches]), data, rtol=0, atol=0)


# ---- nn.DataParallel across cores --------------------------------------------------------------

def _data_parallel_training(device, device_ids=None, mode=None):
    """Five SGD steps of a small MLP, wrapped in nn.DataParallel on neuron, then an eval forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    first = torch.device("neuron", device_ids[0] if device_ids else 0) if device == "neuron" else device
    model.to(first)
    wrapped = torch.nn.DataParallel(model, device_ids=device_ids) if device == "neuron" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(5)]
    losses = []
    with _engine(mode):
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(wrapped(x.to(first)), y.to(first))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            out = wrapped(batches[0][0].to(first))
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}, out


@pytest.mark.parametrize("device_ids", [None, [0], [1, 3], [2, 5, 7]])
@pytest.mark.parametrize("mode", [None, *MODES])
def test_data_parallel_scatters_replicates_and_gathers_as_cpu_computes(device_ids, mode):
    """nn.DataParallel failed on neuron for any device_ids ("torch._C has no attribute '_scatter'":
    PyTorch's CPU wheel builds its copies between devices for CUDA only)."""
    tilewise.reset_caches()
    tilewise.stats().reset()
    want_losses, want_state, want_out = _data_parallel_training("cpu")
    losses, state, out = _data_parallel_training("neuron", device_ids, mode)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    assert out.device == torch.device("neuron", device_ids[0] if device_ids else 0)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-6)
    if mode is not None:
        assert_compiled_if_lazy(mode)  # the step outside the replicas (loss, backward, SGD) compiles


def test_parallel_copies_take_neuron_tensors_and_say_so_otherwise():
    from torch.nn.parallel import comm

    x = torch.arange(6.0).to("neuron:1")
    on_cores = comm.broadcast(x, [1, 2])
    assert on_cores[0] is x and on_cores[1].device == torch.device("neuron", 2)
    parts = comm.scatter(x, [0, 2], chunk_sizes=[2, 4])
    assert [p.device.index for p in parts] == [0, 2] and [p.numel() for p in parts] == [2, 4]
    assert torch.equal(comm.gather(parts, destination=-1), x.cpu())
    assert comm.gather(parts, destination=3).device == torch.device("neuron", 3)
    with pytest.raises(tilewise.DeviceError, match="take neuron tensors"):
        comm.broadcast(torch.ones(2), [0, 1])
    with pytest.raises(tilewise.DeviceError, match="on the first device"):
        comm.broadcast_coalesced([x], [0, 1])
