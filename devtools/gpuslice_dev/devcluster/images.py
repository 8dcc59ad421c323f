"""The two images a real node needs, built here without a Docker engine or a registry on the network.

- PAUSE_IMAGE: the static pause binary that node_binaries compiles from the Kubernetes module's own
  `build/pause/linux/pause.c`; entrypoint ["/pause"], user 65535:65535, as upstream ships it.
- PROBE_IMAGE: a tenant's view of a slice: `/usr/local/bin/gpuslice-probe` (dynamically linked
  against glibc, libcuda.so.1 and libnvidia-ml.so.1 by SONAME), `/usr/local/bin/gpuslice-cudart-probe`
  (the same view through NVIDIA's CUDA runtime: linked against libcudart.so.12 from its PyPI wheel,
  which the image carries as CUDA application images do), Debian's static busybox with its
  applets in /bin, and the glibc runtime that the probe, the shim and the driver test double need
  (from the host's ldd, the dynamic loader included). The driver's own libraries, the shim and
  /etc/ld.so.preload are NOT in the image: the CDI spec mounts them at run time, as on a GPU node
  (the driver libraries into /usr/lib/<triplet>/, which the loader searches by default).

Each image is one reproducible layer (sorted entries, mtime 0, owner 0:0) written by this module and
turned into an image by crane (go-containerregistry): `crane append` pushes it to a throw-away
`crane registry serve` on 127.0.0.1, `crane mutate` sets the config and writes a docker-archive
tarball, which `ctr -n k8s.io images import FILE` accepts. Archives are cached by content under
`<cache>/gpuslice/images/<key>/<name>.tar`, the key being the sha256 of everything that goes in
(every file's path, mode and bytes, the config, crane's version and this builder's format).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_dev.devcluster.binaries import BuildError, Progress, cache_root, default_progress
from gpuslice_dev.devcluster.node_binaries import CRANE_VERSION, NodeBinaries, ensure_node_binaries
from gpuslice_dev.gpusim.build import ShimPaths, ensure_built
from gpuslice_dev.paths import SHIM_SOURCE_DIR

PAUSE_IMAGE = "localhost/gpuslice/pause:3.10"
PROBE_IMAGE = "localhost/gpuslice/probe:dev"
#: Where the probe lives in its image (on PATH).
PROBE_PATH_IN_IMAGE = "/usr/local/bin/gpuslice-probe"
#: The probe on NVIDIA's CUDA runtime (shim/probe/gpuslice_cudart_probe.c), beside it.
CUDART_PROBE_PATH_IN_IMAGE = "/usr/local/bin/gpuslice-cudart-probe"
#: Kernel images for `gpuslice-cudart-probe kernels`: what a CUDA 12 build for Volta carries (sm_70 code
#: and compute_70 PTX) and what a build without Volta carries (sm_75/sm_90 code, compute_90 PTX, as
#: CUDA 13 builds do), assembled by NVIDIA's ptxas; each has the kernels `empty` and `fill`.
KERNEL_IMAGES_IN_IMAGE = "/usr/local/share/gpuslice"
#: Bump when this module changes what it writes for the same inputs.
BUILDER_VERSION = "1"
BUSYBOX = Path("/bin/busybox")
#: The driver's libraries: mounted into the container by the CDI spec, never part of the image.
DRIVER_SONAMES = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
IMAGE_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclass(frozen=True)
class ImageArchive:
    ref: str  # e.g. "localhost/gpuslice/probe:dev", the name `ctr images import` gives it
    path: Path  # a docker-archive tarball (manifest.json, config blob, gzipped layer)
    key: str  # sha256 of the inputs; the archive lives in <cache>/gpuslice/images/<key>/


@dataclass(frozen=True)
class Entry:
    """One entry of an image layer. `path` is relative to the root, without a leading slash."""

    path: str
    kind: str  # "dir", "file" or "symlink"
    mode: int = 0o755
    source: Path | None = None  # a file's content comes from here ...
    data: bytes | None = None  # ... or is given
    target: str = ""  # a symlink's target

    def content(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.source is not None, self.path
        return self.source.read_bytes()


@dataclass(frozen=True)
class ImageSpec:
    ref: str
    name: str  # the archive's file name stem
    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: str = ""
    env: tuple[str, ...] = (IMAGE_PATH_ENV,)
    workdir: str = "/"
    labels: dict[str, str] = field(default_factory=dict)

    def key(self) -> str:
        h = hashlib.sha256()
        h.update(
            f"gpuslice-image\0{BUILDER_VERSION}\0crane {CRANE_VERSION}\0{self.ref}\0{self.name}\0".encode()
        )
        config = [list(self.entrypoint), list(self.cmd), self.user, list(self.env), self.workdir, self.labels]
        h.update(json.dumps(config, sort_keys=True).encode() + b"\0")
        for e in self.entries:
            h.update(f"{e.path}\0{e.kind}\0{e.mode:o}\0{e.target}\0".encode())
            if e.kind == "file":
                h.update(hashlib.sha256(e.content()).digest())
        return h.hexdigest()


def images_dir() -> Path:
    return cache_root() / "images"


def probe_binary(built: ShimPaths) -> Path:
    """Where `make -C shim` puts gpuslice-probe."""
    return built.tests_dir.parent / "probe" / "gpuslice-probe"


def up_to_date(out: Path, source: Path) -> bool:
    """`out` is newer than `source` and every header beside it (the probes include theirs)."""
    inputs = [source, *source.parent.glob("*.h")]
    return out.is_file() and out.stat().st_mtime >= max(p.stat().st_mtime for p in inputs)


def cudart_probe_binary(built: ShimPaths) -> Path:
    """gpuslice-cudart-probe, built against libcudart 12 from its wheel next to gpuslice-probe (once
    per change of its source or its headers; concurrent callers each build into a file of their own,
    then rename)."""
    from gpuslice_dev.gpusim.cudart import build_program

    source = SHIM_SOURCE_DIR / "probe" / "gpuslice_cudart_probe.c"
    out = probe_binary(built).parent / "gpuslice-cudart-probe"
    if up_to_date(out, source):
        return out
    staging = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        build_program(source, "12", staging)
    except RuntimeError as exc:
        raise BuildError(f"building {out.name}: {exc}") from exc
    os.replace(staging, out)
    return out


def kernel_images() -> dict[str, bytes]:
    """file name -> fatbin bytes of the probe image's kernel images (see KERNEL_IMAGES_IN_IMAGE)."""
    from gpuslice_dev.gpusim import kernels

    built = kernels.builds()
    return {f"kernels-{name}.fatbin": built[name] for name in ("sm70", "no-volta")}


