"""The client guard on the routes our server does not see, rendered for Envoy: no body that carries a
steering member (steering.py) reaches an engine, and no steering header either.

Envoy's Lua filter scans a body the engine would read as JSON (guard.lua) and refuses a steering
member with the P/D route's documented 400 ``reserved_request_field`` (``param`` = the member's dotted
path); it fails closed (400 ``invalid_request_body`` for a body it cannot follow, 415
``unsupported_media_type`` for a repeated or comma-joined content-type). The passthrough route removes
the steering headers. Why Lua and not ``json_to_metadata`` + RBAC: docs/decisions.md.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from extproc.core.steering import EMPTY_OBJECT_TOLERATED, STEERING_FIELDS, STEERING_HEADERS
from extproc.errors import Code, error_body

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


def lua_source() -> str:
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
    ))
    template = resources.files("extproc.envoy").joinpath("guard.lua").read_text(encoding="utf-8")
    return template.replace("__TABLES__", tables, 1)


def guard_filter() -> dict[str, Any]:
    """The HTTP filter; it goes before ext_proc and the router."""
    return {"name": LUA_FILTER, "typed_config": {_TYPE: _LUA, "default_source_code": {"inline_string": lua_source()}}}


def disabled_on_route() -> dict[str, Any]:
    """typed_per_filter_config that switches the guard off on a route (the P/D route: our server checks
    the same members there)."""
    return {LUA_FILTER: {_TYPE: _LUA_PER_ROUTE, "disabled": True}}


def stripped_headers() -> list[str]:
    return sorted(header.name for header in STEERING_HEADERS)
