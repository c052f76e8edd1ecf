"""Differential fuzzing in CI: a fixed budget of random programs (tests/fuzzing.py), derandomized so
every run tries the same programs. Each runs 4 times per mode with threshold 2 (warm-up, compile,
cache hits) and must match plain CPU PyTorch in values, dtypes, shapes and gradients.
The long run is `python scripts/fuzz.py` (10,000 programs)."""
import pytest
from hypothesis import HealthCheck, assume, given, settings

import fuzzing
import tilewise

CI_PROGRAMS = 70

# programs hit PyTorch's own warnings (var of one element, .item() of a grad tensor), as on the CPU
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_random_programs_match_cpu_in_every_mode():
    @settings(max_examples=CI_PROGRAMS, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(fuzzing.programs())
    def program_matches_cpu(program):
        assume(fuzzing.runs_on_cpu(program))
        fuzzing.check(program)

    program_matches_cpu()
    stats = tilewise.stats()
    # The fuzz reached the compiled paths: regions compiled, then served from the cache.
    assert stats.compiles >= CI_PROGRAMS and stats.cache_hits >= CI_PROGRAMS, stats.report()


@pytest.mark.parametrize("program", [
    fuzzing.Program(inputs=[((1,), "float32", False), ((1, 4), "float32", False)],
                    lines=["v0 = x0 @ x1", "v1 = v0 * 2"], outputs=["v1"]),
    fuzzing.Program(inputs=[((3, 5), "bfloat16", True), ((5,), "bfloat16", False)],
                    lines=["v0 = x0 @ x1", "v1 = torch.softmax(v0, dim=0)"], outputs=["v1"]),
])
def test_program_printing_round_trips(program):
    """What a failure prints is a Program(...) expression that rebuilds the same program."""
    rebuilt = eval(repr(program), {"Program": fuzzing.Program})
    assert rebuilt == program
    assert "def program(x0, x1):" in rebuilt.source()
    fuzzing.check(rebuilt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_checker_catches_a_wrong_result(monkeypatch, dtype):
    """A checker that cannot fail is no checker: break one op on the device and see it caught."""
    from tilewise.adaptive import regions
    original = regions.CompiledEntry.run

    def wrong(self, segment, region):
        original(self, segment, region)
        for n, o in region.outputs:
            segment.nodes[n].outs[o].add_(1)

    monkeypatch.setattr(regions.CompiledEntry, "run", wrong)
    program = fuzzing.Program(inputs=[((4, 4), dtype, False)], lines=["v0 = x0.tanh() * 3"], outputs=["v0"])
    with pytest.raises(fuzzing.Mismatch, match="adaptive mode, iteration"):
        fuzzing.check(program)
