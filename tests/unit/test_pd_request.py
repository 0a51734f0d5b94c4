"""One rule for "is this a P/D request" (protocol/pd_request.py): the sidecar's pd route, the gateway-mode
server and the gateway parts' guard matcher read it from the same source and agree on a table, for each
adapter's P/D paths (adapters.served)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from extproc.adapters import served
from extproc.config import load_settings
from extproc.envoy.bootstrap import render
from extproc.envoy.gateway import is_pd_request
from extproc.envoy.parts import gateway_guard_filter
from extproc.protocol.openai_request import paths_of
from extproc.protocol.pd_request import PD_METHOD, full_path_regex, is_pd, path_regex
from extproc.protocol.request_head import RequestHead

_CASES = [  # method, :path, tagged -> P/D
    ("POST", "/v1/chat/completions", True, True),
    ("POST", "/v1/completions", True, True),
    ("POST", "/v1/completions?stream=1", True, True),
    ("POST", "/v1/chat/completions?", True, True),
    ("POST", "/v1/completions", False, False),
    ("GET", "/v1/completions", True, False),
    ("post", "/v1/completions", True, False),
    ("POST", "/v1/embeddings", True, False),
    ("POST", "/v1/completions/", True, False),
    ("POST", "/v1/chat/completionsX", True, False),
    ("POST", "/v1/completions#x", True, False),
    ("POST", "//v1/completions", True, False),
    ("POST", "/V1/completions", True, False),
]


# Served P/D by one adapter and not the other: the three readers follow the adapter's paths.
_BY_ADAPTER = [  # method, :path, tagged -> the adapters that serve it P/D
    ("POST", "/v1/responses", True, {"vllm_nixl"}),
    ("POST", "/v1/messages?beta=true", True, {"vllm_nixl"}),
    ("POST", "/inference/v1/generate", True, {"vllm_nixl"}),
    ("POST", "/generate", True, {"sglang"}),
    ("POST", "/generate", False, set()),
]
_ADAPTERS = ("vllm_nixl", "sglang")


def _route_takes(adapter: str, method: str, path: str, tagged: bool) -> bool:
    """The bootstrap's pd route match, read the way Envoy applies it: a whole match on the path without
    its query, the exact method, the header present."""
    route = next(r for r in _vhost_routes(adapter) if r["name"] == "pd")
    headers = {h["name"]: h for h in route["match"]["headers"]}
    return (re.fullmatch(route["match"]["safe_regex"]["regex"], path.split("?", 1)[0]) is not None
            and method == headers[":method"]["string_match"]["exact"] and tagged)


def _vhost_routes(adapter: str) -> list[dict[str, Any]]:
    listener = render(load_settings({"PD_EXTPROC_ADAPTER": adapter}))["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]
    return list(hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"])


def _guard_skips(adapter: str, method: str, path: str, tagged: bool) -> bool:
    """The gateway guard's skip matcher, read the way Envoy applies it: every predicate's RE2 regex matched
    whole against its header (":path" with its query); an absent header matches nothing."""
    config = gateway_guard_filter(adapter)["typed_config"]
    predicates = config["xds_matcher"]["matcher_list"]["matchers"][0]["predicate"]["and_matcher"]["predicate"]
    values = {":method": method, ":path": path, **({"x-prefiller-host-port": "10.0.0.1:8000"} if tagged else {})}
    for predicate in predicates:
        single = predicate["single_predicate"]
        value = values.get(single["input"]["typed_config"]["header_name"])
        if value is None or re.fullmatch(single["value_match"]["safe_regex"]["regex"], value) is None:
            return False
    return True


def _all_cases() -> list[tuple[str, str, str, bool, bool]]:
    cases = [(adapter, *case) for adapter in _ADAPTERS for case in _CASES]
    cases += [(adapter, method, path, tagged, adapter in pd_for)
              for adapter in _ADAPTERS for method, path, tagged, pd_for in _BY_ADAPTER]
    return cases


@pytest.mark.parametrize("adapter,method,path,tagged,pd", _all_cases(),
                         ids=[f"{a} {m} {p} {t}" for a, m, p, t, _ in _all_cases()])
def test_the_route_the_server_and_the_guard_matcher_agree(adapter: str, method: str, path: str, tagged: bool,
                                                          pd: bool) -> None:
    tag = (("x-prefiller-host-port", "10.0.0.1:8000"),) if tagged else ()
    head = RequestHead(path=path, headers=((":method", method), (":path", path), *tag))
    paths = paths_of(served(adapter))
    assert is_pd(method, path, tagged, paths) is pd
    assert is_pd_request(head, paths) is pd, "the gateway-mode server"
    assert _route_takes(adapter, method, path, tagged) is pd, "the sidecar's pd route"
    assert _guard_skips(adapter, method, path, tagged) is pd, "the gateway guard is skipped exactly for P/D"


@pytest.mark.parametrize("adapter", _ADAPTERS)
def test_every_reader_takes_the_rule_from_one_source(adapter: str) -> None:
    route = next(r for r in _vhost_routes(adapter) if r["name"] == "pd")
    assert route["match"]["safe_regex"]["regex"] == path_regex(served(adapter))
    assert {"name": ":method", "string_match": {"exact": PD_METHOD}} in route["match"]["headers"]
    predicates = gateway_guard_filter(adapter)["typed_config"]["xds_matcher"]["matcher_list"]["matchers"][0]
    regexes = [p["single_predicate"]["value_match"]["safe_regex"]["regex"]
               for p in predicates["predicate"]["and_matcher"]["predicate"]]
    assert regexes == [re.escape(PD_METHOD), full_path_regex(served(adapter)), ".+"]
