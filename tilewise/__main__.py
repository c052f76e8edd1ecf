"""Command line: `python -m tilewise report RUN.json -o run.html` (and `trace`)."""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tilewise",
                                     description="Tools for runs recorded with tilewise.explorer.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser("report", help="write the HTML report of a saved run")
    report.add_argument("run", metavar="RUN.json", help="a run saved with Recorder.save() / Run.save()")
    report.add_argument("-o", "--output", default=None, help="the HTML file to write (default: RUN.html)")
    trace = commands.add_parser("trace", help="write the Chrome/Perfetto trace of a saved run")
    trace.add_argument("run", metavar="RUN.json", help="a run saved with Recorder.save() / Run.save()")
    trace.add_argument("-o", "--output", default=None, help="the trace file to write (default: RUN.trace.json)")
    return parser


def _default_output(run_path: str, suffix: str) -> str:
    stem = run_path[:-5] if run_path.endswith(".json") else run_path
    return stem + suffix


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .explorer import ExplorerError, load  # after parsing: --help needs no torch import

    try:
        run = load(args.run)
        if args.command == "report":
            written = run.write_report(args.output or _default_output(args.run, ".html"))
        else:
            written = run.write_trace(args.output or _default_output(args.run, ".trace.json"))
    except ExplorerError as error:
        print(f"python -m tilewise {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"python -m tilewise {args.command}: error: cannot write {error.filename!r}: {error.strerror}",
              file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
