"""Without a cluster: the Dockerfile and the Docker-less build describe the same image, the devcluster
overlay renders what the real-node test relies on, and the operator's in-cluster login follows the
service environment."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from gpuslice.operator.run import _in_cluster
from gpuslice_dev import image
from gpuslice_dev.devcluster import deploy
from gpuslice_dev.devcluster.binaries import ensure_binaries

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def final_stage() -> str:
    return DOCKERFILE.rsplit("\nFROM ", 1)[1]


def test_dockerfile_builds_what_the_dockerless_build_builds() -> None:
    stage = final_stage()
    assert stage.startswith(f"debian:{image.SUITE}-slim\n")
    installed = re.search(r"apt-get install -y --no-install-recommends ([^\n\\]+)", stage)
    assert installed and sorted(installed.group(1).split()) == sorted(image.PACKAGES)
    assert f"COPY --from=build {image.VENV} {image.VENV}" in stage
    assert f"/src/shim/build/libgpuslice.so {image.SHIM_IN_IMAGE}" in stage
    assert f"USER {image.USER}" in stage
    assert f"ENTRYPOINT {list(image.ENTRYPOINT)!r}".replace("'", '"') in stage
    assert f"nonroot:x:{image.UID}:{image.UID}::/nonexistent:/usr/sbin/nologin" in stage
    env = dict(e.split("=", 1) for e in image.ENV)
    for key, value in env.items():
        assert f"{key}={value}" in stage, key
    # both install the same pinned dependencies, without resolving anything else
    assert "-r /src/image/requirements.txt" in DOCKERFILE and "--no-deps" in DOCKERFILE
    assert f"SOURCE_DATE_EPOCH={image.SOURCE_DATE_EPOCH}" in DOCKERFILE
    assert "pip uninstall --yes pip setuptools" in DOCKERFILE


def test_requirements_pin_every_runtime_dependency() -> None:
    import tomllib

    pins = {ln.split("==")[0] for ln in image.requirements()}
    assert all("==" in ln for ln in image.requirements())
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~\[ ]", dep, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} is a dependency of gpuslice but not pinned in image/requirements.txt"


def test_image_key_covers_the_wheel_sources() -> None:
    first = image.source_hash()
    assert first == image.source_hash()
    files = image._source_files()
    assert REPO / "operator" / "gpuslice" / "cli.py" in files
    assert not [f for f in files if "__pycache__" in f.parts]


def render(directory: Path) -> list[dict[str, Any]]:
    kubectl = ensure_binaries().kubectl
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def workload(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["namespace"] == deploy.NAMESPACE]
    return doc


def test_devcluster_overlay_uses_the_local_image_and_no_nvidia_runtime() -> None:
    docs = render(REPO / "manifests" / "overlays" / "devcluster")
    operator = workload(docs, "Deployment")["spec"]["template"]["spec"]
    agent = workload(docs, "DaemonSet")["spec"]["template"]["spec"]
    for spec in (operator, agent):
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"] == image.IMAGE_REF and c["imagePullPolicy"] == "Never", c["name"]
        (main,) = spec["containers"]
        assert {"name": "KUBERNETES_SERVICE_HOST", "value": deploy.API_HOST} in main["env"]
        assert not spec.get("hostNetwork")
    assert "runtimeClassName" not in agent
    assert {"key": "gpuslice.io/gpu", "operator": "Exists", "effect": "NoExecute"} in operator["tolerations"]


def test_generated_agent_patch_mounts_every_host_path_at_itself(tmp_path: Path) -> None:
    dirs = {k: tmp_path / k for k in ("state", "run", "cdi", "nvidia-cdi", "plugins", "registry", "shim")}
    config = tmp_path / "gpu" / "driver" / "fake-gpus.conf"
    ops = deploy.agent_patch(dirs, config, tmp_path / "fake")
    by_path = {op["path"].rsplit("/", 1)[-1]: op for op in ops if op["op"] == "replace"}
    volumes = {v["name"]: v for v in by_path["volumes"]["value"]}
    for mount in by_path["volumeMounts"]["value"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            assert volume["hostPath"]["path"] == mount["mountPath"], mount
    args = by_path["args"]["value"]
    assert f"--shim-library={dirs['shim'] / 'libgpuslice.so'}" in args
    assert f"--plugins-dir={dirs['plugins']}" in args
    env = {op["value"]["name"]: op["value"]["value"] for op in ops if op["op"] == "add"}
    assert env == {
        "GPUSLICE_FAKE_GPU_CONFIG": str(config),
        "LD_LIBRARY_PATH": str(tmp_path / "fake"),
        # the simulated driver's /proc files and the simulated toolkit's CDI spec (MIG claims)
        "GPUSLICE_PROC_ROOT": str(config.parent / "proc"),
        "GPUSLICE_NVIDIA_CDI_DIRS": str(tmp_path / "nvidia-cdi"),
        # the simulated cards' sysfs (PCIe root, NUMA node), laid out beside /proc
        "GPUSLICE_SYS_ROOT": str(config.parent / "sys"),
    }


def test_operator_login_follows_the_service_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    info = kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="t")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert _in_cluster(info) == info
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "kubernetes")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    assert _in_cluster(info) == kopf.ConnectionInfo(server="https://kubernetes:6443", token="t")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert _in_cluster(info).server == "https://[fd00::1]:6443"  # type: ignore[union-attr]
    assert _in_cluster(None) is None
