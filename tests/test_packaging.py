"""The product's wheel holds the product only: no dev tooling, no tests; the dev tooling is its own."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _wheel(source: Path, out: Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _wheel(REPO, tmp_path_factory.mktemp("wheel")).namelist()


def test_the_product_wheel_holds_no_dev_tooling(product_wheel: list[str]) -> None:
    packages = {name.split("/")[0] for name in product_wheel if not name.endswith(".dist-info/")}
    assert "gpuslice" in packages
    assert not [n for n in product_wheel if n.startswith(("gpuslice_dev/", "gpuslice/dev/", "tests/"))]
    assert {p for p in packages if not p.endswith(".dist-info")} == {"gpuslice"}


def test_the_product_wheel_has_the_product_and_its_data(product_wheel: list[str]) -> None:
    assert "gpuslice/cli.py" in product_wheel and "gpuslice/operator/run.py" in product_wheel
    assert "gpuslice/agent/proto/dra_v1.proto" in product_wheel


def test_the_dev_wheel_holds_the_dev_tooling_and_its_console_script(tmp_path: Path) -> None:
    names = _wheel(REPO / "devtools", tmp_path).namelist()
    assert "gpuslice_dev/devcluster/cluster.py" in names
    assert "gpuslice_dev/manifests/demo/workload.yaml" in names
    assert not [n for n in names if n.startswith("gpuslice/")]


def test_the_product_cli_offers_no_dev_commands() -> None:
    from gpuslice.cli import SUBCOMMANDS

    assert set(SUBCOMMANDS) == {"operator", "agent", "explain", "check", "drain", "uncordon", "usage", "top"}
