"""The hand-written manifests use the ports, socket paths, timeouts and images the settings and the
renderer use: a changed setting that the manifests do not follow fails here, naming the field."""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import render_manifests as rm
from extproc._version import __version__
from extproc.config import Settings
from extproc.protocol.prefill_policy import PrefillPolicy
from tests.deploy.conftest import Manifests

pytestmark = pytest.mark.deploy

ENVOY_CONFIG_PATH = "/etc/envoy/envoy.yaml"


def _makefile_envoy_version(repo: Path) -> str:
    match = re.search(r"^ENVOY_VERSION\s*:?=\s*(\S+)", (repo / "Makefile").read_text(), re.M)
    assert match, "ENVOY_VERSION not found in the Makefile"
    return match.group(1)


def _args(container: dict[str, Any]) -> dict[str, str]:
    """--name=value arguments of a container (vLLM's style here)."""
    out = {}
    for arg in container.get("args", []) + container.get("command", []):
        if isinstance(arg, str) and arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            out[name] = value
    return out


def _mount(container: dict[str, Any], volume: str) -> str:
    path: str = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)
    return path


def _port(container: dict[str, Any], name: str) -> int:
    port: int = next(p["containerPort"] for p in container["ports"] if p["name"] == name)
    return port


def _socket_dir(settings: Settings) -> str:
    assert settings.grpc_listen.unix_path, "the deployments expect Envoy -> pd-extproc over a Unix socket"
    return posixpath.dirname(settings.grpc_listen.unix_path)


def _prestop(container: dict[str, Any]) -> int:
    seconds: int = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    return seconds


# ------------------------------------------------------------------------------------------- Kubernetes

def test_decode_envoy_runs_the_bootstrap_its_init_container_renders_from_the_settings(
        manifests: Manifests, k8s_settings: Settings) -> None:
    envoy = manifests.container("pd-decode", "envoy")
    assert envoy["args"][:2] == ["-c", ENVOY_CONFIG_PATH]
    pod = manifests.pod("pd-decode")
    init = next(c for c in pod["initContainers"] if c["name"] == "envoy-config")
    assert init["args"] == ["envoy-config", "--output", ENVOY_CONFIG_PATH]
    assert posixpath.basename(ENVOY_CONFIG_PATH) == rm.ENVOY_CONFIG_KEY
    # The init container writes into the volume Envoy reads, from the ConfigMap pd-extproc reads, with its image.
    volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
    assert "emptyDir" in volume
    assert _mount(init, "envoy-config") == _mount(envoy, "envoy-config") == posixpath.dirname(ENVOY_CONFIG_PATH)
    extproc = manifests.container("pd-decode", "pd-extproc")
    assert init["envFrom"] == extproc["envFrom"] and init["image"] == extproc["image"]
    assert _port(envoy, "http") == k8s_settings.listen.port
    assert envoy["image"] == f"envoyproxy/envoy:v{_makefile_envoy_version(rm.REPO)}"


def test_envoy_and_pd_extproc_share_the_socket_directory(manifests: Manifests, k8s_settings: Settings) -> None:
    pod = manifests.pod("pd-decode")
    socket_volume = next(v for v in pod["volumes"] if v["name"] == "extproc-socket")
    assert "emptyDir" in socket_volume
    for name in ("envoy", "pd-extproc"):
        assert _mount(manifests.container("pd-decode", name), "extproc-socket") == _socket_dir(k8s_settings)
    # Same uid for both, so Envoy may connect to the socket pd-extproc creates.
    assert all("runAsUser" not in c.get("securityContext", {}) for c in pod["containers"])
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid(rm.REPO)


