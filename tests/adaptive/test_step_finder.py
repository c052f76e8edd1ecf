"""The step finder (tilewise/adaptive/period.py): a loop's step is found from its op stream, so a
loop that reads a value every N steps, or never, compiles its step once, as a loop that reads every
step does, computes what the CPU computes, and holds no more recorded work after many steps than
after a few."""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilewise
from tilewise.adaptive import period as P
from tilewise.adaptive import policy
from tilewise.adaptive.engine import RUNTIME
from tilewise.adaptive.policy import NoPeriod, StepAction
from tilewise.adaptive.runtime import OPTIMIZER_STEP, OPTIMIZER_STEPPED

READS = [1, 10, None]  # a read every step, every 10 steps, never
# the forward and backward, the optimizer's step (a segment of its own: engine.py), and in compiled
# mode the first step's optimizer (AdamW makes its state there); a read after the optimizer's step,
# every step, every few or never, falls between units and adds none
COMPILES = {"adaptive": 2, "compiled": 3}


def train(device, mode, steps, read_every, seed=0):
    """An MLP (32-64-10) under AdamW; the loss read every `read_every` steps (None: never).
    Returns the losses read and the final parameters, on the CPU."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(steps)]
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    read = []
    with tilewise.engine(mode=mode) if device != "cpu" else _nothing():
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if read_every is not None and (i + 1) % read_every == 0:
                read.append(loss.item())
    return read, [p.detach().cpu() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def assert_bitwise(got, want):
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


# -- the period and the matcher, on key streams -----------------------------------------------------

def test_the_period_is_found_after_a_prologue_and_in_the_middle_of_a_step():
    step = list(range(10, 20))
    keys = [1, 2, 3] + step * 4 + step[:4]
    assert P.smallest_period(keys) == (10, 44)  # all but the prologue


def test_a_repetition_shorter_than_a_step_is_taken_in_multiples():
    assert P.smallest_period([5] * 40) == (P.MIN_STEP_OPS, 40)


def test_a_stream_that_never_repeats_twice_has_no_period():
    assert P.smallest_period(list(range(100))) is NoPeriod.NO_REPEAT
    step = list(range(20))
    assert P.smallest_period(step + step[:15]) is NoPeriod.NO_REPEAT


def test_the_matcher_cuts_each_step_and_finds_it_again_after_other_ops():
    step = tuple(range(10, 20))
    matcher = P.StepMatcher(P.Period(step, into_step=3))
    ends = [i for i, key in enumerate(list(step[3:]) + list(step) + [99, 10, 11, 98] + list(step))
            if matcher.feed(key)]
    assert ends == [6, 16, 30]


def _fake_stream(finder, ops, search_ops):
    """Feed the finder a stream of ops ('read' ends the segment as a read does); the actions taken."""
    from types import SimpleNamespace
    segment, actions = SimpleNamespace(nodes=[]), []
    for op in ops:
        if op == "read":
            segment = SimpleNamespace(nodes=[])
            continue
        segment.nodes.append(SimpleNamespace(func=op, inputs=[0], srcs=[]))
        action = finder.after_record(segment, search_ops)
        actions.append(action)
        if action is not StepAction.RECORD:
            segment = SimpleNamespace(nodes=[])
    return actions


def test_layers_that_repeat_inside_a_step_are_each_cut_in_every_later_step():
    """Identical layers forward, then others backward, in a step longer than a search, read every
    step (a transformer's training step, whose optimizer's step ends it): the first step's
    searches find a forward layer and a backward one, and every later step is cut at each layer of
    both with no search (no ops run eagerly while searched)."""
    from types import SimpleNamespace
    from tilewise.adaptive.stats import StepStats
    finder = P.StepFinder(SimpleNamespace(steps=StepStats()))
    step = ["f1", "f2", "f3", "f4"] * 10 + ["b1", "b2", "b3", "b4"] * 10 + ["read"]
    actions = [_fake_stream(finder, step, 32) for _ in range(6)]
    assert [a.count(StepAction.LEARN) for a in actions] == [2, 0, 0, 0, 0, 0], actions[0]
    for later in actions[1:]:
        assert later.count(StepAction.CUT) == 20 and StepAction.CUT_EAGER not in later, later


def test_a_step_found_again_uncut_backs_the_searches_off():
    """A search that finds a step its matcher already knows saw that step recur uncut: the next
    searches wait twice as long each time, so such a stream is not searched for ever."""
    from types import SimpleNamespace
    from tilewise.adaptive.stats import StepStats
    finder = P.StepFinder(SimpleNamespace(steps=StepStats()))
    segment = SimpleNamespace(nodes=[SimpleNamespace(func=op, inputs=[0], srcs=[]) for op in ["a", "b", "c", "d"] * 8])
    assert finder._search(segment) is StepAction.LEARN and finder.backoff == 1
    assert finder._search(segment) is StepAction.LEARN and finder.backoff == 2
    assert len(finder.matchers) == 1


# -- the policy's table -----------------------------------------------------------------------------

@pytest.mark.parametrize("step_ends, rest, length, search_at, action", [
    (False, False, 10, 256, StepAction.RECORD),
    (False, False, 256, 256, StepAction.SEARCH),
    (True, False, 40, 256, StepAction.CUT),
    (True, True, 12, 256, StepAction.CUT_EAGER),
    (True, False, 300, 256, StepAction.CUT),  # a step that ends is cut, searched or not
])
def test_step_action_table(step_ends, rest, length, search_at, action):
    assert policy.step_action(step_ends=step_ends, rest_of_found_step=rest, length=length,
                              search_at=search_at) is action


def test_after_a_search():
    assert policy.after_search(found_period=True) is StepAction.LEARN
    assert policy.after_search(found_period=False) is StepAction.RECORD


# -- whole loops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("read_every", READS)
def test_a_loop_computes_what_the_cpu_does_and_compiles_its_step_once(mode, read_every):
    steps = 30
    want = train("cpu", None, steps, read_every)
    got = train("neuron", mode, steps, read_every)
    assert_bitwise(got, want)
    stats = tilewise.stats()
    assert stats.ops_compiled > 0 and stats.compiles == COMPILES[mode] and stats.steps.cuts == 0, stats.report()
    assert stats.flush_reasons[OPTIMIZER_STEP] == stats.flush_reasons[OPTIMIZER_STEPPED] == steps, stats.report()


def test_the_compile_count_does_not_grow_with_the_steps_between_reads():
    compiles = {}
    for steps in (30, 90):
        tilewise.reset_caches()
        tilewise.stats().reset()
        train("neuron", "adaptive", steps, None)
        compiles[steps] = tilewise.stats().compiles
    assert compiles[30] == compiles[90] == COMPILES["adaptive"]
    assert tilewise.stats().compiled_fraction > 0.9  # of 90 steps, some 10 warming up


def test_recorded_work_stays_bounded_over_many_steps_with_no_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to("neuron")
    x = torch.randn(4, 8).to("neuron")
    pending = []
    with tilewise.engine(mode="adaptive"), torch.no_grad():
        for i in range(600):
            x = x - (0.5 / (1 + i)) * model(x)
            pending.append(len(RUNTIME.segment.nodes) + sum(len(w.segment.nodes) for w in RUNTIME.unfinished))
    stats = tilewise.stats()
    assert stats.steps.found == 1 and stats.compiles >= 1, stats.report()
    assert max(pending[300:]) <= stats.steps.period  # one step at most, from the first search on
    assert max(pending) < 2 * tilewise.config.step_search_ops


def test_a_long_computation_that_does_not_repeat_is_flushed_as_before():
    choice = random.Random(0).choices(range(8), k=300)
    ops = [torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.neg, torch.relu]
    x = torch.randn(64)
    want = x.clone()
    for c in choice:
        want = ops[c](want) * 0.5
    with tilewise.engine(mode="adaptive"):
        y = x.to("neuron")
        for c in choice:
            y = ops[c](y) * 0.5
        got = y.cpu()
    stats = tilewise.stats()
    assert torch.equal(got, want)
    assert stats.steps.found == 0 and stats.steps.cuts == 0 and stats.steps.no_period[NoPeriod.NO_REPEAT] == 2
    assert stats.segments == 1, stats.report()  # searched at 256 and 512 ops, flushed by the read


def _sample(device, steps, read_every):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(device)
    x, read = torch.randn(4, 8).to(device), []
    with tilewise.engine(mode="adaptive") if device != "cpu" else _nothing(), torch.no_grad():
        for i in range(steps):
            x = x - (0.5 / (1 + i)) * model(x)
            if (i + 1) % read_every == 0:
                read.append(x.cpu())
    return read


def test_a_sampler_s_step_is_cut_where_only_its_state_flows_on():
    """Inside the sampler's step two values flow on (the state and a layer's output); at its end
    only the state: cut there, the reads fall between steps and add no segment of their own."""
    want = _sample("cpu", 200, 50)
    got = _sample("neuron", 200, 50)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 4
    stats = tilewise.stats()
    assert stats.steps.found == 1 and stats.compiles == 1, stats.report()
    # the report says the step found and how many of the segments were one step each
    report = stats.report()
    assert f"period {stats.steps.period} ops" in report and stats.steps.cuts > 150, report
    assert f"{stats.steps.cuts} of {stats.segments} segments cut at a step's end" in report, report
