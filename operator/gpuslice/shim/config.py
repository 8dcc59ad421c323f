"""The slice limits file the shim reads (constants.CONTAINER_CONFIG_PATH in a container).

Format (shim/README.md, "Limits file"): `key=value` lines, `#` comments, no duplicates, no unknown
keys. The C parser in shim/src/gs_config.c accepts exactly what `render()` writes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuslice.files import atomic_write

UUID_PATTERN = r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
_KEYS = ("version", "memory_bytes", "compute_share", "gpu_uuid", "usage_dir", "context_overhead_bytes")
_UNLIMITED = "unlimited"


class SliceConfigError(ValueError):
    pass


class SliceConfig(BaseModel):
    """Limits of one slice. memory_bytes=None means no memory limit (the shim reports the card)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    memory_bytes: Annotated[int, Field(gt=0, lt=2**64 - 1)] | None
    compute_share: Annotated[int, Field(ge=1, le=100)] = 100
    gpu_uuid: Annotated[str, Field(pattern=UUID_PATTERN)]
    usage_dir: str
    #: Charged once per process and device when its first context is created.
    context_overhead_bytes: Annotated[int, Field(ge=0)] = 0

    @field_validator("usage_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or "\n" in v or len(v) >= 4096 - 16:
            raise ValueError(f"usage_dir must be an absolute path on one line, got {v!r}")
        return v

    def render(self) -> str:
        memory = _UNLIMITED if self.memory_bytes is None else str(self.memory_bytes)
        return (
            f"version={self.version}\n"
            f"memory_bytes={memory}\n"
            f"compute_share={self.compute_share}\n"
            f"gpu_uuid={self.gpu_uuid}\n"
            f"usage_dir={self.usage_dir}\n"
            f"context_overhead_bytes={self.context_overhead_bytes}\n"
        )

    @classmethod
    def parse(cls, text: str) -> SliceConfig:
        values: dict[str, str] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise SliceConfigError(f"line {lineno} is not key=value: {raw!r}")
            if key not in _KEYS:
                raise SliceConfigError(f"line {lineno}: unknown key {key!r} (known: {', '.join(_KEYS)})")
            if key in values:
                raise SliceConfigError(f"line {lineno}: key {key!r} given twice")
            values[key] = value
        missing = [k for k in _KEYS[:5] if k not in values]
        if missing:
            raise SliceConfigError(f"required key(s) missing: {', '.join(missing)}")
        if values["version"] != "1":
            raise SliceConfigError(f"version must be 1, got {values['version']!r}")
        for key in ("compute_share", "context_overhead_bytes"):
            if key in values and not re.fullmatch(r"\d+", values[key]):
                raise SliceConfigError(f"{key} must be a whole number, got {values[key]!r}")
        memory = values["memory_bytes"]
        if memory != _UNLIMITED and not re.fullmatch(r"\d+", memory):
            raise SliceConfigError(f"memory_bytes must be a whole number or 'unlimited', got {memory!r}")
        try:
            return cls(
                memory_bytes=None if memory == _UNLIMITED else int(memory),
                compute_share=int(values["compute_share"]),
                gpu_uuid=values["gpu_uuid"],
                usage_dir=values["usage_dir"],
                context_overhead_bytes=int(values.get("context_overhead_bytes", "0")),
            )
        except ValueError as exc:
            raise SliceConfigError(str(exc)) from exc

    def write(self, path: Path | str) -> None:
        """Atomically replace `path` with this config, read-only (0444): the shim never needs to write it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self.render(), 0o444)
