"""`gpuslice explain` turns a GpuSlice's status into plain words and tells the tenant what to do."""

from __future__ import annotations

from gpuslice.explain import explain

PACKAGE = {
    "metadata": {"name": "v100-16g"},
    "spec": {"displayName": "V100 50% (16 GiB)", "gpuModel": "Tesla V100-PCIE-32GB", "fraction": 50},
    "status": {"memoryPerSlice": "16Gi", "capacity": {"gpus": 4, "slicesTotal": 8, "slicesFree": 0}},
}


def _slice(status: dict[str, object]) -> dict[str, object]:
    return {
        "metadata": {"namespace": "team-a", "name": "train-1"},
        "spec": {"package": "v100-16g"},
        "status": status,
    }


def test_waiting_for_a_full_cluster_says_it_starts_by_itself() -> None:
    text = explain(
        _slice(
            {
                "phase": "Pending",
                "reason": "AllGpusFull",
                "message": "every Tesla V100-PCIE-32GB is full",
                "quota": {"used": 1, "hard": 2, "quota": "gpuslice"},
            }
        ),
        PACKAGE,
    )
    assert "state:    Pending (AllGpusFull)" in text
    assert "1 of 2 v100-16g slices used in team-a" in text
    assert "0 of 8 v100-16g slices free on 4 GPU(s)" in text
    assert "starts by itself when a slice of a matching GPU frees" in text


def test_quota_exceeded_points_at_slices_to_delete() -> None:
    text = explain(
        _slice({"phase": "Pending", "reason": "QuotaExceeded", "message": "quota 2 of 2"}), PACKAGE
    )
    assert "delete a slice you no longer need: kubectl get gpuslices -n team-a" in text


def test_allocated_slice_says_where_and_gives_no_advice() -> None:
    text = explain(
        _slice(
            {
                "phase": "InUse",
                "reason": "InUse",
                "allocations": [
                    {
                        "claim": "train-1",
                        "node": "n1",
                        "gpuUUID": "GPU-abc",
                        "device": "gpu-0-v100-16g-1",
                        "pod": "p",
                    }
                ],
                "usage": {
                    "memoryUsedBytes": 2 * 1024**3,
                    "memoryLimitBytes": 16 * 1024**3,
                    "processes": [{}],
                },
                "conditions": [
                    {"type": "MemoryIsolated", "status": "False", "message": "process 7 bypassed"}
                ],
            }
        ),
        PACKAGE,
    )
    assert "claim train-1: GPU GPU-abc on node n1, device gpu-0-v100-16g-1, held by pod p" in text
    assert "2 GiB of 16 GiB GPU memory, 1 process(es)" in text
    assert "warning:  process 7 bypassed" in text
    assert "what you can do" not in text


def test_missing_package_and_unseen_slice_are_said_plainly() -> None:
    text = explain({"metadata": {"namespace": "a", "name": "b"}, "spec": {"package": "nope"}}, None)
    assert "no GpuPackage of that name exists" in text
    assert "not yet seen by the operator" in text


FULL_PACKAGE = {
    "metadata": {"name": "v100-16g"},
    "spec": {"gpuModel": "Tesla V100-PCIE-32GB", "fraction": 50},
    # The package's count, written a moment before or after the slice's verdict.
    "status": {"memoryPerSlice": "16Gi", "capacity": {"gpus": 1, "slicesTotal": 2, "slicesFree": 2}},
}
WAITS_FOR_A_FULL_CARD = {
    "phase": "Pending",
    "reason": "AllGpusFull",
    "message": "pod p waits: all 2 v100-16g slices on 1 GPU(s) are taken",
    "capacity": {"gpus": 1, "slicesTotal": 2, "slicesFree": 0},
}


def test_a_slice_waiting_on_full_cards_never_shows_free_slices_as_its_capacity() -> None:
    text = explain(_slice(WAITS_FOR_A_FULL_CARD), FULL_PACKAGE)
    assert "capacity: 0 of 2 v100-16g slices free on 1 GPU(s) when this status was decided" in text
    assert "2 of 2 v100-16g slices free on" not in text
    assert "since:    the package counts 2 of 2 free now" in text


def test_the_package_count_agreeing_with_the_verdict_is_said_once() -> None:
    agreeing = {**FULL_PACKAGE, "status": {"capacity": {"gpus": 1, "slicesTotal": 2, "slicesFree": 0}}}
    text = explain(_slice(WAITS_FOR_A_FULL_CARD), agreeing)
    assert "capacity: 0 of 2 v100-16g slices free on 1 GPU(s) when this status was decided" in text
    assert "since:" not in text


def test_an_old_status_without_its_count_names_the_package_count_for_what_it_is() -> None:
    older = {k: v for k, v in WAITS_FOR_A_FULL_CARD.items() if k != "capacity"}
    text = explain(_slice(older), FULL_PACKAGE)
    assert "2 of 2 v100-16g slices free on 1 GPU(s) in the cluster (the package's count, newer" in text


def test_a_slice_waiting_on_unhealthy_cards_says_they_are_out_of_service() -> None:
    sick = {
        "metadata": {"name": "v100-16g"},
        "spec": {"gpuModel": "Tesla V100-PCIE-32GB", "fraction": 50},
        "status": {"capacity": {"gpus": 0, "slicesTotal": 0, "slicesFree": 0, "unhealthyGpus": 2}},
    }
    waits = {
        "phase": "Pending",
        "reason": "GpusUnhealthy",
        "message": "pod p waits: the only GPU(s) of model 'Tesla V100-PCIE-32GB' (2) are unhealthy",
        "capacity": {"gpus": 0, "slicesTotal": 0, "slicesFree": 0},
    }
    text = explain(_slice(waits), sick)
    assert "state:    Pending (GpusUnhealthy)" in text
    assert "unhealthy: 2 GPU(s) of the model are out of service" in text
    assert "the platform team resets or replaces the card" in text
    assert "unhealthy:" not in explain(_slice(WAITS_FOR_A_FULL_CARD), FULL_PACKAGE)


def test_software_that_cannot_use_the_gpu_is_a_warning_with_what_to_do() -> None:
    obj = {
        "metadata": {"namespace": "team-a", "name": "llm"},
        "spec": {"package": "v100-8g"},
        "status": {
            "phase": "InUse", "reason": "InUse",
            "conditions": [
                {"type": "SoftwareCompatible", "status": "False", "reason": "NoKernelImageForGpu",
                 "message": "process ollama (pid 1) loaded kernels built for sm_75; use one with sm_70"},
                {"type": "GpuIdle", "status": "False", "reason": "GpuUsed", "message": "first used at ..."},
            ],
        },
    }  # fmt: skip
    out = explain(obj, None)
    assert "warning:  process ollama (pid 1) loaded kernels built for sm_75" in out
    assert "first used" not in out


def test_a_multi_gpu_product_says_every_card_it_holds() -> None:
    alloc = {
        "claim": "pair", "node": "n1", "gpuUUID": "GPU-a", "device": "gpu-0-v100-x2", "pod": "p",
        "gpuUUIDs": ["GPU-a", "GPU-b"], "devices": ["gpu-0-v100-x2", "gpu-1-v100-x2"],
    }  # fmt: skip
    text = explain(_slice({"phase": "InUse", "reason": "InUse", "gpus": 2, "allocations": [alloc]}), PACKAGE)
    assert (
        "claim pair: 2 GPUs GPU-a, GPU-b on node n1, devices gpu-0-v100-x2, gpu-1-v100-x2, held by pod p"
        in text
    )
