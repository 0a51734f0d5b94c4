"""What our Envoy bootstrap costs a passthrough request, filter by filter (a side experiment).

The main run compares our bootstrap with "Envoy alone" (router filter only, no access log). This
starts one cheap decode worker (bench/cheap_worker.py, so Envoy's own cost is what shows) and one Envoy
per variant, each our rendered bootstrap with parts changed, and measures non-streaming passthrough
requests through each, interleaved over rounds:

    ours                 the rendered bootstrap as shipped (ext_proc disabled by default, enabled by route pd;
                         the Lua client guard on route passthrough, extproc/envoy/guard.py)
    no-guard             PD_EXTPROC_TRUST_CLIENT_STEERING=true: the bootstrap without the client guard
    lua-empty            the guard's Lua filter with an empty envoy_on_request (the filter's own cost)
    lua-body             ... that only buffers the body (handle:body())
    json-to-metadata     the guard as json_to_metadata + RBAC (shadow rules) instead of Lua: the rejected
                         candidate (docs/decisions.md), measured for its cost only
    per-route-disabled   ext_proc in the chain for every request, disabled on route passthrough by
                         ExtProcPerRoute (what we shipped before issue 17)
    no-access-log        without the JSON access log
    no-body-limit        without the body_size_limit filter
    router-only          without body_size_limit and ext_proc (the route's per-filter config removed)
    router-only-no-log   router only and no access log
    envoy-alone          bench/envoy_plain.py, the main run's "Envoy alone"

    .venv/bin/python -m bench.filters [--rounds 4] [--seconds 3] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench import envoy_plain, procs, wrk
from bench.systems import default_tools
from bench.workers import CheapWorker
from bench.workload import write_bodies
from extproc.config import load_settings
from extproc.envoy.bootstrap import render_yaml
from pd_extproc_lab import process

Config = dict[str, Any]


def _hcm(config: Config) -> Config:
    manager: Config = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def _without_access_log(config: Config) -> None:
    del _hcm(config)["access_log"]


def _without_body_limit(config: Config) -> None:
    _hcm(config)["http_filters"] = [f for f in _hcm(config)["http_filters"]
                                    if f["name"] != "envoy.filters.http.body_size_limit"]


def _per_route_disabled(config: Config) -> None:
    for http_filter in _hcm(config)["http_filters"]:
        http_filter.pop("disabled", None)
    for route in _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]:
        route.pop("typed_per_filter_config", None)
        if route["name"] == "passthrough":
            route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True}}


def _router_only(config: Config) -> None:
    _hcm(config)["http_filters"] = [f for f in _hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.router"]
    for route in _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]:
        route.pop("typed_per_filter_config", None)


_JSON_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
_RBAC = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"


def _json_to_metadata_guard(config: Config) -> None:
    """Swap the Lua guard for json_to_metadata (one rule per steering member) and an RBAC deny."""
    from extproc.envoy.guard import LUA_FILTER
    from extproc.protocol.steering import STEERING_FIELDS

    rules = [{"selectors": [{"key": key} for key in field.path],
              "on_present": {"metadata_namespace": "pd_guard", "key": field.name, "value": {"bool_value": True}}}
             for field in STEERING_FIELDS]
    policies = {f"guard_{field.name}": {
        "permissions": [{"metadata": {"filter": "pd_guard", "path": [{"key": field.name}],
                                      "value": {"present_match": True}}}],
        "principals": [{"any": True}]} for field in STEERING_FIELDS}
    filters = []
    for http_filter in _hcm(config)["http_filters"]:
        if http_filter["name"] == LUA_FILTER:
            filters.append({"name": "envoy.filters.http.json_to_metadata", "typed_config": {
                "@type": _JSON_TO_METADATA, "request_rules": {"rules": rules, "allow_empty_content_type": True}}})
            # shadow_rules: evaluated, never enforced. At Envoy 1.40 an on_present with a constant value is
            # applied to every body that parses (no presence check), so enforced rules would refuse all.
            filters.append({"name": "envoy.filters.http.rbac", "typed_config": {
                "@type": _RBAC, "shadow_rules": {"action": "DENY", "policies": policies}}})
        else:
            filters.append(http_filter)
    _hcm(config)["http_filters"] = filters
    for route in _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]:
        per_filter = route.get("typed_per_filter_config", {})
        if per_filter.pop(LUA_FILTER, None) is not None:
            for name in ("envoy.filters.http.json_to_metadata", "envoy.filters.http.rbac"):
                per_filter[name] = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                    "disabled": True}


def _lua(source: str) -> Callable[[Config], None]:
    """Swap the guard's Lua source: what the Lua filter costs by itself, and with the body buffered."""
    def edit(config: Config) -> None:
        from extproc.envoy.guard import LUA_FILTER

        for http_filter in _hcm(config)["http_filters"]:
            if http_filter["name"] == LUA_FILTER:
                http_filter["typed_config"]["default_source_code"] = {"inline_string": source}
    return edit


