"""NVML and the driver inside a slice: its own processes, its own share, never more than the card."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpuslice_dev.gpusim.simulate import start_fake_driverd
from shim.shim_helpers import GIB, Holder, env_of, probe, run, values

LIMIT = 8 * GIB
PHYSICAL = 32 * GIB
CONTEXT = 300 << 20  # a V100 context, as the driver reports it

NVML_VIEW = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"):
        procs = getattr(pynvml, fn)(h)
        print(f"{fn}=" + ",".join(str(p.pid) for p in sorted(procs, key=lambda p: p.pid)))
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    print(f"total={m.total}")
    print(f"free={m.free}")
    print(f"used={m.used}")
    print(f"gpu_util={pynvml.nvmlDeviceGetUtilizationRates(h).gpu}")
    """
)


def _outsider(s, built, *args: str) -> subprocess.Popen[str]:
    """A process on the same card outside the slice (another tenant: no shim)."""
    return subprocess.Popen(
        [str(probe(built)), *args],
        env=env_of(s, shim=False),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@contextmanager
def _mine_beside_an_outsider(s, built) -> Iterator[tuple[Holder, subprocess.Popen[str]]]:
    """For the block: 2 GiB held by a process of the slice, 5 GiB by another tenant's process on the
    same card (the outsider); both let go afterwards."""
    other = _outsider(s, built, "hold", str(5 * GIB))
    assert other.stdout is not None and other.stdout.readline().startswith("held rc=0")
    mine = Holder(s, built, 2 * GIB)
    try:
        yield mine, other
    finally:
        mine.close()
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)


def _views_beside(s, proc: subprocess.Popen[str], settle: float) -> tuple[dict[str, str], dict[str, str]]:
    """NVML_VIEW inside the slice and of the whole card (no shim), read `settle` seconds after `proc`
    started; `proc` is killed afterwards."""
    try:
        time.sleep(settle)
        inside = values(run(s, [sys.executable, "-c", NVML_VIEW]).stdout)
        card = values(run(s, [sys.executable, "-c", NVML_VIEW], shim=False).stdout)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    return inside, card


