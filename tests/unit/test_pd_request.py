"""One rule for "is this a P/D request" (envoy/pd_request.py): the sidecar's pd route, the gateway-mode
server and the gateway parts' guard matcher read it from the same source and agree on a table."""

from __future__ import annotations

import re
from typing import Any

import pytest

from extproc.config import load_settings
from extproc.envoy.bootstrap import render
from extproc.envoy.gateway import is_pd_request
from extproc.envoy.messages import RequestHead
from extproc.envoy.parts import gateway_guard_filter
from extproc.envoy.pd_request import PD_FULL_PATH_REGEX, PD_METHOD, PD_PATH_REGEX, is_pd

_CASES = [  # method, :path, tagged -> P/D
    ("POST", "/v1/chat/completions", True, True),
    ("POST", "/v1/completions", True, True),
    ("POST", "/v1/completions?stream=1", True, True),
    ("POST", "/v1/chat/completions?", True, True),
    ("POST", "/v1/completions", False, False),
    ("GET", "/v1/completions", True, False),
    ("post", "/v1/completions", True, False),
    ("POST", "/v1/responses", True, False),
    ("POST", "/v1/completions/", True, False),
    ("POST", "/v1/chat/completionsX", True, False),
    ("POST", "/v1/completions#x", True, False),
    ("POST", "//v1/completions", True, False),
    ("POST", "/V1/completions", True, False),
]


def _route_takes(method: str, path: str, tagged: bool) -> bool:
    """The bootstrap's pd route match, read the way Envoy applies it: a whole match on the path without
    its query, the exact method, the header present."""
    route = next(r for r in _vhost_routes() if r["name"] == "pd")
    headers = {h["name"]: h for h in route["match"]["headers"]}
    return (re.fullmatch(route["match"]["safe_regex"]["regex"], path.split("?", 1)[0]) is not None
            and method == headers[":method"]["string_match"]["exact"] and tagged)


def _vhost_routes() -> list[dict[str, Any]]:
    hcm = render(load_settings({}))["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return list(hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"])


def _guard_skips(method: str, path: str, tagged: bool) -> bool:
    """The gateway guard's skip matcher, read the way Envoy applies it: every predicate's RE2 regex matched
    whole against its header (":path" with its query); an absent header matches nothing."""
    config = gateway_guard_filter()["typed_config"]
    predicates = config["xds_matcher"]["matcher_list"]["matchers"][0]["predicate"]["and_matcher"]["predicate"]
    values = {":method": method, ":path": path, **({"x-prefiller-host-port": "10.0.0.1:8000"} if tagged else {})}
    for predicate in predicates:
        single = predicate["single_predicate"]
        value = values.get(single["input"]["typed_config"]["header_name"])
        if value is None or re.fullmatch(single["value_match"]["safe_regex"]["regex"], value) is None:
            return False
    return True


@pytest.mark.parametrize("method,path,tagged,pd", _CASES, ids=[f"{m} {p} {t}" for m, p, t, _ in _CASES])
def test_the_route_the_server_and_the_guard_matcher_agree(method: str, path: str, tagged: bool, pd: bool) -> None:
    tag = (("x-prefiller-host-port", "10.0.0.1:8000"),) if tagged else ()
    head = RequestHead(path=path, headers=((":method", method), (":path", path), *tag))
    assert is_pd(method, path, tagged) is pd
    assert is_pd_request(head) is pd, "the gateway-mode server"
    assert _route_takes(method, path, tagged) is pd, "the sidecar's pd route"
    assert _guard_skips(method, path, tagged) is pd, "the gateway guard is skipped exactly for P/D"


def test_every_reader_takes_the_rule_from_one_source() -> None:
    route = next(r for r in _vhost_routes() if r["name"] == "pd")
    assert route["match"]["safe_regex"]["regex"] == PD_PATH_REGEX
    assert {"name": ":method", "string_match": {"exact": PD_METHOD}} in route["match"]["headers"]
    predicates = gateway_guard_filter()["typed_config"]["xds_matcher"]["matcher_list"]["matchers"][0]["predicate"]
    regexes = [p["single_predicate"]["value_match"]["safe_regex"]["regex"]
               for p in predicates["and_matcher"]["predicate"]]
    assert regexes == [re.escape(PD_METHOD), PD_FULL_PATH_REGEX, ".+"]
