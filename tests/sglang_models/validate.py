"""Run by the SGLang virtualenv (.venv-sglang), not by pytest: validate request bodies with SGLang
0.5.23's own pydantic models (``sglang.srt.entrypoints.openai.protocol``) and, for ``/generate``, its JSON
contract (``sglang.api.v1.api_types.GenerateRequest``, which ``srt/entrypoints/api_contract.py``
``generate_contract_error`` applies to every /generate body before serving it).

Importing any ``sglang`` module runs ``sglang/__init__.py``, which imports torch and triton; the
request models need neither. So the three parent packages are registered as bare namespace modules
pointing at the installed files, and ``sglang.utils.convert_json_schema_to_str`` (which protocol.py
imports, and only ``to_sampling_params`` calls) gets a stand-in. Everything validated is SGLang's code.

stdin: a JSON list of {"path", "body"}; stdout: a JSON list of
{"ok", "error", "fields", "dropped", "values"} in the same order.
"""

from __future__ import annotations

import json
import sys
import types
from importlib.util import find_spec
from pathlib import Path


def load_models() -> tuple[type, type]:
    spec = find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed in this interpreter"
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, sub in (("sglang", ""), ("sglang.srt", "srt"), ("sglang.srt.entrypoints", "srt/entrypoints"),
                      ("sglang.api", "api"), ("sglang.api.v1", "api/v1")):
        module = types.ModuleType(name)
        module.__path__ = [str(root / sub)]
        sys.modules[name] = module
    utils = types.ModuleType("sglang.utils")
    utils.convert_json_schema_to_str = lambda schema: schema  # type: ignore[attr-defined]
    sys.modules["sglang.utils"] = utils
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    return ChatCompletionRequest, CompletionRequest


def generate_verdict(body: dict[str, object]) -> dict[str, object]:
    """The /generate contract's verdict: msgspec structs, unknown top-level keys ignored (so reported as
    dropped), unknown sampling_params keys refused."""
    import msgspec
    from sglang.api.v1.api_types import GenerateRequest, JsonContractError

    try:
        request = GenerateRequest.from_json_value(body)
    except JsonContractError as error:
        return {"ok": False, "error": str(error), "fields": [], "dropped": [], "values": {}}
    fields = set(GenerateRequest.__struct_fields__)
    dropped = sorted(key for key in body if key not in fields)
    return {"ok": True, "error": "", "fields": sorted(fields), "dropped": dropped,
            "values": {key: msgspec.to_builtins(getattr(request, key)) for key in body if key in fields}}


def main() -> None:
    from pydantic import ValidationError

    chat, completions = load_models()
    results = []
    for item in json.load(sys.stdin):
        if item["path"] == "/generate":
            results.append(generate_verdict(item["body"]))
            continue
        model = chat if item["path"] == "/v1/chat/completions" else completions
        body = item["body"]
        try:
            request = model(**body)
        except ValidationError as error:
            results.append({"ok": False, "error": str(error), "fields": [], "dropped": [], "values": {}})
            continue
        fields = set(model.model_fields)
        results.append({
            "ok": True, "error": "",
            "fields": sorted(fields),
            "dropped": sorted(key for key in body if key not in fields),  # extra="ignore": silently dropped
            "values": {key: getattr(request, key) for key in body if key in fields and key not in ("messages",)},
        })
    json.dump(results, sys.stdout, default=repr)


if __name__ == "__main__":
    main()
