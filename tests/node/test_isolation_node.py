"""Isolation on the real node: the NVIDIA toolkit config gates publishing, and a process that bypasses
the shim is attributed from the host to its pod and slice, judged against that slice, stopped."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.agent import attribution, toolkit
from gpuslice_dev.agents import DEV_USAGE_INTERVAL
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name, fake_gpu_config, start_agents
from gpuslice_dev.gpusim import simulate
from gpuslice_dev.gpusim.build import ensure_built
from node.node_cluster import GPU_SPEC, TENANT, delete, run_pod, slice_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]
NODE = "real-node-0"
GIB = 1024**3
UNSAFE = b'[nvidia-container-runtime]\nmode = "legacy"\n'
SAFE = (
    b"accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
    b'[nvidia-container-runtime]\nmode = "cdi"\n'
)


def node_slices(cluster: DevCluster) -> list[dict[str, object]]:
    listing = get_json(cluster, "resourceslices", f"--field-selector=spec.nodeName={NODE}")
    return list(listing["items"])


def restart_agent(cluster: DevCluster) -> None:
    cluster.stop_processes(lambda name: name == agent_process_name(NODE))
    assert start_agents(cluster, GPU_SPEC) == [NODE]


def test_an_unsafe_nvidia_toolkit_config_publishes_no_gpus_until_fixed(
    node_cluster: DevCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_bytes(UNSAFE)
    wait_for(lambda: node_slices(node_cluster), 60, "the node's slices before the test")
    monkeypatch.setenv(toolkit.CONFIG_ENV, str(config))
    try:
        restart_agent(node_cluster)  # the agent reads its --nvidia-toolkit-config default from the env

        def event() -> dict[str, object] | None:
            events = get_json(
                node_cluster, "events", "-n", "default",
                f"--field-selector=reason={toolkit.EVENT_REASON},involvedObject.name={NODE}",
            )["items"]  # fmt: skip
            return events[-1] if events else None

        ev = wait_for(event, 60, "the NvidiaToolkitUnsafe Event on the Node")
        assert ev["type"] == "Warning" and ev["involvedObject"]["kind"] == "Node"  # type: ignore[index]
        message = str(ev["message"])
        assert str(config) in message and "mode is 'legacy'" in message, message
        assert "accept-nvidia-visible-devices-envvar-when-unprivileged is unset (default true)" in message
        assert "nvidia-ctk config --in-place" in message
        time.sleep(3)  # the agent has had its time to publish, and must not have
        assert node_slices(node_cluster) == [], "an unsafe node publishes no devices"
        config.write_bytes(SAFE)
        # The pool's slices are applied one by one (counters first, since 1.35 a slice holds devices or
        # counters): a listing between two applies shows the counters alone, so wait for the devices.
        wait_for(
            lambda: sum(len(s["spec"].get("devices") or []) for s in node_slices(node_cluster)),  # type: ignore[attr-defined]
            60,
            "the slices' devices once the config is fixed",
        )
    finally:
        monkeypatch.delenv(toolkit.CONFIG_ENV)
        restart_agent(node_cluster)
        wait_for(lambda: node_slices(node_cluster), 60, "the node's slices after the test")


# --- a process that bypasses the shim ----------------------------------------------------------------------


def _fake_gpu_minor(cluster: DevCluster, uuid: str) -> int:
    lines = dict(
        line.split("=", 1) for line in fake_gpu_config(cluster, NODE).read_text().splitlines() if "=" in line
    )
    index = next(k.split(".")[1] for k, v in lines.items() if k.endswith(".uuid") and v == uuid)
    return int(lines[f"gpu.{index}.minor"])


def _container_pid(pod_uid: str) -> int:
    """Host PID of the pod's workload (`sleep 3600`), found through /proc as the agent finds it."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            cmd[:2] == [b"sleep", b"3600"]
            and attribution.read_owner(int(entry.name)).owner.pod_uid == pod_uid
        ):
            return int(entry.name)
    raise AssertionError(f"no process of pod {pod_uid} found")


def _cgroup_procs_files(pid: int) -> list[Path]:
    """The cgroup.procs of every (v1) hierarchy `pid` is in; writing a PID there moves it in."""
    out = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            continue
        mount = controllers.removeprefix("name=").split(",")[0]
        f = Path("/sys/fs/cgroup") / mount / path.lstrip("/") / "cgroup.procs"
        if f.exists():
            out.append(f)
    return out


def gpu_holder(cluster: DevCluster, uuid: str, size: int, into_pod_of: int | None) -> subprocess.Popen[str]:
    """A process on GPU `uuid` that bypasses the shim: the host's cuda_probe on the driver test double
    (no libgpuslice.so), holding `size` bytes until its stdin closes. With `into_pod_of` (a container's
    host PID) it is first moved into that container's cgroups and PID namespace, as a process that
    loaded a renamed copy of libcuda inside the pod would be. Only that GPU's device node is in its
    /dev (a private mount namespace), so the driver shows it that card alone, as in a container."""
    built = ensure_built()
    env = {**os.environ, **simulate.fake_driver_env(fake_gpu_config(cluster, NODE), built.fake_dir)}
    env.pop("LD_PRELOAD", None)
    probe = [str(built.tests_dir / "cuda_probe"), "hold", str(size)]
    move = ""
    if into_pod_of is not None:
        move = "".join(f"echo $$ > {f}; " for f in _cgroup_procs_files(into_pod_of))
        probe = ["nsenter", f"--target={into_pod_of}", "--pid", "--cgroup", "--", *probe]
    devdir = Path(f"/tmp/gpuslice-holder-dev-{uuid}")
    minor = _fake_gpu_minor(cluster, uuid)
    script = (
        f"{move}mkdir -p {devdir} && touch {devdir}/nvidiactl {devdir}/nvidia{minor} && "
        f"mount --bind {devdir} /dev && exec {' '.join(probe)}"
    )
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "held rc=0", f"{line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc


