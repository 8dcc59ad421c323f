"""The driver double fails like a card does: XID events through NVML's event API (as pynvml reads
them), a card fallen off the bus (NVML_ERROR_GPU_IS_LOST, CUDA calls failing), pending page
retirements and row remaps, and a reset that makes it healthy again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuslice_dev.gpusim import faults, simulate
from gpuslice_dev.gpusim.build import ShimPaths

SPEC = "2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB"

# Registers XID events on every card, says "ready", then prints each event it receives as JSON.
WATCH = textwrap.dedent(
    """
    import ctypes, json, sys, pynvml
    def address(handle): return ctypes.cast(handle, ctypes.c_void_p).value
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    events = pynvml.nvmlEventSetCreate()
    for h in handles:
        assert pynvml.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeXidCriticalError
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
    print("ready", flush=True)
    for _ in range(int(sys.argv[1])):
        try:
            e = pynvml.nvmlEventSetWait_v2(events, 3000)
        except pynvml.NVMLError_Timeout:
            print(json.dumps({"timeout": True}), flush=True)
            continue
        index = [address(h) for h in handles].index(address(e.device))
        print(json.dumps({"gpu": index, "type": e.eventType, "xid": e.eventData}), flush=True)
    pynvml.nvmlEventSetFree(events)
    """
)

# What NVML and CUDA say about each card now.
STATE = textwrap.dedent(
    """
    import ctypes, json, pynvml
    pynvml.nvmlInit()
    out = {"nvml": [], "cuda": [], "by_uuid": None}
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pending = pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
            try:
                rows = list(pynvml.nvmlDeviceGetRemappedRows(h))
            except pynvml.NVMLError_NotSupported:
                rows = None
            out["nvml"].append({"retired_pending": pending, "remapped_rows": rows})
        except pynvml.NVMLError as e:
            out["nvml"].append({"error": e.value})
    try:
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    except pynvml.NVMLError as e:
        out["by_uuid"] = e.value
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    for i in range(3):
        ctx = ctypes.c_void_p()
        rc = cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, i)
        ptr = ctypes.c_uint64()
        alloc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) if rc == 0 else None
        out["cuda"].append([rc, alloc])
    print(json.dumps(out))
    """
)


@pytest.fixture
def node(built: ShimPaths, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    config = simulate.write_node_config(SPEC, "health-node", tmp_path)
    return config, {**simulate.fake_driver_env(config, built.fake_dir)}


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def _state(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", STATE], env=_env(env), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


GPU_IS_LOST, NOT_FOUND = 15, 6
CUDA_ERROR_UNKNOWN, CUDA_ERROR_ECC_UNCORRECTABLE = 999, 214


def test_an_xid_reaches_nvml_event_waiters_and_a_lost_card_stops_answering(node) -> None:
    config, env = node
    faults.inject(config, "2", xid=13)  # before the watcher registered: not delivered to it
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCH, "2"], env=_env(env), stdout=subprocess.PIPE, text=True
    )
    assert watcher.stdout is not None
    try:
        assert watcher.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        line = faults.inject(config, "1", xid=79)
        assert line.split()[0] == "1" and line.endswith("xid 79")
        first = json.loads(watcher.stdout.readline())
        latency = time.monotonic() - t0
        assert first == {"gpu": 1, "type": 8, "xid": 79}  # nvmlEventTypeXidCriticalError
        assert latency < 1.0, f"the waiter woke {latency:.2f} s after the XID"
        second = json.loads(watcher.stdout.readline())
        assert second == {"timeout": True}, "nothing else was raised"
    finally:
        watcher.kill()
        watcher.wait()

    state = _state(env)
    assert state["nvml"][0] == {"retired_pending": 0, "remapped_rows": None}
    assert state["nvml"][1] == {"error": GPU_IS_LOST}
    assert state["by_uuid"] == GPU_IS_LOST, "NVML's lookup by UUID fails while any card is lost"
    assert state["cuda"][0] == [0, 0]
    assert state["cuda"][1][0] == CUDA_ERROR_UNKNOWN
    assert state["cuda"][2] == [0, 0]

    faults.inject(config, "1", clear=True)
    state = _state(env)
    assert state["nvml"][1] == {"retired_pending": 0, "remapped_rows": None}
    assert state["by_uuid"] == NOT_FOUND
    assert state["cuda"][1] == [0, 0]


def test_ecc_errors_leave_pending_retirements_and_remaps_until_reset(node) -> None:
    config, env = node
    faults.inject(config, "0", xid=48)  # V100: double-bit ECC, page retirement pending
    faults.inject(config, "2", xid=63)  # A100: a row remap recorded, pending
    state = _state(env)
    assert state["nvml"][0] == {"retired_pending": 1, "remapped_rows": None}
    assert state["nvml"][2] == {"retired_pending": 0, "remapped_rows": [0, 1, 1, 0]}
    assert state["cuda"][0] == [CUDA_ERROR_ECC_UNCORRECTABLE, None], "sticky until the card is reset"
    assert state["cuda"][2] == [0, 0], "a pending remap lets running work go on"
    for gpu in ("0", "2"):
        faults.inject(config, gpu, clear=True)
    state = _state(env)
    assert state["nvml"][0]["retired_pending"] == 0 and state["nvml"][2]["remapped_rows"] == [0, 0, 0, 0]
    assert state["cuda"][0] == [0, 0]


def test_the_fault_tool_refuses_an_unknown_card(node) -> None:
    config, _ = node
    with pytest.raises(faults.GpuFaultError, match=r"no GPU 7 .*3 GPUs"):
        faults.inject(config, "7", xid=79)
    with pytest.raises(faults.GpuFaultError, match="exactly one"):
        faults.inject(config, "0", xid=79, clear=True)
