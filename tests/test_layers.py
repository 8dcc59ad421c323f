"""The import graph points one way: api/domain -> (operator, agent, shim); the product imports no dev tooling.

Reads every module's imports with `ast` (module-level and function-local ones alike), so a lazy
import inside a function cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "operator" / "gpuslice"
#: the dev tooling's own distribution (devtools/): nothing in the product may import it
DEV_PACKAGE = "gpuslice_dev"

#: layer -> the gpuslice subpackages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "api": ("domain", "operator", "agent", "shim"),
    "domain": ("operator", "agent", "shim"),
    "operator": ("agent",),
    "agent": ("operator",),
    "shim": ("operator", "agent"),
}
#: top-level product modules (cli, constants, logs, metrics, explain) may import any layer, no dev code
TOP_LEVEL_FORBIDDEN: tuple[str, ...] = ()


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("gpuslice", DEV_PACKAGE)}


def violations(layer_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    files = sorted(layer_dir.rglob("*.py")) if layer_dir.is_dir() else [layer_dir]
    for f in files:
        for name in sorted(imports_of(f)):
            parts = name.split(".")
            if parts[0] == DEV_PACKAGE or (len(parts) > 1 and parts[1] in forbidden):
                where = f.relative_to(PACKAGE.parent) if f.is_relative_to(PACKAGE.parent) else f
                bad.append(f"{where} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_has_no_upward_or_dev_import(layer: str) -> None:
    assert violations(PACKAGE / layer, FORBIDDEN[layer]) == []


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_top_level_product_module_imports_no_dev_code(module: str) -> None:
    assert violations(PACKAGE / module, TOP_LEVEL_FORBIDDEN) == []


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    # the test above must be able to fail: a function-local import of dev code is caught
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from gpuslice_dev.gpusim import build\n")
    assert imports_of(f) == {"gpuslice_dev.gpusim", "gpuslice_dev.gpusim.build"}
    assert len(violations(f, ())) == 2


#: the one module of the product that talks to NVML (the agent's NVML boundary)
NVML_BOUNDARY = PACKAGE / "agent" / "nvml.py"


def test_only_the_nvml_boundary_imports_pynvml() -> None:
    def imports_pynvml(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pynvml" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml":
                return True
        return False

    assert [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if imports_pynvml(p)] == [
        str(NVML_BOUNDARY.relative_to(PACKAGE))
    ]
