"""The product image (operator, agent, shim installer), built without a Docker engine.

The same image as the repository's `Dockerfile`, from the same inputs:

- layer 1, Debian bookworm `minbase` + `python3` + `python3-venv` from Debian's packages, made by
  mmdebstrap (as root; SOURCE_DATE_EPOCH fixed, no docs, man pages or locales, no /dev entries);
- layer 2, `/opt/gpuslice`: a venv of Debian's python3 holding the gpuslice wheel (built from this
  checkout) and the pinned dependencies of `image/requirements.txt` (installed `--no-deps`, offline,
  inside the rootfs through chroot; pip and setuptools removed afterwards), the shim at
  /usr/local/gpuslice/lib/libgpuslice.so (`make -C shim`), and a user and group 65532 (`nonroot`).

Config: entrypoint `gpuslice`, user 65532:65532, PATH with /opt/gpuslice/bin first. crane
(go-containerregistry, as for the devcluster's images in gpuslice_dev.devcluster.images) assembles
the image in a throw-away registry on 127.0.0.1 and pulls it as an OCI image layout, written as one
tar: `oci-layout`, `index.json` (named `localhost/gpuslice/gpuslice:dev` through the
`io.containerd.image.name` and `org.opencontainers.image.ref.name` annotations), `blobs/`, plus a
docker-compatible `manifest.json`, so `ctr images import`, `docker load`, `podman load` and
`skopeo copy oci-archive:` all take it.

Everything is cached by content under `<cache>/gpuslice/images/`: the base rootfs by suite,
packages and mirrors; the dependency wheels by requirements.txt; the image by the hash of the base,
every wheel, every source file that goes into the gpuslice wheel, the shim and the config.

    python -m gpuslice_dev.image [--output build/gpuslice-image.oci.tar]   # what `make image` runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuslice_dev.devcluster.binaries import BuildError, Progress, default_progress
from gpuslice_dev.devcluster.images import (
    Entry,
    image_platform,
    images_dir,
    images_lock,
    local_registry,
    run_crane,
    with_parents,
    write_layer,
)
from gpuslice_dev.devcluster.node_binaries import CRANE_VERSION, ensure_node_binaries
from gpuslice_dev.paths import REPO_ROOT

#: devtools/gpuslice_dev/image.py -> repository root
REQUIREMENTS = REPO_ROOT / "image" / "requirements.txt"
DEFAULT_OUTPUT = REPO_ROOT / "build" / "gpuslice-image.oci.tar"

IMAGE_REF = "localhost/gpuslice/gpuslice:dev"
SUITE = "bookworm"
#: Debian packages on top of minbase (the Dockerfile's final stage installs the same).
PACKAGES = ("python3", "python3-venv")
#: Debian's own mirrors; GPUSLICE_DEBIAN_MIRROR / GPUSLICE_DEBIAN_SECURITY_MIRROR replace them.
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
VENV = "/opt/gpuslice"
SHIM_IN_IMAGE = "/usr/local/gpuslice/lib/libgpuslice.so"
UID = 65532
USER = f"{UID}:{UID}"
ENV = (
    f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
)
ENTRYPOINT = ("gpuslice",)
#: 2023-11-14: mtimes in the Debian layer and the pyc hashes of the venv (checked-hash pycs)
SOURCE_DATE_EPOCH = "1700000000"
#: Bump when this module changes what it writes for the same inputs.
BUILDER_VERSION = "1"
#: what a dpkg path-exclude keeps out of the Debian layer (copyright files stay)
_DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")


def _say(progress: Progress | None) -> Progress:
    return progress or default_progress


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: float = 1800) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise BuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:6])} ...\n{out}")


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for build tools: no pip settings or proxies of the caller's shell leak in."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PIP_") and not k.lower().endswith("_proxy")
    }
    env.update(extra)
    return env


# ------------------------------------------------------------------------------- the Debian layer


def mirrors() -> list[str]:
    main = os.environ.get("GPUSLICE_DEBIAN_MIRROR", DEBIAN_MIRROR)
    security = os.environ.get("GPUSLICE_DEBIAN_SECURITY_MIRROR", SECURITY_MIRROR)
    return [
        f"deb {main} {SUITE} main",
        f"deb {main} {SUITE}-updates main",
        f"deb {security} {SUITE}-security main",
    ]


def base_key() -> str:
    spec = {
        "builder": BUILDER_VERSION,
        "suite": SUITE,
        "variant": "minbase",
        "packages": list(PACKAGES),
        "mirrors": mirrors(),
        "excludes": list(_DPKG_EXCLUDES),
        "recommends": False,
        "merged-usr": "hook",
        "epoch": SOURCE_DATE_EPOCH,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def ensure_base(progress: Progress | None = None) -> Path:
    """The Debian layer tarball (cached); runs mmdebstrap the first time (as root)."""
    say = _say(progress)
    out = images_dir() / f"debian-{SUITE}-{base_key()[:24]}" / "rootfs.tar"
    if out.is_file():
        return out
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise BuildError("mmdebstrap is missing: apt-get install mmdebstrap (Debian/Ubuntu)")
    if os.geteuid() != 0:
        raise BuildError("the image build runs mmdebstrap and chroot as root; run it as root")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"image: debootstrapping Debian {SUITE} minbase + {', '.join(PACKAGES)} with mmdebstrap ...")
    partial = out.with_suffix(".tar.partial")
    cmd = [
        mmdebstrap,
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        "--skip=output/dev",
        # merged /usr the debootstrap way (symlinks + usr-is-merged), not through the usrmerge
        # package, which would pull perl into the image
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        # as the Dockerfile's apt-get install --no-install-recommends (python3 recommends pull in perl)
        "--aptopt=APT::Install-Recommends false",
        *(f"--dpkgopt=path-exclude={p}" for p in _DPKG_EXCLUDES),
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--format=tar",
        SUITE,
        str(partial),
        *mirrors(),
    ]
    _run(cmd, "mmdebstrap", env=_clean_env(SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH), timeout=1800)
    partial.rename(out)
    say(f"image: Debian layer {out.stat().st_size / 1e6:.0f} MB in {time.monotonic() - started:.0f}s")
    return out


# ------------------------------------------------------------------------------- Python packages


def requirements() -> list[str]:
    lines = REQUIREMENTS.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _platform_args() -> list[str]:
    """Every manylinux tag bookworm's glibc (2.36) runs, for pip's --platform (it takes them as given)."""
    arch = os.uname().machine
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(36, 16, -1)]
    tags += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def ensure_wheelhouse(progress: Progress | None = None) -> Path:
    """The wheels of image/requirements.txt (binary only, for this machine's CPU and Python 3.11)."""
    say = _say(progress)
    key = hashlib.sha256(f"{BUILDER_VERSION}\0{image_platform()}\0".encode() + REQUIREMENTS.read_bytes())
    out = images_dir() / f"wheels-{key.hexdigest()[:24]}"
    if (out / ".complete").is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    say(f"image: downloading {len(requirements())} pinned wheels ...")
    _run(
        [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            *_platform_args(),
            "--dest", str(partial), "-r", str(REQUIREMENTS),
        ],
        "pip download",
        env=_clean_env(),
    )  # fmt: skip
    (partial / ".complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def lock(progress: Progress | None = None) -> None:
    """Rewrite image/requirements.txt: pyproject.toml's dependencies resolved now, pinned."""
    import tomllib

    say = _say(progress)
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    header = [ln for ln in REQUIREMENTS.read_text().splitlines() if ln.startswith("#")]
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", tmp, *deps],
            "pip download",
            env=_clean_env(),
        )
        pins = sorted(
            f"{w.name.split('-')[0].lower().replace('_', '-')}=={w.name.split('-')[1]}"
            for w in Path(tmp).glob("*.whl")
        )
    REQUIREMENTS.write_text("\n".join([*header, *pins]) + "\n")
    say(f"image: {REQUIREMENTS} pins {len(pins)} packages")


def _source_files() -> list[Path]:
    """What goes into the gpuslice wheel (its content decides the image key, not the wheel's zip)."""
    files = [REPO_ROOT / "pyproject.toml", REPO_ROOT / "README.md"]
    package = REPO_ROOT / "operator" / "gpuslice"
    files += sorted(
        p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    return files


def source_hash() -> str:
    h = hashlib.sha256()
    for path in _source_files():
        h.update(f"{path.relative_to(REPO_ROOT)}\0".encode() + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _build_wheel(dest: Path) -> Path:
    """`pip wheel --no-deps .` (without build isolation when this Python has setuptools >= 77)."""
    base = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest)]
    with tempfile.TemporaryDirectory() as tmp:
        # Build from a copy: setuptools leaves build/ and *.egg-info in the source tree otherwise.
        src = Path(tmp) / "src"
        for path in _source_files():
            target = src / path.relative_to(REPO_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        env = _clean_env(SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH)
        proc = subprocess.run(
            [*base, "--no-build-isolation", str(src)], capture_output=True, text=True, env=env, check=False
        )
        if proc.returncode != 0:
            _run([*base, str(src)], "pip wheel .", env=env)
    (wheel,) = dest.glob("gpuslice-*.whl")
    return wheel


# ---------------------------------------------------------------------------------- the app layer


@contextmanager
def _rootfs(base: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=".rootfs-", dir=images_dir()) as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        _run(["tar", "-xpf", str(base), "-C", str(root), "--numeric-owner"], "unpacking the Debian layer")
        yield root


def _chroot(root: Path, script: str) -> None:
    """Run `script` with sh inside `root`, in a private mount namespace that has /dev and /proc."""
    for d in ("dev", "proc"):
        (root / d).mkdir(exist_ok=True)
    wrapper = (
        f'mount --rbind /dev "{root}/dev" && mount -t proc proc "{root}/proc" && '
        f'exec chroot "{root}" /bin/sh -ec "$0"'
    )
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
    }
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-ec", wrapper, script]
    _run(cmd, "installing into the image (chroot)", env=env)


def _install_venv(root: Path, wheelhouse: Path, wheel: Path) -> None:
    stage = root / "tmp" / "wheels"
    stage.mkdir(parents=True)
    for w in [*wheelhouse.glob("*.whl"), wheel]:
        shutil.copy2(w, stage / w.name)
    shutil.copy2(REQUIREMENTS, stage / "requirements.txt")
    _chroot(
        root,
        f"""
        python3 -m venv {VENV}
        {VENV}/bin/pip install --quiet --no-index --no-deps --find-links /tmp/wheels \\
            -r /tmp/wheels/requirements.txt /tmp/wheels/{wheel.name}
        {VENV}/bin/pip uninstall --quiet --yes pip setuptools
        {VENV}/bin/python -c 'import gpuslice.cli, kopf, grpc, pynvml, kubernetes_asyncio'
        rm -rf /tmp/wheels
        """,
    )


def _tree_entries(root: Path, top: str) -> list[Entry]:
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root / top):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = path.lstat()
            mode = st.st_mode & 0o7777
            if path.is_symlink():
                entries.append(Entry(rel, "symlink", 0o777, target=os.readlink(path)))
            elif path.is_dir():
                entries.append(Entry(rel, "dir", mode))
            elif path.is_file():
                entries.append(Entry(rel, "file", mode, source=path))
            else:
                raise BuildError(f"unexpected file type in the image's {top}: {rel}")
    return entries