def _release(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _memory_isolated(cluster: DevCluster, name: str) -> dict[str, str] | None:
    status = get_json(cluster, "gpuslice", name, "-n", TENANT).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == "MemoryIsolated"), None)


def _set_policy(cluster: DevCluster, policy: str | None) -> None:
    patch = {"spec": {"isolation": {"onViolation": policy} if policy else None}}
    cluster.kubectl("patch", "gpupackage", "v100-8g", "--type=merge", "-p", json.dumps(patch))


@pytest.fixture
def bypass_pod(node_cluster: DevCluster) -> Iterator[tuple[str, str, int]]:
    """A slice pod: (its GPU's UUID, its pod UID, the host PID of its workload)."""
    pod = run_pod(node_cluster, slice_pod("bypass", ["sleep", "3600"]))
    try:

        def gpu() -> str | None:
            return (get_json(node_cluster, "gpuslice", pod, "-n", TENANT).get("status") or {}).get("gpuUUID")

        uuid = wait_for(gpu, 60, "the slice's GPU in its status")
        uid = get_json(node_cluster, "pod", pod, "-n", TENANT)["metadata"]["uid"]
        yield uuid, uid, _container_pid(uid)
    finally:
        delete(node_cluster, "pod", pod)
        delete(node_cluster, "gpuslice", pod)
        # The garbage collector deletes the claim a moment later. The next test's slice of the same name
        # must not meet it: its pod would be given that claim, which is not the new slice's.
        delete(node_cluster, "resourceclaim", pod)


def test_a_pod_process_past_its_slice_is_attributed_reported_and_stopped(
    node_cluster: DevCluster, bypass_pod: tuple[str, str, int]
) -> None:
    uuid, _, container_pid = bypass_pod
    _set_policy(node_cluster, "Report")
    # 10 GiB: past the pod's 8 GiB slice, though well within the card's 32 GiB
    holder = gpu_holder(node_cluster, uuid, 10 * GIB, into_pod_of=container_pid)
    try:
        cond = wait_for(
            lambda: (c := _memory_isolated(node_cluster, "bypass")) and c["status"] == "False" and c,
            60, "MemoryIsolated=False on the bypassing pod's slice",
        )  # fmt: skip
        message = cond["message"]
        assert cond["reason"] == "ShimBypassed"
        assert (
            f"of slice {TENANT}/bypass hold 10240 MiB on GPU {uuid}, more than the slice's 8192 MiB"
            in message
        )
        assert "reported only (onViolation: Report)" in message
        time.sleep(2 * DEV_USAGE_INTERVAL)  # two more readings: Report never stops it
        assert holder.poll() is None, "a Report package's violator was stopped"

        _set_policy(node_cluster, "Stop")
        holder.wait(timeout=60)  # SIGKILLed by the agent (nsenter reports its child's signal)
        events = get_json(
            node_cluster, "events", "-n", TENANT,
            "--field-selector=reason=SliceMemoryViolation,involvedObject.name=bypass",
        )["items"]  # fmt: skip
        stopped = [e["message"] for e in events if "onViolation: Stop" in e["message"]]
        assert stopped and "8192 MiB" in stopped[0], [e["message"] for e in events]
        assert all(e["type"] == "Warning" and e["involvedObject"]["kind"] == "GpuSlice" for e in events)
    finally:
        _release(holder)
        _set_policy(node_cluster, None)


def test_a_host_process_on_a_sold_card_is_flagged_unknown_and_not_stopped(
    node_cluster: DevCluster, bypass_pod: tuple[str, str, int]
) -> None:
    uuid, _, _ = bypass_pod
    holder = gpu_holder(node_cluster, uuid, 1 * GIB, into_pod_of=None)
    try:
        cond = wait_for(
            lambda: (c := _memory_isolated(node_cluster, "bypass")) and c["status"] == "False" and c,
            60, "MemoryIsolated=False on the slice of the card the host process uses",
        )  # fmt: skip
        assert "belongs to no pod (a host process); it holds 1024 MiB on GPU" in cond["message"]
        assert "does not stop it" in cond["message"]
        time.sleep(2 * DEV_USAGE_INTERVAL)  # two more readings
        assert holder.poll() is None, "an unattributed process was stopped"
    finally:
        _release(holder)
    wait_for(
        lambda: (c := _memory_isolated(node_cluster, "bypass")) and c["status"] == "True",
        60, "MemoryIsolated=True once the host process is gone",
    )  # fmt: skip
