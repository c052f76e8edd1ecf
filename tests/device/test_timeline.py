"""The timeline's record (tilewise/device/timeline.py): the most recent `max_events` kernels,
flushes and eager ops, given back as they were recorded, in rings whose memory is taken at the first
record and does not grow with the run."""
import gc
import tracemalloc

from tilewise.device.timeline import HostEvent, Kernel, Timeline


def _fill(timeline: Timeline, count: int, first: int = 0) -> None:
    """`count` kernels, flushes and eager ops, each with values of its own; the eager op's reason
    made anew every time, as the engine's str(reason) is."""
    for i in range(first, first + count):
        timeline.record(("mm", "exp")[i % 2], "TensorEngine", 1e-6 * (i + 1), 4096 * i, 2 ** 40 + i,
                        region=None if i % 3 else "region1")
        timeline.flush_spans(i, "a step of the loop ends", 7 + i, 10.0 + i, 10.5 + i, 10.75 + i, 0.25 * i)
        timeline.eager_op("_to_copy", 20.0 + i, 0.125, "".join(["copies data between ", "the host and the device"]))


def test_the_timeline_gives_back_the_most_recent_events_as_recorded():
    timeline = Timeline(max_events=3)
    _fill(timeline, 5)
    timeline.host("compilation", "region1", 30.0, 2.0, ops=12)
    clock = [0.0]
    for i in range(5):
        clock.append(clock[-1] + 1e-6 * (i + 1))
    assert timeline.events == [Kernel(("mm", "exp")[i % 2], "TensorEngine", clock[i], 1e-6 * (i + 1), 4096 * i,
                                      2 ** 40 + i, None if i % 3 else "region1") for i in (2, 3, 4)]
    assert all(type(k.hbm_bytes) is int and type(k.flops) is int for k in timeline.events)
    # totals cover every kernel, not only those kept
    assert timeline.kernels == 5 and timeline.clock == clock[5] and timeline.flops == sum(2 ** 40 + i for i in range(5))
    want = []
    for i in (2, 3, 4):
        want += [HostEvent("tracing", f"segment {i}", 10.0 + i, 0.5, {"ops": 7 + i}),
                 HostEvent("flush", "flush: a step of the loop ends", 10.5 + i, 0.25,
                           {"segment": i, "ops": 7 + i, "simulated_us": [0.25 * i * 1e6, clock[i + 1] * 1e6]}),
                 HostEvent("eager ops", "_to_copy", 20.0 + i, 0.125, {"reason": "copies data between the host and the device"})]
    want.append(HostEvent("compilation", "region1", 30.0, 2.0, {"ops": 12}))
    assert timeline.host_events == sorted(want, key=lambda e: e.start)


def test_a_timeline_that_keeps_nothing_still_counts():
    timeline = Timeline(max_events=0)
    _fill(timeline, 4)
    assert timeline.events == [] and timeline.host_events == []
    assert timeline.kernels == 4 and timeline.hbm_bytes == 4096 * 6


def test_a_kept_event_costs_tens_of_bytes():
    """A kernel, a flush and an eager op cost 192, 877 and 304 bytes as Python objects (a NamedTuple
    of boxed floats and ints; two spans with dicts and names formatted per flush); kept in the rings
    they cost 56, 64 and 32, taken at the first record, and a full timeline takes no more."""
    events = 2_000
    gc.collect()
    tracemalloc.start()
    try:
        timeline = Timeline(max_events=events)
        _fill(timeline, events)
        full = tracemalloc.get_traced_memory()[0]
        _fill(timeline, events, first=events)
        again = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert full / events < 200, f"{full / events:.0f} bytes per kernel, flush and eager op"
    assert again - full < 1024
