"""Real usage into status: what status.usage says and when it is written (shim bypasses:
test_attribution.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, cast

from gpuslice.agent.checkpoint import Checkpoint, CheckpointStore, ClaimRecord, PreparedDevice
from gpuslice.agent.kube import Kube
from gpuslice.agent.owners import ClaimOwner
from gpuslice.agent.prepare import NodePaths
from gpuslice.agent.usage import (
    UsageReporter,
    _SliceState,
    claim_memory_bytes,
    should_write,
    usage_patch,
    usage_status,
)
from gpuslice.agent.violations import ViolationEnforcer
from gpuslice.kubehttp import ApiError
from gpuslice.shim.region import ProcessUsage, UsageSnapshot

GIB = 1024**3


def _snapshot(used: int, procs: list[tuple[int, int]], refused: int = 0) -> UsageSnapshot:
    return UsageSnapshot(
        initialized=True, version=1, memory_limit_bytes=8 * GIB, memory_used_bytes=used, compute_share=25,
        processes=[
            ProcessUsage(pid=pid, start_time=1, memory_used_bytes=b, memory_granted_bytes=b,
                         memory_peak_bytes=b, context_overhead_bytes=0, refused_allocations=0,
                         throttled_seconds=0.0)
            for pid, b in procs
        ],
        refused_allocations_total=refused, throttled_seconds_total=0.5, shim_utilization_percent=23.0,
        shim_utilization_time=1.0, throttle_delay_ns=0, lock_recoveries_total=0,
    )  # fmt: skip


def test_usage_status_reports_memory_processes_and_refusals() -> None:
    usage = usage_status(
        _snapshot(3 * GIB, [(7, 2 * GIB), (3, GIB)], refused=2), 8 * GIB, "2026-12-02T00:00:00Z"
    )
    assert usage["memoryUsedBytes"] == 3 * GIB
    assert usage["memoryLimitBytes"] == 8 * GIB
    assert [p["pid"] for p in usage["processes"]] == [3, 7]
    assert usage["refusedAllocations"] == 2
    assert usage["computeUtilizationPercent"] == 23.0
    assert "violation" not in usage


def test_no_write_when_only_the_time_changed_and_at_most_one_per_interval() -> None:
    a = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t1")
    same_later = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t2")
    changed = usage_status(_snapshot(2 * GIB, [(1, 2 * GIB)]), 8 * GIB, "t3")
    assert should_write(None, a, None, 0.0, 10.0)
    assert not should_write(a, same_later, 0.0, 100.0, 10.0)
    assert not should_write(a, changed, 0.0, 5.0, 10.0)  # changed, but inside the interval
    assert should_write(a, changed, 0.0, 10.0, 10.0)


def test_usage_goes_only_to_the_slice_that_owns_the_claim() -> None:
    """A GpuSlice deleted and re-created under its name while the old claim is still prepared: the old
    claim's usage (a violation among it) must not land on the new slice. The patch tests the uid."""
    usage = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t1")
    ops = usage_patch("uid-old", usage)
    assert ops[0] == {"op": "test", "path": "/metadata/uid", "value": "uid-old"}
    # the whole usage object replaces the last one: a violation that is over leaves no key behind
    assert ops[1] == {"op": "add", "path": "/status/usage", "value": usage}


class _Kube:
    def __init__(self, answers: list[ApiError | None]) -> None:
        self.answers, self.writes = answers, []  # type: list[ApiError | None], list[Any]

    async def patch_slice_usage(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        self.writes.append((namespace, name, ops))
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer


def test_a_refused_usage_write_is_tried_again_and_a_gone_slice_is_not() -> None:
    """A write the API server refused is not taken for written (that left a violation that was over
    on the slice for good): the next interval writes it again. A slice that is gone (404) is done."""
    refused = ApiError(422, "Unprocessable Entity", '{"message": "denied"}')
    kube = _Kube([refused, None, ApiError(404, "Not Found")])
    enforcer = ViolationEnforcer(node="n0", kube=cast(Kube, kube))
    reporter = UsageReporter(node="n0", paths=cast(Any, None), kube=cast(Kube, kube), enforcer=enforcer)
    state = _SliceState(ClaimOwner(key="ns/s", uid="uid-s", labels=()))
    usage = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t1")
    assert asyncio.run(reporter._write_usage(state, usage)) is False
    assert state.write_error == 422
    assert asyncio.run(reporter._write_usage(state, usage)) is True
    assert state.write_error is None
    assert asyncio.run(reporter._write_usage(state, usage)) is True
    assert [w[:2] for w in kube.writes] == [("ns", "s")] * 3


class _Enforcer:
    async def sweep(self, records: object, owners: object) -> dict[str, str]:
        return {}

    def forget(self, keep: set[str]) -> None:
        pass


class _ClaimKube:
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {"labels": {}}}

    async def patch_slice_usage(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        pass


def test_a_fifo_for_a_usage_region_never_stops_the_loop_that_serves_kubelet(tmp_path: Path) -> None:
    # In a slice container: rm usage.bin && mkfifo usage.bin. The reader used to block in open() on
    # the loop that also answers kubelet's NodePrepareResources.
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", tmp_path / "libgpuslice.so")
    device = PreparedDevice(
        request="gpu", pool="n0", device="gpu-0-slice-0", gpu_uuid="GPU-1", memory_bytes=8 * GIB,
        compute_share=25, cdi_device_ids=[],
    )  # fmt: skip
    record = ClaimRecord(uid="u1", namespace="t", name="s", state="Prepared", devices=[device])
    CheckpointStore(paths.state_dir / "checkpoint.json").save(Checkpoint(claims={"u1": record}))
    paths.usage_dir("u1").mkdir(parents=True)
    fifo = paths.usage_dir("u1") / "usage.bin"
    os.mkfifo(fifo)
    reporter = UsageReporter(
        node="n0", paths=paths, kube=cast(Kube, _ClaimKube()), enforcer=cast(ViolationEnforcer, _Enforcer())
    )
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0.01)

    async def main() -> bool:
        hb = asyncio.create_task(heartbeat())
        tick = asyncio.create_task(reporter.tick())
        await asyncio.sleep(0.5)
        done = tick.done()
        hb.cancel()
        return done

    # Run it where a blocked open() can be freed: a thread whose loop a writer on the FIFO unblocks.
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(main())), daemon=True)
    t.start()
    t.join(3)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the stuck reader go
        t.join(5)
    assert result == [True], "the usage reader blocked the event loop"
    assert beats >= 10, f"the loop ran {beats} heartbeats in 0.5 s"


def test_a_2_card_products_memory_limit_is_both_cards() -> None:
    def whole(i: int) -> PreparedDevice:
        return PreparedDevice(
            request="gpu", pool="n0", device=f"gpu-{i}-x2", gpu_uuid=f"GPU-{i}", memory_bytes=32 * GIB,
            compute_share=100, cdi_device_ids=[],
        )  # fmt: skip

    pair = ClaimRecord(uid="u", namespace="t", name="pair", state="Prepared", devices=[whole(0), whole(1)])
    assert claim_memory_bytes(pair) == 64 * GIB
    # the product's region says unlimited (its cards are whole): the reading says both cards' memory
    unlimited = _snapshot(GIB, []).model_copy(update={"memory_limit_bytes": None, "compute_share": 100})
    usage = usage_status(unlimited, claim_memory_bytes(pair), "2026-12-02T00:00:00Z")
    assert usage["memoryLimitBytes"] == 64 * GIB