def _with_user(root: Path, file: str, line: str) -> bytes:
    text = (root / file).read_text()
    return (text if text.endswith("\n") else text + "\n").encode() + line.encode() + b"\n"


def app_entries(root: Path, shim: Path) -> tuple[Entry, ...]:
    return with_parents(
        [
            *_tree_entries(root, VENV.lstrip("/")),
            Entry(SHIM_IN_IMAGE.lstrip("/"), "file", 0o755, source=shim),
            Entry(
                "etc/passwd", "file", 0o644,
                data=_with_user(root, "etc/passwd", f"nonroot:x:{UID}:{UID}::/nonexistent:/usr/sbin/nologin"),
            ),
            Entry("etc/group", "file", 0o644, data=_with_user(root, "etc/group", f"nonroot:x:{UID}:")),
        ]
    )  # fmt: skip


# ------------------------------------------------------------------------------------ the archive


def image_key(base: Path, wheelhouse: Path, shim: Path) -> str:
    h = hashlib.sha256()
    config = [IMAGE_REF, list(ENTRYPOINT), USER, list(ENV), VENV, SHIM_IN_IMAGE, image_platform()]
    h.update(f"gpuslice-product-image\0{BUILDER_VERSION}\0crane {CRANE_VERSION}\0".encode())
    h.update(json.dumps(config).encode() + b"\0")
    h.update(f"base {base.parent.name}\0".encode())  # the base's own key (its inputs)
    for w in sorted(wheelhouse.glob("*.whl")):
        h.update(f"{w.name}\0{_sha256_file(w)}\0".encode())
    h.update(f"source {source_hash()}\0shim {_sha256_file(shim)}\0".encode())
    return h.hexdigest()


