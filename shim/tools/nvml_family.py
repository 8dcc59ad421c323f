"""Record the names of NVML's process, memory and utilization API family as a driver branch's
libnvidia-ml.so.1 exports them, from that branch's public nvml.h (NVIDIA's nvml-dev PyPI wheel).

    python shim/tools/nvml_family.py > tests/shim/nvml_family.json

Every function nvml.h declares is exported by the library under its name (the unversioned names of
versioned calls too: nvml.h declares them for old binaries). The family is every name with
Process, Memory, Utilization or Accounting in it. tests/shim/test_nvml_api_family.py compares the
double's exports against the recorded lists.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: driver branch -> (the nvml-dev wheel of the CUDA release it ships with, its header's path)
BRANCHES = {
    "535": ("nvidia-nvml-dev-cu12", "12.2.140", "nvidia/nvml_dev/include/nvml.h"),  # CUDA 12.2
    "580": ("nvidia-nvml-dev", "13.0.87", "nvidia/cu13/include/nvml.h"),  # CUDA 13.0
}
FAMILY = re.compile(r"Process|Memory|Utilization|Accounting")


def declared(header: str) -> set[str]:
    code = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    return set(re.findall(r"DECLDIR\s+(nvml\w+)\s*\(", code))


def main() -> int:
    out: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for branch, (dist, version, path) in BRANCHES.items():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--dest", tmp, f"{dist}=={version}"],
                check=True,
            )  # fmt: skip
            wheel = next(Path(tmp).glob(dist.replace("-", "_") + f"-{version}-*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                header = zf.read(next(n for n in zf.namelist() if n.endswith(path))).decode()
            names = declared(header)
            out[branch] = {
                "source": f"{dist}=={version} {path}",
                "declared": len(names),
                "family": sorted(n for n in names if FAMILY.search(n)),
            }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
