"""A real Prometheus (built from its Go module) scrapes the operator and the node agents the way the
shipped ServiceMonitor says, and the README's queries and every dashboard panel return what the
cluster holds.

What is real: Prometheus, its Kubernetes service discovery (role endpointslice) against the
devcluster's API server with a service account token bound by the monitoring component's
metrics-reader binding, the shipped Services, the operator and agent processes with their
TokenReview + SubjectAccessReview gate. What stands in for kube-controller-manager's pod
endpoints: the operator and the agents run as processes on this machine, not as pods, so the
Services' EndpointSlices are written by the test, pointing at this machine's address and each
process's port (named `metrics` as the Service's port is); target labels that come from a pod
(`pod`, `container`) are therefore absent here. tests/deploy runs them as pods on a real node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.agents import agent_dirs, agent_kubeconfig, install_agent_rbac, spawn_agent
from gpuslice_dev.devcluster import prometheus as prom
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from gpuslice_dev.gpusim import faults
from support import V100, apply, package_doc, pod_doc, remove_operator_policies, slice_doc, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "manifests/components/monitoring"
DASHBOARD = json.loads((MONITORING / "dashboard.json").read_text())
#: The ServiceMonitor says 30s; the module scrapes every 2 s so rates have samples within seconds.
#: Everything else in the scrape config is the ServiceMonitor's translation.
SCRAPE_INTERVAL = "2s"
NODES = 2
GPUS = 2
PRICE = "0.45"
TOKEN_LABEL = "gpuslice-test/monitoring"

#: Panels' queries that return nothing on this cluster, each with why; the test fails if one of
#: them starts returning series (shrink the list) or another one returns nothing.
#: Agents on kwok nodes prepare each allocated claim ahead of a kubelet (a usage region, memory used
#: 0), but no CUDA process runs in those slices, so the shim's own readings never come.
_NO_PROCESS = "no CUDA process runs in a kwok node's slice: the shim never writes this reading"
NOT_EXERCISED: dict[str, str] = {
    "Slice compute utilization [A]": _NO_PROCESS,
    "Throttled time [A]": _NO_PROCESS,
    "Refused allocations [A]": _NO_PROCESS,
    "Isolation violations (last hour) [A]": "needs a process that bypasses the shim (tests/node does)",
    # `> 0`: zero is filtered out; the series under the filter are checked to exist.
    "Software that cannot use its GPU, idle slices [A]": "every slice's software is compatible (0)",
    "Software that cannot use its GPU, idle slices [B]": "no slice has been idle for --idle-after (0)",
}


def _rules_without_for(work: Path) -> Path:
    """The PrometheusRule's groups with every `for` at 0: the expressions are the shipped ones, the
    waits are promtool's to test (tests/monitoring/test_alerts.py)."""
    (rule,) = _docs(MONITORING / "prometheusrule.yaml")
    groups = rule["spec"]["groups"]
    for group in groups:
        for r in group["rules"]:
            r.pop("for", None)
    path = work / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def _firing(w: World, alert: str, **labels: str) -> list[dict[str, Any]]:
    return [
        a
        for a in w.server.api("alerts")["alerts"]
        if a["labels"]["alertname"] == alert
        and a["state"] == "firing"
        and labels.items() <= a["labels"].items()
    ]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@dataclass
class World:
    cluster: DevCluster
    server: prom.PrometheusServer
    namespace: str
    token: str
    started: float
    agents: dict[str, Path]  # node -> its driver double's GPU description
    processes: dict[str, subprocess.Popen[bytes]]  # node -> its agent
    slices: list[str] = field(default_factory=list)

    @property
    def pkg(self) -> str:
        return f"pm{self.token}-8g"


