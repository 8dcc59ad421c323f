"""The driver test double as the node agent uses it: GPUs from a spec, loaded under pynvml."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gpuslice_dev.gpusim.simulate import KNOWN_MODELS, GpuSpecError, parse_gpu_spec, write_fake_config
from shim.shim_helpers import GIB, Holder, probe, run, values


def test_parse_gpu_spec_counts_models_and_seeds_uuids():
    gpus = parse_gpu_spec("2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB", seed="node-a")
    assert [g.name for g in gpus] == ["Tesla V100-PCIE-32GB"] * 2 + ["NVIDIA A100-SXM4-40GB"]
    assert [g.memory_bytes for g in gpus] == [32 * GIB, 32 * GIB, 40 * GIB]
    assert [g.compute_capability for g in gpus] == ["7.0", "7.0", "8.0"]
    assert len({g.uuid for g in gpus}) == 3
    assert parse_gpu_spec("2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB", seed="node-a") == gpus
    other = parse_gpu_spec("2x Tesla V100-PCIE-32GB", seed="node-b")
    assert not {g.uuid for g in other} & {g.uuid for g in gpus}
    assert parse_gpu_spec("tesla v100-sxm2-16gb")[0].memory_bytes == 16 * GIB


@pytest.mark.parametrize("spec", ["", "2x", "3x GeForce 256", "0x Tesla T4"])
def test_bad_gpu_spec_names_the_known_models(spec):
    with pytest.raises(GpuSpecError) as err:
        parse_gpu_spec(spec)
    if "GeForce" in spec:
        for name in KNOWN_MODELS:
            assert name in str(err.value)


AGENT_VIEW = textwrap.dedent(
    """
    import sys
    from gpuslice_dev.gpusim.simulate import use_fake_driver
    use_fake_driver(sys.argv[1])
    import pynvml
    pynvml.nvmlInit()
    print(f"count={pynvml.nvmlDeviceGetCount()}")
    print(f"driver={pynvml.nvmlSystemGetDriverVersion()}")
    print(f"cuda={pynvml.nvmlSystemGetCudaDriverVersion()}")
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        cc = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        print(f"gpu{i}.name={pynvml.nvmlDeviceGetName(h)}")
        print(f"gpu{i}.uuid={pynvml.nvmlDeviceGetUUID(h)}")
        print(f"gpu{i}.total={pynvml.nvmlDeviceGetMemoryInfo(h).total}")
        print(f"gpu{i}.cc={cc[0]}.{cc[1]}")
        print(f"gpu{i}.minor={pynvml.nvmlDeviceGetMinorNumber(h)}")
        print(f"gpu{i}.bus={pynvml.nvmlDeviceGetPciInfo(h).busId}")
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        print(f"gpu{i}.procs=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
        try:
            pynvml.nvmlDeviceGetMigMode(h)
            print(f"gpu{i}.mig=supported")
        except pynvml.NVMLError_NotSupported:
            print(f"gpu{i}.mig=not-supported")
    """
)


def test_pynvml_in_the_agent_process_binds_to_the_double(tmp_path, make_slice, built):
    gpus = parse_gpu_spec("2x Tesla V100-PCIE-32GB", seed="node-a")
    config = write_fake_config(gpus, tmp_path / "gpus.conf")
    result = subprocess.run(
        [sys.executable, "-c", AGENT_VIEW, str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    v = values(result.stdout)
    assert v["count"] == "2"
    assert v["driver"] == "535.183.01"
    assert v["cuda"] == "12020"
    assert v["gpu1.uuid"] == gpus[1].uuid
    assert v["gpu0.total"] == str(32 * GIB)
    assert v["gpu0.cc"] == "7.0"
    assert v["gpu1.minor"] == "1"
    assert v["gpu1.bus"] == "00000000:05:00.0"
    assert v["gpu0.procs"] == ""
    assert v["gpu0.mig"] == "not-supported"


def test_nvml_lists_processes_with_their_memory(make_slice, built):
    s = make_slice(memory_bytes=None)
    holder = Holder(s, built, 3 * GIB)
    try:
        v = values(
            run(s, [sys.executable, "-c", AGENT_VIEW, s.env["GPUSLICE_FAKE_GPU_CONFIG"]], shim=False).stdout
        )
    finally:
        holder.close()
    assert v["gpu0.procs"] == f"{holder.proc.pid}:{3 * GIB}"


def test_the_double_refuses_beyond_the_card_like_the_driver(make_slice, built):
    s = make_slice(memory_bytes=None)
    assert values(run(s, [probe(built), "alloc", 32 * GIB + 1], shim=False).stdout)["rc"] == "2"
    assert values(run(s, [probe(built), "alloc", 32 * GIB], shim=False).stdout)["rc"] == "0"
