"""The one console script, `gpuslice`, and its subcommands.

Each subcommand lives in its own module exposing `register(subparsers)`; the module sets
`func` on its parser. Imports are lazy per module so `gpuslice explain` does not pay for grpc.
The dev tooling has its own console script, `gpuslice-dev` (devtools/).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
}
SUBCOMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(SUBCOMMANDS.values()))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line, only the module of the subcommand it names is imported
    (a node agent does not pay for the operator's Kubernetes client, nor the operator for grpc)."""
    parser = argparse.ArgumentParser(
        prog="gpuslice", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--version", action="version", version=f"gpuslice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    first = next((a for a in argv or () if not a.startswith("-")), None)
    modules = [SUBCOMMANDS[first]] if first in SUBCOMMANDS else SUBCOMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
