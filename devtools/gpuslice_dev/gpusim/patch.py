"""Private copies of libgpuslice.so that read their limits from another file.

The config path lives in a marked, fixed-size array inside the library (shim/src/gs_init.c,
gs_config_slot), never in the environment. `gpuslice-dev shim run` and the tests write a copy with the
array rewritten; in a container the unmodified library reads constants.CONTAINER_CONFIG_PATH.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuslice.files import atomic_write

MARKER = b"@@GPUSLICE_CONFIG_PATH@@"
SLOT_BYTES = 4096


class PatchError(RuntimeError):
    pass


def config_path_of(library: Path) -> str:
    """The config path compiled into (or patched into) `library`."""
    data = library.read_bytes()
    start = _slot_start(data, library)
    end = data.index(b"\0", start)
    return data[start:end].decode()


def write_private_shim(library: Path, config_path: Path | str, dest_dir: Path) -> Path:
    """Copy `library` into dest_dir with its config path set to `config_path`; returns the copy."""
    data = bytearray(library.read_bytes())
    start = _slot_start(bytes(data), library)
    encoded = os.fsencode(str(config_path))
    room = SLOT_BYTES - len(MARKER) - 1
    if len(encoded) > room or b"\0" in encoded:
        raise PatchError(f"config path {config_path!s} is longer than {room} bytes or contains NUL")
    data[start : start + room + 1] = encoded + b"\0" * (room + 1 - len(encoded))
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / library.name
    atomic_write(out, bytes(data), 0o555)
    return out


def _slot_start(data: bytes, library: Path) -> int:
    first = data.find(MARKER)
    if first < 0 or data.find(MARKER, first + 1) >= 0:
        raise PatchError(f"{library} does not hold exactly one config-path slot: not a libgpuslice.so build")
    return first + len(MARKER)
