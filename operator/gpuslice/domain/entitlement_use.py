"""How much of its entitlements a tenant namespace holds, read from its gpuslice ResourceQuota.

The quota's devices key of a package counts every claim of the package's DeviceClass in the
namespace (GpuSlices' claims and those kube-scheduler makes for `resources.limits` pods), so its
`used` is what the namespace holds in both request forms, and its `hard` the entitlement. The
operator exports both so that an alert can warn a namespace before its next slice is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuslice import constants as c
from gpuslice.api.quantity import parse_int_quantity


def entitlement_use(hard: Mapping[str, str], used: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """package -> (slices entitled, slices held) for each package's devices key in the quota's status.

    From the quota's status, one snapshot of kube-apiserver's: `hard` and `used` are written
    together. A package the quota does not count yet (its status not filled in) is left out rather
    than shown as an entitlement of 0.
    """
    suffix = c.quota_key("")
    return {
        key.removesuffix(suffix): (parse_int_quantity(value), parse_int_quantity(used.get(key, "0")))
        for key, value in hard.items()
        if key.endswith(suffix) and key != suffix
    }
