"""The one console script, `gpuslice`, and its subcommands.

Each subcommand lives in its own module exposing `register(subparsers)`; the module sets
`func` on its parser. Imports are lazy per module so `gpuslice explain` does not pay for grpc.
The dev tooling has its own console script, `gpuslice-dev` (devtools/).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence

from gpuslice import __version__

#: subcommand -> the module that registers it.
SUBCOMMANDS: dict[str, str] = {
    "operator": "gpuslice.operator.cli",
    "agent": "gpuslice.agent.cli",
    "explain": "gpuslice.explain",
    "check": "gpuslice.check",
    "drain": "gpuslice.drain",
    "uncordon": "gpuslice.drain",
    "usage": "gpuslice.usage",
    "top": "gpuslice.top",
}


def build_parser(
    argv: Sequence[str] | None = None,
    subcommands: Mapping[str, str] = SUBCOMMANDS,
    prog: str = "gpuslice",
    description: str | None = __doc__.splitlines()[0] if __doc__ else None,
) -> argparse.ArgumentParser:
    """The parser; given the command line, only the module of the subcommand it names is imported
    (a node agent does not pay for the operator's Kubernetes client, nor the operator for grpc)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    first = next((a for a in argv or () if not a.startswith("-")), None)
    named = subcommands.get(first or "")
    modules = [named] if named else list(dict.fromkeys(subcommands.values()))
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse `argv` and run the subcommand it names (help and exit status 2 without one)."""
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(build_parser(argv), argv)
