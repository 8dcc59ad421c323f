"""MIG on the driver double, judged by NVIDIA's own software: pynvml (nvidia-ml-py) manages it as
nvidia-smi and the node agent do (MIG mode, GPU and compute instances with the real profiles and
placements, MIG devices), and NVIDIA's CUDA runtime (libcudart 12.9 from PyPI) run with
CUDA_VISIBLE_DEVICES=MIG-<uuid> sees exactly that instance. Every step runs in its own process: the
MIG layout is the node's, as the real driver's is, not a process's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_dev.gpusim import cudart, simulate
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.wheels import ensure_unpacked
from shim.matrix import TORCH, nvitop_pythonpath

MIB = 1024**2
GIB = 1024**3
A100_80 = "1x NVIDIA A100-SXM4-80GB"

# nvidia-smi mig -lgip on an A100-SXM4-80GB: profile index -> (id, name, slices, instances, MiB, SMs)
A100_80_PROFILES = {
    0: (19, "MIG 1g.10gb", 1, 7, 9728, 14),
    7: (20, "MIG 1g.10gb+me", 1, 1, 9728, 14),
    9: (15, "MIG 1g.20gb", 1, 4, 19968, 14),
    1: (14, "MIG 2g.20gb", 2, 3, 19968, 28),
    2: (9, "MIG 3g.40gb", 3, 2, 40192, 42),
    3: (5, "MIG 4g.40gb", 4, 1, 40192, 56),
    4: (0, "MIG 7g.80gb", 7, 1, 80896, 98),
}

PRELUDE = textwrap.dedent(
    """
    import json, sys, pynvml as N
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    out = {}
    def err(f, *a):
        try:
            r = f(*a)
            return None if r is None or isinstance(r, (int, str, list)) else r
        except N.NVMLError as e:
            return e.value
    def mig_devices():
        devs = []
        for k in range(N.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = N.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except N.NVMLError_NotFound:
                break
            mem = N.nvmlDeviceGetMemoryInfo(m)
            devs.append({"name": N.nvmlDeviceGetName(m), "uuid": N.nvmlDeviceGetUUID(m),
                         "total": mem.total, "used": mem.used,
                         "gi": N.nvmlDeviceGetGpuInstanceId(m), "ci": N.nvmlDeviceGetComputeInstanceId(m),
                         "parent": N.nvmlDeviceGetUUID(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
                         "by_uuid": N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(m)))})
        return devs
    """
)


def _env(config: Path, built: ShimPaths, **extra: str) -> dict[str, str]:
    return {**os.environ, **simulate.fake_driver_env(config, built.fake_dir), **extra}


def _nvml(env: dict[str, str], body: str, *args: str) -> dict:
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["no-daemon", "driverd"])
def a100(request: pytest.FixtureRequest, tmp_path: Path, built: ShimPaths) -> Iterator[dict[str, str]]:
    """One simulated A100-SXM4-80GB; with `driverd` the double's host daemon owns the state, as on a
    node (instances' memory charged through it, read-only to every process)."""
    config = simulate.write_fake_config(
        simulate.parse_gpu_spec(A100_80, seed="mig"), tmp_path / "fake-gpus.conf"
    )
    daemon = simulate.start_fake_driverd(config) if request.param == "driverd" else None
    try:
        yield _env(config, built)
    finally:
        if daemon:
            daemon.terminate()
            daemon.wait(timeout=30)


def _enable(env: dict[str, str]) -> None:
    out = _nvml(env, 'out["status"] = N.nvmlDeviceSetMigMode(h, 1); out["mode"] = N.nvmlDeviceGetMigMode(h)')
    assert out == {"status": 0, "mode": [1, 1]}


def test_mig_mode_and_the_real_profiles(tmp_path: Path, built: ShimPaths, a100: dict[str, str]) -> None:
    v100 = simulate.write_fake_config(
        simulate.parse_gpu_spec("1x Tesla V100-SXM2-32GB", seed="v"), tmp_path / "v.conf"
    )
    assert _nvml(_env(v100, built), 'out["mode"] = err(N.nvmlDeviceGetMigMode, h)') == {
        "mode": N_NOT_SUPPORTED
    }

    before = _nvml(
        a100,
        'out["mode"] = N.nvmlDeviceGetMigMode(h)\n'
        'out["v2"] = err(N.nvmlDeviceGetGpuInstanceProfileInfo, h, 0)',
    )
    assert before == {"mode": [0, 0], "v2": N_NOT_SUPPORTED}  # `nvidia-smi mig -lgip`: no MIG-enabled device
    _enable(a100)
    table = _nvml(
        a100,
        """
        out["profiles"] = {}
        for idx in range(17):
            try:
                p = N.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except N.NVMLError_NotSupported:
                continue
            out["profiles"][idx] = [p.id, p.name, p.sliceCount, p.instanceCount, p.memorySizeMB,
                                    p.multiprocessorCount]
        out["beyond"] = err(N.nvmlDeviceGetGpuInstanceProfileInfo, h, 17, 1)
        out["placements"] = {}
        for pid in (19, 15, 14, 9, 5, 0):
            count = N.c_uint(0)
            N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, N.byref(count))
            arr = (N.c_nvmlGpuInstancePlacement_t * count.value)()
            N.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, arr, N.byref(count))
            out["placements"][pid] = [[p.start, p.size] for p in arr]
        """,
    )
    assert {int(k): tuple(v) for k, v in table["profiles"].items()} == A100_80_PROFILES
    assert table["beyond"] == N_INVALID_ARGUMENT  # the end of the profile list, as NVML documents
    # `nvidia-smi mig -lgipp`: {0,1,2,3,4,5,6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8
    assert table["placements"] == {
        "19": [[s, 1] for s in range(7)],
        "15": [[0, 2], [2, 2], [4, 2], [6, 2]],
        "14": [[0, 2], [2, 2], [4, 2]],
        "9": [[0, 4], [4, 4]],
        "5": [[0, 4]],
        "0": [[0, 8]],
    }


N_NOT_SUPPORTED, N_INVALID_ARGUMENT, N_IN_USE, N_INSUFFICIENT_RESOURCES, N_NO_PERMISSION = 3, 2, 19, 23, 4

CREATE = """
p1 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
p3 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
gi1 = N.nvmlDeviceCreateGpuInstanceWithPlacement(h, p1.id, N.byref(N.c_nvmlGpuInstancePlacement_t(6, 1)))
gi3 = N.nvmlDeviceCreateGpuInstance(h, p3.id)
SHARED = N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
CI1, CI3 = N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE
for gi, ci_profile in ((gi1, CI1), (gi3, CI3)):
    cp = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, SHARED)
    N.nvmlGpuInstanceCreateComputeInstance(gi, cp.id)
out["placements"] = [[i.placement.start, i.placement.size] for i in map(N.nvmlGpuInstanceGetInfo, (gi1, gi3))]
"""


def _create(env: dict[str, str]) -> list[dict]:
    _enable(env)
    assert _nvml(env, CREATE) == {"placements": [[6, 1], [0, 4]]}
    return _nvml(env, 'out["devices"] = mig_devices()')["devices"]


def test_a_1g_and_a_3g_instance_side_by_side_overlap_refused_then_destroyed(a100: dict[str, str]) -> None:
    devices = _create(a100)
    # another process lists them, as nvidia-smi -L does
    assert [(d["name"], d["total"], d["gi"], d["ci"]) for d in devices] == [
        ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9728 * MIB, 1, 0),
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40192 * MIB, 2, 0),
    ]
    for d in devices:
        assert d["uuid"].startswith("MIG-") and len(d["uuid"]) == 40 and d["uuid"][18] == "5"
        assert d["by_uuid"] == d["name"] and d["used"] == 0
    assert devices[0]["parent"] == devices[1]["parent"] and devices[0]["uuid"] != devices[1]["uuid"]

    refused = _nvml(
        a100,
        """
        p1 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        p3 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        p7 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
        place = lambda s, n: N.byref(N.c_nvmlGpuInstancePlacement_t(s, n))
        at = lambda p, s, n: err(N.nvmlDeviceCreateGpuInstanceWithPlacement, h, p.id, place(s, n))
        out["1g_inside_3g"] = at(p1, 1, 1)
        out["3g_over_1g"] = at(p3, 4, 4)
        out["second_3g"] = err(N.nvmlDeviceCreateGpuInstance, h, p3.id)
        out["7g"] = err(N.nvmlDeviceCreateGpuInstance, h, p7.id)
        out["not_a_placement"] = at(p3, 2, 4)
        out["remaining_1g"] = N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p1.id)
        out["mode_off"] = [N.nvmlDeviceSetMigMode(h, 0), N.nvmlDeviceGetMigMode(h)]
        """,
    )
    assert refused == {
        "1g_inside_3g": N_INSUFFICIENT_RESOURCES,
        "3g_over_1g": N_INSUFFICIENT_RESOURCES,
        "second_3g": N_INSUFFICIENT_RESOURCES,
        "7g": N_INSUFFICIENT_RESOURCES,
        "not_a_placement": N_INVALID_ARGUMENT,
        "remaining_1g": 2,  # at memory slices 4 and 5: no 1g placement starts at 7, 6 is the 1g's
        "mode_off": [N_IN_USE, [1, 0]],  # not while instances exist: pending only
    }

    destroyed = _nvml(
        a100,
        """
        p3 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        gis = (N.c_nvmlGpuInstance_t * 2)(); n = N.c_uint(0)
        N.nvmlDeviceGetGpuInstances(h, p3.id, gis, N.byref(n))
        gi = gis[0]
        out["with_ci"] = err(N.nvmlGpuInstanceDestroy, gi)
        cis = (N.c_nvmlComputeInstance_t * 3)(); m = N.c_uint(0)
        N.nvmlGpuInstanceGetComputeInstances(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, cis, N.byref(m))
        N.nvmlComputeInstanceDestroy(cis[0])
        N.nvmlGpuInstanceDestroy(gi)
        out["stale_handle"] = err(N.nvmlGpuInstanceGetInfo, gi)
        out["devices"] = [d["name"] for d in mig_devices()]
        out["3g_again"] = N.nvmlGpuInstanceGetInfo(N.nvmlDeviceCreateGpuInstance(h, p3.id)).placement.start
        """,
    )
    assert destroyed == {
        "with_ci": N_IN_USE,
        "stale_handle": N_INVALID_ARGUMENT,
        "devices": ["NVIDIA A100-SXM4-80GB MIG 1g.10gb"],
        "3g_again": 0,
    }


