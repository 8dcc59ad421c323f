"""What the operator adds to kube-scheduler on a big cluster: time to allocation and to a true status,
API writes, operator CPU and memory.

    .venv/bin/python bench/operator_scale.py [--nodes 125] [--gpus 4] [--slices 2000] [--noise-pods 0]
        [--runs A,B] [--probes 10] [--json] [--keep] [--profile DIR]

Each run gets a fresh `gpuslice-dev devcluster` (kwok nodes) whose ResourceSlices are published exactly as
the node agents publish them (the agent's own builder: `--gpus` simulated V100s per node, one package of
fraction 25, so `4 * gpus * nodes` slots). `--noise-pods` unrelated pods (bound to CPU-only kwok nodes of
their own, 100 per node, Running) are created in another namespace first. Then, with the same client:

- A: documented-form ResourceClaims and one pod each, no operator (kube-scheduler alone);
- B: the operator runs; GpuSlices and one pod each (the pod names the slice's claim).

Each run first measures `--probes` single slices one after the other on the idle cluster (create ->
allocated, then deleted), then creates the burst (all slices/claims and pods at once, `--concurrency`
requests in flight) and waits until every claim is allocated and every pod bound (A and B), and every
GpuSlice's status says Allocated (or InUse) with its device (B). API writes are the API server's own
`apiserver_request_total` (write verbs, by resource) over the burst; operator CPU from /proc, peak RSS
is its VmHWM; its own writes are `gpuslice_operator_writes_total`.

Prints a table and, last, one line: the ratio of B's status time to A's allocation time and the
operator's peak RSS. `--json` prints the whole result as JSON instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _kwok import card, node_slices

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.agent.slices import Package
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.claims import documented_claim_spec
from gpuslice.domain.deviceclass import device_selector_expression
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.components import node_manifest

REPO = Path(__file__).resolve().parents[1]
MODEL = "Tesla V100-PCIE-32GB"
PACKAGE = "v100-8g"
FRACTION = 25
TENANT = "bench"
NOISE = "noise"
NOISE_PODS_PER_NODE = 100
TENANT_LABEL = "bench.gpuslice.io/tenant"
DRA = c.DRA_GROUP_VERSION
WRITE_VERBS = {"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"}
ALLOCATED = {"Allocated", "InUse"}


#: Runs `python -m gpuslice ...` under tracemalloc; SIGUSR1 writes the top allocation sites.
TRACEMALLOC_WRAPPER = """
import runpy, signal, sys, tracemalloc
tracemalloc.start(8)
def dump(*_):
    snap = tracemalloc.take_snapshot()
    with open({out!r}, "a") as fh:
        current, peak = tracemalloc.get_traced_memory()
        fh.write(f"=== traced now {{current / 2**20:.1f}} MiB, peak {{peak / 2**20:.1f}} MiB\\n")
        for key in ("filename", "lineno"):
            fh.write(f"--- by {{key}}\\n")
            for stat in snap.statistics(key)[:30]:
                where = stat.traceback.format()[0].strip()
                fh.write(f"{{stat.size / 2**20:8.2f}} MiB {{stat.count:8d}} {{where}}\\n")
        with open({out!r} + ".lines", "w") as lines:
            for stat in snap.statistics("lineno"):
                lines.write(f"{{stat.size}} {{stat.count}} {{stat.traceback.format()[0].strip()}}\\n")
        fh.write("--- by traceback\\n")
        for stat in snap.statistics("traceback")[:25]:
            fh.write(f"{{stat.size / 2**20:8.2f}} MiB {{stat.count:8d}} blocks\\n")
            for line in stat.traceback.format()[-8:]:
                fh.write(f"    {{line}}\\n")
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["gpuslice", *sys.argv[1:]]
runpy.run_module("gpuslice", run_name="__main__")
"""


#: Runs `python -m gpuslice ...`; SIGUSR1 writes live objects by type, asyncio tasks, threads, sockets
#: and pymalloc's arena use (to tell live data from fragmentation).
MEMSTATS_WRAPPER = """
import asyncio, collections, gc, os, runpy, signal, sys, threading, traceback
def dump(*_):
    try:
        _dump()
    except Exception:
        with open({out!r}, "a") as fh:
            fh.write(traceback.format_exc())
