"""Fetches and unpacks every PyPI wheel of the compatibility matrix (tests/shim/matrix.py) into the
cache, before the suite starts: a cold download of several GB inside a test would count against
that test's timeout, and the suite's workers would all wait on it at once.

Run by `make pytest`; cached wheels cost nothing (`gpuslice_dev.wheels` keeps them by version).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix  # the matrix's lists are the one source of the versions

from gpuslice_dev.wheels import ensure_unpacked


def _pairs(value: object) -> list[tuple[str, str]]:
    def pair(v: object) -> bool:
        return isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v)

    if pair(value):
        return [value]  # type: ignore[list-item]
    if isinstance(value, list) and value and all(pair(v) for v in value):
        return list(value)
    return []


def main() -> None:
    wheels = sorted({p for name in dir(matrix) if name.isupper() for p in _pairs(getattr(matrix, name))})
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda w: ensure_unpacked(*w), wheels))
    print(f"compatibility-matrix wheels: {len(wheels)} cached in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
