"""Events on a GpuSlice from the agent (core/v1 Events in the slice's namespace)."""

from __future__ import annotations

import datetime as dt

from gpuslice import constants as c
from gpuslice import logs
from gpuslice.agent.kube import Kube
from gpuslice.kubehttp import ApiError

log = logs.get(__name__)


async def slice_event(kube: Kube, node: str, key: str, type_: str, reason: str, message: str) -> None:
    """Record an Event on the GpuSlice `key` (namespace/name); a refused write is logged, not raised."""
    namespace, name = key.split("/", 1)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "metadata": {"generateName": f"{name}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": c.GROUP_VERSION, "kind": c.SLICE_KIND,
            "name": name, "namespace": namespace,
        },
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": "gpuslice-agent", "host": node},
    }  # fmt: skip
    try:
        await kube.create_event(namespace, body)
    except ApiError as exc:
        log.warning("could not record event", slice=key, reason=reason, status=exc.status)