def _dump():
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    try:
        tasks = len(asyncio.all_tasks(asyncio.get_running_loop()))
    except RuntimeError:
        tasks = -1
    fds = os.listdir("/proc/self/fd")
    socks = 0
    for f in fds:
        try:
            socks += os.readlink(f"/proc/self/fd/{{f}}").startswith("socket:")
        except OSError:
            pass
    with open({out!r}, "a") as fh:
        threads, blocks = threading.active_count(), sys.getallocatedblocks()
        fh.write(f"=== tasks {{tasks}} threads {{threads}} sockets {{socks}} blocks {{blocks}}\\n")
        for name, n in counts.most_common(30):
            fh.write(f"{{n:9d}} {{name}}\\n")
        stderr, sys.stderr = sys.stderr, fh
        try:
            sys._debugmallocstats()
        finally:
            sys.stderr = stderr
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["gpuslice", *sys.argv[1:]]
runpy.run_module("gpuslice", run_name="__main__")
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- objects --------------------------------------------------------------------------------------


def resource_slices(node: str, gpus: int) -> list[dict[str, Any]]:
    """What the agent of `node` publishes for `gpus` V100s and the one package."""
    spec = GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": FRACTION})
    return node_slices(
        [node], lambda n: [card(n, i, MODEL, 32 * c.GIB) for i in range(gpus)], [Package(PACKAGE, spec)]
    )


def device_class() -> dict[str, Any]:
    spec = GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": FRACTION})
    expression = device_selector_expression(PACKAGE, spec)
    return {
        "apiVersion": DRA,
        "kind": "DeviceClass",
        "metadata": {"name": c.device_class_name(PACKAGE)},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def package(slices: int) -> dict[str, Any]:
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": PACKAGE},
        "spec": {
            "gpuModel": MODEL,
            "fraction": FRACTION,
            "entitlements": [
                {"namespaceSelector": {"matchLabels": {TENANT_LABEL: "true"}}, "slices": slices}
            ],
        },
    }


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": DRA,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {c.LABEL_PACKAGE: PACKAGE}},
        "spec": documented_claim_spec(PACKAGE),
    }


def gpu_slice(name: str) -> dict[str, Any]:
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.SLICE_KIND,
        "metadata": {"name": name},
        "spec": {"package": PACKAGE},
    }


def pod(name: str, claim_name: str | None = None, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "2Gi"}},
            }
        ],
        "nodeSelector": {"type": "kwok"},
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name}]
        spec["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# --- measuring --------------------------------------------------------------------------------------


def parse_counter(text: str, metric: str) -> dict[tuple[str, ...], float]:
    """`metric{labels} value` lines -> {(label=value, ...): value}."""
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        labels, _, value = line[len(metric) + 1 :].rpartition("} ")
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(value)  # type: ignore[arg-type]
    return out


def api_writes(before: dict[Any, float], after: dict[Any, float]) -> dict[str, int]:
    """Write requests between two scrapes, by `VERB resource[/subresource]`."""
    out: Counter[str] = Counter()
    for key, value in after.items():
        labels = dict(key)
        if labels.get("verb") not in WRITE_VERBS:
            continue
        n = int(value - before.get(key, 0))
        if n:
            sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
            out[f"{labels['verb']} {labels.get('resource', '')}{sub}"] += n
    return dict(out.most_common())


class Proc:
    """CPU seconds and peak RSS of a process from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick

    def mem(self, key: str) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0


class Seen:
    """Watches a namespace's objects and records when each first satisfies `done`."""

    def __init__(self, api: kubehttp.Client, url: str, done: Callable[[dict[str, Any]], bool]) -> None:
        self.api, self.url, self.done = api, url, done
        self.at: dict[str, float] = {}
        self.changed = asyncio.Event()
        self.events = 0

    def _see(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if name not in self.at and self.done(obj):
            self.at[name] = time.monotonic()
            self.changed.set()

    async def run(self) -> None:
        while True:
            try:
                async for kind, obj in kubehttp.list_and_watch(self.api, self.url):
                    if kind == "LIST":
                        for o in obj:
                            self._see(o)
                    elif kind in ("ADDED", "MODIFIED"):
                        self.events += 1
                        self._see(obj)
                    elif kind == "DELETED":
                        self.at.pop(obj["metadata"]["name"], None)
            except (kubehttp.ApiError, OSError, TimeoutError) as exc:
                log(f"watch {self.url}: {exc}; again")
                await asyncio.sleep(0.5)

    async def wait(self, names: set[str], within: float) -> float | None:
        """Monotonic time when the last of `names` was seen done; None after `within` seconds."""
        deadline = time.monotonic() + within
        while not names <= self.at.keys():
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 5.0))
        return max((self.at[n] for n in names), default=time.monotonic())