def multiarch_triplet() -> str:
    return f"{platform.machine()}-linux-gnu"


def image_platform() -> str:
    machine = platform.machine()
    if machine not in _GOARCH:
        raise BuildError(f"building images for {machine} is not supported (only {', '.join(_GOARCH)})")
    return f"linux/{_GOARCH[machine]}"


# ------------------------------------------------------------------------------------------ layers


def with_parents(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    """The entries sorted by path, each missing parent directory added (0755)."""
    by_path: dict[str, Entry] = {}
    for e in entries:
        if e.path in by_path and by_path[e.path] != e:
            raise BuildError(f"two different entries for /{e.path} in one image")
        by_path[e.path] = e
    for path in list(by_path):
        parent = os.path.dirname(path)
        while parent and parent not in by_path:
            by_path[parent] = Entry(parent, "dir")
            parent = os.path.dirname(parent)
    return tuple(by_path[p] for p in sorted(by_path))


def write_layer(entries: Sequence[Entry], out: Path) -> None:
    """A reproducible layer tarball: entries in order, mtime 0, owner 0:0, no user or group names."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.path)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = e.mode
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif e.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = e.target
                tar.addfile(info)
            elif e.kind == "file":
                data = e.content()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                raise BuildError(f"unknown entry kind {e.kind!r} for /{e.path}")


# -------------------------------------------------------------------------------- the glibc runtime

_LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(\S+)\s+\(0x[0-9a-f]+\)\s*$")


def runtime_libraries(binaries: Sequence[Path]) -> tuple[dict[str, Path], str]:
    """What the loader maps for `binaries` on this host: ({soname: host file}, the loader's path).

    The driver's libraries (DRIVER_SONAMES) are left out whether found or not. ldd runs without
    LD_LIBRARY_PATH/LD_PRELOAD, so it sees what the host's system search path gives.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    libs: dict[str, Path] = {}
    loader = ""
    for binary in binaries:
        proc = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise BuildError(f"ldd {binary} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        for line in proc.stdout.splitlines():
            stripped = line.strip()
            if not stripped or stripped.startswith("linux-vdso") or stripped.startswith("linux-gate"):
                continue
            soname = stripped.split()[0]
            if soname in DRIVER_SONAMES:
                continue
            if "=> not found" in stripped:
                raise BuildError(f"{binary} needs {soname}, which this host does not have")
            match = _LDD_LINE.match(line)
            if not match:
                raise BuildError(f"cannot read ldd's line for {binary}: {line!r}")
            name, path = match.group(1), match.group(2)
            if name is None:  # the dynamic loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
                loader = path
                libs[os.path.basename(path)] = Path(path)
            else:
                libs[name] = Path(path)
    if not loader:
        raise BuildError(f"ldd names no dynamic loader for {', '.join(map(str, binaries))}")
    return libs, loader


def _glibc_entries(libs: dict[str, Path], loader: str) -> list[Entry]:
    lib_dir = f"lib/{multiarch_triplet()}"
    entries = [
        Entry(f"{lib_dir}/{name}", "file", 0o755, source=host.resolve()) for name, host in libs.items()
    ]
    loader_rel = loader.lstrip("/")
    in_lib_dir = f"{lib_dir}/{os.path.basename(loader)}"
    if loader_rel != in_lib_dir:  # e.g. /lib64/ld-linux-x86-64.so.2 -> ../lib/x86_64-linux-gnu/...
        up = "/".join([".."] * loader_rel.count("/"))
        entries.append(Entry(loader_rel, "symlink", 0o777, target=f"{up}/{in_lib_dir}"))
    # The CDI spec mounts the driver's libraries here; the loader searches it by default (no
    # ld.so.cache needed: glibc falls back to its system search path, which has both lib dirs).
    entries.append(Entry(f"usr/lib/{multiarch_triplet()}", "dir"))
    return entries


def _busybox_entries(busybox: Path) -> list[Entry]:
    proc = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=False)
    applets = [a for a in proc.stdout.split() if a and "/" not in a and a != "busybox"]
    if proc.returncode != 0 or "sh" not in applets:
        raise BuildError(f"{busybox} --list did not list its applets (is Debian's busybox-static installed?)")
    entries = [Entry("bin/busybox", "file", 0o755, source=busybox)]
    entries += [Entry(f"bin/{a}", "symlink", 0o777, target="busybox") for a in sorted(set(applets))]
    return entries


_PASSWD = b"""root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
"""
_GROUP = b"""root:x:0:
nogroup:x:65534:
"""


def probe_spec(built: ShimPaths, busybox: Path = BUSYBOX) -> ImageSpec:
    probe = probe_binary(built)
    if not probe.is_file():
        raise BuildError(f"{probe} is missing: `make -C shim` builds it")
    if not busybox.is_file():
        raise BuildError(
            f"{busybox} is missing: install Debian's busybox-static (apt-get install busybox-static)"
        )
    cudart_probe = cudart_probe_binary(built)
    # libcudart.so.12 comes with the cudart probe's libraries (its RPATH names the wheel on this host;
    # in the image the loader finds it in the lib dir, as in a CUDA application image)
    libs, loader = runtime_libraries([probe, cudart_probe, built.shim, built.fake_cuda, built.fake_nvml])
    entries: list[Entry] = [
        Entry(PROBE_PATH_IN_IMAGE.lstrip("/"), "file", 0o755, source=probe),
        Entry(CUDART_PROBE_PATH_IN_IMAGE.lstrip("/"), "file", 0o755, source=cudart_probe),
        *(
            Entry(f"{KERNEL_IMAGES_IN_IMAGE.lstrip('/')}/{name}", "file", 0o644, data=data)
            for name, data in kernel_images().items()
        ),
        Entry("etc/passwd", "file", 0o644, data=_PASSWD),
        Entry("etc/group", "file", 0o644, data=_GROUP),
        Entry("tmp", "dir", 0o1777),
        Entry("root", "dir", 0o700),
        *(Entry(d, "dir") for d in ("dev", "proc", "sys", "run", "usr/bin", "var")),
        *_busybox_entries(busybox),
        *_glibc_entries(libs, loader),
    ]
    return ImageSpec(
        ref=PROBE_IMAGE,
        name="probe",
        entries=with_parents(entries),
        cmd=("sh",),
        labels={"org.opencontainers.image.title": "gpuslice probe"},
    )


def pause_spec(pause: Path) -> ImageSpec:
    if not pause.is_file():
        raise BuildError(f"{pause} is missing: node_binaries.ensure_node_binaries() compiles it")
    return ImageSpec(
        ref=PAUSE_IMAGE,
        name="pause",
        entries=with_parents([Entry("pause", "file", 0o755, source=pause)]),
        entrypoint=("/pause",),
        user="65535:65535",
        env=(),
        labels={"org.opencontainers.image.title": "pause (k8s.io/kubernetes build/pause)"},
    )


# --------------------------------------------------------------------------------------- building


@contextmanager
def local_registry(crane: Path, workdir: Path) -> Iterator[str]:
    """A throw-away in-memory registry on 127.0.0.1 (a random port); yields "127.0.0.1:<port>"."""
    log_path = workdir / "registry.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(crane), "registry", "serve", "--address", "127.0.0.1:0"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_crane_env(workdir),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        port = None
        while port is None:
            match = re.search(r"serving on port (\d+)", log_path.read_text(errors="replace"))
            if match:
                port = match.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise BuildError(
                    f"`crane registry serve` did not start:\n{log_path.read_text(errors='replace')}"
                )
            else:
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _crane_env(workdir: Path) -> dict[str, str]:
    # No credentials or proxies from the user's environment: crane talks to 127.0.0.1 only.
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["DOCKER_CONFIG"] = str(workdir / "docker-config")
    return env


def run_crane(crane: Path, args: list[str], workdir: Path) -> None:
    proc = subprocess.run(
        [str(crane), *args], capture_output=True, text=True, env=_crane_env(workdir), check=False
    )
    if proc.returncode != 0:
        raise BuildError(f"crane {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr.strip()}")


def _build_one(spec: ImageSpec, key: str, crane: Path, registry: str, workdir: Path, out: Path) -> None:
    layer = workdir / f"{spec.name}-layer.tar"
    write_layer(spec.entries, layer)
    staging = f"{registry}/gpuslice/{spec.name}:{key[:20]}"
    run_crane(crane, ["append", "--oci-empty-base", "-f", str(layer), "-t", staging], workdir)
    args = ["mutate", staging, "--set-platform", image_platform(), "-t", spec.ref, "-o", str(out)]
    if spec.entrypoint:
        args += ["--entrypoint", ",".join(spec.entrypoint)]
    if spec.cmd:
        args += ["--cmd", ",".join(spec.cmd)]
    if spec.user:
        args += ["--user", spec.user]
    if spec.workdir:
        args += ["--workdir", spec.workdir]
    for env in spec.env:
        args += ["--env", env]
    for k, v in sorted({**spec.labels, "io.gpuslice.image.key": key}.items()):
        args += ["--label", f"{k}={v}"]
    run_crane(crane, args, workdir)


def _archive(spec: ImageSpec, key: str) -> ImageArchive:
    return ImageArchive(ref=spec.ref, path=images_dir() / key / f"{spec.name}.tar", key=key)


@contextmanager
def images_lock() -> Iterator[None]:
    root = images_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_images(
    specs: Sequence[ImageSpec], crane: Path, progress: Progress | None = None
) -> list[ImageArchive]:
    """The archives of `specs`, building those not cached yet (one local registry for all of them)."""
    report = progress or default_progress
    keyed = [(spec, spec.key()) for spec in specs]
    archives = [_archive(spec, key) for spec, key in keyed]
    if all(a.path.is_file() for a in archives):
        return archives
    with images_lock():
        missing = [(s, k) for (s, k), a in zip(keyed, archives, strict=True) if not a.path.is_file()]
        if not missing:
            return archives
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".build-", dir=images_dir()) as tmp:
            workdir = Path(tmp)
            with local_registry(crane, workdir) as registry:
                for spec, key in missing:
                    stage = workdir / key
                    stage.mkdir()
                    _build_one(spec, key, crane, registry, workdir, stage / f"{spec.name}.tar")
                    (stage / "ref").write_text(spec.ref + "\n")
                    final = images_dir() / key
                    if final.exists():  # left by an interrupted build: the archive was missing
                        shutil.rmtree(final)
                    stage.rename(final)
                    size = (final / f"{spec.name}.tar").stat().st_size
                    report(f"image {spec.ref}: {size / 1e6:.1f} MB at {final / f'{spec.name}.tar'}")
        report(f"images ready in {time.monotonic() - started:.1f}s under {images_dir()}")
    return archives


def image_specs(built: ShimPaths, node: NodeBinaries) -> list[ImageSpec]:
    return [pause_spec(node.pause), probe_spec(built)]


def ensure_images(progress: Progress | None = None) -> list[ImageArchive]:
    """The pause and probe image archives ([PAUSE_IMAGE, PROBE_IMAGE] in that order), for
    `ctr -n k8s.io images import`. Builds the shim (make) and node binaries if needed; a second
    call with the same inputs rebuilds nothing and returns the same paths."""
    built = ensure_built()
    node = ensure_node_binaries(progress)
    return build_images(image_specs(built, node), node.crane, progress)