def test_nvml_process_lists_show_only_the_slices_processes(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    with _mine_beside_an_outsider(s, built) as (mine, other):
        inside = values(run(s, [sys.executable, "-c", NVML_VIEW]).stdout)
        card = values(run(s, [sys.executable, "-c", NVML_VIEW], shim=False).stdout)
    assert card["nvmlDeviceGetComputeRunningProcesses"] == ",".join(
        str(p) for p in sorted([mine.proc.pid, other.pid])
    )
    assert inside["nvmlDeviceGetComputeRunningProcesses"] == str(mine.proc.pid)
    assert inside["nvmlDeviceGetComputeRunningProcesses_v2"] == str(mine.proc.pid)


NVML_THROUGH_DLVSYM = textwrap.dedent(
    """
    import ctypes
    from ctypes import CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_uint, c_ulonglong, c_void_p
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    class Info(Structure):  # nvmlProcessInfo_v1_t
        _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]

    libc = ctypes.CDLL("libc.so.6")
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    dlvsym = libc.dlvsym
    dlvsym.restype, dlvsym.argtypes = c_void_p, [c_void_p, c_char_p, c_char_p]
    name = b"nvmlDeviceGetComputeRunningProcesses"
    found = {}
    # libc's own dlsym, taken by version, asked for the entry point
    for version in (b"GLIBC_2.34", b"GLIBC_2.2.5"):
        raw = dlvsym(libc._handle, b"dlsym", version)
        if raw:
            found["libc-dlsym"] = CFUNCTYPE(c_void_p, c_void_p, c_char_p)(raw)(nvml._handle, name)
            break
    # libc's own dlvsym, taken by version, asked for libc's dlsym, asked for the entry point
    for version in (b"GLIBC_2.34", b"GLIBC_2.2.5"):
        raw = dlvsym(libc._handle, b"dlvsym", version)
        if raw:
            inner = CFUNCTYPE(c_void_p, c_void_p, c_char_p, c_char_p)(raw)(libc._handle, b"dlsym", version)
            found["libc-dlvsym"] = CFUNCTYPE(c_void_p, c_void_p, c_char_p)(inner)(nvml._handle, name)
            break
    for how, addr in found.items():
        fn = CFUNCTYPE(c_int, c_void_p, POINTER(c_uint), POINTER(Info))(addr)
        count, infos = c_uint(64), (Info * 64)()
        rc = fn(h, ctypes.byref(count), infos)
        print(f"{how}=rc{rc}:" + ",".join(str(infos[i].pid) for i in range(count.value)))
    """
)


def test_nvml_reached_through_dlvsym_still_shows_only_the_slices_processes(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    with _mine_beside_an_outsider(s, built) as (mine, other):
        result = run(s, [sys.executable, "-c", NVML_THROUGH_DLVSYM])
    assert result.returncode == 0, result.stderr
    seen = values(result.stdout)
    assert set(seen) == {"libc-dlsym", "libc-dlvsym"}, result.stdout
    for how, listed in seen.items():
        assert listed == f"rc0:{mine.proc.pid}", (how, listed, other.pid)


def test_free_is_never_above_what_the_card_has_free(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    other = _outsider(s, built, "hold", str(30 * GIB))
    assert other.stdout is not None and other.stdout.readline().startswith("held rc=0")
    try:
        inside = values(run(s, [sys.executable, "-c", NVML_VIEW]).stdout)
        info = values(run(s, [probe(built), "info"]).stdout)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    assert int(inside["total"]) == LIMIT
    assert int(inside["free"]) == 2 * GIB, "the card has only 2 GiB free"
    assert int(info["meminfo_free"]) == 2 * GIB


def test_totals_are_never_above_the_card(make_slice, built):
    s = make_slice(memory_bytes=40 * GIB)
    inside = values(run(s, [sys.executable, "-c", NVML_VIEW]).stdout)
    info = values(run(s, [probe(built), "info"]).stdout)
    assert int(inside["total"]) == PHYSICAL
    assert int(info["meminfo_total"]) == PHYSICAL
    assert int(info["total_mem"]) == PHYSICAL
    assert int(info["meminfo_free"]) <= PHYSICAL


def test_utilization_is_the_slices_own_as_a_share_of_its_quota(make_slice, built):
    # another tenant keeps the card busy: the slice does not see it
    s = make_slice(memory_bytes=LIMIT, compute_share=50)
    # the launching processes run until both views are read (on a loaded machine starting two Pythons
    # with NVML can take seconds: a launch of fixed length could end before the card is read)
    other = _outsider(s, built, "launch", "120", "1000", "kernel")
    inside, card = _views_beside(s, other, settle=2)
    assert int(card["gpu_util"]) >= 50
    assert int(inside["gpu_util"]) == 0
    # the slice's own work reads as a share of its quota: half the card is 100 % of a 50 % slice
    burner = subprocess.Popen(
        [str(probe(built)), "launch", "120", "1000", "kernel"],
        env=env_of(s),
        stdout=subprocess.PIPE,
        text=True,
    )
    inside, card = _views_beside(s, burner, settle=3)
    expected = min(100, 2 * int(card["gpu_util"]))
    assert int(card["gpu_util"]) > 10
    assert abs(int(inside["gpu_util"]) - expected) <= 25, (inside["gpu_util"], card["gpu_util"])


INSIDE_A_POD = textwrap.dedent(
    """
    import subprocess, sys, pynvml
    holder = subprocess.Popen(
        [sys.argv[1], "hold", str(1 << 30)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().startswith("held rc=0")
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    print(f"namespace_pid={holder.pid}")
    print("listed=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
    holder.stdin.close()
    holder.wait()
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_inside_a_pid_namespace_the_slice_learns_its_host_pids_and_context_cost(make_slice, built):
    """In a pod NVML reports host pids: a process learns its own at its first context (and what the
    context costs), so the slice's lists show it and nobody else."""
    s = make_slice(memory_bytes=LIMIT)
    conf = s.workdir / "fake-gpus.conf"
    with conf.open("a") as f:
        f.write(f"gpu.0.context_bytes={CONTEXT}\n")
    daemon = start_fake_driverd(conf)
    other = _outsider(s, built, "hold", str(5 * GIB))
    try:
        assert other.stdout is not None and other.stdout.readline().startswith("held rc=0")
        result = run(
            s,
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INSIDE_A_POD, probe(built)],
        )
        assert result.returncode == 0, result.stderr
        v = values(result.stdout)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=10)
    listed = [entry.split(":") for entry in v["listed"].split(",")]
    assert len(listed) == 1, v["listed"]
    pid, used = int(listed[0][0]), int(listed[0][1])
    assert pid != int(v["namespace_pid"]), "NVML reports the host pid"
    assert used == GIB + CONTEXT


CARDS_VIEW = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3"):
            procs = sorted(getattr(pynvml, fn)(h), key=lambda p: p.pid)
            print(f"card{i}.{fn[-3:]}=" + ",".join(str(p.pid) for p in procs))
    """
)


def test_nvml_in_a_multi_gpu_product_lists_each_cards_own_processes(make_slice, built):
    # The agent's files of a multi-GPU product's container: whole cards, no limit, every card visible.
    s = make_slice(memory_bytes=None, compute_share=100, simulate_gpus="2x Tesla V100-PCIE-32GB")

    def hold(card: str, shim: bool = True) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [str(probe(built)), "hold", str(GIB)],
            env={**env_of(s, shim=shim), "CUDA_VISIBLE_DEVICES": card},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().startswith("held rc=0")
        return proc

    procs = [hold("0"), hold("1"), hold("1", shim=False)]  # the last: another tenant's, on card 1
    try:
        inside = values(run(s, [sys.executable, "-c", CARDS_VIEW]).stdout)
        card = values(run(s, [sys.executable, "-c", CARDS_VIEW], shim=False).stdout)
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=30)
    mine0, mine1, other = (str(p.pid) for p in procs)
    assert card["card1.ses"] == ",".join(sorted([mine1, other], key=int)), card
    for fn in ("ses", "_v3"):
        assert (inside[f"card0.{fn}"], inside[f"card1.{fn}"]) == (mine0, mine1), inside
