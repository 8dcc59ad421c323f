"""Module-scope variables (__device__ / __constant__) in the driver double, called through ctypes as a
driver-API client calls them (tests/shim/clients/globals_client.py), on the double alone and under an
8 GiB slice: a PTX module, the cubin NVIDIA's ptxas assembles from it and a fatbin holding that cubin.
The driver backs a module's variables with device memory at load (initialized from the image, zeros
where it has none), cuModuleGetGlobal / cuLibraryGetGlobal give their address and size, and the
unload frees it."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_dev.gpusim import kernels
from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "globals_client.py"
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND = 1, 500

PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .global .align 4 .u32 counter;
.visible .global .align 8 .b8 table[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
.visible .global .align 4 .f32 scale = 0f3FC00000;
.visible .const .align 4 .u32 limits[4] = {7, 8, 9, 0x10};
.global .align 4 .s32 hidden = -2;
.visible .global .align 16 .v4 .u32 wide[2];
.extern .global .align 4 .u32 elsewhere;

.visible .entry touch(.param .u64 .ptr .global .align 4 touch_p)
{
	.reg .b32 %r<8>;
	ld.global.u32 %r1, [counter];
	ld.global.u32 %r3, [hidden];
	ld.const.u32 %r2, [limits+4];
	ld.global.f32 %r4, [scale];
	ld.global.u32 %r5, [wide+16];
	add.u32 %r1, %r1, %r2;
	add.u32 %r1, %r1, %r3;
	add.u32 %r1, %r1, %r4;
	add.u32 %r1, %r1, %r5;
	st.global.u32 [counter], %r1;
	ld.global.u8 %r2, [table+3];
	st.global.u32 [hidden], %r2;
	ret;
}
"""
SIZES = {"counter": 4, "table": 16, "scale": 4, "limits": 16, "hidden": 4, "wide": 32}
INITIAL = {
    "counter": "00000000",
    "table": bytes(range(1, 17)).hex(),
    "scale": struct.pack("<f", 1.5).hex(),
    "limits": struct.pack("<4I", 7, 8, 9, 16).hex(),
    "hidden": struct.pack("<i", -2).hex(),
    "wide": "00" * 32,
}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("globals")
    cubin = kernels.assemble(PTX, "sm_70")
    built = {
        "ptx": PTX,
        "cubin": cubin,
        "fatbin": kernels.fatbin([kernels.Entry(kernels.KIND_CUBIN, 70, cubin)]),
    }
    for name, data in built.items():
        (out / name).write_bytes(data)
    return {name: out / name for name in built}


@pytest.mark.parametrize("kind", ["ptx", "cubin", "fatbin"])
@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_module_variables_have_device_memory_while_loaded(make_slice, images, memory, kind):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT), str(images[kind])], env=env_of(s, shim=memory is not None),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    calls = ["init", "ctx", "load", "write", "read", "get_function", "unload", "library_load"]
    calls += ["library_global"]
    assert {c: v[c] for c in calls} == dict.fromkeys(calls, "0"), proc.stdout
    for name, size in SIZES.items():
        assert (v[f"{name}_rc"], v[f"{name}_size"]) == ("0", str(size)), name
        assert v[f"{name}_init"] == INITIAL[name], name
    assert v["distinct_addresses"] == "1"
    assert (v["size_only"], v["size_only_size"]) == ("0", "16")
    assert v["both_null"] == str(CUDA_ERROR_INVALID_VALUE)
    # a declaration of a variable defined elsewhere, a kernel's name: not this module's variables
    assert v["unknown"] == v["kernel_name"] == v["library_unknown"] == str(CUDA_ERROR_NOT_FOUND)
    assert v["read_back"] == hex(0xC0FFEE)
    assert v["mem_free_global"] == str(CUDA_ERROR_INVALID_VALUE)
    assert v["library_global_size"] == "16"
    assert v["library_unload"] == "0"
    before, loaded = int(v["free_before"]), int(v["free_loaded"])
    if memory is None:
        # the card: the variables take device memory while the module is loaded, and it comes back
        assert sum(SIZES.values()) <= before - loaded < sum(SIZES.values()) + 4096
        assert int(v["library_loaded_free"]) == loaded
    assert int(v["free_unloaded"]) == int(v["free_end"]) == before


#: a module whose one variable is a 6 GiB __device__ array (`__device__ char big[6 << 30];`)
BIG_PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .global .align 8 .b8 big[6442450944];
.visible .entry touch()
{
\tret;
}
"""
CUDA_ERROR_OUT_OF_MEMORY = 2


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_module_variables_take_memory_of_the_card_and_of_the_slice(make_slice, tmp_path, memory):
    """A module's variables are device memory: on the whole card two modules of 6 GiB fit; under an
    8 GiB slice the first takes 6 GiB of it and the second, and a library of the same image, are
    refused with CUDA_ERROR_OUT_OF_MEMORY as a card of 8 GiB refuses them; unloading gives it back."""
    image = tmp_path / "big.ptx"
    image.write_bytes(BIG_PTX)
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT), str(image), "twice"], env=env_of(s, shim=memory is not None),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    before = int(v["free_before"])
    assert (v["init"], v["ctx"], v["load1"]) == ("0", "0", "0"), proc.stdout
    assert int(v["free_load1"]) == before - 6 * GIB
    if memory is None:
        assert (v["load2"], v["library_load"], v["unloads"]) == ("0", "0", "0,0")
        assert int(v["free_load2"]) == before - 12 * GIB
        assert v["library_unload"] == "0"
    else:
        assert before == memory
        oom = str(CUDA_ERROR_OUT_OF_MEMORY)
        assert (v["load2"], v["library_load"], v["unloads"]) == (oom, oom, "0")
        assert int(v["free_load2"]) == before - 6 * GIB
    assert int(v["free_end"]) == before
