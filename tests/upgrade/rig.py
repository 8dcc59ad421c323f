"""What the real-node upgrade tests share: a release exported from its commit and its image, the
tenants it serves (GpuPackages, a direct and a template GpuSlice, a `resources.limits` pod, a month with
an open and a closed interval), the checks after each move between releases (`tests/invariants.py`,
claims, ledger, usage, writes, a new slice) and the prepare window measured while the agent's DaemonSet
rolls (a pod of another tenant created every 0.5 s).

A test names how it moves (`Run.step(name, apply, ...)`: kustomize, Helm); the rest is here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

import gpuslice
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.deploy import NAMESPACE
from gpuslice_dev.devcluster.node_binaries import ensure_node_binaries
from gpuslice_dev.devcluster.realnode import ctr, dirs_of, import_image
from invariants import Invariants, World, real_node, running_slice_pods, shim_enforces
from node.node_cluster import PROBE, TENANT
from support import get_json, wait_for

REPO = Path(__file__).resolve().parents[2]
NODE = "real-node-0"
GPU_SPEC = "2x Tesla V100-PCIE-32GB"
IMAGE = "localhost/gpuslice/gpuslice"
OLD = "0.1.0"
NEW = gpuslice.__version__
#: this tree's image under the tag of a patch release: the rollout from 0.2.0 to 0.2.x, where the
#: stopping agent already leaves its ResourceSlices to kubelet
NEXT = f"{NEW}-next"
#: another tenant whose pods start during each rollout, on a small product of its own
PROBER = "team-b"
PROBE_PACKAGE = "v100-4pct"
#: 2 pods before the step, then up to 20 from the moment the old agent is stopping: 1.28 GiB each
#: (fraction 4), so that many fit beside the 8 GiB slices held during the rollback
BASELINE_PROBES = 2
PROBE_SLOTS = 22
#: the operator's quota on GpuSlice objects in each entitled namespace (0.1.0 makes it too)
COUNT_QUOTA = "gpuslice-objects"


def _say(msg: str) -> None:
    print(f"[upgrade] {msg}", file=sys.stderr, flush=True)


def kubectl(c: DevCluster, *args: str, timeout: float = 240, input: str | None = None) -> str:
    proc = c.kubectl(*args, check=False, timeout=timeout, input=input)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}\n{proc.stdout[-2000:]}")
    return proc.stdout


def release_commit() -> str:
    """The commit the changelog names for 0.1.0 (a clone may not carry the tag)."""
    section = (REPO / "CHANGELOG.md").read_text().split(f"## [{OLD}]", 1)[1]
    found = re.search(r"`([0-9a-f]{40})`", section)
    assert found, f"CHANGELOG.md names no commit for {OLD}"
    return found.group(1)


def export_release(dest: Path) -> Path:
    commit = release_commit()
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], check=False)
    if have.returncode != 0:
        pytest.fail(f"this clone lacks release {OLD} ({commit}): git fetch origin {commit}")
    dest.mkdir(parents=True)
    subprocess.run(
        f"git -C '{REPO}' archive {commit} | tar -x -C '{dest}'", shell=True, check=True, timeout=120
    )
    return dest


def build_release_image(tree: Path, out: Path) -> Path:
    """The release's image, built by the release's own image module from its own sources."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'devtools'}{os.pathsep}{tree / 'operator'}"}
    proc = subprocess.run(
        [sys.executable, "-m", "gpuslice_dev.image", "--output", str(out)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def tag_image(c: DevCluster, tag: str, as_tag: str) -> None:
    bins = ensure_node_binaries(c.progress, c.kubernetes)
    ctr(bins, dirs_of(c, NODE), "images", "tag", "--force", f"{IMAGE}:{tag}", f"{IMAGE}:{as_tag}")


def load_tagged(c: DevCluster, archive: Path, tag: str) -> None:
    """Import the archive (named `:dev`, as every build names it) and tag it `tag` on the node."""
    import_image(c, archive)
    bins = ensure_node_binaries(c.progress, c.kubernetes)
    ctr(bins, dirs_of(c, NODE), "images", "tag", "--force", f"{IMAGE}:dev", f"{IMAGE}:{tag}")


def release_overlay(c: DevCluster, generated: Path, devcluster_overlay: Path, tag: str) -> Path:
    """The generated node overlay over a release's `manifests/overlays/devcluster`, with its tag."""
    top = c.dir / f"deploy-{tag}"
    node = top / "node"
    node.mkdir(parents=True)
    doc = yaml.safe_load((generated / "kustomization.yaml").read_text())
    doc["resources"] = [os.path.relpath(devcluster_overlay, node)]
    (node / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    layer = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["node"],
        "images": [{"name": IMAGE, "newTag": tag}],
    }
    (top / "kustomization.yaml").write_text(yaml.safe_dump(layer, sort_keys=False))
    return top


def rollout(c: DevCluster, what: str, timeout: int = 300) -> None:
    kubectl(c, "-n", NAMESPACE, "rollout", "status", what, f"--timeout={timeout}s", timeout=timeout + 30)


def images_running(c: DevCluster) -> set[str]:
    """The image tags the namespace's running pods were made with: their spec (one image carries
    several tags on the node, and a container's status may name any of them)."""
    pods = get_json(c, "pods", "-n", NAMESPACE)["items"]
    return {
        ct["image"].rsplit(":", 1)[-1]
        for p in pods
        if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
        for ct in p["spec"]["containers"]
    }


def deploy(c: DevCluster, overlay: Path, tag: str) -> None:
    kubectl(c, "apply", "--server-side", "-k", str(overlay))
    rollout(c, "deploy/gpuslice-operator")
    rollout(c, "ds/gpuslice-agent")
    wait_for(lambda: images_running(c) == {tag}, 180, f"only {tag} running in {NAMESPACE}")


# --- what the tenants have ---------------------------------------------------------------------------


def slice_doc(name: str, api: str, package: str = "v100-8g", ns: str = TENANT, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"gpuslice.io/{api}",
        "kind": "GpuSlice",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"package": package, **spec},
    }


def pod_doc(
    name: str, ns: str = TENANT, claim: dict[str, str] | None = None, **limits: str
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": PROBE,
        "command": ["sleep", "3600"],
        "resources": {"limits": {"memory": "64Mi", **limits}},
    }
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", **claim}]
        container["resources"]["claims"] = [{"name": "gpu"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def apply_docs(c: DevCluster, *docs: dict[str, Any]) -> None:
    c.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))


def wait_ready(c: DevCluster, pod: str, ns: str = TENANT, timeout: int = 180) -> None:
    proc = c.kubectl(
        "wait", "--for=condition=Ready", f"pod/{pod}", "-n", ns, f"--timeout={timeout}s",
        check=False, timeout=timeout + 20,
    )  # fmt: skip
    if proc.returncode != 0:
        described = c.kubectl("describe", "pod", pod, "-n", ns, check=False).stdout
        raise AssertionError(f"pod {ns}/{pod} not Ready:\n{described[-3000:]}")


def packages(c: DevCluster, tree: Path) -> None:
    """The release's sample product for TENANT, and a small product for PROBER."""
    v100 = yaml.safe_load((tree / "manifests" / "samples" / "v100-8g.yaml").read_text())
    v100["spec"]["entitlements"][0]["slices"] = 8
    small = {
        "apiVersion": v100["apiVersion"],
        "kind": "GpuPackage",
        "metadata": {"name": PROBE_PACKAGE},
        "spec": {
            "gpuModel": v100["spec"]["gpuModel"],
            "fraction": 4,
            "computeShare": 4,
            "entitlements": [
                {"namespaceSelector": {"matchLabels": {"tenant.example.com/project": PROBER}}, "slices": 40}
            ],
        },
    }
    c.apply(yaml.safe_dump_all([v100, small]))
    c.create_namespace(TENANT, {"tenant.example.com/project": TENANT})
    c.create_namespace(PROBER, {"tenant.example.com/project": PROBER})
    for pkg in ("v100-8g", PROBE_PACKAGE):
        wait_for(
            lambda p=pkg: c.kubectl("get", "deviceclass", f"{p}.gpuslice.io", check=False).returncode == 0,
            120,
            f"DeviceClass {pkg}",
        )
    # the operator's object-count quota in each namespace: until kube-controller-manager has counted
    # it (a usage for every limit), the API server refuses every GpuSlice ("status unknown for
    # quota"). A limit without a usage is the quota synced before the controller discovered GpuSlices
    # (every 30 s): on a fast machine the operator makes it within those 30 s of the CRDs, and asks
    # for a re-count until it is counted
    for ns in (TENANT, PROBER):
        wait_for(lambda n=ns: quota_counted(c, n), 120, f"quota {ns}/{COUNT_QUOTA} counted")


def quota_counted(c: DevCluster, ns: str) -> bool:
    status = (get_json(c, "resourcequota", COUNT_QUOTA, "-n", ns) or {}).get("status") or {}
    hard, used = status.get("hard") or {}, status.get("used") or {}
    return bool(hard) and set(hard) <= set(used)


def claims(c: DevCluster) -> dict[str, tuple[str, str]]:
    """{claim: (uid, its allocation as JSON)} in TENANT."""
    items = get_json(c, "resourceclaims", "-n", TENANT)["items"]
    return {
        cl["metadata"]["name"]: (
            cl["metadata"]["uid"],
            json.dumps((cl.get("status") or {}).get("allocation"), sort_keys=True),
        )
        for cl in items
    }


def intervals(c: DevCluster) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for u in get_json(c, "gpuusages", "-n", TENANT)["items"]:
        out += u.get("intervals") or []
    return out


def ledger_problems(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """Each interval of `before` still there once, open ones still open from the same start, closed
    ones unchanged; a claim that had an interval has no second one."""
    out = []
    by_claim: dict[str, list[dict[str, Any]]] = {}
    for iv in after:
        by_claim.setdefault(iv["claimUID"], []).append(iv)
    for iv in before:
        now = by_claim.get(iv["claimUID"], [])
        if len(now) != 1:
            out.append(f"claim {iv['claim']} ({iv['claimUID']}): {len(now)} intervals, was 1: {now}")
            continue
        (n,) = now
        if n["start"] != iv["start"]:
            out.append(f"claim {iv['claim']}: interval starts {n['start']}, was {iv['start']}")
        if iv.get("end") is None and n.get("end") is not None:
            out.append(f"claim {iv['claim']}: its open interval was closed at {n['end']}")
        if iv.get("end") is not None and n.get("end") != iv["end"]:
            out.append(f"claim {iv['claim']}: closed interval now ends {n.get('end')}, was {iv['end']}")
    return out


def usage_time(c: DevCluster, name: str) -> datetime | None:
    st = (get_json(c, "gpuslice", name, "-n", TENANT) or {}).get("status") or {}
    t = (st.get("usage") or {}).get("time")
    return datetime.fromisoformat(t.replace("Z", "+00:00")) if t else None


def refused(c: DevCluster, name: str) -> int:
    st = (get_json(c, "gpuslice", name, "-n", TENANT) or {}).get("status") or {}
    return int((st.get("usage") or {}).get("refusedAllocations") or 0)


#: what a step may write to the objects there before it: what was, per kind
KINDS = (
    "customresourcedefinitions,gpupackages,gpuslices,gpuusages,resourceclaims,resourceclaimtemplates,deviceclasses,"
    "resourceslices,resourcequotas,validatingadmissionpolicies,validatingadmissionpolicybindings"
)


def versions(c: DevCluster) -> dict[str, str]:
    items = get_json(c, KINDS, "-A")["items"]
    return {
        f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}": o["metadata"][
            "resourceVersion"
        ]
        for o in items
        if o["metadata"].get("namespace") in (None, TENANT)
    }


