"""The promises gpuslice keeps whatever breaks, checked from what the cluster and the node show.

After every fault the fault tests call `Invariants.settle(fault_ended)`: it polls until each of these
holds again, and fails (listing what does not) if that takes more than 30 s:

1. No card holds more slice memory than it has: per card (a ResourceSlice counter set), the allocated
   claims' devices consume at most its memory, no device is allocated twice; on a real node the
   agent's prepared claims on a card fit the card's memory as NVML reports it, and NVML's used
   memory fits its total.
2. No GpuSlice loses or duplicates its claim: exactly one ResourceClaim (one ResourceClaimTemplate in
   the template form) owned by the slice's uid, named like it.
3. Every GpuSlice's status is true: phase, node, device, GPU UUID and conditions say what its claim and
   pods really are, for the slice's current generation.
4. No running slice pod was disturbed: the same pod uid, each container the same container id and
   restart count, still running.
5. The shim still enforces in running containers: in each slice pod on a real node an allocation
   that fits the slice succeeds and one past it is refused (`gpuslice-probe alloc`).

The time each fault takes to hold again is printed and, with GPUSLICE_FAULT_REPORT=<file>, appended
there as a JSON line (the figures in the README's fault table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice import constants as c
from gpuslice.api.quantity import parse_int_quantity
from gpuslice_dev.devcluster.cluster import DevCluster

#: What the issue promises: every status true again this long after the fault ends.
SETTLE_SECONDS = 30.0
PROBE = "gpuslice-probe"


@dataclass(frozen=True)
class RunningPod:
    namespace: str
    name: str
    uid: str
    node: str
    #: container name -> (container id, restart count)
    containers: Mapping[str, tuple[str, int]]
    #: the ResourceClaims the pod holds (names in its namespace)
    claims: tuple[str, ...]


@dataclass(frozen=True)
class RealNode:
    """What the check reads on a real node, without the API server: the agent's checkpoint, NVML
    through the driver test double (as the agent reads it), containers through CRI."""

    name: str
    checkpoint: Path
    nvml_env: Mapping[str, str]
    crictl: Callable[..., subprocess.CompletedProcess[str]]


def real_node(cluster: DevCluster, name: str) -> RealNode:
    from gpuslice_dev.devcluster import realnode
    from gpuslice_dev.devcluster.node_agents import fake_gpu_config
    from gpuslice_dev.devcluster.node_binaries import ensure_node_binaries
    from gpuslice_dev.gpusim import simulate
    from gpuslice_dev.gpusim.build import ensure_built

    d = realnode.dirs_of(cluster, name)
    bins = ensure_node_binaries(lambda _m: None)
    return RealNode(
        name=name,
        checkpoint=d.base / "agent" / "state" / "checkpoint.json",
        nvml_env={
            **os.environ,
            **simulate.fake_driver_env(fake_gpu_config(cluster, name), ensure_built().fake_dir),
        },
        crictl=lambda *args, timeout=60: realnode.crictl(bins, d, *args, timeout=timeout),
    )


_NVML_SCRIPT = """
import json, pynvml
pynvml.nvmlInit()
out = {}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    out[uuid if isinstance(uuid, str) else uuid.decode()] = [m.total, m.used]
print(json.dumps(out))
"""


def nvml_memory(node: RealNode) -> dict[str, tuple[int, int]]:
    """{GPU UUID: (total, used)} as NVML reports them on the node."""
    proc = subprocess.run(
        [sys.executable, "-c", _NVML_SCRIPT],
        env=dict(node.nvml_env),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return {k: (v[0], v[1]) for k, v in json.loads(proc.stdout).items()}


# --- reading the cluster ------------------------------------------------------------------------------


class Unreachable(Exception):
    pass


def _items(cluster: DevCluster, resource: str) -> list[dict[str, Any]]:
    proc = cluster.kubectl(
        "get", resource, "-A", "-o", "json", "--request-timeout=10s", check=False, timeout=30
    )
    if proc.returncode != 0:
        raise Unreachable(f"kubectl get {resource}: {proc.stderr.strip()[-300:]}")
    return list(json.loads(proc.stdout)["items"])


@dataclass
class World:
    slices: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    templates: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    resource_slices: list[dict[str, Any]]
    quotas: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, cluster: DevCluster) -> World:
        return cls(
            slices=_items(cluster, f"{c.SLICE_PLURAL}.{c.API_GROUP}"),
            claims=_items(cluster, "resourceclaims"),
            templates=_items(cluster, "resourceclaimtemplates"),
            pods=_items(cluster, "pods"),
            resource_slices=[
                s for s in _items(cluster, "resourceslices") if s["spec"].get("driver") == c.DRIVER_NAME
            ],
            quotas=_items(cluster, "resourcequotas"),
        )


def _key(obj: Mapping[str, Any]) -> str:
    m = obj["metadata"]
    return f"{m.get('namespace', '')}/{m['name']}"


def _allocated_devices(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    return [(r["pool"], r["device"]) for r in results if r.get("driver") == c.DRIVER_NAME]


def _claim_node(claim: Mapping[str, Any]) -> str | None:
    terms = (((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}).get(
        "nodeSelectorTerms"
    ) or []
    for term in terms:
        for f in term.get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("values"):
                return str(f["values"][0])
    return None


@dataclass
class _Pool:
    generation: int = -1
    counters: dict[str, int] = field(default_factory=dict)  # counter set -> memory
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)


def _pools(resource_slices: Iterable[Mapping[str, Any]]) -> dict[str, _Pool]:
    pools: dict[str, _Pool] = defaultdict(_Pool)
    for s in resource_slices:
        spec = s["spec"]
        pool = pools[spec["pool"]["name"]]
        gen = int(spec["pool"]["generation"])
        if gen < pool.generation:
            continue
        if gen > pool.generation:
            pools[spec["pool"]["name"]] = pool = _Pool(generation=gen)
        for cs in spec.get("sharedCounters") or []:
            pool.counters[cs["name"]] = parse_int_quantity(cs["counters"]["memory"]["value"])
        for d in spec.get("devices") or []:
            pool.devices[d["name"]] = d
    return pools


def _device_memory(device: Mapping[str, Any]) -> list[tuple[str, int]]:
    return [
        (cc["counterSet"], parse_int_quantity(cc["counters"]["memory"]["value"]))
        for cc in device.get("consumesCounters") or []
        if "memory" in cc.get("counters", {})
    ]


# --- the invariants -----------------------------------------------------------------------------------


def card_memory(w: World) -> list[str]:
    """Invariant 1, from the API: allocated slices fit their cards; no device is allocated twice."""
    out: list[str] = []
    pools = _pools(w.resource_slices)
    used: dict[tuple[str, str], int] = defaultdict(int)
    holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    for claim in w.claims:
        for pool, device in _allocated_devices(claim):
            holders[(pool, device)].append(_key(claim))
            d = pools[pool].devices.get(device) if pool in pools else None
            if d is None:
                continue  # a pool being republished; its devices return with the next generation
            for counter_set, memory in _device_memory(d):
                used[(pool, counter_set)] += memory
    for (pool, device), claims in holders.items():
        if len(claims) > 1:
            out.append(f"device {pool}/{device} is allocated to {len(claims)} claims: {sorted(claims)}")
    for (pool, counter_set), memory in used.items():
        have = pools[pool].counters.get(counter_set)
        if have is not None and memory > have:
            out.append(f"card {pool}/{counter_set} has {have} bytes; its allocated slices take {memory}")
    return out


def node_memory(node: RealNode) -> list[str]:
    """Invariant 1, on the node: prepared slices fit the card as NVML sees it; used fits total."""
    out: list[str] = []
    try:
        cards = nvml_memory(node)
    except (subprocess.SubprocessError, ValueError) as exc:
        return [f"{node.name}: NVML unreadable: {exc}"]
    for uuid, (total, used) in cards.items():
        if used > total:
            out.append(f"{node.name}: NVML shows {used} of {total} bytes used on {uuid}")
    if node.checkpoint.exists():
        prepared: dict[str, int] = defaultdict(int)
        for rec in json.loads(node.checkpoint.read_text())["claims"].values():
            for d in rec["devices"]:
                prepared[d["gpu_uuid"]] += int(d["memory_bytes"])
        for uuid, memory in prepared.items():
            if uuid not in cards:
                out.append(f"{node.name}: prepared claims name {uuid}, which NVML does not show")
            elif memory > cards[uuid][0]:
                out.append(
                    f"{node.name}: claims prepared on {uuid} take {memory} bytes of its {cards[uuid][0]}"
                )
    return out


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def _conditions(status: Mapping[str, Any]) -> dict[str, str]:
    return {x["type"]: x["status"] for x in status.get("conditions") or []}


def _pod_running(pod: Mapping[str, Any] | None) -> bool:
    if pod is None:
        return False
    return pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def slice_claims_and_status(
    w: World, namespaces: set[str] | None = None, known: dict[str, str] | None = None
) -> list[str]:
    """Invariants 2 and 3: one claim (or template) per GpuSlice, and a status that says what it is.

    known: {slice uid: claim uid} seen before; a slice whose claim is replaced or gone lost it. A slice
    that never had one may still be making it (its status then says CreatingClaim)."""
    known = {} if known is None else known
    out: list[str] = []
    pools = _pools(w.resource_slices)
    claims_by_ns: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for cl in w.claims:
        claims_by_ns[cl["metadata"]["namespace"]].append(cl)
    templates_by_ns: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in w.templates:
        templates_by_ns[t["metadata"]["namespace"]].append(t)
    pods = {_key(p): p for p in w.pods}
    for s in w.slices:
        ns, name, uid = s["metadata"]["namespace"], s["metadata"]["name"], s["metadata"]["uid"]
        if (namespaces is not None and ns not in namespaces) or s["metadata"].get("deletionTimestamp"):
            continue
        where = f"GpuSlice {ns}/{name}"
        st = s.get("status") or {}
        if st.get("observedGeneration") != s["metadata"].get("generation"):
            out.append(
                f"{where}: status is of generation {st.get('observedGeneration')}, "
                f"not {s['metadata'].get('generation')}"
            )
            continue
        if st.get("phase") == "Failed":
            continue  # its claim was never made (the fuzz tests look at why)
        pod_name = s["spec"].get("pod")
        if pod_name:
            # a pod's slice (a product in resources.limits): its claim is kube-scheduler's, owned by
            # the pod; with the pod gone (or never there) the slice is Released until it is deleted
            if f"{ns}/{pod_name}" not in pods and st.get("phase") != "Released":
                out.append(f"{where}: its pod {pod_name} is gone, but status says {st.get('phase')}")
            continue
        template = bool(s["spec"].get("template"))
        owned = [cl for cl in claims_by_ns[ns] if _owned_by(cl, uid)]
        if template:
            mine = [t for t in templates_by_ns[ns] if _owned_by(t, uid)]
            if [t["metadata"]["name"] for t in mine] != [name]:
                out.append(f"{where}: owns ResourceClaimTemplates {[t['metadata']['name'] for t in mine]}")
            generated = [
                cl
                for cl in claims_by_ns[ns]
                if cl["metadata"].get("annotations", {}).get("resource.kubernetes.io/pod-claim-name")
                and any(
                    (pc.get("resourceClaimTemplateName") == name)
                    for r in cl["metadata"].get("ownerReferences") or []
                    if r.get("kind") == "Pod" and (p := pods.get(f"{ns}/{r['name']}"))
                    for pc in p["spec"].get("resourceClaims") or []
                )
            ]
            want = sorted(_key(cl).split("/")[1] for cl in generated if _allocated_devices(cl))
            have = sorted(a["claim"] for a in st.get("allocations") or [])
            if want != have:
                out.append(f"{where}: status lists allocations {have}; the allocated claims are {want}")
            continue
        if not owned and uid not in known:
            if st.get("reason") == "QuotaExceeded":
                out += _quota_refusal_true(w, ns, s["spec"].get("package", ""), st, where)
            elif st.get("reason") != "CreatingClaim":
                out.append(
                    f"{where}: no ResourceClaim yet, but status says {st.get('phase')}/{st.get('reason')}"
                )
            continue
        if [cl["metadata"]["name"] for cl in owned] != [name]:
            out.append(
                f"{where}: owns ResourceClaims {[cl['metadata']['name'] for cl in owned]}, not [{name!r}]"
            )
            continue
        claim = owned[0]
        if known.setdefault(uid, claim["metadata"]["uid"]) != claim["metadata"]["uid"]:
            out.append(f"{where}: its ResourceClaim {known[uid]} was replaced by {claim['metadata']['uid']}")
        devices = _allocated_devices(claim)
        conds = _conditions(st)
        if st.get("claimName") != name:
            out.append(f"{where}: status.claimName {st.get('claimName')!r}")
        if not devices:
            if st.get("phase") not in ("Pending", "Released") or st.get("allocations"):
                out.append(
                    f"{where}: claim not allocated but status says {st.get('phase')} {st.get('allocations')}"
                )
            if conds.get("Allocated") != "False":
                out.append(f"{where}: claim not allocated but condition Allocated={conds.get('Allocated')}")
            continue
        pool, device = devices[0]
        node = _claim_node(claim)
        d = pools.get(pool, _Pool()).devices.get(device)
        uuid = d["attributes"]["uuid"]["string"] if d else None
        users = [
            pods.get(f"{ns}/{r['name']}")
            for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods"
        ]
        phase = "InUse" if any(_pod_running(p) for p in users) else "Allocated"
        got = st.get("allocations") or [{}]
        a = got[0]
        seen: tuple[Any, ...] = (
            st.get("phase"),
            a.get("claim"),
            a.get("node"),
            a.get("pool"),
            a.get("device"),
            a.get("gpuUUID"),
        )
        truth = (phase, name, node, pool, device, uuid)
        if len(got) != 1 or seen != truth:
            out.append(f"{where}: status says {seen}, the cluster {truth}")
        if conds.get("Allocated") != "True" or conds.get("InUse") != (
            "True" if phase == "InUse" else "False"
        ):
            out.append(f"{where}: conditions {conds} for a {phase} slice")
    return out


def _quota_refusal_true(w: World, ns: str, package: str, st: Mapping[str, Any], where: str) -> list[str]:
    """A slice refused for quota: the namespace's quota counts its entitlement used. Where it counts
    more than the namespace holds (Kubernetes charged a create that failed), the status says so."""
    key = c.quota_key(package)
    full = [
        (int(q["status"]["used"][key]), int(q["status"]["hard"][key]))
        for q in w.quotas
        if q["metadata"]["namespace"] == ns and key in (q.get("status") or {}).get("used", {})
    ]
    full = [(used, hard) for used, hard in full if used >= hard]
    if not full:
        return [f"{where}: status says QuotaExceeded, but no quota of {ns} counts {key} used up"]
    held = sum(
        1
        for cl in w.claims
        if cl["metadata"]["namespace"] == ns
        and (cl["metadata"].get("labels") or {}).get(c.LABEL_PACKAGE) == package
        and not cl["metadata"].get("deletionTimestamp")
    )
    used = min(u for u, _ in full)
    if held < used and f"holds {held} of them" not in st.get("message", ""):
        return [
            f"{where}: the quota counts {used} used, {ns} holds {held} claims; "
            f"status says {st.get('message')!r}"
        ]
    return []


def running_slice_pods(w: World, namespaces: set[str] | None = None) -> dict[str, RunningPod]:
    out = {}
    for p in w.pods:
        m, spec, st = p["metadata"], p["spec"], p["status"]
        # a pod that asked for a product in `resources.limits` has no claim in its spec: kube-scheduler
        # made one for it (the extended-resource path) and named it in the pod's status
        extended = (st.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
        if namespaces is not None and m["namespace"] not in namespaces:
            continue
        if not spec.get("resourceClaims") and not extended:
            continue
        if not _pod_running(p):
            continue
        statuses = st.get("containerStatuses") or []
        if not statuses or not all("running" in (cs.get("state") or {}) for cs in statuses):
            continue
        names = {
            x["name"]: x["resourceClaimName"]
            for x in st.get("resourceClaimStatuses") or []
            if x.get("resourceClaimName")
        }
        claims = tuple(
            x.get("resourceClaimName") or names.get(x["name"], "") for x in spec.get("resourceClaims") or []
        ) + ((extended,) if extended else ())
        out[_key(p)] = RunningPod(
            namespace=m["namespace"],
            name=m["name"],
            uid=m["uid"],
            node=spec.get("nodeName", ""),
            containers={
                cs["name"]: (cs.get("containerID", ""), int(cs.get("restartCount", 0))) for cs in statuses
            },
            claims=claims,
        )
    return out


def pods_undisturbed(w: World, before: Mapping[str, RunningPod], skip_nodes: set[str]) -> list[str]:
    """Invariant 4 from the API: same uid, same containers, same restart counts, still running."""
    now = {_key(p): p for p in w.pods}
    out = []
    for key, was in before.items():
        if was.node in skip_nodes:
            continue
        p = now.get(key)
        if p is None or p["metadata"]["uid"] != was.uid:
            out.append(
                f"pod {key} (uid {was.uid}) is gone"
                + (f", replaced by uid {p['metadata']['uid']}" if p else "")
            )
            continue
        if not _pod_running(p):
            out.append(
                f"pod {key} is {p['status'].get('phase')}"
                + (" (deleting)" if p["metadata"].get("deletionTimestamp") else "")
            )
            continue
        for cs in p["status"].get("containerStatuses") or []:
            cid, restarts = was.containers.get(cs["name"], ("", 0))
            if cs.get("containerID") != cid or int(cs.get("restartCount", 0)) != restarts:
                out.append(
                    f"pod {key} container {cs['name']}: {cs.get('containerID')} restarts "
                    f"{cs.get('restartCount')}, was {cid} restarts {restarts}"
                )
            elif "running" not in (cs.get("state") or {}):
                out.append(f"pod {key} container {cs['name']} is {cs.get('state')}")
    return out


def containers_running(node: RealNode, before: Mapping[str, RunningPod]) -> list[str]:
    """Invariant 4 from the node (also while the API server is down): each container still runs."""
    out = []
    for key, was in before.items():
        if was.node != node.name:
            continue
        for name, (cid, _) in was.containers.items():
            proc = node.crictl(
                "inspect", "-o", "go-template", "--template", "{{.status.state}}", cid.split("//")[-1]
            )
            if proc.returncode != 0 or proc.stdout.strip() != "CONTAINER_RUNNING":
                out.append(
                    f"{node.name}: pod {key} container {name} is "
                    f"{proc.stdout.strip() or proc.stderr.strip()[-200:]}"
                )
    return out


def _alloc_lines(slice_bytes: int) -> tuple[list[str], list[str]]:
    half = slice_bytes // 2
    sizes = [str(half), str(slice_bytes - half + (1 << 20))]
    return sizes, [
        f"cuMemAlloc({sizes[0]}) -> 0 CUDA_SUCCESS",
        f"cuMemAlloc({sizes[1]}) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
    ]


def shim_enforces(
    cluster: DevCluster, pod: RunningPod, slice_bytes: int, node: RealNode | None = None
) -> list[str]:
    """Invariant 5: in the pod, half the slice is granted and the rest plus 1 MiB refused. Through
    `kubectl exec` as a tenant does; through CRI on the node when `node` is given (the API server
    may be down)."""
    sizes, want = _alloc_lines(slice_bytes)
    if node is not None:
        cid = next(iter(pod.containers.values()))[0].split("//")[-1]
        proc = node.crictl("exec", cid, PROBE, "alloc", *sizes)
    else:
        proc = cluster.kubectl(
            "exec", "-n", pod.namespace, pod.name, "--", PROBE, "alloc", *sizes, check=False, timeout=60
        )
    if proc.returncode != 0 or proc.stdout.strip().splitlines() != want:
        return [
            f"pod {pod.namespace}/{pod.name}: `{PROBE} alloc {' '.join(sizes)}` -> {proc.returncode} "
            f"{proc.stdout!r} {proc.stderr[-300:]!r}"
        ]
    return []


def _slice_bytes(w: World, pod: RunningPod) -> int | None:
    pools = _pools(w.resource_slices)
    claims = {_key(cl): cl for cl in w.claims}
    for name in pod.claims:
        cl = claims.get(f"{pod.namespace}/{name}")
        for pool, device in _allocated_devices(cl or {}):
            d = pools.get(pool, _Pool()).devices.get(device)
            if d:
                return parse_int_quantity(d["capacity"]["memory"]["value"])
    return None


# --- the helper every fault test calls ----------------------------------------------------------------


class Invariants:
    """The invariants of a cluster's slices in `namespaces` (None: all), with the real nodes whose
    NVML, checkpoint and containers can be read."""

    def __init__(
        self, cluster: DevCluster, namespaces: Iterable[str] | None = None, nodes: Iterable[RealNode] = ()
    ) -> None:
        self.cluster = cluster
        self.namespaces = set(namespaces) if namespaces is not None else None
        self.nodes = {n.name: n for n in nodes}
        self.before: dict[str, RunningPod] = {}
        self.slice_bytes: dict[str, int] = {}
        #: {GpuSlice uid: ResourceClaim uid}, as first seen: a claim replaced later was lost
        self.claims: dict[str, str] = {}
        #: pods on these nodes may go (a node lost for good): they are not held to invariant 4
        self.lost_nodes: set[str] = set()
        #: check the shim through CRI even while the API server answers: a kubelet restarted during
        #: a long outage learns its pods again only once its own watch is back (client-go's backoff,
        #: up to a minute), and `kubectl exec` into them fails until then
        self.shim_through_node = False

    def baseline(self) -> dict[str, RunningPod]:
        """Record the running slice pods; every invariant must hold now (a fault test starts sound)."""
        w = World.read(self.cluster)
        self.before = running_slice_pods(w, self.namespaces)
        self.slice_bytes = {k: b for k, p in self.before.items() if (b := _slice_bytes(w, p))}
        problems = self.violations()
        assert not problems, "invariants do not hold before the fault:\n" + "\n".join(problems)
        return self.before

    def violations(self, *, shim: bool = True) -> list[str]:
        try:
            w = World.read(self.cluster)
        except Unreachable as exc:
            return [f"API server unreachable: {exc}"]
        out = card_memory(w) + slice_claims_and_status(w, self.namespaces, self.claims)
        out += pods_undisturbed(w, self.before, self.lost_nodes)
        for node in self.nodes.values():
            if node.name not in self.lost_nodes:
                out += node_memory(node) + containers_running(node, self.before)
        if shim and not out:
            for key, pod in self.before.items():
                if pod.node in self.nodes and pod.node not in self.lost_nodes and key in self.slice_bytes:
                    node = self.nodes[pod.node] if self.shim_through_node else None
                    out += shim_enforces(self.cluster, pod, self.slice_bytes[key], node)
        return out

    def node_side(self) -> list[str]:
        """What can be checked while the API server is down: containers run, the shim enforces (through
        CRI), NVML and the agent's prepared claims fit the cards."""
        out: list[str] = []
        for node in self.nodes.values():
            out += node_memory(node) + containers_running(node, self.before)
            for key, pod in self.before.items():
                if pod.node == node.name and key in self.slice_bytes:
                    out += shim_enforces(self.cluster, pod, self.slice_bytes[key], node)
        return out

    def settle(self, fault: str, since: float, timeout: float = SETTLE_SECONDS) -> float:
        """Poll until every invariant holds; returns the seconds since `since` (the fault's end) it took.
        Fails, listing what does not hold, when that is more than `timeout`."""
        deadline = since + timeout
        first: list[str] | None = None
        while True:
            problems = self.violations()
            first = problems if first is None else first
            if not problems:
                took = time.monotonic() - since
                report(fault, took, first)
                return took
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{fault}: invariants still broken {time.monotonic() - since:.0f}s after the fault ended:"
                    "\n" + "\n".join(problems)
                )
            time.sleep(0.5)


def report(fault: str, seconds: float, first: list[str]) -> None:
    """Print (and with GPUSLICE_FAULT_REPORT append) how long the invariants took, and what was
    broken at the first look after the fault ended."""
    line = f"[invariants] {fault}: every invariant holds {seconds:.1f}s after the fault ended"
    if first:
        line += f"; {len(first)} broken at first, e.g. {first[0][:200]}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("GPUSLICE_FAULT_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(
                json.dumps({"fault": fault, "seconds": round(seconds, 1), "broken_at_first": first}) + "\n"
            )
