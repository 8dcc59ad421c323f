"""Shim bypasses caught from the host: every GPU process attributed (host PID -> cgroup -> pod UID ->
claims) and judged against its own slice; unknown processes on sold cards flagged; Stop vs Report."""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice import procfs
from gpuslice.agent import attribution as at
from gpuslice.api.package import GpuPackageSpec, OnViolation
from gpuslice.domain.gpu_processes import (
    KIND_OVER,
    KIND_UNKNOWN,
    GpuProcess,
    Owner,
    PodClaims,
    SliceClaim,
    judge,
)
from gpuslice.metrics import ViolationKind

GIB = 1024**3
UID_A = "0b5e4a8e-7f1c-4d5e-9a3b-1c2d3e4f5a6b"
UID_B = "9f8e7d6c-5b4a-4321-8765-0a1b2c3d4e5f"


def test_pod_uid_from_kubelet_cgroup_paths() -> None:
    # cgroupfs driver (the real node of tests/node), per QoS class
    assert at.pod_uid_of_path(f"/kubepods/besteffort/pod{UID_A}/0123abcd") == UID_A
    assert at.pod_uid_of_path(f"/gpuslice-node-0/kubepods/pod{UID_A}/0123abcd") == UID_A
    # systemd driver: underscores in the slice name
    u = UID_A.replace("-", "_")
    path = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-1.scope"
    assert at.pod_uid_of_path(path) == UID_A
    assert at.pod_uid_of_path(f"/kubepods.slice/kubepods-pod{u}.slice") == UID_A
    # seen from another cgroup namespace (the agent's container)
    assert at.pod_uid_of_path(f"/../../kubepods/burstable/pod{UID_A}/c") == UID_A
    # not a pod: host processes, or a pod UID that is not a whole path component
    assert at.pod_uid_of_path("/user.slice/user-0.slice/session-1.scope") is None
    assert at.pod_uid_of_path("/") is None
    assert at.pod_uid_of_path(f"/kubepods/xpod{UID_A}/c") is None
    assert at.pod_uid_of_path(f"/kubepods/pod{UID_A}-evil/c") is None


def test_a_nested_cgroup_cannot_claim_another_pod() -> None:
    # a container allowed to create cgroups nests them under its own pod's: the first one counts
    path = f"/kubepods/burstable/pod{UID_A}/c1/pod{UID_B}"
    assert at.pod_uid_of_path(path) == UID_A


def test_owner_from_v1_and_v2_cgroup_files() -> None:
    v2 = f"0::/kubepods/besteffort/pod{UID_A}/c1\n"
    assert at.owner_from_cgroup(v2) == Owner(UID_A)
    v1 = (
        f"12:memory:/kubepods/besteffort/pod{UID_A}/c1\n"
        f"4:pids:/kubepods/besteffort/pod{UID_A}/c1\n"
        "1:name=systemd:/\n"
        "0::/\n"
    )
    assert at.owner_from_cgroup(v1) == Owner(UID_A)
    host = "12:memory:/user.slice\n4:pids:/\n0::/\n"
    assert at.owner_from_cgroup(host) == Owner(None)
    assert at.owner_from_cgroup("0::/init.scope\n") == Owner(None)
    # hierarchies disagree (moved by hand in one of them): not certain
    mixed = f"12:memory:/kubepods/pod{UID_A}/c\n4:pids:/kubepods/pod{UID_B}/c\n"
    assert at.owner_from_cgroup(mixed) == Owner(None, certain=False)
    half = f"12:memory:/kubepods/pod{UID_A}/c\n4:pids:/\n"
    assert at.owner_from_cgroup(half) == Owner(None, certain=False)
    assert at.owner_from_cgroup("") == Owner(None, certain=False)


