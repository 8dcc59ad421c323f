"""The one console script, `gpuslice`, and its subcommands.

Each subcommand lives in its own module exposing `register(subparsers)`; the module sets
`func` on its parser. Imports are lazy per module so `gpuslice devcluster` does not pay for grpc.
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
    # Dev tooling (gpuslice.dev): absent from a product install, so skipped when missing.
    "devcluster": "gpuslice.dev.devcluster.cli",
    "demo": "gpuslice.dev.demo",
    "shim": "gpuslice.dev.gpusim.cli",
}
SUBCOMMAND_MODULES: tuple[str, ...] = tuple(SUBCOMMANDS.values())


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
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only a subcommand whose module is not part of this build is skipped; a broken
            # import inside an existing module still fails loudly.
            if exc.name != name:
                raise
            continue
        module.register(sub)
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
