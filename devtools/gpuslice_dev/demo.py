"""`gpuslice-dev demo`: the whole product on this machine, playing the field report (README.md, "make demo").

A devcluster with real nodes (kubelet + containerd + runc on this machine) over simulated V100s, the
CRDs, the three V100 products, two tenant namespaces, the operator and one agent per node; then each
lesson of the field report as a step with its result, the workloads being real pods of the probe
image. It leaves the cluster running and says what to try next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice.domain import features
from gpuslice_dev.paths import MANIFESTS as PRODUCT_MANIFESTS

SAMPLES = PRODUCT_MANIFESTS / "samples"
#: the demo's own objects (workload, tenant access, the lessons' wrong requests)
DEMO_MANIFESTS = Path(__file__).resolve().parent / "manifests" / "demo"
GPU_MODEL = "Tesla V100-PCIE-32GB"

#: The workload image: busybox and `gpuslice-probe` (smi, alloc, hold, burn), built and imported at `up`.
PROBE_IMAGE = "localhost/gpuslice/probe:dev"


class DemoError(RuntimeError):
    pass


def lessons_skipped(platform: features.Platform) -> dict[str, str]:
    """The demo's lessons a Kubernetes version cannot play, each with what stops it there: what the
    operator and agent decided from the API server (README, "Kubernetes versions")."""
    skipped = {}
    refusal = platform.publish_refusal
    if refusal:
        # the agents publish no device: nothing past the admission lessons can be allocated
        for lesson in ("chart form", "allocation", "capacity", "usage", "bypass"):
            skipped[lesson] = f"nothing is sold here: the agents publish no devices ({refusal})"
    elif not platform.on(features.EXTENDED_RESOURCES):
        skipped["chart form"] = platform.feature(features.EXTENDED_RESOURCES).reason
    return skipped


def try_lines(skipped: Collection[str], *, kubectl: str, gs: str, nodes: int) -> list[str]:
    """The closing hints: only commands whose objects the lessons played made (no `explain` of a slice
    the capacity lesson never created, no `exec` into a pod the allocation lesson never started)."""
    lines = [f"{kubectl} get gpuslices -A"]
    if "capacity" not in skipped:
        lines.append(f"{gs} explain team-b/big-{nodes - 1}")
    if "allocation" not in skipped:
        lines += [
            f"{kubectl} exec -n team-a llm-worker -- gpuslice-probe smi",
            f"{kubectl} exec -it -n team-a llm-worker -- sh",
        ]
    else:
        lines.append(f"{gs} check")  # says what this Kubernetes lets gpuslice do, and why nothing is sold
    return lines


class Demo:
    def __init__(
        self,
        directory: Path | None,
        nodes: int,
        gpus_per_node: int,
        *,
        kubernetes: str | None = None,
        feature_gates: str = "",
    ) -> None:
        from gpuslice_dev.devcluster.cluster import DevCluster

        self.cluster = DevCluster(
            directory, progress=self._progress, kubernetes=kubernetes, extra_feature_gates=feature_gates
        )
        #: what the API server serves, read once the operator runs (`platform_step`)
        self.platform: features.Platform | None = None
        self.nodes = nodes
        self.spec = f"{gpus_per_node}x {GPU_MODEL}"
        self.step_no = 0
        self.started = time.monotonic()

    # --- output -----------------------------------------------------------------------------------
    def _progress(self, msg: str) -> None:
        print(f"      . {msg}", flush=True)

    def step(self, title: str) -> None:
        self.step_no += 1
        print(f"\n[{self.step_no}] {title}  (+{time.monotonic() - self.started:.0f}s)", flush=True)

    def show(self, text: str, prefix: str = "      | ") -> None:
        for line in text.rstrip().splitlines():
            print(prefix + line, flush=True)

    def ok(self, text: str) -> None:
        print(f"      => {text}", flush=True)

    # --- helpers ----------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, user: Path | None = None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, kubeconfig=user, input=input, check=False)

    def get(self, *args: str) -> Any:
        proc = self.kubectl("get", *args, "-o", "json")
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
        deadline = time.monotonic() + timeout
        last_note = time.monotonic()
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            self._check_processes()
            if time.monotonic() - last_note > 10:
                self._progress(f"still waiting for {what} ...")
                last_note = time.monotonic()
            time.sleep(0.5)
        raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")

    def _check_processes(self) -> None:
        """Fail fast, with its last log line, when the operator or an agent died."""
        state = self.cluster.state()
        if state is None:
            return
        for name, alive in self.cluster.status().items():
            if not alive and (name == "operator" or name.startswith("agent/")):
                lines = Path(state.processes[name].log).read_text(errors="replace").strip().splitlines()
                raise DemoError(f"{name} exited: {lines[-1] if lines else 'no output'}")

    def slice_status(self, ns: str, name: str) -> dict[str, Any]:
        obj = self.get(c.SLICE_PLURAL, name, "-n", ns)
        return (obj or {}).get("status") or {}

    def wait_phase(self, ns: str, name: str, phases: tuple[str, ...], timeout: float = 90) -> dict[str, Any]:
        return self.wait(
            f"GpuSlice {ns}/{name} to be {' or '.join(phases)}",
            lambda: (s := self.slice_status(ns, name)).get("phase") in phases and s,
            timeout,
        )

    def workload(self, ns: str, name: str, package: str, memory_limit: str = "8Gi", pod: str = "") -> str:
        """GpuSlice `name` of `package` and a probe pod (`pod`, default `name`) holding its claim."""
        gpuslice, workload = _manifests("workload.yaml")
        gpuslice["metadata"] = {"name": name, "namespace": ns}
        gpuslice["spec"]["package"] = package
        workload["metadata"] = {"name": pod or name, "namespace": ns}
        workload["spec"]["resourceClaims"][0]["resourceClaimName"] = name
        workload["spec"]["containers"][0]["resources"]["limits"]["memory"] = memory_limit
        self._tolerate_gpu_nodes(workload["spec"])
        return yaml.safe_dump_all([gpuslice, workload])

    def _tolerate_gpu_nodes(self, pod_spec: dict[str, Any]) -> None:
        # Without MutatingAdmissionPolicy the operator cannot add the GPU nodes' toleration: the
        # tenant's pod carries it, as the README says for such a platform.
        if self.platform is not None and not self.platform.on(features.MUTATING):
            pod_spec.setdefault("tolerations", []).append(
                {"key": c.TAINT_GPU_KEY, "operator": "Exists", "effect": c.TAINT_GPU_EFFECT}
            )

    # --- the story --------------------------------------------------------------------------------
    def run(self) -> None:
        from gpuslice_dev.devcluster.realnode import start_real_nodes

        self.step(
            f"A real control plane (Kubernetes {self.cluster.kubernetes}) and {self.nodes} real node(s) "
            f"(kubelet, containerd), each with {self.spec}"
        )
        if self.cluster.state() is not None:
            self._progress(f"starting from scratch: stopping and wiping the devcluster in {self.cluster.dir}")
        self.cluster.up(nodes=0, fresh=True)
        start_real_nodes(self.cluster, self.nodes)
        self.setup()
        alice = self.cluster.tenant_kubeconfig("alice", ["team-a"])
        bob = self.cluster.tenant_kubeconfig("bob", ["team-b"])
        self.raw_gpu_request(alice)
        if self.playable("chart form", "the way charts ask: resources.limits {gpuslice.io/v100-8g: 1}"):
            self.chart_form(alice)
        self.hand_written_template(alice)
        if self.playable("allocation", "a GpuSlice allocated and used from inside its container"):
            self.allocate(alice)
            self.inside_the_container(alice)
        if self.playable("capacity", "a tenant waits for capacity"):
            self.capacity_wait(bob)
        if self.playable("usage", "usage and billing"):
            self.usage()
        if self.playable("bypass", "a process that bypasses the shim"):
            self.bypass()
        self.tables()
        self.next_steps()

    def playable(self, lesson: str, title: str) -> bool:
        """False (and says why, as a step) where this Kubernetes cannot play `lesson`."""
        why = lessons_skipped(self.platform).get(lesson) if self.platform is not None else None
        if why is None:
            return True
        self.step(f"Not on Kubernetes {self.cluster.kubernetes}: {title}")
        self.show(textwrap.fill(why, 100))
        return False

    def platform_step(self) -> None:
        """What this API server lets gpuslice do, read as the operator and the agents read it."""
        import asyncio

        from gpuslice import kubehttp
        from gpuslice.platform import read_platform

        async def read() -> features.Platform:
            api = kubehttp.Client(kubehttp.load(str(self.cluster.kubeconfig)), connections=2)
            try:
                return await read_platform(api)
            finally:
                await api.close()

        platform = asyncio.run(read())
        self.step(f"What Kubernetes {platform.version} lets gpuslice do (gpuslice check says the same)")
        for f in platform.features:
            mark = "\u221a" if f.on else "\u00d7"
            gate = f" ({f.gate})" if f.gate else ""
            self.show(f"{mark} {f.name}{gate}" + ("" if f.on else f": {f.reason}"))
        self.platform = platform

    def setup(self) -> None:
        from gpuslice_dev.devcluster.node_agents import start_agents

        self.step("Platform team: CRDs, the three V100 products, tenants team-a and team-b, operator, agents")
        self.cluster.apply_crds()
        for sample in ("v100-8g.yaml", "v100-16g.yaml", "v100-32g.yaml"):
            package = yaml.safe_load((SAMPLES / sample).read_text())
            if package["metadata"]["name"] == "v100-32g":
                # team-b is entitled to a whole card per node: enough to fill every V100 below.
                package["spec"].setdefault("entitlements", []).append(
                    {
                        "namespaceSelector": {"matchLabels": {"tenant.example.com/project": "team-b"}},
                        "slices": self.nodes,
                    }
                )
            self.cluster.apply(yaml.safe_dump(package))
        self.cluster.apply(PRODUCT_MANIFESTS / "base" / "tenant" / "rbac.yaml")
        for team in ("team-a", "team-b"):
            self.cluster.create_namespace(team, {"tenant.example.com/project": team})
            access = (DEMO_MANIFESTS / "tenant-access.yaml").read_text().replace("team-a", team)
            self.cluster.apply(access)
        self.start_operator()
        self.platform_step()
        start_agents(self.cluster, self.spec, progress=self._progress)
        if self.platform is not None and self.platform.publish_refusal:
            self.ok("the agents run and publish nothing, saying why (their log and a Node Event)")
            return
        self.wait(
            "the agents' ResourceSlices and the packages' capacity",
            lambda: (
                ((self.get(c.PACKAGE_PLURAL, "v100-8g") or {}).get("status") or {})
                .get("capacity", {})
                .get("gpus", 0)
                >= self.nodes
            ),
            timeout=120,
        )
        self.show(self.kubectl("get", "gpupackages").stdout)
        quota = self.kubectl("get", "resourcequota", "-n", "team-a", "-o", "yaml").stdout
        self.ok(
            "team-a's entitlement (spec.hard, status.hard, status.used), as the tenant checks it (lesson 6):"
        )
        self.show("\n".join(line for line in quota.splitlines() if "deviceclass" in line))

    def start_operator(self) -> None:
        if self.cluster.status().get("operator"):
            self._progress("operator already running")
            return
        argv = [sys.executable, "-m", "gpuslice", "operator", "--kubeconfig", str(self.cluster.kubeconfig)]
        rec = self.cluster.start_process("operator", argv)
        self._progress(f"operator started (pid {rec.pid}), log {rec.log}")
        # Policies are ready once a raw GPU request is denied by them.
        self.wait(
            "the operator's DeviceClasses and admission policies",
            lambda: (
                self.get("deviceclass", c.device_class_name("v100-8g"))
                and self.get("validatingadmissionpolicies")
                and any(
                    p["metadata"].get("labels", {}).get(c.LABEL_MANAGED_BY) == c.MANAGED_BY_VALUE
                    for p in self.get("validatingadmissionpolicies")["items"]
                )
            ),
            timeout=120,
        )

    def raw_gpu_request(self, alice: Path) -> None:
        self.step("Lesson 1: a tenant asks for a raw nvidia.com/gpu")
        pod = yaml.safe_dump_all(_manifests("raw-gpu-pod.yaml"))

        def try_create() -> subprocess.CompletedProcess[str] | None:
            # Policies reach admission asynchronously: an early create may pass; undo it and retry.
            proc = self.kubectl("create", "-f", "-", user=alice, input=pod)
            if proc.returncode != 0:
                return proc
            self.kubectl("delete", "pod", "raw-gpu", "-n", "team-a", "--wait=false")
            return None

        proc = self.wait("the policy to be enforced", try_create)
        self.ok("rejected at admission, and the message says what to do instead:")
        self.show(textwrap.fill(proc.stderr.strip(), 100))

    def chart_form(self, alice: Path) -> None:
        self.step("The way charts ask: a stock Deployment with resources.limits {gpuslice.io/v100-8g: 1}")
        docs = _manifests("chart-deployment.yaml")
        for doc in docs:
            if doc["kind"] == "Deployment":
                self._tolerate_gpu_nodes(doc["spec"]["template"]["spec"])
        proc = self.kubectl("apply", "-f", "-", user=alice, input=yaml.safe_dump_all(docs))
        if proc.returncode != 0:
            raise DemoError(f"creating the Deployment failed: {proc.stderr}")

        def running_pod() -> str | None:
            pods = (self.get("pods", "-n", "team-a", "-l", "app=chart") or {}).get("items") or []
            ready = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
            return ready[0]["metadata"]["name"] if ready else None

        pod = self.wait("the Deployment's pod to run on a real node", running_pod)
        st = self.wait_phase("team-a", pod, ("InUse",))
        self.ok(
            f"kube-scheduler made pod {pod} a claim ({st.get('claimName')}) and placed it on {st.get('node')}"
        )
        self.ok(f"kubectl exec {pod} -- gpuslice-probe smi:")
        self.show(self.exec("team-a", pod, "gpuslice-probe", "smi", user=alice))
        self.ok("the operator shows the pod's slice as a GpuSlice, owned by the pod (kubectl get gpuslices):")
        self.show(self.kubectl("get", c.SLICE_PLURAL, "-n", "team-a", user=alice).stdout)
        quota = self.kubectl("describe", "resourcequota", c.QUOTA_NAME, "-n", "team-a").stdout
        self.ok("charged to team-a's entitlement like a GpuSlice's claim (kubectl describe quota):")
        self.show("\n".join(line for line in quota.splitlines() if "v100-8g" in line))
        self.kubectl("delete", "deployment", "chart", "-n", "team-a", "--wait=true", user=alice)
        self.wait(
            f"GpuSlice team-a/{pod} to go with its pod",
            lambda: self.get(c.SLICE_PLURAL, pod, "-n", "team-a") is None,
        )
        self.ok("Deployment deleted: its pod's GpuSlice and claim went with the pod, the slice is free again")

    def hand_written_template(self, alice: Path) -> None:
        self.step("Lesson 2: a hand-written claim template that is not of the documented form")
        template = yaml.safe_dump_all(_manifests("wrong-claim-template.yaml"))
        proc = self.kubectl("create", "-f", "-", user=alice, input=template)
        if proc.returncode == 0:
            raise DemoError(
                "the malformed claim template was accepted; the admission policies are not working"
            )
        self.ok("rejected, and the message shows the expected form:")
        self.show(textwrap.fill(proc.stderr.strip(), 100))

    def allocate(self, alice: Path) -> None:
        self.step("The documented way: GpuSlice team-a/llm (v100-8g) and a pod that uses its claim")
        proc = self.kubectl(
            "apply",
            "-f",
            "-",
            user=alice,
            input=self.workload("team-a", "llm", "v100-8g", pod="llm-worker"),
        )
        if proc.returncode != 0:
            raise DemoError(f"creating the slice failed: {proc.stderr}")
        if proc.stderr.strip():
            self.show(proc.stderr.strip(), prefix="      warning | ")
        status = self.wait_phase("team-a", "llm", ("InUse", "Allocated"))
        self.ok(
            f"{status['phase']}: GPU {status.get('gpuUUID')} on node {status.get('node')}, "
            f"device {status.get('device')}"
        )

    def exec(self, ns: str, pod: str, *command: str, user: Path | None = None) -> str:
        proc = self.kubectl("exec", "-n", ns, pod, "--", *command, user=user)
        if proc.returncode != 0:
            raise DemoError(f"kubectl exec {pod} -- {' '.join(command)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def inside_the_container(self, alice: Path) -> None:
        self.kubectl("wait", "--for=condition=Ready", "pod/llm-worker", "-n", "team-a", "--timeout=90s")
        self.step(
            "Lesson 7: inside the pod, through the shim (kubelet -> agent -> CDI -> containerd -> runc)"
        )
        self.ok(
            "kubectl exec llm-worker -- gpuslice-probe smi   (as nvidia-smi --query-gpu=name,memory.total):"
        )
        self.show(self.exec("team-a", "llm-worker", "gpuslice-probe", "smi", user=alice))
        self.step("Memory is enforced: allocations past the 8 GiB slice are refused")
        self.show(
            self.exec("team-a", "llm-worker", "gpuslice-probe", "alloc", "4Gi", "3Gi", "2Gi", user=alice)
        )
        self.ok("4 + 3 GiB fit in the slice; 2 GiB more would pass 8 GiB and never reaches the driver")
        attack = "echo > /etc/ld.so.preload; rm /etc/ld.so.preload; echo > /etc/gpuslice/slice.conf"
        proc = self.kubectl("exec", "-n", "team-a", "llm-worker", "--", "sh", "-c", attack, user=alice)
        self.ok("the container's root cannot take the shim out or raise its limit (read-only bind mounts):")
        self.show(proc.stderr)

    def capacity_wait(self, bob: Path) -> None:
        self.step("Quota is an entitlement, not a reservation: fill every V100, then ask for one more")
        names: list[str] = []
        # Each v100-32g takes a whole card; with one card already holding team-a's 8g slice, all but
        # one card can take a 32g slice, and the next one must wait.
        for i in range(self.nodes):
            name = f"big-{i}"
            names.append(name)
            self.kubectl(
                "apply",
                "-f",
                "-",
                user=bob,
                input=self.workload("team-b", name, "v100-32g", "16Gi"),
            )
        waiting = names[-1]
        for name in names[:-1]:
            st = self.wait_phase("team-b", name, ("InUse", "Allocated"))
            self.ok(f"team-b/{name}: {st['phase']} on {st.get('node')}")
        st = self.wait_phase("team-b", waiting, ("Pending",))
        st = self.wait(
            f"the operator to tell why team-b/{waiting} waits",
            lambda: (s := self.slice_status("team-b", waiting)).get("reason") == "AllGpusFull" and s,
        )
        self.ok(f"team-b/{waiting}: {st['phase']} ({st.get('reason')}):")
        self.show(textwrap.fill(str(st.get("message")), 100))
        from gpuslice.explain import explain

        self.show(
            explain(self.get(c.SLICE_PLURAL, waiting, "-n", "team-b"), self.get(c.PACKAGE_PLURAL, "v100-32g"))
        )
        if self.nodes > 1:
            freed = names[0]
            self.ok(f"deleting team-b/{freed} (pod and slice) frees a card ...")
            self.kubectl("delete", "pod", freed, "-n", "team-b", "--grace-period=0", "--force", user=bob)
            self.kubectl("delete", c.SLICE_PLURAL, freed, "-n", "team-b", user=bob)
            st = self.wait_phase("team-b", waiting, ("InUse", "Allocated"), timeout=120)
            self.ok(f"team-b/{waiting} started by itself: {st['phase']} on {st.get('node')}")

    def usage(self) -> None:
        self.step("Real usage in status: the workload holds 3 GiB of its slice for a while")
        hold = subprocess.Popen(
            self.cluster.kubectl_argv(
                "exec", "-n", "team-a", "llm-worker", "--", "gpuslice-probe", "hold", "3Gi", "60"
            ),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            st = self.wait(
                "the agent to report usage into GpuSlice team-a/llm",
                lambda: (
                    ((s := self.slice_status("team-a", "llm")).get("usage") or {}).get("memoryUsedBytes", 0)
                    >= 3 * c.GIB
                    and s
                ),
                timeout=60,
            )
        finally:
            self.kubectl("exec", "-n", "team-a", "llm-worker", "--", "killall", "gpuslice-probe")
            hold.wait(timeout=30)
        u = st["usage"]
        self.ok(
            f"status.usage: {u['memoryUsedBytes'] / c.GIB:.1f} GiB "
            f"of {u['memoryLimitBytes'] / c.GIB:.0f} GiB used, "
            f"{len(u.get('processes') or [])} process(es), read at {u.get('time')}"
        )

    def bypass(self) -> None:
        from gpuslice_dev.devcluster.node_agents import fake_gpu_config
        from gpuslice_dev.gpusim import simulate
        from gpuslice_dev.gpusim.build import ensure_built

        self.step(
            "Isolation is best-effort: a process that bypasses the shim is caught by the agent's NVML check"
        )
        node = self.slice_status("team-a", "llm")["node"]
        built = ensure_built()
        # A process on the node's card without libgpuslice.so (here on the host, outside any pod):
        # nothing limits it, and the driver shows its memory to the agent.
        env = {**os.environ, **simulate.fake_driver_env(fake_gpu_config(self.cluster, node), built.fake_dir)}
        holder = subprocess.Popen(
            [str(built.tests_dir / "cuda_probe"), "hold", str(12 * c.GIB)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            cond = self.wait(
                "the MemoryIsolated condition of team-a/llm to turn False",
                lambda: next(
                    (
                        x
                        for x in self.slice_status("team-a", "llm").get("conditions") or []
                        if x["type"] == "MemoryIsolated" and x["status"] == "False"
                    ),
                    None,
                ),
                timeout=60,
            )
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=30)
        self.ok(f"condition MemoryIsolated=False ({cond['reason']}):")
        self.show(textwrap.fill(cond["message"], 100))
        events = self.kubectl(
            "get", "events", "-n", "team-a", "--field-selector", "reason=SliceMemoryViolation",
            "-o", "custom-columns=TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name",
        )  # fmt: skip
        self.show(events.stdout)
        self.ok(
            "a host process is reported, never stopped; a pod's own process past its slice is stopped "
            "(GpuPackage spec.isolation.onViolation: Stop, the default)"
        )

    def tables(self) -> None:
        self.step("What tenants and the platform team see")
        self.show(self.kubectl("get", "gpuslices", "-A").stdout)
        self.show(self.kubectl("get", "gpupackages").stdout)

    def next_steps(self) -> None:
        dir_flag = "" if self.cluster.dir == _default_dir() else f" --dir {self.cluster.dir}"
        # Print runnable paths: under `make demo` neither the venv nor the kubectl cache is on PATH.
        gs = shutil.which("gpuslice") or str(Path(sys.executable).parent / "gpuslice")
        # The devcluster is the dev tooling's command, not the product's.
        dev = shutil.which("gpuslice-dev") or str(Path(sys.executable).parent / "gpuslice-dev")
        skipped = lessons_skipped(self.platform) if self.platform is not None else {}
        tries = try_lines(skipped, kubectl=str(self.cluster.bins.kubectl), gs=gs, nodes=self.nodes)
        lines = "\n".join(f"  {line}" for line in tries)
        print(
            f"""
