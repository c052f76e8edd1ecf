"""Differential fuzzing in CI: a fixed budget of random programs (tilewise/testing/fuzz_programs.py),
derandomized so every run tries the same programs, checked by tilewise/testing/fuzzing.py. Each runs
4 times per mode with threshold 2 (warm-up, compile, cache hits) and must match plain CPU PyTorch in
values, dtypes, shapes and gradients.
The new areas (fuzzing.Features) get a few fixed programs each, and the fuzzer's own machinery
(poisoned buffers, injected interrupts) is shown able to fail.
The long run is `python scripts/fuzz.py` (10,000 programs)."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from tilewise.testing import fuzz_interrupts, fuzz_programs, fuzzing
import tilewise

CI_PROGRAMS = 70
AREA_PROGRAMS = 6

# programs hit PyTorch's own warnings (var of one element, .item() of a grad tensor), as on the CPU
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_random_programs_match_cpu_in_every_mode():
    @settings(max_examples=CI_PROGRAMS, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(fuzz_programs.programs())
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


def _area_programs_match_cpu(features: fuzzing.Features) -> None:
    @settings(max_examples=AREA_PROGRAMS, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(fuzz_programs.programs(features=features))
    def program_matches_cpu(program):
        assume(fuzzing.runs_on_cpu(program))
        fuzzing.check(program, features=features)

    program_matches_cpu()
    assert tilewise.stats().compiles > 0, tilewise.stats().report()


# Strict xfails: engine bugs reported (tests/test_fuzz_regressions.py has their minimal programs);
# a fix makes the test pass, strict turns that into a failure, and the mark goes.


@pytest.mark.parametrize("area", ["data", "set_copy", "swap", "aliases", "half",
                                  "interrupts"])
def test_programs_of_each_new_area_match_cpu(area):
    """A few derandomized programs per area, with poisoned lazy buffers."""
    _area_programs_match_cpu(fuzzing.Features.parse(f"{area},poison"))


def test_features_parse_and_refuse_unknown_areas():
    assert fuzzing.Features.parse("all") == fuzzing.ALL
    assert fuzzing.Features.parse("none").names() == []
    assert fuzzing.Features.parse("swap,half").names() == ["swap", "half"]
    with pytest.raises(ValueError, match="unknown fuzz features"):
        fuzzing.Features.parse("data,nonsense")


def test_a_value_the_engine_never_writes_is_caught_as_poison(monkeypatch):
    """Skip every replayed node (adaptive mode's first, warm-up run replays them one by one): with
    poisoned buffers the result reads as NaN, not as the zeros a fresh allocation often holds, and
    the checker says so."""
    from tilewise.adaptive import regions
    monkeypatch.setattr(regions, "replay", lambda node: None)
    program = fuzzing.Program(inputs=[((4, 4), "float32", False)], lines=["v0 = x0 * 0"], outputs=["v0"])
    with pytest.raises(fuzzing.Mismatch, match="adaptive mode, iteration 0"):
        fuzzing.check(program, modes=("adaptive",), features=fuzzing.Features.parse("poison"))


def test_an_injected_interrupt_leaves_the_flush_and_the_engine_restored():
    from tilewise.adaptive import regions
    originals = regions.replay, regions.CompiledEntry.run
    with tilewise.engine(mode="adaptive"), fuzz_interrupts.Interrupter() as interrupter:
        x = torch.ones(3, device="neuron")
        y = x + 1
        interrupter.arm(0, before=True)
        with pytest.raises(KeyboardInterrupt):
            tilewise.sync()
        assert interrupter.fired
        interrupter.arm(None)
        del y
    assert (regions.replay, regions.CompiledEntry.run) == originals


def test_a_float64_rerun_that_cannot_run_is_no_reference():
    """The long run once died on a program whose float64 rerun raised (a cast back to float32
    meeting float64 values): that is a difference outside tolerance, not a crash."""
    def cannot_run():
        raise RuntimeError("dot : expected both vectors to have same dtype, but found Float and Double")

    with pytest.raises(AssertionError, match="result 0"):
        fuzzing.compare([torch.tensor([1.0, 2.0])], [torch.tensor([1.5, 2.0])], cannot_run)
