"""Real nodes: a kubelet of the cluster's release with its own containerd, runc and a CNI bridge.

Each real node `real-node-<i>` gets
- containerd (CRI with CDI on) with its own root, state, socket, runc root and CNI network, so
  several nodes can share the machine; its CRI netns mounts live under its state dir;
- a kubelet registered with the API server as `system:node:<name>` (client certificate from the
  cluster's CA), serving on 127.0.0.1 with a CA-signed certificate so `kubectl logs/exec` work,
  cgroupfs under its own cgroup root, and its own `--root-dir` (plugins_registry for DRA drivers);
- the pause and probe images imported at start (no registry).

`stop_all` (called by `DevCluster.down`) removes every pod sandbox through CRI (CNI releases the
addresses, containerd removes the netns), stops kubelet and containerd, kills shims left behind,
unmounts whatever is still mounted under the node's dirs, deletes its bridge and its cgroups.

Several devclusters may run real nodes on one machine at once (test workers do): each node's bridge
carries its owner in the link's alias (`gpuslice-dev:<digest of the node's dir>`), and a node only
ever deletes or adopts a bridge that names it; a bridge name taken meanwhile by another devcluster
is left alone, and the node moves to a free slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuslice import procfs
from gpuslice_dev.devcluster import pki
from gpuslice_dev.devcluster.cluster import DevCluster, State
from gpuslice_dev.devcluster.components import gates_map
from gpuslice_dev.devcluster.node_binaries import NodeBinaries, ensure_node_binaries
from gpuslice_dev.devcluster.supervisor import DevClusterError, free_port, stop

Progress = Callable[[str], None]

REAL_NODE_PREFIX = "real-node-"
#: longest kubelet root dir: its sockets (plugins_registry/<driver>-reg.sock, ...) must fit sun_path
_MAX_ROOT = 62
#: pod subnets: 10.88.<i>.0/24 on bridge gs-br<i>; the host is .1 on it (kubelet probes reach pods)
_SUBNET = "10.88.{i}.0/24"


def real_node_name(i: int) -> str:
    return f"{REAL_NODE_PREFIX}{i}"


def is_real_node(name: str) -> bool:
    return name.startswith(REAL_NODE_PREFIX)


@dataclass(frozen=True)
class NodeDirs:
    """Where one real node keeps its files. `base` holds configs, images and logs (disk); `root`
    is kubelet's root dir and containerd's state (short path: unix sockets live there)."""

    name: str
    #: machine-wide number of the node's bridge and subnet (two devclusters may run side by side)
    slot: int
    base: Path
    root: Path

    @property
    def containerd_root(self) -> Path:
        return self.base / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd-state"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.base / "containerd.toml"

    @property
    def runc_root(self) -> Path:
        return self.root / "runc"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.base / "kubelet-config.yaml"

    @property
    def pod_logs(self) -> Path:
        """The kubelet's pod log dir. Not the machine's /var/log/pods: a kubelet removes the log dirs
        there of every pod it does not know, i.e. every other dev cluster's pods."""
        return self.base / "pod-logs"

    @property
    def kubeconfig(self) -> Path:
        return self.base / "kubelet.kubeconfig"

    @property
    def cni_conf_dir(self) -> Path:
        return self.base / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.base / "cni" / "ipam"

    @property
    def cdi_dirs(self) -> list[Path]:
        """containerd reads CDI specs here: the agent's and the NVIDIA toolkit's (simulated)."""
        return [self.base / "cdi" / "gpuslice", self.base / "cdi" / "nvidia"]

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def registry_dir(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def bridge(self) -> str:
        return f"gs-br{self.slot}"

    @property
    def bridge_owner(self) -> str:
        """The alias this node's bridge carries: the node's own dir, so no other devcluster's node
        (nor another node of this one) claims it."""
        digest = hashlib.sha256(str(self.base.resolve()).encode()).hexdigest()[:16]
        return f"gpuslice-dev:{digest}"

    @property
    def subnet(self) -> str:
        return _SUBNET.format(i=self.slot)

    @property
    def node_ip(self) -> str:
        """The host's address on the node's bridge: kubelet serves here (a Node's InternalIP may not
        be loopback) and the API server reaches it without anything leaving the machine."""
        return self.subnet.replace(".0/24", ".1")

    @property
    def cgroup_root(self) -> str:
        digest = hashlib.sha256(str(self.base).encode()).hexdigest()[:8]
        return f"/gpuslice-{digest}-{self.name}"


def node_dirs(cluster_dir: Path, name: str, slot: int = 0) -> NodeDirs:
    base = cluster_dir / "nodes" / name
    root = base / "run"
    if len(str(root / "kubelet")) > _MAX_ROOT:
        # A deep cluster dir (a pytest tmp dir): the socket-holding dirs move to a short stable path.
        digest = hashlib.sha256(str(base.resolve()).encode()).hexdigest()[:12]
        root = Path("/run/gpuslice-dev") / digest
    return NodeDirs(name=name, slot=slot, base=base, root=root)


def _free_slot(taken: set[int]) -> int:
    for slot in range(250):
        if slot not in taken and not Path(f"/sys/class/net/gs-br{slot}").exists():
            return slot
    raise DevClusterError("no free bridge slot (gs-br0..249 all exist); stop other devclusters' real nodes")


def bridge_owner_of(bridge: str) -> str | None:
    """The owner a bridge carries in its alias ("" if none), or None if there is no such link."""
    try:
        return Path(f"/sys/class/net/{bridge}/ifalias").read_text().strip()
    except FileNotFoundError:
        return None


def _slot_is_ours(d: NodeDirs) -> bool:
    """Whether the node can (re)use its recorded slot: its bridge is gone or is its own."""
    return bridge_owner_of(d.bridge) in (None, d.bridge_owner)


def delete_bridge(d: NodeDirs) -> bool:
    """Delete the node's bridge if it is the node's own; True if deleted. A bridge of that name made
    by another devcluster (after this one's was gone) is never touched."""
    if bridge_owner_of(d.bridge) != d.bridge_owner:
        return False
    subprocess.run(["ip", "link", "delete", d.bridge], capture_output=True, check=False)
    return True


@contextlib.contextmanager
def _slot_lock() -> Iterator[None]:
    lock = Path("/run/gpuslice-dev/slots.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def dirs_of(cluster: DevCluster, name: str) -> NodeDirs:
    """The dirs of a node this cluster started (its slot is in the cluster's state)."""
    st = cluster.state()
    return node_dirs(cluster.dir, name, (st.node_slots.get(name, 0) if st else 0))


def process_names(node: str) -> dict[str, str]:
    return {k: f"{k}/{node}" for k in ("containerd", "kubelet")}


# --- configuration files ------------------------------------------------------------------------
def containerd_config(d: NodeDirs, bins: NodeBinaries, sandbox_image: str) -> str:
    cdi = ", ".join(f"'{p}'" for p in d.cdi_dirs)
    return f"""version = 3
root = '{d.containerd_root}'
state = '{d.containerd_state}'
# NRI and the tracing/ttrpc extras would share machine-wide sockets with the other nodes.
disabled_plugins = ['io.containerd.nri.v1.nri']

[grpc]
  address = '{d.containerd_socket}'

[plugins.'io.containerd.internal.v1.opt']
  path = '{d.base / "opt"}'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{sandbox_image}'

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = [{cdi}]
  netns_mounts_under_state_dir = true
  # This machine may not lower oom_score_adj below containerd's own (no CAP_SYS_RESOURCE over it).
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{bins.runc}'
        Root = '{d.runc_root}'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{bins.cni_dir}']
    conf_dir = '{d.cni_conf_dir}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"""


def cni_config(d: NodeDirs) -> dict[str, object]:
    return {
        "cniVersion": "1.0.0",
        "name": f"gpuslice-{d.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": d.bridge,
                "isGateway": True,
                # No masquerading: pods talk to this machine only, nothing is routed off it.
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": d.subnet}]],
                    "dataDir": str(d.cni_ipam_dir),
                },
            }
        ],
    }


