"""Finding a loop's step in the op stream, wherever the program reads a value.

A segment runs from one read of device data to the next; a loop that reads every N steps, or
never, records N steps (or `max_segment_ops` ops) as one segment, which recurs late or never. The
step is found from the ops themselves: each recorded node gets a key (`op_key`), the segment's keys
are searched for their period (`find_period`), and from then on a matcher (`StepMatcher`, the
Knuth-Morris-Pratt automaton of one step's keys) tells the runtime where each step ends, so each
step is flushed as one segment: the unit that recurs and compiles once.

A key names an op and how many host values it reads, nothing of where they come from: a node's
`local` says how far back its producers are and its `fp` folds in its producers' fingerprints, so
in a long segment both differ between a step that reads the previous step's values in the segment
and the same step cut off as a segment of its own (where those values are external). Floats and
sizes are left out too, so steps that differ in a learning rate or a length repeat all the same
(the region machinery generalises them, as for steps cut by reads). A key too coarse cuts in the
wrong place at worst: any cut is a valid flush, so values never depend on it.
"""
from __future__ import annotations

from typing import NamedTuple

from .policy import NoPeriod, StepAction, after_search, step_action
from .segment import Segment

# A step shorter than this is taken as several of its repetitions: a chain of identical ops has
# period 1, and cutting it at every op would flush one op per segment.
MIN_STEP_OPS = 4


def op_key(node) -> int:
    # by the op's identity (ops are singletons): hashing an OpOverload costs twice as much, per op
    return id(node.func) << 8 ^ len(node.inputs)


class Period(NamedTuple):
    """A step found in a segment: its keys, starting at a step boundary, and how many keys of
    the next step the segment already holds (it ends inside a step: `into_step` > 0)."""
    keys: tuple
    into_step: int


def failure(keys) -> list[int]:
    """Knuth-Morris-Pratt's failure function: for each prefix of `keys`, the length of its longest
    proper prefix that is also its suffix."""
    border = [0] * len(keys)
    k = 0
    for i in range(1, len(keys)):
        while k and keys[i] != keys[k]:
            k = border[k - 1]
        if keys[i] == keys[k]:
            k += 1
        border[i] = k
    return border


