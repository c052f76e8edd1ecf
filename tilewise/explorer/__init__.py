"""The explorer: what the engine did in a run, as a Chrome/Perfetto trace and as an HTML report.

    with tilewise.explorer.record() as run:
        train()
    run.write_report("run.html"); run.write_trace("run.trace.json"); run.save("run.json")

and later `python -m tilewise report run.json -o run.html`.
"""
from .recorder import ExplorerError, Recorder, Run, load, record

__all__ = ["ExplorerError", "Recorder", "Run", "load", "record"]
