"""Startup warnings where an address setting cannot match the pod's own network.

The Kubernetes manifests give pd-extproc its pod's address (``POD_IP``, from the downward API). Prefill pods and
the gateway's pods live in the same pod network, so a ``PD_EXTPROC_PREFILL_ALLOW`` or
``PD_EXTPROC_TRUSTED_SOURCES`` that does not contain that address was most likely left at the shipped
``10.0.0.0/8`` on a cluster whose pods live elsewhere (192.168.0.0/16, 172.16.0.0/12, 100.64.0.0/10): every P/D
request would then be refused (403 prefill_target_forbidden). The check is a
warning, not a refusal: a deliberately narrower range (the prefill pods' own subnet) is legitimate.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from extproc.config import Settings

POD_IP_VARIABLE = "POD_IP"


def _contains(networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
              address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return any(address.version == network.version and address in network for network in networks)


def network_warnings(settings: Settings, pod_ip: str | None) -> list[str]:
    """What to warn about at startup, given the pod's own address (none outside Kubernetes: no warning)."""
    if not pod_ip:
        return []
    try:
        address = ipaddress.ip_address(pod_ip.strip())
    except ValueError:
        return [f"{POD_IP_VARIABLE}={pod_ip!r} is not an IP address; the pod-network checks are skipped"]
    warnings = []
    rules = settings.prefill_allow
    networks = [rule.network for rule in rules if rule.network is not None]
    if rules and all(rule.name is None for rule in rules) and not _contains(networks, address):
        warnings.append(
            f"PD_EXTPROC_PREFILL_ALLOW ({', '.join(str(n) for n in networks)}) does not contain this pod's address "
            f"{address}: prefill pods in the same pod network would get 403 prefill_target_forbidden; set your pod "
            "CIDR (docs/configuration.md)")
    if settings.mode == "sidecar" and settings.trusted_sources \
            and not _contains(settings.trusted_sources, address):
        warnings.append(
            f"PD_EXTPROC_TRUSTED_SOURCES ({', '.join(str(n) for n in settings.trusted_sources)}) does not contain "
            f"this pod's address {address}: a gateway in the pod network would be untrusted and its P/D requests "
            "refused 403 prefill_target_forbidden (counted as envoy_pd_untrusted_picker_header_rq); set your pod "
            "CIDR or the gateway's range")
    return warnings