def test_mig_mode_stays_pending_while_a_process_uses_the_card(built: ShimPaths, a100: dict[str, str]) -> None:
    holder = subprocess.Popen(
        [str(built.fake_dir.parent / "probe" / "gpuslice-probe"), "hold", "1Gi", "0"],
        env=a100, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and "held" in holder.stdout.readline()
        busy = _nvml(a100, 'out["set"] = [N.nvmlDeviceSetMigMode(h, 1), N.nvmlDeviceGetMigMode(h)]')
        assert busy == {"set": [N_IN_USE, [0, 1]]}  # activationStatus: idle the card and retry
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    _enable(a100)


def test_changing_mig_takes_root(built: ShimPaths) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    with tempfile.TemporaryDirectory() as d:  # pytest's tmp_path is private to root
        os.chmod(d, 0o755)
        config = simulate.write_fake_config(
            simulate.parse_gpu_spec(A100_80, seed="mig"), Path(d) / "fake-gpus.conf"
        )
        os.chmod(config, 0o644)
        daemon = simulate.start_fake_driverd(config)  # the state is the daemon's, read-only to clients
        try:
            env = _env(config, built)
            _enable(env)  # root may change MIG; uid 1000 reads it and may not
            _as_uid_1000(env)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


def _as_uid_1000(a100: dict[str, str]) -> None:
    proc = subprocess.run(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable, "-c",
         PRELUDE + 'out = [N.nvmlDeviceGetMigMode(h), err(N.nvmlDeviceCreateGpuInstance, h, 19)]\n'
         'print(json.dumps(out))'],
        env=a100, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[1, 1], N_NO_PERMISSION]


