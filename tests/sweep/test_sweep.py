"""Every sweep program in every mode against CPU, each in a child process of its own (run_all.py's
rows as tests; long: marked slow). `python tests/sweep/run_all.py` prints the same as a table."""
import pytest

from sweep.run_all import MODES, PROGRAMS, run_one

TIMEOUT = 900  # seconds one program may take in one mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_equals_cpu(program, mode):
    verdict, _ = run_one(program, mode, TIMEOUT)
    assert verdict["status"] == "OK", verdict
