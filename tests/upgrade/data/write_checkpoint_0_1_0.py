"""Writes `checkpoint-0.1.0.json` with release 0.1.0's own checkpoint code, as its agent writes it.

Run against that release's tree, not this one:

    git archive 4ff7adc9020e534cac8e7a17758cdd38992dd65f operator | tar -x -C /tmp/v010
    PYTHONPATH=/tmp/v010/operator python tests/upgrade/data/write_checkpoint_0_1_0.py

The claims are what a node holds in the middle of its work: two prepared slices on two cards (one
taken over from a prepare-ahead, one still ahead of kubelet) and one left in PrepareStarted by a
killed agent, which the next agent must finish from the record alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gpuslice
from gpuslice.agent import cdi
from gpuslice.agent.checkpoint import Checkpoint, CheckpointStore, ClaimRecord, PreparedDevice

GIB = 1 << 30
CARDS = ("GPU-5f1c3a4e-0d5b-4c2a-9a41-2f7e8b1c0d01", "GPU-9b2e7d10-4f3a-4e8c-b1d2-6a5c4e3f2b02")
NODE = "gpu-node-1"


def _device(uid: str, card: int, slot: int, memory_gib: int, share: int) -> PreparedDevice:
    return PreparedDevice(
        request="gpu",
        pool=NODE,
        device=f"gpu{card}-slice{slot}",
        gpu_uuid=CARDS[card],
        memory_bytes=memory_gib * GIB,
        compute_share=share,
        cdi_device_ids=[cdi.cdi_device_id(uid), cdi.nvidia_device_id(CARDS[card])],
    )


def main() -> None:
    assert not gpuslice.__file__ or "v010" in gpuslice.__file__, f"not release 0.1.0: {gpuslice.__file__}"
    claims = [
        ClaimRecord(uid="0b6f5d1e-7c2a-4e1f-9d3b-a1c2e3f40001", namespace="team-a", name="llm-gpu-x7k2p",
                    state="Prepared", devices=[_device("0b6f5d1e-7c2a-4e1f-9d3b-a1c2e3f40001", 0, 0, 8, 25)]),
        ClaimRecord(uid="4c1e2f3a-5b6d-4e7f-8a9b-c0d1e2f30002", namespace="team-b", name="web-gpu-q9m4z",
                    state="Prepared", ahead=True,
                    devices=[_device("4c1e2f3a-5b6d-4e7f-8a9b-c0d1e2f30002", 1, 3, 4, 10)]),
        ClaimRecord(uid="9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d0003", namespace="team-a", name="train-gpu-h3v8c",
                    state="PrepareStarted",
                    devices=[_device("9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d0003", 0, 1, 16, 50)]),
    ]  # fmt: skip
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("checkpoint-0.1.0.json")
    CheckpointStore(out).save(Checkpoint(claims={r.uid: r for r in claims}))


if __name__ == "__main__":
    main()
