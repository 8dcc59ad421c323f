"""Every cuGetProcAddress query NVIDIA's runtimes make, replayed through the shim.

The lists under shim/tests/data/ were recorded from libcudart 12.9 and 13.x as they start on the driver
test double (name, CUDA version, flags). Each query is answered once by the bare double handing out its
exported symbols (the oracle: which variant a driver of that version serves), and once through the shim
on the double handing out internal entry points, as real drivers do (GPUSLICE_FAKE_PROC_TRAMPOLINES=1),
and once through the shim with exported symbols. Through the shim no query may be refused that the
driver answers, and every variant the shim wraps must come back as the shim's wrapper of that very
variant (same name, so the same ABI); variants it does not wrap pass through.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.build import ShimPaths
from shim.shim_helpers import GIB, env_of, probe

DATA = Path(__file__).resolve().parents[2] / "shim" / "tests" / "data"
LISTS = sorted(DATA.glob("cudart-*-procs.txt"))


def _exports(shim: Path) -> set[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(shim)], capture_output=True, text=True, check=True
    )
    return {line.split()[-1] for line in out.stdout.splitlines() if line.split()[-1].startswith("cu")}


def _replay(prepared, built: ShimPaths, listing: Path, *, shim: bool, internal: bool) -> list[list[str]]:
    env = env_of(prepared, shim)
    env["GPUSLICE_FAKE_PROC_TRAMPOLINES"] = "1" if internal else "0"
    default_version = "13000" if "13" in listing.name.split("-")[1] else "12090"
    proc = subprocess.run(
        [str(probe(built, "proc_replay")), str(listing), default_version],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [line.split() for line in proc.stdout.splitlines()]


def test_the_recorded_lists_are_there():
    # The replay below is only as good as its lists: one per runtime major the product supports.
    assert {p.name.split("-")[1].split(".")[0] for p in LISTS} >= {"12", "13"}, (
        f"recorded cuGetProcAddress lists missing under {DATA}: {[p.name for p in LISTS]}"
    )


CASES = [(p, d) for p in LISTS for d in (["580"] if "-13." in p.name else ["535", "580"])]


@pytest.mark.parametrize("internal", [True, False], ids=["internal-pointers", "exported-symbols"])
@pytest.mark.parametrize(("listing", "driver"), CASES, ids=[f"{p.stem}-{d}" for p, d in CASES])
def test_runtime_lookups_through_the_shim(
    listing: Path, driver: str, internal: bool, built: ShimPaths, make_slice
):
    # On the driver branch the list was recorded on (a CUDA 13 runtime needs 580), and on 580 for
    # CUDA 12 too: a newer driver serves newer variants of the same names.
    prepared = make_slice(memory_bytes=8 * GIB, driver=driver)
    oracle = _replay(prepared, built, listing, shim=False, internal=False)
    shimmed = _replay(prepared, built, listing, shim=True, internal=internal)
    wrapped = _exports(prepared.shim)
    assert len(oracle) == len(shimmed) > 0
    problems = []
    answered = 0
    for want, got in zip(oracle, shimmed, strict=True):
        query = " ".join(want[:3])
        assert want[:3] == got[:3]
        rc, variant = int(want[3]), want[5]
        got_rc, got_symbol, got_object = int(got[3]), got[5], got[6]
        if rc != 0:
            if got_rc != rc:
                problems.append(f"{query}: the driver answers {rc}, through the shim {got_rc}")
            continue
        answered += 1
        if got_rc != 0:
            problems.append(f"{query}: refused through the shim ({got_rc}); the driver serves {variant}")
        elif variant in wrapped and (got_object != "libgpuslice.so" or got_symbol != variant):
            problems.append(
                f"{query}: the driver serves {variant}, wrapped by the shim; got {got_symbol} in {got_object}"
            )
        elif got_object == "libgpuslice.so" and got_symbol != variant:
            problems.append(f"{query}: the driver serves {variant}; the shim handed out its {got_symbol}")
    # A family the shim wraps in some variant is wrapped in every variant a runtime is served: one left
    # out (a per-thread-stream twin, the older ABI of a renamed call) would be a way around the slice.
    served: dict[str, set[str]] = {}
    for want in oracle:
        if int(want[3]) == 0 and want[5] != "-":
            served.setdefault(want[0], set()).add(want[5])
    for base, variants in sorted(served.items()):
        if variants & wrapped and variants - wrapped:
            problems.append(
                f"{base}: the shim wraps {sorted(variants & wrapped)} but not {sorted(variants - wrapped)}"
            )
    assert not problems, (
        f"{len(problems)} of {len(oracle)} queries ({answered} answered by the driver):\n"
        + "\n".join(problems)
    )
