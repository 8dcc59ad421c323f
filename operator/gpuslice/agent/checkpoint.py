"""The agent's record of prepared claims, on disk so a restart loses nothing and repeats nothing.

A claim is recorded as `PrepareStarted` (with everything needed to finish or undo it) before any file
is written, and as `Prepared` once its CDI spec is in place. Every write replaces the file atomically
(write, fsync, rename), so a kill at any point leaves either the old or the new checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from gpuslice.files import atomic_write

CHECKPOINT_VERSION = 1


class PreparedDevice(BaseModel):
    request: str
    pool: str
    device: str
    gpu_uuid: str
    memory_bytes: int
    compute_share: int
    cdi_device_ids: list[str]


class ClaimRecord(BaseModel):
    uid: str
    namespace: str
    name: str
    state: Literal["PrepareStarted", "Prepared"]
    devices: list[PreparedDevice]
    #: Prepared by the agent when the claim's pod was bound, before kubelet asked (`agent.ahead`);
    #: False once kubelet has asked for it. Only such claims are ever unprepared by the agent itself.
    ahead: bool = False


class Checkpoint(BaseModel):
    version: int = CHECKPOINT_VERSION
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)


class CheckpointError(RuntimeError):
    pass


class CheckpointStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Checkpoint:
        if not self.path.exists():
            return Checkpoint()
        try:
            checkpoint = Checkpoint.model_validate_json(self.path.read_bytes())
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {self.path} is not readable ({exc}); it was not written by this agent version "
                "or was edited by hand. Move it aside only after unpreparing the claims it lists."
            ) from exc
        if checkpoint.version != CHECKPOINT_VERSION:
            raise CheckpointError(
                f"checkpoint {self.path} has version {checkpoint.version}, "
                f"this agent reads version {CHECKPOINT_VERSION}"
            )
        return checkpoint

    def save(self, checkpoint: Checkpoint) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, checkpoint.model_dump_json(indent=1))
