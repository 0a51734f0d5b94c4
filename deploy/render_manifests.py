"""Renders every generated deployment file from the per-target settings files.

    make manifests                                  # write them
    .venv/bin/python -m deploy.render_manifests --check   # exit 1 and name the stale files

Targets and what each renders (a later settings file overrides an earlier one, as a Compose
``env_file`` list does):
- compose-ENGINE, for ENGINE in vllm, sglang, trtllm: envoy/pd-extproc.env + envoy/engine.ENGINE.env
  -> envoy/envoy.ENGINE.yaml (what ``pd-extproc envoy-config`` prints for those settings;
  docker-compose.yaml mounts the one of PD_ENGINE into the Envoy container)
- docs-configuration: every setting's declaration -> the table of docs/configuration.md (between its
  settings-table markers; the prose around it is hand-written)
- k8s-dashboard: deploy/grafana/pd-extproc.json -> k8s/components/monitoring/shared/grafana-dashboard.yaml
  (ConfigMap ``pd-extproc-dashboard``, labelled for Grafana's dashboard sidecar)
- k8s-gateway-guard: k8s/gateway-mode/core/pd-extproc.env -> k8s/gateway-mode/client-guard.yaml (ConfigMap
  ``pd-client-guard``: the client guard's Lua source, extproc/envoy/guard.py ``lua_source``, which the
  EnvoyExtensionPolicy's ``lua`` entry reads by ``valueRef``; the settings do not change it)
- k8s-istio-guard: k8s/gateway-mode/core/pd-extproc.env -> k8s/gateway-mode/istio/client-guard.yaml (Istio 1.28
  EnvoyFilters: ``pd-client-guard`` puts the same Lua inline before Istio's endpoint-picker filter, and
  ``pd-extproc-local-replies`` merges the ``--parts`` local-reply mappers, scoped to the name Istio gives the
  HTTPRoute rule to the InferencePool in k8s/gateway-mode/istio/gateway.yaml; docs/gateway-chains.md)

The Envoy bootstrap always comes from ``extproc.envoy.bootstrap.render_yaml``: nothing here knows a port,
a timeout or a limit of its own. Kubernetes' sidecar mode needs nothing generated: kustomize makes the ConfigMap
``pd-extproc-settings`` from k8s/base/pd-extproc.env (and an overlay's changes), and the decode pod's init
container runs ``pd-extproc envoy-config`` on it.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.envfile import read_env_file
from extproc.config import ENVOY_BOOTSTRAP_SETTINGS, ENVOY_ONLY_SETTINGS, Settings, load_settings, specs
from extproc.envoy.bootstrap import render_yaml
from extproc.envoy.guard import guard_filter, lua_source
from extproc.envoy.parts import GATEWAY_STATUS_ON_ERROR, gateway_local_reply_mappers

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "make manifests"
NAMESPACE = "llm"
ENVOY_CONFIG_KEY = "envoy.yaml"  # the file the decode pod's init container writes
SETTINGS_CONFIGMAP = "pd-extproc-settings"
COMPOSE_DIR = REPO / "envoy"
COMPOSE_SETTINGS = COMPOSE_DIR / "pd-extproc.env"
COMPOSE_ENGINES = ("vllm", "sglang", "trtllm")  # PD_ENGINE in envoy/docker-compose.yaml; vllm is the default
K8S_SETTINGS = REPO / "k8s" / "base" / "pd-extproc.env"
GATEWAY_SETTINGS = REPO / "k8s" / "gateway-mode" / "core" / "pd-extproc.env"
GATEWAY_GUARD = REPO / "k8s" / "gateway-mode" / "client-guard.yaml"
GUARD_CONFIGMAP = "pd-client-guard"
GUARD_KEY = "lua"  # the key Envoy Gateway reads from a Lua valueRef (internal/gatewayapi/envoyextensionpolicy.go:39)
ISTIO_DIR = REPO / "k8s" / "gateway-mode" / "istio"
ISTIO_GATEWAY = ISTIO_DIR / "gateway.yaml"
ISTIO_EXT_PROC = ISTIO_DIR / "envoyfilter.yaml"  # hand-written: pd-extproc's own filter
ISTIO_GUARD = ISTIO_DIR / "client-guard.yaml"
ISTIO_GATEWAY_NAME = "pd-gateway"
# Istio 1.28 (istio/istio @ b8d1df54): the endpoint picker's filter is named envoy.filters.http.ext_proc
# (pilot/pkg/xds/filters/filters.go:170-171) and is the only filter of that exact name; an EnvoyFilter
# sub-filter match is by exact name (pilot/pkg/networking/core/envoyfilter/listener_patch.go:758-766).
ISTIO_PICKER_FILTER = "envoy.filters.http.ext_proc"
ISTIO_GUARD_FILTER = "envoy.filters.http.lua/pd-client-guard"
_HCM_FILTER = "envoy.filters.network.http_connection_manager"
_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def compose_engine_settings(engine: str) -> Path:
    return COMPOSE_DIR / f"engine.{engine}.env"


def compose_envoy(engine: str) -> Path:
    return COMPOSE_DIR / f"envoy.{engine}.yaml"


COMPOSE_ENVOY = compose_envoy(COMPOSE_ENGINES[0])


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    settings_files: tuple[Path, ...]
    output: Path
    render: Callable[[Settings, Mapping[str, str], Target], str]


def target_settings(*paths: Path) -> tuple[Settings, dict[str, str]]:
    """The Settings a target's files yield (exactly what pd-extproc would load from them, in order)."""
    env: dict[str, str] = {}
    for path in paths:
        env.update(read_env_file(path))
    return load_settings(env), env