def _start_operator(cluster: DevCluster, log: Path, port: int) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuslice", "operator", f"--kubeconfig={cluster.kubeconfig}",
             f"--metrics-port={port}"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
        )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def world(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    binaries = prom.ensure_prometheus()
    work = tmp_path_factory.mktemp("prometheus")
    token = "t" + uuid.uuid4().hex[:5]
    system_ns = cluster.create_namespace(f"gpuslice-system-{token}")
    monitoring_ns = cluster.create_namespace(f"monitoring-{token}")
    tenant_ns = cluster.create_namespace(f"tenant-{token}", {TOKEN_LABEL: token})
    # In-cluster identity: the monitoring component's metrics-reader binding, pointed at this
    # namespace's Prometheus account (as a user patches it), and the discovery role.
    (binding,) = _docs(MONITORING / "metrics-reader.yaml")
    (role,) = _docs(REPO / "manifests/base/metrics-reader.yaml")
    apply(cluster, [role, *prom.scraper_docs(binding, monitoring_ns, suffix=f"-{token}")])
    account = binding["subjects"][0]["name"]
    sa_token = cluster.kubectl(
        "create", "token", account, "-n", monitoring_ns, "--duration=2h"
    ).stdout.strip()
    token_file = work / "token"
    token_file.write_text(sa_token)
    token_file.chmod(0o600)
    ca = cluster.dir / "pki" / "ca.crt"
    creds = prom.Credentials(
        api_server=cluster.state().server,  # type: ignore[union-attr]
        api_ca_file=ca,
        api_token_file=token_file,
        files={prom.SERVICE_ACCOUNT_TOKEN: token_file, prom.SERVICE_ACCOUNT_CA: ca},
    )
    sm = prom.load_servicemonitor(MONITORING / "servicemonitor.yaml")
    # The namespace an overlay's `namespace:` would set: the module's own gpuslice-system.
    sm["metadata"]["namespace"] = system_ns
    sm["spec"]["namespaceSelector"]["matchNames"] = [system_ns]
    scrape = prom.scrape_configs(sm, creds)
    for s in scrape:
        s["scrape_interval"] = SCRAPE_INTERVAL
    # The shipped Services, in the module's namespace, and EndpointSlices naming the processes.
    services = {
        d["metadata"]["name"]: {**d, "metadata": {**d["metadata"], "namespace": system_ns}}
        for d in _docs(REPO / "manifests/base/operator/service.yaml")
        + _docs(REPO / "manifests/base/agent/service.yaml")
        if d["kind"] == "Service"
    }
    address = prom.host_address()

    cluster.apply_crds()
    op_port = free_port()
    operator = _start_operator(cluster, work / "operator.log", op_port)
    install_agent_rbac(cluster)
    nodes = cluster.nodes[:NODES]
    agents: dict[str, subprocess.Popen[bytes]] = {}
    configs: dict[str, Path] = {}
    state_root = work / "agents"
    endpoints = [
        prom.local_endpoint_slice(
            services["gpuslice-operator-metrics"], address, [(op_port, None)], "operator-local"
        )
    ]
    for node in nodes:
        port = free_port()
        agents[node] = spawn_agent(
            node, f"{GPUS}x {V100}", agent_kubeconfig(cluster, node, install=False), state_root,
            work / f"agent-{node}.log", metrics_port=port,
        )  # fmt: skip
        configs[node] = agent_dirs(state_root, node)["state"] / "simulated" / "fake-gpus.conf"
        endpoints.append(
            prom.local_endpoint_slice(
                services["gpuslice-agent-metrics"], address, [(port, node)], f"agent-{node}"
            )
        )
    apply(cluster, [*services.values(), *endpoints])
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "1s"},
        "scrape_configs": scrape,
    }
    rules = _rules_without_for(work)
    server = prom.start_prometheus(
        binaries.prometheus, config, work / "prom", free_port(), rule_files=[rules]
    )
    w = World(cluster, server, tenant_ns, token, time.time(), configs, agents)
    try:
        pkg = package_doc(w.pkg, 25, {TOKEN_LABEL: token}, slices=4, labels={TOKEN_LABEL: "true"})
        pkg["spec"]["price"] = {"perHour": PRICE, "currency": "EUR"}
        apply(cluster, [pkg])
        w.slices = ["a", "b", "c"]
        apply(cluster, [slice_doc(n, tenant_ns, w.pkg) for n in w.slices])
        wait_for(
            lambda: all(_get(cluster, "resourceclaim", n, "-n", tenant_ns) for n in w.slices), 60, "claims"
        )
        kwok = {"type": "kwok"}
        pause = "registry.k8s.io/pause:3.10"
        pods = [
            pod_doc(f"p{n}", tenant_ns, n, cpu=None, memory="1Gi", image=pause, node_selector=kwok)
            for n in w.slices
        ]
        apply(cluster, pods)
        for n in w.slices:
            wait_for(
                lambda n=n: (
                    (_get(cluster, "resourceclaim", n, "-n", tenant_ns) or {}).get("status") or {}
                ).get("allocation"),
                90,
                f"claim {n} allocated",
            )
        allocated = time.time()
        # From here the ledger and Prometheus look at the same span: every slice billed and scraped.
        sel = f'gpuslice_slice_allocated{{namespace="{tenant_ns}"}}'
        wait_for(lambda: len(server.query(sel)) == len(w.slices), 60, "every slice's series")
        print(
            f"\n[prometheus] allocation to gpuslice_slice_allocated scraped: {time.time() - allocated:.1f} s"
        )
        w.started = time.time()
        yield w
    finally:
        cluster.kubectl(
            "delete", "gpuslices.gpuslice.io", "-n", tenant_ns, "--all", "--wait=false", check=False
        )
        cluster.kubectl("delete", "gpupackages.gpuslice.io", w.pkg, "--timeout=60s", check=False)
        server.stop()
        for proc in agents.values():
            _stop(proc)
        _stop(operator)
        remove_operator_policies(cluster)
        for ns in (tenant_ns, system_ns, monitoring_ns):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding", f"{binding['metadata']['name']}-{token}",
                        f"prometheus-discovery-{token}", check=False)  # fmt: skip
        cluster.kubectl("delete", "clusterrole", f"prometheus-discovery-{token}", check=False)


