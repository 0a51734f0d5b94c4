"""k8s/components/prefill-and-picker/epp.yaml, as every overlay renders it, against llm-d-router v0.10.0
(commit 71f4f0999f95b96c49a9d0c4afbd18dfdb943c26).

The table below was read in that release's source (paths beside each entry): the plugin types the
runner registers, the parameters each decodes (strictly: the loader refuses unknown keys), which of
those name other plugins, and what the role filters keep. The checks: every reference resolves, the
disaggregation handler has its prefill decider (without one every request is decode-only and our
server is never called), and the profiles pick prefill pods for "prefill" and decode pods for
"decode", applied to the labels of k8s/components/prefill-and-picker/prefill.yaml and k8s/base/decode.yaml.

What this cannot prove: that the picker binary accepts the file and behaves as its source reads. The
picker is a Go program that cannot be built or run here, so this is a check of the file against our
reading of the source, not a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import Manifests

pytestmark = pytest.mark.deploy

RELEASE = "v0.10.0"
IMAGE = f"ghcr.io/llm-d/llm-d-router-endpoint-picker:{RELEASE}"  # .github/workflows/ci-release.yaml
# apix/config/v1alpha1/zz_generated.register.go; the loader also takes inference.networking.x-k8s.io/v1alpha1
# but logs it as deprecated (pkg/epp/config/loader/configloader.go, LoadRawConfig).
API_VERSION = "llm-d.ai/v1alpha1"
KIND = "EndpointPickerConfig"
# apix/config/v1alpha1/endpointpickerconfig_types.go, type EndpointPickerConfig.
TOP_LEVEL = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
             "requestHandler", "saturationDetector", "parser"}
ROLE_LABEL = "llm-d.ai/role"  # scheduling/filter/bylabel/roles.go, RoleLabel


@dataclass(frozen=True)
class PluginType:
    kind: str  # profile-handler | decider | filter | scorer | picker
    source: str
    parameters: frozenset[str] = frozenset()  # top-level parameter keys the factory decodes
    references: Callable[[dict[str, Any]], list[str]] = field(default=lambda params: [])  # pluginRef values
    keeps: Callable[[dict[str, str]], bool] | None = None  # filters: does it keep a pod with these labels


def _role_filter(values: set[str], keeps_unlabelled: bool) -> Callable[[dict[str, str]], bool]:
    """bylabel.NewByLabel(name, RoleLabel, allowsNoLabel, values...)."""
    def keeps(labels: dict[str, str]) -> bool:
        return labels[ROLE_LABEL] in values if ROLE_LABEL in labels else keeps_unlabelled
    return keeps


def _disagg_references(params: dict[str, Any]) -> list[str]:
    return [ref for ref in (params.get("deciders") or {}).values() if ref]


DISAGG = "pkg/epp/framework/plugins/scheduling/profilehandler/disagg/"
PLUGINS: dict[str, PluginType] = {
    # DisaggProfileHandlerParameters (stageOrder, profiles{decode,prefill,encode}, deciders{prefill,encode});
    # deciders.* carry pluginRef tags.
    "disagg-profile-handler": PluginType("profile-handler", DISAGG + "disagg_profile_handler.go",
                                         frozenset({"stageOrder", "profiles", "deciders"}), _disagg_references),
    "single-profile-handler": PluginType("profile-handler", "pkg/epp/framework/plugins/scheduling/profilehandler/"
                                         "single/single_profile_handler.go"),
    "always-disagg-pd-decider": PluginType("decider", DISAGG + "always_disagg_pd_decider.go"),
    "prefix-based-pd-decider": PluginType("decider", DISAGG + "prefix_based_pd_decider.go",
                                          frozenset({"nonCachedTokens", "promptTokens"})),
    # roles.go: NewDecodeRole keeps decode, prefill-decode, both, encode-prefill-decode and unlabelled pods;
    # NewPrefillRole keeps prefill, encode-prefill, prefill-decode, both, encode-prefill-decode only.
    "decode-filter": PluginType("filter", "pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go",
                                keeps=_role_filter({"decode", "prefill-decode", "both", "encode-prefill-decode"},
                                                   True)),
    "prefill-filter": PluginType("filter", "pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go",
                                 keeps=_role_filter({"prefill", "encode-prefill", "prefill-decode", "both",
                                                     "encode-prefill-decode"}, False)),
    "queue-scorer": PluginType("scorer", "pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go"),
    "kv-cache-utilization-scorer": PluginType("scorer", "pkg/epp/framework/plugins/scheduling/scorer/"
                                              "kvcacheutilization/kvcache_utilization.go"),
    "prefix-cache-scorer": PluginType("scorer", "pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go",
                                      frozenset({"prefixMatchInfoProducerName", "matchLengthWeight",
                                                 "matchLengthScaleTokens"})),
    "max-score-picker": PluginType("picker", "pkg/epp/framework/plugins/scheduling/picker/maxscore/picker.go",
                                   frozenset({"maxNumOfEndpoints"})),
    # The data layer (dataLayer.sources), which the loader adds with defaults unless a source of this type is
    # configured (pkg/epp/config/loader/defaults.go, ensureDataLayer).
    "metrics-data-source": PluginType("data-source", "pkg/epp/framework/plugins/datalayer/source/metrics/"
                                      "datasource.go", frozenset({"scheme", "path", "port", "insecureSkipVerify",
                                                                  "caCertPath", "clientCertPath", "clientKeyPath",
                                                                  "interval"})),
    "core-metrics-extractor": PluginType("extractor", "pkg/epp/framework/plugins/datalayer/extractor/metrics/"
                                         "factories.go",
                                         frozenset({"engineLabelKey", "defaultEngine", "engineConfigs"})),
}
# pkg/epp/server/options.go, AddFlags: the flags the shipped Deployment passes must exist.
FLAGS = {"--pool-name", "--pool-namespace", "--pool-group", "--config-file", "--config-text", "--grpc-port",
         "--grpc-health-port", "--metrics-port", "--secure-serving", "--metrics-endpoint-auth", "--tracing",
         "--cert-path", "--ha-enable-leader-election", "--allow-experimental-plugins", "--v", "--zap-encoder"}


def epp_config(manifests: Manifests) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(manifests.get("ConfigMap", "pd-epp-config")["data"]["epp-config.yaml"])
    return config


def check(config: dict[str, Any], prefill_labels: dict[str, str], decode_labels: dict[str, str]) -> list[str]:
    """Every way ``config`` departs from what the pinned release reads (an empty list: none)."""
    problems: list[str] = []
    if config.get("apiVersion") != API_VERSION or config.get("kind") != KIND:
        problems.append(f"apiVersion/kind must be {API_VERSION}/{KIND}")
    problems += [f"unknown top-level key {key}" for key in sorted(set(config) - TOP_LEVEL)]
    plugins: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in config.get("plugins") or []:
        name = spec.get("name") or spec.get("type")  # applyStaticDefaults: the name defaults to the type
        if spec.get("type") not in PLUGINS:
            problems.append(f"plugin type {spec.get('type')!r} is not registered by {RELEASE}")
            continue
        if name in plugins:
            problems.append(f"plugin name {name!r} is used twice")
        params = spec.get("parameters") or {}
        unknown = set(params) - PLUGINS[spec["type"]].parameters
        problems += [f"{name}: unknown parameter {key!r} (strict decoding refuses it)" for key in sorted(unknown)]
        plugins[name] = (spec["type"], params)
    for name, (kind, params) in plugins.items():
        problems += [f"{name} refers to {ref!r}, which is not a plugin" for ref in PLUGINS[kind].references(params)
                     if ref not in plugins]
    handlers = [name for name, (kind, _) in plugins.items() if PLUGINS[kind].kind == "profile-handler"]
    if len(handlers) != 1:
        return [*problems, f"exactly one profile handler is needed, found {handlers}"]
    kind, params = plugins[handlers[0]]
    if kind != "disagg-profile-handler":
        return [*problems, f"the profile handler is {kind}: requests are never disaggregated"]
    decider = (params.get("deciders") or {}).get("prefill")
    if not decider:
        problems.append("disagg-profile-handler has no deciders.prefill: every request is decode-only")
    elif decider in plugins and PLUGINS[plugins[decider][0]].kind != "decider":
        problems.append(f"deciders.prefill names {decider!r}, which is not a decider")
    profiles = {p.get("name"): p for p in config.get("schedulingProfiles") or []}
    names = params.get("profiles") or {}
    for role, labels, other in (("prefill", prefill_labels, decode_labels), ("decode", decode_labels, prefill_labels)):
        profile = profiles.get(names.get(role, role))  # DisaggProfileHandlerParameters defaults: "decode", "prefill"
        if profile is None:
            problems.append(f"no scheduling profile for the {role} stage")
            continue
        refs = [entry.get("pluginRef") for entry in profile.get("plugins") or []]
        problems += [f"profile {profile['name']} refers to {ref!r}, which is not a plugin" for ref in refs
                     if ref not in plugins]
        filters = [PLUGINS[plugins[ref][0]] for ref in refs if ref in plugins
                   and PLUGINS[plugins[ref][0]].kind == "filter"]
        if not all(f.keeps is not None and f.keeps(labels) for f in filters):
            problems.append(f"profile {profile['name']} filters out the {role} pods")
        if not any(f.keeps is not None and not f.keeps(other) for f in filters):
            problems.append(f"profile {profile['name']} does not filter out the other role's pods")
    return problems


def pod_labels(manifests: Manifests, deployment: str) -> dict[str, str]:
    labels: dict[str, str] = manifests.get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_the_shipped_epp_config_is_what_the_pinned_release_reads(manifests: Manifests) -> None:
    problems = check(epp_config(manifests), pod_labels(manifests, "pd-prefill"), pod_labels(manifests, "pd-decode"))
    assert problems == []


BEFORE = {  # epp.yaml before this check existed: the decider declared, never wired
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
    "plugins": [{"type": "always-disagg-pd-decider"}, {"type": "disagg-profile-handler"},
                {"type": "prefill-filter"}, {"type": "decode-filter"}, {"type": "queue-scorer"},
                {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "queue-scorer"},
                                        {"pluginRef": "max-score-picker"}]},
        {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "queue-scorer"},
                                       {"pluginRef": "max-score-picker"}]}],
}
PREFILL = {"app.kubernetes.io/name": "vllm", ROLE_LABEL: "prefill"}
DECODE = {"app.kubernetes.io/name": "vllm", ROLE_LABEL: "decode"}


def test_the_check_fails_on_the_old_file_for_the_missing_decider() -> None:
    problems = check(BEFORE, PREFILL, DECODE)
    assert "disagg-profile-handler has no deciders.prefill: every request is decode-only" in problems
    assert f"apiVersion/kind must be {API_VERSION}/{KIND}" in problems


@pytest.mark.parametrize("edit,problem", [
    (lambda c: c["plugins"][1].update(parameters={"deciders": {"prefill": "no-such-decider"}}),
     "disagg-profile-handler refers to 'no-such-decider', which is not a plugin"),
    (lambda c: c["plugins"][1].update(parameters={"deciders": {"prefill": "queue-scorer"}}),
     "deciders.prefill names 'queue-scorer', which is not a decider"),
    (lambda c: c["plugins"][1].update(parameters={"deciders": {"prefill": "always-disagg-pd-decider"},
                                                  "primaryPort": 8000}),
     "disagg-profile-handler: unknown parameter 'primaryPort' (strict decoding refuses it)"),
    (lambda c: c["schedulingProfiles"][0]["plugins"].__setitem__(0, {"pluginRef": "decode-filter"}),
     "profile prefill filters out the prefill pods"),
    (lambda c: c["schedulingProfiles"][1]["plugins"].pop(0),
     "profile decode does not filter out the other role's pods"),
    (lambda c: c["plugins"].append({"type": "pd-sidecar-filter"}),
     "plugin type 'pd-sidecar-filter' is not registered by v0.10.0"),
], ids=["unresolved-decider", "decider-of-the-wrong-kind", "unknown-parameter", "prefill-profile-keeps-decode",
        "decode-profile-keeps-prefill", "unknown-type"])
def test_the_check_names_each_kind_of_mistake(manifests: Manifests, edit: Callable[[dict[str, Any]], None],
                                             problem: str) -> None:
    config = epp_config(manifests)
    edit(config)
    assert problem in check(config, PREFILL, DECODE)


def test_the_deployment_runs_the_released_image_with_flags_the_release_has(manifests: Manifests) -> None:
    epp = manifests.container("pd-epp", "epp")
    assert epp["image"] == IMAGE
    flags = {arg.split("=", 1)[0] for arg in epp["args"]}
    assert flags <= FLAGS, flags - FLAGS
    assert "--config-file=/config/epp-config.yaml" in epp["args"]


def test_the_pool_selects_both_roles_on_the_port_their_servers_listen_on(manifests: Manifests) -> None:
    """One targetPort: the decode pods' Envoy and the prefill pods' vLLM (llm-d's own layout: decode
    sidecar 8000 in front of vLLM 8200, prefill vLLM 8000); the picker's header carries that port."""
    pool = manifests.get("InferencePool", "pd-pool")["spec"]
    selector = pool["selector"]["matchLabels"]
    for deployment in ("pd-prefill", "pd-decode"):
        labels = pod_labels(manifests, deployment)
        assert selector.items() <= labels.items(), deployment
    assert [port["number"] for port in pool["targetPorts"]] == [8000]
    envoy = manifests.container("pd-decode", "envoy")
    assert any(port["containerPort"] == 8000 for port in envoy["ports"])
    prefill = manifests.container("pd-prefill", "vllm")
    assert any(port["containerPort"] == 8000 for port in prefill["ports"])
    assert pool["endpointPickerRef"] == {"name": "pd-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
