"""PyPI wheels the tests run real CUDA clients from (NVIDIA's runtime, CuPy, PyTorch), cached by version.

Each wheel is fetched once with `pip download --no-deps` into
`${XDG_CACHE_HOME:-~/.cache}/gpuslice/wheels/<name>-<version>/` (outside the checkout: they are large
and shared by every worktree) and unpacked next to it on request. Concurrent test workers serialize
on a lock file per wheel; a half-done download or unpack never counts as cached.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gpuslice_dev.devcluster.binaries import cache_root


class WheelError(RuntimeError):
    pass


def wheel_dir(name: str, version: str) -> Path:
    """Where `name==version` is cached (whether or not it is there yet)."""
    return cache_root() / "wheels" / f"{_normal(name)}-{version}"


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / f"{directory.name}.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached_wheel(directory: Path) -> Path | None:
    found = sorted(directory.glob("*.whl"))
    return found[-1] if found else None


def ensure_wheel(name: str, version: str, pip_args: Sequence[str] = ()) -> Path:
    """The wheel file of `name==version` (e.g. "nvidia-cuda-runtime-cu12", "12.9.79"), downloaded once.

    `pip_args` go to `pip download` as they are (e.g. `("--python-version", "3.11")` for a wheel of
    another interpreter); the default picks the wheel for this interpreter and platform.
    """
    directory = wheel_dir(name, version)
    wheel = _cached_wheel(directory)
    if wheel is not None:
        return wheel
    with _locked(directory):
        wheel = _cached_wheel(directory)
        if wheel is not None:
            return wheel
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--dest", str(staging), *pip_args, f"{name}=={version}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or _cached_wheel(staging) is None:
            shutil.rmtree(staging, ignore_errors=True)
            raise WheelError(
                f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}\n"
                f"Check that PyPI is reachable, or put the wheel into {directory}/"
            )
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
        wheel = _cached_wheel(directory)
        assert wheel is not None
        return wheel


def ensure_unpacked(name: str, version: str, pip_args: Sequence[str] = ()) -> Path:
    """The unpacked contents of `name==version` (the wheel's top level: `nvidia/...`, `cupy/...`)."""
    wheel = ensure_wheel(name, version, pip_args)
    out = wheel.parent / "unpacked"
    if (out / ".complete").exists():
        return out
    with _locked(wheel.parent):
        if (out / ".complete").exists():
            return out
        staging = out.with_name("unpacked.partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                zf.extract(info, staging)
                mode = info.external_attr >> 16
                if mode & 0o111:  # zipfile drops the executable bits (nvcc, ptxas, fatbinary)
                    (staging / info.filename).chmod(mode & 0o777)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
        (out / ".complete").touch()
        return out