def smallest_period(keys) -> tuple[int, int] | NoPeriod:
    """(period, m): the longest suffix of `keys` that repeats at least twice, m keys long, and its
    smallest period of at least MIN_STEP_OPS keys; or why there is none. The suffixes of `keys` are
    the prefixes of its reverse, whose smallest periods the failure function gives."""
    reverse = keys[::-1]
    border = failure(reverse)
    for m in range(len(reverse), 2 * MIN_STEP_OPS - 1, -1):
        period = m - border[m - 1]
        if period < MIN_STEP_OPS:  # a short repetition: its multiples are periods too
            period *= -(-MIN_STEP_OPS // period)
        if 2 * period <= m:
            return period, m
    return NoPeriod.NO_REPEAT


def find_period(segment: Segment) -> Period | NoPeriod:
    """The step of a segment: its period, repeated over at least half of the segment, cut where
    the fewest values flow from one step into the next."""
    keys = [op_key(node) for node in segment.nodes]
    found = smallest_period(keys)
    if isinstance(found, NoPeriod):
        return found
    period, m = found
    if 2 * m < len(keys):
        return NoPeriod.TOO_LITTLE
    end = _boundary(segment, period)
    return Period(tuple(keys[end - period:end]), len(keys) - end)


def _boundary(segment: Segment, period: int) -> int:
    """Where to cut the segment's last period: the boundary the fewest values flow across (a
    training step's end has none: its parameters are written in place, so the next step reads them
    as external values; a sampler's only its state). Ties go to the segment's own end, then the
    latest boundary."""
    n = len(segment.nodes)
    # the values made in the period before the last (their readers less than a period later are
    # all recorded) -> their last reader
    last_use: dict = {}
    for i in range(n - 2 * period, n):
        for source in segment.nodes[i].srcs:
            if n - 2 * period <= source[0] < n - period:
                last_use[source] = i
    # a value made by node j and last read by node i crosses the cuts j+1..i, whose distances back
    # from the end (n - i .. n - j - 1) make one run of fewer than `period`: counted by
    # differences, then folded
    runs = [0] * (2 * period + 1)
    for (j, _), i in last_use.items():
        if i - j >= period:
            continue  # read a period or more after it is made (a sampler's state): crosses every boundary alike
        runs[n - i] += 1
        runs[n - j] -= 1
    crossing, running = [0] * period, 0
    for back in range(2 * period):
        running += runs[back]
        crossing[back % period] += running
    back = min(range(period), key=crossing.__getitem__)
    return n - back


class StepMatcher:
    """Where each step ends in the stream of recorded ops: the automaton that matches a step's
    keys, fed one key per op across flushes. A key that does not continue the step falls back
    along the failure function, as in Knuth-Morris-Pratt, so a step that follows other ops (a
    validation pass) is found again where it ends."""

    def __init__(self, period: Period):
        self.keys = period.keys
        self.border = failure(period.keys)
        self.matched = period.into_step

    def __len__(self) -> int:
        return len(self.keys)

    def feed(self, key: int) -> bool:
        """True when this key ends a step."""
        keys, k = self.keys, self.matched
        while k and keys[k] != key:
            k = self.border[k - 1]
        if keys[k] == key:
            k += 1
        if k == len(keys):
            self.matched = 0
            return True
        self.matched = k
        return False


class StepFinder:
    """The runtime's step finder: after each recorded op, what to do (policy.step_action), with a
    matcher for each step found. Searches and cuts are counted in `stats.steps`.

    A step can hold several that recur inside it (identical layers forward, then others backward):
    each search that finds one adds its matcher, and from then on every matcher is fed each op, so
    a later step is cut at each of them without being searched again."""

    def __init__(self, stats):
        self.stats = stats
        self.matchers: dict[tuple, StepMatcher] = {}  # by the step's keys, oldest first
        self.search_at = _NEVER           # the current segment's length at its next search (set at its first op)
        self.rest_of_found_step = False   # the next step to end began in the segment searched
        # A search that finds a step already matched saw it recur uncut (a step longer than a
        # search that repeats inside): each search after it waits `backoff` times longer, until a
        # search holds the whole step or a read ends the segment first.
        self.backoff = 1

    def after_record(self, segment: Segment, search_ops: int) -> StepAction:
        """Called once per recorded op (the segment's last node): cheap unless a step ends or the
        segment has grown to its next search."""
        nodes = segment.nodes
        if len(nodes) == 1:  # a new segment
            self.search_at = search_ops * self.backoff or _NEVER
        step_ends = False
        if self.matchers:
            key = op_key(nodes[-1])
            for matcher in self.matchers.values():  # every matcher: each keeps its own place
                step_ends |= matcher.feed(key)
        if not step_ends and len(nodes) < self.search_at:
            return StepAction.RECORD
        action = step_action(step_ends=step_ends, rest_of_found_step=self.rest_of_found_step,
                             length=len(nodes), search_at=self.search_at)
        if action is StepAction.SEARCH:
            return self._search(segment)
        self.rest_of_found_step = False
        self.stats.steps.cuts += 1
        return action

    def _search(self, segment: Segment) -> StepAction:
        found = find_period(segment)
        counts = self.stats.steps
        if isinstance(found, NoPeriod):
            counts.no_period[found] += 1
            self.search_at *= 2
            return after_search(found_period=False)
        if found.keys in self.matchers:
            self.backoff *= 2
            del self.matchers[found.keys]  # made anew below, as the step found last
        elif len(self.matchers) == _MATCHERS:
            del self.matchers[next(iter(self.matchers))]
        self.matchers[found.keys] = StepMatcher(found)
        self.rest_of_found_step = found.into_step > 0
        counts.found += 1
        counts.period = len(found.keys)
        counts.searched_ops += len(segment.nodes)
        return after_search(found_period=True)


_NEVER = 1 << 62
_MATCHERS = 8  # steps StepFinder matches at once; a ninth found replaces the oldest
