"""Device gaps of issue #11: checkpoints mapped onto neuron, generators, storages, sparse and nested
tensors. What works matches the CPU; what cannot work says so and what to do, and never crashes."""
import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch

import tilewise
from tilewise.adaptive.engine import RUNTIME
from tilewise.adaptive.regions import CompiledEntry
from tilewise.compiler.native.tiers import Tier

MODES = ["eager", "adaptive", "compiled"]


def _saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("location", ["neuron", "neuron:0", "neuron:1", torch.device("neuron", 1),
                                      {"cpu": "neuron:1"}])
@pytest.mark.parametrize("mode", [None, *MODES])
def test_a_cpu_checkpoint_loads_onto_neuron(location, mode):
    state = {"w": torch.randn(4, 3), "b": torch.arange(3), "p": torch.nn.Parameter(torch.randn(2))}
    want = torch.device("neuron", 1) if "1" in str(location) else torch.device("neuron", 0)
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        loaded = torch.load(_saved(state), map_location=location)
        assert {t.device for t in loaded.values()} == {want}
        assert isinstance(loaded["p"], torch.nn.Parameter) and loaded["p"].requires_grad
        for name, value in state.items():
            assert loaded[name].dtype == value.dtype
            torch.testing.assert_close(loaded[name].detach().cpu(), value.detach(), rtol=0, atol=0)


def test_a_neuron_checkpoint_maps_back_to_the_cpu_as_plain_tensors():
    state = {"w": torch.randn(4, 3).to("neuron:1")}
    loaded = torch.load(_saved(state), map_location="cpu")
    assert type(loaded["w"]) is torch.Tensor and loaded["w"].device == torch.device("cpu")


def test_a_cpu_generator_drives_neurons_random_ops_on_any_core_as_the_cpus():
    """(A neuron generator: tests/device/test_generator.py.)"""
    want = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    got = torch.randn(3, 4, device="neuron:1", generator=torch.Generator().manual_seed(3))
    assert got.device == torch.device("neuron", 1)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_a_storage_on_neuron_is_a_clear_error_not_a_crash():
    """Without the refusal this segfaults the interpreter; run in a child to prove it does not."""
    code = ("import torch, tilewise\n"
            "for make in (lambda: torch.UntypedStorage(8, device='neuron'),\n"
            "             lambda: torch.UntypedStorage(8, device=torch.device('neuron', 1)),\n"
            "             lambda: torch.TypedStorage(8, device='neuron')):\n"
            "    try:\n        make()\n    except tilewise.DeviceError as e:\n        print(str(e)[:40])\n"
            "print(torch.UntypedStorage(8).nbytes(), torch.UntypedStorage(8, device='cpu').device)\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(tilewise.__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["torch.UntypedStorage(..., device='neuron"] * 3 + ["8 cpu"]


_NESTED = {
    "strided, made on neuron": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], device="neuron"),
    "strided, moved": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]).to("neuron"),
    "jagged, made on neuron": lambda: torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)],
                                                                 layout=torch.jagged, device="neuron"),
    "jagged, moved": lambda: torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)],
                                                        layout=torch.jagged).to("neuron:1"),
    "from neuron tensors": lambda: torch.nested.as_nested_tensor([torch.ones(2, device="neuron")]),
    "from jagged neuron values": lambda: torch.nested.nested_tensor_from_jagged(
        torch.ones(5, 4, device="neuron"), torch.tensor([0, 2, 5])),
}


@pytest.mark.parametrize("mode", [None, "adaptive"])
@pytest.mark.parametrize("case", sorted(_NESTED))
def test_nested_tensors_on_neuron_are_refused_clearly(case, mode):
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        with pytest.raises(tilewise.DeviceError, match="nested tensors are not supported on neuron|cannot put a nested tensor on neuron"):
            _NESTED[case]()
        x = torch.ones(3, device="neuron")
        assert (x * 2).sum().item() == 6.0
    cpu = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]).sin()  # the host's own are untouched
    torch.testing.assert_close(cpu.unbind()[1], torch.ones(3).sin())