def test_pd_extproc_reads_the_generated_settings_and_probes_its_health_endpoints(
        manifests: Manifests, k8s_settings: Settings) -> None:
    extproc = manifests.container("pd-decode", "pd-extproc")
    [source] = extproc["envFrom"]
    name = source["configMapRef"]["name"]
    # kustomize's generated name: the settings with a content hash, so a changed setting rolls the pods.
    assert name.startswith(f"{rm.SETTINGS_CONFIGMAP}-") and manifests.has("ConfigMap", name)
    # Every setting comes from the generated ConfigMap; the only other variable is the pod's own address.
    assert extproc["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert _port(extproc, "metrics") == k8s_settings.metrics_listen.port
    assert extproc["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert extproc["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert extproc["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_decode_vllm_listens_where_envoy_sends_the_decode_leg(manifests: Manifests, k8s_settings: Settings) -> None:
    vllm = manifests.container("pd-decode", "vllm")
    args = _args(vllm)
    assert (args["--host"], int(args["--port"])) == (k8s_settings.decode.host, k8s_settings.decode.port)
    for probe in ("startupProbe", "livenessProbe"):
        assert f"{k8s_settings.decode.host}:{k8s_settings.decode.port}/health" in " ".join(
            vllm[probe]["exec"]["command"])
    config = json.loads(args["--kv-transfer-config"])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}
    assert int(args["--max-num-seqs"]) >= k8s_settings.max_inflight


def test_prefill_serves_on_the_pool_port_that_the_allow_list_admits(manifests: Manifests,
                                                                    k8s_settings: Settings) -> None:
    pool = manifests.get("InferencePool", "pd-pool")
    target_ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert target_ports == [k8s_settings.listen.port]
    vllm = manifests.container("pd-prefill", "vllm")
    args = _args(vllm)
    assert (args["--host"], int(args["--port"])) == ("0.0.0.0", target_ports[0])
    assert _port(vllm, "http") == target_ports[0]
    assert json.loads(args["--kv-transfer-config"]) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    # The picker names <pod IP>:<targetPort>: a pod-network address on that port must pass, and nothing
    # on another port.
    assert k8s_settings.prefill_allow, "k8s must set an explicit prefill allow-list"
    policy = PrefillPolicy(k8s_settings.prefill_allow)
    for rule in k8s_settings.prefill_allow:
        assert rule.network is not None and target_ports[0] in rule.ports
        pod_ip = ipaddress.ip_address(str(next(rule.network.hosts())))
        assert policy.allows_address(pod_ip, target_ports[0])
        assert not policy.allows_address(pod_ip, 5600)
    assert k8s_settings.trusted_sources, "k8s must say which peers may set x-prefiller-host-port"


def test_pool_selects_both_roles_and_the_picker_service(manifests: Manifests) -> None:
    pool = manifests.get("InferencePool", "pd-pool")["spec"]
    for deployment in ("pd-decode", "pd-prefill"):
        labels = manifests.get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
        assert pool["selector"]["matchLabels"].items() <= labels.items()
    picker = manifests.get("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    assert pool["endpointPickerRef"]["failureMode"] == "FailClose"
    epp = manifests.container("pd-epp", "epp")
    assert f"--pool-name={manifests.get('InferencePool', 'pd-pool')['metadata']['name']}" in epp["args"]


def test_route_reaches_the_pool_through_the_gateway(manifests: Manifests) -> None:
    route = manifests.get("HTTPRoute", "pd-route")["spec"]
    assert [ref["name"] for ref in route["parentRefs"]] == ["pd-gateway"]
    gateways = manifests.of_kind("Gateway")
    if provider(manifests):
        assert [g["metadata"]["name"] for g in gateways] == ["pd-gateway"]
        assert gateways[0]["spec"]["gatewayClassName"] == GATEWAY_CLASSES[provider(manifests)]
    else:
        assert gateways == []  # overlay none: the Gateway is yours
    for rule in route["rules"]:
        assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": "pd-pool"}]
        assert rule["timeouts"]["request"] == "0s"
        assert "filters" not in rule  # a route filter would run after the picker and could drop its header


def stats_port(settings: Settings) -> int:
    assert settings.envoy_stats_listen is not None, "k8s scrapes Envoy's P/D histograms"
    return settings.envoy_stats_listen.port


def test_envoy_serves_its_stats_page_on_the_named_port(manifests: Manifests, k8s_settings: Settings) -> None:
    assert _port(manifests.container("pd-decode", "envoy"), "envoy-stats") == stats_port(k8s_settings)


def test_services_point_at_named_container_ports(manifests: Manifests, k8s_settings: Settings) -> None:
    service = manifests.get("Service", "pd-decode")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service} == {
        "http": (k8s_settings.listen.port, "http"), "metrics": (k8s_settings.metrics_listen.port, "metrics"),
        "envoy-stats": (stats_port(k8s_settings), "envoy-stats")}


def test_network_policy_ports_follow_the_settings(manifests: Manifests, k8s_settings: Settings) -> None:
    decode = manifests.get("NetworkPolicy", "pd-decode")["spec"]
    ports = [{p["port"] for p in rule.get("ports", [])} for rule in decode["ingress"]]
    assert {k8s_settings.listen.port} in ports  # gateway and picker -> Envoy
    assert {k8s_settings.metrics_listen.port, stats_port(k8s_settings)} in ports  # Prometheus -> pd-extproc, Envoy
    decode_labels = manifests.get("Deployment", "pd-decode")["spec"]["template"]["metadata"]["labels"]
    prefill_labels = manifests.get("Deployment", "pd-prefill")["spec"]["template"]["metadata"]["labels"]
    assert decode["podSelector"]["matchLabels"].items() <= decode_labels.items()
    egress_peers = [peer.get("podSelector", {}).get("matchLabels") for rule in decode["egress"]
                    for peer in rule.get("to", [])]
    assert any(p and p.items() <= prefill_labels.items() for p in egress_peers)
    for rule in decode["egress"]:
        for peer in rule.get("to", []):
            if "ipBlock" in peer:  # the model-download rule never opens the cluster's own ranges
                excepted = [ipaddress.ip_network(c) for c in peer["ipBlock"]["except"]]
                assert any(ipaddress.ip_address("10.1.2.3") in e for e in excepted)


def _admits(rule: dict[str, Any], port: int) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports if isinstance(p["port"], int))


# The gateway's data-plane peers each provider's component adds (k8s/components/gateway-*; none: none).
GATEWAY_PEERS: dict[str, list[dict[str, Any]]] = {
    "gateway-envoy-gateway": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                                     "envoy-gateway-system"}},
                               "podSelector": {"matchLabels": {"gateway.envoyproxy.io/owning-gateway-name":
                                                               "pd-gateway"}}}],
    "gateway-istio": [{"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "pd-gateway"}}}],
    "gateway-gke": [{"ipBlock": {"cidr": "10.129.0.0/23"}}, {"ipBlock": {"cidr": "35.191.0.0/16"}},
                    {"ipBlock": {"cidr": "130.211.0.0/22"}}],
    "": [],
}
# GKE: the load balancer's proxies call the picker; its health checkers do not.
PICKER_PEERS = {"gateway-gke": GATEWAY_PEERS["gateway-gke"][:1]}
GATEWAY_CLASSES = {"gateway-envoy-gateway": "eg", "gateway-istio": "istio",
                   "gateway-gke": "gke-l7-regional-external-managed"}


def provider(manifests: Manifests) -> str:
    """The gateway component an overlay uses ("" for none), from its kustomization.yaml."""
    assert manifests.overlay is not None
    kustomization = yaml.safe_load((manifests.overlay / "kustomization.yaml").read_text())
    components = [Path(c).name for c in kustomization.get("components", []) if Path(c).name.startswith("gateway-")]
    assert len(components) <= 1, components
    return components[0] if components else ""


def test_only_the_gateway_and_the_picker_reach_envoy(manifests: Manifests, k8s_settings: Settings) -> None:
    decode = manifests.get("NetworkPolicy", "pd-decode")["spec"]
    gateway_peers = GATEWAY_PEERS[provider(manifests)]
    for rule in decode["ingress"]:
        assert rule.get("from"), "a rule without peers admits everyone"
        if not _admits(rule, k8s_settings.listen.port):
            continue
        assert rule["from"] == [*gateway_peers, {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pd-epp"}}}]
    assert sum(_admits(rule, k8s_settings.metrics_listen.port) for rule in decode["ingress"]) == 1
    assert sum(_admits(rule, stats_port(k8s_settings)) for rule in decode["ingress"]) == 1


def test_only_the_gateway_reaches_the_picker(manifests: Manifests) -> None:
    """The picker's ext_proc port: the gateway only (none: nobody until you add yours); its metrics port
    only to Prometheus, with the monitoring component."""
    rules = manifests.get("NetworkPolicy", "pd-epp")["spec"]["ingress"]
    gateway_peers = PICKER_PEERS.get(provider(manifests), GATEWAY_PEERS[provider(manifests)])
    assert rules == ([{"from": gateway_peers, "ports": [{"protocol": "TCP", "port": 9002}]}] if gateway_peers else [])
    picker_ports = {p["containerPort"] for p in manifests.container("pd-epp", "epp")["ports"]}
    assert 9002 in picker_ports


def test_shutdown_order_lets_pd_extproc_drain_before_envoy_and_vllm_stop(manifests: Manifests,
                                                                         k8s_settings: Settings) -> None:
    pod = manifests.pod("pd-decode")
    extproc = _prestop(manifests.container("pd-decode", "pd-extproc"))
    envoy = _prestop(manifests.container("pd-decode", "envoy"))
    vllm = _prestop(manifests.container("pd-decode", "vllm"))
    assert envoy >= extproc + k8s_settings.drain_timeout
    assert vllm >= envoy
    assert pod["terminationGracePeriodSeconds"] > vllm


def test_images_agree_between_compose_and_kubernetes(manifests: Manifests, compose: dict[str, Any],
                                                     compose_gpu: dict[str, Any], repo: Path) -> None:
    services = compose["services"]
    # The image is tagged with the release (extproc/_version.py); an overlay may name a registry's copy.
    release = f"pd-extproc:{__version__}"
    assert {name: service["image"] for name, service in services.items()} == dict.fromkeys(services, release)
    # Kubernetes runs the server image (Dockerfile `--target server`) of the same release.
    server = manifests.container("pd-decode", "pd-extproc")["image"]
    assert server.rsplit("/", 1)[-1] == f"pd-extproc-server:{__version__}"
    # Compose's Envoy is the one in our image; Kubernetes runs Envoy's own image of the same release.
    assert manifests.container("pd-decode", "envoy")["image"] == f"envoyproxy/envoy:v{_makefile_envoy_version(repo)}"
    for deployment in ("pd-decode", "pd-prefill"):
        for service in ("prefill", "decode"):
            assert manifests.container(deployment, "vllm")["image"] == compose_gpu["services"][service]["image"]


# ---------------------------------------------------------------------------------------------- Compose

ENGINE_VARIABLE = "${PD_ENGINE:-vllm}"


def _compose_args(service: dict[str, Any]) -> dict[str, str]:
    return _args({"args": service["command"]})


def _for_engine(text: str, engine: str) -> str:
    return text.replace(ENGINE_VARIABLE, engine)


def _dockerfile_uid(repo: Path) -> int:
    match = re.search(r"^USER\s+(\d+)", (repo / "Dockerfile").read_text(), re.M)
    assert match, "the Dockerfile must set a numeric USER"
    return int(match.group(1))


def _dockerfile_arg(repo: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)", (repo / "Dockerfile").read_text(), re.M)
    assert match, f"ARG {name} not found in the Dockerfile"
    return match.group(1)


def test_the_image_carries_the_envoy_the_tests_run(repo: Path) -> None:
    assert _dockerfile_arg(repo, "ENVOY_VERSION") == _makefile_envoy_version(repo)


def test_the_wheelhouse_holds_the_build_backend_pyproject_names(repo: Path) -> None:
    requires = re.search(r'^requires = \["(setuptools==[^"]+)"\]', (repo / "pyproject.toml").read_text(), re.M)
    assert requires, "pyproject.toml's build-system requires one pinned setuptools"
    match = re.search(r"^BUILD_BACKEND\s*:?=\s*(\S+)", (repo / "Makefile").read_text(), re.M)
    assert match and match.group(1) == requires.group(1)


def test_compose_builds_on_the_dockerfile_default_base(compose: dict[str, Any], repo: Path) -> None:
    args = compose["services"]["pd-extproc"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == f"${{PD_BASE_IMAGE:-{_dockerfile_arg(repo, 'PYTHON_IMAGE')}}}"
    assert args["WHEELS"] == f"${{PD_WHEELS:-{_dockerfile_arg(repo, 'WHEELS')}}}"


def test_compose_envoy_mounts_the_generated_bootstrap_of_each_engine(compose: dict[str, Any], repo: Path) -> None:
    envoy = compose["services"]["envoy"]
    mount = f"./envoy.{ENGINE_VARIABLE}.yaml:{ENVOY_CONFIG_PATH}:ro"
    assert mount in envoy["volumes"]
    generated = {target.output for target in rm.TARGETS}
    for engine in rm.COMPOSE_ENGINES:
        assert rm.COMPOSE_DIR / _for_engine(mount, engine).split(":")[0] in generated
    assert envoy["command"][:3] == ["envoy", "-c", ENVOY_CONFIG_PATH]  # `pd-extproc envoy`: the image's entrypoint
    assert int(envoy["user"].split(":")[0]) == _dockerfile_uid(repo)


def test_compose_pd_extproc_and_envoy_read_the_settings_files(compose: dict[str, Any]) -> None:
    for name in ("pd-extproc", "envoy"):
        files = compose["services"][name]["env_file"]
        for engine in rm.COMPOSE_ENGINES:
            assert [rm.COMPOSE_DIR / _for_engine(f, engine) for f in files] == [
                rm.COMPOSE_SETTINGS, rm.compose_engine_settings(engine)]


def test_compose_emulators_are_the_engine_the_adapter_speaks(compose: dict[str, Any]) -> None:
    for name in ("prefill", "decode"):
        service = compose["services"][name]
        assert service["command"][0] == "emulate"
        assert _compose_args(service)["--engine"] == ENGINE_VARIABLE
        assert _compose_args(service)["--role"] == name
    assert set(rm.COMPOSE_ENGINES) == {"vllm", "sglang", "trtllm"}  # pd-extproc emulate --engine choices


def test_compose_shares_the_decode_namespace_and_the_socket(compose: dict[str, Any], compose_gpu: dict[str, Any],
                                                             compose_settings: Settings) -> None:
    services = compose["services"]
    for name in ("envoy", "pd-extproc"):
        assert services[name]["network_mode"] == "service:decode"
        assert f"extproc-socket:{_socket_dir(compose_settings)}" in services[name]["volumes"]
    published = {int(p.rsplit(":", 1)[1]) for p in services["decode"]["ports"]}
    assert published == {compose_settings.listen.port, compose_settings.metrics_listen.port}
    decode = compose_settings.decode
    assert _compose_args(services["decode"])["--listen"] == f"{decode.host}:{decode.port}"
    gpu_args = _compose_args(compose_gpu["services"]["decode"])
    assert (gpu_args["--host"], int(gpu_args["--port"])) == (decode.host, decode.port)
    assert json.loads(gpu_args["--kv-transfer-config"])["kv_load_failure_policy"] == "fail"


def test_compose_prefill_is_the_one_allowed_target(compose: dict[str, Any], compose_gpu: dict[str, Any],
                                                   compose_settings: Settings) -> None:
    from tests.compose.commands import PREFILL_TARGET

    prefill = compose["services"]["prefill"]
    address = ipaddress.ip_address(prefill["networks"]["pd"]["ipv4_address"])
    port = int(_compose_args(prefill)["--listen"].rsplit(":", 1)[1])
    assert int(_compose_args(compose_gpu["services"]["prefill"])["--port"]) == port
    assert f"{address}:{port}" == PREFILL_TARGET  # what README's P/D request names
    policy = PrefillPolicy(compose_settings.prefill_allow)
    assert policy.allows_address(address, port)
    assert not policy.allows_address(address, port + 1)
    decode_address = ipaddress.ip_address(compose["services"]["decode"]["networks"]["pd"]["ipv4_address"])
    assert not policy.allows_address(decode_address, port)  # decode itself
    side_host, side_port = _compose_args(prefill)["--side-channel"].rsplit(":", 1)
    assert ipaddress.ip_address(side_host) == address  # advertised in the handoff: must be reachable from decode
    for name in ("prefill", "decode"):
        gpu_env = compose_gpu["services"][name]["environment"]
        assert gpu_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == compose["services"][name]["networks"]["pd"]["ipv4_address"]
    assert rm.compose_settings("sglang")[0].value("sglang_bootstrap_port") == int(side_port)
    assert address in ipaddress.ip_network(compose["networks"]["pd"]["ipam"]["config"][0]["subnet"])
    assert f"{address}:{port}" in (rm.COMPOSE_DIR / "docker-compose.yaml").read_text()  # its usage comment


def test_compose_gives_envoy_and_pd_extproc_time_to_drain(compose: dict[str, Any]) -> None:
    for engine in rm.COMPOSE_ENGINES:
        settings = rm.compose_settings(engine)[0]
        for name in ("envoy", "pd-extproc"):
            grace = compose["services"][name]["stop_grace_period"]
            assert grace.endswith("s") and int(grace[:-1]) > settings.drain_timeout


# ---------------------------------------------------------------------------------------------- Release

def test_the_makefile_tags_the_image_with_the_release(repo: Path) -> None:
    result = subprocess.run(["make", "-s", "-C", str(repo), "version"], capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip() == __version__
    assert re.search(r"^IMAGE \?= pd-extproc:\$\(VERSION\)$", (repo / "Makefile").read_text(), re.M)


def test_every_image_tag_the_repository_names_is_the_release(repo: Path) -> None:
    """Compose, the kustomize package, the Dockerfile's usage and the commands of README and docs/ name one tag."""
    files = [repo / "Dockerfile", repo / "README.md", *sorted((repo / "docs").rglob("*.md")),
             *sorted((repo / "envoy").glob("*.yaml")),
             *sorted((repo / "k8s").rglob("*.yaml"))]
    tags = {(path.relative_to(repo).as_posix(), tag) for path in files
            for tag in re.findall(r"pd-extproc(?:-server)?:(\d+\.\d+\.\d+(?:[-+][\w.]*\w)?)", path.read_text())}
    assert tags and {tag for _, tag in tags} == {__version__}, sorted(tags)
