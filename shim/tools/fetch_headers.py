"""Fetch cuda.h and nvml.h from NVIDIA's PyPI wheels into an include directory (no CUDA toolkit).

Used by shim/Makefile. The wheels are cached in --wheels; only the headers the shim needs are
extracted. Runs `pip download`, so a pip configured for PyPI (or a local wheel cache) must work.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = {
    "nvidia-cuda-runtime-cu12": ("nvidia/cuda_runtime/include/", ("cuda.h", "cudaTypedefs.h")),
    "nvidia-nvml-dev-cu12": ("nvidia/nvml_dev/include/", ("nvml.h",)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", required=True)
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for dist, (prefix, headers) in WHEELS.items():
        pattern = dist.replace("-", "_") + f"-{args.version}-*.whl"
        found = sorted(args.wheels.glob(pattern))
        if not found:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                str(args.wheels),
                f"{dist}=={args.version}",
            ]
            result = subprocess.run(cmd, check=False)
            if result.returncode != 0:
                print(
                    f"fetch_headers: `{' '.join(cmd)}` failed; the shim needs {dist}'s headers. "
                    "Check that PyPI is reachable or put the wheel into " + str(args.wheels),
                    file=sys.stderr,
                )
                return 1
            found = sorted(args.wheels.glob(pattern))
        if not found:
            print(f"fetch_headers: no {pattern} in {args.wheels} after download", file=sys.stderr)
            return 1
        with zipfile.ZipFile(found[-1]) as wheel:
            for header in headers:
                (args.out / header).write_bytes(wheel.read(prefix + header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
