"""One compile cache shared by programs run the ways users run them: a tensor-parallel program
under torchrun, again and again in one cache directory, and two of them at once (four processes).
A second run in the directory used to find its step region's entry refused as corrupt (it named
DTensor's functional collectives, which the decoder did not admit) and then died with SIGSEGV: the
native library it loaded from the cache was called on a collective's pending result, a wrapper
tensor whose data pointer is 0."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tilewise.compiler.native import build as native

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "parallel_programs_worker.py")
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


def launch(out, tag: str, cache_dir, key_file) -> subprocess.Popen:
    env = dict(os.environ, TILEWISE_MODE="compiled", TILEWISE_CACHE_DIR=str(cache_dir),
               TILEWISE_CACHE_KEY_FILE=str(key_file), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, HERE, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", WORKER, str(out / f"{tag}-rank"), "shared_cache"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, out, tag: str) -> list[dict]:
    log = proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, log[-6000:]
    assert "Warning" not in log, log[-6000:]
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def expected_losses():
    sys.path.insert(0, HERE)
    try:
        import parallel_programs_worker as worker
    finally:
        sys.path.pop(0)
    return worker.tp_losses(worker.tensor_parallel_model(bias=False), worker.tensor_parallel_data(),
                            worker.SHARED_CACHE_STEPS, worker.BUILT_AFTER, worker.row_mean_square)


def test_tensor_parallel_runs_again_and_again_in_one_cache_and_four_processes_at_once(tmp_path, expected_losses):
    cache_dir, key = tmp_path / "cache", tmp_path / "cache.key"
    runs = []
    for tag in ("first", "second", "third"):
        runs.append(finished(launch(tmp_path, tag, cache_dir, key), tmp_path, tag))
    both = [launch(tmp_path, tag, cache_dir, key) for tag in ("left", "right")]
    runs += [finished(proc, tmp_path, tag) for proc, tag in zip(both, ("left", "right"))]
    for ranks in runs:
        for rank in ranks:
            torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
            assert rank["cache"]["corrupt"] == 0 and rank["libraries"] >= 1
    first, second = runs[0][0]["cache"], runs[1][0]["cache"]
    assert first["compiles"] >= 1 and first["disk_writes"] >= 1
    # every entry rank 0 used in the first run it wrote, or read from disk where rank 1 wrote it
    # first (the two ranks compile the same regions at once): the second run reads them all
    assert second["compiles"] == 0 and second["disk_hits"] == first["disk_writes"] + first["disk_hits"]
    assert second["native_disk_hits"] >= 1  # the C built by the first run, called on the collective's result
