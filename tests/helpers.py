"""Small helpers for tests that talk to the real control plane through kubectl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpuslice.dev.devcluster.cluster import DevCluster

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout: float = 60, interval: float = 0.25, what: str = "") -> T:
    """Poll until `check` returns something truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last value: {last!r}")


def get_json(cluster: DevCluster, *args: str, **kw: Any) -> Any:
    """`kubectl get ... -o json`, parsed; None when not found."""
    proc = cluster.kubectl("get", *args, "-o", "json", check=False, **kw)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)} failed: {proc.stderr}")
    return json.loads(proc.stdout)