def _fake_proc(root: Path, pid: int, cgroup: str, start: int = 4242, state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    rest = " ".join(["0"] * 17)  # fields 5..21; the start time is field 22
    (d / "stat").write_text(f"{pid} (cuda prog) {state} 1 {rest} {start} 0 0\n")


def test_read_owners_from_a_fake_proc_tree(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 100, f"0::/kubepods/besteffort/pod{UID_A}/c1\n", start=7)
    _fake_proc(tmp_path, 101, "0::/system.slice/sshd.service\n")
    _fake_proc(tmp_path, 102, f"0::/kubepods/pod{UID_B}/c\n", state="Z")
    seen = at.read_owners([100, 101, 102, 103], tmp_path)
    assert seen[100] == at.Seen(Owner(UID_A), 7)
    assert seen[101].owner == Owner(None)
    assert seen[102].owner == Owner(None, certain=False)  # a zombie holds nothing and is nobody's
    assert seen[103] == at.Seen(Owner(None, certain=False), None)  # gone


def _pod(uid: str, name: str, claims: list[dict[str, str]], statuses: list[dict[str, str]] | None = None):
    return {
        "metadata": {"uid": uid, "name": name, "namespace": "team-a"},
        "spec": {"resourceClaims": claims},
        "status": {"resourceClaimStatuses": statuses} if statuses is not None else {},
    }


def test_pod_claims_by_name_and_from_templates() -> None:
    uids = {("team-a", "llm"): "c-llm", ("team-a", "w-gpu-x1"): "c-gen", ("team-b", "llm"): "c-other"}
    direct = _pod(UID_A, "p", [{"name": "gpu", "resourceClaimName": "llm"}])
    assert at.pod_claims(direct, uids) == PodClaims("team-a", "p", frozenset({"c-llm"}))
    templated = _pod(
        UID_B,
        "w",
        [{"name": "gpu", "resourceClaimTemplateName": "t"}],
        [{"name": "gpu", "resourceClaimName": "w-gpu-x1"}],
    )
    assert at.pod_claims(templated, uids) == PodClaims("team-a", "w", frozenset({"c-gen"}))
    # the generated claim is not named yet: not known (looked up again later)
    assert (
        at.pod_claims(_pod(UID_B, "w", [{"name": "gpu", "resourceClaimTemplateName": "t"}], []), uids) is None
    )
    # a claim of the pod that is not prepared here does not count
    other = _pod(UID_A, "p", [{"name": "gpu", "resourceClaimName": "elsewhere"}])
    assert at.pod_claims(other, uids) == PodClaims("team-a", "p", frozenset())


S1 = SliceClaim("c1", "team-a/s1", "GPU-1", 8 * GIB)
S2 = SliceClaim("c2", "team-b/s2", "GPU-1", 16 * GIB)
PODS = {
    UID_A: PodClaims("team-a", "pa", frozenset({"c1"})),
    UID_B: PodClaims("team-b", "pb", frozenset({"c2"})),
}


def test_a_process_is_judged_against_its_own_slice_not_the_largest_on_the_card() -> None:
    # 10 GiB is within the 16 GiB slice on the card, but the process is pod A's, whose slice is 8 GiB
    procs = [GpuProcess("GPU-1", 10, 10 * GIB), GpuProcess("GPU-1", 11, 12 * GIB)]
    owners = {10: Owner(UID_A), 11: Owner(UID_B)}
    (f,) = judge(procs, owners, PODS, [S1, S2])
    assert (f.kind, f.pids, f.slices, f.allowed_bytes, f.stop) == (
        KIND_OVER,
        (10,),
        ("team-a/s1",),
        8 * GIB,
        (10,),
    )
    assert "8192 MiB" in f.message and "bypassed the gpuslice shim" in f.message
    assert "onViolation: Stop" in f.message


def test_the_processes_of_a_slice_share_its_limit_and_the_largest_are_stopped_first() -> None:
    procs = [
        GpuProcess("GPU-1", 10, 3 * GIB),
        GpuProcess("GPU-1", 11, 4 * GIB),
        GpuProcess("GPU-1", 12, 5 * GIB),
    ]
    owners = dict.fromkeys((10, 11, 12), Owner(UID_A))
    (f,) = judge(procs, owners, PODS, [S1, S2])
    assert f.used_bytes == 12 * GIB and f.pids == (10, 11, 12)
    assert f.stop == (12,)  # without the 5 GiB one the other two fit the 8 GiB slice
    within = [GpuProcess("GPU-1", 10, 3 * GIB), GpuProcess("GPU-1", 11, 5 * GIB)]
    assert judge(within, owners, PODS, [S1, S2]) == []


def test_report_packages_are_only_reported() -> None:
    report = SliceClaim("c1", "team-a/s1", "GPU-1", 8 * GIB, OnViolation.REPORT)
    (f,) = judge([GpuProcess("GPU-1", 10, 9 * GIB)], {10: Owner(UID_A)}, PODS, [report])
    assert f.kind == KIND_OVER and f.stop == () and "onViolation: Report" in f.message


def test_unknown_processes_on_a_sold_card_are_flagged_on_every_slice_and_never_stopped() -> None:
    procs = [
        GpuProcess("GPU-1", 20, 1 * GIB),  # a host process
        GpuProcess("GPU-1", 21, 1 * GIB),  # /proc unreadable
        GpuProcess("GPU-1", 22, 1 * GIB),  # a pod not on this node
        GpuProcess("GPU-1", 23, 1 * GIB),  # a pod without a claim on this card
    ]
    third = "11111111-2222-4333-8444-555555555555"
    pods = {**PODS, third: PodClaims("team-c", "pc", frozenset({"c9"}))}
    owners = {20: Owner(None), 21: Owner(None, certain=False), 22: Owner(UID_B[::-1]), 23: Owner(third)}
    found = judge(procs, owners, pods, [S1, S2])
    assert [(f.kind, f.pids, f.slices, f.stop) for f in found] == [
        (KIND_UNKNOWN, (pid,), ("team-a/s1", "team-b/s2"), ()) for pid in (20, 21, 22, 23)
    ]
    assert "belongs to no pod (a host process)" in found[0].message
    assert "could not be attributed" in found[1].message
    assert "not on this node" in found[2].message
    assert "team-c/pc, which holds no slice of this GPU" in found[3].message


def test_a_process_of_a_slice_on_another_card_is_unknown_there() -> None:
    s3 = SliceClaim("c3", "team-a/s3", "GPU-2", 8 * GIB)
    (f,) = judge([GpuProcess("GPU-2", 30, 1 * GIB)], {30: Owner(UID_A)}, PODS, [S1, s3])
    assert f.kind == KIND_UNKNOWN and f.slices == ("team-a/s3",)


def test_processes_on_a_card_without_slices_are_returned_for_the_log_only() -> None:
    (f,) = judge([GpuProcess("GPU-9", 40, 30 * GIB)], {40: Owner(None)}, PODS, [S1])
    assert (f.kind, f.slices, f.stop) == (KIND_UNKNOWN, (), ())


def test_a_pod_with_two_slices_on_one_card_gets_both() -> None:
    s1b = SliceClaim("c1b", "team-a/s1b", "GPU-1", 8 * GIB)
    pods = {UID_A: PodClaims("team-a", "pa", frozenset({"c1", "c1b"}))}
    assert judge([GpuProcess("GPU-1", 10, 15 * GIB)], {10: Owner(UID_A)}, pods, [S1, s1b]) == []
    (f,) = judge([GpuProcess("GPU-1", 10, 17 * GIB)], {10: Owner(UID_A)}, pods, [S1, s1b])
    assert f.slices == ("team-a/s1", "team-a/s1b") and f.allowed_bytes == 16 * GIB


def test_finding_kinds_are_the_metric_kinds() -> None:
    assert {ViolationKind(KIND_OVER), ViolationKind(KIND_UNKNOWN)} == set(ViolationKind)


def test_package_policy_defaults_to_stop() -> None:
    assert GpuPackageSpec.model_validate({"gpuModel": "m", "fraction": 25}).isolation.on_violation == "Stop"
    spec = GpuPackageSpec.model_validate(
        {"gpuModel": "m", "fraction": 25, "isolation": {"onViolation": "Report"}}
    )

    class P:
        def __init__(self, spec: GpuPackageSpec) -> None:
            self.spec = spec

    assert at.package_policy({"r": P(spec)}, "r") == OnViolation.REPORT
    assert at.package_policy({}, "gone") == OnViolation.STOP


def test_pod_directory_lists_only_for_pod_uids_it_has_not_seen() -> None:
    calls = 0

    async def list_pods():
        nonlocal calls
        calls += 1
        return [_pod(UID_A, "pa", [{"name": "gpu", "resourceClaimName": "s1"}])]

    directory = at.PodDirectory(list_pods, miss_ttl=3600)
    uids = {("team-a", "s1"): "c1"}

    async def scenario() -> None:
        assert await directory.lookup({UID_A}, uids) == {UID_A: PodClaims("team-a", "pa", frozenset({"c1"}))}
        assert await directory.lookup({UID_A}, uids) == {UID_A: PodClaims("team-a", "pa", frozenset({"c1"}))}
        assert calls == 1
        assert await directory.lookup({UID_A, UID_B}, uids) == {
            UID_A: PodClaims("team-a", "pa", frozenset({"c1"}))
        }
        assert await directory.lookup({UID_B}, uids) == {}  # a miss is not looked up again at once
        assert calls == 2

    asyncio.run(scenario())


def test_find_violations_without_a_pod_list_stops_nobody(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 100, f"0::/kubepods/pod{UID_A}/c\n")

    async def failing():
        raise OSError("API down")

    found, seen = asyncio.run(
        at.find_violations(
            [GpuProcess("GPU-1", 100, 20 * GIB)], [S1], {}, at.PodDirectory(failing), proc=tmp_path
        )
    )
    (f,) = found
    assert f.kind == KIND_UNKNOWN and f.stop == () and seen[100].start_time == 4242


@contextmanager
def _python_child(code: str) -> Iterator[subprocess.Popen[str]]:
    """`python -c code` as a child (its stdout a pipe), killed on the way out if it still runs."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_stop_signals_only_the_process_that_was_judged() -> None:
    with _python_child("import time; time.sleep(60)") as child:
        seen = at.read_owner(child.pid)
        assert seen.start_time is not None
        # a different start time: the PID was reused, nothing is signalled
        assert not at.stop(child.pid, at.Seen(seen.owner, seen.start_time + 1))
        assert child.poll() is None
        assert at.stop(child.pid, seen)
        assert child.wait(timeout=10) == -9
    assert not at.stop(child.pid, seen)  # gone


def test_a_process_whose_leader_thread_exited_is_attributed_through_its_live_threads(tmp_path: Path) -> None:
    # The leader called SYS_exit while a worker holds the GPU memory: /proc/<pid>/stat says Z.
    _fake_proc(tmp_path, 100, f"0::/kubepods/pod{UID_A}/c1\n", state="Z", start=7)
    for tid, state in ((101, "S"), (102, "R")):
        task = tmp_path / "100" / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "cgroup").write_text(f"0::/kubepods/pod{UID_A}/c1\n")
        (task / "stat").write_text(f"{tid} (python3) {state} " + " ".join(["0"] * 18) + " 9 0\n")
    assert at.read_owner(100, tmp_path) == at.Seen(Owner(UID_A), 7)  # the process's start time
    # threads that disagree (one moved to another pod's cgroup) make it uncertain: reported, not stopped
    (tmp_path / "100" / "task" / "102" / "cgroup").write_text(f"0::/kubepods/pod{UID_B}/c\n")
    assert at.read_owner(100, tmp_path).owner == Owner(None, certain=False)


LEADER_EXITS = """
import ctypes, threading, time
threading.Thread(target=lambda: time.sleep(60)).start()  # the worker holding the memory
print("ready", flush=True)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit (x86_64): the leader thread alone
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="SYS_exit is 60 on x86_64")
def test_a_process_whose_leader_thread_exited_is_stopped() -> None:
    with _python_child(LEADER_EXITS) as child:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while (stat := procfs.read_stat(child.pid)) is not None and not stat.zombie:
            assert time.monotonic() < deadline, "the leader thread did not exit"
            time.sleep(0.05)
        seen = at.read_owner(child.pid)
        assert seen.owner.certain and seen.start_time is not None, seen  # not given up on
        assert at.stop(child.pid, seen)
        assert child.wait(timeout=10) == -9