def writes(c: DevCluster) -> Counter[str]:
    """The API server's count of writes by group/resource[/subresource] and verb, since it started."""
    out: Counter[str] = Counter()
    for line in kubectl(c, "get", "--raw", "/metrics").splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if labels.get("verb") in ("GET", "LIST", "WATCH", "CONNECT") or labels.get("resource") in (
            "leases",
            "events",
            "tokenreviews",
            "subjectaccessreviews",
            "selfsubjectaccessreviews",
            "tokenrequests",
        ):
            continue
        parts = (labels.get("group") or "core", labels.get("resource", ""), labels.get("subresource"))
        res = "/".join(x for x in parts if x)
        out[f"{labels.get('verb')} {res}"] += int(float(line.rsplit(" ", 1)[1]))
    return out


def report_writes(
    step: str, rv0: dict[str, str], rv1: dict[str, str], w0: Counter[str], w1: Counter[str]
) -> None:
    changed = Counter(k.split("/", 1)[0] for k, v in rv0.items() if rv1.get(k, v) != v)
    gone = sorted(k for k in rv0 if k not in rv1)
    _say(f"{step}: objects there before and rewritten, per kind: {dict(changed)} of {len(rv0)}; gone: {gone}")
    _say(f"{step}: API writes meanwhile (every client, the prober's too): {dict(sorted((w1 - w0).items()))}")