def claim_allocated(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("allocation"))


def pod_bound(obj: dict[str, Any]) -> bool:
    return bool((obj.get("spec") or {}).get("nodeName"))


def slice_allocated(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    return status.get("phase") in ALLOCATED and bool(status.get("device"))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))], 3)


async def gather_limited(limit: int, jobs: list[Callable[[], Any]]) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Any]) -> Any:
        async with sem:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


async def wait_all_running(api: kubehttp.Client, url: str, within: float) -> float:
    """Seconds until no pod under `url` is in another phase than Running (server-side field selector)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        page = await api.get(url, fieldSelector="status.phase!=Running", limit="1")
        if not page.get("items"):
            return round(time.monotonic() - t0, 1)
        await asyncio.sleep(2)
    raise TimeoutError(f"pods under {url} still not Running after {within:.0f}s")


async def create_with_retry(api: kubehttp.Client, url: str, body: dict[str, Any]) -> float:
    """POST, retrying what a loaded API server refuses for a moment; the reply's monotonic time."""
    for attempt in range(20):
        try:
            await api.create(url, body)
            return time.monotonic()
        except kubehttp.ApiError as exc:
            if exc.status == 409:
                return time.monotonic()
            if exc.status not in (429, 500, 503, 504) and not (exc.status == 403 and attempt < 10):
                raise
        except (OSError, TimeoutError):
            pass
        await asyncio.sleep(min(0.2 * 2**attempt, 5))
    raise RuntimeError(f"could not create {url} {body['metadata']['name']}")