_SPARSE = {
    "coo moved": lambda: torch.randn(3, 3).to_sparse().to("neuron"),
    "csr moved": lambda: torch.randn(3, 3).to_sparse_csr().to("neuron:1"),
    "coo made on neuron": lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]),
                                                          (2, 2), device="neuron"),
    "to_sparse on neuron": lambda: torch.ones(2, 2, device="neuron").to_sparse(),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", sorted(_SPARSE))
def test_sparse_tensors_on_neuron_are_refused_clearly(case):
    with pytest.raises(tilewise.DeviceError, match="dense \\(strided\\) only"):
        _SPARSE[case]()


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("mode", [None, *MODES])
def test_record_stream_has_nothing_to_do_and_keeps_regions_compiling(mode, inference):
    """Prefetching code calls `t.record_stream(stream)` after copying on a side stream: CPU has no
    kernel for it (NotImplementedError on neuron), and a recorded one made its region's compile fail."""
    tilewise.reset_caches()
    tilewise.stats().reset()
    x = torch.randn(8)
    with torch.inference_mode() if inference else contextlib.nullcontext(), \
            tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for _ in range(tilewise.config.threshold + 2):
            y = x.to("neuron") * 2
            y.record_stream(torch.neuron.current_stream())
            z = (y + 1).cpu()
    torch.testing.assert_close(z, x * 2 + 1)
    stats = tilewise.stats()
    assert not [reason for (_, reason) in stats.fallbacks if "compile failed" in reason]
    if mode in ("adaptive", "compiled"):
        assert stats.compiles >= 1 and stats.ops_compiled > 0


@pytest.mark.parametrize("lengths", ["cpu tensors", "device tensors", "tuples"])
@pytest.mark.parametrize("mode", [None, *MODES])
def test_ctc_loss_takes_its_lengths_as_cpu_tensors_as_on_cuda(mode, lengths):
    """CUDA reads CTC's lengths on the host, so speech and OCR code passes them as CPU tensors; on
    neuron PyTorch's composite divided the device loss by them (a mixed-device error)."""
    def run(device):
        torch.manual_seed(0)
        log_probs = torch.randn(12, 2, 5).log_softmax(2).to(device).requires_grad_()
        targets = torch.tensor([[1, 2, 2], [3, 1, 0]]).to(device)
        given = {"cpu tensors": (torch.tensor([12, 10]), torch.tensor([3, 2])),
                 "device tensors": (torch.tensor([12, 10]).to(device), torch.tensor([3, 2]).to(device)),
                 "tuples": ((12, 10), (3, 2))}[lengths]
        results = []
        for reduction in ("mean", "sum", "none"):
            loss = torch.nn.functional.ctc_loss(log_probs, targets, *given, reduction=reduction, zero_infinity=True)
            log_probs.grad = None
            loss.sum().backward()
            results += [loss.detach().cpu(), log_probs.grad.cpu()]
        with torch.inference_mode():  # the composite arrives whole below autograd
            results.append(torch.nn.functional.ctc_loss(log_probs.detach(), targets, *given).cpu())
        return results

    want = run("cpu")
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        got = run("neuron")
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_views_of_normal_tensors_under_inference_mode_are_normal_tensors_as_on_cpu(mode):
    """`with torch.inference_mode(): model(x[:, :-1])` with x made outside: every view of a normal
    neuron tensor there failed ("Cannot set version_counter for inference tensor")."""
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(device)
        x = torch.randn(4, 6).to(device)
        w = model[0].weight
        with torch.inference_mode():
            views = [x[:, :-1], x.view(-1), x.t(), w.detach(), w.t()]
            out = model(x[:, :-1])
            flags = [v.is_inference() for v in views] + [out.is_inference()]
            x[0].add_(1)  # in place through a view of a normal tensor: allowed, as on CPU
            values = [v.cpu() for v in views] + [out.cpu()]
        return flags, values + [x.cpu()]

    want_flags, want = run("cpu")
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        flags, got = run("neuron")
    assert flags == want_flags == [False] * 5 + [True]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_composite_ops_under_inference_mode_run_as_autograd_would_as_on_cpu(mode):
    """With autograd off, ops with a CompositeImplicitAutograd kernel reach the device whole: run
    on the host buffers, `to(device, dtype)` made a device tensor inside a device tensor (compiled
    mode then hung compiling BERT's padding-mask check), and a lazy `reshape` that must copy copied
    a buffer not computed yet (wrong values, silently)."""
    def run(device):
        x = torch.arange(12.).reshape(3, 4).to(device)
        other = torch.ones(3, 4).to(device)
        mask = torch.ones(3, 7, dtype=torch.long).to(device)
        with torch.inference_mode():
            results = [
                (x * 2).t().reshape(-1),
                (x + 1).flatten(0).unflatten(0, (4, 3)),
                torch.matmul(x, other.t()),
                x.to(device=device, dtype=torch.float64),
                x.to(other),
                (x * 3).to("cpu"),
                torch.arange(5.).to(device, torch.float16),
                torch.tensor([bool(mask[:, :6].to(device=x.device, dtype=torch.bool).all())]),
            ]
            same = [x.to(device) is x, x.to(torch.float32) is x]
        return results, same

    want, want_same = run("cpu")
    tilewise.stats().reset()
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for _ in range(3):  # adaptive mode compiles what recurs
            got, same = run("neuron")
    assert same == want_same == [True, True]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
        assert g.device.type == "cpu" or type(g._data) is torch.Tensor  # no device tensor inside another
    if mode in ("adaptive", "compiled"):
        assert tilewise.stats().compiles > 0, tilewise.stats().report()


