"""Copies into and out of CUDA arrays on the double move real bytes and stay inside the array's
accounted memory, alone and under an 8 GiB slice (the array's bytes are charged once, at creation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "array_client.py"


def _run(s, shim: bool, *args: str) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, str(CLIENT), *args], env=env_of(s, shim=shim), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return values(proc.stdout)


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_3d_2d_and_1d_array_copies_move_the_bytes_and_refuse_outside_the_array(make_slice, memory):
    v = _run(make_slice(memory_bytes=memory), memory is not None)
    ok = [
        "init",
        "ctx",
        "array_create",
        "copy3d_in",
        "copy3d_out",
        "alloc",
        "htoa",
        "atod",
        "dtoh",
        "atoa",
        "atoh",
    ]
    assert {k: v[k] for k in ok} == dict.fromkeys(ok, "0"), v
    assert v["roundtrip"] == v["linear_roundtrip"] == v["array_roundtrip"] == v["copy2d_roundtrip"] == "1"
    assert v["free_unchanged"] == "1"  # a copy allocates nothing
    # CUDA_ERROR_INVALID_VALUE: a box past the array's depth or row, a range past its end
    assert (v["copy3d_outside"], v["copy3d_too_wide"], v["atoh_past_end"]) == ("1", "1", "1")


def test_a_5_gib_array_filled_by_a_3d_copy_counts_once_against_an_8_gib_slice(make_slice):
    v = _run(make_slice(memory_bytes=8 * GIB), True, str(5 * GIB))
    assert v["big_create"] == "0" and int(v["big_charged"]) == 5 * GIB
    assert v["big_copy_last_row"] == "0" and v["big_copy_free_unchanged"] == "1"
    assert v["second_big_create"] == "2"  # CUDA_ERROR_OUT_OF_MEMORY: 10 GiB would pass the slice
    assert v["big_destroy"] == "0" and v["big_returned"] == "1"
