"""7b. As interrupts.py, but the timer's own handler raises KeyboardInterrupt (not SIGINT's), so the
engine's deferral of SIGINT during a flush does not apply: the interrupt lands anywhere, flushes
and compiles included."""
from sweep.interrupts import run as _run


def run(device, probe):
    return _run(device, probe, as_sigint=False)
