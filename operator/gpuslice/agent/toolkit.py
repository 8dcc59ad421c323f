"""The node's NVIDIA container toolkit must not hand GPUs to containers that hold no slice.

The NVIDIA container runtime (RuntimeClass `nvidia`, or a node whose default runtime is NVIDIA's)
injects GPUs that a container asks for by environment variable (`NVIDIA_VISIBLE_DEVICES=all`, which
an image's ENV can set where admission cannot see it) or by volume mounts under /var/run/nvidia-
container-devices. Either way the container gets whole cards at full memory without the shim.
gpuslice pods need none of it (their devices come through CDI, from the agent's claim specs), so the
agent publishes this node's GPUs only when the toolkit's config
(`/etc/nvidia-container-runtime/config.toml`, keys as in NVIDIA's api/config/v1/config.go) says:

- `[nvidia-container-runtime] mode = "cdi"` (the default "auto" and "legacy" inject by env var
  through nvidia-container-cli; "jit-cdi" builds devices from the env var as well);
- `accept-nvidia-visible-devices-envvar-when-unprivileged = false` (the default is true: an
  unprivileged container's env var is honoured);
- `accept-nvidia-visible-devices-as-volume-mounts` not true (default false).

No file means no NVIDIA container runtime on the node: devices reach containers only through CDI,
which is safe. While the config is unsafe the agent publishes no devices (its ResourceSlices are
withdrawn), records a Warning Event `NvidiaToolkitUnsafe` on its Node naming each unsafe setting and
the fix, and sets `gpuslice_agent_toolkit_unsafe` to 1; it re-reads the file every few seconds and
publishes again once it is fixed.
"""

from __future__ import annotations

import asyncio
import os
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuslice import logs, metrics
from gpuslice.agent.events import event_body
from gpuslice.kubehttp import ApiError

if TYPE_CHECKING:
    from gpuslice.agent.kube import Kube

log = logs.get(__name__)

DEFAULT_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
#: environment default of `gpuslice agent --nvidia-toolkit-config`
CONFIG_ENV = "GPUSLICE_NVIDIA_TOOLKIT_CONFIG"
EVENT_REASON = "NvidiaToolkitUnsafe"
EVENT_REASON_FIXED = "NvidiaToolkitSafe"

ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
VOLUME_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
RUNTIME_TABLE = "nvidia-container-runtime"
FIX_COMMAND = (
    f"nvidia-ctk config --in-place --set {RUNTIME_TABLE}.mode=cdi --set {ENVVAR_KEY}=false "
    f"--set {VOLUME_KEY}=false"
)


def default_config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def unsafe_settings(raw: bytes | None) -> list[str]:
    """What in a toolkit config (its bytes; None: no file) lets containers take GPUs outside CDI
    claims: one line per unsafe setting, saying what to set. Empty: safe."""
    if raw is None:
        return []
    try:
        cfg: dict[str, Any] = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return [f"the file is not valid TOML ({exc}): the agent cannot tell what the runtime does"]
    found: list[str] = []
    runtime = cfg.get(RUNTIME_TABLE)
    mode = runtime.get("mode", "auto") if isinstance(runtime, dict) else "auto"
    if mode != "cdi":
        shown = f"{mode!r}" + (
            " (unset: the default)" if not isinstance(runtime, dict) or "mode" not in runtime else ""
        )
        found.append(
            f'[{RUNTIME_TABLE}] mode is {shown}: set mode = "cdi" (other modes inject GPUs named by '
            "NVIDIA_VISIBLE_DEVICES)"
        )
    envvar = cfg.get(ENVVAR_KEY, True)
    if envvar is not False:
        shown = "unset (default true)" if ENVVAR_KEY not in cfg else f"{envvar!r}"
        found.append(
            f"{ENVVAR_KEY} is {shown}: set it to false (otherwise any container whose image sets "
            "NVIDIA_VISIBLE_DEVICES gets GPUs)"
        )
    volumes = cfg.get(VOLUME_KEY, False)
    if volumes is not False:
        found.append(f"{VOLUME_KEY} is {volumes!r}: set it to false (or remove it)")
    return found


def read_config(path: Path) -> bytes | None:
    """The file's bytes; None when it does not exist (no NVIDIA runtime). Other errors raise."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def verdict_message(path: Path, found: list[str]) -> str:
    return (
        f"NVIDIA container toolkit config {path} lets containers take GPUs without a gpuslice claim: "
        + "; ".join(found)
        + f". gpuslice publishes no GPUs of this node until it is fixed, e.g. `{FIX_COMMAND}` "
        "(then restart the container runtime)."
    )


#: records an Event on this agent's Node: (type, reason, message)
NodeEvent = Callable[[str, str, str], Awaitable[None]]


@dataclass
class ToolkitGuard:
    """Re-reads the toolkit config every `interval` and tells the publisher whether it may publish."""

    node: str
    path: Path
    #: called with the reason the node's GPUs must not be published, or None when they may
    set_blocked: Callable[[str | None], None]
    event: NodeEvent
    interval: float = 5.0
    blocked: str | None = None
    _checked: bool = False

    def check(self) -> str | None:
        """One reading: the message why the node's GPUs must not be published (None: safe)."""
        try:
            found = unsafe_settings(read_config(self.path))
        except OSError as exc:  # unreadable: cannot be shown safe
            found = [f"the file cannot be read ({exc})"]
        metrics.TOOLKIT_UNSAFE.labels(node=self.node).set(1 if found else 0)
        return verdict_message(self.path, found) if found else None

    async def step(self) -> None:
        """Check, and on a change (or the first time) tell the publisher, the log and the Node."""
        message = self.check()
        if self._checked and message == self.blocked:
            return
        first, self.blocked, self._checked = not self._checked, message, True
        self.set_blocked(message)
        if message:
            log.error("NVIDIA container toolkit unsafe; not publishing GPUs", node=self.node, message=message)
            await self.event("Warning", EVENT_REASON, message)
        elif not first:
            log.info(
                "NVIDIA container toolkit safe again; publishing GPUs", node=self.node, path=str(self.path)
            )
            await self.event(
                "Normal",
                EVENT_REASON_FIXED,
                f"NVIDIA container toolkit config {self.path} is safe; GPUs published",
            )

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("toolkit check failed; retrying")
            await asyncio.sleep(self.interval)


def node_event_recorder(kube: Kube, node: str, node_uid: Callable[[], str | None]) -> NodeEvent:
    """An Event recorder on the Node `node` (core/v1 Events in namespace default, as kubelet's)."""

    async def record(type_: str, reason: str, message: str) -> None:
        involved: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": node}
        uid = node_uid()
        if uid:
            involved["uid"] = uid
        try:
            await kube.create_event("default", event_body(involved, "default", node, type_, reason, message))
        except ApiError as exc:
            log.warning("could not record node event", node=node, reason=reason, status=exc.status)

    return record