VARIANTS: dict[str, list[Callable[[Config], None]]] = {
    "ours": [],
    "lua-empty": [_lua("function envoy_on_request(handle) end")],
    "lua-body": [_lua("function envoy_on_request(handle) local body = handle:body() end")],
    "no-guard": [],  # rendered with PD_EXTPROC_TRUST_CLIENT_STEERING=true
    "json-to-metadata": [_json_to_metadata_guard],
    "per-route-disabled": [_per_route_disabled],
    "no-access-log": [_without_access_log],
    "no-body-limit": [_without_body_limit],
    "router-only": [_router_only],
    "router-only-no-log": [_router_only, _without_access_log],
    "envoy-alone": [],  # replaced whole by envoy_plain's bootstrap
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.filters", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="measure these variants only")
    args = parser.parse_args(argv)
    tools = default_tools()
    log_dir = Path(tempfile.mkdtemp(prefix="pd-bench-filters-"))
    decode = CheapWorker("vllm", "decode", log_dir, "cheap-decode")
    envoys: list[process.EnvoyProcess] = []
    try:
        decode.start()
        decode.wait_ready(30)
        settings = load_settings({"PD_EXTPROC_DECODE": decode.address, "PD_EXTPROC_LISTEN": "127.0.0.1:0",
                                  "PD_EXTPROC_ENVOY_ADMIN": "127.0.0.1:0"}, {})
        base = yaml.safe_load(render_yaml(settings))
        unguarded = yaml.safe_load(render_yaml(dataclasses.replace(settings, trust_client_steering=True)))
        urls: dict[str, str] = {}
        chosen = {name: edits for name, edits in VARIANTS.items() if not args.only or name in args.only}
        for name, edits in chosen.items():
            config = copy.deepcopy(unguarded if name == "no-guard" else base)
            for edit in edits:
                edit(config)
            if name == "envoy-alone":
                config = envoy_plain.render(int(decode.address.rsplit(":", 1)[1]))
            workdir = log_dir / name
            workdir.mkdir()
            (workdir / "envoy.yaml").write_text(yaml.safe_dump(config))
            envoy = process.EnvoyProcess.launch(tools.envoy, workdir / "envoy.yaml", workdir)
            envoys.append(envoy)
            urls[name] = f"http://{envoy.wait_ready(30)}/v1/chat/completions"
        script = log_dir / "non-stream.lua"
        script.write_text(wrk.lua_script(write_bodies(log_dir)["non-stream"], {}))
        results: dict[tuple[str, int], list[wrk.WrkResult]] = {}
        cpu: dict[tuple[str, int], list[float]] = {}
        pids = {name: envoy.child.process.pid for name, envoy in zip(chosen, envoys, strict=True)
                if envoy.child.process is not None}
        names = list(chosen)
        for round_number in range(args.rounds):
            rotated = names[round_number % len(names):] + names[:round_number % len(names)]
            for concurrency in args.concurrency:
                for name in rotated:
                    before = procs.cpu_seconds(pids[name])
                    result = wrk.run(urls[name], script, concurrency, args.seconds)
                    results.setdefault((name, concurrency), []).append(result)
                    cpu.setdefault((name, concurrency), []).append(
                        (procs.cpu_seconds(pids[name]) - before) / max(result.requests, 1) * 1e6)
        print("| variant | " + " | ".join(f"c={c} req/s | c={c} p50 µs | c={c} Envoy CPU µs/req"
                                        for c in args.concurrency) + " |")
        print("|---|" + "---|---|---|" * len(args.concurrency))
        for name in names:
            cells = []
            for concurrency in args.concurrency:
                runs = results[(name, concurrency)]
                cells.append(f"{statistics.median(r.rps for r in runs):.0f}")
                cells.append(f"{statistics.median(r.p50_us for r in runs):.0f}")
                cells.append(f"{statistics.median(cpu[(name, concurrency)]):.0f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print(f"\n(medians over {args.rounds} interleaved rounds of {args.seconds} s; logs in {log_dir})")
    finally:
        for envoy in envoys:
            envoy.child.stop()
        decode.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