def hold(inv: Invariants) -> None:
    """Record the running slice pods (the `resources.limits` ones too); every invariant holds now."""
    inv.baseline()


# --- the prepare window --------------------------------------------------------------------------------


class Prober:
    """Pods of PROBER, each with a claim of its own from one template slice, started every 0.5 s
    while the agent's DaemonSet rolls: when each was created, when it was first seen Running."""

    def __init__(self, c: DevCluster, step: str) -> None:
        self.c, self.step = c, step
        self.created: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.stop = threading.Event()
        #: set when the old agent is seen stopping: the 0.5 s cadence starts there
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._create, daemon=True)
        self.t0 = time.monotonic()

    def _create(self) -> None:
        n = 0
        while not self.stop.is_set() and n < PROBE_SLOTS:
            name = f"{self.step}-{n}"
            doc = pod_doc(name, PROBER, {"resourceClaimTemplateName": "probe"})
            asked = time.monotonic()
            proc = self.c.kubectl("create", "-f", "-", input=json.dumps(doc), check=False, timeout=60)
            if proc.returncode == 0:
                self.created[name] = asked
            n += 1
            if n == BASELINE_PROBES:
                self.go.wait(180)
            # every 0.5 s for 7 s, then every 2 s: a node's slots are few
            self.stop.wait(0.5 if n < BASELINE_PROBES + 14 else 2.0)

    def poll(self) -> None:
        pods = get_json(self.c, "pods", "-n", PROBER)["items"]
        now = time.monotonic()
        for p in pods:
            name = p["metadata"]["name"]
            if name.startswith(f"{self.step}-") and p["status"].get("phase") == "Running":
                self.running.setdefault(name, now)

    def events(self) -> Counter[str]:
        items = get_json(self.c, "events", "-n", PROBER)["items"]
        return Counter(
            f"{e['reason']}: {e.get('message', '')[:160]}"
            for e in items
            if e.get("type") == "Warning" and e["involvedObject"]["name"].startswith(f"{self.step}-")
        )

    def summary(self, agent_stopped: float | None, agent_ready: float | None) -> dict[str, Any]:
        rel = lambda t: round(t - self.t0, 1) if t is not None else None  # noqa: E731
        rows = [
            (rel(t), round(self.running[n] - t, 1) if n in self.running else None)
            for n, t in sorted(self.created.items(), key=lambda kv: kv[1])
        ]
        done = [ttr for _, ttr in rows if ttr is not None]
        return {
            "agent_stopping_at": rel(agent_stopped),
            "new_agent_ready_at": rel(agent_ready),
            "pods (created at, time to Running)": rows,
            "median_s": statistics.median(done) if done else None,
            "max_s": max(done) if done else None,
            "never_running": [n for n in self.created if n not in self.running],
            "warnings": dict(self.events()),
        }