def _tar_oci_layout(layout: Path, out: Path) -> None:
    """One tar of the OCI layout (sorted, mtime 0, 0:0), the index named IMAGE_REF, plus a
    docker-style manifest.json next to it (what `docker save` has written since Docker 25)."""
    index = json.loads((layout / "index.json").read_text())
    (manifest_desc,) = index["manifests"]
    tag = IMAGE_REF.rpartition(":")[2]
    manifest_desc["annotations"] = {
        "io.containerd.image.name": IMAGE_REF,
        "org.opencontainers.image.ref.name": tag,
    }
    (layout / "index.json").write_text(json.dumps(index, separators=(",", ":")))
    digest = manifest_desc["digest"].split(":", 1)[1]
    manifest = json.loads((layout / "blobs" / "sha256" / digest).read_text())
    blob = "blobs/sha256/{}".format
    docker = [
        {
            "Config": blob(manifest["config"]["digest"].split(":", 1)[1]),
            "RepoTags": [IMAGE_REF],
            "Layers": [blob(layer["digest"].split(":", 1)[1]) for layer in manifest["layers"]],
        }
    ]
    (layout / "manifest.json").write_text(json.dumps(docker, separators=(",", ":")))
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(layout.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(layout)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_file():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)


def _assemble(base: Path, app: Path, key: str, crane: Path, workdir: Path, out: Path) -> None:
    with local_registry(crane, workdir) as registry:
        staging = f"{registry}/gpuslice/gpuslice:{key[:20]}"
        final = f"{registry}/gpuslice/gpuslice:final-{key[:20]}"
        append = ["append", "--oci-empty-base", "-f", str(base), "-f", str(app), "-t", staging]
        run_crane(crane, append, workdir)
        args = ["mutate", staging, "--set-platform", image_platform(), "-t", final]
        args += ["--entrypoint", ",".join(ENTRYPOINT), "--user", USER, "--workdir", "/"]
        for env in ENV:
            args += ["--env", env]
        labels = {
            "org.opencontainers.image.title": "gpuslice",
            "org.opencontainers.image.description": "gpuslice operator, node agent and shim installer",
            "org.opencontainers.image.base.name": f"debian:{SUITE} (mmdebstrap minbase)",
            "io.gpuslice.image.key": key,
        }
        for k, v in sorted(labels.items()):
            args += ["--label", f"{k}={v}"]
        run_crane(crane, args, workdir)
        layout = workdir / "layout"
        run_crane(crane, ["pull", "--format=oci", final, str(layout)], workdir)
    _tar_oci_layout(layout, out)


