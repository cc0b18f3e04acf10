"""Validating custom resources against their CRD's openAPIV3Schema, as strictly as the API server does.

The CRD schemas are OpenAPI v3 structural schemas, not JSON Schema: an unknown field is pruned by the
API server (and refused by `kubectl apply`'s default strict field validation) rather than being a
schema error, `nullable` stands for a null type, and `x-kubernetes-list-type: map|set` lists must not
repeat a key. `strict_schema` turns those rules into JSON Schema terms (additionalProperties false on
every object that lists its properties, null types), and `duplicate_list_keys` checks the list keys.
CEL rules (x-kubernetes-validations) are not evaluated here.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

Schema = dict[str, Any]


@functools.cache
def crd_schemas(crds_dir: Path) -> dict[tuple[str, str], Schema]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, for every CRD file in the folder."""
    found: dict[tuple[str, str], Schema] = {}
    for path in sorted(crds_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                found[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return found


def strict_schema(schema: Schema) -> Schema:
    """A JSON Schema that refuses what the API server would drop or refuse (see the module docstring)."""
    out = copy.deepcopy(schema)
    _tighten(out)
    return out


def _tighten(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _tighten(item)
        return
    if not isinstance(node, dict):
        return
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            for prop in value.values():
                _tighten(prop)
        elif key != "enum":
            _tighten(value)


def schema_errors(obj: dict[str, Any], schema: Schema) -> list[str]:
    """Every violation, each as 'path: message'; empty when the object is valid."""
    validator = jsonschema.Draft7Validator(strict_schema(schema))
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
    return errors + duplicate_list_keys(obj, schema)


def duplicate_list_keys(obj: Any, schema: Schema, path: str = "") -> list[str]:
    """Entries of `x-kubernetes-list-type: map` (by their map keys) or `set` lists that repeat."""
    found: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        for key, value in obj.items():
            if key in props:
                found += duplicate_list_keys(value, props[key], f"{path}/{key}")
    elif isinstance(obj, list):
        items = schema.get("items", {})
        list_type = schema.get("x-kubernetes-list-type")
        if list_type in ("map", "set"):
            map_keys = schema.get("x-kubernetes-list-map-keys", [])
            seen: set[str] = set()
            for entry in obj:
                ident = repr([entry.get(k) for k in map_keys]) if list_type == "map" else repr(entry)
                if ident in seen:
                    found.append(f"{path}: duplicate entry {ident} in a list of type {list_type}")
                seen.add(ident)
        for i, entry in enumerate(obj):
            found += duplicate_list_keys(entry, items, f"{path}/{i}")
    return found
