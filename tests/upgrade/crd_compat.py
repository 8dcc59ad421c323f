"""Compare two releases' CRDs, and make objects that fill every field a CRD schema declares.

Used by the upgrade tests: a GitOps sync or a chart upgrade replaces the CRDs under objects the
previous release stored, so a field the new schema no longer has (pruned on the next write), a
version it no longer serves or a validation it tightened makes a stored object unreadable or unwritable.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Schema = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
CRD_FILES = ("gpuslice.io_gpupackages.yaml", "gpuslice.io_gpuslices.yaml", "gpuslice.io_gpuusages.yaml")


def crds_at(commit: str) -> dict[str, Schema]:
    """The CRDs of a commit of this repository, by file name; fails saying the commit is missing."""
    out = {}
    for name in CRD_FILES:
        proc = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:crds/{name}"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"commit {commit} (a release) is not in this clone: fetch the full history "
                f"(git fetch --unshallow) to test upgrades from it ({proc.stderr.strip()})"
            )
        out[name] = yaml.safe_load(proc.stdout)
    return out


def crds_here() -> dict[str, Schema]:
    return {name: yaml.safe_load((REPO / "crds" / name).read_text()) for name in CRD_FILES}


def versions(crd: Schema) -> dict[str, Schema]:
    return {v["name"]: v for v in crd["spec"]["versions"]}


def _walk(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def breaking_changes(old: Schema, new: Schema) -> list[str]:
    """What in `new` could refuse or lose an object `old` accepted; [] when nothing."""
    problems = []
    new_versions = versions(new)
    for name, old_version in versions(old).items():
        if name not in new_versions or not new_versions[name].get("served", False):
            problems.append(f"version {name} is no longer served (objects stored in it cannot be read)")
            continue
        new_paths = dict(_walk(new_versions[name]["schema"]["openAPIV3Schema"]))
        old_paths = dict(_walk(old_version["schema"]["openAPIV3Schema"]))
        for path, was in old_paths.items():
            now = new_paths.get(path)
            if now is None:
                if not _preserves_unknown(new_paths, path):
                    problems.append(f"{name} {path}: removed (the API server prunes it on the next write)")
                continue
            problems += [f"{name} {path}: {p}" for p in _tightened(was, now)]
        for path, now in new_paths.items():
            was = old_paths.get(path)
            if was is None:
                continue
            for field in set(now.get("required", [])) - set(was.get("required", [])):
                if "default" not in now.get("properties", {}).get(field, {}):
                    problems.append(f"{name} {path}: newly required {field!r} without a default")
    return problems


def _preserves_unknown(paths: dict[str, Schema], path: str) -> bool:
    parent = path.rsplit(".", 1)[0]
    return bool(paths.get(parent, {}).get("x-kubernetes-preserve-unknown-fields"))


def _tightened(was: Schema, now: Schema) -> list[str]:
    out = []
    if was.get("type") != now.get("type"):
        out.append(f"type {was.get('type')} -> {now.get('type')}")
    if "enum" in now and set(was.get("enum", now["enum"])) - set(now["enum"]):
        out.append(f"enum values removed: {sorted(set(was.get('enum', [])) - set(now['enum']))}")
    if "enum" in now and "enum" not in was:
        out.append(f"now limited to {now['enum']}")
    for bound in ("maximum", "maxLength", "maxItems", "maxProperties"):
        if bound in now and now[bound] < was.get(bound, float("inf")):
            out.append(f"{bound} {was.get(bound)} -> {now[bound]}")
    for bound in ("minimum", "minLength", "minItems", "minProperties"):
        if bound in now and now[bound] > was.get(bound, float("-inf")):
            out.append(f"{bound} {was.get(bound)} -> {now[bound]}")
    if "pattern" in now and now["pattern"] != was.get("pattern"):
        out.append(f"pattern {was.get('pattern')!r} -> {now['pattern']!r}")
    old_rules = {r["rule"] for r in was.get("x-kubernetes-validations", [])}
    added = [r["rule"] for r in now.get("x-kubernetes-validations", []) if r["rule"] not in old_rules]
    # A new CEL rule is ratcheted (an unchanged stored value still updates) only where it does not
    # read the object as a whole: say it, the round-trip test on the real API server decides.
    out += [f"new validation rule {r!r} (check a stored object still updates)" for r in added]
    return out


#: Values for strings whose schema has a pattern or a CEL rule a generic string would not satisfy.
EXAMPLES: dict[str, Any] = {
    ".month": "2026-11",
    ".metadata": None,
}


def example(schema: Schema, path: str = "", examples: dict[str, Any] | None = None) -> Any:
    """An object that sets every property `schema` declares (one item per list), as a release that
    used every field would have stored it; `examples` overrides by path."""
    examples = {**EXAMPLES, **(examples or {})}
    if path in examples:
        return examples[path]
    if "default" in schema:
        return schema["default"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        obj = {
            k: example(s, f"{path}.{k}", examples)
            for k, s in props.items()
            if k not in ("apiVersion", "kind")
        }
        return {k: v for k, v in obj.items() if v is not None}
    if kind == "array":
        return [example(schema.get("items", {}), f"{path}[]", examples)]
    if kind == "integer":
        return max(schema.get("minimum", 1), 1)
    if kind == "number":
        return float(max(schema.get("minimum", 1), 1))
    if kind == "boolean":
        return False
    if schema.get("x-kubernetes-int-or-string"):
        return 1
    if schema.get("format") == "date-time":
        return "2026-11-03T10:00:00Z"
    if "pattern" in schema:
        raise AssertionError(f"{path} has pattern {schema['pattern']!r}: add an example for it to EXAMPLES")
    return "x"


def prune(value: Any, schema: Schema) -> Any:
    """What a structural schema keeps of a value (the API server drops undeclared fields)."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for k, v in value.items():
            if k in props:
                out[k] = prune(v, props[k])
            elif isinstance(extra, dict):
                out[k] = prune(v, extra)
        return out
    if isinstance(value, list):
        return [prune(v, schema.get("items", {})) for v in value]
    return value
