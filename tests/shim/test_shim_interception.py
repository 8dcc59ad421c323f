"""Interception however the application reaches the driver, and however the shim is loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuslice import constants
from gpuslice.shim.config import SliceConfig
from gpuslice_dev.gpusim.patch import config_path_of
from shim.shim_helpers import GIB, probe, run, values

LIMIT = 8 * GIB


def test_dlopen_dlsym_and_cuGetProcAddress_paths_are_intercepted(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [probe(built, "dl_probe"), LIMIT])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dlsym cuMemAlloc_v2 from libgpuslice.so" in result.stdout


def test_without_the_shim_dlsym_reaches_the_driver(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [probe(built, "dl_probe"), 0], shim=False)
    assert result.returncode == 0, result.stderr
    assert "dlsym cuMemAlloc_v2 from libcuda.so.1" in result.stdout
    assert f"meminfo_total={32 * GIB}" in result.stdout


def test_the_shipped_library_reads_the_container_config_path(built):
    assert config_path_of(built.shim) == constants.CONTAINER_CONFIG_PATH


def test_missing_config_fails_closed(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    s.config_path.unlink()
    result = run(s, [probe(built), "alloc", 1])
    assert values(result.stdout)["rc"] == "2"
    assert f"slice config {s.config_path.resolve()} is unusable" in result.stderr
    assert "fail closed" in result.stderr
    info = values(run(s, [probe(built), "info"]).stdout)
    assert info["meminfo_total"] == "0" and info["total_mem"] == "0"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("version=1\nmemory_bytes=8Gi\ncompute_share=50\n", "memory_bytes must be a positive integer"),
        ("", "required key 'version' is missing"),
        ("version=2\n", "version must be 1"),
        ("version=1\nmemory_bytes=1\nmemory_bytes=2\n", "given twice"),
        ("version=1\nmemroy_bytes=1\n", "unknown key 'memroy_bytes'"),
        ("version=1\nmemory_bytes=1\ncompute_share=0\n", "compute_share must be an integer in 1..100"),
    ],
)
def test_garbled_config_fails_closed_with_the_reason(make_slice, built, text, reason):
    s = make_slice(memory_bytes=LIMIT)
    os.chmod(s.config_path, 0o644)
    s.config_path.write_text(text)
    result = run(s, [probe(built), "alloc", 1])
    assert values(result.stdout)["rc"] == "2"
    assert reason in result.stderr
    assert "gets no GPU memory (fail closed)" in result.stderr


def test_the_shim_ignores_environment_variables_a_tenant_could_set(make_slice, built, tmp_path):
    s = make_slice(memory_bytes=LIMIT)
    lifted = tmp_path / "lifted.conf"
    lifted.write_text(s.config.model_copy(update={"memory_bytes": 30 * GIB}).render())
    env = {**os.environ, **s.env, "GPUSLICE_CONFIG": str(lifted), "CUDA_DEVICE_MEMORY_LIMIT": "30g"}
    result = subprocess.run(
        [str(probe(built)), "alloc", str(LIMIT + 1)], env=env, capture_output=True, text=True, check=False
    )
    assert values(result.stdout)["rc"] == "2"


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe_run = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, check=False
    )
    return probe_run.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces (unshare)")
def test_etc_ld_so_preload_with_the_unpatched_library(make_slice, built, tmp_path):
    """The container path: /etc/ld.so.preload names the shipped library, which reads
    /etc/gpuslice/slice.conf. Simulated with a private copy of /etc bind-mounted in a mount namespace."""
    s = make_slice(memory_bytes=LIMIT)
    etc = tmp_path / "etc"
    subprocess.run(["cp", "-a", "/etc/.", str(etc)], check=False, capture_output=True)
    (etc / "ld.so.preload").write_text(f"{built.shim}\n")
    SliceConfig.model_validate(s.config.model_dump()).write(etc / "gpuslice" / "slice.conf")
    script = (
        f"mount --bind {etc} /etc && "
        f"{probe(built)} info && {probe(built)} alloc {LIMIT + 1} && {probe(built)} alloc {LIMIT}"
    )
    env = {k: v for k, v in {**os.environ, **s.env}.items() if k != "LD_PRELOAD"}
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"meminfo_total={LIMIT}" in result.stdout
    assert result.stdout.count("rc=") == 2
    assert "rc=2" in result.stdout and "rc=0" in result.stdout
    assert Path(s.usage_dir, "usage.bin").stat().st_size > 0, "the shim laid out the usage region"


def test_the_library_cannot_read_the_environment(built):
    """No getenv/secure_getenv import at all: limits can only come from the config file."""
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(built.shim)], capture_output=True, text=True, check=True
    ).stdout
    imported = {line.split()[-1].split("@")[0] for line in undefined.splitlines() if line.strip()}
    assert "dlvsym" in imported  # the listing is real
    assert not imported & {"getenv", "secure_getenv", "__libc_secure_getenv", "environ", "__environ"}
