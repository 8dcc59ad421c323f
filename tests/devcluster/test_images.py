"""The pause and probe images: valid archives that containerd imports, and a probe rootfs that runs.

The archives come from `ensure_images()` (the shared cache, as `devcluster up` uses it); one test
builds them again into an empty cache to see the build itself and that it is reproducible.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuslice_dev.devcluster import images
from gpuslice_dev.devcluster.images import PAUSE_IMAGE, PROBE_IMAGE, ImageArchive, ensure_images
from gpuslice_dev.devcluster.node_binaries import NodeBinaries, ensure_node_binaries
from gpuslice_dev.gpusim.build import ShimPaths, ensure_built
from gpuslice_dev.gpusim.runner import prepare
from gpuslice_dev.gpusim.simulate import parse_gpu_spec, start_fake_driverd, write_fake_config

LIB_DIR = f"usr/lib/{images.multiarch_triplet()}"


@dataclass
class Archive:
    """A docker-archive read back: manifest, config and the one layer's members by path."""

    manifest: dict[str, object]
    config: dict[str, object]
    config_blob: bytes
    layer_gz: bytes
    members: dict[str, tarfile.TarInfo]
    names_in_order: list[str]


def read_archive(path: Path) -> Archive:
    with tarfile.open(path) as outer:
        manifests = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert len(manifests) == 1, manifests
        manifest = manifests[0]
        config_blob = outer.extractfile(manifest["Config"]).read()  # type: ignore[union-attr]
        assert len(manifest["Layers"]) == 1
        layer_gz = outer.extractfile(manifest["Layers"][0]).read()  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer_gz))) as layer:
        infos = layer.getmembers()
    return Archive(
        manifest=manifest,
        config=json.loads(config_blob),
        config_blob=config_blob,
        layer_gz=layer_gz,
        members={i.name.rstrip("/"): i for i in infos},
        names_in_order=[i.name.rstrip("/") for i in infos],
    )


@pytest.fixture(scope="module")
def node() -> NodeBinaries:
    return ensure_node_binaries()


@pytest.fixture(scope="module")
def built() -> ShimPaths:
    return ensure_built()


@pytest.fixture(scope="module")
def archives(node: NodeBinaries, built: ShimPaths) -> dict[str, ImageArchive]:
    found = ensure_images()
    assert [a.ref for a in found] == [PAUSE_IMAGE, PROBE_IMAGE]
    return {a.ref: a for a in found}


@pytest.fixture(scope="module")
def probe(archives: dict[str, ImageArchive]) -> Archive:
    return read_archive(archives[PROBE_IMAGE].path)


@pytest.fixture(scope="module")
def pause(archives: dict[str, ImageArchive]) -> Archive:
    return read_archive(archives[PAUSE_IMAGE].path)


# ------------------------------------------------------------------------------------ the archives


@pytest.mark.parametrize("ref", [PAUSE_IMAGE, PROBE_IMAGE])
def test_archives_are_docker_archives_tagged_with_their_ref(
    archives: dict[str, ImageArchive], ref: str
) -> None:
    archive = archives[ref]
    assert archive.path.is_file()
    assert archive.path.parent == images.images_dir() / archive.key
    a = read_archive(archive.path)
    assert a.manifest["RepoTags"] == [ref]
    # the config blob is named by its digest, and its diff_id is the uncompressed layer's digest
    assert a.manifest["Config"] == "sha256:" + hashlib.sha256(a.config_blob).hexdigest()
    diff_id = "sha256:" + hashlib.sha256(gzip.decompress(a.layer_gz)).hexdigest()
    assert a.config["rootfs"] == {"type": "layers", "diff_ids": [diff_id]}
    assert (a.config["os"], a.config["architecture"]) == tuple(images.image_platform().split("/"))
    assert a.config["config"]["Labels"]["io.gpuslice.image.key"] == archive.key  # type: ignore[index]


def test_layers_are_reproducible_tarballs(probe: Archive, pause: Archive) -> None:
    for a in (probe, pause):
        assert a.names_in_order == sorted(a.names_in_order)
        for info in a.members.values():
            assert (info.uid, info.gid, info.mtime, info.uname, info.gname) == (0, 0, 0, "", ""), info.name


