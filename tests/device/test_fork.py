"""Forks of a program that imported tilewise, with background compiles on: before any compile,
after one, from multiprocessing and from a DataLoader worker. Each fork must finish, and compute
CPU's values where it runs the engine; a regression hangs, so every case runs in a subprocess
bounded by a timeout. Every fork of such a program used to hang for ever closing the pipes to the
compile process that it inherited (their buffered files' locks were held by a thread the fork does
not have)."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120

PROGRAM = textwrap.dedent("""
    import os, sys, time, torch, tilewise, multiprocessing as mp

    def step():
        x = torch.arange(12.0).reshape(3, 4).to("neuron")
        with tilewise.engine(mode="adaptive"):
            for _ in range(5):
                value = (x * 2 + 1).sin().sum().item()
        return value

    want = (torch.arange(12.0).reshape(3, 4) * 2 + 1).sin().sum().item()

    def child(queue=None):
        ok = step() == want
        if queue is not None:
            queue.put(ok)
        return ok

    where = sys.argv[1]
    if where == "bare":
        time.sleep(1)
    if where == "after_a_compile":
        step()
        tilewise.wait_for_compiles(60)
    if where in ("bare", "before_a_compile", "after_a_compile"):
        pid = os.fork()
        if pid == 0:
            os._exit(0 if where == "bare" or child() else 3)
        print("exit", os.waitpid(pid, 0)[1] >> 8)
    elif where == "multiprocessing":
        context = mp.get_context("fork")
        queue = context.Queue()
        process = context.Process(target=child, args=(queue,))
        process.start()
        print("exit", 0 if queue.get(timeout=60) else 3)
        process.join()
    elif where == "dataloader":
        data = torch.utils.data.TensorDataset(torch.arange(8.0))
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")
        batches = [batch[0].tolist() for batch in loader]
        print("exit", 0 if batches[0] == [0.0, 1.0] and step() == want else 3)
""")


@pytest.mark.parametrize("where", ["bare", "before_a_compile", "after_a_compile", "multiprocessing", "dataloader"])
def test_a_fork_finishes_and_computes_cpus_values(where):
    env = dict(os.environ, TILEWISE_BACKGROUND_COMPILE="on",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROGRAM, where], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fork ({where}) did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["exit", "0"], done.stdout + done.stderr[-3000:]


def _run(program: str, *args: str, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **env)
    try:
        return subprocess.run([sys.executable, "-c", program, *args], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the program did not finish within {TIMEOUT_S} s")


CPU_PROGRAM_FORKS = textwrap.dedent("""
    import os, sys, torch
    if sys.argv[1] == "with_tilewise":
        import tilewise
    layer = torch.nn.Linear(3, 1)
    layer(torch.randn(2, 3)).sum().backward()
    if sys.argv[2] == "after_a_neuron_backward":
        device_layer = torch.nn.Linear(3, 1).to("neuron")
        device_layer(torch.randn(2, 3).to("neuron")).sum().backward()
    pid = os.fork()
    if pid == 0:
        torch.manual_seed(0)
        layer.zero_grad()
        layer(torch.randn(2, 3)).sum().backward()
        print(layer.weight.grad.tolist(), flush=True)
        os._exit(0)
    print("exit", os.waitpid(pid, 0)[1] >> 8)
""")


@pytest.mark.parametrize("when", ["cpu_only", "after_a_neuron_backward"])
def test_a_forked_child_runs_backward_as_without_tilewise(when):
    """Importing tilewise does not change what a CPU program's forked children can do: the first
    backward used to start autograd's device threads for the registered neuron guard, which marks
    every later fork as unable to run backward."""
    without = _run(CPU_PROGRAM_FORKS, "without", "cpu_only")
    assert without.stdout.split()[-2:] == ["exit", "0"], without.stdout + without.stderr[-3000:]
    done = _run(CPU_PROGRAM_FORKS, "with_tilewise", when)
    assert done.stdout.split()[-2:] == ["exit", "0"], done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == without.stdout.splitlines()[0]


COMPILE_PROCESS_OUTLIVES_A_FORK = textwrap.dedent("""
    import os, sys, torch, tilewise
    from tilewise.compiler.process import background

    def run(x):
        with tilewise.engine(mode="compiled"):
            for _ in range(3):
                value = (x * 2 + 1).sin().sum().item()
        tilewise.wait_for_compiles(60)
        return value

    run(torch.arange(12.0).reshape(3, 4).to("neuron"))
    process = background.PROCESS._child
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit runs the exit handlers the fork inherited
    os.waitpid(pid, 0)
    x = torch.arange(20.0).reshape(4, 5)
    value = run(x.to("neuron"))
    print(process is not None, process.wait(0) is None, background.PROCESS.broken,
          value == (x * 2 + 1).sin().sum().item())
""")


def test_the_compile_process_outlives_a_fork_that_exits_normally():
    """multiprocessing's exit handler, inherited by a fork of the program, terminated the
    compile process when it was a daemonic multiprocessing.Process."""
    done = _run(COMPILE_PROCESS_OUTLIVES_A_FORK, TILEWISE_BACKGROUND_COMPILE="on")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True", "None", "True"], done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