@pytest.mark.parametrize("mode", MODES)
def test_values_computed_under_inference_mode_are_read_after_it(mode):
    """The lazy modes compute what was recorded under inference_mode at the next flush, wherever
    it is: writing those inference tensors' buffers outside inference_mode was refused."""
    x = torch.randn(3, 4)
    with tilewise.engine(mode=mode):
        device_x = x.to("neuron")
        with torch.inference_mode():
            y = (device_x * 2).relu()
            first = y[:, 0]
        z = device_x + 1  # a normal tensor again
    assert first.is_inference() and not z.is_inference()
    assert torch.equal(first.cpu(), (x * 2).relu()[:, 0]) and torch.equal(z.cpu(), x + 1)


@pytest.mark.parametrize("mode", MODES)
def test_training_with_inference_mode_validation_matches_cpu_and_compiles(mode):
    """Epochs of SGD steps, each followed by validation under inference_mode, the optimizer's
    last updates and the validation in one segment: its buffers shared with the parameters were
    inference tensors, and compiling the region that writes them failed (functionalization writes
    a region's mutations back to its inputs, which an inference tensor refuses)."""
    from tilewise.compiler.cache import regions as cache

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 3)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        losses = []
        for _ in range(4):
            model.train()
            for i in range(0, 32, 8):
                loss = torch.nn.functional.cross_entropy(model(x[i:i + 8].to(device)), y[i:i + 8].to(device))
                losses.append(loss.item())  # read first: the step and what follows it are one segment
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            with torch.inference_mode():
                losses.append(torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).item())
        return torch.tensor(losses), [p.detach().cpu() for p in model.parameters()]

    want_losses, want_parameters = run("cpu")
    cache.clear_memory()
    tilewise.stats().reset()
    with tilewise.config.patch(cache_dir=None), tilewise.engine(mode=mode):
        losses, parameters = run("neuron")
    torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=1e-5)
    for got, want in zip(parameters, want_parameters):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    stats = tilewise.stats()
    assert not [reason for op, reason in stats.fallbacks if op == "<region>"], stats.report()
    if mode != "eager":
        assert stats.compiles > 0 and stats.compiled_fraction > 0.7, stats.report()


