"""Issue 5: who may be a prefill target, header trust, TLS to prefill, and hostile input through a real Envoy.

"No connection is opened" is observed on a listener that counts every accepted connection.
"""

from __future__ import annotations

import json
import random
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trustme

from extproc.protocol.errors import SPEC, Code
from tests.conftest import SUMMARY
from tests.harness import Stack, Worker, WorkerSpec, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    chat_body,
    envoy_logged,
    envoy_stats_settled,
    eventually,
    post,
)

pytestmark = pytest.mark.dataplane


class CountingListener:
    """A TCP listener that accepts and counts connections (and closes them)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.bind((host, 0))
        self.socket.listen(16)
        self.port = int(self.socket.getsockname()[1])
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def counting_listener() -> Iterator[CountingListener]:
    listener = CountingListener()
    yield listener
    listener.close()


def _allow_prefill_only(workers: dict[str, Worker]) -> dict[str, str]:
    port = workers["prefill"].address.rsplit(":", 1)[1]
    return {"PD_EXTPROC_PREFILL_ALLOW": f"127.0.0.1:{port},localhost:{port}"}


@pytest.fixture(scope="module")
def target_stack() -> Iterator[Stack]:
    """An explicit allow-list naming exactly the prefill worker's address and port (and its name)."""
    with running_stack(env_from_workers=_allow_prefill_only) as stack:
        yield stack


@pytest.fixture(scope="module")
def default_policy_stack() -> Iterator[Stack]:
    """No allow-list: the built-in default (no loopback, no link-local), which the server accepts only
    with trusted sources (our loopback client is one)."""
    with running_stack({"PD_EXTPROC_PREFILL_ALLOW": "", "PD_EXTPROC_TRUSTED_SOURCES": "127.0.0.0/8,::1/128"}) as stack:
        yield stack


def test_forbidden_targets_are_refused_without_a_connection(
        target_stack: Stack, default_policy_stack: Stack, counting_listener: CountingListener) -> None:
    """Metadata address, loopback, a name resolving to a forbidden address, an allowed host on a
    disallowed port: 403 each, and the listener never sees a connection."""
    target_stack.reset()
    default_policy_stack.reset()
    cases = [
        (default_policy_stack, "169.254.169.254:80"),
        (default_policy_stack, f"127.0.0.1:{counting_listener.port}"),
        (default_policy_stack, f"localhost:{counting_listener.port}"),
        (default_policy_stack, f"[::ffff:127.0.0.1]:{counting_listener.port}"),
        (target_stack, f"127.0.0.1:{counting_listener.port}"),
        (target_stack, f"localhost:{counting_listener.port}"),
        (target_stack, f"runsc:{counting_listener.port}"),
    ]
    for stack, target in cases:
        response = post(stack, CHAT, chat_body(), **{"x-prefiller-host-port": target})
        assert_error(response, 403, Code.PREFILL_TARGET_FORBIDDEN.value)
    assert counting_listener.accepted == 0, "a refused target must never be dialled"
    for stack in (target_stack, default_policy_stack):
        assert stack.prefill.requests() == [] and stack.decode.requests() == []


def test_allowed_targets_work_by_address_and_by_name(target_stack: Stack) -> None:
    """The allow-listed address and the allow-listed name both run the full P/D path."""
    target_stack.reset()
    port = target_stack.prefill.address.rsplit(":", 1)[1]
    for target in (f"127.0.0.1:{port}", f"localhost:{port}"):
        response = post(target_stack, CHAT, chat_body(max_tokens=2), **{"x-prefiller-host-port": target})
        assert response.status_code == 200, response.text
    prefill = target_stack.prefill.requests()
    assert [dict(r["headers"])["host"] for r in prefill] == [f"127.0.0.1:{port}", f"localhost:{port}"]
    assert len(target_stack.decode.requests()) == 2


def test_unresolvable_name_is_unavailable_without_a_connection(target_stack: Stack) -> None:
    target_stack.reset()
    response = post(target_stack, CHAT, chat_body(), **{"x-prefiller-host-port": "no-such-host.invalid:8000"})
    assert_error(response, 502, Code.PREFILL_UPSTREAM_UNAVAILABLE.value)  # a name that does not resolve
    assert target_stack.prefill.requests() == [] and target_stack.decode.requests() == []