CUDART = textwrap.dedent(
    """
    import ctypes, json, sys
    rt = ctypes.CDLL(sys.argv[1])
    out = {}
    n = ctypes.c_int(-1)
    out["count_rc"] = rt.cudaGetDeviceCount(ctypes.byref(n))
    out["count"] = n.value
    if n.value > 0:
        prop = ctypes.create_string_buffer(4096)
        rt.cudaGetDeviceProperties_v2(prop, 0)
        out["name"] = prop.raw[:256].split(b"\\0")[0].decode()
        out["uuid"] = prop.raw[256:272].hex()
        out["total"] = ctypes.c_size_t.from_buffer(prop, 288).value
        sm = ctypes.c_int()
        rt.cudaDeviceGetAttribute(ctypes.byref(sm), 16, 0)  # cudaDevAttrMultiProcessorCount
        out["sms"] = sm.value
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        out["meminfo_total"] = total.value
        ptr = ctypes.c_void_p()
        out["allocs"] = [rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(int(s))) for s in sys.argv[2:]]
        import pynvml as N
        N.nvmlInit()
        u = out["uuid"]
        mig = N.nvmlDeviceGetHandleByUUID("MIG-" + "-".join([u[:8], u[8:12], u[12:16], u[16:20], u[20:]]))
        out["nvml_used"] = N.nvmlDeviceGetMemoryInfo(mig).used
    print(json.dumps(out))
    """
)


