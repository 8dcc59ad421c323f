"""Where the checkout is: the one place the dev tooling finds the repository's files from."""

from __future__ import annotations

from pathlib import Path

#: The repository root (this file is devtools/gpuslice_dev/paths.py in the checkout).
REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = REPO_ROOT / "crds"
MANIFESTS = REPO_ROOT / "manifests"
SHIM_SOURCE_DIR = REPO_ROOT / "shim"