def build_image(output: Path | None = DEFAULT_OUTPUT, progress: Progress | None = None) -> Path:
    """Build (or find cached) the product image; copy it to `output` (unless None) and return the
    cached archive. Needs root the first time (mmdebstrap, chroot)."""
    from gpuslice_dev.gpusim.build import ensure_built

    say = _say(progress)
    started = time.monotonic()
    shim = ensure_built().shim
    crane = ensure_node_binaries(progress).crane
    base = ensure_base(progress)
    wheelhouse = ensure_wheelhouse(progress)
    key = image_key(base, wheelhouse, shim)
    cached = images_dir() / key / "gpuslice.oci.tar"
    if not cached.is_file():
        with images_lock():
            if not cached.is_file():
                if os.geteuid() != 0:
                    raise BuildError("the image build runs chroot as root; run it as root")
                with tempfile.TemporaryDirectory(prefix=".build-", dir=images_dir()) as tmp:
                    workdir = Path(tmp)
                    wheel = _build_wheel(workdir / "dist")
                    say(f"image: installing {wheel.name} and {len(requirements())} wheels into {VENV} ...")
                    app = workdir / "app-layer.tar"
                    with _rootfs(base) as root:
                        _install_venv(root, wheelhouse, wheel)
                        write_layer(app_entries(root, shim), app)
                    stage = workdir / "out"
                    stage.mkdir()
                    _assemble(base, app, key, crane, workdir, stage / "gpuslice.oci.tar")
                    (stage / "ref").write_text(IMAGE_REF + "\n")
                    final = images_dir() / key
                    if final.exists():
                        shutil.rmtree(final)
                    stage.rename(final)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = output.with_name(f".{output.name}.tmp")
        shutil.copyfile(cached, tmp_out)
        tmp_out.rename(output)
    size = cached.stat().st_size
    took = time.monotonic() - started
    say(f"image {IMAGE_REF}: {size / 1e6:.1f} MB, ready in {took:.1f}s at {output or cached}")
    return cached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuslice_dev.image", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}")
    parser.add_argument("--lock", action="store_true", help="re-pin image/requirements.txt and exit")
    args = parser.parse_args(argv)
    try:
        if args.lock:
            lock()
        else:
            build_image(args.output)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
