"""Stream memory operations on the double: the _v2 calls work as the attributes the double reports say
(64-bit ops and NOR waits: 1), the v1 ABI does not (CAN_USE_STREAM_MEM_OPS_V1: 0), alone and under a slice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "memops_client.py"


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_stream_memory_operations_agree_with_the_device_attributes(make_slice, memory):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT)], env=env_of(s, shim=memory is not None), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    assert (v["attr_v1"], v["attr_64"], v["attr_nor"]) == ("0", "1", "1")
    ok = [
        "init",
        "ctx",
        "alloc",
        "stream",
        "write32",
        "write64",
        "wait_geq_now",
        "wait64_eq_released",
        "batch",
    ]
    assert {k: v[k] for k in ok} == dict.fromkeys(ok, "0"), v
    assert v["read"] == f"7:{1 << 40}"
    assert v["waited_for_the_writer"] == "1"
    assert (v["misaligned"], v["bad_flags"]) == ("1", "1")  # CUDA_ERROR_INVALID_VALUE
    assert v["v1"] == "801"  # CUDA_ERROR_NOT_SUPPORTED, as CAN_USE_STREAM_MEM_OPS_V1 says


MEMSET_CLIENT = Path(__file__).parent / "clients" / "memset_client.py"


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_a_zero_fill_of_device_memory_reads_zero_and_holds_no_host_memory(make_slice, memory):
    """The double keeps device memory in the process's own pages: a buffer written holds them, and a
    zero fill (llama.cpp clears its whole KV cache so at start) reads as zeros, to the byte at the
    edges, and gives them back, as a memset on a card costs the host nothing."""
    s = make_slice(memory_bytes=memory)
    size = 256 << 20
    proc = subprocess.run(
        [sys.executable, str(MEMSET_CLIENT), str(size)], env=env_of(s, shim=memory is not None),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    calls = ["init", "ctx", "alloc", "memset_ff", "memset_0", "memset32_0", "free"]
    assert {k: v[k] for k in calls} == dict.fromkeys(calls, "0"), v
    assert int(v["rss_written"]) >= size - (1 << 20)
    assert int(v["rss_zeroed"]) < 16 << 20, v
    assert v["edges"] == "ffffff0000ffffff"
    assert v["middle_zero"] == "1"
    assert v["tail_after_d32"] == "0000000000000000"
