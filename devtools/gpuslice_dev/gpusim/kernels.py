"""Real kernel images for tests, without nvcc: PTX assembled by NVIDIA's ptxas, packed into fatbins.

`ptxas` comes from the `nvidia-cuda-nvcc-cu12` wheel (it runs on x86_64 Linux without a GPU); the
fatbin container is written here in its public layout (shim/src/fatbin.h describes it):

    header  u32 magic 0xBA55ED50, u16 version 1, u16 header size 16, u64 size of the entries
    entry   u16 kind (1 PTX, 2 cubin), u16 version 0x0101, u32 header size 64, u64 payload size,
            u32 compressed size @16, u32 arch @28, u64 flags @40, u64 uncompressed size @56
"""

from __future__ import annotations

import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpuslice_dev.wheels import ensure_unpacked

NVCC_WHEEL = ("nvidia-cuda-nvcc-cu12", "12.9.86")
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_CUBIN = 2
FLAG_64BIT = 0x1
FLAG_LINUX = 0x10
FLAG_LZ4 = 0x2000

#: Two kernels: `fill(ptr, n)` and `empty()`; `.target` is filled in.
KERNELS_PTX = """\
// gpuslice-fake: duration_us={duration_us}
.version {isa}
.target sm_{arch}
.address_size 64

.visible .entry fill(.param .u64 fill_param_0, .param .u32 fill_param_1)
{{
\t.reg .b32 %r<3>;
\t.reg .b64 %rd<4>;
\tld.param.u64 %rd1, [fill_param_0];
\tld.param.u32 %r1, [fill_param_1];
\tcvta.to.global.u64 %rd2, %rd1;
\tst.global.u32 [%rd2], %r1;
\tret;
}}

.visible .entry empty()
{{
\tret;
}}
"""


def kernels_ptx(arch: int = 70, isa: str = "6.0", duration_us: int = 50) -> bytes:
    return KERNELS_PTX.format(arch=arch, isa=isa, duration_us=duration_us).encode()


def ptxas() -> Path:
    return ensure_unpacked(*NVCC_WHEEL) / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"


def assemble(ptx: bytes, arch: str) -> bytes:
    """A cubin for `arch` ("sm_70", "sm_90a") from PTX text, by NVIDIA's ptxas."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_bytes(ptx)
        subprocess.run(
            [str(ptxas()), f"-arch={arch}", "-o", str(out), str(src)], check=True, capture_output=True
        )
        return out.read_bytes()


@dataclass(frozen=True)
class Entry:
    kind: int  # KIND_PTX or KIND_CUBIN
    arch: int  # 70 for sm_70 / compute_70
    data: bytes
    lz4: bool = False  # store LZ4-compressed (literal-only blocks: valid LZ4, no compression library needed)


def _lz4_literals(data: bytes) -> bytes:
    """An LZ4 block of one literal run: what an LZ4 decoder must accept."""
    n = len(data)
    if n < 15:
        return bytes([n << 4]) + data
    rest = n - 15
    out = bytearray([0xF0])
    while rest >= 255:
        out.append(255)
        rest -= 255
    out.append(rest)
    return bytes(out) + data


def fatbin(entries: list[Entry]) -> bytes:
    body = bytearray()
    for e in entries:
        raw = e.data + (b"\0" if e.kind == KIND_PTX and not e.data.endswith(b"\0") else b"")
        stored = _lz4_literals(raw) if e.lz4 else raw
        padded = stored + b"\0" * (-len(stored) % 8)
        flags = FLAG_64BIT | FLAG_LINUX | (FLAG_LZ4 if e.lz4 else 0)
        header = struct.pack(
            "<HHIQIIIIIIQQQ",
            e.kind, 0x0101, 64, len(padded),
            len(stored) if e.lz4 else 0, 0, 0, e.arch, 64, 0,
            flags, 0, len(raw) if e.lz4 else 0,
        )  # fmt: skip
        assert len(header) == 64
        body += header + padded
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + bytes(body)


def device_runtime_fatbin(major: str) -> bytes:
    """The fatbin NVIDIA ships in the runtime wheel's libcudadevrt.a (section __nv_relfatbin of
    cuda_device_runtime.o): real images, one cubin per architecture the release supports (CUDA 12.9:
    sm_50 ... sm_121, LZ4; CUDA 13.0: sm_75 and up, zstd). Relocatable code: for reading tables of
    contents and the choice of image, not for running."""
    from gpuslice_dev.gpusim.cudart import runtime_dir

    archive = runtime_dir(major) / "lib" / "libcudadevrt.a"
    with tempfile.TemporaryDirectory() as tmp:
        obj, out = Path(tmp) / "cuda_device_runtime.o", Path(tmp) / "fatbin"
        obj.write_bytes(
            subprocess.run(["ar", "p", str(archive), obj.name], capture_output=True, check=True).stdout
        )
        subprocess.run(
            ["objcopy", "-O", "binary", "--only-section=__nv_relfatbin", str(obj), str(out)],
            check=True,
            capture_output=True,
        )
        return out.read_bytes()


#: Real libraries with kernels, for loading tests: cuRAND of CUDA 12 (sm_50 ... sm_121, with sm_70)
#: and of CUDA 13 (sm_75 and up: Volta dropped). (wheel, version, member)
CURAND = {
    "12": ("nvidia-curand-cu12", "10.3.10.19", "nvidia/curand/lib/libcurand.so.10"),
    "13": ("nvidia-curand", "10.4.0.35", "nvidia/cu13/lib/libcurand.so.10"),
}


def library_fatbins(major: str) -> list[bytes]:
    """The fatbins (.nv_fatbin, one per translation unit) of the cuRAND library of CUDA `major`."""
    import zipfile

    from gpuslice_dev.wheels import ensure_wheel

    wheel, version, member = CURAND[major]
    with tempfile.TemporaryDirectory() as tmp:
        lib, out = Path(tmp) / "lib.so", Path(tmp) / "fatbin"
        with zipfile.ZipFile(ensure_wheel(wheel, version)) as zf:
            lib.write_bytes(zf.read(member))
        subprocess.run(
            ["objcopy", "-O", "binary", "--only-section=.nv_fatbin", str(lib), str(out)],
            check=True,
            capture_output=True,
        )
        data = out.read_bytes()
    fatbins, off = [], 0
    while off + 16 <= len(data):
        magic, _version, header, size = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            break
        fatbins.append(data[off : off + header + size])
        off += (header + size + 7) & ~7
    return fatbins


def cubin_of(fatbin_image: bytes, arch: int) -> bytes | None:
    """The uncompressed cubin for `arch` in a fatbin, if it has one."""
    _magic, _version, header, size = struct.unpack_from("<IHHQ", fatbin_image, 0)
    off, end = header, header + size
    while off + 64 <= end:
        kind, _v, eh, payload = struct.unpack_from("<HHIQ", fatbin_image, off)
        entry_arch = struct.unpack_from("<I", fatbin_image, off + 28)[0]
        flags = struct.unpack_from("<Q", fatbin_image, off + 40)[0]
        if kind == KIND_CUBIN and entry_arch == arch and not flags & (FLAG_LZ4 | 0x8000):
            return fatbin_image[off + eh : off + eh + payload]
        off += eh + payload
    return None


def kernel_names(cubin: bytes) -> list[str]:
    """The kernels a cubin defines (FUNC symbols marked as entries, st_other 0x10), by readelf."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if " FUNC " in line and "[<other>: 10]" in line]


