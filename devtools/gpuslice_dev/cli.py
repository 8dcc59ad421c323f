"""The dev tooling's console script, `gpuslice-dev`: devcluster, demo, shim (the simulator)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> the module that registers it (imported only when named, like `gpuslice`'s).
SUBCOMMANDS: dict[str, str] = {
    "devcluster": "gpuslice_dev.devcluster.cli",
    "demo": "gpuslice_dev.demo",
    # Runs a command under the shim on the driver test double (or, without --simulate-gpus, on
    # this machine's driver): a developer's tool, so it lives with the simulator, not in the product.
    "shim": "gpuslice_dev.gpusim.cli",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuslice-dev", description="gpuslice development tooling: local cluster, demo, GPU simulator"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    first = next((a for a in argv or () if not a.startswith("-")), None)
    modules = [SUBCOMMANDS[first]] if first in SUBCOMMANDS else list(SUBCOMMANDS.values())
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