@pytest.mark.parametrize("mode", [None, *MODES])
def test_indexing_takes_host_index_tensors_as_on_cuda(mode):
    """`x[cpu_index]`, `x[cpu_mask] = v`: CUDA copies host index tensors to the device; on neuron
    they were a mixed-device error (nn.init.sparse_ indexes so)."""
    index, mask = torch.tensor([2, 0]), torch.tensor([True, False, True])
    programs = [lambda x: x[index], lambda x: x[mask], lambda x: x[index, index], lambda x: x[:, index.flip(0)],
                lambda x: x.__setitem__(index, 0.0), lambda x: x.__setitem__(mask, 1.0),
                lambda x: x.__setitem__((index, index), 5.0), lambda x: x.index_put_((index,), x[0] * 2)]
    for program in programs:
        want = torch.arange(12.0).reshape(3, 4)
        x = want.to("neuron")
        with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
            got, expected = program(x), program(want)
            got = None if got is None else got.cpu()
        assert torch.equal(x.cpu(), want)
        assert (got is None) == (expected is None) and (got is None or torch.equal(got, expected))


@pytest.mark.parametrize("host", ["recorded", "native"])
@pytest.mark.parametrize("mode", MODES[1:])
def test_minibatches_drawn_by_host_indices_compile_without_a_flush(mode, host, monkeypatch):
    """The usual `X[perm[i:i + batch]]` with a CPU permutation: the indices are uploaded, the
    indexing is recorded and compiles with the step; no flush for a host tensor.

    Each host tier on its own, bitwise CPU's: the recorded graph (host_backend=torch), and the
    native tier asked for at once (native_everywhere), which a region recording cross_entropy's
    log_softmax or a Linear's addmm declines with its typed reason (their decompositions round
    otherwise than CPU's fused kernels): it runs its recorded graph."""
    if host == "native":
        from tilewise.testing.native_everywhere import force_native
        force_native(monkeypatch.setattr)
    torch.manual_seed(0)
    data, targets = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model_cpu = torch.nn.Linear(8, 3)
    model = torch.nn.Linear(8, 3).to("neuron")
    model.load_state_dict(model_cpu.state_dict())
    opt_cpu, opt = torch.optim.SGD(model_cpu.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    data_dev, targets_dev = data.to("neuron"), targets.to("neuron")
    tilewise.reset_caches()
    tilewise.stats().reset()
    with tilewise.config.patch(host_backend="torch" if host == "recorded" else "native"), tilewise.engine(mode=mode):
        for step in range(6):
            batch = torch.randperm(64, generator=torch.Generator().manual_seed(step))[:16]
            for m, o, x, y in ((model_cpu, opt_cpu, data, targets), (model, opt, data_dev, targets_dev)):
                loss = torch.nn.functional.cross_entropy(m(x[batch]), y[batch])
                o.zero_grad()
                loss.backward()
                o.step()
        compiled = [entry.compiled for entry in RUNTIME.memory.regions.values() if isinstance(entry, CompiledEntry)]
        tiers = {c.name: c.host_tier for c in compiled}
    for p, q in zip(model.parameters(), model_cpu.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach())
    # the optimizer's step is a region of its own (engine.py): SGD's foreach update, which has C
    stepping = [c for c in compiled if all("_foreach_" in str(n.target) for n in c.source.graph.nodes
                                           if n.op == "call_function")]
    learning = [c for c in compiled if c not in stepping]
    assert learning and len(stepping) == 1
    if host == "recorded":
        assert all(tier is Tier.TORCH for tier in tiers.values()), tiers
    else:  # the native tier was asked for and declined for rounding where the region learns
        assert all(c.rounds_otherwise and tiers[c.name] is Tier.TORCH for c in learning), tiers
    stats = tilewise.stats()
    assert stats.ops_compiled > 0 and not [r for (_, r) in stats.fallbacks if "host tensor" in r], stats.report()