def _cudart(env: dict[str, str], visible: str | None, *sizes: int) -> dict:
    lib = cudart.runtime_dir("12") / "lib" / "libcudart.so.12"
    env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run(
        [sys.executable, "-c", CUDART, str(lib), *map(str, sizes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_cuda_runtime_sees_only_its_instance(a100: dict[str, str]) -> None:
    small, large = _create(a100)
    # 9 GiB fits the 1g.10gb (9.5 GiB); one more GiB does not: refused by the driver, no shim loaded
    seen = _cudart(a100, small["uuid"], 9 * GIB, 1 * GIB)
    assert seen["count"] == 1 and seen["name"] == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert "MIG-" + "-".join([seen["uuid"][:8], seen["uuid"][8:12]]) == small["uuid"][:17]
    assert seen["total"] == seen["meminfo_total"] == 9728 * MIB and seen["sms"] == 14
    assert seen["allocs"] == [0, 2]  # cudaSuccess, cudaErrorMemoryAllocation
    assert seen["nvml_used"] >= 9 * GIB  # NVML's MIG device showed it while the process held it

    # the other instance's memory is its own: 30 GiB there, whatever the 1g holds
    other = _cudart(a100, large["uuid"], 30 * GIB, 9 * GIB, 2 * GIB)
    assert (other["count"], other["name"], other["total"], other["sms"]) == (
        1, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40192 * MIB, 42,
    )  # fmt: skip
    assert other["allocs"] == [0, 0, 2]

    # CUDA enumerates one MIG device per process, however many are named or visible: no peers
    assert _cudart(a100, f"{large['uuid']},{small['uuid']}")["name"].endswith("MIG 3g.40gb")
    assert _cudart(a100, None)["count"] == 1
    # the card itself is not a CUDA device in MIG mode; an entry naming nothing ends the list
    assert _cudart(a100, "nonsense," + small["uuid"])["count"] == 0
    assert _cudart(a100, "0")["name"].endswith("MIG 1g.10gb")


def test_a_killed_process_frees_its_instance(built: ShimPaths, a100: dict[str, str]) -> None:
    """While a process holds memory on a MIG device its instances cannot go; once it is killed the
    driver frees its memory (the daemon, however it died) and they can."""
    small, _ = _create(a100)
    holder = subprocess.Popen(
        [str(built.fake_dir.parent / "probe" / "gpuslice-probe"), "hold", "4Gi", "0"],
        env={**a100, "CUDA_VISIBLE_DEVICES": small["uuid"]}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    destroy = """
    p1 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    gi = N.nvmlDeviceGetGpuInstanceById(h, 1)
    cis = (N.c_nvmlComputeInstance_t * 1)(); n = N.c_uint(0)
    N.nvmlGpuInstanceGetComputeInstances(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, cis, N.byref(n))
    out["used"] = mig_devices()[0]["used"]
    out["card_used"] = N.nvmlDeviceGetMemoryInfo(h).used
    mig = N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    procs = lambda d: [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                       for p in N.nvmlDeviceGetComputeRunningProcesses(d)]
    other = N.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    out["procs"] = {"card": procs(h), "mig": procs(mig), "other": procs(other)}
    out["ci"] = err(N.nvmlComputeInstanceDestroy, cis[0]) if n.value else "gone"
    out["gi"] = err(N.nvmlGpuInstanceDestroy, gi)
    """
    try:
        assert holder.stdout is not None and "held" in holder.stdout.readline()
        held = _nvml(a100, destroy)
        # NVML lists the process with its instance's ids, on the card and on its MIG device only
        listed = [[holder.pid, 4 * GIB, 1, 0]]
        assert held.pop("procs") == {"card": listed, "mig": listed, "other": []}
        assert held == {"used": 4 * GIB, "card_used": 4 * GIB, "ci": N_IN_USE, "gi": N_IN_USE}
    finally:
        holder.kill()
        holder.wait(timeout=30)
    freed = _nvml(a100, destroy)
    assert (freed["used"], freed["procs"]["card"], freed["ci"], freed["gi"]) == (0, [], None, None)


# nvidia-smi mig -lgip of the other models: (id, name, instances, MiB, SMs) by profile index
OTHER_MODELS = {
    "NVIDIA A100-SXM4-40GB": {
        0: (19, "MIG 1g.5gb", 7, 4864, 14), 7: (20, "MIG 1g.5gb+me", 1, 4864, 14),
        9: (15, "MIG 1g.10gb", 4, 9856, 14), 1: (14, "MIG 2g.10gb", 3, 9856, 28),
        2: (9, "MIG 3g.20gb", 2, 19968, 42), 3: (5, "MIG 4g.20gb", 1, 19968, 56),
        4: (0, "MIG 7g.40gb", 1, 40192, 98),
    },
    "NVIDIA H100 80GB HBM3": {
        0: (19, "MIG 1g.10gb", 7, 9984, 16), 7: (20, "MIG 1g.10gb+me", 1, 9984, 16),
        9: (15, "MIG 1g.20gb", 4, 20096, 26), 1: (14, "MIG 2g.20gb", 3, 20096, 32),
        2: (9, "MIG 3g.40gb", 2, 40448, 60), 3: (5, "MIG 4g.40gb", 1, 40448, 64),
        4: (0, "MIG 7g.80gb", 1, 81152, 132),
    },
}  # fmt: skip


@pytest.mark.parametrize("model", OTHER_MODELS)
def test_the_other_models_profiles(tmp_path: Path, built: ShimPaths, model: str) -> None:
    config = simulate.write_fake_config(simulate.parse_gpu_spec(f"1x {model}", seed="m"), tmp_path / "f.conf")
    env = _env(config, built)
    _enable(env)
    table = _nvml(
        env,
        """
        out["name"] = N.nvmlDeviceGetName(h)
        out["cc"] = list(N.nvmlDeviceGetCudaComputeCapability(h))
        out["profiles"] = {}
        for idx in range(17):
            try:
                p = N.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except N.NVMLError_NotSupported:
                continue
            out["profiles"][idx] = [p.id, p.name, p.instanceCount, p.memorySizeMB, p.multiprocessorCount]
        """,
    )
    assert table["name"] == model and table["cc"] == ([9, 0] if "H100" in model else [8, 0])
    assert {int(k): tuple(v) for k, v in table["profiles"].items()} == OTHER_MODELS[model]


def test_nvitop_shows_the_mig_devices_and_their_process(built: ShimPaths, a100: dict[str, str]) -> None:
    """The monitor tenants and admins run (nvitop 1.7.2 on nvidia-ml-py): its screen lists the card's
    MIG devices with their instance ids, memory and BAR1, and a process on one of them."""
    small, _ = _create(a100)
    holder = subprocess.Popen(
        [str(built.fake_dir.parent / "probe" / "gpuslice-probe"), "hold", "2Gi", "0"],
        env={**a100, "CUDA_VISIBLE_DEVICES": small["uuid"]}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and "held" in holder.stdout.readline()
        env = {**a100, "PYTHONPATH": nvitop_pythonpath(), "COLUMNS": "160", "TERM": "dumb"}
        screen = subprocess.run(
            [sys.executable, "-m", "nvitop", "--once"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    assert screen.returncode == 0, screen.stderr
    rows = [line for line in screen.stdout.splitlines() if "GI/CI" in line]
    assert len(rows) == 2, screen.stdout
    assert re.search(r"1g\.10gb @ GI/CI: 1/0 │ +2048MiB / +9728MiB │ BAR1:", rows[0]), rows[0]
    assert re.search(r"3g\.40gb @ GI/CI: 2/0 │ +0B / 39\.25GiB │", rows[1]), rows[1]
    # listed under its MIG device (GPU 0, MIG device 0)
    assert re.search(rf"│ 0:0\s+{holder.pid} C\s+\S+\s+2048MiB", screen.stdout), screen.stdout


TORCH_ON_MIG = """
import json, torch
p = torch.cuda.get_device_properties(0)
out = {"count": torch.cuda.device_count(), "name": p.name, "total": p.total_memory,
       "sms": p.multi_processor_count, "free": torch.cuda.mem_get_info()[0]}
held = torch.empty(9 * 2**30, dtype=torch.uint8, device="cuda")
try:
    torch.empty(2**30, dtype=torch.uint8, device="cuda")
    out["oom"] = None
except torch.cuda.OutOfMemoryError as e:
    out["oom"] = str(e).splitlines()[0]
print(json.dumps(out))
"""


@pytest.mark.slow(seconds=15)
def test_pytorch_on_a_mig_device_runs_out_at_the_instance(a100: dict[str, str]) -> None:
    """PyTorch (its CUDA 12 build) given CUDA_VISIBLE_DEVICES=MIG-...: one device of the instance's
    size, and torch.cuda.OutOfMemoryError past it, from the driver (no shim loaded)."""
    small, _ = _create(a100)
    roots = [ensure_unpacked(name, version) for name, version in TORCH]
    libs = sorted(str(d) for root in roots for d in (root / "nvidia").glob("*/lib"))
    env = {
        **a100,
        "CUDA_VISIBLE_DEVICES": small["uuid"],
        "PYTHONPATH": os.pathsep.join(map(str, roots)),
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, a100["LD_LIBRARY_PATH"]]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_ON_MIG], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["count"] == 1 and seen["name"] == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert seen["total"] == seen["free"] == 9728 * MIB and seen["sms"] == 14
    assert seen["oom"] and "total capacity of 9.50 GiB" in seen["oom"], seen["oom"]


def test_an_instances_memory_outlives_a_restart_of_the_daemon(tmp_path: Path, built: ShimPaths) -> None:
    """The daemon keeps no MIG state of its own: a new one serves the instances and the memory that
    live processes hold on them as the old one left them, and frees what dead ones held."""
    config = simulate.write_fake_config(simulate.parse_gpu_spec(A100_80, seed="mig"), tmp_path / "f.conf")
    env = _env(config, built)
    daemon = simulate.start_fake_driverd(config)
    probe = str(built.fake_dir.parent / "probe" / "gpuslice-probe")
    holders: list[subprocess.Popen[str]] = []
    try:
        small, _ = _create(env)
        on_small = {**env, "CUDA_VISIBLE_DEVICES": small["uuid"]}
        for size in ("3Gi", "2Gi"):
            holders.append(
                subprocess.Popen([probe, "hold", size, "0"], env=on_small, stdout=subprocess.PIPE, text=True)
            )
            assert holders[-1].stdout is not None and "held" in holders[-1].stdout.readline()
        daemon.terminate()
        daemon.wait(timeout=30)
        holders[1].kill()  # dies while no daemon watches
        holders[1].wait(timeout=30)
        daemon = simulate.start_fake_driverd(config)
        after = _nvml(env, 'out["used"] = [d["used"] for d in mig_devices()]')
        assert after["used"] == [3 * GIB, 0]  # the live holder's; the dead one's freed
        more = _cudart(env, small["uuid"], 6 * GIB, 1 * GIB)
        assert more["allocs"] == [0, 2]  # 3 GiB still held by the live holder + 6 GiB = 9 of 9.5 GiB
    finally:
        for h in holders:
            h.kill()
            h.wait(timeout=30)
        daemon.terminate()
        daemon.wait(timeout=30)
