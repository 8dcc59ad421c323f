"""A real Kubernetes control plane as local processes on 127.0.0.1: no Docker.

etcd -> kube-apiserver -> (kube-controller-manager, kube-scheduler, kwok). kwok keeps fake nodes
Ready and plays the kubelet's pod lifecycle, so quota, DRA allocation, the resourceclaim controller
and garbage collection all run for real. State (ports, pids) lives in `<dir>/state.json`, so
`up`, `status` and `down` work from any shell. Real nodes (kubelet + containerd) are added by
`realnode`; processes run under `supervisor`, with the flags in `components`; `kubectl` is the client.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gpuslice.files import atomic_write
from gpuslice_dev.devcluster import components, pki
from gpuslice_dev.devcluster.binaries import FEATURE_GATES_ENV, Binaries, ensure_binaries, kubernetes_release
from gpuslice_dev.devcluster.components import CORE_COMPONENTS, FEATURE_GATES, feature_gates, node_manifest
from gpuslice_dev.devcluster.kubectl import KubectlClient
from gpuslice_dev.devcluster.supervisor import (
    DevClusterError,
    ProcessRecord,
    client_ssl,
    free_port,
    http_ok,
    insecure_ssl,
    spawn,
    stop,
)

__all__ = [
    "CORE_COMPONENTS",
    "FEATURE_GATES",
    "DevCluster",
    "DevClusterError",
    "State",
    "free_port",
    "node_manifest",
]

Progress = Callable[[str], None]


def default_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuslice" / "devcluster"


@dataclass
class State:
    dir: str
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    #: nodes run by a real kubelet + containerd on this machine (see gpuslice_dev.devcluster.realnode)
    real_nodes: list[str] = field(default_factory=list)
    node_slots: dict[str, int] = field(default_factory=dict)
    #: the Kubernetes release (v1.X.Y) it runs and the --feature-gates of its components
    kubernetes: str = ""
    feature_gates: str = ""

    @property
    def kubeconfig(self) -> Path:
        return Path(self.dir) / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    def save(self) -> None:
        atomic_write(Path(self.dir) / "state.json", json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: Path) -> State | None:
        path = directory / "state.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        procs = {k: ProcessRecord(**v) for k, v in raw.pop("processes", {}).items()}
        return cls(processes=procs, **raw)


class DevCluster(KubectlClient):
    """Start, inspect and stop the local control plane rooted at `directory`."""

    def __init__(
        self,
        directory: Path | None = None,
        progress: Progress | None = None,
        apiserver_feature_gates: str | None = None,
        *,
        kubernetes: str | None = None,
        extra_feature_gates: str = "",
        emulated_version: str = "",
    ) -> None:
        """kubernetes: the minor ("1.36"; None: the one a running cluster in `directory` runs, else
        $GPUSLICE_KUBERNETES, else the default). extra_feature_gates ("Gate=false,..."): on top of the
        minor's set (components.FEATURE_GATES_BY_MINOR) and $GPUSLICE_FEATURE_GATES, for every
        component and kubelet. emulated_version ("1.34"): kube-apiserver emulates that older minor,
        with that minor's default gates (an alpha gate cannot be turned on under emulation)."""
        self.dir = (directory or default_dir()).resolve()
        self.progress: Progress = progress or (lambda _msg: None)
        recorded = self.state()
        running = recorded is not None and any(r.alive() for r in recorded.processes.values())
        if kubernetes is None and recorded is not None and recorded.kubernetes and running:
            self.kubernetes = recorded.kubernetes
            self.feature_gates = recorded.feature_gates
        else:
            self.kubernetes = kubernetes_release(kubernetes)
            extra = ",".join(filter(None, (os.environ.get(FEATURE_GATES_ENV, ""), extra_feature_gates)))
            self.feature_gates = feature_gates(self.kubernetes, extra)
        #: kube-apiserver's --feature-gates (tests start one with the DRA gates off to see fields dropped).
        self.emulated_version = emulated_version
        default_gates = "" if emulated_version else self.feature_gates
        self.apiserver_feature_gates = apiserver_feature_gates or default_gates
        self._bins: Binaries | None = None

    # --- public API -------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def bins(self) -> Binaries:
        if self._bins is None:
            self._bins = ensure_binaries(self.progress, self.kubernetes)
        return self._bins

    def state(self) -> State | None:
        return State.load(self.dir)

    def status(self) -> dict[str, bool]:
        """Which components (and agents) run, by name."""
        st = self.state()
        if st is None:
            return {}
        return {name: rec.alive() for name, rec in st.processes.items()}

    def up(self, nodes: int = 1, *, fresh: bool = False, crds: bool = True) -> State:
        """Start (or find running) the control plane with at least `nodes` kwok nodes.

        fresh: stop whatever runs in the directory and start from an empty etcd.
        crds: apply gpuslice's CRDs before kube-controller-manager starts, as on a cluster where
        gpuslice is installed already. Its quota controller then counts GpuSlices from the start; a
        CRD applied later is discovered within 30 s, and until then a tenant's GpuSlice-count quota
        is not counted and refuses GpuSlice creates (the operator asks a re-count; False: that case).
        """
        if nodes < 0:
            raise DevClusterError("--nodes must be 0 or more")
        if fresh:
            self.wipe()
        st = self.state()
        if st is not None:
            alive = {n: r.alive() for n, r in st.processes.items() if n in CORE_COMPONENTS}
            if alive and all(alive.values()) and len(alive) == len(CORE_COMPONENTS):
                if st.kubernetes and st.kubernetes != self.kubernetes:
                    raise DevClusterError(
                        f"the devcluster in {self.dir} runs Kubernetes {st.kubernetes}, "
                        f"not {self.kubernetes}: stop it first (or use another --dir)"
                    )
                self.progress(f"control plane already running in {self.dir}; ensuring {nodes} node(s)")
                self._ensure_nodes(st, nodes)
                return st
            if any(alive.values()):
                self.progress("found a partly running control plane; stopping it before starting again")
                self.down()
        bins = self.bins
        started = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        st = State(dir=str(self.dir), kubernetes=self.kubernetes, feature_gates=self.feature_gates)
        st.save()
        self.progress(f"Kubernetes {self.kubernetes}, feature gates: {self.feature_gates or 'its defaults'}")
        try:
            self._start_etcd(st, bins)
            self._start_apiserver(st, bins)
            self._write_kubeconfigs(st)
            if crds:
                self.apply_crds()
            self._start_controllers(st, bins)
            self._ensure_nodes(st, nodes)
            self.wait_default_service_account("default")
        except BaseException:
            self.progress(f"start failed; logs are in {self.dir / 'logs'}")
            self.down()
            raise
        self.progress(f"control plane up in {time.monotonic() - started:.1f}s")
        return st

    def wipe(self) -> None:
        """Stop everything and delete the cluster's data (etcd, agents' and containers' files)."""
        self.down()
        for sub in ("etcd", "agents", "containers", "nodes"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)

    def down(self) -> list[str]:
        """Stop every process this cluster started; returns the names stopped."""
        st = self.state()
        if st is None:
            return []
        stopped: list[str] = []
        if st.real_nodes:
            # kubelet, pods, containerd, mounts and network of real nodes go in their own order.
            from gpuslice_dev.devcluster import realnode

            stopped += realnode.stop_all(self, st)
        # Agents and extras first, then the core in reverse start order.
        order = [n for n in st.processes if n not in CORE_COMPONENTS]
        order += [n for n in reversed(CORE_COMPONENTS) if n in st.processes]
        for name in order:
            rec = st.processes[name]
            if stop(rec):
                stopped.append(name)
        st.processes = {}
        st.save()
        return stopped

    def stop_processes(self, which: Callable[[str], bool]) -> list[str]:
        """Stop the recorded extra processes whose name `which` accepts; returns the names stopped."""
        st = self.state()
        if st is None:
            return []
        chosen = {n for n in st.processes if which(n) and n not in CORE_COMPONENTS}
        stopped = [n for n in sorted(chosen) if stop(st.processes[n])]
        st = self.state() or st  # re-read: another process may have registered meanwhile
        st.processes = {n: r for n, r in st.processes.items() if n not in chosen}
        st.save()
        return stopped

    def start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ProcessRecord:
        """Start an extra process (e.g. the operator) logged and recorded like a component, so
        `status` shows it and `down` stops it."""
        return self._spawn(self._require_state(), name, argv, env)

    def tenant_kubeconfig(self, user: str, groups: Sequence[str] = ("gpuslice:tenants",)) -> Path:
        """Kubeconfig for a non-admin client-certificate user (CN=user, O=groups) — real RBAC applies."""
        st = self._require_state()
        ca = pki.LocalCA(self.dir / "pki")
        stem = "user-" + "-".join([user, *groups]).replace(":", "_").replace("/", "_")
        pair = ca.issue(stem, user, groups)
        return pki.write_kubeconfig(
            self.dir / "users" / f"{stem}.kubeconfig", st.server, ca.cert_path, pair, user
        )

    @property
    def nodes(self) -> list[str]:
        st = self.state()
        return list(st.nodes) if st else []

    # --- internals --------------------------------------------------------------------------------
    def _require_state(self) -> State:
        st = self.state()
        if st is None or "kube-apiserver" not in st.ports:
            raise DevClusterError(f"no devcluster in {self.dir}; run `gpuslice-dev devcluster up` first")
        return st

    def _spawn(
        self, st: State, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> ProcessRecord:
        rec = spawn(self.dir / "logs" / f"{name.replace('/', '-')}.log", argv, env)
        st.processes[name] = rec
        st.save()
        return rec

    def _start_with_port_retry(
        self, st: State, name: str, build: Callable[[], list[str]], ready: Callable[[], bool], timeout: float
    ) -> None:
        # Ports are picked free just before start; if another process grabs one in between, the
        # component dies with "address already in use" and is started again on new ports.
        for attempt in range(3):
            argv = build()
            rec = self._spawn(st, name, argv)
            self.progress(f"starting {name} (pid {rec.pid}) ...")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not rec.alive():
                    break
                if ready():
                    return
                time.sleep(0.2)
            log_text = Path(rec.log).read_text(errors="replace")[-4000:]
            if not rec.alive() and "address already in use" in log_text and attempt < 2:
                self.progress(f"{name}: a port was taken, retrying on another port")
                continue
            stop(rec)
            raise DevClusterError(
                f"{name} did not become ready in {timeout:.0f}s; log: {rec.log}\n{log_text[-1500:]}"
            )

    def _start_etcd(self, st: State, bins: Binaries) -> None:
        def argv() -> list[str]:
            st.ports["etcd"], st.ports["etcd-peer"] = free_port(), free_port()
            return components.etcd_argv(bins, self.dir / "etcd", st.ports["etcd"], st.ports["etcd-peer"])

        def ready() -> bool:
            return http_ok(f"http://127.0.0.1:{st.ports['etcd']}/health")

        self._start_with_port_retry(st, "etcd", argv, ready, 60)

    def _start_apiserver(self, st: State, bins: Binaries) -> None:
        pkidir = self.dir / "pki"
        ca = pki.LocalCA(pkidir)
        serving = ca.issue(
            "apiserver", "kube-apiserver", server=True, hosts=["127.0.0.1", "localhost", "kubernetes"]
        )
        admin = ca.issue("admin", "devcluster-admin", ["system:masters"])
        ctx = client_ssl(ca.cert_path, admin)
        kubelet_client = ca.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]
        )

        def argv() -> list[str]:
            st.ports["kube-apiserver"] = free_port()
            return components.apiserver_argv(
                bins,
                etcd_port=st.ports["etcd"],
                port=st.ports["kube-apiserver"],
                pki_dir=pkidir,
                serving=serving,
                service_accounts=pki.service_account_keys(pkidir),
                kubelet_client=kubelet_client,
                feature_gates=self.apiserver_feature_gates,
                emulated_version=self.emulated_version,
            )

        def ready() -> bool:
            return http_ok(f"https://127.0.0.1:{st.ports['kube-apiserver']}/readyz", ctx)

        self._start_with_port_retry(st, "kube-apiserver", argv, ready, 120)

    def _write_kubeconfigs(self, st: State) -> None:
        ca = pki.LocalCA(self.dir / "pki")
        admin = ca.issue("admin", "devcluster-admin", ["system:masters"])
        pki.write_kubeconfig(self.kubeconfig, st.server, ca.cert_path, admin, "devcluster-admin")
        for stem, user in (
            ("kube-controller-manager", "system:kube-controller-manager"),
            ("kube-scheduler", "system:kube-scheduler"),
            # kwok writes node and pod status the way kubelets do; it runs as an admin here.
            ("kwok", "kwok-controller"),
        ):
            orgs = ["system:masters"] if stem == "kwok" else []
            pair = ca.issue(stem, user, orgs)
            pki.write_kubeconfig(
                self.dir / "components" / f"{stem}.kubeconfig", st.server, ca.cert_path, pair, user
            )

    def _start_controllers(self, st: State, bins: Binaries) -> None:
        comp = self.dir / "components"
        pkidir = self.dir / "pki"

        def kcm() -> list[str]:
            st.ports["kube-controller-manager"] = free_port()
            return components.controller_manager_argv(
                bins,
                kubeconfig=comp / "kube-controller-manager.kubeconfig",
                port=st.ports["kube-controller-manager"],
                pki_dir=pkidir,
                service_account_key=pki.service_account_keys(pkidir).key,
                gates=self.feature_gates,
            )

        def scheduler() -> list[str]:
            st.ports["kube-scheduler"] = free_port()
            return components.scheduler_argv(
                bins,
                kubeconfig=comp / "kube-scheduler.kubeconfig",
                port=st.ports["kube-scheduler"],
                pki_dir=pkidir,
                gates=self.feature_gates,
            )

        def kwok() -> list[str]:
            st.ports["kwok"] = free_port()
            stages = comp / "kwok-stages.yaml"
            stages.write_text(components.kwok_stages(bins.kwok_stages.read_text()))
            return components.kwok_argv(
                bins, kubeconfig=comp / "kwok.kubeconfig", port=st.ports["kwok"], stages=stages
            )

        def healthz(name: str) -> Callable[[], bool]:
            return lambda: http_ok(f"https://127.0.0.1:{st.ports[name]}/healthz", insecure_ssl())

        self._start_with_port_retry(
            st, "kube-controller-manager", kcm, healthz("kube-controller-manager"), 90
        )
        self._start_with_port_retry(st, "kube-scheduler", scheduler, healthz("kube-scheduler"), 90)
        self._start_with_port_retry(
            st, "kwok", kwok, lambda: http_ok(f"http://127.0.0.1:{st.ports['kwok']}/healthz"), 60
        )

    def _ensure_nodes(self, st: State, count: int) -> None:
        names = [f"kwok-node-{i}" for i in range(count)]
        if names:
            self.apply(yaml.safe_dump_all([node_manifest(n) for n in names]))
            # kwok marks nodes Ready one after another (about 5 a second here): the wait grows with them.
            timeout = 60 + len(names) // 2
            nodes = [f"node/{n}" for n in names]
            self.kubectl("wait", "--for=condition=Ready", f"--timeout={timeout}s", *nodes)
        st.nodes = sorted(set(st.nodes) | set(names), key=lambda n: int(n.rsplit("-", 1)[1]))
        st.save()
        self.progress(f"{len(st.nodes)} kwok node(s) Ready")
