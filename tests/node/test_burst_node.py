"""Work-conserving compute on the real node (kubelet, containerd, runc, the agent, the shim): a slice of
a computeBurst package (share 25) uses the whole of an idle card, gives the card back once a slice
of a plain package on the same card runs, and is held to its share again once the agent stops.

Every pod runs as Pod Security's `restricted` profile requires (non-root uids 1000 and 1000680000
with no passwd entry, a read-only root filesystem); the burst slice runs two processes, one per
container. The figures are the probe's own: its kernels' time over wall time, per second as each
progress line reaches the test (stamped on arrival), and over the run's second half at its end.
The agent's own figures (the measured utilization and the allowance it writes into the slice's
read-only utilization file) are read from the host beside them.

The driver double on a real node runs in daemon mode, where one process's kernels queue behind
another's only once the daemon has merged them (every 5 ms): two processes on one card can together
keep it more than 100 % busy, so the burst slice's two probe figures may sum above 100. That is why
the card's own figure (NVML, capped at 100 %) is asserted for the burst slice alone as well.
"""

from __future__ import annotations

import json
import mmap
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.agent.checkpoint import CheckpointStore
from gpuslice.shim.region import UTILIZATION_FILE
from gpuslice_dev.devcluster import faults
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name, start_agents
from gpuslice_dev.devcluster.realnode import dirs_of
from node.node_cluster import GPU_SPEC, REPO, TENANT, restricted_container
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=150)]
NODE = "real-node-0"
NS = "team-a-burst"
BURST_PACKAGE = "v100-8g-burst"
SHARE = 25
UIDS = {"one": (1000, 1000), "two": (1000680000, 0)}  # the burst slice's two containers
KERNEL_US = "10000"


def _slice_pod(name: str, package: str, containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "gpuslice.io/v1beta1",
            "kind": "GpuSlice",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"package": package},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": containers,
            },
        },
    ]


@dataclass
class Burn:
    """`gpuslice-probe burn` in one container, each output line stamped with the time it arrived."""

    proc: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.strip()))

    def wait(self) -> None:
        self.proc.wait(timeout=120)
        if self.reader:
            self.reader.join(timeout=30)
        err = self.proc.stderr.read() if self.proc.stderr else ""
        assert self.proc.returncode == 0, (self.proc.returncode, self.lines, err)

    def started(self) -> float:
        """When its kernel loop began (the header line comes right before it)."""
        return next(t for t, line in self.lines if line.startswith("burn "))

    def share(self) -> float:
        """Percent of the card its kernels used over the run's second half (the probe's last line)."""
        return float(self.lines[-1][1].split()[1])

    def per_second(self, start: float, end: float) -> list[float]:
        """Its per-second busy figures for the seconds that lie within [start, end] (a line reports the
        second before it arrived)."""
        return [
            float(line.rsplit("busy=", 1)[1].rstrip("%"))
            for t, line in self.lines
            if line.startswith("progress ") and start + 1 <= t <= end + 0.3
        ]


