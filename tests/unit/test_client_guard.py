"""Issue 23's pure pieces: the steering catalogue and the P/D route's check, the guard's rendering, the
unsupported-variants setting, and which prefill errors are relayed (and how they are cleaned)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.adapters.sglang import OVERRIDE_HEADERS, SglangAdapter
from extproc.adapters.trtllm import AUTH_HEADER, TrtllmAdapter
from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.config import ConfigError, load_settings
from extproc.envoy.bootstrap import render
from extproc.envoy.guard import LUA_FILTER, lua_source
from extproc.protocol.errors import Code, PdError
from extproc.protocol.openai_request import parse_client_request
from extproc.protocol.relayed_error import MAX_MESSAGE_CHARS, Shape, relayable_error
from extproc.protocol.steering import STEERING_FIELDS, STEERING_HEADER_NAMES, refuse_steering


def test_every_adapters_reserved_field_and_header_is_in_the_catalogue() -> None:
    names = {field.name for field in STEERING_FIELDS}
    for adapter in (VllmNixlAdapter, SglangAdapter, TrtllmAdapter):
        assert {field.name for field in adapter.reserved_fields} - {"rid"} <= names, adapter.name
    assert OVERRIDE_HEADERS - {"x-override-rid"} <= STEERING_HEADER_NAMES
    assert AUTH_HEADER in STEERING_HEADER_NAMES
    assert all(field.source for field in STEERING_FIELDS), "each names where the engine reads it"


@pytest.mark.parametrize("body,param", [
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": [1]}}, "vllm_xargs.kv_transfer_params"),
    ({"sampling_params": {"extra_args": {"ec_transfer_params": {}}}}, "sampling_params.extra_args.ec_transfer_params"),
    ({"bootstrap_room": 0}, "bootstrap_room"),
    ({"parameters": {"bootstrap_pair_key": "k"}}, "parameters.bootstrap_pair_key"),
    ({"disaggregated_params": {}}, "disaggregated_params"),
    ({"kv_transfer_params": None}, None),
    ({"kv_transfer_params": {}}, None),
    ({"vllm_xargs": "not an object", "metadata": {"bootstrap_host": "x"}}, None),
])
def test_refuse_steering(body: dict[str, Any], param: str | None) -> None:
    if param is None:
        refuse_steering(body)
        return
    with pytest.raises(PdError) as raised:
        refuse_steering(body)
    assert (raised.value.code, raised.value.param) == (Code.RESERVED_REQUEST_FIELD, param)


def _hcm(config: dict[str, Any], chain: int = 0) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][chain]["filters"][0][
        "typed_config"]
    return typed


def _routes(hcm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {route["name"]: route for route in hcm["route_config"]["virtual_hosts"][0]["routes"]}


@pytest.mark.parametrize("env", [{}, {"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"}], ids=["one-chain", "two-chains"])
def test_the_guard_is_on_every_chain_and_off_on_the_pd_route_only(env: dict[str, str]) -> None:
    config = render(load_settings(env, {}))
    chains = config["static_resources"]["listeners"][0]["filter_chains"]
    for chain in range(len(chains)):
        hcm = _hcm(config, chain)
        names = [f["name"] for f in hcm["http_filters"]]
        assert names.index(LUA_FILTER) < names.index("envoy.filters.http.router")
        routes = _routes(hcm)
        passthrough = routes["passthrough"]
        assert set(passthrough["request_headers_to_remove"]) >= STEERING_HEADER_NAMES
        assert passthrough["request_body_buffer_limit"] == load_settings(env, {}).max_request_bytes
        if "pd" in routes:
            assert routes["pd"]["typed_per_filter_config"][LUA_FILTER]["disabled"] is True
            assert not STEERING_HEADER_NAMES & set(routes["pd"]["request_headers_to_remove"]), \
                "the P/D route sets some of them itself (x-trtllm-disagg-auth)"


def test_trust_client_steering_removes_the_guard() -> None:
    hcm = _hcm(render(load_settings({"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"}, {})))
    assert LUA_FILTER not in [f["name"] for f in hcm["http_filters"]]
    passthrough = _routes(hcm)["passthrough"]
    assert not STEERING_HEADER_NAMES & set(passthrough["request_headers_to_remove"])
    assert "request_body_buffer_limit" not in passthrough


def test_the_lua_guard_names_every_steering_member() -> None:
    source = lua_source()
    assert "__TABLES__" not in source
    for field in STEERING_FIELDS:
        assert f'["{field.name}"] = true' in source


def _guard_source(hcm: dict[str, Any]) -> str:
    guard = next(f for f in hcm["http_filters"] if f["name"] == LUA_FILTER)
    source: str = guard["typed_config"]["default_source_code"]["inline_string"]
    return source


@pytest.mark.parametrize("env,compressed,forms", [
    ({}, "false", "false"),
    ({"PD_EXTPROC_GUARD_ALLOW_COMPRESSED_BODIES": "true"}, "true", "false"),
    ({"PD_EXTPROC_GUARD_ALLOW_FORM_JSON_FIELDS": "true"}, "false", "true"),
])
def test_each_loosening_reaches_the_rendered_guard_alone(env: dict[str, str], compressed: str, forms: str) -> None:
    source = _guard_source(_hcm(render(load_settings(env, {}))))
    assert f"local ALLOW_COMPRESSED = {compressed}\n" in source
    assert f"local ALLOW_FORM_JSON = {forms}\n" in source
    assert source == lua_source(allow_compressed=compressed == "true", allow_form_json=forms == "true")


def test_unsupported_variants_cannot_be_served_whole_by_sglang() -> None:
    with pytest.raises(ConfigError, match="unsupported_variants"):
        load_settings({"PD_EXTPROC_ADAPTER": "sglang", "PD_EXTPROC_UNSUPPORTED_VARIANTS": "aggregated"}, {})
    assert load_settings({"PD_EXTPROC_UNSUPPORTED_VARIANTS": "aggregated"}, {}).unsupported_variants == "aggregated"
    assert load_settings({}, {}).unsupported_variants == "refuse"


@pytest.mark.parametrize("body,field", [(b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
                                        (b'{"prompt": ["a", "b"]}', "prompt")])
def test_an_unsupported_variant_is_named_not_refused_when_allowed(body: bytes, field: str) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert parse_client_request(path, "application/json", body, 1 << 20, allow_unsupported=True).unsupported == field
    with pytest.raises(PdError) as raised:
        parse_client_request(path, "application/json", body, 1 << 20)
    assert (raised.value.code, raised.value.param) == (Code.UNSUPPORTED_PD_VARIANT, field)


# --- relayed prefill errors -------------------------------------------------------------------------

VLLM_CONTEXT = {"error": {"message": "This model's maximum context length is 4096 tokens. However, your prompt "
                                     "contains 5000 input tokens, which exceeds this limit even without any output "
                                     "tokens. Please reduce the length of the input prompt.",
                          "type": "BadRequestError", "param": "input_tokens", "code": 400}}
SGLANG_ERROR = {"object": "error", "message": "The input (5000 tokens) is longer than the model's context length "
                                              "(4096 tokens).", "type": "BadRequestError", "param": None, "code": 400}
TRTLLM_VALIDATION = {"error": "1 validation error: {'type': 'extra_forbidden', 'loc': ('body', 'x')}"}


@pytest.mark.parametrize("body,shape", [(VLLM_CONTEXT, Shape.NESTED), (SGLANG_ERROR, Shape.FLAT),
                                        (TRTLLM_VALIDATION, Shape.STRING)], ids=["vllm", "sglang", "trtllm"])
def test_an_engines_own_error_is_rebuilt_in_its_own_shape(body: dict[str, Any], shape: Shape) -> None:
    relayed = relayable_error(400, "application/json", orjson.dumps(body))
    assert relayed is not None and relayed.shape is shape
    assert orjson.loads(relayed.body()) == body


@pytest.mark.parametrize("status,content_type,raw", [
    (401, "application/json", orjson.dumps(VLLM_CONTEXT)),
    (429, "application/json", orjson.dumps(VLLM_CONTEXT)),
    (500, "application/json", orjson.dumps(VLLM_CONTEXT)),
    (400, "text/html", orjson.dumps(VLLM_CONTEXT)),
    (400, "application/json", b"not json"),
    (400, "application/json", b'{"detail": "x"}'),
    (400, "application/json", b'{"error": {"type": "no message"}}'),
    (400, "application/json", b'{"error": "x", "extra": 1}'),
    (400, "application/json", orjson.dumps({"error": {"message": "x" * (70 << 10)}})),
])
def test_anything_else_is_not_relayed(status: int, content_type: str, raw: bytes) -> None:
    assert relayable_error(status, content_type, raw) is None


def test_a_relayed_error_is_bounded_and_has_no_control_characters() -> None:
    body = {"error": {"message": "line one\nline two\r\x1b[31m\u2028" + "y" * 5000, "type": "Bad\x00Request",
                      "param": "p" * 500, "code": True}}
    relayed = relayable_error(422, "application/json; charset=utf-8", orjson.dumps(body))
    assert relayed is not None
    assert relayed.message.startswith("line oneline two[31m") and len(relayed.message) == MAX_MESSAGE_CHARS
    assert (relayed.type, len(relayed.param or ""), relayed.code) == ("BadRequest", 128, None)
    assert len(relayed.reason) == 256
