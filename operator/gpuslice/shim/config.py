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
_MAX_PATH = 4096  # GS_PATH_MAX
_MAX_FILE_BYTES = 65536  # GS_CONFIG_MAX_BYTES
_MAX_LINE_BYTES = _MAX_PATH + 64
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def _u64(text: str) -> bool:
    """ASCII digits only and at most 2^64-1, as the C parser's parse_u64."""
    return _DIGITS.fullmatch(text) is not None and int(text) <= 2**64 - 1


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
    context_overhead_bytes: Annotated[int, Field(ge=0, le=2**64 - 1)] = 0

    @field_validator("usage_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        too_long = len(v.encode("utf-8", "surrogateescape")) >= _MAX_PATH - 16  # bytes, as in C
        if not v.startswith("/") or "\n" in v or "\0" in v or too_long:
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
        """Parse a limits file by exactly the C parser's rules (shim/src/gs_config.c).

        Lines end at "\\n" only; each line loses trailing spaces, tabs and CRs and leading spaces and
        tabs (no other whitespace); numbers are ASCII digits only (no sign, no whitespace, at most
        2^64-1); the file is at most 65536 bytes, a line shorter than 4160 bytes, without NUL bytes.
        A differential test feeds both parsers the same files.
        """
        raw_bytes = len(text.encode("utf-8", "surrogateescape"))
        if raw_bytes > _MAX_FILE_BYTES:
            raise SliceConfigError(f"larger than {_MAX_FILE_BYTES} bytes")
        values: dict[str, str] = {}
        for lineno, raw in enumerate(text.split("\n"), start=1):
            if len(raw.encode("utf-8", "surrogateescape")) >= _MAX_LINE_BYTES:
                raise SliceConfigError(f"line {lineno} is longer than {_MAX_LINE_BYTES - 1} bytes")
            if "\0" in raw:
                raise SliceConfigError(f"line {lineno} contains a NUL byte")
            line = raw.rstrip(" \t\r").lstrip(" \t")
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
            if key in values and not _u64(values[key]):
                raise SliceConfigError(f"{key} must be a whole number below 2^64, got {values[key]!r}")
        memory = values["memory_bytes"]
        if memory != _UNLIMITED and not _u64(memory):
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
