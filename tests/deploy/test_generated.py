"""Generated deployment files never drift from the settings files and the Envoy renderer."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import render_manifests as rm
from deploy import validate
from deploy.envfile import EnvFileError, parse_env_text, read_env_file
from extproc import cli
from extproc.config import specs
from tests.deploy.conftest import Manifests

pytestmark = pytest.mark.deploy

# Settings the deployment files rely on (names as in extproc.config.specs()).
RELIED_ON = ("adapter", "grpc_listen", "listen", "decode", "envoy_admin", "metrics_listen", "prefill_allow",
             "trusted_sources", "max_request_bytes", "max_prefill_response_bytes", "prefill_connect_timeout",
             "prefill_read_timeout", "prefill_deadline", "client_body_timeout", "decode_idle_timeout",
             "drain_timeout", "max_inflight", "log_level")


@pytest.mark.parametrize("path", sorted(rm.rendered()), ids=lambda p: str(p.relative_to(rm.REPO)))
def test_generated_file_is_current(path: Path) -> None:
    expected = rm.rendered()[path]
    assert path.exists() and path.read_text() == expected, (
        f"{path.relative_to(rm.REPO)} is stale: run `{rm.REGENERATE}` and commit the result.\n"
        + rm.diff(path, expected))


def _cli_envoy_config(capsys: pytest.CaptureFixture[str], *settings_files: Path) -> str:
    capsys.readouterr()
    environ = {name: value for path in settings_files for name, value in read_env_file(path).items()}
    assert cli.main(["envoy-config"], environ=environ) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("engine", rm.COMPOSE_ENGINES)
def test_compose_mounts_what_pd_extproc_envoy_config_prints(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert rm.compose_envoy(engine).read_text() == _cli_envoy_config(
        capsys, rm.COMPOSE_SETTINGS, rm.compose_engine_settings(engine))


def test_the_settings_configmap_every_overlay_renders_is_the_settings_file(manifests: Manifests) -> None:
    """kustomize's configMapGenerator, hashed: the overlays shipped here change none of the settings."""
    assert validate.decode_settings([doc.body for doc in manifests.docs]) == read_env_file(rm.K8S_SETTINGS)


@pytest.mark.parametrize("target", rm.TARGETS, ids=lambda t: t.name)
def test_settings_files_use_only_known_settings(target: rm.Target) -> None:
    known = {spec.env for spec in specs()}
    for path in target.settings_files:
        assert set(read_env_file(path)) <= known
    rm.target_settings(*target.settings_files)  # and pd-extproc accepts every value


def test_each_compose_engine_file_names_its_adapter_and_nothing_the_shared_file_sets() -> None:
    shared = read_env_file(rm.COMPOSE_SETTINGS)
    assert "PD_EXTPROC_ADAPTER" not in shared
    for engine in rm.COMPOSE_ENGINES:
        own = read_env_file(rm.compose_engine_settings(engine))
        assert not set(own) & set(shared), f"engine.{engine}.env repeats a shared setting"
        assert own["PD_EXTPROC_ADAPTER"] == {"vllm": "vllm_nixl"}.get(engine, engine)


def test_the_settings_the_manifests_rely_on_exist() -> None:
    assert set(RELIED_ON) <= {spec.name for spec in specs()}


def test_check_mode_names_the_stale_file_and_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "envoy.yaml"
    target.write_text("old\n")
    monkeypatch.setattr(rm, "REPO", tmp_path)
    monkeypatch.setattr(rm, "rendered", lambda: {target: "new\n"})
    assert rm.main(["--check"]) == 1
    captured = capsys.readouterr()
    assert "envoy.yaml" in captured.err and rm.REGENERATE in captured.err
    assert "-old" in captured.out and "+new" in captured.out
    assert target.read_text() == "old\n"
    assert rm.main([]) == 0
    assert target.read_text() == "new\n"


def test_a_changed_setting_makes_the_rendered_config_stale(tmp_path: Path) -> None:
    settings_file = tmp_path / "pd-extproc.env"
    settings_file.write_text(rm.COMPOSE_SETTINGS.read_text().replace("PD_EXTPROC_LISTEN=0.0.0.0:8000",
                                                                      "PD_EXTPROC_LISTEN=0.0.0.0:8001"))
    expected = rm.rendered([rm.Target("planted", (settings_file, rm.compose_engine_settings("vllm")),
                                      rm.COMPOSE_ENVOY, rm.render_compose)])
    assert rm.stale(expected) == [rm.COMPOSE_ENVOY]


@pytest.mark.parametrize("line", ['PD_EXTPROC_LOG_LEVEL="info"', "PD_EXTPROC_DECODE=${DECODE}",
                                  "PD_EXTPROC_LOG_LEVEL=info # comment", "export PD_EXTPROC_LOG_LEVEL=info",
                                  "PD_EXTPROC_LOG_LEVEL"])
def test_settings_files_refuse_what_compose_would_read_differently(line: str) -> None:
    with pytest.raises(EnvFileError):
        parse_env_text(line)


@pytest.mark.parametrize("files", [
    (rm.COMPOSE_SETTINGS,), (rm.K8S_SETTINGS,), (rm.GATEWAY_SETTINGS,)],
    ids=["compose", "k8s-base", "k8s-gateway-mode"])
def test_every_shipped_shape_closes_the_prefill_policy(files: tuple[Path, ...]) -> None:
    """The server refuses to start with neither an allow-list nor trusted sources (gateway mode: no
    allow-list): every shape we ship sets one, so none of them starts open or fails to start."""
    from extproc.config import load_settings, open_prefill_policy

    environ = {name: value for path in files for name, value in read_env_file(path).items()}
    settings = load_settings(environ)
    assert not settings.demo and open_prefill_policy(settings) == ""
    assert settings.prefill_allow, "an explicit list of prefill targets, not the default policy"
