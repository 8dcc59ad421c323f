"""The dev tooling's console script, `gpuslice-dev`: devcluster, demo, shim (the simulator)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpuslice.cli import build_parser, run

#: subcommand -> the module that registers it (imported only when named, like `gpuslice`'s).
SUBCOMMANDS: dict[str, str] = {
    "devcluster": "gpuslice_dev.devcluster.cli",
    "demo": "gpuslice_dev.demo",
    # Runs a command under the shim on the driver test double (or, without --simulate-gpus, on
    # this machine's driver): a developer's tool, so it lives with the simulator, not in the product.
    "shim": "gpuslice_dev.gpusim.cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(
        argv, SUBCOMMANDS, "gpuslice-dev", "gpuslice development tooling: local cluster, demo, GPU simulator"
    )
    return run(parser, argv)
