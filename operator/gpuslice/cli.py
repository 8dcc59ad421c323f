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

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "gpuslice.operator.cli",
    "gpuslice.agent.cli",
    "gpuslice.explain",
    "gpuslice.check",
    # Dev tooling (gpuslice.dev): absent from a product install, so skipped when missing.
    "gpuslice.dev.devcluster.cli",
    "gpuslice.dev.demo",
    "gpuslice.dev.gpusim.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuslice", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--version", action="version", version=f"gpuslice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
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
    parser = build_parser()
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
