"""Leader election cost: seconds from killing the active operator (SIGKILL) to the standby acting.

    .venv/bin/python bench/operator_failover.py [--peering-lifetime 10] [--json]

Starts a fresh `gpuslice-dev devcluster`, Kopf's peering CRD and the ClusterKopfPeering `gpuslice`, and two
`gpuslice operator --peering` replicas (priorities 200 and 100). Once the standby has paused, it kills
the active replica with SIGKILL (no goodbye in the peering object), creates a GpuPackage at once and
measures until its DeviceClass exists: only the standby can have written it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster

REPO = Path(__file__).resolve().parents[1]
MODEL = "Tesla V100-PCIE-32GB"


def package(name: str) -> str:
    doc = {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND, "metadata": {"name": name},
           "spec": {"gpuModel": MODEL, "fraction": 25}}  # fmt: skip
    return json.dumps(doc)


def wait(check: object, timeout: float, what: str, interval: float = 0.1) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return time.monotonic()
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--peering-lifetime", type=int, default=None, help="passed to both replicas")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gs-failover-"))
    cluster = DevCluster(workdir, progress=lambda m: print(m, file=sys.stderr))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        cluster.up(nodes=1)
        cluster.apply_crds()
        cluster.apply(REPO / "manifests" / "crds" / "kopf-peering-crd.yaml")
        cluster.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev"
        )
        cluster.apply(REPO / "manifests" / "base" / "operator" / "peering.yaml")
        extra = [f"--peering-lifetime={args.peering_lifetime}"] if args.peering_lifetime else []
        for name, priority in (("active", 200), ("standby", 100)):
            log = (workdir / f"{name}.log").open("ab")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gpuslice", "operator", f"--kubeconfig={cluster.kubeconfig}",
                 "--peering", f"--priority={priority}", *extra],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "POD_ID": name,
                     "PYTHONPATH": str(REPO / "operator")},
            )  # fmt: skip

        def exists(kind: str, name: str) -> bool:
            return cluster.kubectl("get", kind, name, check=False).returncode == 0

        cluster.apply(package("before"))
        wait(lambda: exists("deviceclass", c.device_class_name("before")), 120, "the active replica")
        wait(
            lambda: (
                "Pausing operations in favour of" in (workdir / "standby.log").read_text(errors="replace")
            ),
            120,
            "the standby pausing",
        )
        procs["active"].send_signal(signal.SIGKILL)
        procs["active"].wait()
        killed = time.monotonic()
        cluster.apply(package("after"))
        acted = wait(lambda: exists("deviceclass", c.device_class_name("after")), 300, "the standby acting")
        seconds = round(acted - killed, 1)
        report = {"peering_lifetime": args.peering_lifetime or "default", "kill_to_standby_acting_s": seconds}
        print(
            json.dumps(report)
            if args.json
            else f"SIGKILL of the active replica -> standby acted: {seconds} s"
        )
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        cluster.down()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
