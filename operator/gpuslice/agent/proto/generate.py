"""Regenerate the kubelet gRPC bindings checked in next to this file.

    .venv/bin/python -m gpuslice.agent.proto.generate [--go-mod-cache DIR] [--kubelet-version v0.37.2]

Copies the DRA v1 and plugin-registration v1 protos from the `k8s.io/kubelet` Go module, strips
gogo-protobuf options (imports of gogo.proto and `(gogoproto.*)` field/file options, which only
affect Go code generation), then runs grpc_tools.protoc with `operator/` as the include root so the
generated `_pb2_grpc.py` modules import their `_pb2` siblings as `gpuslice.agent.proto.*`.
The proto `package` lines are kept verbatim: they are part of the gRPC method paths kubelet calls.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
INCLUDE_ROOT = HERE.parents[2]  # .../operator

#: our file name -> path of the proto inside the k8s.io/kubelet module
SOURCES = {
    "dra_v1.proto": "pkg/apis/dra/v1/api.proto",
    "pluginregistration_v1.proto": "pkg/apis/pluginregistration/v1/api.proto",
}

_GOGO_IMPORT = re.compile(r'^\s*import\s+"(github\.com/gogo/protobuf/)?gogoproto/gogo\.proto";\s*\n', re.M)
_GOGO_FILE_OPTION = re.compile(r"^\s*option\s+\(gogoproto\.[a-z_]+\)\s*=\s*[a-z]+;\s*\n", re.M)
_GOGO_FIELD_OPTIONS = re.compile(r"\s*\[\s*\(gogoproto\.[^\]]*\]")


def strip_gogo(text: str) -> str:
    """Remove gogo-protobuf imports and options; everything else is kept byte for byte."""
    text = _GOGO_IMPORT.sub("", text)
    text = _GOGO_FILE_OPTION.sub("", text)
    return _GOGO_FIELD_OPTIONS.sub("", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--go-mod-cache", type=Path, default=Path("/root/go/pkg/mod"))
    parser.add_argument("--kubelet-version", default="v0.37.2")
    parser.add_argument(
        "--out",
        type=Path,
        default=INCLUDE_ROOT,
        help="root to write gpuslice/agent/proto/ under (default: the source tree)",
    )
    args = parser.parse_args(argv)
    rel = HERE.relative_to(INCLUDE_ROOT)
    target = args.out / rel
    target.mkdir(parents=True, exist_ok=True)

    module = args.go_mod_cache / "k8s.io" / f"kubelet@{args.kubelet_version}"
    if not module.is_dir():
        print(
            f"error: {module} not found; run `go mod download k8s.io/kubelet@{args.kubelet_version}` "
            "or pass --go-mod-cache",
            file=sys.stderr,
        )
        return 1
    for ours, theirs in SOURCES.items():
        text = (module / theirs).read_text()
        origin = f"k8s.io/kubelet@{args.kubelet_version}/{theirs}"
        header = f"// Copied from {origin} by generate.py; gogo options stripped.\n"
        (target / ours).write_text(header + strip_gogo(text))

    protos = [str(rel / name) for name in SOURCES]
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{args.out}",
            f"--python_out={args.out}",
            f"--pyi_out={args.out}",
            f"--grpc_python_out={args.out}",
            *protos,
        ]
    )
    if rc != 0:
        print(f"error: protoc failed with exit code {rc}", file=sys.stderr)
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
