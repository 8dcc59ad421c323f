"""A real Kubernetes control plane as local processes on 127.0.0.1: no Docker, no kubelet.

etcd -> kube-apiserver -> (kube-controller-manager, kube-scheduler, kwok). kwok keeps fake nodes
Ready and plays the kubelet's pod lifecycle, so quota, DRA allocation, the resourceclaim controller
and garbage collection all run for real. State (ports, pids) lives in `<dir>/state.json`, so
`up`, `status` and `down` work from any shell.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gpuslice import procfs
from gpuslice.dev.devcluster import pki
from gpuslice.dev.devcluster.binaries import Binaries, ensure_binaries
from gpuslice.files import atomic_write

Progress = Callable[[str], None]

#: Order matters: started in this order, stopped in reverse.
CORE_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
FEATURE_GATES = "DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true"
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


class DevClusterError(RuntimeError):
    pass


def default_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuslice" / "devcluster"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ProcessRecord:
    pid: int
    start_time: int
    log: str
    argv: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        stat = procfs.read_stat(self.pid)
        return stat is not None and stat.start_time == self.start_time and not stat.zombie

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


@dataclass
class State:
    dir: str
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    #: nodes run by a real kubelet + containerd on this machine (see gpuslice.dev.devcluster.realnode)
    real_nodes: list[str] = field(default_factory=list)
    node_slots: dict[str, int] = field(default_factory=dict)

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


class DevCluster:
    """Start, inspect and stop the local control plane rooted at `directory`."""

    def __init__(
        self,
        directory: Path | None = None,
        progress: Progress | None = None,
        apiserver_feature_gates: str | None = None,
    ) -> None:
        self.dir = (directory or default_dir()).resolve()
        self.progress: Progress = progress or (lambda _msg: None)
        #: kube-apiserver's --feature-gates (tests start one with the DRA gates off to see fields dropped).
        self.apiserver_feature_gates = apiserver_feature_gates or FEATURE_GATES
        self._bins: Binaries | None = None

    # --- public API -------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def bins(self) -> Binaries:
        if self._bins is None:
            self._bins = ensure_binaries(self.progress)
        return self._bins

    def state(self) -> State | None:
        return State.load(self.dir)

    def status(self) -> dict[str, bool]:
        """Which components (and agents) run, by name."""
        st = self.state()
        if st is None:
            return {}
        return {name: rec.alive() for name, rec in st.processes.items()}

    def up(self, nodes: int = 1, *, fresh: bool = False) -> State:
        """Start (or find running) the control plane with at least `nodes` kwok nodes.

        fresh: stop whatever runs in the directory and start from an empty etcd.
        """
        if nodes < 0:
            raise DevClusterError("--nodes must be 0 or more")
        if fresh:
            self.wipe()
        st = self.state()
        if st is not None:
            alive = {n: r.alive() for n, r in st.processes.items() if n in CORE_COMPONENTS}
            if alive and all(alive.values()) and len(alive) == len(CORE_COMPONENTS):
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
        st = State(dir=str(self.dir))
        st.save()
        try:
            self._start_etcd(st, bins)
            self._start_apiserver(st, bins)
            self._write_kubeconfigs(st)
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
            from gpuslice.dev.devcluster import realnode

            stopped += realnode.stop_all(self, st)
        # Agents and extras first, then the core in reverse start order.
        order = [n for n in st.processes if n not in CORE_COMPONENTS]
        order += [n for n in reversed(CORE_COMPONENTS) if n in st.processes]
        for name in order:
            rec = st.processes[name]
            if _stop(rec):
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
        stopped = [n for n in sorted(chosen) if _stop(st.processes[n])]
        st = self.state() or st  # re-read: another process may have registered meanwhile
        st.processes = {n: r for n, r in st.processes.items() if n not in chosen}
        st.save()
        return stopped

    def start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ProcessRecord:
        """Start an extra process (e.g. the operator) logged and recorded like a component, so
        `status` shows it and `down` stops it."""
        return self._spawn(self._require_state(), name, argv, env)

    def register_process(
        self, name: str, proc: subprocess.Popen[bytes], log: Path, argv: Sequence[str]
    ) -> None:
        """Record an extra process (e.g. a node agent) so `status` shows it and `down` stops it."""
        st = self.state()
        if st is None:
            raise DevClusterError(f"no devcluster in {self.dir}; run `gpuslice devcluster up` first")
        st.processes[name] = ProcessRecord(proc.pid, procfs.start_time(proc.pid) or 0, str(log), list(argv))
        st.save()

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bins.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

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

    def apply(self, manifest: str | Path, *, kubeconfig: Path | None = None) -> None:
        """Server-side apply a file, a directory of YAML, or YAML text (the dev tool owns what it applies)."""
        source = ["-f", str(manifest)] if isinstance(manifest, Path) else ["-f", "-"]
        text = None if isinstance(manifest, Path) else manifest
        self.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=gpuslice-devcluster", *source,
            input=text, kubeconfig=kubeconfig,
        )  # fmt: skip

    def apply_crds(self, crd_dir: Path | None = None) -> None:
        """Apply gpuslice's CRDs and wait until the API server serves them."""
        directory = crd_dir or Path(__file__).resolve().parents[4] / "crds"
        if not directory.is_dir():
            raise DevClusterError(f"CRD directory {directory} not found")
        self.apply(directory)
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(directory))

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create (or update) a namespace and wait for its default service account, so pods can be created."""
        doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        # JSON, not YAML: a label value like "12e456" must stay a string for kubectl's YAML parser.
        self.apply(json.dumps(doc))
        self.wait_default_service_account(name)
        return name

    def wait_default_service_account(self, namespace: str, timeout: float = 60) -> None:
        """Pods are rejected until kube-controller-manager has created the namespace's `default`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise DevClusterError(f"namespace {namespace}: no default service account after {timeout:.0f}s")

    # --- internals --------------------------------------------------------------------------------
    def _require_state(self) -> State:
        st = self.state()
        if st is None or "kube-apiserver" not in st.ports:
            raise DevClusterError(f"no devcluster in {self.dir}; run `gpuslice devcluster up` first")
        return st

    def _spawn(
        self, st: State, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> ProcessRecord:
        log = self.dir / "logs" / f"{name.replace('/', '-')}.log"
        with log.open("ab") as fh:
            fh.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            fh.flush()
            # A new session: the control plane outlives `gpuslice devcluster up` and a Ctrl-C in it.
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=env,
            )  # fmt: skip
        rec = ProcessRecord(proc.pid, procfs.start_time(proc.pid) or 0, str(log), argv)
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
            _stop(rec)
            raise DevClusterError(
                f"{name} did not become ready in {timeout:.0f}s; log: {rec.log}\n{log_text[-1500:]}"
            )

    def _start_etcd(self, st: State, bins: Binaries) -> None:
        data = self.dir / "etcd"

        def argv() -> list[str]:
            st.ports["etcd"], st.ports["etcd-peer"] = free_port(), free_port()
            client, peer = f"http://127.0.0.1:{st.ports['etcd']}", f"http://127.0.0.1:{st.ports['etcd-peer']}"
            return [
                str(bins.etcd),
                "--name=devcluster",
                f"--data-dir={data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=devcluster={peer}",
                "--listen-metrics-urls=",
                # A throw-away dev cluster: skipping fsync keeps writes fast on shared disks.
                "--unsafe-no-fsync",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ]

        def ready() -> bool:
            return _http_ok(f"http://127.0.0.1:{st.ports['etcd']}/health")

        self._start_with_port_retry(st, "etcd", argv, ready, 60)

    def _start_apiserver(self, st: State, bins: Binaries) -> None:
        pkidir = self.dir / "pki"
        ca = pki.LocalCA(pkidir)
        serving = ca.issue(
            "apiserver", "kube-apiserver", server=True, hosts=["127.0.0.1", "localhost", "kubernetes"]
        )
        sa = pki.service_account_keys(pkidir)
        admin = ca.issue("admin", "devcluster-admin", ["system:masters"])
        ctx = _client_ssl(ca.cert_path, admin)
        # kube-apiserver -> kubelet (logs, exec, port-forward): as real clusters do, a client
        # certificate the kubelets authorize by webhook, and their serving certs checked against the CA.
        kubelet_client = ca.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]
        )

        def argv() -> list[str]:
            st.ports["kube-apiserver"] = free_port()
            return [
                str(bins.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{st.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The `kubernetes` Service endpoint may not be loopback; nothing here needs it.
                "--endpoint-reconciler-type=none",
                f"--secure-port={st.ports['kube-apiserver']}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.cert_path}",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",
                # Node + NodeRestriction: a real kubelet may touch only its own Node and its pods' objects.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={ca.cert_path}",
                "--kubelet-preferred-address-types=InternalIP",
                "--service-cluster-ip-range=10.96.0.0/16",
                # Privileged pods must reach admission so gpuslice's policies (not this flag) reject them.
                "--allow-privileged=true",
                f"--feature-gates={self.apiserver_feature_gates}",
                "--profiling=false",
                "--enable-priority-and-fairness=false",
                f"--cert-dir={pkidir / 'apiserver-generated'}",
            ]

        def ready() -> bool:
            return _http_ok(f"https://127.0.0.1:{st.ports['kube-apiserver']}/readyz", ctx)

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
        sa = pki.service_account_keys(pkidir)

        def kcm() -> list[str]:
            st.ports["kube-controller-manager"] = free_port()
            kc = comp / "kube-controller-manager.kubeconfig"
            return [
                str(bins.kube_controller_manager),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={st.ports['kube-controller-manager']}",
                "--leader-elect=false",
                # Each controller acts as its own service account, with the bootstrap RBAC roles.
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={pkidir / 'ca.crt'}",
                "--controllers=*",
                f"--feature-gates={FEATURE_GATES}",
                f"--cert-dir={pkidir / 'kcm-generated'}",
                "--concurrent-gc-syncs=5",
            ]

        def scheduler() -> list[str]:
            st.ports["kube-scheduler"] = free_port()
            kc = comp / "kube-scheduler.kubeconfig"
            return [
                str(bins.kube_scheduler),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={st.ports['kube-scheduler']}",
                "--leader-elect=false",
                f"--feature-gates={FEATURE_GATES}",
                f"--cert-dir={pkidir / 'scheduler-generated'}",
            ]

        def kwok() -> list[str]:
            st.ports["kwok"] = free_port()
            return [
                str(bins.kwok),
                f"--kubeconfig={comp / 'kwok.kubeconfig'}",
                f"--config={bins.kwok_stages}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
                "--disregard-status-with-annotation-selector=kwok.x-k8s.io/status=custom",
                "--cidr=10.0.0.1/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{st.ports['kwok']}",
            ]

        def healthz(name: str) -> Callable[[], bool]:
            return lambda: _http_ok(f"https://127.0.0.1:{st.ports[name]}/healthz", _insecure_ssl())

        self._start_with_port_retry(
            st, "kube-controller-manager", kcm, healthz("kube-controller-manager"), 90
        )
        self._start_with_port_retry(st, "kube-scheduler", scheduler, healthz("kube-scheduler"), 90)
        self._start_with_port_retry(
            st, "kwok", kwok, lambda: _http_ok(f"http://127.0.0.1:{st.ports['kwok']}/healthz"), 60
        )

    def _ensure_nodes(self, st: State, count: int) -> None:
        names = [f"kwok-node-{i}" for i in range(count)]
        if names:
            self.apply(yaml.safe_dump_all([node_manifest(n) for n in names]))
            self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names])
        st.nodes = sorted(set(st.nodes) | set(names), key=lambda n: int(n.rsplit("-", 1)[1]))
        st.save()
        self.progress(f"{len(st.nodes)} kwok node(s) Ready")


def node_manifest(name: str, cpu: str = "32", memory: str = "256Gi") -> dict[str, object]:
    resources = {"cpu": cpu, "memory": memory, "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1],
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {},
        "status": {"allocatable": resources, "capacity": resources},
    }


def _stop(rec: ProcessRecord, grace: float = 10.0) -> bool:
    if not rec.alive():
        return False
    try:
        os.kill(rec.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not rec.alive() or _is_zombie(rec.pid):
            _reap(rec.pid)
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(rec.pid, signal.SIGKILL)
    _reap(rec.pid)
    return True


def _is_zombie(pid: int) -> bool:
    return not procfs.alive(pid)


def _reap(pid: int) -> None:
    # Only our own children can be reaped; for processes started by another `up` this is a no-op.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _client_ssl(ca: Path, client: pki.CertPair) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    return ctx


def _insecure_ssl() -> ssl.SSLContext:
    # Controller-manager and scheduler serve health on self-signed certificates they generate.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
