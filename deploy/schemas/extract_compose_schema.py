"""Extracts the Compose Specification JSON Schema that docker compose v2.40.3 validates with.

docker compose embeds compose-go's ``schema/compose-spec.json`` (compose-go v2.9.1 in v2.40.3) in its
binary verbatim. This finds it there and writes it to deploy/schemas/compose-spec.json, so the tests
validate against exactly the schema of the pinned tool without needing the tool:

    .venv/bin/python -m deploy.schemas.extract_compose_schema          # (re)write the schema
    .venv/bin/python -m deploy.schemas.extract_compose_schema --check  # exit 1 if it differs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from deploy.tools import compose_bin

SCHEMA = Path(__file__).resolve().parent / "compose-spec.json"
_START = b'{\n  "$schema": "https://json-schema.org/draft-07/schema",\n  "$id": "compose_spec.json"'


def embedded_schema(binary: Path) -> bytes:
    data = binary.read_bytes()
    start = data.find(_START)
    if start < 0 or data.find(_START, start + 1) >= 0:
        raise ValueError(f"expected exactly one embedded compose-spec.json in {binary}")
    text = data[start:].decode("utf-8", errors="replace")
    _, end = json.JSONDecoder().raw_decode(text)
    return text[:end].encode("utf-8") + b"\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    schema = embedded_schema(compose_bin())
    digest = hashlib.sha256(schema).hexdigest()
    if args.check:
        same = SCHEMA.exists() and SCHEMA.read_bytes() == schema
        sys.stdout.write(f"{'matches' if same else 'DIFFERS from'} the binary's schema (sha256 {digest})\n")
        return 0 if same else 1
    SCHEMA.write_bytes(schema)
    sys.stdout.write(f"wrote {SCHEMA} (sha256 {digest})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