def kubelet_config(
    d: NodeDirs, *, ca: Path, serving: pki.CertPair, port: int, healthz: int, feature_gates: str = ""
) -> dict[str, object]:
    gates = gates_map(feature_gates)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine kind mounts cgroup v1; kubelet >= 1.35 refuses it unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": d.cgroup_root,
        "podLogsDir": str(d.pod_logs),
        "containerRuntimeEndpoint": f"unix://{d.containerd_socket}",
        "address": d.node_ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "tlsCertFile": str(serving.cert),
        "tlsPrivateKeyFile": str(serving.key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "failSwapOn": False,
        # A shared dev machine: never evict for disk or memory the other nodes and tests use.
        "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "60s",
        "maxPods": 110,
        "featureGates": gates,
    }


# --- start --------------------------------------------------------------------------------------
def _env(bins: NodeBinaries) -> dict[str, str]:
    path = ":".join(
        [*(str(p) for p in bins.bin_dirs), os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")]
    )
    return {**os.environ, "PATH": path}


def _wait(what: str, ready: Callable[[], bool], timeout: float, log: str, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not alive():
            break
        time.sleep(0.25)
    tail = Path(log).read_text(errors="replace")[-2500:] if Path(log).exists() else ""
    raise DevClusterError(f"{what} did not become ready in {timeout:.0f}s; log: {log}\n{tail}")


def ctr(bins: NodeBinaries, d: NodeDirs, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(bins.ctr), "--address", str(d.containerd_socket), "--namespace", "k8s.io", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if check and proc.returncode != 0:
        raise DevClusterError(f"ctr {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def crictl(
    bins: NodeBinaries, d: NodeDirs, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = [str(bins.crictl), "--runtime-endpoint", f"unix://{d.containerd_socket}", "--timeout", "60s", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _start_containerd(
    cluster: DevCluster, d: NodeDirs, bins: NodeBinaries, images: list[tuple[str, Path]]
) -> None:
    for p in (
        d.containerd_root,
        d.containerd_state,
        d.runc_root,
        d.cni_conf_dir,
        d.cni_ipam_dir,
        *d.cdi_dirs,
    ):
        p.mkdir(parents=True, exist_ok=True)
    sandbox = next((ref for ref, _ in images if "/pause:" in ref), "registry.k8s.io/pause:3.10.2")
    d.containerd_config.write_text(containerd_config(d, bins, sandbox))
    (d.cni_conf_dir / "10-gpuslice.conflist").write_text(json.dumps(cni_config(d), indent=2))
    d.containerd_socket.unlink(missing_ok=True)
    name = process_names(d.name)["containerd"]
    rec = cluster.start_process(
        name, [str(bins.containerd), "--config", str(d.containerd_config)], env=_env(bins)
    )
    cluster.progress(f"starting {name} (pid {rec.pid}) ...")
    _wait(name, lambda: ctr(bins, d, "version", check=False).returncode == 0, 60, rec.log, rec.alive)
    for ref, archive in images:
        if ref not in ctr(bins, d, "images", "list", "-q").stdout.split():
            ctr(bins, d, "images", "import", str(archive))
        cluster.progress(f"{d.name}: image {ref} ready")


def _make_cgroup_root(cgroup_root: str) -> None:
    """kubelet wants its --cgroup-root to exist in every v1 hierarchy; cpuset needs cpus and mems."""
    base = Path("/sys/fs/cgroup")
    for hierarchy in (p for p in base.iterdir() if p.is_dir() and p.name != "unified"):
        top = hierarchy / cgroup_root.lstrip("/")
        top.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if not (top / knob).read_text().strip():
                    (top / knob).write_text((hierarchy / knob).read_text())


def _make_bridge(d: NodeDirs) -> None:
    """The CNI bridge, made before kubelet starts so the node has its address from the start (the
    bridge plugin adopts an existing bridge and its gateway address)."""
    owner = bridge_owner_of(d.bridge)
    if owner is None:
        subprocess.run(["ip", "link", "add", d.bridge, "type", "bridge"], check=True, capture_output=True)
        subprocess.run(
            ["ip", "link", "set", "dev", d.bridge, "alias", d.bridge_owner], check=True, capture_output=True
        )
    elif owner != d.bridge_owner:
        raise DevClusterError(f"bridge {d.bridge} belongs to another devcluster ({owner or 'no owner'})")
    subprocess.run(
        ["ip", "addr", "replace", f"{d.node_ip}/24", "dev", d.bridge], check=True, capture_output=True
    )
    subprocess.run(["ip", "link", "set", d.bridge, "up"], check=True, capture_output=True)


def _start_kubelet(cluster: DevCluster, st: State, d: NodeDirs, bins: NodeBinaries) -> None:
    # (the node's bridge, and so its address, exists already: start_real_nodes made it with the slot)
    _make_cgroup_root(d.cgroup_root)
    ca = pki.LocalCA(cluster.dir / "pki")
    client = ca.issue(f"kubelet-{d.name}", f"system:node:{d.name}", ["system:nodes"])
    pki.write_kubeconfig(d.kubeconfig, st.server, ca.cert_path, client, f"system:node:{d.name}")
    serving = ca.issue(
        f"kubelet-serving-{d.name}",
        f"system:node:{d.name}",
        server=True,
        hosts=[d.node_ip, "127.0.0.1", d.name],
    )
    port, healthz = free_port(), free_port()
    st.ports[f"kubelet/{d.name}"] = port
    d.kubelet_root.mkdir(parents=True, exist_ok=True)
    d.kubelet_config.write_text(
        yaml.safe_dump(
            kubelet_config(
                d,
                ca=ca.cert_path,
                serving=serving,
                port=port,
                healthz=healthz,
                feature_gates=cluster.feature_gates,
            )
        )
    )
    argv = [
        str(bins.kubelet),
        f"--config={d.kubelet_config}",
        f"--kubeconfig={d.kubeconfig}",
        f"--root-dir={d.kubelet_root}",
        f"--hostname-override={d.name}",
        f"--node-ip={d.node_ip}",
        f"--node-labels=type=real,{'gpuslice.io/real-node'}=true",
        "--v=1",
    ]
    name = process_names(d.name)["kubelet"]
    rec = cluster.start_process(name, argv, env=_env(bins))
    cluster.progress(f"starting {name} (pid {rec.pid}) ...")

    def ready() -> bool:
        proc = cluster.kubectl("get", "node", d.name, "-o", "json", check=False)
        if proc.returncode != 0:
            return False
        conds = json.loads(proc.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    _wait(f"{name} (node Ready)", ready, 120, rec.log, rec.alive)


def start_real_nodes(cluster: DevCluster, count: int, progress: Progress | None = None) -> list[str]:
    """Start (or find running) real nodes real-node-0..count-1; returns the names started now."""
    from gpuslice_dev.devcluster.images import ensure_images

    say = progress or cluster.progress
    st = cluster.state()
    if st is None:
        raise DevClusterError(f"no devcluster in {cluster.dir}; run `gpuslice-dev devcluster up` first")
    if os.geteuid() != 0:
        raise DevClusterError(
            "real nodes run kubelet and containerd, which need root; run as root or use --nodes"
        )
    bins = ensure_node_binaries(say, cluster.kubernetes)
    images = [(img.ref, img.path) for img in ensure_images(say)]
    started: list[str] = []
    for i in range(count):
        name = real_node_name(i)
        names = process_names(name)
        running = cluster.status()
        if all(running.get(n) for n in names.values()):
            continue
        if any(running.get(n) for n in names.values()):
            say(f"{name} is partly running; restarting it")
            stop_node(cluster, name, bins)
        started_at = time.monotonic()
        st = cluster.state() or st
        with _slot_lock():
            # The bridge is the slot's reservation: made under the machine-wide lock, so two
            # devclusters starting at once never take the same subnet.
            recorded = st.node_slots.get(name)
            if recorded is None or not _slot_is_ours(node_dirs(cluster.dir, name, recorded)):
                # (a recorded slot whose bridge another devcluster took meanwhile is not ours any more)
                others = {s for n, s in st.node_slots.items() if n != name}
                st.node_slots[name] = _free_slot(others)
                st.save()
            d = node_dirs(cluster.dir, name, st.node_slots[name])
            _make_bridge(d)
        _start_containerd(cluster, d, bins, images)
        st = cluster.state() or st
        _start_kubelet(cluster, st, d, bins)
        st = cluster.state() or st
        st.real_nodes = sorted(set(st.real_nodes) | {name}, key=lambda n: int(n.rsplit("-", 1)[1]))
        st.save()
        started.append(name)
        say(f"{name} Ready in {time.monotonic() - started_at:.1f}s (kubelet + containerd)")
    return started


def import_image(cluster: DevCluster, archive: Path) -> list[str]:
    """`ctr -n k8s.io images import ARCHIVE` (an OCI or docker archive) on every real node of the
    cluster; returns the nodes it was imported on. kubelet then runs it without pulling."""
    st = cluster.state()
    if st is None or not st.real_nodes:
        raise DevClusterError(
            f"no real node runs in {cluster.dir}; `gpuslice-dev devcluster up --real-nodes 1`"
        )
    if not archive.is_file():
        raise DevClusterError(f"{archive} is not a file (build it with `make image`)")
    bins = ensure_node_binaries(cluster.progress, cluster.kubernetes)
    for name in st.real_nodes:
        ctr(bins, dirs_of(cluster, name), "images", "import", str(archive.resolve()))
    return list(st.real_nodes)


# --- stop ---------------------------------------------------------------------------------------
def _processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process on the machine."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(entry.name), [a.decode(errors="replace") for a in argv if a]


def _kill_tree_of(pred: Callable[[list[str]], bool]) -> list[int]:
    """SIGKILL every process whose argv `pred` accepts (shims a stopped containerd left behind)."""
    killed = []
    for pid, args in _processes():
        if args and pred(args):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def mounts_under(*dirs: Path) -> list[str]:
    """Mount points at or below `dirs`, deepest first (mountinfo escapes spaces as \\040)."""
    found = []
    prefixes = [str(d) for d in dirs]
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def _unmount_all(*dirs: Path) -> None:
    for _ in range(3):
        points = mounts_under(*dirs)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _remove_cgroups(cgroup_root: str) -> None:
    base = Path("/sys/fs/cgroup")
    for hierarchy in (
        [p for p in base.iterdir() if p.is_dir() and p.name != "unified"] if base.exists() else []
    ):
        top = hierarchy / cgroup_root.lstrip("/")
        if not top.is_dir():
            continue
        for dirpath in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                dirpath.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def stop_node(cluster: DevCluster, name: str, bins: NodeBinaries | None = None) -> list[str]:
    """Stop one real node and leave nothing behind: no process, mount, netns, bridge or cgroup."""
    bins = bins or ensure_node_binaries(cluster.progress, cluster.kubernetes)
    d = dirs_of(cluster, name)
    st = cluster.state()
    stopped: list[str] = []
    names = process_names(name)
    recs = st.processes if st else {}
    if names["kubelet"] in recs and stop(recs[names["kubelet"]]):
        stopped.append(names["kubelet"])
    if names["containerd"] in recs and recs[names["containerd"]].alive():
        # Through CRI: containers stop, CNI releases the pod addresses, netns are removed.
        crictl(bins, d, "rmp", "--all", "--force")
    if names["containerd"] in recs and stop(recs[names["containerd"]]):
        stopped.append(names["containerd"])
    sock = str(d.containerd_socket)
    _kill_tree_of(lambda args: "containerd-shim" in args[0] and sock in args)
    _kill_tree_of(lambda args: args[0].endswith("runc") and str(d.runc_root) in args)
    _unmount_all(d.base, d.root)
    delete_bridge(d)
    _remove_cgroups(d.cgroup_root)
    shutil.rmtree(d.root, ignore_errors=True)
    shutil.rmtree(d.containerd_state, ignore_errors=True)
    # containerd's machine-wide dirs (shim sockets, fifos), once no node uses them any more
    for shared in (
        "/run/containerd/s",
        "/run/containerd/fifo",
        "/run/containerd/runc/k8s.io",
        "/run/containerd/runc",
    ):
        with contextlib.suppress(OSError):
            Path(shared).rmdir()
    if st is not None:
        st = cluster.state() or st
        for n in names.values():
            st.processes.pop(n, None)
        st.ports.pop(f"kubelet/{name}", None)
        st.real_nodes = [n for n in st.real_nodes if n != name]
        st.node_slots.pop(name, None)
        st.save()
    return stopped


def stop_all(cluster: DevCluster, st: State) -> list[str]:
    """Stop every real node (agents on them first, then kubelet and containerd)."""
    stopped: list[str] = []
    for name in list(st.real_nodes):
        extras = [
            n
            for n in st.processes
            if n.endswith(f"/{name}") and n.split("/")[0] not in ("kubelet", "containerd")
        ]
        # the agent before the driver daemon it reads GPUs through
        for proc_name in sorted(extras, key=lambda n: not n.startswith("agent/")):
            if stop(st.processes[proc_name]):
                stopped.append(proc_name)
        stopped += stop_node(cluster, name)
    return stopped


def leftovers(cluster_dir: Path, nodes: dict[str, int]) -> dict[str, list[str]]:
    """What stopped nodes ({name: slot}) left behind (for `down`'s tests): mounts, bridges, processes."""
    out: dict[str, list[str]] = {"mounts": [], "links": [], "processes": []}
    for name, slot in nodes.items():
        d = node_dirs(cluster_dir, name, slot)
        out["mounts"] += mounts_under(d.base, d.root)
        if bridge_owner_of(d.bridge) == d.bridge_owner:
            out["links"].append(d.bridge)
        ours = (str(d.containerd_socket), str(d.kubelet_root), str(d.runc_root))
        for pid, args in _processes():
            cmd = " ".join(args)
            if any(o in cmd for o in ours) and procfs.alive(pid):
                out["processes"].append(f"{pid}: {cmd[:120]}")
    return out