def test_overlapping_claim_sets_cannot_hide_a_violation() -> None:
    # Pods holding {shared}, {m1} and {m1, shared}: 8 + 8 + 14 GiB on two 8 GiB slices. Judged by claim
    # set, each set fit (8 <= 8, 8 <= 8, 14 <= 16) and nothing was found.
    m1, shared = (
        SliceClaim("m1", "team-a/m1", "GPU-1", 8 * GIB),
        SliceClaim("sh", "team-a/shared", "GPU-1", 8 * GIB),
    )
    uids = ["11111111-0000-4000-8000-00000000000" + str(i) for i in range(3)]
    pods = {
        uids[0]: PodClaims("team-a", "only-shared", frozenset({"sh"})),
        uids[1]: PodClaims("team-a", "only-m1", frozenset({"m1"})),
        uids[2]: PodClaims("team-a", "both", frozenset({"m1", "sh"})),
    }
    procs = [
        GpuProcess("GPU-1", 10, 8 * GIB),
        GpuProcess("GPU-1", 11, 8 * GIB),
        GpuProcess("GPU-1", 12, 14 * GIB),
    ]
    owners = {10: Owner(uids[0]), 11: Owner(uids[1]), 12: Owner(uids[2])}
    (f,) = judge(procs, owners, pods, [m1, shared])
    assert (f.kind, f.pids, f.slices, f.used_bytes, f.allowed_bytes) == (
        KIND_OVER, (10, 11, 12), ("team-a/m1", "team-a/shared"), 30 * GIB, 16 * GIB,
    )  # fmt: skip
    assert f.stop == (12,)  # the largest; the other two fit their slices


