"""The shim's config parser under a coverage-guided fuzzer for a fixed time (`make -C shim fuzz`:
libFuzzer with ASan and UBSan), then every input it found interesting fed to both parsers: the C one
the shim enforces with and the agent's Python one must give the same verdict on each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.build import ShimPaths
from shim.shim_helpers import probe, python_config_view

SHIM = Path(__file__).resolve().parents[2] / "shim"
#: seconds of fuzzing in the suite (over a million inputs on an idle core); longer runs: e.g. 600
SECONDS = int(os.environ.get("GPUSLICE_FUZZ_SECONDS", "15"))
CLANGS = ("clang", "clang-19", "clang-16", "clang-15", "clang-14")


def _python_view(raw: bytes) -> str:
    return python_config_view(raw.decode("utf-8", "surrogateescape"))


def test_config_parser_survives_coverage_guided_fuzzing_and_agrees_with_python(
    built: ShimPaths, tmp_path: Path
) -> None:
    if not any(shutil.which(c) for c in CLANGS):
        pytest.skip("no clang with libFuzzer here (Debian: apt-get install clang libclang-rt-14-dev)")
    proc = subprocess.run(
        ["make", "-s", "-C", str(SHIM), "fuzz", f"BUILD={tmp_path}", f"FUZZ_SECONDS={SECONDS}"],
        capture_output=True,
        text=True,
        timeout=SECONDS + 300,
        check=False,
    )
    log = proc.stdout + proc.stderr
    crashes = list((tmp_path / "fuzz").glob("crash-*")) + list((tmp_path / "fuzz").glob("timeout-*"))
    assert proc.returncode == 0 and not crashes, f"the fuzzer found {crashes}:\n{log[-4000:]}"
    runs = int(re.search(r"Done (\d+) runs", log).group(1))  # type: ignore[union-attr]
    corpus = sorted((tmp_path / "fuzz" / "corpus").iterdir())
    print(f"\n[fuzz] gs_config_parse: {runs} inputs in {SECONDS}s, {len(corpus)} kept for coverage, no crash")
    assert runs > 1000 and corpus

    # the inputs that reached new code, through both parsers
    out = subprocess.run(
        [str(probe(built, "config_check")), *map(str, corpus)], capture_output=True, check=True, timeout=120
    ).stdout
    lines = out.decode("utf-8", "surrogateescape").split("\n")[: len(corpus)]
    differ = []
    accepted = 0
    for path, line in zip(corpus, lines, strict=True):
        c_view = "error" if line.startswith("error") else line
        accepted += c_view != "error"
        if c_view != _python_view(path.read_bytes()):
            py_view = _python_view(path.read_bytes())
            differ.append(f"{path.read_bytes()[:300]!r}: C {c_view[:200]!r}, Python {py_view[:200]!r}")
    print(f"[fuzz] {len(corpus)} inputs through both parsers, {accepted} accepted, {len(differ)} differ")
    assert not differ, "\n".join(differ[:10])
