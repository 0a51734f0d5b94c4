"""Which client headers the prefill leg carries."""

from __future__ import annotations

from extproc.headers import prefill_headers


def test_prefill_headers_keep_end_to_end_and_drop_hop_by_hop() -> None:
    client = [(":method", "POST"), (":path", "/v1/completions"), ("host", "gw"), ("content-length", "10"),
              ("Authorization", "Bearer k"), ("connection", "keep-alive, X-Secret-Hop"), ("x-secret-hop", "1"),
              ("keep-alive", "timeout=5"), ("te", "trailers"), ("transfer-encoding", "chunked"),
              ("upgrade", "h2c"), ("proxy-authorization", "Basic x"), ("x-envoy-expected-rq-timeout-ms", "1"),
              ("x-prefiller-host-port", "10.0.0.1:8000"), ("traceparent", "00-a-b-01"), ("x-request-id", "r"),
              ("accept-encoding", "gzip"), ("content-type", "application/json; charset=utf-8"),
              ("x-multi", "1"), ("x-multi", "2")]
    assert prefill_headers(client) == [
        ("authorization", "Bearer k"), ("traceparent", "00-a-b-01"), ("x-request-id", "r"), ("x-multi", "1"),
        ("x-multi", "2"), ("content-type", "application/json"), ("accept-encoding", "identity")]