# --- one run ----------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace, mode: str, workdir: Path) -> None:
        self.args, self.mode = args, mode
        self.dir = workdir / f"run-{mode}"
        self.cluster = DevCluster(self.dir, progress=lambda m: log(f"{mode}: {m}"))
        self.operator: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.metrics_token = ""
        self.result: dict[str, Any] = {"run": mode}
        self.peak_rss = 0.0

    @property
    def with_operator(self) -> bool:
        return self.mode == "B"

    async def setup(self, api: kubehttp.Client) -> None:
        a = self.args
        nodes = self.cluster.nodes
        slices = [s for n in nodes for s in resource_slices(n, a.gpus)]
        url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
        await gather_limited(
            a.concurrency,
            [lambda s=s: api.apply(f"{url}/{s['metadata']['name']}", s, "bench") for s in slices],
        )
        ns_url = kubehttp.path("", "v1", "namespaces")
        for ns, labels in ((TENANT, {TENANT_LABEL: "true"}), (NOISE, {})):
            await api.create(ns_url, {"metadata": {"name": ns, "labels": labels}})
        for ns in (TENANT, NOISE):
            self.cluster.wait_default_service_account(ns)
        if a.noise_pods:
            # On nodes of their own, 100 per node (a node holds 110 pods): on the GPU nodes they would
            # fill every node and leave the slices' pods unschedulable.
            t0 = time.monotonic()
            hosts = [f"noise-node-{i}" for i in range(-(-a.noise_pods // NOISE_PODS_PER_NODE))]
            await gather_limited(
                a.concurrency,
                [lambda h=h: api.create(kubehttp.path("", "v1", "nodes"), node_manifest(h)) for h in hosts],
            )
            purl = kubehttp.path("", "v1", "pods", namespace=NOISE)
            await gather_limited(
                a.concurrency,
                [
                    lambda i=i: create_with_retry(
                        api, purl, pod(f"noise-{i}", node=hosts[i // NOISE_PODS_PER_NODE])
                    )
                    for i in range(a.noise_pods)
                ],
            )
            log(
                f"{self.mode}: {a.noise_pods} noise pods on {len(hosts)} nodes"
                f" created in {time.monotonic() - t0:.1f}s"
            )
            # kwok moves them to Running minutes after their creation (one status patch each). Measured
            # from here, the operator's start-up, idle and "at rest" figures were its pod watch decoding
            # that catch-up (8.8 % CPU "at rest" with 20,000, 0.3 % once they all ran), not a cluster
            # at rest: wait for it.
            t1 = time.monotonic()
            self.result["noise_running_s"] = await wait_all_running(api, purl, a.timeout)
            log(f"{self.mode}: every noise pod Running {time.monotonic() - t1:.1f}s later")
        self.result["resourceslices"] = len(slices)

    def metrics_reader(self) -> None:
        """A service account bound to the manifests' metrics-reader role, as a scraper has: the
        operator's /metrics answers only readers the API server authorizes."""
        self.cluster.apply(REPO / "manifests" / "base" / "metrics-reader.yaml")
        self.cluster.kubectl("create", "serviceaccount", "bench-scraper", "-n", "default")
        self.cluster.kubectl(
            "create", "clusterrolebinding", "bench-scraper", "--clusterrole=gpuslice-metrics-reader",
            "--serviceaccount=default:bench-scraper",
        )  # fmt: skip
        self.metrics_token = self.cluster.kubectl(
            "create", "token", "bench-scraper", "-n", "default", "--duration=24h"
        ).stdout.strip()

    def start_operator(self) -> None:
        self.metrics_reader()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.metrics_port = s.getsockname()[1]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "operator")}
        argv = [
            sys.executable, "-m", "gpuslice", "operator", f"--kubeconfig={self.cluster.kubeconfig}",
            f"--metrics-port={self.metrics_port}",
            # every slice of the burst is in one tenant namespace
            f"--max-gpuslices-per-namespace={self.args.slices + self.args.probes}",
            *self.args.operator_arg,
        ]  # fmt: skip
        if self.args.tracemalloc or self.args.memstats:
            kind, wrapper = (
                ("tracemalloc", TRACEMALLOC_WRAPPER)
                if self.args.tracemalloc
                else ("memstats", MEMSTATS_WRAPPER)
            )
            out = Path(self.args.tracemalloc or self.args.memstats) / f"operator-{self.mode}.{kind}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            argv[1:3] = ["-c", wrapper.format(out=str(out))]
        logfile = (self.dir / "logs" / "operator.log").open("ab")
        self.operator = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if self.args.profile:
            out = Path(self.args.profile) / f"operator-{self.mode}.speedscope.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            self.profiler = subprocess.Popen(
                [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
                 "--pid", str(self.operator.pid), "--rate", "50", "--format", "speedscope",
                 "--output", str(out), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=(self.dir / "logs" / "py-spy.log").open("ab"),
            )  # fmt: skip

    def operator_metrics(self) -> dict[str, float]:
        try:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.metrics_port}/metrics",
                headers={"Authorization": f"Bearer {self.metrics_token}"},
            )
            with urllib.request.urlopen(request, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for key, value in parse_counter(text, "gpuslice_operator_writes_total").items():
            labels = dict(key)
            out[f"{labels.get('kind')} {labels.get('verb')}"] = value
        return out

    async def wait_operator_ready(self, api: kubehttp.Client, t0: float) -> float:
        """Seconds from the operator's start to the package's DeviceClass and the tenant's quota."""
        dc = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", c.device_class_name(PACKAGE))
        quota = kubehttp.path("", "v1", "resourcequotas", c.QUOTA_NAME, namespace=TENANT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                await api.get(dc)
                q = await api.get(quota)
                if (q.get("status") or {}).get("hard"):
                    ns = await api.get(kubehttp.path("", "v1", "namespaces", TENANT))
                    if ns["metadata"].get("labels", {}).get(c.LABEL_TENANT) == "true":
                        return time.monotonic() - t0
            except kubehttp.ApiError as exc:
                if exc.status != 404:
                    raise
            if self.operator is not None and self.operator.poll() is not None:
                raise RuntimeError(f"operator exited ({self.operator.returncode}); log in {self.dir}/logs")
            await asyncio.sleep(0.2)
        raise RuntimeError("operator did not reconcile the package in 600s")

    def sample_rss(self) -> None:
        if self.operator is not None:
            self.peak_rss = max(self.peak_rss, Proc(self.operator.pid).mem("VmHWM"))

    async def item(self, api: kubehttp.Client, name: str) -> float:
        """Create one slice (B) or claim (A) and its pod; the create reply's monotonic time."""
        if self.with_operator:
            url = kubehttp.path(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL, namespace=TENANT)
            at = await create_with_retry(api, url, gpu_slice(name))
        else:
            url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", namespace=TENANT)
            at = await create_with_retry(api, url, claim(name))
        await create_with_retry(api, kubehttp.path("", "v1", "pods", namespace=TENANT), pod(name, name))
        return at

    async def probes(self, api: kubehttp.Client, watch: Seen) -> list[float]:
        """Single slices on the idle cluster, one after the other; deleted again afterwards."""
        latencies = []
        names = [f"probe-{i}" for i in range(self.args.probes)]
        for name in names:
            at = await self.item(api, name)
            done = await watch.wait({name}, 120)
            if done is None:
                raise RuntimeError(f"{self.mode}: probe {name} not allocated in 120s")
            latencies.append(done - at)
        for name in names:
            await api.delete(kubehttp.path("", "v1", "pods", name, namespace=TENANT), gracePeriodSeconds="0")
            if self.with_operator:
                await api.delete(kubehttp.path(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL, name, TENANT))
            else:
                await api.delete(kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", name, TENANT))
        claims_url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", namespace=TENANT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listing = await api.get(claims_url)
            if not listing["items"]:
                break
            await asyncio.sleep(0.5)
        return latencies

    async def measure(self) -> dict[str, Any]:
        a = self.args
        self.cluster.up(nodes=a.nodes)
        self.cluster.apply_crds()
        api = kubehttp.Client(kubehttp.Config.from_kubeconfig(self.cluster.kubeconfig), connections=64)
        tasks: list[asyncio.Task[None]] = []
        try:
            await self.setup(api)
            r = self.result
            if self.with_operator:
                t0 = time.monotonic()
                self.start_operator()
                assert self.operator is not None
                proc = Proc(self.operator.pid)
                await api.apply(
                    kubehttp.path(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, PACKAGE),
                    package(a.slices + a.probes),
                    "bench",
                )
                r["operator_startup_s"] = round(await self.wait_operator_ready(api, t0), 1)
                await asyncio.sleep(2)
                r["operator_idle_rss_mib"] = round(proc.mem("VmRSS"), 1)
            else:
                dc = device_class()
                dc_url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", dc["metadata"]["name"])
                await api.apply(dc_url, dc, "bench")
            claims_url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", namespace=TENANT)
            slices_url = kubehttp.path(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL, namespace=TENANT)
            claims = Seen(api, claims_url, claim_allocated)
            pods = Seen(api, kubehttp.path("", "v1", "pods", namespace=TENANT), pod_bound)
            slices = Seen(api, slices_url, slice_allocated)
            watchers = [claims, pods] + ([slices] if self.with_operator else [])
            tasks = [asyncio.create_task(w.run()) for w in watchers]
            status_watch = slices if self.with_operator else claims
            if a.probes:
                lat = await self.probes(api, status_watch)
                r["idle_status_p50_s"], r["idle_status_p99_s"] = pct(lat, 0.5), pct(lat, 0.99)
            if self.operator is not None:
                # 2 s after start-up the operator may still be reading a big cluster's pods, page by
                # page; a slice's status waits for that listing, so after the probes it is done.
                await asyncio.sleep(2)
                r["operator_settled_rss_mib"] = round(Proc(self.operator.pid).mem("VmRSS"), 1)
            names = [f"s{i}" for i in range(a.slices)]
            metrics_before = parse_counter(await api.text("/metrics"), "apiserver_request_total")
            op_before = self.operator_metrics() if self.with_operator else {}
            cpu_before = Proc(self.operator.pid).cpu() if self.operator else 0.0
            log(f"{self.mode}: burst of {a.slices} {'GpuSlices' if self.with_operator else 'claims'} + pods")
            start = time.monotonic()
            created_list = await gather_limited(a.concurrency, [lambda n=n: self.item(api, n) for n in names])
            created = dict(zip(names, created_list, strict=True))
            r["create_s"] = round(time.monotonic() - start, 1)
            want = set(names)
            sampler = asyncio.create_task(self._sample())
            try:
                done_alloc = await claims.wait(want, a.timeout)
                done_pods = await pods.wait(want, a.timeout)
                r["allocated_and_bound_s"] = (
                    round(max(done_alloc, done_pods) - start, 1) if done_alloc and done_pods else None
                )
                if self.with_operator:
                    done_status = await slices.wait(want, a.timeout)
                    r["status_allocated_s"] = round(done_status - start, 1) if done_status else None
                    missing = want - slices.at.keys()
                    if missing:
                        r["status_missing"] = len(missing)
            finally:
                sampler.cancel()
            lat = [status_watch.at[n] - created[n] for n in names if n in status_watch.at]
            r["burst_status_p50_s"], r["burst_status_p99_s"] = pct(lat, 0.5), pct(lat, 0.99)
            await asyncio.sleep(a.settle)
            metrics_after = parse_counter(await api.text("/metrics"), "apiserver_request_total")
            writes = api_writes(metrics_before, metrics_after)
            r["api_writes"] = sum(writes.values())
            r["api_writes_by_resource"] = writes
            r["slice_events"] = slices.events if self.with_operator else None
            if self.operator is not None:
                proc = Proc(self.operator.pid)
                r["operator_cpu_s"] = round(proc.cpu() - cpu_before, 1)
                self.sample_rss()
                r["operator_peak_rss_mib"] = round(self.peak_rss, 1)
                r["operator_rss_after_mib"] = round(proc.mem("VmRSS"), 1)
                after = self.operator_metrics()
                r["operator_writes"] = {k: int(v - op_before.get(k, 0)) for k, v in after.items()}
                r["operator_writes_total"] = sum(r["operator_writes"].values())
                if a.rest > 0:
                    r.update(await self.at_rest(proc, after, a.rest))
            if (self.args.tracemalloc or self.args.memstats) and self.operator is not None:
                self.operator.send_signal(signal.SIGUSR1)
                await asyncio.sleep(10)
            devices = await self._distinct_devices(api)
            r["distinct_devices"] = devices
            return r
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await api.close()

    async def at_rest(self, proc: Proc, writes_before: dict[str, float], seconds: float) -> dict[str, Any]:
        """After the burst settled: does the operator keep growing, working or writing while idle?"""
        rss_before, cpu_before = proc.mem("VmRSS"), proc.cpu()
        await asyncio.sleep(seconds)
        after = self.operator_metrics()
        return {
            "rest_s": seconds,
            "operator_rest_rss_growth_mib": round(proc.mem("VmRSS") - rss_before, 1),
            "operator_rest_cpu_pct": round(100 * (proc.cpu() - cpu_before) / seconds, 2),
            "operator_rest_writes": int(sum(after.values()) - sum(writes_before.values())),
            "operator_rest_writes_by_kind": {
                k: int(v - writes_before.get(k, 0)) for k, v in after.items() if v - writes_before.get(k, 0)
            },
        }

    async def _sample(self) -> None:
        while True:
            self.sample_rss()
            await asyncio.sleep(1)

    async def _distinct_devices(self, api: kubehttp.Client) -> bool:
        listing = await api.get(kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", namespace=TENANT))
        taken = []
        for cl in listing["items"]:
            allocation = (cl.get("status") or {}).get("allocation") or {}
            taken += [
                (res["pool"], res["device"]) for res in allocation.get("devices", {}).get("results", [])
            ]
        return len(taken) == len(set(taken)) == self.args.slices

    def stop(self) -> None:
        if getattr(self, "profiler", None) is not None:
            self.profiler.send_signal(signal.SIGINT)
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait()
        if getattr(self, "profiler", None) is not None:
            try:
                self.profiler.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.profiler.kill()
        if not self.args.keep:
            self.cluster.down()
            shutil.rmtree(self.dir, ignore_errors=True)


# --- report -----------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    gpus = args.nodes * args.gpus
    head = f"{args.slices} slices on {gpus} GPUs ({args.nodes} nodes), {args.noise_pods} noise pods"
    rows = [
        ("noise pods all Running, before the operator starts (s)", "noise_running_s"),
        ("claims allocated + pods bound (s)", "allocated_and_bound_s"),
        ("every GpuSlice status Allocated (s)", "status_allocated_s"),
        ("status p50 / p99, idle, single slice (s)", ("idle_status_p50_s", "idle_status_p99_s")),
        ("status p50 / p99, during the burst (s)", ("burst_status_p50_s", "burst_status_p99_s")),
        ("API writes during the burst", "api_writes"),
        ("operator writes (its own metric)", "operator_writes_total"),
        ("operator CPU during the burst (s)", "operator_cpu_s"),
        ("operator start-up to package reconciled (s)", "operator_startup_s"),
        ("operator RSS idle: 2 s after start-up / after the idle probes (MiB)",
         ("operator_idle_rss_mib", "operator_settled_rss_mib")),
        ("operator RSS peak / after the burst (MiB)", ("operator_peak_rss_mib", "operator_rss_after_mib")),
        ("at rest after the burst: RSS growth (MiB) / CPU (%) / writes",
         ("operator_rest_rss_growth_mib", "operator_rest_cpu_pct", "operator_rest_writes")),
        ("every device distinct", "distinct_devices"),
    ]  # fmt: skip
    names = [r["run"] for r in results]
    out = [head, "", "| measure | " + " | ".join(f"run {n}" for n in names) + " |"]
    out.append("|---" * (len(names) + 1) + "|")
    for label, key in rows:
        cells = []
        for r in results:
            keys = key if isinstance(key, tuple) else (key,)
            vals = [r.get(k) for k in keys]
            cells.append(" / ".join("—" if v is None else str(v) for v in vals))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    for r in results:
        top = list(r.get("api_writes_by_resource", {}).items())[:8]
        out.append(f"\nrun {r['run']} API writes: " + ", ".join(f"{k} {v}" for k, v in top))
        if r.get("operator_writes"):
            ours = ", ".join(f"{k} {v}" for k, v in r["operator_writes"].items() if v)
            out.append(f"run {r['run']} operator writes: {ours}")
    return "\n".join(out)


def summary(results: list[dict[str, Any]]) -> str:
    by = {r["run"]: r for r in results}
    a, b = by.get("A", {}), by.get("B", {})
    parts = []
    if a.get("allocated_and_bound_s") and b.get("status_allocated_s"):
        ratio = b["status_allocated_s"] / a["allocated_and_bound_s"]
        parts.append(
            f"B status / A allocation = {ratio:.2f}x "
            f"({b['status_allocated_s']} s / {a['allocated_and_bound_s']} s)"
        )
    if a.get("allocated_and_bound_s") and b.get("allocated_and_bound_s"):
        parts.append(f"B allocation / A = {b['allocated_and_bound_s'] / a['allocated_and_bound_s']:.2f}x")
    if b.get("operator_peak_rss_mib") is not None:
        parts.append(f"operator peak RSS {b['operator_peak_rss_mib']} MiB")
    return "; ".join(parts) or "no complete run"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=125)
    p.add_argument("--gpus", type=int, default=4, help="simulated V100s per node")
    p.add_argument("--slices", type=int, default=2000)
    p.add_argument("--noise-pods", type=int, default=0, help="unrelated pods in another namespace")
    p.add_argument("--runs", default="A,B", help="A (kube-scheduler alone), B (through the operator)")
    p.add_argument("--probes", type=int, default=10, help="single slices measured on the idle cluster")
    p.add_argument("--concurrency", type=int, default=32, help="create requests in flight")
    p.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the burst")
    p.add_argument("--settle", type=float, default=5, help="seconds after the burst before counting writes")
    p.add_argument("--rest", type=float, default=60,
                   help="seconds watched after that: operator RSS growth, CPU, writes at rest")  # fmt: skip
    p.add_argument("--operator-arg", action="append", default=[], help="extra `gpuslice operator` flag")
    p.add_argument("--profile", metavar="DIR", help="record the operator with py-spy (speedscope) into DIR")
    p.add_argument(
        "--tracemalloc", metavar="DIR", help="run the operator under tracemalloc; top sites into DIR"
    )
    p.add_argument("--memstats", metavar="DIR", help="after the burst, the operator's live objects into DIR")
    p.add_argument("--dir", type=Path, help="parent of the runs' devcluster dirs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="leave the clusters running")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    # The probes are deleted (and their devices freed) before the burst.
    if max(args.slices, args.probes) > args.nodes * args.gpus * (100 // FRACTION):
        print(f"error: {args.slices} slices do not fit on {args.nodes * args.gpus} GPUs", file=sys.stderr)
        return 2
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="gs-scale-"))
    results = []
    for mode in args.runs.split(","):
        run = Run(args, mode.strip().upper(), workdir)
        try:
            results.append(asyncio.run(run.measure()))
        finally:
            run.stop()
        log(f"{mode}: {json.dumps(results[-1]) if results else 'failed'}")
    report = {"nodes": args.nodes, "gpus": args.nodes * args.gpus, "slices": args.slices,
              "noise_pods": args.noise_pods, "runs": results, "summary": summary(results)}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(results, args))
        print()
        print(summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
