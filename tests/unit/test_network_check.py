"""extproc/network_check.py: a pod-network address setting that cannot match this pod is warned about."""

from __future__ import annotations

import pytest

from extproc.config import load_settings
from extproc.network_check import network_warnings

SHIPPED = {"PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8:8000", "PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"}


def test_the_shipped_ranges_on_a_pod_outside_them_warn_about_both() -> None:
    warnings = network_warnings(load_settings(SHIPPED, {}), "192.168.7.12")
    assert len(warnings) == 2
    assert warnings[0].startswith("PD_EXTPROC_PREFILL_ALLOW (10.0.0.0/8)") and "192.168.7.12" in warnings[0]
    assert warnings[1].startswith("PD_EXTPROC_TRUSTED_SOURCES (10.0.0.0/8)")


@pytest.mark.parametrize("env,pod_ip", [
    (SHIPPED, "10.42.3.4"),  # inside both
    (SHIPPED, None),  # not in Kubernetes: nothing to compare with
    ({"PD_EXTPROC_PREFILL_ALLOW": "prefill.llm.svc.cluster.local:8000"}, "192.168.7.12"),  # names: unknowable
    ({}, "192.168.7.12"),  # nothing set: the default policy and no trusted sources
    ({**SHIPPED, "PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_PREFILL_ALLOW": "192.168.0.0/16:8000"},
     "192.168.7.12"),  # gateway mode has no trusted sources of its own
], ids=["inside", "no-pod-ip", "name-rules", "unset", "gateway-mode"])
def test_no_warning_where_nothing_contradicts(env: dict[str, str], pod_ip: str | None) -> None:
    assert network_warnings(load_settings(env, {}), pod_ip) == []


def test_a_pod_ip_that_is_not_an_address_is_said_once() -> None:
    (warning,) = network_warnings(load_settings(SHIPPED, {}), "not-an-ip")
    assert "not an IP address" in warning