def test_probe_image_holds_the_probe_busybox_and_the_glibc_runtime(probe: Archive) -> None:
    m = probe.members
    assert m["usr/local/bin/gpuslice-probe"].isfile() and m["usr/local/bin/gpuslice-probe"].mode == 0o755
    # the same view through NVIDIA's runtime, which the image carries as CUDA application images do
    assert m["usr/local/bin/gpuslice-cudart-probe"].isfile()
    assert m["lib/x86_64-linux-gnu/libcudart.so.12"].isfile()
    assert m["bin/busybox"].isfile()
    applets = ("sh", "cat", "awk", "ls", "ps", "echo", "sleep", "id", "touch", "rm", "mount", "grep", "env")
    for applet in applets:
        assert m[f"bin/{applet}"].issym() and m[f"bin/{applet}"].linkname == "busybox", applet
    # the dynamic loader at the path the probe names (PT_INTERP), and the libraries it needs
    loader = m["lib64/ld-linux-x86-64.so.2"]
    assert loader.issym()
    assert (
        os.path.normpath(os.path.join("lib64", loader.linkname))
        == "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    )
    for lib in ("ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6"):
        assert m[f"lib/x86_64-linux-gnu/{lib}"].isfile(), lib
    assert m[LIB_DIR].isdir()  # where the CDI spec mounts the driver's libraries
    assert m["tmp"].isdir() and m["tmp"].mode == 0o1777
    assert m["etc/passwd"].isfile() and m["etc/group"].isfile()


def test_probe_image_leaves_the_driver_the_shim_and_the_preload_to_cdi(probe: Archive) -> None:
    names = {os.path.basename(n) for n in probe.members}
    assert (
        not {"libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so", "libgpuslice.so"} & names
    )
    assert "etc/ld.so.preload" not in probe.members
    assert "etc/ld.so.cache" not in probe.members  # glibc falls back to its system search path


def test_image_configs(probe: Archive, pause: Archive) -> None:
    p = probe.config["config"]
    assert p["Cmd"] == ["sh"] and "Entrypoint" not in p  # type: ignore[operator,index]
    assert p["Env"] == [images.IMAGE_PATH_ENV]  # type: ignore[index]
    assert "User" not in p  # type: ignore[operator]
    q = pause.config["config"]
    assert q["Entrypoint"] == ["/pause"] and "Cmd" not in q  # type: ignore[operator,index]
    assert q["User"] == "65535:65535"  # type: ignore[index]
    assert pause.members["pause"].isfile() and pause.members["pause"].mode == 0o755
    assert set(pause.members) == {"pause"}


# ----------------------------------------------------------------------------------------- caching


def test_a_second_call_rebuilds_nothing(
    archives: dict[str, ImageArchive], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {ref: a.path.stat().st_mtime_ns for ref, a in archives.items()}

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("ensure_images rebuilt an image whose inputs did not change")

    monkeypatch.setattr(images, "_build_one", no_build)
    monkeypatch.setattr(images, "local_registry", no_build)
    started = time.monotonic()
    again = ensure_images()
    elapsed = time.monotonic() - started
    assert {a.ref: a.path for a in again} == {ref: a.path for ref, a in archives.items()}
    assert {a.ref: a.path.stat().st_mtime_ns for a in again} == before
    assert elapsed < 10, f"a warm ensure_images took {elapsed:.1f}s"


def test_a_cold_build_is_reproducible_and_keyed_by_content(
    archives: dict[str, ImageArchive],
    node: NodeBinaries,
    built: ShimPaths,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # node binaries already resolved
    specs = images.image_specs(built, node)
    messages: list[str] = []
    started = time.monotonic()
    cold = images.build_images(specs, node.crane, progress=messages.append)
    assert time.monotonic() - started < 120
    assert any(m.startswith("images ready in") for m in messages), messages
    for a in cold:
        assert a.path.is_relative_to(tmp_path / "cache" / "gpuslice" / "images")
        shared = archives[a.ref]
        assert a.key == shared.key
        assert a.path.read_bytes() == shared.path.read_bytes(), f"{a.ref} differs between two builds"
    assert not [
        p for p in (tmp_path / "cache" / "gpuslice" / "images").iterdir() if p.name.startswith(".build-")
    ]

    # any byte of any input changes the key; the same inputs keep it
    probe_spec = specs[1]
    assert probe_spec.key() == images.probe_spec(built).key()
    changed = images.ImageSpec(
        ref=probe_spec.ref,
        name=probe_spec.name,
        entries=tuple(
            images.Entry(e.path, e.kind, e.mode, data=b"other passwd\n") if e.path == "etc/passwd" else e
            for e in probe_spec.entries
        ),
        cmd=probe_spec.cmd,
        labels=probe_spec.labels,
    )
    assert changed.key() != probe_spec.key()
    assert (
        images.ImageSpec(ref=probe_spec.ref, name="probe", entries=probe_spec.entries).key()
        != probe_spec.key()
    )


def test_runtime_libraries_leave_out_the_driver(built: ShimPaths) -> None:
    libs, loader = images.runtime_libraries([images.probe_binary(built), built.shim, built.fake_cuda])
    assert loader == "/lib64/ld-linux-x86-64.so.2"
    assert "libc.so.6" in libs and "libm.so.6" in libs  # the shim needs libm
    assert not set(libs) & images.DRIVER_SONAMES


# ------------------------------------------------------------------------- containerd and runc, real


def _fake_gpu_dir(tmp_path: Path) -> Path:
    """A fake V100 description in its own directory (the double keeps its state beside it)."""
    gpu_dir = tmp_path / "gpu"
    write_fake_config(
        parse_gpu_spec("1x Tesla V100-PCIE-32GB", seed="images-test"), gpu_dir / "fake-gpus.conf"
    )
    return gpu_dir


@pytest.fixture
def containerd(node: NodeBinaries, tmp_path: Path) -> Iterator[Path]:
    """A private containerd (its own root, state and socket; no CRI) for ctr; yields its socket."""
    if not node.containerd.is_file():
        pytest.skip(f"containerd is not built yet at {node.containerd}")
    base = Path(f"/tmp/gs-ctd-{os.getpid()}-{tmp_path.name[-12:]}")  # short: unix socket paths are limited
    base.mkdir(parents=True)
    sock = base / "containerd.sock"
    config = base / "config.toml"
    config.write_text(
        "version = 3\n"
        f"root = '{base}/root'\nstate = '{base}/state'\nimports = []\n"
        "disabled_plugins = ['io.containerd.grpc.v1.cri', 'io.containerd.cri.v1.runtime',"
        " 'io.containerd.cri.v1.images', 'io.containerd.podsandbox.controller.v1.podsandbox']\n"
        f"[grpc]\n  address = '{sock}'\n[ttrpc]\n  address = '{sock}.ttrpc'\n"
        f"[plugins.'io.containerd.internal.v1.opt']\n  path = '{base}/opt'\n"
    )
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, node.bin_dirs), os.environ.get("PATH", "")])}
    with (base / "containerd.log").open("w") as log:
        proc = subprocess.Popen(
            [str(node.containerd), "--config", str(config)], stdout=log, stderr=log, env=env
        )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, (base / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.1)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["umount", "-R", str(base / "root")], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _ctr(
    node: NodeBinaries, sock: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(node.ctr), "--address", str(sock), "--namespace", "k8s.io", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_ctr_imports_both_archives_and_runs_the_probe_with_the_driver_mounted(
    archives: dict[str, ImageArchive], node: NodeBinaries, built: ShimPaths, containerd: Path, tmp_path: Path
) -> None:
    for archive in archives.values():
        result = _ctr(node, containerd, "images", "import", str(archive.path))
        assert result.returncode == 0, result.stderr
    listed = _ctr(node, containerd, "images", "ls", "-q")
    assert set(listed.stdout.split()) == {PAUSE_IMAGE, PROBE_IMAGE}
    check = _ctr(node, containerd, "images", "check")
    for ref in (PAUSE_IMAGE, PROBE_IMAGE):
        line = next(line for line in check.stdout.splitlines() if line.startswith(ref + " "))
        assert "complete (2/2)" in line and line.split()[-1] == "true", line  # content complete, unpacked

    if not node.runc.is_file():
        pytest.skip(f"runc is not built yet at {node.runc}: imported, not run")
    gpu_dir = _fake_gpu_dir(tmp_path)
    run = _ctr(
        node, containerd, "run", "--rm",
        "--env", "GPUSLICE_FAKE_GPU_CONFIG=/run/fake-gpu/fake-gpus.conf",
        "--mount", f"type=bind,src={built.fake_cuda},dst=/{LIB_DIR}/libcuda.so.1,options=rbind:ro",
        "--mount", f"type=bind,src={built.fake_nvml},dst=/{LIB_DIR}/libnvidia-ml.so.1,options=rbind:ro",
        "--mount", f"type=bind,src={gpu_dir},dst=/run/fake-gpu,options=rbind:rw",
        PROBE_IMAGE, f"gs-probe-{os.getpid()}", "sh", "-c", "gpuslice-probe smi && echo pid=$$",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["Tesla V100-PCIE-32GB, 32768 MiB", "pid=1"]


def _extract_rootfs(archive: Path, rootfs: Path) -> None:
    a = read_archive(archive)
    rootfs.mkdir(parents=True)
    layer = rootfs.parent / "layer.tar.gz"
    layer.write_bytes(a.layer_gz)
    subprocess.run(["tar", "-xzf", str(layer), "-C", str(rootfs), "--numeric-owner"], check=True)


def _bind(src: Path | str, dst: str, ro: bool = True) -> dict[str, object]:
    return {
        "type": "bind",
        "source": str(src),
        "destination": dst,
        "options": ["rbind", "ro" if ro else "rw"],
    }


def test_the_probe_rootfs_runs_in_runc_with_the_shim_preloaded_as_cdi_would(
    archives: dict[str, ImageArchive], node: NodeBinaries, built: ShimPaths, tmp_path: Path
) -> None:
    """CDI's part played by hand: the double's libraries in /usr/lib/<triplet>, the shim named in a
    read-only /etc/ld.so.preload, the limits file; the double's host-side daemon gives host PIDs."""
    if not node.runc.is_file():
        pytest.skip(f"runc is not built yet at {node.runc} (node_binaries builds it)")
    bundle = tmp_path / "bundle"
    _extract_rootfs(archives[PROBE_IMAGE].path, bundle / "rootfs")
    s = prepare(memory_bytes=8 << 30, simulate_gpus="1x Tesla V100-PCIE-32GB", seed="images-test",
                workdir=tmp_path / "slice", built=built)  # fmt: skip
    preload = tmp_path / "ld.so.preload"
    preload.write_text(f"{s.shim}\n")
    subprocess.run([str(node.runc), "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = [
        "sh", "-c",
        "gpuslice-probe smi; gpuslice-probe alloc 8Gi 1; echo pid=$$; "
        "echo x > /etc/ld.so.preload 2>/dev/null && echo preload-writable; ls /usr/lib/*-linux-gnu",
    ]  # fmt: skip
    spec["process"]["env"] += [f"GPUSLICE_FAKE_GPU_CONFIG={s.workdir / 'fake-gpus.conf'}"]
    spec["mounts"] += [
        _bind(built.fake_cuda, f"/{LIB_DIR}/libcuda.so.1"),
        _bind(built.fake_nvml, f"/{LIB_DIR}/libnvidia-ml.so.1"),
        _bind(preload, "/etc/ld.so.preload"),
        _bind(s.workdir, str(s.workdir), ro=False),  # the patched shim, limits file, usage, fake GPUs
    ]
    # the GPU's device node, as the NVIDIA CDI spec brings it: the double's daemon serves a process of
    # another root only GPUs whose /dev/nvidia<minor> it has (a real driver: none without it)
    assert s.fake_gpus
    minor = s.fake_gpus[0].minor
    spec["linux"]["devices"] = [
        {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor, "fileMode": 0o666}
    ]
    spec["linux"]["resources"]["devices"].append({"allow": True, "type": "c", "major": 195, "access": "rwm"})
    (bundle / "config.json").write_text(json.dumps(spec))
    state = tmp_path / "runc-state"
    cid = f"gs-images-{os.getpid()}"
    driverd = start_fake_driverd(s.workdir / "fake-gpus.conf")
    try:
        result = subprocess.run(
            [str(node.runc), "--root", str(state), "run", "--bundle", str(bundle), cid],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(
            [str(node.runc), "--root", str(state), "delete", "--force", cid], capture_output=True, check=False
        )
        driverd.terminate()
        driverd.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "Tesla V100-PCIE-32GB, 8192 MiB",
        f"cuMemAlloc({8 << 30}) -> 0 CUDA_SUCCESS",
        "cuMemAlloc(1) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
        "pid=1",
        "libcuda.so.1",
        "libnvidia-ml.so.1",
    ]


def test_a_probe_is_rebuilt_when_a_header_it_includes_changes(tmp_path: Path) -> None:
    """The cudart probe includes probe/*.h: a change there alone must rebuild it, or the image keeps
    the old code while the source tree says otherwise."""
    source, header, out = tmp_path / "probe.c", tmp_path / "probe_file.h", tmp_path / "probe"
    for path, at in ((source, 100), (header, 100), (out, 200)):
        path.write_text("x")
        os.utime(path, (at, at))
    assert images.up_to_date(out, source)
    os.utime(header, (300, 300))
    assert not images.up_to_date(out, source)