def _burn(c: DevCluster, pod: str, container: str, seconds: float) -> Burn:
    argv = c.kubectl_argv(
        "exec", "-n", NS, pod, "-c", container, "--", "gpuslice-probe", "burn", str(seconds), KERNEL_US
    )
    b = Burn(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    b.reader = threading.Thread(target=b.read, daemon=True)
    b.reader.start()
    return b


def _slice_busy(burns: list[Burn], start: float, end: float) -> float:
    """The slice's percent of the card from start to end: its processes' per-second figures, summed."""
    total = 0.0
    for b in burns:
        xs = b.per_second(start, end)
        assert xs, f"no progress line between {start:.1f} and {end:.1f}: {b.lines}"
        total += sum(xs) / len(xs)
    return total


@dataclass
class AgentView:
    """The burst slice's utilization file on the host, sampled every 0.1 s: the agent's measured
    utilization of the slice and the allowance it wrote (the shim reads the same words)."""

    path: Path
    samples: list[tuple[float, float | None, float | None, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.is_set():
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 24, prot=mmap.PROT_READ) as m:
                _, util, allowed = struct.unpack("<8sQQ", m[:24])
            now = time.time()
            # (time, utilization %, allowance %, allowance age s)
            self.samples.append(
                (
                    now,
                    (util & 0xFFFF) / 100 if util else None,
                    (allowed & 0xFFFF) / 100 if allowed else None,
                    now - (allowed >> 16) / 1000 if allowed else float("inf"),
                )
            )
            time.sleep(0.1)

    def __enter__(self) -> AgentView:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()

    def allowance_at(self, t: float) -> float | None:
        return next((a for s, _, a, _ in self.samples if s >= t), None)

    def utilization(self, start: float, end: float) -> float:
        xs = [u for s, u, _, _ in self.samples if start <= s <= end and u is not None]
        return sum(xs) / len(xs) if xs else float("nan")


def _agent_state(c: DevCluster) -> Path:
    """The real node's agent's state directory (checkpoint, per-claim files) on the host."""
    return dirs_of(c, NODE).base / "agent" / "state"


def _card_of(c: DevCluster, claim_uid: str) -> str:
    checkpoint = CheckpointStore(_agent_state(c) / "checkpoint.json").load()
    return checkpoint.claims[claim_uid].devices[0].gpu_uuid


@pytest.fixture(scope="module")
def burst_card(node_cluster: DevCluster) -> Iterator[tuple[DevCluster, Path]]:
    """The burst package; a `restricted` namespace; the burst slice's pod (two containers, uids 1000
    and 1000680000) and a plain slice's pod (uid 1000680000), both claims on one card. Yields the
    cluster and the burst slice's utilization file on the host."""
    c = node_cluster
    package = yaml.safe_load((REPO / "manifests" / "samples" / "v100-8g.yaml").read_text())
    package["metadata"]["name"] = BURST_PACKAGE
    package["spec"]["displayName"] = "V100 25% (8 GiB), bursts into idle compute"
    package["spec"]["computeBurst"] = True
    c.apply(yaml.safe_dump(package))
    wait_for(
        lambda: c.kubectl("get", "deviceclass", f"{BURST_PACKAGE}.gpuslice.io", check=False).returncode == 0,
        90,
        "the burst package's DeviceClass",
    )
    guarantees = wait_for(
        lambda: (get_json(c, "gpupackage", BURST_PACKAGE) or {}).get("status", {}).get("guarantees"),
        60,
        "the burst package's guarantees",
    )
    assert guarantees["compute"] == "CooperativeBurst", guarantees
    c.create_namespace(
        NS,
        {
            "tenant.example.com/project": TENANT,
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    )
    docs = _slice_pod(
        "burst", BURST_PACKAGE, [restricted_container(n, *ids, ["sleep", "3600"]) for n, ids in UIDS.items()]
    )
    docs += _slice_pod("plain", "v100-8g", [restricted_container("one", *UIDS["two"], ["sleep", "3600"])])
    c.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    for pod in ("burst", "plain"):
        ready = c.kubectl(
            "wait", "--for=condition=Ready", f"pod/{pod}", "-n", NS, "--timeout=120s", check=False
        )
        if ready.returncode != 0:
            described = c.kubectl("describe", "pod", pod, "-n", NS, check=False).stdout
            events = c.kubectl("get", "events", "-n", NS, "-o", "wide", check=False).stdout
            raise AssertionError(f"pod {pod} not Ready:\n{described[-3000:]}\n{events[-2000:]}")
    uids = {n: get_json(c, "resourceclaim", n, "-n", NS)["metadata"]["uid"] for n in ("burst", "plain")}
    cards = {n: _card_of(c, uid) for n, uid in uids.items()}
    assert cards["burst"] == cards["plain"], f"the two slices landed on different cards: {cards}"
    util = _agent_state(c) / "claims" / uids["burst"] / UTILIZATION_FILE
    assert util.exists(), f"no utilization file for the burst slice at {util}"
    yield c, util
    for pod in ("burst", "plain"):
        c.kubectl("delete", "pod", pod, "-n", NS, "--wait=true", "--timeout=60s", check=False)
        c.kubectl("delete", "gpuslice", pod, "-n", NS, "--wait=true", "--timeout=60s", check=False)


def test_restricted_pods_run_as_the_uids_asked(burst_card: tuple[DevCluster, Path]) -> None:
    c, _ = burst_card
    for pod, container, (uid, gid) in (("burst", "one", UIDS["one"]), ("burst", "two", UIDS["two"])):
        out = c.kubectl("exec", "-n", NS, pod, "-c", container, "--", "id").stdout
        assert f"uid={uid}" in out and f"gid={gid}" in out, out
    out = c.kubectl("exec", "-n", NS, "plain", "--", "sh", "-c", "touch /x 2>&1; echo rc=$?").stdout
    assert "rc=0" not in out, "the root filesystem is read-only"


def test_burst_alone_then_a_neighbour_then_the_agent_stopped(burst_card: tuple[DevCluster, Path]) -> None:
    c, util = burst_card
    with AgentView(util) as agent:
        # 1. alone on the card: the burst slice's two processes take the card between them
        alone = [_burn(c, "burst", n, 10) for n in UIDS]
        for b in alone:
            b.wait()
        used_alone = sum(b.share() for b in alone)
        t_alone = min(b.started() for b in alone)
        # the card's own figure: the double's NVML per-process samples as the agent sums them (the
        # probes' figures, each its kernels' time over its own wall time, overlap a little)
        nvml_alone = agent.utilization(t_alone + 5, t_alone + 10)
        print(
            f"\n[burst, real node] alone: {nvml_alone:.1f} % of the card (NVML, as the agent measured it, "
            f"second half of 10 s); probe {' + '.join(f'{b.share():.1f}' for b in alone)} %; "
            f"allowed {agent.allowance_at(t_alone + 7)} %"
        )

        # 2. a neighbour on the card (a plain slice, share 25) runs 4 s while the burst slice runs
        # (an idle burst slice is held to its share: it takes the card a measurement or two after it
        # starts, so the neighbour comes once the burst slice has had the card for a while)
        hog = [_burn(c, "burst", n, 18) for n in UIDS]
        wait_for(lambda: all(b.per_second(0, time.time()) for b in hog), 30, "the burst slice running")
        time.sleep(6)
        neighbour = _burn(c, "plain", "one", 4)
        neighbour.wait()
        tn = neighbour.started()
        before = _slice_busy(hog, tn - 2.5, tn)
        after = _slice_busy(hog, tn + 2, tn + 4)
        allowed_before, allowed_after = agent.allowance_at(tn - 0.5), agent.allowance_at(tn + 2)
        print(
            f"[burst, real node] neighbour: {neighbour.share():.1f} % from 2 s to 4 s after it started; "
            f"burst slice {before:.1f} % before, {after:.1f} % from 2 s to 4 s after (probe); agent "
            f"measured {agent.utilization(tn - 2, tn):.1f} % before, "
            f"{agent.utilization(tn + 2, tn + 4):.1f} % after; "
            f"allowed {allowed_before} % before, {allowed_after} % 2 s after"
        )
        for b in hog:
            b.wait()

        # 3. the burst slice alone again, then the agent stops: the share is a ceiling again
        hog = [_burn(c, "burst", n, 16) for n in UIDS]
        wait_for(lambda: all(b.per_second(0, time.time()) for b in hog), 30, "the burst slice running")
        time.sleep(6)
        t_agent = time.time()
        rec = faults.kill(c, agent_process_name(NODE), signal.SIGKILL)
        stopped = time.time()
        try:
            for b in hog:
                b.wait()
            running = _slice_busy(hog, t_agent - 2.5, t_agent)
            ceiling = _slice_busy(hog, stopped + 3, stopped + 5)
            last = max((s for s in agent.samples if s[0] <= stopped), key=lambda s: s[0])
            print(
                f"[burst, real node] agent SIGKILLed (pid {rec.pid}): burst slice {running:.1f} % before, "
                f"{ceiling:.1f} % from 3 s to 5 s after (probe); last allowance {last[2]} %, "
                f"{last[3]:.1f} s old at the kill"
            )
        finally:
            assert start_agents(c, GPU_SPEC) == [NODE]

    assert nvml_alone >= 90, f"the burst slice alone used {nvml_alone:.1f} % of the card (NVML)"
    assert used_alone >= 90, f"the burst slice alone used {used_alone:.1f} % of the card (probe)"
    assert allowed_before == 100 and allowed_after == SHARE, (allowed_before, allowed_after)
    assert before >= 50, f"the burst slice did not have the card before the neighbour: {before:.1f} %"
    assert SHARE - 5 <= neighbour.share() <= SHARE + 5, f"the neighbour got {neighbour.share():.1f} %"
    assert after <= SHARE + 10, f"the burst slice did not fall back: {after:.1f} % with the neighbour running"
    assert running >= 50, f"the burst slice did not have the card before the agent stopped: {running:.1f} %"
    assert ceiling <= SHARE + 10, f"with the agent stopped the burst slice used {ceiling:.1f} %"