# --- trusted sources ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untrusted_stack() -> Iterator[Stack]:
    """Only 10.0.0.0/8 may set the header; our test client (loopback) is not in it."""
    with running_stack({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"}) as stack:
        yield stack


def test_a_pd_request_from_an_untrusted_peer_is_refused_before_any_leg(untrusted_stack: Stack) -> None:
    """With trusted_sources, a client outside them cannot aim us anywhere: a P/D request naming a prefill
    target is refused 403 prefill_target_forbidden, as the --parts' RBAC refuses it (no silent decode-only
    answer); our server, prefill and decode are never reached."""
    untrusted_stack.reset()
    response = post(untrusted_stack, CHAT, chat_body(max_tokens=2))
    assert_error(response, 403, Code.PREFILL_TARGET_FORBIDDEN.value)
    assert untrusted_stack.prefill.requests() == [] and untrusted_stack.decode.requests() == []


def test_the_picker_header_on_another_path_from_an_untrusted_peer_is_dropped(untrusted_stack: Stack) -> None:
    """A path that is never P/D: the header is removed and the request is a plain passthrough."""
    untrusted_stack.reset()
    raw = json.dumps({"model": "emulated", "input": "hello"}).encode()
    with untrusted_stack.client() as client:
        response = client.post("/v1/embeddings", content=raw, headers={
            "content-type": "application/json", "x-prefiller-host-port": "127.0.0.1:1"})
    assert untrusted_stack.prefill.requests() == []
    decode = untrusted_stack.decode.requests()
    assert len(decode) == 1 and untrusted_stack.decode.raw_body(decode[0]["seq"]) == raw, response.text
    assert "x-prefiller-host-port" not in dict(decode[0]["headers"])


def _untrusted_picker_count(stack: Stack) -> int:
    assert stack.envoy is not None
    text = stack.envoy.admin_get("/stats/prometheus").decode()
    found = [line for line in text.splitlines() if line.startswith("envoy_pd_untrusted_picker_header_rq")]
    return int(float(found[0].rsplit(" ", 1)[1])) if found else 0


def test_a_picker_header_from_an_untrusted_peer_is_counted_and_logged(untrusted_stack: Stack) -> None:
    """Loud, not silent: a gateway missing from trusted_sources shows as this counter and as access-log
    lines on the route untrusted_picker_header (the refused P/D request); a plain request is not counted."""
    untrusted_stack.reset()
    before = _untrusted_picker_count(untrusted_stack)
    with untrusted_stack.client() as client:
        plain = client.post(CHAT, content=json.dumps(chat_body(max_tokens=2)),
                            headers={"content-type": "application/json", "x-request-id": "untrusted-plain"})
    steered = post(untrusted_stack, CHAT, chat_body(max_tokens=2), **{"x-request-id": "untrusted-steered"})
    assert (plain.status_code, steered.status_code) == (200, 403)
    envoy_logged(untrusted_stack, "untrusted-plain", "untrusted-steered")
    envoy_stats_settled(untrusted_stack)
    assert _untrusted_picker_count(untrusted_stack) == before + 1
    routes = {entry["request_id"]: entry["route"] for entry in
              (json.loads(line) for line in (untrusted_stack.log_dir / "envoy.log").read_text().splitlines()
               if line.startswith("{") and "untrusted-" in line)}
    assert routes == {"untrusted-plain": "passthrough", "untrusted-steered": "untrusted_picker_header"}
    assert untrusted_stack.prefill.requests() == []


# --- TLS to prefill ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a prefill server certificate for prefill.test and 127.0.0.1, and a client certificate."""
    directory = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    other_ca = trustme.CA()
    server = ca.issue_cert("prefill.test", "127.0.0.1")
    client = ca.issue_cert("pd-extproc.client")
    paths = {
        "ca": directory / "ca.pem", "other_ca": directory / "other-ca.pem",
        "server_cert": directory / "server.pem", "server_key": directory / "server.key",
        "client_cert": directory / "client.pem", "client_key": directory / "client.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    other_ca.cert_pem.write_to_path(str(paths["other_ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["server_cert"]))
    server.private_key_pem.write_to_path(str(paths["server_key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    return {name: str(path) for name, path in paths.items()}


def _tls_workers(pki: dict[str, str]) -> tuple[WorkerSpec, ...]:
    control_client = ssl.create_default_context(cafile=pki["ca"])
    control_client.load_cert_chain(pki["client_cert"], pki["client_key"])
    return (
        WorkerSpec("prefill", "prefill",
                   args=("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                         "--tls-client-ca", pki["ca"]),
                   control_tls=control_client),
        WorkerSpec("decode", "decode"),
    )


@pytest.mark.parametrize("variant,expected_status", [
    ("mtls", 200), ("mtls-by-name", 200), ("no-client-cert", 502), ("wrong-ca", 502), ("wrong-name", 502),
])
def test_tls_to_prefill(pki: dict[str, str], variant: str, expected_status: int) -> None:
    """TLS with a CA bundle, a client certificate (mTLS) and a server-name check; each failure is a 502
    before decode."""
    env = {"PD_EXTPROC_PREFILL_TLS": "true", "PD_EXTPROC_PREFILL_CA_FILE": pki["ca"],
           "PD_EXTPROC_PREFILL_CERT_FILE": pki["client_cert"], "PD_EXTPROC_PREFILL_KEY_FILE": pki["client_key"]}
    if variant == "no-client-cert":
        env = {k: v for k, v in env.items() if "CERT_FILE" not in k and "KEY_FILE" not in k}
    if variant == "wrong-ca":
        env["PD_EXTPROC_PREFILL_CA_FILE"] = pki["other_ca"]
    if variant == "mtls-by-name":
        env["PD_EXTPROC_PREFILL_SERVER_NAME"] = "prefill.test"
    if variant == "wrong-name":
        env["PD_EXTPROC_PREFILL_SERVER_NAME"] = "evil.test"
    with running_stack(env, workers=_tls_workers(pki)) as stack:
        response = post(stack, CHAT, chat_body(max_tokens=2))
        assert response.status_code == expected_status, response.text
        if expected_status == 200:
            assert len(stack.prefill.requests()) == 1
            assert len(stack.decode.requests()) == 1
        else:
            assert response.json()["error"]["code"] == "prefill_upstream_unavailable"
            assert stack.prefill.requests() == [], "no request may be sent over a connection that failed TLS"
            assert stack.decode.requests() == []


# --- hostile input -----------------------------------------------------------------------------------

MARKER = "zqmarkerqz"
OUR_CODES = {code.value for code in Code}


def test_caller_input_never_appears_in_error_bodies_or_log_lines(stack: Stack) -> None:
    """A unique marker in every field and header, across every refusal path, never shows up in an
    error body or in a line our server logged."""
    marked_headers = {"x-request-id": MARKER + "-id", "authorization": "Bearer " + MARKER, "x-custom": MARKER,
                      "user-agent": MARKER}
    bodies: list[bytes] = [
        json.dumps({"model": MARKER, "messages": [{"role": "user", "content": MARKER}], "n": 2,
                    MARKER: MARKER}).encode(),
        json.dumps({"model": MARKER, "messages": [{"role": MARKER, "content": MARKER}],
                    "kv_transfer_params": {MARKER: MARKER}}).encode(),
        json.dumps({"model": MARKER, "messages": MARKER}).encode(),
        json.dumps({"model": MARKER, "stream": MARKER, "messages": []}).encode(),
        ("{" + MARKER).encode(),
        json.dumps({"model": MARKER, "prompt": [MARKER, MARKER]}).encode(),
    ]
    logged_before = stack.server_log().count('"msg":"pd_request"')
    responses = []
    for body in bodies:
        path = COMPLETIONS if b'"prompt"' in body else CHAT + "?" + MARKER + "=1"
        responses.append(post(stack, path, body, **marked_headers))
    responses.append(post(stack, CHAT, chat_body(), **{**marked_headers, "x-prefiller-host-port": MARKER + ":80"}))
    responses.append(post(stack, CHAT, chat_body(), **{**marked_headers, "content-type": "text/" + MARKER}))
    # (a 400 in the engine's shape is relayed as the engine said it: test_c16; a 401 body never is)
    for behaviour in ({"status": 401, "echo_request": True}, {"raw_body": MARKER},
                      {"kv_set": {"remote_port": MARKER, MARKER: MARKER}}):
        stack.prefill.script(behaviour)
        responses.append(post(stack, CHAT, chat_body(model=MARKER, marker=MARKER), **marked_headers))
    for response in responses:
        assert response.status_code >= 400
        assert response.json()["error"]["code"] in OUR_CODES
        assert MARKER not in response.text
    assert stack.decode.requests() == []
    # Log lines are written by the server's log thread: wait for one per P/D request sent here.
    assert eventually(lambda: stack.server_log().count('"msg":"pd_request"') >= logged_before + len(responses))
    assert MARKER not in stack.server_log()


def _mutations(rng: random.Random, prefill: str) -> tuple[str, str, dict[str, str], bytes]:
    base: dict[str, Any] = rng.choice([
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
         "stream_options": {"include_usage": True}, "max_tokens": 2, "min_tokens": 1},
    ])
    path = CHAT if "messages" in base else COMPLETIONS
    body = dict(base)
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(["n", "stream", "max_tokens", "max_completion_tokens", "kv_transfer_params", "messages",
                          "prompt", "temperature", "tools", "x"])
        body[key] = rng.choice([None, 0, 1, 2, -1, 1.5, True, "s", [], {}, [1], {"a": 1}, "\u0000", 2**70])
    raw = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.15:
        cut = rng.randrange(len(raw))
        raw = raw[:cut]
    elif roll < 0.3:
        position = rng.randrange(len(raw))
        raw = raw[:position] + bytes([rng.randrange(256)]) + raw[position + 1:]
    elif roll < 0.35:
        raw = rng.randbytes(rng.randint(0, 64))
    header = rng.choice([prefill] * 6 + ["", "127.0.0.1:1", "[::1]:1", "a:b", "127.0.0.1:99999", "x" * 300,
                                         prefill + "," + prefill, "169.254.169.254:80", "localhost:0"])
    content_type = rng.choice(["application/json"] * 8 + ["text/plain", "application/json; charset=utf-8", ""])
    if rng.random() < 0.1:
        path = rng.choice(["/v1/completions?x=1", "/v1/chat/completions/", "/v1/embeddings"])
    return path, header, {"content-type": content_type}, raw


def test_fuzz_through_envoy_gives_only_documented_outcomes(stack: Stack) -> None:
    """A bounded fuzz run: 2,000 random and mutated requests through the real Envoy. Every answer is
    a success, a documented error of ours, or an engine's own answer; never our internal_error; no
    hang; the server is healthy afterwards."""
    rng = random.Random(20261130)
    counts: dict[str, int] = {}
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for _ in range(2000):
            path, header, headers, raw = _mutations(rng, stack.prefill.address)
            if header:
                headers["x-prefiller-host-port"] = header
            response = client.post(path, content=raw, headers={k: v for k, v in headers.items() if v})
            if response.status_code < 300:
                key = f"{response.status_code}"
            else:
                error = response.json()["error"]
                assert error["code"] != "internal_error"
                if error["code"] in OUR_CODES and error["code"] != Code.PREFILL_UPSTREAM_ERROR:
                    assert response.status_code == SPEC[Code(error["code"])].status, response.text
                key = f"{response.status_code} {error['code'] if error['code'] in OUR_CODES else 'engine'}"
                if error["code"] not in OUR_CODES:
                    assert response.headers.get("x-emulator-worker") or error["type"].endswith("Error"), response.text
            counts[key] = counts.get(key, 0) + 1
    with httpx.Client(timeout=10) as client:
        assert client.get(stack.metrics_url + "/healthz").status_code == 200
    stack.reset()
    assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    summary = ", ".join(f"{key}: {count}" for key, count in sorted(counts.items()))
    SUMMARY.append(f"fuzz outcomes over 2000 requests through Envoy: {summary}")
    assert sum(counts.values()) == 2000 and counts.get("200", 0) > 100
