"""Which client headers the prefill leg carries."""

from __future__ import annotations

from extproc.protocol.headers import prefill_headers


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


def test_the_pickers_routing_headers_and_the_decode_rank_stay_off_the_prefill_leg() -> None:
    """x-encoder-hosts-ports and x-kv-cache-source-host-port name workers for a router; the data-parallel
    rank the gateway chose is the decode engine's (the prefill rank is its port)."""
    client = [("x-encoder-hosts-ports", "10.0.0.2:8000,10.0.0.3:8000"),
              ("x-kv-cache-source-host-port", "10.0.0.4:8000"), ("x-data-parallel-rank", "3"),
              ("X-Override-Routed-DP-Rank", "1"),
              ("x-trtllm-disagg-auth", "sha256=00"), ("x-keep", "1")]
    assert prefill_headers(client, frozenset({"x-trtllm-disagg-auth"})) == [
        ("x-keep", "1"), ("content-type", "application/json"), ("accept-encoding", "identity")]
