"""The import graph points one way: api/domain -> (operator, agent, shim) -> nothing of dev.

Reads every module's imports with `ast` (module-level and function-local ones alike), so a lazy
import inside a function cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "operator" / "gpuslice"

#: layer -> the gpuslice subpackages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "api": ("domain", "operator", "agent", "shim", "dev"),
    "domain": ("operator", "agent", "shim", "dev"),
    "operator": ("agent", "dev"),
    "agent": ("operator", "dev"),
    "shim": ("operator", "agent", "dev"),
}
#: top-level product modules (constants, logs, metrics, explain) import no dev code either
TOP_LEVEL_FORBIDDEN = ("dev",)


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "gpuslice" or n.startswith("gpuslice.")}


def violations(layer_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    files = sorted(layer_dir.rglob("*.py")) if layer_dir.is_dir() else [layer_dir]
    for f in files:
        for name in sorted(imports_of(f)):
            parts = name.split(".")
            if len(parts) > 1 and parts[1] in forbidden:
                bad.append(f"{f.relative_to(PACKAGE.parent)} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_has_no_upward_or_dev_import(layer: str) -> None:
    assert violations(PACKAGE / layer, FORBIDDEN[layer]) == []


@pytest.mark.parametrize(
    "module", sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"cli.py", "__main__.py"})
)
def test_top_level_product_module_imports_no_dev_code(module: str) -> None:
    assert violations(PACKAGE / module, TOP_LEVEL_FORBIDDEN) == []


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    # the test above must be able to fail: a function-local import of dev code is caught
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from gpuslice.dev.gpusim import build\n")
    assert imports_of(f) == {"gpuslice.dev.gpusim", "gpuslice.dev.gpusim.build"}
