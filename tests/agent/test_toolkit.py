"""The NVIDIA toolkit, node side: the agent publishes no GPUs while the node's NVIDIA container
toolkit would hand GPUs to containers outside CDI claims."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gpuslice import metrics
from gpuslice.agent import toolkit
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.publisher import Publisher

SAFE = b"""
accept-nvidia-visible-devices-envvar-when-unprivileged = false
accept-nvidia-visible-devices-as-volume-mounts = false

[nvidia-container-runtime]
mode = "cdi"
"""
# what `nvidia-ctk runtime configure` leaves by default (keys of NVIDIA's api/config/v1/config.go)
DEFAULTS = b"""
#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false

[nvidia-container-cli]
ldconfig = "@/sbin/ldconfig"

[nvidia-container-runtime]
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]
"""


def test_no_file_means_no_nvidia_runtime_and_is_safe() -> None:
    assert toolkit.unsafe_settings(None) == []
    assert toolkit.read_config(Path("/nonexistent/config.toml")) is None


def test_a_cdi_only_config_is_safe() -> None:
    assert toolkit.unsafe_settings(SAFE) == []
    assert (
        toolkit.unsafe_settings(SAFE.replace(b"accept-nvidia-visible-devices-as-volume-mounts = false", b""))
        == []
    )


def test_the_toolkit_defaults_are_unsafe_and_each_setting_is_named() -> None:
    found = toolkit.unsafe_settings(DEFAULTS)
    assert len(found) == 2
    assert found[0].startswith("[nvidia-container-runtime] mode is 'auto'") and 'set mode = "cdi"' in found[0]
    assert found[1].startswith(
        "accept-nvidia-visible-devices-envvar-when-unprivileged is unset (default true): set it to false"
    )
    assert toolkit.unsafe_settings(b"") == [
        "[nvidia-container-runtime] mode is 'auto' (unset: the default): set mode = \"cdi\" (other modes "
        "inject GPUs named by NVIDIA_VISIBLE_DEVICES)",
        "accept-nvidia-visible-devices-envvar-when-unprivileged is unset (default true): set it to false "
        "(otherwise any container whose image sets NVIDIA_VISIBLE_DEVICES gets GPUs)",
    ]


def test_each_unsafe_setting_alone() -> None:
    legacy = SAFE.replace(b'mode = "cdi"', b'mode = "legacy"')
    assert [f.split(":")[0] for f in toolkit.unsafe_settings(legacy)] == [
        "[nvidia-container-runtime] mode is 'legacy'"
    ]
    jit = SAFE.replace(b'mode = "cdi"', b'mode = "jit-cdi"')
    assert len(toolkit.unsafe_settings(jit)) == 1
    envvar = SAFE.replace(b"unprivileged = false", b"unprivileged = true")
    assert toolkit.unsafe_settings(envvar)[0].startswith(
        "accept-nvidia-visible-devices-envvar-when-unprivileged is True"
    )
    # not a boolean: the runtime would not read it as false either
    quoted = SAFE.replace(b"unprivileged = false", b'unprivileged = "false"')
    assert len(toolkit.unsafe_settings(quoted)) == 1
    volumes = SAFE.replace(b"as-volume-mounts = false", b"as-volume-mounts = true")
    assert toolkit.unsafe_settings(volumes) == [
        "accept-nvidia-visible-devices-as-volume-mounts is True: set it to false (or remove it)"
    ]


def test_a_file_that_is_not_toml_is_unsafe() -> None:
    (found,) = toolkit.unsafe_settings(b"mode = = cdi")
    assert found.startswith("the file is not valid TOML")


def test_the_message_names_the_file_the_settings_and_the_fix() -> None:
    msg = toolkit.verdict_message(Path("/etc/nvidia-container-runtime/config.toml"), ["a", "b"])
    assert "/etc/nvidia-container-runtime/config.toml" in msg and "a; b" in msg
    assert "nvidia-ctk config --in-place --set nvidia-container-runtime.mode=cdi" in msg
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged=false" in msg


def test_the_config_path_defaults_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.delenv(toolkit.CONFIG_ENV, raising=False)
    assert toolkit.default_config_path() == Path("/etc/nvidia-container-runtime/config.toml")
    monkeypatch.setenv(toolkit.CONFIG_ENV, "/tmp/x.toml")
    assert toolkit.default_config_path() == Path("/tmp/x.toml")


class FakeKube:
    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}

    async def list_pool_slices(self, node: str) -> list[dict[str, Any]]:
        return list(self.slices.values())

    async def apply_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self.slices[body["metadata"]["name"]] = body
        return body  # stored as sent

    async def delete_slice(self, name: str) -> None:
        self.slices.pop(name, None)


GPU = GpuInfo(
    index=0, uuid="GPU-1", product_name="Tesla V100-PCIE-32GB", memory_bytes=32 << 30,
    cuda_compute_capability="7.0", driver_version="535.183.01", pci_bus_id="00000000:04:00.0",
    minor_number=0, cuda_driver_version="12.2",
)  # fmt: skip


def test_an_unsafe_config_withdraws_the_pool_and_a_fix_publishes_it_again(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    kube = FakeKube()
    publisher = Publisher("n1", [GPU], kube)  # type: ignore[arg-type]
    publisher.packages_listed([])
    publisher.node_seen({"metadata": {"name": "n1", "uid": "u1"}})
    events: list[tuple[str, str, str]] = []

    async def event(type_: str, reason: str, message: str) -> None:
        events.append((type_, reason, message))

    guard = toolkit.ToolkitGuard("n1", config, publisher.set_blocked, event)

    def gauge() -> float | None:
        return metrics.AGENT_REGISTRY.get_sample_value("gpuslice_agent_toolkit_unsafe", {"node": "n1"})

    async def scenario() -> None:
        await guard.step()  # no file: safe, no event
        await publisher.sync()
        assert kube.slices and events == [] and gauge() == 0
        config.write_bytes(DEFAULTS)
        await guard.step()
        await publisher.sync()
        assert kube.slices == {}, "an unsafe node publishes no devices"
        assert gauge() == 1
        ((kind, reason, message),) = events
        assert (kind, reason) == ("Warning", "NvidiaToolkitUnsafe")
        assert "mode is 'auto'" in message and "envvar-when-unprivileged is unset" in message
        await guard.step()  # unchanged: no second event
        assert len(events) == 1
        config.write_bytes(SAFE)
        await guard.step()
        await publisher.sync()
        assert kube.slices and gauge() == 0
        assert events[-1][:2] == ("Normal", "NvidiaToolkitSafe")

    asyncio.run(scenario())
