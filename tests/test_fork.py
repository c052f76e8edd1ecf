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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