def library_kernel_fatbin(major: str) -> tuple[bytes, str]:
    """The smallest cuRAND fatbin of CUDA `major` with sm_75 kernels, and one kernel's name; cached
    next to the wheel (finding it reads the whole library)."""
    from gpuslice_dev.wheels import wheel_dir

    wheel, version, _member = CURAND[major]
    cache = wheel_dir(wheel, version)
    image, name = cache / "kernels.fatbin", cache / "kernels.name"
    if image.exists() and name.exists():
        return image.read_bytes(), name.read_text()
    for fatbin in sorted(library_fatbins(major), key=len):
        cubin = cubin_of(fatbin, 75)
        names = kernel_names(cubin) if cubin else []
        if names:
            partial = cache / "kernels.fatbin.partial"
            partial.write_bytes(fatbin)
            name.write_text(names[0])
            partial.rename(image)
            return fatbin, names[0]
    raise RuntimeError(f"no fatbin with sm_75 kernels in {wheel} {version}")


def builds() -> dict[str, bytes]:
    """name -> fatbin of the kernels (`empty`, `fill`) as three kinds of build carry them, for tests
    and the probe image: "sm70", a CUDA 12 build for Volta (sm_70 code, LZ4-compressed compute_70
    PTX); "no-volta", a build without Volta as CUDA 13 builds are (sm_75 and sm_90 code, compute_90
    PTX); "ptx85", PTX only, of an ISA (8.5) newer than a 535 driver (CUDA 12.2) compiles."""
    ptx70, ptx90 = kernels_ptx(70), kernels_ptx(90, isa="8.0")
    return {
        "sm70": fatbin(
            [Entry(KIND_CUBIN, 70, assemble(ptx70, "sm_70")), Entry(KIND_PTX, 70, ptx70, lz4=True)]
        ),
        "no-volta": fatbin(
            [Entry(KIND_CUBIN, 75, assemble(ptx70, "sm_75")), Entry(KIND_CUBIN, 90, assemble(ptx90, "sm_90")),
             Entry(KIND_PTX, 90, ptx90)]
        ),
        "ptx85": fatbin([Entry(KIND_PTX, 70, kernels_ptx(70, isa="8.5"))]),
    }  # fmt: skip


def write_builds(out: Path) -> dict[str, Path]:
    """`builds()` written as `<out>/<name>.fatbin`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, data in builds().items():
        paths[name] = out / f"{name}.fatbin"
        paths[name].write_bytes(data)
    return paths
