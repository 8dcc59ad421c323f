"""`gpuslice-dev devcluster gpu-fault`: a simulated card of a running devcluster fails or recovers.

The node's driver double (the one its agent and its pods load) gets the fault at once: an XID
event to every NVML event waiter, and what that XID does to the card (`gpusim.faults`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from gpuslice_dev.devcluster.cluster import DevCluster


def node_fake_config(cluster: DevCluster, node: str) -> Path | None:
    """The driver double's GPU description of `node` (real or kwok), or None when it has none."""
    from gpuslice_dev.agents import agent_dirs
    from gpuslice_dev.devcluster.node_agents import fake_gpu_config

    st = cluster.state()
    if st is None:
        return None
    if node in st.real_nodes:
        path = fake_gpu_config(cluster, node)
    else:
        path = agent_dirs(cluster.dir / "agents", node)["state"] / "simulated" / "fake-gpus.conf"
    return path if path.is_file() else None


def register(
    cmds: argparse._SubParsersAction[argparse.ArgumentParser],
    with_dir: Callable[[argparse.ArgumentParser], None],
) -> None:
    p = cmds.add_parser(
        "gpu-fault",
        help="make a simulated GPU fail (an XID, lost, a pending remap) or recover (--clear)",
        description=__doc__,
    )
    with_dir(p)
    p.add_argument("--node", required=True, help="the node whose card fails")
    p.add_argument("--gpu", required=True, metavar="INDEX|UUID", help="the card: NVML index or GPU- UUID")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--xid", type=int, help="raise this XID (e.g. 79: fallen off the bus, 48: double-bit ECC)"
    )
    what.add_argument("--lost", action="store_true", help="the card stops answering, without an event")
    what.add_argument(
        "--pending-remap", action="store_true", help="a page retirement / row remap waits for a reset"
    )
    what.add_argument("--clear", action="store_true", help="reset the card: healthy again")
    p.set_defaults(func=_gpu_fault)


def _gpu_fault(args: argparse.Namespace) -> int:
    from gpuslice_dev.gpusim import faults

    cluster = DevCluster(args.dir)
    config = node_fake_config(cluster, args.node)
    if config is None:
        print(
            f"error: node {args.node!r} of the devcluster in {cluster.dir} has no simulated GPUs "
            "(start it with `gpuslice-dev devcluster up --simulate-gpus SPEC`)",
            file=sys.stderr,
        )
        return 1
    try:
        line = faults.inject(
            config, args.gpu, xid=args.xid, lost=args.lost, pending_remap=args.pending_remap, clear=args.clear
        )
    except faults.GpuFaultError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    index, uuid, what = line.split(" ", 2)
    print(f"{args.node} gpu {index} ({uuid}): {what}")
    return 0
