"""GPU nodes keep the taint gpuslice.io/gpu=present:NoExecute (see domain.isolation).

Level-triggered on every Node event: a GPU node without the taint gets it appended; a refused patch
is logged and tried again at the node's next event (kubelet updates its Node status at least every
few minutes). Nodes get no timer: a Kopf timer would put its finalizer on every Node.
The operator never removes the taint: taking a node out of GPU service is the platform's decision.

Only GPU nodes are watched: the label is a server-side selector. Every node renews its status every
few seconds to minutes, and a CPU node's body (kilobytes, tens of them with an image list) was
decoded and handled for nothing; with 20,000 noise pods on 200 CPU nodes the operator's idle RSS
was 17.7 % above a cluster without them, 9.7 % with the selector.
"""

from __future__ import annotations

from typing import Any

import kopf

from gpuslice.domain.isolation import taint_patch
from gpuslice.logs import get
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.retry import fast_path, refusal_is_temporary
from gpuslice.operator.state import OperatorState

log = get(__name__)


NODES = ("", "v1", "nodes")


def register(config: OperatorConfig, registry: kopf.OperatorRegistry | None = None) -> None:
    """The Node handler, when a GPU node label is configured (none: no node is tainted or watched)."""
    if config.gpu_node_label:
        kopf.on.event(*NODES, registry=registry)(node_event)


def select(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Kopf's Node watch asks the API server for GPU nodes only (`key=value` is a label selector)."""
    if config.gpu_node_label:
        settings.watching.label_selectors[NODES] = config.gpu_node_label


async def node_event(
    name: str,
    type: str | None,
    labels: kopf.Labels,
    spec: kopf.Spec,
    meta: kopf.Meta,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    if type == "DELETED":
        return
    ops = taint_patch(
        dict(labels),
        list(spec.get("taints") or []),
        memo.state.config.gpu_node_label,
        str(meta.get("resourceVersion", "")),
    )
    if ops is not None:
        await fast_path(_taint(memo.state, name, ops), "the next event of the Node")


async def _taint(state: OperatorState, name: str, ops: list[dict[str, Any]]) -> None:
    with refusal_is_temporary(f"node {name}", state.config.recheck_seconds):
        if await state.kube.json_patch("v1", "Node", name, ops, missing_ok=True):
            log.info("GPU node tainted", node=name, taint=ops[-1]["value"])
