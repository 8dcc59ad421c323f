"""The limits file: what the agent writes is exactly what the shim accepts."""

from __future__ import annotations

import stat
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.shim.config import SliceConfig, SliceConfigError
from shim.shim_helpers import GIB, probe, python_config_view, run, values

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


# ---- the C parser and SliceConfig.parse agree exactly (accept/reject, and the values) ----------------

_VALUES = {
    "version": ["1", "01", " 1", "1 ", "+1", "2", ""],
    "memory_bytes": [
        "8589934592",
        "unlimited",
        "Unlimited",
        " 5",
        "+5",
        "-5",
        "0",
        "007",
        "5\t",
        "1e3",
        "0x10",
        "\u0665",
        "18446744073709551614",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999999",
        "",
    ],
    "compute_share": ["25", "100", "101", "0", " 25", "+25", "025", "2 5", "\u0662\u0665"],
    "gpu_uuid": [UUID, UUID.upper(), UUID + " ", " " + UUID, UUID[:-1], UUID.replace("-", "_")],
    "usage_dir": ["/var/run/x", "rel", "/a b", "/x\u00e9", "/" + "d" * 4070, "/" + "\u00e9" * 2038],
    "context_overhead_bytes": ["0", "1024", "-1", " 1", "+1", "18446744073709551615", "18446744073709551616"],
}
_DECOR = ["", " ", "\t", "\r", " \r", "\x0b", "\x0c", "\u00a0", "\u2028"]


@st.composite
def _configs(draw):
    lines = []
    for key, choices in _VALUES.items():
        if key != "version" and draw(st.integers(0, 29)) == 0:
            continue  # a missing key
        # mostly valid lines, so that one odd value decides the outcome
        value = choices[0] if draw(st.integers(0, 3)) else draw(st.sampled_from(choices))
        lead = "" if draw(st.integers(0, 3)) else draw(st.sampled_from(_DECOR))
        trail = "" if draw(st.integers(0, 3)) else draw(st.sampled_from(_DECOR))
        lines.append(f"{lead}{key}={value}{trail}")
        if draw(st.integers(0, 19)) == 0:
            lines.append(f"{key}={value}")  # given twice
    if draw(st.booleans()):
        lines.insert(
            draw(st.integers(0, len(lines))), draw(st.sampled_from(["# comment", "  # c", "", "\t"]))
        )
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n", "\n\n"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_configs())
def test_the_c_parser_and_python_agree_exactly(built, tmp_path, text):
    path = tmp_path / "slice.conf"
    path.write_bytes(text.encode())
    out = subprocess.run(
        [str(probe(built, "config_check")), str(path)], capture_output=True, text=True, check=True
    )
    c_view = out.stdout.removesuffix("\n")
    if c_view.startswith("error"):
        c_view = "error"
    assert c_view == python_config_view(text), f"config {text!r}"
