"""Reading the usage region and patching the config path, as the agent and `shim run` do."""

from __future__ import annotations

import pytest

from gpuslice.shim.region import RegionFormatError, read_usage
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