def _brute_force_over(
    layout: dict[int, tuple[frozenset[str], int]], limits: dict[str, int]
) -> list[frozenset[str]]:
    """Every set of slices whose processes (those whose pods hold only slices of the set) hold more
    than the set's slices together: Hall's condition, by enumeration."""
    uids = sorted(limits)
    bad = []
    for mask in range(1, 1 << len(uids)):
        chosen = frozenset(u for i, u in enumerate(uids) if mask >> i & 1)
        held = sum(used for claims, used in layout.values() if claims <= chosen)
        if held > sum(limits[u] for u in chosen):
            bad.append(chosen)
    return bad


@st.composite
def _layouts(
    draw: st.DrawFn,
) -> tuple[list[SliceClaim], dict[str, PodClaims], list[GpuProcess], dict[int, Owner]]:
    n_slices = draw(st.integers(1, 4))
    policies = draw(
        st.lists(
            st.sampled_from([OnViolation.STOP, OnViolation.REPORT]), min_size=n_slices, max_size=n_slices
        )
    )
    claims = [
        SliceClaim(f"c{i}", f"team/s{i}", "GPU-1", draw(st.sampled_from([4, 8, 16])) * GIB, policies[i])
        for i in range(n_slices)
    ]
    pods: dict[str, PodClaims] = {}
    procs: list[GpuProcess] = []
    owners: dict[int, Owner] = {}
    pid = 100
    for p in range(draw(st.integers(1, 5))):
        held = draw(st.sets(st.sampled_from([c.uid for c in claims]), min_size=1))
        uid = f"00000000-0000-4000-8000-{p:012d}"
        pods[uid] = PodClaims("team", f"p{p}", frozenset(held))
        for used in draw(st.lists(st.integers(0, 20), min_size=1, max_size=3)):
            procs.append(GpuProcess("GPU-1", pid, used * GIB))
            owners[pid] = Owner(uid)
            pid += 1
    return claims, pods, procs, owners


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_the_judge_agrees_with_a_brute_force_judge_on_any_overlap(
    layout: tuple[list[SliceClaim], dict[str, PodClaims], list[GpuProcess], dict[int, Owner]],
) -> None:
    claims, pods, procs, owners = layout
    limits = {c.uid: c.limit_bytes for c in claims}
    by_pid = {p.pid: (pods[owners[p.pid].pod_uid or ""].claim_uids, p.used_bytes) for p in procs}
    found = [f for f in judge(procs, owners, pods, claims) if f.kind == KIND_OVER]
    key_to_uid = {c.key: c.uid for c in claims}
    # a violation is found exactly when the memory cannot be spread over the slices
    assert bool(found) == bool(_brute_force_over(by_pid, limits))
    for f in found:
        # each finding's slices are themselves overloaded by processes of the finding
        region = frozenset(key_to_uid[k] for k in f.slices)
        assert region in _brute_force_over({pid: by_pid[pid] for pid in f.pids}, limits)
        assert f.allowed_bytes == sum(limits[u] for u in region)
        assert set(f.stop) <= set(f.pids)
        if any(c.on_violation == OnViolation.REPORT for c in claims if c.uid in region):
            assert f.stop == ()
    stopped = {pid for f in found for pid in f.stop}
    if all(c.on_violation == OnViolation.STOP for c in claims):
        # what is left after the stops fits
        assert _brute_force_over({p: v for p, v in by_pid.items() if p not in stopped}, limits) == []


