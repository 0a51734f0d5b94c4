"""The sglang adapter as pure functions: both legs' bodies, the room, discovery, the background check."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.adapters import adapter_flow, build_adapter, engines
from extproc.adapters.base import Flow, PlanInput
from extproc.adapters.sglang import PROTOCOL_0_5_23, ROOM_LIMIT, SglangAdapter, rid_from_nonce, room_from_nonce
from extproc.config import ConfigError, load_settings
from extproc.envoy.bootstrap import decode_idle_timeout
from extproc.protocol.errors import Code, PdError
from extproc.protocol.fields import refuse_reserved
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.protocol.settings_spec import SecretFileError
from extproc.protocol.transport import WorkerReply
from tests.helpers import client_request

TARGET = parse_prefill_target(["10.0.0.7:30000"])
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9}


request = client_request


def plan(body: dict[str, Any] | bytes, path: str = "/v1/chat/completions", nonce: int = 41,
         adapter: SglangAdapter | None = None, server_info: dict[str, Any] | None = None) -> tuple[Any, Any]:
    made = (adapter or SglangAdapter()).plan(request(path, body), PlanInput(TARGET, nonce, server_info))
    return json.loads(made.prefill_body), json.loads(made.decode.body)


def discovering() -> SglangAdapter:
    return SglangAdapter(bootstrap_port=None)


def test_both_legs_get_the_same_bootstrap_fields_as_json_string_and_integers() -> None:
    prefill, decode = plan({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    fields = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42, "rid": "pd-0000000000000029"}
    assert decode == {**CHAT, "stream": True, "stream_options": {"include_usage": True}, **fields}
    assert prefill == {**CHAT, "stream": False, **fields}  # one JSON answer; max_tokens untouched
    assert type(decode["bootstrap_room"]) is int and type(decode["bootstrap_port"]) is int


def test_decode_body_is_the_client_bytes_plus_three_members() -> None:
    raw = b'{"prompt": "p",  "seed": 123456789012345678901234567890, "bootstrap_room": null}'
    made = SglangAdapter(bootstrap_port=9000).plan(request("/v1/completions", raw), PlanInput(TARGET, 6))
    assert made.decode.body == (b'{"prompt": "p","seed": 123456789012345678901234567890,'
                                b'"bootstrap_host":"10.0.0.7","bootstrap_port":9000,"bootstrap_room":7,'
                                b'"rid":"pd-0000000000000006"}')


def test_a_non_streaming_client_request_gets_stream_false_once_on_prefill() -> None:
    prefill, decode = plan(CHAT, "/v1/chat/completions")
    assert prefill["stream"] is False and "stream" not in decode


def test_ipv6_prefill_host_is_sent_without_brackets() -> None:
    made = SglangAdapter().plan(request("/v1/completions", {"prompt": "p"}),
                                PlanInput(parse_prefill_target(["[fd00::7]:30000"]), 1))
    assert json.loads(made.prefill_body)["bootstrap_host"] == "fd00::7"


@given(st.integers(min_value=0, max_value=ROOM_LIMIT - 1))
def test_rooms_are_positive_int64(nonce: int) -> None:
    assert 1 <= room_from_nonce(nonce) < ROOM_LIMIT


def test_a_room_of_zero_is_never_sent() -> None:
    assert room_from_nonce(0) == 1
    assert room_from_nonce(ROOM_LIMIT - 1) == 1


@pytest.mark.parametrize("field,value", [("bootstrap_host", "evil.example"), ("bootstrap_port", 1),
                                         ("bootstrap_room", 5), ("bootstrap_room", [5]), ("rid", "mine")])
def test_client_supplied_bootstrap_fields_are_refused(field: str, value: Any) -> None:
    with pytest.raises(PdError) as caught:
        refuse_reserved({**CHAT, field: value}, SglangAdapter.reserved_fields)
    assert caught.value.code is Code.RESERVED_REQUEST_FIELD and caught.value.param == field
    refuse_reserved({**CHAT, field: None}, SglangAdapter.reserved_fields)  # null is tolerated


def test_discovery_uses_the_prefill_workers_advertised_port() -> None:
    info = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 31000, "version": "0.5.23"}
    _, decode = plan(CHAT, adapter=discovering(), server_info=info)
    assert decode["bootstrap_port"] == 31000
    assert discovering().server_info_path == "/server_info" and SglangAdapter().server_info_path is None


@pytest.mark.parametrize("info,param", [
    ({"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 8998},
     "server_info.disaggregation_mode is invalid"),
    ({"disaggregation_mode": "prefill"}, "server_info.disaggregation_bootstrap_port is missing"),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": "8998"},
     "server_info.disaggregation_bootstrap_port is invalid"),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": True},
     "server_info.disaggregation_bootstrap_port is invalid"),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 0},
     "server_info.disaggregation_bootstrap_port is invalid"),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 65536},
     "server_info.disaggregation_bootstrap_port is invalid"),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998.0},
     "server_info.disaggregation_bootstrap_port is invalid"),
])
def test_bad_server_info_stops_before_either_leg(info: dict[str, Any], param: str) -> None:
    with pytest.raises(PdError) as caught:
        plan(CHAT, adapter=discovering(), server_info=info)
    assert caught.value.code is Code.INVALID_PREFILL_HANDOFF and caught.value.param == param


def reply(status: int, body: Any, content_type: str = "application/json") -> WorkerReply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return WorkerReply(status, content_type, raw)


def test_background_check_accepts_sglangs_completion() -> None:
    SglangAdapter().check_prefill(reply(200, {"id": "x", "choices": [{"index": 0, "finish_reason": "length"}]}))


@pytest.mark.parametrize("answer,code,param", [
    (reply(500, {"object": "error", "message": "Prefill bootstrap failed", "type": "500", "code": 500}),
     Code.PREFILL_UPSTREAM_ERROR, None),
    (reply(200, {"id": "x", "choices": [{"index": 0, "finish_reason": "abort"}]}), Code.INVALID_PREFILL_HANDOFF,
     "choices.finish_reason is abort"),
    (reply(200, {"object": "error", "message": "m"}), Code.INVALID_PREFILL_HANDOFF, "choices is missing"),
    (reply(200, b"data: {}\n\n", "text/event-stream"), Code.PREFILL_RESPONSE_STREAMED, None),
    (reply(200, b'{"choices": ['), Code.PREFILL_RESPONSE_TRUNCATED, None),
])
def test_background_check_reports_failures(answer: WorkerReply, code: Code, param: str | None) -> None:
    with pytest.raises(PdError) as caught:
        SglangAdapter().check_prefill(answer)
    assert caught.value.code is code and caught.value.param == param
    if code is Code.PREFILL_UPSTREAM_ERROR:
        assert caught.value.status == 500


def test_registry_builds_from_settings_and_the_flow_is_concurrent() -> None:
    assert adapter_flow("sglang") is Flow.CONCURRENT
    assert engines()["sglang"].pins[0] == PROTOCOL_0_5_23
    configured = build_adapter("sglang", "", {"sglang_bootstrap_port": 9100})
    assert type(configured) is SglangAdapter and configured.protocol == PROTOCOL_0_5_23
    made = configured.plan(request("/v1/completions", {"prompt": "p"}), PlanInput(TARGET, 1))
    assert json.loads(made.prefill_body)["bootstrap_port"] == 9100
    found = build_adapter("sglang", "", {"sglang_bootstrap_port": "discover"})
    assert isinstance(found, SglangAdapter) and found.server_info_path == "/server_info"


@pytest.mark.parametrize("text,value", [("discover", "discover"), ("9000", 9000), (" 1 ", 1), ("65535", 65535)])
def test_bootstrap_port_setting(text: str, value: Any) -> None:
    settings = load_settings({"PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": text}, {})
    assert settings.value("sglang_bootstrap_port") == value
    assert load_settings({}, {}).value("sglang_bootstrap_port") == 8998


@pytest.mark.parametrize("text", ["0", "65536", "-1", "auto", "", "8998.0"])
def test_bad_bootstrap_port_setting_refuses_to_start(text: str) -> None:
    with pytest.raises(ConfigError, match="PD_EXTPROC_SGLANG_BOOTSTRAP_PORT"):
        load_settings({"PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": text}, {})


# --- request ids and the decode abort (http_server.py abort_request; scheduler.py abort_request) ------


@given(st.integers(min_value=0, max_value=(1 << 63) - 1), st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_our_rids_never_prefix_one_another(a: int, b: int) -> None:
    """SGLang aborts every rid that starts with the aborted one: ours have one fixed length."""
    first, second = rid_from_nonce(a), rid_from_nonce(b)
    assert len(first) == len(second) == 19
    assert first.startswith(second) == (a == b)


def test_the_plan_aborts_decode_by_the_rid_both_legs_carry() -> None:
    made = SglangAdapter().plan(request("/v1/completions", {"prompt": "p"}), PlanInput(TARGET, 77))
    rid = json.loads(made.decode.body)["rid"]
    assert json.loads(made.prefill_body)["rid"] == rid
    assert made.abort is not None and made.abort.path == "/abort_request"
    assert json.loads(made.abort.body) == {"rid": rid, "abort_all": False}
    assert made.abort.headers == ()


def test_keys_go_on_our_own_requests_only() -> None:
    """Discovery carries the API key; the abort the admin key when there is one (ADMIN_OPTIONAL)."""
    keyed = SglangAdapter(api_key=b"K")
    made = keyed.plan(request("/v1/completions", {"prompt": "p"}), PlanInput(TARGET, 1))
    assert keyed.discovery_headers == (("authorization", "Bearer K"),)
    assert made.abort is not None and made.abort.headers == (("authorization", "Bearer K"),)
    assert made.decode.headers == (), "the legs carry the client's own authorization"
    admin = SglangAdapter(api_key=b"K", admin_api_key=b"A")
    admin_plan = admin.plan(request("/v1/completions", {"prompt": "p"}), PlanInput(TARGET, 1))
    assert admin_plan.abort is not None and admin_plan.abort.headers == (("authorization", "Bearer A"),)
    assert admin.discovery_headers == (("authorization", "Bearer K"),)


def test_a_key_that_cannot_travel_in_a_header_refuses_to_start(tmp_path: Any) -> None:
    bad = tmp_path / "key"
    bad.write_text("two words\n")
    with pytest.raises(SecretFileError, match="visible ASCII"):
        build_adapter("sglang", "", {"sglang_api_key_file": str(bad)})


def test_the_prefill_deadline_outlasts_sglangs_own_timeouts() -> None:
    assert build_adapter("sglang", "", {}).prefill_deadline > 300  # type: ignore[union-attr]
    settings = load_settings({"PD_EXTPROC_ADAPTER": "sglang"}, {})
    assert decode_idle_timeout(settings) >= settings.value("sglang_prefill_deadline") + 30
