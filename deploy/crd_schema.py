"""Validation of custom resources against the released CRDs' OpenAPI v3 schemas (deploy/schemas/crds/).

Each CRD file is the project's own release file, copied unchanged (sources, versions and hashes:
deploy/schemas/SOURCES.md). An object is checked against the ``openAPIV3Schema`` of its
apiVersion's served version with ``jsonschema``, strictly: a field the schema does not declare is an
error (as ``kubectl apply --validate=strict`` reports it), except under
``x-kubernetes-preserve-unknown-fields``. Not checked: the CEL rules (``x-kubernetes-validations``),
which only the API server evaluates, and the ``format`` keywords.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

CRD_DIR = Path(__file__).resolve().parent / "schemas" / "crds"


@dataclass(frozen=True, slots=True)
class CrdVersion:
    group: str
    version: str
    kind: str
    source: Path
    schema: Mapping[str, Any]


def _strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def load_crds(paths: Iterable[Path]) -> dict[tuple[str, str, str], CrdVersion]:
    """(group, version, kind) -> schema, for every served version of the CRDs in these files."""
    found: dict[tuple[str, str, str], CrdVersion] = {}
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", False):
                    continue
                key = (spec["group"], version["name"], spec["names"]["kind"])
                schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                # Every object has these, declared in its CRD or not (Istio's leave them out).
                schema.setdefault("properties", {})
                for name, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
                    schema["properties"].setdefault(name, {"type": kind})
                found[key] = CrdVersion(*key, path, schema)
    return found


@cache
def committed_crds() -> dict[tuple[str, str, str], CrdVersion]:
    return load_crds(sorted(CRD_DIR.rglob("*.yaml")))


def groups() -> frozenset[str]:
    return frozenset(group for group, _, _ in committed_crds())


def crd_for(body: Mapping[str, Any]) -> CrdVersion | None:
    group, _, version = str(body.get("apiVersion", "")).rpartition("/")
    return committed_crds().get((group, version, str(body.get("kind", ""))))


def crd_problems(body: Mapping[str, Any]) -> list[str]:
    """Problems of one object against its CRD's schema; a kind with no committed CRD is a problem."""
    crd = crd_for(body)
    if crd is None:
        return [f"no CRD schema for {body.get('apiVersion')} {body.get('kind')}"]
    validator = jsonschema.Draft7Validator(crd.schema)
    errors = sorted(validator.iter_errors(body), key=lambda e: [str(p) for p in e.absolute_path])
    where = crd.source.relative_to(CRD_DIR)
    return [f"CRD {where}: {'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]
