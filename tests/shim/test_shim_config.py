"""The limits file: what the agent writes is exactly what the shim accepts."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.shim.config import SliceConfig, SliceConfigError
from shim.shim_helpers import GIB, probe, run, values

UUID = "GPU-0b9f3a2e-1c4d-4e5f-8a6b-7c8d9e0f1a2b"


def test_render_is_the_documented_format():
    cfg = SliceConfig(
        memory_bytes=8 * GIB, compute_share=25, gpu_uuid=UUID, usage_dir="/var/run/gpuslice/slice"
    )
    assert cfg.render() == (
        "version=1\nmemory_bytes=8589934592\ncompute_share=25\n"
        f"gpu_uuid={UUID}\nusage_dir=/var/run/gpuslice/slice\ncontext_overhead_bytes=0\n"
    )
    unlimited = cfg.model_copy(update={"memory_bytes": None})
    assert "memory_bytes=unlimited\n" in unlimited.render()


@given(
    memory=st.one_of(st.none(), st.integers(min_value=1, max_value=2**64 - 2)),
    share=st.integers(min_value=1, max_value=100),
    overhead=st.integers(min_value=0, max_value=2**40),
    usage=st.from_regex(r"/[a-z0-9_/.-]{0,40}", fullmatch=True),
)
def test_parse_inverts_render(memory, share, overhead, usage):
    cfg = SliceConfig(memory_bytes=memory, compute_share=share, gpu_uuid=UUID, usage_dir=usage,
                      context_overhead_bytes=overhead)  # fmt: skip
    assert SliceConfig.parse(cfg.render()) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version=1\n", "required key(s) missing: memory_bytes"),
        ("version=1\nversion=1\n", "given twice"),
        ("garbage\n", "not key=value"),
        (
            "version=1\nmemory_bytes=8Gi\ncompute_share=1\ngpu_uuid=" + UUID + "\nusage_dir=/x\n",
            "whole number",
        ),
        ("version=1\nmemory_bytes=1\ncompute_share=1\ngpu_uuid=GPU-1\nusage_dir=/x\n", "gpu_uuid"),
        (
            "version=1\nmemory_bytes=1\ncompute_share=101\ngpu_uuid=" + UUID + "\nusage_dir=/x\n",
            "compute_share",
        ),
        ("version=1\nmemory_bytes=1\ncompute_share=1\ngpu_uuid=" + UUID + "\nusage_dir=rel\n", "absolute"),
        ("version=1\nmemory=1\n", "unknown key 'memory'"),
    ],
)
def test_parse_rejects_what_the_shim_rejects(text, message):
    with pytest.raises(SliceConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SliceConfig.parse(text)


def test_write_is_read_only_and_the_shim_accepts_it(make_slice, built):
    s = make_slice(memory_bytes=2 * GIB, compute_share=50)
    assert stat.S_IMODE(s.config_path.stat().st_mode) == 0o444
    assert SliceConfig.parse(s.config_path.read_text()) == s.config
    info = values(run(s, [probe(built), "info"]).stdout)
    assert info["meminfo_total"] == str(2 * GIB)