def test_a_pod_asking_for_a_product_in_its_limits_is_attributed_to_the_schedulers_claim() -> None:
    # `resources.limits: {gpuslice.io/v100-8g: 1}`: no spec.resourceClaims; kube-scheduler made the
    # claim and named it in status.extendedResourceClaimStatus.
    uids = {("team-a", "p-extended-resources-x1"): "c-ext"}
    pod = _pod(UID_A, "p", [])
    pod["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": "p-extended-resources-x1",
        "requestMappings": [
            {
                "containerName": "main",
                "resourceName": "gpuslice.io/v100-8g",
                "requestName": "container-0-request-0",
            }
        ],
    }
    assert at.pod_claims(pod, uids) == PodClaims("team-a", "p", frozenset({"c-ext"}))


def test_every_card_of_a_multi_gpu_product_is_cross_checked() -> None:
    from gpuslice.agent.checkpoint import ClaimRecord, PreparedDevice
    from gpuslice.agent.owners import ClaimOwner
    from gpuslice.agent.violations import slice_claims

    def card(i: int) -> PreparedDevice:
        return PreparedDevice(
            request="gpu", pool="n0", device=f"gpu-{i}-x2", gpu_uuid=f"GPU-{i}", memory_bytes=32 * GIB,
            compute_share=100, cdi_device_ids=[],
        )  # fmt: skip

    pair = ClaimRecord(
        uid="c1", namespace="team-a", name="pair", state="Prepared", devices=[card(0), card(1)]
    )
    owner = ClaimOwner(key="team-a/pair", uid="s-uid", labels=("team-a", "pair", "v100-x2", "n0", "GPU-0"))
    claims = slice_claims([pair], {"c1": owner}, lambda _package: OnViolation.STOP)
    assert sorted((c.gpu_uuid, c.limit_bytes) for c in claims) == [("GPU-0", 32 * GIB), ("GPU-1", 32 * GIB)]
    pods = {UID_A: PodClaims("team-a", "pair", frozenset({"c1"}))}
    # The product's own process on its second card is the product's, within that card's memory ...
    assert judge([GpuProcess("GPU-1", 10, 20 * GIB)], {10: Owner(UID_A)}, pods, claims) == []
    # ... and a host process there is flagged on the product, as on its first card.
    (f,) = judge([GpuProcess("GPU-1", 11, 1 * GIB)], {11: Owner(None)}, pods, claims)
    assert (f.kind, f.gpu_uuid, f.slices) == (KIND_UNKNOWN, "GPU-1", ("team-a/pair",))
