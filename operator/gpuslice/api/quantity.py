"""Integer values of Kubernetes resource quantities as the API server returns them ("8Gi", "100")."""

from __future__ import annotations

import re

_SUFFIX = {
    "": 1,
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def parse_int_quantity(value: str | int) -> int:
    """Whole-number quantities only: every quantity gpuslice publishes is a whole number of bytes or
    percent, and the API server keeps them whole when it canonicalises them."""
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(value.strip())
    if not match:
        raise ValueError(f"quantity {value!r} is not a whole number with an optional binary/decimal suffix")
    return int(match.group(1)) * _SUFFIX[match.group(2) or ""]
