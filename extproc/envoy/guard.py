"""The client guard on the routes our server does not see, rendered for Envoy: no body that carries a
steering member (steering.py) reaches an engine, and no steering header either.

Envoy's Lua filter reads a body the way the engine would (guard.lua; docs/security.md has the table per engine
and endpoint): a body FastAPI would read as JSON is scanned and a steering member is refused with the P/D
route's documented 400 ``reserved_request_field`` (``param`` = the member's dotted path). It fails closed:
400 ``invalid_request_body`` for a body it cannot follow, 415 ``unsupported_media_type`` for a repeated or
comma-joined content-type, 415 ``uninspectable_request_body`` for a body the engine would decompress first
(SGLang's ``x-body-compressed``) or a form that may carry a field the engine decodes as JSON (``vllm_xargs``).
The passthrough route removes the steering headers. Why Lua and not ``json_to_metadata`` + RBAC: docs/decisions.md.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from extproc.protocol.errors import Code, error_body
from extproc.protocol.steering import EMPTY_OBJECT_TOLERATED, STEERING_FIELDS, STEERING_HEADERS

LUA_FILTER = "envoy.filters.http.lua"
# Details of a Lua filter's own reply (Envoy's HttpResponseCodeDetails LuaResponse): our generic
# local-reply mappers leave such a reply alone, it already carries its JSON body.
LUA_RESPONSE_DETAILS = "lua_response"
_TYPE = "@type"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
_LUA_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"


def _lua_string(text: str) -> str:
    """A Lua long-bracket-free string literal (our bodies are ASCII JSON)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lua_set(names: list[str]) -> str:
    return "{" + ", ".join(f"[{_lua_string(name)}] = true" for name in sorted(names)) + "}"


# Form fields an engine decodes as JSON: vLLM 0.32.0 speech_to_text/transcription/protocol.py and
# translation/protocol.py, the model_validator of TranscriptionRequest / TranslationRequest (json.loads of the
# vllm_xargs form string, which becomes SamplingParams.extra_args: kv_transfer_params).
FORM_JSON_FIELDS = ("vllm_xargs",)
# What a refusal of an uninspectable body names: the header that asks for decompression, the form field, or
# the multipart content-type whose charset would change how field names are decoded.
_UNINSPECTABLE_PARAMS = ("x-body-compressed", "content-type", *FORM_JSON_FIELDS)


def _lua_bool(value: bool) -> str:
    return "true" if value else "false"


def lua_source(*, allow_compressed: bool = False, allow_form_json: bool = False) -> str:
    """The guard's Lua; the two flags are the operator's loosenings (PD_EXTPROC_GUARD_ALLOW_COMPRESSED_BODIES,
    PD_EXTPROC_GUARD_ALLOW_FORM_JSON_FIELDS), off in every shipped shape unless set."""
    names = [field.name for field in STEERING_FIELDS]
    parents = sorted({".".join(field.path[:depth])
                      for field in STEERING_FIELDS for depth in range(1, len(field.path))})
    refusals = ", ".join(
        f"[{_lua_string(name)}] = {_lua_string(error_body(Code.RESERVED_REQUEST_FIELD, name).decode())}"
        for name in sorted(names))
    literals = sorted({field.path[-1] for field in STEERING_FIELDS})
    tables = "\n".join((
        f"local WATCH = {_lua_set(names)}",
        f"local PARENTS = {_lua_set(parents)}",
        "local LITERALS = {" + ", ".join(_lua_string(name) for name in literals) + "}",
        f"local EMPTY_OK = {_lua_set(sorted(EMPTY_OBJECT_TOLERATED))}",
        f"local REFUSALS = {{{refusals}}}",
        f"local INVALID_BODY = {_lua_string(error_body(Code.INVALID_REQUEST_BODY).decode())}",
        f"local MEDIA_TYPE = {_lua_string(error_body(Code.UNSUPPORTED_MEDIA_TYPE).decode())}",
        "local UNINSPECTABLE = {" + ", ".join(
            f"[{_lua_string(param)}] = "
            f"{_lua_string(error_body(Code.UNINSPECTABLE_REQUEST_BODY, param).decode())}"
            for param in _UNINSPECTABLE_PARAMS) + "}",
        "local FORM_JSON_FIELDS = {" + ", ".join(_lua_string(name) for name in FORM_JSON_FIELDS) + "}",
        f"local ALLOW_COMPRESSED = {_lua_bool(allow_compressed)}",
        f"local ALLOW_FORM_JSON = {_lua_bool(allow_form_json)}",
    ))
    template = resources.files("extproc.envoy").joinpath("guard.lua").read_text(encoding="utf-8")
    return template.replace("__TABLES__", tables, 1)


def guard_filter(*, allow_compressed: bool = False, allow_form_json: bool = False) -> dict[str, Any]:
    """The HTTP filter; it goes before ext_proc and the router."""
    source = lua_source(allow_compressed=allow_compressed, allow_form_json=allow_form_json)
    return {"name": LUA_FILTER, "typed_config": {_TYPE: _LUA, "default_source_code": {"inline_string": source}}}


def disabled_on_route() -> dict[str, Any]:
    """typed_per_filter_config that switches the guard off on a route (the P/D route: our server checks
    the same members there)."""
    return {LUA_FILTER: {_TYPE: _LUA_PER_ROUTE, "disabled": True}}


def stripped_headers() -> list[str]:
    return sorted(header.name for header in STEERING_HEADERS)
