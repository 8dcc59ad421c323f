"""Card faults in the driver double: an XID, a card fallen off the bus, a pending remap, a reset.

The double keeps each node's card health in `<fake-gpus.conf>.state/health.bin`, shared by every
process that loads it (the node agent, the pods' CUDA programs); `gpuslice-fake-gpu-fault` is its
only writer. An XID also does to the card what the driver does (79: lost; 48/95: uncorrectable ECC
in running contexts and a pending retirement/remap; 63/94: a pending retirement/remap; 64: remap
failure); `clear` is a reset.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


class GpuFaultError(RuntimeError):
    pass


def inject(
    config: Path | str,
    gpu: str,
    *,
    xid: int | None = None,
    lost: bool = False,
    pending_remap: bool = False,
    clear: bool = False,
) -> str:
    """Apply one fault (exactly one of the keywords) to GPU `gpu` (index or UUID) of the node whose
    double is described by `config`; returns the tool's line "<index> <uuid> <what>"."""
    from gpuslice_dev.gpusim.build import ensure_built

    chosen = [xid is not None, lost, pending_remap, clear]
    if sum(chosen) != 1:
        raise GpuFaultError("give exactly one of xid, lost, pending_remap, clear")
    args = [str(ensure_built().fault_tool), "--config", str(config), "--gpu", gpu]
    if xid is not None:
        args += ["--xid", str(xid)]
    else:
        args.append("--lost" if lost else "--pending-remap" if pending_remap else "--clear")
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise GpuFaultError(out.stderr.strip() or f"gpuslice-fake-gpu-fault exited {out.returncode}")
    return out.stdout.strip()
