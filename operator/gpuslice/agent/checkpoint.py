"""The agent's record of prepared claims, on disk so a restart loses nothing and repeats nothing.

A claim is recorded as `PrepareStarted` (with everything needed to finish or undo it) before any file
is written, and as `Prepared` once its CDI spec is in place. Every write replaces the file atomically
(write, fsync, rename), so a kill at any point leaves either the old or the new checkpoint.

The format is versioned, and the agent is upgraded and rolled back under running pods, so:

* it reads every earlier version: `MIGRATIONS[n]` turns a version-n document into version n+1 (pure
  functions on the JSON, applied in order, so each format change is written once, against the one
  before it);
* it writes `WRITE_VERSION`, the newest format that the previous release reads, and not the newest
  it knows: a rollback to the previous release finds a checkpoint it reads, with every claim. A
  format change that a claim needs raises `WRITE_VERSION` one release after `CHECKPOINT_VERSION`
  (and `tests/agent/test_checkpoint_versions.py` holds the rule against the previous release's code);
* it refuses a newer version than it knows, naming both and what to do, and never rewrites it:
  reading it as an older format could drop what it does not know, and the claims it lists are
  prepared on this node whatever this agent thinks.

Version 1 is the format of release 0.1.0, the first; it is still the current one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from gpuslice import __version__
from gpuslice.files import atomic_write

#: The format this agent holds in memory; it reads it and every earlier one through `MIGRATIONS`.
CHECKPOINT_VERSION = 1
#: The format this agent writes: the newest one the previous release reads (see the module's doc).
WRITE_VERSION = 1
#: The first format ever written (release 0.1.0); nothing older exists to migrate from.
OLDEST_VERSION = 1

Document = dict[str, Any]
#: version n -> the function that turns a version-n document into a version n+1 one.
MIGRATIONS: dict[int, Callable[[Document], Document]] = {}


class PreparedDevice(BaseModel):
    request: str
    pool: str
    device: str
    gpu_uuid: str
    memory_bytes: int
    compute_share: int
    cdi_device_ids: list[str]
    #: may use idle compute of its card above its share (the package's computeBurst)
    compute_burst: bool = False

    @model_serializer(mode="wrap")
    def _without_default_burst(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Written only when set: a slice that does not burst keeps the document of the releases
        # before the field (a rollback reads the same checkpoint).
        out: dict[str, Any] = handler(self)
        if not self.compute_burst:
            out.pop("compute_burst", None)
        return out

    #: A MIG placement (Hardware package): its profile and first memory slice, and the UUID of the
    #: instance made for it at prepare (None until made). Left out of the file when None, so a
    #: software slice's record is what earlier agents wrote and read.
    mig_profile: str | None = Field(default=None, exclude_if=lambda v: v is None)
    mig_start: int | None = Field(default=None, exclude_if=lambda v: v is None)
    mig_uuid: str | None = Field(default=None, exclude_if=lambda v: v is None)
    #: an instance of a static layout: prepare finds it, unprepare leaves it (None: dynamic)
    mig_static: bool | None = Field(default=None, exclude_if=lambda v: v is None)


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


def migrate(
    document: Document,
    *,
    to: int = CHECKPOINT_VERSION,
    migrations: dict[int, Callable[[Document], Document]] = MIGRATIONS,
) -> Document:
    """`document` (a checkpoint of any version up to `to`) as a version-`to` one; `document` is not
    changed. Raises CheckpointError for a newer version or one no migration starts from."""
    version = document.get("version")
    if not isinstance(version, int):
        raise CheckpointError(f"has no integer version ({version!r})")
    if version > to:
        raise CheckpointError(
            f"has version {version}, newer than this agent ({__version__}) reads "
            f"(versions {OLDEST_VERSION} to {to}): it was written by a newer agent"
        )
    out = document
    while version < to:
        step = migrations.get(version)
        if step is None:
            raise CheckpointError(
                f"has version {version}, which no migration of this agent ({__version__}) reads; "
                f"it reads versions {OLDEST_VERSION} to {to}"
            )
        out = step(dict(out))
        if out.get("version") != version + 1:
            wrote = out.get("version")
            raise CheckpointError(f"the migration from version {version} wrote version {wrote!r}")
        version += 1
    return out


def downgrade(checkpoint: Checkpoint, version: int = WRITE_VERSION) -> Document:
    """The document written for `checkpoint` in format `version`. While `version` is the current one
    this is the checkpoint itself; a release that adds a format extends this for the one before."""
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"this agent writes version {CHECKPOINT_VERSION} only, not {version}")
    return checkpoint.model_dump(mode="json") | {"version": version}


class CheckpointStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Checkpoint:
        if not self.path.exists():
            return Checkpoint()
        try:
            document = json.loads(self.path.read_bytes())
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {self.path} is not readable: not JSON ({exc}); it was cut short or edited "
                "by hand. Move it aside only after unpreparing the claims it lists."
            ) from exc
        if not isinstance(document, dict):
            raise CheckpointError(f"checkpoint {self.path} is not readable: not a JSON object")
        try:
            current = migrate(document)
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint {self.path} {exc}. Its claims are prepared on this node: run the agent "
                "release that wrote it (roll the DaemonSet forward again), or drain the node and "
                "unprepare them with that release before moving the file aside; this agent does not "
                "rewrite it."
            ) from exc
        try:
            checkpoint = Checkpoint.model_validate(current)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {self.path} is not readable ({exc}); it was not written by any agent "
                "version or was edited by hand. Move it aside only after unpreparing the claims it lists."
            ) from exc
        checkpoint.version = CHECKPOINT_VERSION
        return checkpoint

    def save(self, checkpoint: Checkpoint) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(downgrade(checkpoint), indent=1))
