"""Reading the usage region and patching the config path, as the agent and `shim run` do."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from gpuslice.shim.region import REGION_SIZE, RegionFormatError, read_usage, trim_region
from gpuslice_dev.gpusim.patch import PatchError, config_path_of, write_private_shim
from shim.shim_helpers import GIB, Holder


def test_an_unused_slice_reads_as_empty(tmp_path):
    snap = read_usage(tmp_path)
    assert snap.initialized is False
    assert snap.processes == [] and snap.memory_used_bytes == 0


def test_snapshot_reports_processes_limits_and_refusals(make_slice, built):
    s = make_slice(memory_bytes=4 * GIB, compute_share=40, context_overhead_bytes=GIB // 4)
    a = Holder(s, built, GIB)
    refused = Holder(s, built, 4 * GIB)  # does not fit next to a's context and GiB
    try:
        snap = read_usage(s.usage_dir)
    finally:
        a.close()
        refused.close()
    assert refused.rc == 2
    assert snap.initialized and snap.version == 1
    assert snap.memory_limit_bytes == 4 * GIB and snap.compute_share == 40
    assert snap.refused_allocations_total == 1
    by_pid = {p.pid: p for p in snap.processes}
    assert by_pid[a.proc.pid].memory_used_bytes == GIB + GIB // 4
    assert by_pid[a.proc.pid].context_overhead_bytes == GIB // 4
    assert by_pid[a.proc.pid].memory_peak_bytes == GIB + GIB // 4
    assert by_pid[refused.proc.pid].refused_allocations == 1
    assert snap.memory_used_bytes == GIB + 2 * (GIB // 4)
    assert all(p.start_time > 0 for p in snap.processes)


def test_a_foreign_file_is_not_read_as_a_region(tmp_path):
    (tmp_path / "usage.bin").write_bytes(b"NOTASLICE" + bytes(200))
    with pytest.raises(RegionFormatError, match="not a version-1 gpuslice usage region"):
        read_usage(tmp_path)


def test_private_copy_reads_its_own_config_path(built, tmp_path):
    copy = write_private_shim(built.shim, tmp_path / "my.conf", tmp_path / "lib")
    assert config_path_of(copy) == str(tmp_path / "my.conf")
    assert copy.stat().st_size == built.shim.stat().st_size
    with pytest.raises(PatchError, match="longer than"):
        write_private_shim(built.shim, "/" + "x" * 5000, tmp_path / "lib2")
    not_a_shim = tmp_path / "libother.so"
    not_a_shim.write_bytes(b"\x7fELF" + bytes(100))
    with pytest.raises(PatchError, match=r"not a libgpuslice\.so build"):
        write_private_shim(not_a_shim, "/x", tmp_path / "lib3")


# --- the region is the tenant's file: whatever stands in its place is read safely --------------------


def _read_in_thread(usage_dir, seconds: float = 5.0):
    """read_usage in a thread: (finished in time, its result or exception)."""
    out: list[object] = []

    def target() -> None:
        try:
            out.append(read_usage(usage_dir))
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None)


def test_a_fifo_in_place_of_the_region_is_refused_without_blocking(tmp_path):
    # In a slice container: rm usage.bin && mkfifo usage.bin. The root agent's open used to block.
    fifo = tmp_path / "usage.bin"
    os.mkfifo(fifo)
    try:
        done, result = _read_in_thread(tmp_path)
        assert done, "read_usage blocked on a FIFO"
        assert isinstance(result, RegionFormatError) and "a FIFO" in str(result), result
    finally:
        # unblock a reader that did open it (before the fix), so the test process can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if not done else None
        if fd is not None:
            os.close(fd)
    assert trim_region(tmp_path) == 0


def test_a_link_to_another_slices_region_is_not_followed(make_slice, built, tmp_path):
    # The agent followed /proc/<victim pid>/root/... and published the victim's usage as the attacker's.
    victim = make_slice(memory_bytes=4 * GIB)
    holder = Holder(victim, built, GIB)
    try:
        assert read_usage(victim.usage_dir).memory_used_bytes > 0
        attacker = tmp_path / "attacker"
        attacker.mkdir()
        (attacker / "usage.bin").symlink_to(Path(victim.usage_dir) / "usage.bin")
        with pytest.raises(RegionFormatError, match="a symbolic link"):
            read_usage(attacker)
        # a link from outside the slice's directory to it is no region of its own either
        linked = tmp_path / "linked"
        linked.mkdir()
        os.link(Path(victim.usage_dir) / "usage.bin", linked / "usage.bin")
        with pytest.raises(RegionFormatError, match="2 links"):
            read_usage(linked)
        os.unlink(linked / "usage.bin")
        assert trim_region(attacker) == 0
    finally:
        holder.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_device_node_in_place_of_the_region_is_never_opened(tmp_path):
    # A tenant with CAP_MKNOD (in the runtime's default set) can make any device node; opening some
    # (a watchdog) has effects. /dev/null's numbers stand for them: refused from its stat alone.
    os.mknod(tmp_path / "usage.bin", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    with pytest.raises(RegionFormatError, match="not a regular file"):
        read_usage(tmp_path)


def test_a_region_grown_past_its_size_is_read_to_its_size_and_cut_back(make_slice, built):
    # 300 MiB written into the host's run dir from a pod limited to 20 MiB of ephemeral storage.
    s = make_slice(memory_bytes=4 * GIB)
    holder = Holder(s, built, GIB)
    try:
        region = Path(s.usage_dir) / "usage.bin"
        before = read_usage(s.usage_dir)
        with open(region, "r+b") as f:
            f.seek(300 << 20)
            f.write(b"x")
        assert region.stat().st_size > 300 << 20
        assert read_usage(s.usage_dir) == before
        assert trim_region(s.usage_dir) == (300 << 20) + 1 - REGION_SIZE
        assert region.stat().st_size == REGION_SIZE
        assert read_usage(s.usage_dir) == before  # the slice's processes go on as they were
    finally:
        holder.close()
    assert holder.rc == 0