def compose_settings(engine: str) -> tuple[Settings, dict[str, str]]:
    """What the pd-extproc and Envoy containers of envoy/docker-compose.yaml read for PD_ENGINE=engine."""
    return target_settings(COMPOSE_SETTINGS, compose_engine_settings(engine))


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the Envoy bootstrap inside a ConfigMap) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def _dump_all(documents: Sequence[dict[str, Any]], header: str) -> str:
    body = yaml.dump_all(documents, Dumper=_BlockDumper, sort_keys=False, width=120, explicit_start=True)
    return header + body


def _header(settings_files: Sequence[Path]) -> str:
    sources = " + ".join(str(path.relative_to(REPO)) for path in settings_files)
    return (f"# Generated by `{REGENERATE}` from {sources} and extproc/envoy/bootstrap.py: edit those, "
            "not this file.\n")


def render_compose(settings: Settings, env: Mapping[str, str], target: Target) -> str:
    return render_yaml(settings)


def _metadata(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": "pd-extproc", "app.kubernetes.io/component": component}}


def guard_configmap() -> dict[str, Any]:
    """The client guard's Lua for Envoy Gateway (k8s/gateway-mode/envoy-gateway.yaml's ``lua`` entry)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(GUARD_CONFIGMAP, "client-guard"),
            "data": {GUARD_KEY: lua_source()}}


def render_gateway_guard(settings: Settings, env: Mapping[str, str], target: Target) -> str:
    header = (f"# Generated by `{REGENERATE}` from extproc/envoy/guard.py and guard.lua: edit those, "
              "not this file.\n# The client guard on Envoy Gateway (envoy-gateway.yaml, EnvoyExtensionPolicy "
              "`lua`; docs/gateway.md).\n")
    return _dump_all([guard_configmap()], header)


def istio_route_name(gateway_yaml: Path = ISTIO_GATEWAY) -> str:
    """The Envoy route name Istio 1.28 gives the HTTPRoute rule whose backend is an InferencePool: the rule's
    own ``name`` if it has one, else ``<namespace>.<route>.<rule index>``
    (pilot/pkg/config/kube/gateway/conversion.go:104-110); the match adds nothing, Istio sets no match name
    (:129-134; pilot/pkg/networking/core/route/route.go:488-494)."""
    found = []
    for doc in yaml.safe_load_all(gateway_yaml.read_text()):
        if not doc or doc.get("kind") != "HTTPRoute":
            continue
        meta = doc["metadata"]
        for index, rule in enumerate(doc["spec"]["rules"]):
            if any(ref.get("kind") == "InferencePool" for ref in rule.get("backendRefs", [])):
                found.append(rule.get("name") or f"{meta['namespace']}.{meta['name']}.{index}")
    if len(found) != 1:
        raise ValueError(f"{gateway_yaml}: expected one HTTPRoute rule to an InferencePool, found {found}")
    return found[0]


def istio_status_on_error(envoyfilter_yaml: Path | None = None) -> int:
    """pd-extproc's status_on_error in the hand-written EnvoyFilter: the mappers generated here recognise our
    filter's failures by it, so it must be GATEWAY_STATUS_ON_ERROR (checked when rendering)."""
    envoyfilter_yaml = envoyfilter_yaml or ISTIO_EXT_PROC  # read at call time: tests plant another file
    found = []
    for doc in yaml.safe_load_all(envoyfilter_yaml.read_text()):
        for patch in (doc or {}).get("spec", {}).get("configPatches", []):
            config = patch["patch"].get("value", {}).get("typed_config", {})
            if "grpc_service" in config:
                found.append(config.get("status_on_error", {}).get("code"))
    if len(found) != 1:
        raise ValueError(f"{envoyfilter_yaml}: expected one ext_proc filter, found {len(found)}")
    return int(found[0] or 0)


def _istio_hcm_match() -> dict[str, Any]:
    return {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": _HCM_FILTER}}}}


def istio_envoy_filters() -> list[dict[str, Any]]:
    """Two EnvoyFilters for Istio's gateway (k8s/gateway-mode/istio; envoyfilter.yaml adds pd-extproc itself).

    The guard goes right before the endpoint picker's filter: after Istio's authn/authz filters, before the
    picker and pd-extproc, so it reads the client's own body on every request of the Gateway and refuses
    steering members unconditionally (as Envoy Gateway's shape does). If the Gateway has no InferencePool,
    Istio renders no picker filter (listener_builder.go:414-419) and the guard is not inserted; the
    InferencePool route, the only way to the decode pods here, does not exist then either.

    The local-reply mappers (the gateway's, parts.gateway_local_reply_mappers) turn Envoy's own errors on the
    inference route into our JSON errors: pd-extproc down (envoyfilter.yaml's status_on_error,
    GATEWAY_STATUS_ON_ERROR) is 503 pd_extproc_unavailable, the picker down is gateway_error with
    the picker's status. Each is scoped to that route's name, so no other route's errors change.
    Istio sets no local_reply_config on a gateway's connection manager, and a MERGE appends repeated fields
    (pkg/proto/merge/merge.go:89-90,114-125), so these are the mappers, ahead of any that another
    EnvoyFilter adds later."""
    if (status := istio_status_on_error()) != GATEWAY_STATUS_ON_ERROR:
        raise ValueError(f"{ISTIO_EXT_PROC}: pd-extproc's status_on_error is {status}, the local-reply mappers "
                         f"expect {GATEWAY_STATUS_ON_ERROR} (extproc/envoy/parts.py GATEWAY_STATUS_ON_ERROR)")
    selector = {"labels": {"gateway.networking.k8s.io/gateway-name": ISTIO_GATEWAY_NAME}}
    guard = guard_filter()
    guard_match = _istio_hcm_match()
    guard_match["listener"]["filterChain"]["filter"]["subFilter"] = {"name": ISTIO_PICKER_FILTER}
    return [
        {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
         "metadata": _metadata("pd-client-guard", "client-guard"),
         "spec": {"workloadSelector": selector, "configPatches": [{
             "applyTo": "HTTP_FILTER", "match": guard_match,
             "patch": {"operation": "INSERT_BEFORE",
                       "value": {"name": ISTIO_GUARD_FILTER, "typed_config": guard["typed_config"]}}}]}},
        {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
         "metadata": _metadata("pd-extproc-local-replies", "local-replies"),
         "spec": {"workloadSelector": selector, "configPatches": [{
             "applyTo": "NETWORK_FILTER", "match": _istio_hcm_match(),
             "patch": {"operation": "MERGE", "value": {"typed_config": {
                 "@type": _HCM_TYPE,
                 "local_reply_config": {"mappers": gateway_local_reply_mappers(istio_route_name())}}}}}]}},
    ]


def render_istio_guard(settings: Settings, env: Mapping[str, str], target: Target) -> str:
    header = (f"# Generated by `{REGENERATE}` from extproc/envoy/guard.py, guard.lua, extproc/envoy/parts.py and the "
              "HTTPRoute in istio/gateway.yaml:\n# edit those, not this file. The client guard and pd-extproc's JSON "
              "errors on Istio 1.28 (docs/gateway-chains.md).\n# The mappers read pd-extproc's failures by its "
              f"status_on_error, {GATEWAY_STATUS_ON_ERROR} in envoyfilter.yaml: keep them in step.\n")
    return _dump_all(istio_envoy_filters(), header)


CONFIGURATION_DOC = REPO / "docs" / "configuration.md"
SETTINGS_TABLE_BEGIN = "<!-- settings-table: generated by `make manifests` from extproc/config.py specs() -->"
SETTINGS_TABLE_END = "<!-- /settings-table -->"


def settings_table() -> str:
    """Every setting (core and engines'), as docs/configuration.md shows them: variable, default, what."""
    defaults = Settings()
    rows = ["| variable | default | read by | what |", "|---|---|---|---|"]
    for spec in specs():
        default = spec.show(defaults.value(spec.name))
        reader = ("Envoy" if spec.name in ENVOY_ONLY_SETTINGS
                  else "server, Envoy" if spec.name in ENVOY_BOOTSTRAP_SETTINGS else "server")
        what = spec.help.replace("|", "\\|")
        rows.append(f"| `{spec.env}` | {f'`{default}`' if default else 'empty'} | {reader} | {what} |")
    return "\n".join(rows)


def render_configuration_doc(settings: Settings, env: Mapping[str, str], target: Target) -> str:
    """docs/configuration.md with its generated block replaced; the prose around it is hand-written."""
    text = target.output.read_text()
    head, _, rest = text.partition(SETTINGS_TABLE_BEGIN + "\n")
    _, found, tail = rest.partition(SETTINGS_TABLE_END)
    if not found:
        raise ValueError(f"{target.output}: the settings-table markers are missing")
    return f"{head}{SETTINGS_TABLE_BEGIN}\n{settings_table()}\n{SETTINGS_TABLE_END}{tail}"


DASHBOARD = REPO / "deploy" / "grafana" / "pd-extproc.json"
DASHBOARD_CONFIGMAP = REPO / "k8s" / "components" / "monitoring" / "shared" / "grafana-dashboard.yaml"
# kube-prometheus-stack's Grafana sidecar loads every ConfigMap with this label (its chart's default).
GRAFANA_DASHBOARD_LABEL = "grafana_dashboard"


def render_dashboard_configmap(settings: Settings, env: Mapping[str, str], target: Target) -> str:
    """The Grafana dashboard as a ConfigMap for Grafana's dashboard sidecar (the monitoring components)."""
    metadata = _metadata("pd-extproc-dashboard", "dashboard")
    metadata.pop("namespace")  # the overlay's namespace
    metadata["labels"][GRAFANA_DASHBOARD_LABEL] = "1"
    header = (f"# Generated by `{REGENERATE}` from deploy/grafana/pd-extproc.json: edit that, not this file.\n")
    return _dump_all([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                       "data": {DASHBOARD.name: DASHBOARD.read_text()}}], header)


TARGETS: tuple[Target, ...] = (
    *(Target(f"compose-{engine}", (COMPOSE_SETTINGS, compose_engine_settings(engine)), compose_envoy(engine),
             render_compose) for engine in COMPOSE_ENGINES),
    Target("k8s-gateway-guard", (GATEWAY_SETTINGS,), GATEWAY_GUARD, render_gateway_guard),
    Target("docs-configuration", (), CONFIGURATION_DOC, render_configuration_doc),
    Target("k8s-dashboard", (), DASHBOARD_CONFIGMAP, render_dashboard_configmap),
    Target("k8s-istio-guard", (GATEWAY_SETTINGS,), ISTIO_GUARD, render_istio_guard),
)


def rendered(targets: Sequence[Target] = TARGETS) -> dict[Path, str]:
    """Every generated file's expected content, keyed by its path."""
    out: dict[Path, str] = {}
    for target in targets:
        settings, env = target_settings(*target.settings_files)
        out[target.output] = target.render(settings, env, target)
    return out


def stale(expected: Mapping[Path, str]) -> list[Path]:
    return [path for path, text in expected.items() if not path.exists() or path.read_text() != text]


def diff(path: Path, text: str, context: int = 2) -> str:
    current = path.read_text().splitlines(keepends=True) if path.exists() else []
    lines = difflib.unified_diff(current, text.splitlines(keepends=True), f"{path} (committed)",
                                 f"{path} (rendered)", n=context)
    return "".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render_manifests", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    expected = rendered()
    outdated = stale(expected)
    if args.check:
        for path in outdated:
            sys.stdout.write(diff(path, expected[path]))
        if outdated:
            names = ", ".join(str(p.relative_to(REPO)) for p in outdated)
            sys.stderr.write(f"stale generated files: {names}\nregenerate with: {REGENERATE}\n")
            return 1
        return 0
    for path in outdated:
        path.write_text(expected[path])
        sys.stdout.write(f"wrote {path.relative_to(REPO)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