def _get(cluster: DevCluster, *args: str) -> Any:
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _all_up(w: World) -> list[dict[str, Any]]:
    """The active targets once the operator's and every agent's are up; fails with their errors."""
    last: list[dict[str, Any]] = []

    def up() -> list[dict[str, Any]] | None:
        last[:] = w.server.targets()
        healthy = [t for t in last if t["health"] == "up"]
        return last if len(healthy) == len(last) == 1 + NODES else None

    try:
        return wait_for(up, 60, "targets up")
    except AssertionError:
        raise AssertionError(
            "targets: " + json.dumps([(t["scrapeUrl"], t["health"], t["lastError"]) for t in last], indent=1)
        ) from None


def test_prometheus_finds_and_scrapes_the_operator_and_every_agent_with_its_token(world: World) -> None:
    targets = _all_up(world)
    jobs = sorted(t["labels"]["job"] for t in targets)
    # jobLabel app.kubernetes.io/component names the job, as the Prometheus Operator makes it.
    assert jobs == ["agent"] * NODES + ["operator"], targets
    assert {t["labels"]["endpoint"] for t in targets} == {"metrics"}
    assert all(t["scrapeUrl"].endswith("/metrics") for t in targets)
    assert {t["labels"]["service"] for t in targets} == {
        "gpuslice-operator-metrics",
        "gpuslice-agent-metrics",
    }
    # Scrape cost as Prometheus measures it (3 slices on 2 agents of 2 cards; bench/ has 2,000).
    for name in ("scrape_samples_scraped", "scrape_duration_seconds"):
        for r in world.server.query(name):
            m = r["metric"]
            print(f"\n[prometheus] {name} {m['job']} {m['instance']}: {r['value'][1]}")


