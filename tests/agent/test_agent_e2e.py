"""The node agent against the real control plane: real agent processes over the NVIDIA driver test
double publish ResourceSlices, the real kube-scheduler allocates claims from them, and the tests play
kubelet over the plugin's real unix sockets."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.agent_cluster import (
    V100,
    apply_docs,
    card_usage,
    claim_doc,
    device_class_doc,
    get_items,
    package_doc,
    pod_doc,
    pool_slices,
    published_devices,
)
from gpuslice import constants
from gpuslice.agent.proto import dra_v1_pb2 as dra
from gpuslice.agent.proto import dra_v1_pb2_grpc as dra_grpc
from gpuslice.agent.proto import pluginregistration_v1_pb2 as reg
from gpuslice.agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from gpuslice.shim.config import SliceConfig
from gpuslice_dev.agents import agent_dirs, agent_kubeconfig, spawn_agent
from gpuslice_dev.devcluster.cluster import DevCluster, node_manifest
from gpuslice_dev.devcluster.node_agents import start_agents, stop_agents
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=80)]

GPUS_PER_NODE = 2
SPEC = f"{GPUS_PER_NODE}x {V100}"
GIB = constants.GIB
CARD = 32 * GIB
PACKAGES = {"e2e-v100-8g": 25, "e2e-v100-16g": 50, "e2e-v100-32g": 100}


def node_devices(cluster: DevCluster, node: str) -> list[dict[str, Any]]:
    return [d for s in pool_slices(cluster, node) for d in s["spec"].get("devices") or []]


def offers(cluster: DevCluster, node: str, package: str) -> int:
    return sum(1 for d in node_devices(cluster, node) if d["attributes"]["package"]["string"] == package)


@pytest.fixture(scope="module")
def agents(cluster: DevCluster) -> Iterator[list[str]]:
    cluster.apply_crds()
    start_agents(cluster, SPEC)
    for node in cluster.nodes:
        wait_for(
            lambda n=node: any(s["spec"].get("sharedCounters") for s in pool_slices(cluster, n)),
            timeout=90,
            what=f"the agent of {node} to publish its GPUs",
        )
    yield cluster.nodes
    # Other test modules share the session cluster: leave no agent publishing GPUs behind.
    stop_agents(cluster)


@pytest.fixture(scope="module")
def packages(cluster: DevCluster, agents: list[str]) -> Iterator[dict[str, int]]:
    apply_docs(
        cluster, [package_doc(n, f) for n, f in PACKAGES.items()] + [device_class_doc(n) for n in PACKAGES]
    )
    for node in agents:
        for name, fraction in PACKAGES.items():
            want = GPUS_PER_NODE * (100 // fraction)
            wait_for(
                lambda n=node, p=name, w=want: offers(cluster, n, p) == w,
                timeout=60,
                what=f"{name} on {node}",
            )
    yield PACKAGES
    names = list(PACKAGES)
    cluster.kubectl("delete", "gpupackage", *names, "--wait=false", check=False)
    cluster.kubectl("delete", "deviceclass", *[constants.device_class_name(n) for n in names], check=False)


def wait_allocated(cluster: DevCluster, namespace: str, claim: str, timeout: float = 60) -> dict[str, Any]:
    def allocated() -> dict[str, Any] | None:
        c = get_json(cluster, "resourceclaim", claim, "-n", namespace)
        return c if c and (c.get("status") or {}).get("allocation") else None

    return wait_for(allocated, timeout=timeout, what=f"claim {namespace}/{claim} to be allocated")


def scheduling_state(pod: dict[str, Any]) -> str | None:
    """'scheduled', 'unschedulable', or None while kube-scheduler has not decided yet."""
    if pod["spec"].get("nodeName"):
        return "scheduled"
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            cond["type"] == "PodScheduled"
            and cond["status"] == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return "unschedulable"
    return None


def test_every_node_publishes_its_cards_as_counters_and_partitions(
    cluster: DevCluster, packages: dict[str, int]
) -> None:
    uuids: set[str] = set()
    for node in cluster.nodes:
        slices = pool_slices(cluster, node)
        generations = {s["spec"]["pool"]["generation"] for s in slices}
        assert len(generations) == 1, f"{node}: one pool generation at a time, got {generations}"
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
        for s in slices:
            assert s["spec"]["nodeName"] == node and s["spec"]["pool"]["name"] == node
            assert bool(s["spec"].get("devices")) != bool(s["spec"].get("sharedCounters"))
            assert len(s["spec"].get("devices") or []) <= 64
            assert s["metadata"]["ownerReferences"][0]["kind"] == "Node"
        counter_sets = {
            cs["name"]: cs["counters"] for s in slices for cs in s["spec"].get("sharedCounters") or []
        }
        assert set(counter_sets) == {f"gpu-{i}" for i in range(GPUS_PER_NODE)}
        for counters in counter_sets.values():
            assert counters["memory"]["value"] in ("32Gi", str(CARD))
            assert counters["compute"]["value"] == "100"
        devices = node_devices(cluster, node)
        per_package = Counter(d["attributes"]["package"]["string"] for d in devices)
        for name, fraction in packages.items():
            assert per_package[name] == GPUS_PER_NODE * (100 // fraction)
        sample = next(d for d in devices if d["attributes"]["package"]["string"] == "e2e-v100-8g")
        attrs = sample["attributes"]
        assert attrs["productName"] == {"string": V100}
        assert attrs["cudaComputeCapability"] == {"version": "7.0.0"}
        assert "version" in attrs["driverVersion"]
        assert sample["capacity"]["memory"]["value"] in ("8Gi", str(8 * GIB))
        uuids |= {d["attributes"]["uuid"]["string"] for d in devices}
    assert len(uuids) == GPUS_PER_NODE * len(cluster.nodes), "every simulated card has its own UUID"


def test_scheduler_never_overfills_a_card_and_a_slice_waits_until_one_is_freed(
    cluster: DevCluster, packages: dict[str, int], namespace: str
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cards = GPUS_PER_NODE * len(cluster.nodes)
    # ask for about 1.6x what the cards hold, in a random mix of the three sizes
    mix: list[str] = []
    while sum(packages[p] for p in mix) < 160 * cards:
        mix.append(rng.choice(sorted(packages)))
    docs: list[dict[str, Any]] = []
    for i, package in enumerate(mix):
        docs += [claim_doc(f"c{i}", namespace, package), pod_doc(f"p{i}", namespace, f"c{i}")]
    apply_docs(cluster, docs)

    def all_decided() -> list[dict[str, Any]] | None:
        pods = get_items(cluster, "pods", "-n", namespace)
        return pods if len(pods) == len(mix) and all(scheduling_state(p) for p in pods) else None

    wait_for(all_decided, timeout=120, what=f"kube-scheduler to decide every pod (seed {seed})")
    all_cards = {d.uuid for d in published_devices(cluster).values() if d.pool in cluster.nodes}

    def pending_with_room() -> list[str]:
        """Pending pods for which some card has room. A pod can be marked Unschedulable while other
        pods' allocations are in flight and retried when one of them fails to bind; so the verdict is
        the settled one, not the first."""
        pods, usage = get_items(cluster, "pods", "-n", namespace), card_usage(cluster)
        out = []
        for pod in (p for p in pods if scheduling_state(p) != "scheduled"):
            share = packages[mix[int(pod["metadata"]["name"][1:])]]
            room = [u for u in all_cards if usage.get(u, (0, 0))[0] + CARD * share // 100 <= CARD
                    and usage.get(u, (0, 0))[1] + share <= 100]  # fmt: skip
            out += [f"{pod['metadata']['name']} ({share}%) fits {room[0]}"] if room else []
        return out

    deadline = time.monotonic() + 60
    left = pending_with_room()
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = pending_with_room()
    assert not left, f"seed {seed}: pending although a card has room: {left}"
    pods = wait_for(all_decided, timeout=30, what=f"kube-scheduler to decide every pod (seed {seed})")
    pending = [p for p in pods if scheduling_state(p) == "unschedulable"]
    assert pending, f"seed {seed}: {len(mix)} slices for {cards} cards must leave some Pending"

    usage = card_usage(cluster)
    for uuid, (memory, compute) in usage.items():
        assert memory <= CARD and compute <= 100, f"seed {seed}: card {uuid} holds {memory} bytes, {compute}%"
    for pod in pending:
        message = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")["message"]
        assert "claim" in message, message

    # Free room for a pending slice: a pending slice starts (which one is kube-scheduler's choice:
    # several may fit in the room made).
    need = min(packages[mix[int(p["metadata"]["name"][1:])]] for p in pending)
    devices = published_devices(cluster)
    on_card: dict[str, list[int]] = {}
    for pod in (p for p in pods if scheduling_state(p) == "scheduled"):
        i = int(pod["metadata"]["name"][1:])
        claim = get_json(cluster, "resourceclaim", f"c{i}", "-n", namespace)
        result = claim["status"]["allocation"]["devices"]["results"][0]
        on_card.setdefault(devices[(result["pool"], result["device"])].uuid, []).append(i)
    card = min(on_card, key=lambda c: usage[c][1])
    freed = 0
    for i in sorted(on_card[card], key=lambda i: -packages[mix[i]]):
        if usage[card][1] - freed + need <= 100:
            break
        cluster.kubectl("delete", "pod", f"p{i}", "-n", namespace, "--grace-period=0", "--force")
        cluster.kubectl("delete", "resourceclaim", f"c{i}", "-n", namespace, "--wait=false")
        freed += packages[mix[i]]
    pending_names = {p["metadata"]["name"] for p in pending}

    def a_pending_one_started() -> list[str]:
        now = get_items(cluster, "pods", "-n", namespace)
        return [
            p["metadata"]["name"]
            for p in now
            if p["metadata"]["name"] in pending_names and scheduling_state(p) == "scheduled"
        ]

    wait_for(
        a_pending_one_started, timeout=90, what=f"a pending slice to start once one was deleted (seed {seed})"
    )
    for uuid, (memory, compute) in card_usage(cluster).items():
        assert memory <= CARD and compute <= 100, f"seed {seed}: card {uuid} over-full after the reschedule"


def _sockets(cluster: DevCluster, node: str, state_root: Path | None = None) -> tuple[str, str]:
    dirs = agent_dirs(state_root or cluster.dir / "agents", node)
    return (
        f"unix://{dirs['registry'] / 'gpuslice.io-reg.sock'}",
        f"unix://{dirs['plugins'] / 'gpuslice.io' / 'dra.sock'}",
    )


def kubelet_claims(claims: list[dict[str, Any]]) -> list[dra.Claim]:
    return [
        dra.Claim(namespace=c["metadata"]["namespace"], name=c["metadata"]["name"], uid=c["metadata"]["uid"])
        for c in claims
    ]


def prepare(
    socket: str, claims: list[dict[str, Any]], timeout: float = 30
) -> dra.NodePrepareResourcesResponse:
    with grpc.insecure_channel(socket) as ch:
        req = dra.NodePrepareResourcesRequest(claims=kubelet_claims(claims))
        return dra_grpc.DRAPluginStub(ch).NodePrepareResources(req, timeout=timeout)


def unprepare(socket: str, claims: list[dict[str, Any]]) -> dra.NodeUnprepareResourcesResponse:
    with grpc.insecure_channel(socket) as ch:
        req = dra.NodeUnprepareResourcesRequest(claims=kubelet_claims(claims))
        return dra_grpc.DRAPluginStub(ch).NodeUnprepareResources(req, timeout=30)


def get_info(socket: str) -> reg.PluginInfo:
    with grpc.insecure_channel(socket) as ch:
        return reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=5)


def test_kubelet_prepares_and_unprepares_a_slice_over_the_plugin_socket(
    cluster: DevCluster, packages: dict[str, int], namespace: str
) -> None:
    apply_docs(cluster, [claim_doc("slice", namespace, "e2e-v100-16g"), pod_doc("job", namespace, "slice")])
    claim = wait_allocated(cluster, namespace, "slice")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    node = result["pool"]
    card = published_devices(cluster)[(node, result["device"])].uuid
    registration, endpoint = _sockets(cluster, node)

    info = get_info(registration)
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin",
        "gpuslice.io",
        ["v1.DRAPlugin"],
    )
    assert f"unix://{info.endpoint}" == endpoint
    with grpc.insecure_channel(registration) as ch:
        reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=True), timeout=5
        )

    uid = claim["metadata"]["uid"]
    response = prepare(endpoint, [claim])
    entry = response.claims[uid]
    assert entry.error == ""
    [device] = entry.devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (
        node,
        result["device"],
        ["gpu"],
    )
    assert list(device.cdi_device_ids) == [f"gpuslice.io/slice={uid}", f"nvidia.com/gpu={card}"]
    assert prepare(endpoint, [claim]).claims[uid] == entry, "preparing again answers the same"

    cdi_dir = agent_dirs(cluster.dir / "agents", node)["cdi"]
    spec = json.loads((cdi_dir / f"gpuslice.io-slice-{uid}.json").read_text())
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]}
    limits = SliceConfig.parse(Path(mounts[constants.CONTAINER_CONFIG_PATH]).read_text())
    assert (limits.memory_bytes, limits.compute_share, limits.gpu_uuid) == (16 * GIB, 50, card)
    assert (
        Path(mounts[constants.CONTAINER_LD_SO_PRELOAD]).read_text().strip() == constants.CONTAINER_SHIM_PATH
    )
    assert Path(mounts[constants.CONTAINER_SHIM_PATH]).name == "libgpuslice.so"

    # a claim kubelet names but the scheduler did not give this node: a clear per-claim error
    apply_docs(cluster, [claim_doc("unallocated", namespace, "e2e-v100-8g")])
    other = get_json(cluster, "resourceclaim", "unallocated", "-n", namespace)
    err = prepare(endpoint, [other]).claims[other["metadata"]["uid"]].error
    assert f"no device of driver gpuslice.io allocated on node {node}" in err

    assert unprepare(endpoint, [claim]).claims[uid].error == ""
    assert not (cdi_dir / f"gpuslice.io-slice-{uid}.json").exists()
    assert not Path(mounts[constants.CONTAINER_CONFIG_PATH]).exists()
    assert not Path(mounts[f"{constants.CONTAINER_USAGE_DIR}/usage.bin"]).parent.exists()


def test_agent_may_write_only_its_own_nodes_slices(cluster: DevCluster, agents: list[str]) -> None:
    mine, other = agents[0], agents[1]
    kubeconfig = agent_kubeconfig(cluster, mine)

    def probe(node: str, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": constants.DRIVER_NAME,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},  # its own pool only
                "devices": [{"name": "probe"}],
            },
        }

    import yaml

    denied = cluster.kubectl(
        "apply", "--server-side", "-f", "-", kubeconfig=kubeconfig, check=False,
        input=yaml.safe_dump(probe(other, "e2e-probe-other")),
    )  # fmt: skip
    assert denied.returncode != 0
    assert (
        f"the gpuslice agent of node {mine} may only write ResourceSlices with spec.nodeName {mine}"
        in denied.stderr
    )
    allowed = cluster.kubectl(
        "apply", "--server-side", "-f", "-", kubeconfig=kubeconfig, check=False,
        input=yaml.safe_dump(probe(mine, "e2e-probe-mine")),
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    cluster.kubectl("delete", "resourceslice", "e2e-probe-mine", kubeconfig=kubeconfig)


def test_the_agents_start_up_probe_is_admitted_by_its_own_node_policy(
    cluster: DevCluster, agents: list[str]
) -> None:
    # The agents run as their nodes' identities under the shipped own-node policy; their start-up
    # dry-run ResourceSlices are how they learn whether the API server keeps shared counters and
    # device taints. A probe the policy refuses leaves that unknown, and an agent on an API server
    # that drops counters would then publish cards whose memory can be sold twice.
    import asyncio

    from gpuslice import platform
    from gpuslice.agent.kube import api_client
    from gpuslice.domain import features
    from support import counters_kept

    for node in agents:
        log = (cluster.dir / "logs" / f"agent-{node}.log").read_text(errors="replace")
        assert "a dry-run probe was refused" not in log, log[-3000:]

    async def read() -> features.Platform:
        api = api_client(agent_kubeconfig(cluster, agents[0]))
        try:
            return await platform.read_platform(api, device_class=False, node=agents[0])
        finally:
            await api.close()

    found = asyncio.run(read())
    for name in (features.PARTITIONABLE, features.DEVICE_TAINTS):
        assert not found.feature(name).unknown, found.summary()
    assert found.on(features.PARTITIONABLE) == counters_kept(cluster), found.summary()


def test_package_changes_republish_the_pool_under_a_new_generation(
    cluster: DevCluster, agents: list[str]
) -> None:
    node = agents[0]

    def generation() -> int:
        return int(pool_slices(cluster, node)[0]["spec"]["pool"]["generation"])

    before = generation()
    apply_docs(cluster, [package_doc("e2e-v100-4g", 12)])
    wait_for(
        lambda: offers(cluster, node, "e2e-v100-4g") == GPUS_PER_NODE * 8,
        timeout=60,
        what="4g slices offered",
    )
    assert generation() > before
    names = {d["name"] for d in node_devices(cluster, node)}
    assert {f"gpu-{i}-e2e-v100-4g-{k}" for i in range(GPUS_PER_NODE) for k in range(8)} <= names

    after_add = generation()
    cluster.kubectl("delete", "gpupackage", "e2e-v100-4g")
    wait_for(lambda: offers(cluster, node, "e2e-v100-4g") == 0, timeout=60, what="4g slices withdrawn")
    assert generation() > after_add
    slices = pool_slices(cluster, node)
    assert len({s["spec"]["pool"]["generation"] for s in slices}) == 1, (
        "stale slices of older generations are deleted"
    )


# --- a node and an agent of the test's own: kill, restart, SIGTERM, node deletion ------------------------


@pytest.fixture
def own_node(cluster: DevCluster, agents: list[str]) -> Iterator[str]:
    name = f"e2e-agent-{os.getpid() % 10000}"
    apply_docs(cluster, [node_manifest(name)])
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=60s", f"node/{name}")
    yield name
    cluster.kubectl("delete", "node", name, "--wait=false", check=False)


class OwnAgent:
    def __init__(self, cluster: DevCluster, node: str, root: Path) -> None:
        self.cluster, self.node, self.root = cluster, node, root
        self.kubeconfig = agent_kubeconfig(cluster, node)
        self.log = root / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.registration, self.endpoint = _sockets(cluster, node, root)

    def start(self) -> None:
        self.proc = spawn_agent(self.node, SPEC, self.kubeconfig, self.root, self.log)
        wait_for(self._serving, timeout=60, what=f"agent of {self.node} serving")

    def _serving(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            get_info(self.registration)
            return True
        except grpc.RpcError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


@pytest.fixture
def own_agent(
    cluster: DevCluster, own_node: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OwnAgent]:
    agent = OwnAgent(cluster, own_node, tmp_path_factory.mktemp("ag"))
    agent.start()
    yield agent
    if agent.proc is not None and agent.proc.poll() is None:
        agent.stop()


def test_agent_killed_mid_prepare_restarts_without_losing_or_repeating_a_claim(
    cluster: DevCluster, packages: dict[str, int], namespace: str, own_agent: OwnAgent
) -> None:
    node = own_agent.node
    wait_for(
        lambda: offers(cluster, node, "e2e-v100-8g") == GPUS_PER_NODE * 4,
        timeout=60,
        what="own node's slices",
    )
    count = GPUS_PER_NODE * 4
    docs: list[dict[str, Any]] = []
    for i in range(count):
        docs += [
            claim_doc(f"k{i}", namespace, "e2e-v100-8g"),
            pod_doc(f"k{i}", namespace, f"k{i}", node=node),
        ]
    apply_docs(cluster, docs)
    claims = [wait_allocated(cluster, namespace, f"k{i}") for i in range(count)]
    uids = [c["metadata"]["uid"] for c in claims]

    rng = random.Random()
    answered: dict[str, list[str]] = {}
    marker: Path | None = None
    for _round in range(4):
        replies: list[Any] = []

        def call(out: list[Any] = replies) -> None:
            try:
                out.append(prepare(own_agent.endpoint, claims, timeout=20))
            except grpc.RpcError as exc:  # the agent died under the call
                out.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(rng.uniform(0.0, 0.4))
        own_agent.kill()
        caller.join()
        for reply in replies:
            if isinstance(reply, dra.NodePrepareResourcesResponse):
                for uid in uids:
                    answered[uid] = list(reply.claims[uid].devices[0].cdi_device_ids)
        own_agent.start()
        if marker is None and (own_agent.root / node / "run" / "slices" / uids[0]).is_dir():
            marker = own_agent.root / node / "run" / "slices" / uids[0] / "in-use"
            marker.write_text("a container's usage region")

    final = prepare(own_agent.endpoint, claims)
    for uid in uids:
        entry = final.claims[uid]
        assert entry.error == "", entry.error
        ids = list(entry.devices[0].cdi_device_ids)
        assert ids[0] == f"gpuslice.io/slice={uid}"
        if uid in answered:
            assert answered[uid] == ids, "a claim answered before the kill is answered the same after it"
    checkpoint = json.loads((own_agent.root / node / "state" / "checkpoint.json").read_text())
    assert {uid: c["state"] for uid, c in checkpoint["claims"].items()} == dict.fromkeys(uids, "Prepared")
    cdi_files = sorted(p.name for p in (own_agent.root / node / "cdi").iterdir())
    assert cdi_files == sorted(f"gpuslice.io-slice-{uid}.json" for uid in uids)
    if marker is not None:
        assert marker.read_text() == "a container's usage region", "a prepared claim's usage region is kept"
    # No claim went through the full prepare twice: once recorded Prepared, restarts answer from the
    # checkpoint (a kill between recording and logging may leave a claim without its log line).
    prepared_lines = Counter(
        json.loads(line)["uid"]
        for line in own_agent.log.read_text().splitlines()
        if line.startswith("{") and json.loads(line).get("event") == "claim prepared"
    )
    assert set(prepared_lines) <= set(uids) and max(prepared_lines.values()) == 1, prepared_lines

    unprepared = unprepare(own_agent.endpoint, claims)
    assert all(unprepared.claims[uid].error == "" for uid in uids)
    assert list((own_agent.root / node / "cdi").iterdir()) == []


def test_agent_withdraws_its_slices_on_sigterm_and_when_its_node_goes_away(
    cluster: DevCluster, agents: list[str], own_agent: OwnAgent
) -> None:
    node = own_agent.node
    wait_for(lambda: pool_slices(cluster, node), timeout=60, what="own node's slices")
    assert own_agent.stop() == 0
    assert pool_slices(cluster, node) == [], "SIGTERM withdraws the node's slices before exiting"

    own_agent.start()
    wait_for(lambda: pool_slices(cluster, node), timeout=60, what="slices republished after restart")
    cluster.kubectl("delete", "node", node)
    wait_for(lambda: pool_slices(cluster, node) == [], timeout=60, what="slices removed with the node")
    assert own_agent.proc is not None and own_agent.proc.poll() is None, (
        "the agent keeps running without its node"
    )
    # the node comes back: the agent publishes again
    apply_docs(cluster, [node_manifest(node)])
    wait_for(
        lambda: pool_slices(cluster, node), timeout=60, what="slices republished for the re-created node"
    )


def test_with_the_quota_used_up_the_next_claim_is_refused_for_the_quota(
    cluster: DevCluster, packages: dict[str, int], namespace: str
) -> None:
    key = constants.quota_key("e2e-v100-8g")
    apply_docs(
        cluster,
        [{"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "slices", "namespace": namespace},
          "spec": {"hard": {key: "1"}}}],
    )  # fmt: skip
    wait_for(
        lambda: (get_json(cluster, "resourcequota", "slices", "-n", namespace).get("status") or {}).get(
            "hard"
        ),
        timeout=30,
        what="quota status",
    )
    apply_docs(cluster, [claim_doc("first", namespace, "e2e-v100-8g")])
    refused = cluster.kubectl(
        "apply", "--server-side", "-f", "-", check=False,
        input=json.dumps(claim_doc("second", namespace, "e2e-v100-8g")),
    )  # fmt: skip
    assert refused.returncode != 0
    assert "exceeded quota" in refused.stderr and key in refused.stderr, refused.stderr
