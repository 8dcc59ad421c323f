"""The capability devices of a MIG claim's CDI spec: the simulated driver's /proc files read as the
NVIDIA tooling reads a real node's, and the spec built from them names one instance's devices only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpuslice.agent import cdi
from gpuslice_dev.gpusim import simulate

CARD = {"path": "/dev/nvidia1", "hostPath": "/h/nvidia1"}
TOOLKIT = {
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": "GPU-a", "containerEdits": {"deviceNodes": [CARD]}},
        {"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}, CARD]}},
    ],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [
            {"path": "/dev/nvidiactl"},
            {"path": "/dev/nvidia-uvm"},
            {"path": "/dev/nvidia-caps/nvidia-cap1"},  # config: makes instances; never handed out
        ],
        "mounts": [{"hostPath": "/h/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}],
    },
}


def test_the_doubles_mig_minors_are_the_kernels_layout() -> None:
    minors = cdi.parse_mig_minors(simulate.render_mig_minors())
    # the lines NVIDIA's k8s-dra-driver-gpu quotes from a real node's file
    assert minors["config"] == 1 and minors["monitor"] == 2
    assert minors["gpu0/gi0/access"] == 3 and minors["gpu0/gi0/ci2/access"] == 6
    assert minors["gpu3/gi3/ci3/access"] == 439 and minors["gpu6/gi11/ci6/access"] == 919
    assert len(set(minors.values())) == len(minors)  # one device per capability
    assert cdi.char_major(simulate.render_proc_devices(), "nvidia-caps") == simulate.NVIDIA_CAPS_MAJOR
    assert cdi.char_major(simulate.render_proc_devices(), "nvidia") is None  # "nvidia-frontend" is not it
    assert cdi.char_major("Block devices:\n237 nvidia-caps\n", "nvidia-caps") is None


def test_a_1g_claims_spec_names_its_gi_and_ci_caps_and_no_other_instances() -> None:
    minors = cdi.parse_mig_minors(simulate.render_mig_minors())
    spec = cdi.build_mig_spec(
        "uid-1", mig_uuid="MIG-x", gpu_minor=1, gi=9, ci=0, minors=minors, caps_major=237,
        toolkit=TOOLKIT, card_uuid="GPU-a",
    )  # fmt: skip
    (device,) = spec["devices"]
    edits = device["containerEdits"]
    nodes = edits["deviceNodes"]
    gi, ci = minors["gpu1/gi9/access"], minors["gpu1/gi9/ci0/access"]
    assert [n["path"] for n in nodes] == [
        "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
        f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}",
    ]  # fmt: skip
    assert nodes[0]["hostPath"] == "/h/nvidia1"  # the toolkit's node of the card
    assert [(n["major"], n["minor"]) for n in nodes[3:]] == [(237, gi), (237, ci)]
    caps = {n["path"] for n in nodes if n["path"].startswith("/dev/nvidia-caps/")}
    others = {f"/dev/nvidia-caps/nvidia-cap{m}" for k, m in minors.items() if not k.startswith("gpu1/gi9/")}
    assert not caps & others
    assert edits["env"] == ["CUDA_VISIBLE_DEVICES=MIG-x", "NVIDIA_VISIBLE_DEVICES=MIG-x"]
    assert edits["mounts"] == TOOLKIT["containerEdits"]["mounts"]  # the driver's libraries


def test_a_node_whose_mig_minors_lack_the_instance_refuses_the_spec() -> None:
    with pytest.raises(cdi.MigCdiError, match="gpu40/gi1/access"):
        cdi.build_mig_spec(
            "uid-1", mig_uuid="MIG-x", gpu_minor=40, gi=1, ci=0,
            minors=cdi.parse_mig_minors(simulate.render_mig_minors()), caps_major=237, toolkit={},
            card_uuid="GPU-a",
        )  # fmt: skip


def test_the_toolkits_spec_is_found_as_yaml_or_json_and_its_absence_is_a_clear_error(tmp_path: Path) -> None:
    from gpuslice.agent import mig

    ours = {"kind": "gpuslice.io/slice", "devices": []}  # the agent's own specs share the dir
    (tmp_path / "gpuslice.io-slice-x.json").write_text(json.dumps(ours))
    with pytest.raises(mig.MigPrepareError, match="nvidia-ctk cdi generate"):
        mig.toolkit_spec([tmp_path, tmp_path / "absent"])
    (tmp_path / "nvidia.yaml").write_text(yaml.safe_dump(TOOLKIT))
    assert mig.toolkit_spec([tmp_path])["containerEdits"] == TOOLKIT["containerEdits"]