def agent_pods(c: DevCluster) -> list[dict[str, Any]]:
    return get_json(c, "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=gpuslice-agent")["items"]


def roll_with_probes(c: DevCluster, step: str, apply: Any) -> dict[str, Any]:
    """Run `apply` (the step's kubectl commands) while pods start every 0.5 s; return the figures."""
    old_agent = {p["metadata"]["uid"] for p in agent_pods(c)}
    prober = Prober(c, step)
    prober.thread.start()
    # two pods before the step: the machine's time to Running with the agent up
    wait_for(lambda: len(prober.created) >= BASELINE_PROBES, 60, "the baseline probes created")
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            apply()
        except BaseException as exc:  # re-raised by the caller
            failure.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    stopped = ready = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        prober.poll()
        pods = agent_pods(c)
        now = time.monotonic()
        going = [p for p in pods if p["metadata"]["uid"] in old_agent]
        if stopped is None and (not going or any(p["metadata"].get("deletionTimestamp") for p in going)):
            stopped = now
            prober.go.set()
        if ready is None and any(
            p["metadata"]["uid"] not in old_agent
            and any(
                x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions") or []
            )
            for p in pods
        ):
            ready = now
        if ready is not None and now - ready > 10:
            prober.stop.set()
        if done.is_set() and prober.stop.is_set() and set(prober.running) >= set(prober.created):
            break
        time.sleep(0.5)
    prober.stop.set()
    prober.thread.join(60)
    worker.join(60)
    if failure:
        raise failure[0]
    late = time.monotonic() + 180
    while not set(prober.running) >= set(prober.created) and time.monotonic() < late:
        time.sleep(0.5)
        prober.poll()
    figures = prober.summary(stopped, ready)
    _say(f"{step}: prepare window: {json.dumps(figures)}")
    return figures


