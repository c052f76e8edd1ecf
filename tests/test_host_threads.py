"""The engine's threads run PyTorch's kernels on one core, the program's threads keep their count
(tilewise/host_threads.py): a thread of the engine with an OpenMP team of its own made the program's
parallel kernels wait for theirs (benchmarks/engine_threads.py: 4-5x on a 64 x 64 matmul)."""
import threading

import pytest
import torch
import torch.nn.functional as F

import tilewise
from tilewise.adaptive.compiler_calls import in_compiler_thread
from tilewise.compiler.native import build as native, tiers
from tilewise.host_threads import _thread_count_setters, run_kernels_serially
from tilewise.workloads import MLP


def test_this_pytorch_build_has_both_thread_count_setters():
    # the CPU wheel this project pins: were they gone, the fix would silently do nothing
    assert len(_thread_count_setters()) == 2


@pytest.mark.parametrize("program_set_threads", [False, True])
def test_a_thread_that_runs_serially_leaves_the_program_threads_count(program_set_threads):
    program_threads = torch.get_num_threads()
    if program_set_threads:  # then ATen sets each thread's count at its first call (benchmarks do this)
        torch.set_num_threads(program_threads)
    seen = {}

    def engine_thread():
        run_kernels_serially()
        seen["threads"] = torch.get_num_threads()
        seen["sum"] = torch.ones(1 << 20).sum().item()  # a kernel big enough to be parallel elsewhere

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == {"threads": 1, "sum": float(1 << 20)}
    assert torch.get_num_threads() == program_threads


def test_the_compiler_thread_runs_kernels_serially_after_a_real_compile():
    program_threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = MLP().to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 32).to("neuron"), torch.randint(0, 10, (64,)).to("neuron")
    with tilewise.config.patch(cache_dir=""), tilewise.engine(mode="compiled") as stats:
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
    assert stats.compiles >= 1
    assert in_compiler_thread(torch.get_num_threads) == 1
    assert torch.get_num_threads() == program_threads


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_the_native_builder_thread_runs_kernels_serially():
    seen = {}
    done = threading.Event()
    tiers._submit(done, lambda: seen.setdefault("threads", torch.get_num_threads()))
    assert done.wait(60)
    assert seen["threads"] == 1
