"""Give the C heap's free pages back after a burst.

A burst of watch events decodes thousands of short-lived JSON bodies; CPython hands the freed
memory to glibc's malloc, which keeps it (fragmented among long-lived objects) unless asked with
`malloc_trim`. Without it the operator's RSS stayed at its burst peak for good.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc: ctypes.CDLL | None = None
_last = 0.0


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if not name:
            return None
        _libc = ctypes.CDLL(name)
    return getattr(_libc, "malloc_trim", None)  # glibc only; musl has none


def trim(min_interval: float = 5.0) -> bool:
    """malloc_trim(0), at most once per `min_interval` seconds; True when it gave memory back."""
    global _last
    now = time.monotonic()
    if now - _last < min_interval:
        return False
    _last = now
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
