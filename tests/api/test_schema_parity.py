"""The pydantic models and the CRDs are two schemas of one API: held equal here.

Compares, for spec and status of each kind, every property name (recursively, through nested
objects and arrays of objects), its JSON type, its enum and which properties are required. A field
added to one side only fails this test with the path that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from gpuslice.api.package import GpuPackageSpec, GpuPackageStatus
from gpuslice.api.slice import GpuSliceSpec, GpuSliceStatus
from gpuslice.api.usage import GpuUsage

CRDS = Path(__file__).resolve().parents[2] / "crds"


def crd_schema(file: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Follows $ref, and Optional's anyOf [X, null], down to the schema that says what X is."""
    while True:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        elif "anyOf" in node:
            (node,) = [n for n in node["anyOf"] if n.get("type") != "null"]
        elif "allOf" in node and len(node["allOf"]) == 1:
            node = node["allOf"][0]
        else:
            return node


def _type(node: dict[str, Any]) -> str:
    if "enum" in node and "type" not in node:
        return "string"
    t = node.get("type", "object")
    return "object" if t == "object" else str(t)


def differences(model: dict[str, Any], crd: dict[str, Any], defs: dict[str, Any], path: str) -> list[str]:
    model = _resolve(model, defs)
    diffs: list[str] = []
    mtype, ctype = _type(model), _type(crd)
    if crd.get("x-kubernetes-int-or-string"):
        ctype = mtype if mtype in ("string", "integer") else "int-or-string"
    if mtype != ctype:
        return [f"{path}: model type {mtype}, CRD type {ctype}"]
    if sorted(model.get("enum", [])) != sorted(crd.get("enum", [])):
        diffs.append(f"{path}: model enum {model.get('enum')}, CRD enum {crd.get('enum')}")
    if mtype == "array":
        diffs += differences(model.get("items", {}), crd.get("items", {}), defs, f"{path}[]")
    if mtype == "object":
        mprops, cprops = model.get("properties", {}), crd.get("properties", {})
        if not mprops and not cprops:
            return diffs  # a map (additionalProperties) on both sides
        for name in sorted(set(mprops) | set(cprops)):
            if name not in cprops:
                diffs.append(f"{path}.{name}: in the model, not in the CRD")
            elif name not in mprops:
                diffs.append(f"{path}.{name}: in the CRD, not in the model")
            else:
                diffs += differences(mprops[name], cprops[name], defs, f"{path}.{name}")
        mreq, creq = set(model.get("required", [])), set(crd.get("required", []))
        if mreq != creq:
            diffs.append(f"{path}: required in the model {sorted(mreq)}, in the CRD {sorted(creq)}")
    return diffs


CASES = [
    ("gpuslice.io_gpupackages.yaml", "spec", GpuPackageSpec),
    ("gpuslice.io_gpupackages.yaml", "status", GpuPackageStatus),
    ("gpuslice.io_gpuslices.yaml", "spec", GpuSliceSpec),
    ("gpuslice.io_gpuslices.yaml", "status", GpuSliceStatus),
]


@pytest.mark.parametrize(("file", "part", "model"), CASES, ids=[f"{f}:{p}" for f, p, _ in CASES])
def test_model_and_crd_describe_the_same_fields(file: str, part: str, model: type[BaseModel]) -> None:
    schema = model.model_json_schema(by_alias=True)
    assert differences(schema, crd_schema(file)["properties"][part], schema.get("$defs", {}), part) == []


def test_the_ledger_model_and_crd_describe_the_same_fields() -> None:
    """GpuUsage keeps its record at the top level (like an Event), not under spec or status."""
    schema = GpuUsage.model_json_schema(by_alias=True)
    root = crd_schema("gpuslice.io_gpuusages.yaml")
    fields = {k: v for k, v in root["properties"].items() if k not in ("apiVersion", "kind", "metadata")}
    crd = {**root, "properties": fields}
    assert differences(schema, crd, schema.get("$defs", {}), "GpuUsage") == []


def test_a_field_on_one_side_only_is_found() -> None:
    class Spec(BaseModel):
        a: int
        b: str = ""

    props = {"a": {"type": "integer"}, "c": {"type": "string"}}
    crd: dict[str, Any] = {"type": "object", "required": ["a"], "properties": props}
    found = differences(Spec.model_json_schema(), crd, {}, "spec")
    assert found == ["spec.b: in the model, not in the CRD", "spec.c: in the CRD, not in the model"]
    crd["properties"] = {"a": {"type": "string"}, "b": {"type": "string"}}
    found = differences(Spec.model_json_schema(), crd, {}, "spec")
    assert found == ["spec.a: model type integer, CRD type string"]