def clear_probes(c: DevCluster) -> None:
    kubectl(c, "delete", "pods", "--all", "-n", PROBER, "--wait=true", "--timeout=180s", timeout=240)
    wait_for(
        lambda: not get_json(c, "resourceclaims", "-n", PROBER)["items"], 120, "the prober's claims gone"
    )


# --- the run: a cluster, the tenants on the old release, the steps ----------------------------------------


def devcluster(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[DevCluster]:
    """A devcluster of the test's own (real nodes are started by the test), torn down after it."""
    if os.geteuid() != 0:
        pytest.skip("real nodes and the image build need root (kubelet, containerd, mmdebstrap, chroot)")
    if shutil.which("mmdebstrap") is None:
        pytest.skip("the image build needs mmdebstrap (apt-get install mmdebstrap)")
    c = DevCluster(tmp_path_factory.mktemp(name), progress=_say)
    try:
        yield c
    finally:
        c.down()


def images(tmp_path: Path) -> tuple[Path, Path, Path]:
    """0.1.0's tree, its image (built by its own image module) and this tree's image."""
    from gpuslice_dev.image import build_image

    old_tree = export_release(tmp_path / f"gpuslice-{OLD}")
    old_image = build_release_image(old_tree, tmp_path / f"gpuslice-{OLD}.oci.tar")
    return old_tree, old_image, build_image(output=None, progress=_say)


class Run:
    """The tenants on the old release, held to every check through each step; what did not hold is
    collected (a test goes on to roll back and measure) and `finish` fails with all of it."""

    def __init__(self, c: DevCluster, old_tree: Path) -> None:
        self.c, self.old_tree = c, old_tree
        self.failures: list[str] = []
        #: more checks after each step (a drained card stays drained): each returns what does not hold
        self.checks: list[Callable[[str], list[str]]] = []
        self.figures: dict[str, dict[str, Any]] = {}

    def check(self, ok: object, what: str) -> None:
        if not ok:
            self.failures.append(what)
            _say(f"NOT HELD: {what[:2000]}")

    def tenants(self, after_packages: Callable[[], None] | None = None) -> None:
        """Tenants on 0.1.0, written as a GitOps repository for 0.1.0 has them (v1alpha1).
        `after_packages` runs once the products exist (the agent publishes devices per product)."""
        c = self.c
        packages(c, self.old_tree)
        if after_packages is not None:
            after_packages()
        apply_docs(
            c,
            slice_doc("direct", "v1alpha1"),
            pod_doc("direct", claim={"resourceClaimName": "direct"}),
            slice_doc("tmpl", "v1alpha1", template=True),
            pod_doc("from-template", claim={"resourceClaimTemplateName": "tmpl"}),
            pod_doc("limits", **{"gpuslice.io/v100-8g": "1"}),
            slice_doc("ended", "v1alpha1"),
            pod_doc("ended", claim={"resourceClaimName": "ended"}),
            slice_doc("probe", "v1alpha1", package=PROBE_PACKAGE, ns=PROBER, template=True),
        )
        for pod in ("direct", "from-template", "limits", "ended"):
            wait_ready(c, pod)
        # a closed interval in the month: a slice held, then released
        wait_for(lambda: any(iv["claim"] == "ended" for iv in intervals(c)), 60, "the ended slice's interval")
        kubectl(c, "delete", "pod", "ended", "-n", TENANT, "--wait=true", "--timeout=60s")
        kubectl(c, "delete", "gpuslice", "ended", "-n", TENANT, "--wait=true", "--timeout=60s")
        wait_for(
            lambda: next(iv.get("end") for iv in intervals(c) if iv["claim"] == "ended") is not None,
            60,
            "the ended slice's interval closed",
        )
        wait_for(lambda: usage_time(c, "direct") is not None, 90, "usage of the direct slice")
        wait_for(
            lambda: get_json(c, "resourceclaimtemplate", "probe", "-n", PROBER),
            60,
            "the prober's claim template",
        )
        self.inv = Invariants(c, {TENANT}, [real_node(c, NODE)])
        self.inv.settle(f"{OLD} installed", time.monotonic(), timeout=120)
        hold(self.inv)
        self.before = dict(self.inv.before)
        want = {f"{TENANT}/{p}" for p in ("direct", "from-template", "limits")}
        assert set(self.before) == want, self.before
        self.claims0, self.ledger0 = claims(c), intervals(c)
        _say(f"the month on {OLD}: {json.dumps(self.ledger0)}")
        assert [iv.get("end") for iv in self.ledger0 if iv["claim"] == "direct"] == [None], self.ledger0

    def step(self, name: str, apply: Callable[[], None], api: str) -> dict[str, Any]:
        """One move between releases (`apply`) under the running pods, then every check, then a new
        slice written under `api`; returns the prepare window's figures."""
        c, inv, check = self.c, self.inv, self.check
        rv0, w0 = versions(c), writes(c)
        held_claims, held_ledger = claims(c), intervals(c)
        refused0 = refused(c, "direct")
        t = time.monotonic()
        figures = roll_with_probes(c, name, apply)
        self.figures[name] = figures
        check(not figures["never_running"], f"{name}: pods that never ran: {figures['never_running']}")
        rolled = time.monotonic()
        _say(f"{name}: rolled out in {rolled - t:.0f}s")
        try:
            inv.settle(name, rolled, timeout=90)
        except AssertionError as exc:
            check(False, f"{name}: {exc}")
        now_claims = claims(c)
        check(
            {k: now_claims.get(k) for k in held_claims} == held_claims,
            f"{name}: a claim re-created or re-allocated: {held_claims} -> {now_claims}",
        )
        problems = ledger_problems(held_ledger, intervals(c))
        check(not problems, f"{name}: ledger: " + "\n".join(problems))
        # the invariants' shim check refused an allocation in each pod after the rollout: the agent
        # that runs now read it from the slice's usage region and reported it
        wall = time.time() - (time.monotonic() - rolled)
        try:
            wait_for(
                lambda: (
                    refused(c, "direct") > refused0
                    and (u := usage_time(c, "direct"))
                    and u.timestamp() > wall
                ),
                120,
                f"{name}: the agent's usage of the direct slice after the rollout (refused was {refused0})",
            )
        except AssertionError as exc:
            check(False, str(exc))
        for more in self.checks:
            problems = more(name)
            check(not problems, f"{name}: " + "\n".join(problems))
        report_writes(name, rv0, versions(c), w0, writes(c))
        served = {
            crd["metadata"]["name"]: [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
            for crd in get_json(c, "crd")["items"]
        }
        _say(f"{name}: CRD versions served: {served}")
        # a new slice, written as this release's users write it, once the prober's pods are gone:
        # with them the cards had no 8 GiB left
        clear_probes(c)
        fresh = f"after-{name}"
        apply_docs(c, slice_doc(fresh, api), pod_doc(fresh, claim={"resourceClaimName": fresh}))
        wait_ready(c, fresh)
        pod = running_slice_pods(World.read(c), {TENANT})[f"{TENANT}/{fresh}"]
        problems = shim_enforces(c, pod, 8 << 30)
        check(not problems, f"{name}: the new slice: {problems}")
        for more in self.checks:
            problems = more(f"after {name}'s new slice")
            check(not problems, f"{name}: " + "\n".join(problems))
        try:
            hold(inv)  # the new slice's pod is held to the invariants from here on
        except AssertionError as exc:
            check(False, f"after {name}: {exc}")
        return figures

    def finish(self, started: float) -> None:
        """Across every step: each pod that ran on 0.1.0 is the same pod, the same containers; the
        ledger and the claims as they were; then fail with whatever did not hold."""
        c, check = self.c, self.check
        now = running_slice_pods(World.read(c), {TENANT})
        for key, was in self.before.items():
            check(
                key in now and now[key].uid == was.uid and now[key].containers == was.containers,
                f"pod {key} was {was}, now {now.get(key)}",
            )
        problems = ledger_problems(self.ledger0, intervals(c))
        check(not problems, "across every step: ledger: " + "\n".join(problems))
        now_claims = claims(c)
        same = {k: now_claims.get(k) for k in self.claims0} == self.claims0
        check(same, f"across every step: claims changed: {self.claims0} -> {now_claims}")
        _say(f"done after {time.monotonic() - started:.0f}s")
        assert not self.failures, "\n".join(self.failures)