def _top(w: World, *args: str) -> Any:
    """`gpuslice top` as a user runs it, with the cluster's admin kubeconfig."""
    out = subprocess.run(
        [sys.executable, "-m", "gpuslice", "top", f"--kubeconfig={w.cluster.kubeconfig}", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    )  # fmt: skip
    return json.loads(out.stdout) if "json" in args else out.stdout


def _claim_devices(w: World) -> dict[str, tuple[str, str]]:
    """slice -> (pool, device) kube-scheduler allocated to its claim."""
    out = {}
    for n in w.slices:
        (result,) = _get(w.cluster, "resourceclaim", n, "-n", w.namespace)["status"]["allocation"]["devices"][
            "results"
        ]
        out[n] = (result["pool"], result["device"])
    return out


def test_gpuslice_top_puts_each_slice_on_its_card_with_memory_usage_and_the_entitlement(world: World) -> None:
    w = world
    _all_up(w)
    view = _top(w, "-n", w.namespace, "-o", "json")
    claims = _claim_devices(w)
    rows = {r["slice"]: r for r in view["slices"]}
    assert sorted(rows) == sorted(w.slices)
    # Where kube-scheduler put each claim: the card whose published device it was.
    published = {
        (s["spec"]["pool"]["name"], d["name"]): d["attributes"]["uuid"]["string"]
        for s in _get(w.cluster, "resourceslices")["items"]
        if s["spec"]["driver"] == "gpuslice.io"
        for d in s["spec"].get("devices") or []
    }
    for n, (pool, device) in claims.items():
        assert (rows[n]["node"], rows[n]["gpu_uuid"]) == (pool, published[(pool, device)]), rows[n]
        assert rows[n]["memory_limit_bytes"] == 8 * 1024**3  # 25 % of a 32 GiB V100
    cards = [k for k in view["cards"] if k["node"] in w.agents]
    assert len(cards) == NODES * GPUS
    assert {(k["model"], k["memory_total_bytes"], k["healthy"]) for k in cards} == {
        (V100, 32 * 1024**3, True)
    }
    assert sum(k["slices"] for k in cards) == len(w.slices)
    assert sum(k["memory_held_bytes"] for k in cards) == len(w.slices) * 8 * 1024**3
    (ns,) = [r for r in view["namespaces"] if r["package"] == w.pkg]
    assert (ns["held"], ns["entitled"], sum(ns["phases"].values())) == (len(w.slices), 4, len(w.slices))

    def package() -> Any:
        rows = [p for p in _top(w, "-n", w.namespace, "-o", "json")["packages"] if p["package"] == w.pkg]
        return rows if rows and rows[0]["allocated"] == len(w.slices) else None

    (pkg,) = wait_for(package, 60, "the package's capacity in gpuslice top")
    assert (pkg["gpus"], pkg["total"], pkg["free"]) == (
        NODES * GPUS,
        NODES * GPUS * 4,
        NODES * GPUS * 4 - len(w.slices),
    )

    # From Prometheus: each slice's memory used is the agents' series, joined by its labels.
    used = f'gpuslice_slice_memory_used_bytes{{namespace="{w.namespace}"}}'
    wait_for(lambda: len(w.server.query(used)) == len(w.slices), 60, "every slice's memory used")
    scraped = {r["metric"]["slice"]: int(float(r["value"][1])) for r in w.server.query(used)}
    view = _top(w, "-n", w.namespace, "-o", "json", "--prometheus", w.server.url)
    rows = {r["slice"]: r for r in view["slices"]}
    assert {n: (r["source"], r["memory_used_bytes"]) for n, r in rows.items()} == {
        n: ("metrics", v) for n, v in scraped.items()
    }

    table = _top(w, "-n", w.namespace)
    assert table.splitlines()[0].split()[:3] == ["NODE", "GPU", "MODEL"]
    for n in w.slices:
        assert any(line.split()[:3] == [w.namespace, n, w.pkg] for line in table.splitlines()), table
    # --watch redraws: piped, one frame after another
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuslice", "top", f"--kubeconfig={w.cluster.kubeconfig}", "-n", w.namespace,
         "-o", "json", "--watch", "--interval", "0.5"],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        time.sleep(5)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    frames = [json.loads(f) for f in out.split("\n\n") if f.strip()]
    assert len(frames) >= 2 and all(len(f["slices"]) == len(w.slices) for f in frames), out[-500:]