The cluster is still running. Try:
  export KUBECONFIG={self.cluster.kubeconfig}
{lines}
Stop everything with:  {dev} devcluster down{dir_flag}
""",
            flush=True,
        )


def _default_dir() -> Path:
    from gpuslice_dev.devcluster.cluster import default_dir

    return default_dir().resolve()


def _manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEMO_MANIFESTS / name).read_text()) if d]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole product locally on simulated GPUs and play the field report",
        description=__doc__,
    )
    p.add_argument("--dir", type=Path, default=None, help="devcluster state directory")
    p.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="V100s per node (default 1)")
    p.add_argument(
        "--kubernetes",
        default=None,
        metavar="MINOR",
        help="Kubernetes minor: 1.35, 1.36 or 1.37 (default: $GPUSLICE_KUBERNETES, else 1.37); the demo "
        "says what that minor cannot do and leaves out the lessons it cannot play",
    )
    p.add_argument(
        "--feature-gates",
        default="",
        metavar="GATES",
        help="feature gates on top of the minor's own set, e.g. DRADeviceTaintRules=false",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gpuslice_dev.devcluster.binaries import BuildError
    from gpuslice_dev.devcluster.cluster import DevClusterError

    if args.nodes < 1 or args.gpus_per_node < 1:
        print("error: --nodes and --gpus-per-node must be at least 1", file=sys.stderr)
        return 2
    demo = Demo(
        args.dir, args.nodes, args.gpus_per_node, kubernetes=args.kubernetes, feature_gates=args.feature_gates
    )
    try:
        demo.run()
    except (DemoError, DevClusterError, BuildError) as exc:
        print(f"\ndemo failed at step {demo.step_no}: {exc}", file=sys.stderr)
        print(
            f"logs: {demo.cluster.dir / 'logs'}; the cluster is left running for inspection "
            "(gpuslice-dev devcluster down to stop it)",
            file=sys.stderr,
        )
        return 1
    return 0
