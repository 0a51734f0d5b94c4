"""Why our filter is enabled on the whole inference route: the shape that enables it per route on the
picker's header (the sidecar's pd route) never fires in a gateway, because Envoy fixes the request's
filter chain and per-route configs before the picker adds x-prefiller-host-port (envoyproxy/gateway#9444,
envoyproxy/envoy#44739). Pinned here on Envoy 1.40: if a release changes it, this test says so."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from pd_extproc_lab.process import EnvoyProcess
from tests.gateway.bootstrap import PD_FILTER, ROUTE
from tests.gateway.stack import GatewayStack, gateway_stack
from tests.gateway.test_gateway_contract import post, served
from tests.harness import READY_TIMEOUT, envoy_bin
from tests.helpers import CHAT, chat_body, only

pytestmark = pytest.mark.dataplane


def keyed_on_the_pickers_header(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The inference route split in two, as the sidecar does it: a route that carries
    x-prefiller-host-port enables our filter, the other one does not."""
    config = copy.deepcopy(bootstrap)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    inference = next(route for route in routes if route["name"] == ROUTE)
    plain = copy.deepcopy(inference)
    plain["name"] = ROUTE + "/plain"
    del plain["typed_per_filter_config"][PD_FILTER]
    inference["match"] = {**inference["match"], "headers": [{"name": "x-prefiller-host-port", "present_match": True}]}
    routes.append(plain)
    return config


@pytest.fixture(scope="module")
def keyed() -> Iterator[GatewayStack]:
    with gateway_stack(replicas=1) as stack:
        assert stack.envoy is not None
        stack.envoy.child.stop()
        bootstrap = yaml.safe_load((stack.log_dir / "envoy.yaml").read_text())
        path = stack.log_dir / "envoy-keyed.yaml"
        path.write_text(yaml.safe_dump(keyed_on_the_pickers_header(bootstrap), sort_keys=False))
        stack.envoy = EnvoyProcess.launch(envoy_bin(), path, stack.log_dir)
        stack.url = "http://" + stack.envoy.wait_ready(READY_TIMEOUT)
        yield stack.reset()


def test_a_per_route_enable_on_the_pickers_header_never_calls_us_and_fails_open(keyed: GatewayStack) -> None:
    keyed.pick("decode-b")
    response = post(keyed, CHAT, chat_body(n=2, max_tokens=2))  # a P/D request we would refuse
    assert keyed.pd_streams() == 0, "the filter never ran"
    assert response.status_code == 200, "served by decode without our refusal"
    assert keyed.prefill.requests() == [], "and without a prefill leg"
    assert "kv_transfer_params" not in only(keyed.decode("decode-b").requests())["json"], "no handoff"
    assert served(keyed)["decode-b"] == 1