def test_gpuslice_top_as_a_tenant_shows_its_slices_and_entitlement_and_says_why_no_cards(
    world: World,
) -> None:
    w = world
    group = f"team-{w.token}"
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "gpu-tenant", "namespace": w.namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "gpuslice-tenant",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}],
    }
    apply(w.cluster, [*_docs(REPO / "manifests/base/tenant/rbac.yaml"), binding])
    tenant = w.cluster.tenant_kubeconfig(f"user-{w.token}", [group])
    argv = [
        sys.executable,
        "-m",
        "gpuslice",
        "top",
        f"--kubeconfig={tenant}",
        "-n",
        w.namespace,
        "-o",
        "json",
    ]

    def as_tenant() -> Any:
        # the aggregated role's rules are filled in by kube-controller-manager a moment after the apply
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    view = wait_for(as_tenant, 30, "the tenant may run gpuslice top")
    assert view["cards"] is None
    assert any("ResourceSlices not readable" in n for n in view["notes"])
    assert sorted(r["slice"] for r in view["slices"]) == sorted(w.slices)
    assert all(r["node"] in w.agents and r["gpu_uuid"] for r in view["slices"]), view["slices"]
    (ns,) = [r for r in view["namespaces"] if r["package"] == w.pkg]
    assert (ns["held"], ns["entitled"]) == (len(w.slices), 4)
    # another namespace: refused by the API server, said plainly
    other = subprocess.run(
        [*argv[:-4], "-n", "default"], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert other.returncode == 2, other
    assert other.stderr.startswith("gpuslice top: cannot list GpuSlices in namespace default:"), other.stderr


def _past_a_minute_boundary(world: World) -> None:
    """Slice-hours sample once a minute, at whole minutes (a subquery's steps are aligned): wait
    until one has passed since the slices were allocated and scraped, so the estimate has a sample."""
    boundary = (int(world.started + 4) // 60 + 1) * 60
    time.sleep(max(0.0, boundary + 3 - time.time()))


def _substitute(expr: str, span: float) -> str:
    return (
        expr.replace("$__rate_interval", "30s")
        .replace("$__range", f"{max(int(span), 60)}s")
        .replace("$node", ".*")
        .replace("$namespace", ".*")
        .replace("$package", ".*")
    )


def test_gpu_health_and_xids_follow_an_xid_79_on_a_card(world: World) -> None:
    node, config = next(iter(world.agents.items()))
    q = f'gpuslice_gpu_healthy{{node="{node}", gpu_index="1"}}'
    assert [r["value"][1] for r in wait_for(lambda: world.server.query(q), 30, "card health")] == ["1"]
    assert not _firing(world, "GpuSliceGpuUnhealthy")
    faulted = time.monotonic()
    faults.inject(config, "1", xid=79)
    wait_for(lambda: [r for r in world.server.query(q) if r["value"][1] == "0"], 60, "card 1 unhealthy")
    try:
        wait_for(lambda: _firing(world, "GpuSliceGpuUnhealthy", node=node, gpu_index="1"), 30, "alert firing")
    except AssertionError:
        raise AssertionError(json.dumps(world.server.api("rules"), indent=1)[:3000]) from None
    print(f"\n[alerts] XID 79 to GpuSliceGpuUnhealthy firing (for: 0): {time.monotonic() - faulted:.1f} s")

    # `gpuslice top` shows the card unhealthy from the API alone (the agent's device taints).
    def unhealthy_in_top() -> list[dict[str, Any]]:
        return [
            k
            for k in _top(world, "-n", world.namespace, "-o", "json")["cards"]
            if k["node"] == node and not k["healthy"]
        ]

    (card,) = wait_for(unhealthy_in_top, 30, "the card unhealthy in gpuslice top")
    assert card["gpu_uuid"] == next(r["metric"]["gpu_uuid"] for r in world.server.query(q))
    xid = f'sum(increase(gpuslice_gpu_xid_total{{node="{node}", xid="79"}}[5m]))'
    wait_for(lambda: world.server.query(xid), 30, "XID 79 counted")
    faults.inject(config, "1", clear=True)
    wait_for(lambda: not _firing(world, "GpuSliceGpuUnhealthy"), 60, "alert resolved after the card is reset")


def test_every_dashboard_panel_returns_series(world: World) -> None:
    _all_up(world)
    _past_a_minute_boundary(world)
    span = time.time() - world.started
    empty: dict[str, str] = {}
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = _substitute(target["expr"], span)
            if not world.server.query(expr):
                empty[f"{panel['title']} [{target.get('refId')}]"] = expr
                if expr.endswith(" > 0"):
                    assert world.server.query(expr.removesuffix(" > 0")), f"no series under {expr}"
    assert empty.keys() == NOT_EXERCISED.keys(), json.dumps(empty, indent=1)


def test_template_variables_list_the_clusters_values(world: World) -> None:
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"]).groups()  # type: ignore[union-attr]
        values = world.server.api(f"label/{label}/values", **{"match[]": metric})
        assert values, f"variable {var['name']}: no values"
    nodes = world.server.api("label/node/values", **{"match[]": "gpuslice_gpu_memory_total_bytes"})
    assert set(world.agents) <= set(nodes)
    namespaces = world.server.api("label/namespace/values", **{"match[]": "gpuslice_slice_allocated"})
    assert world.namespace in namespaces  # honorLabels kept the tenant's namespace


def _gpuslice_usage(cluster: DevCluster, namespace: str, since: float, until: float) -> dict[str, Any]:
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    out = subprocess.run(
        [sys.executable, "-m", "gpuslice", "usage", f"--kubeconfig={cluster.kubeconfig}", "-n", namespace,
         "--since", time.strftime(fmt, time.gmtime(since)), "--until", time.strftime(fmt, time.gmtime(until)),
         "-o", "json"],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _readme_queries() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", text, flags=re.S)
    queries: list[str] = []
    for block in blocks:
        current: list[str] = []
        for line in block.splitlines():
            if line.startswith("#"):
                if current:
                    queries.append(" ".join(current))
                current = []
            elif line.strip():
                current.append(line.strip())
        if current:
            queries.append(" ".join(current))
    return queries


def test_readme_slice_hours_and_cost_agree_with_the_ledger_within_a_minutes_sampling(world: World) -> None:
    queries = _readme_queries()
    assert len(queries) >= 2, queries
    _past_a_minute_boundary(world)
    now = time.time()
    span = now - world.started
    ledger = _gpuslice_usage(world.cluster, world.namespace, world.started, now)
    (row,) = [u for u in ledger["usage"] if u["package"] == world.pkg]
    by_query = {}
    for q in queries:
        expr = q.replace("$__range", f"{int(span)}s").replace("30d", f"{int(span)}s")
        result = world.server.query(expr, time=now)
        assert result, f"README query returns nothing: {q}"
        (series,) = [r for r in result if r["metric"].get("namespace") == world.namespace]
        by_query[q] = (series["metric"], float(series["value"][1]))
    # Every README query returned the tenant's series (above); the two metering ones are checked
    # against the ledger by what they compute.
    (hours_metric, hours), (cost_metric, cost) = (
        next(v for q, v in by_query.items() if "price_per_hour" not in q and "slice_allocated" in q),
        next(v for q, v in by_query.items() if "price_per_hour" in q),
    )
    assert hours_metric["package"] == world.pkg
    # Minute sampling: each slice counts whole minutes, so within a minute per slice of the ledger.
    slices = len(world.slices)
    assert abs(hours * 3600 - float(row["sliceSeconds"])) <= 60 * slices, (hours, row)
    assert cost_metric["currency"] == "EUR" == row["currency"]
    assert abs(cost - hours * float(PRICE)) < 1e-9
    # The same query at the scrape's resolution agrees much closer: it is the sampling, not the series.
    fine = world.server.query(
        "sum by (namespace, package) (sum_over_time("
        f"gpuslice_slice_allocated{{namespace='{world.namespace}'}}[{int(span)}s:1s]))",
        time=now,
    )
    fine_seconds = float(fine[0]["value"][1])
    assert abs(fine_seconds - float(row["sliceSeconds"])) <= 2 * 2 * slices + 2, (fine_seconds, row)


def test_a_deleted_slices_series_go_at_the_next_scrape(world: World) -> None:
    # A stale marker at the next scrape, not five minutes of lookback.
    gone = world.slices.pop()
    sel = f'gpuslice_slice_allocated{{namespace="{world.namespace}", slice="{gone}"}}'
    assert world.server.query(sel)
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", gone, "-n", world.namespace, "--wait=false")
    world.cluster.kubectl("delete", "pod", f"p{gone}", "-n", world.namespace, "--grace-period=0", "--force")
    wait_for(lambda: not world.server.query(sel), 60, f"{gone}'s series gone")


def test_an_agent_killed_fires_agent_down(world: World) -> None:
    node = next(iter(world.agents))
    assert not _firing(world, "GpuSliceAgentDown")
    killed = time.monotonic()
    world.processes[node].kill()
    wait_for(lambda: _firing(world, "GpuSliceAgentDown", job="agent"), 60, "GpuSliceAgentDown firing")
    print(f"\n[alerts] agent SIGKILL to GpuSliceAgentDown firing (for: 0): {time.monotonic() - killed:.1f} s")
    (up,) = [t for t in world.server.targets() if t["health"] == "down"]
    assert up["labels"]["job"] == "agent"


def test_a_namespace_holding_its_whole_entitlement_fires_near_entitlement_and_resolves(world: World) -> None:
    w, ns = world, world.namespace
    entitled = f'gpuslice_namespace_entitled_slices{{namespace="{ns}", package="{w.pkg}"}}'
    held = f'gpuslice_namespace_held_slices{{namespace="{ns}", package="{w.pkg}"}}'

    def values() -> tuple[float, float] | None:
        e, h = w.server.query(entitled), w.server.query(held)
        return (float(e[0]["value"][1]), float(h[0]["value"][1])) if e and h else None

    before = len(w.slices)
    wait_for(lambda: values() == (4, before), 60, f"entitled 4, held {before}")
    assert not _firing(w, "GpuSliceNamespaceNearEntitlement", namespace=ns)
    extra = [f"x{i}" for i in range(4 - before)]
    apply(w.cluster, [slice_doc(n, ns, w.pkg) for n in extra])
    created = time.monotonic()
    try:
        wait_for(
            lambda: _firing(w, "GpuSliceNamespaceNearEntitlement", namespace=ns, package=w.pkg),
            60,
            "GpuSliceNamespaceNearEntitlement firing",
        )
        print(
            "\n[alerts] the entitlement's last slice created to GpuSliceNamespaceNearEntitlement firing"
            f" (for: 0): {time.monotonic() - created:.1f} s"
        )
        assert values() == (4, 4)
    finally:
        w.cluster.kubectl("delete", "gpuslices.gpuslice.io", *extra, "-n", ns, "--wait=false")
    wait_for(lambda: values() == (4, before), 60, f"held back to {before}")
    wait_for(lambda: not _firing(w, "GpuSliceNamespaceNearEntitlement", namespace=ns), 30, "resolved")
