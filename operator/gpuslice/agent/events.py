"""Events on a GpuSlice from the agent (core/v1 Events in the slice's namespace)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpuslice import constants as c
from gpuslice import logs
from gpuslice.agent.kube import Kube
from gpuslice.kubehttp import ApiError
from gpuslice.timefmt import rfc3339

log = logs.get(__name__)


def event_body(
    involved: dict[str, Any], namespace: str, node: str, type_: str, reason: str, message: str
) -> dict[str, Any]:
    """A core/v1 Event from the agent on `node` about `involved` (its apiVersion, kind, name...),
    stamped now; each is a new Event (count 1), named after the object as kubelet's are."""
    stamp = rfc3339(dt.datetime.now(dt.UTC))
    return {
        "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": "gpuslice-agent", "host": node},
    }


async def slice_event(kube: Kube, node: str, key: str, type_: str, reason: str, message: str) -> None:
    """Record an Event on the GpuSlice `key` (namespace/name); a refused write is logged, not raised."""
    namespace, name = key.split("/", 1)
    involved = {"apiVersion": c.GROUP_VERSION, "kind": c.SLICE_KIND, "name": name, "namespace": namespace}
    body = event_body(involved, namespace, node, type_, reason, message)
    try:
        await kube.create_event(namespace, body)
    except ApiError as exc:
        log.warning("could not record event", slice=key, reason=reason, status=exc.status)
