"""The checked-in kubelet gRPC bindings are what the documented command generates."""

from __future__ import annotations

from pathlib import Path

from gpuslice.agent.proto import dra_v1_pb2_grpc, generate, pluginregistration_v1_pb2_grpc

PROTO_DIR = Path(generate.__file__).resolve().parent


def test_generated_bindings_are_reproducible(tmp_path: Path) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    fresh = tmp_path / "gpuslice" / "agent" / "proto"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert "dra_v1_pb2_grpc.py" in names and "pluginregistration_v1.proto" in names
    for name in names:
        assert (fresh / name).read_bytes() == (PROTO_DIR / name).read_bytes(), f"{name} differs: regenerate"


def test_gogo_options_are_stripped_and_nothing_else() -> None:
    text = (
        'syntax = "proto3";\nimport "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
        "option (gogoproto.marshaler_all) = true;\n"
        'message A {\n  string x = 1 [(gogoproto.customname) = "X"];\n}\n'
    )
    assert generate.strip_gogo(text) == 'syntax = "proto3";\nmessage A {\n  string x = 1;\n}\n'


def test_service_paths_are_the_ones_kubelet_calls() -> None:
    # kubelet dials these exact method names; the proto package lines must survive the copy
    assert (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
        in Path(dra_v1_pb2_grpc.__file__).read_text()
    )
    assert (
        "/pluginregistration.Registration/GetInfo"
        in Path(pluginregistration_v1_pb2_grpc.__file__).read_text()
    )
