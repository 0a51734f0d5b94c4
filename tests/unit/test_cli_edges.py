"""The command line's edges (issue 25): --version, `envoy --help`, a missing Envoy, the flags `serve`
offers, exact variable names. In-process, no Envoy started."""

from __future__ import annotations

import re

import pytest

from extproc import cli
from extproc._version import __version__
from extproc.config import ENVOY_ONLY_SETTINGS, ConfigError, load_settings, open_prefill_policy, specs
from extproc.observability.metrics import Metrics


def _flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?m)^\s+(--[a-z0-9-]+)", help_text))


def test_version_is_printed_and_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"pd-extproc {__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_metrics_export_the_build_version() -> None:
    exposition = Metrics().exposition().decode()
    assert f'pd_extproc_build_info{{version="{__version__}"}} 1.0' in exposition


@pytest.mark.parametrize("argv", [["envoy", "--help"], ["envoy", "-h"], ["envoy", "-c", "x.yaml", "--help"]])
def test_envoy_help_is_ours_and_never_reaches_envoy(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # An Envoy that would fail if run: the help must not start it.
    assert cli.main(argv, {"PD_EXTPROC_ENVOY_BIN": "/nonexistent/envoy"}) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pd-extproc envoy")
    assert "drain" in out and "/nonexistent/envoy --help" in out


def test_envoy_missing_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    """It used to die with a FileNotFoundError traceback."""
    assert cli.main(["envoy", "-c", "envoy.yaml"], {"PD_EXTPROC_ENVOY_BIN": "/nonexistent/envoy"}) == cli.EXIT_RUNTIME
    err = capsys.readouterr().err
    assert err.startswith("pd-extproc envoy: Envoy binary '/nonexistent/envoy' not found")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_serve_offers_only_the_flags_the_server_reads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    flags = _flags(capsys.readouterr().out)
    envoy_only = {spec.flag for spec in specs() if spec.name in ENVOY_ONLY_SETTINGS}
    assert envoy_only and not flags & envoy_only
    assert {spec.flag for spec in specs() if spec.name not in ENVOY_ONLY_SETTINGS} <= flags
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    assert envoy_only <= _flags(capsys.readouterr().out)  # `up` runs Envoy: it keeps them


def test_envoy_only_settings_are_not_read_by_the_server() -> None:
    """The server module never reads the settings serve no longer offers as flags."""
    from pathlib import Path

    import extproc.app

    source = Path(extproc.app.__file__).read_text()
    for name in ENVOY_ONLY_SETTINGS:
        assert f"settings.{name}" not in source, name


@pytest.mark.parametrize("name", ["PD_EXTPROC_prefill_allow", "PD_EXTPROC_Prefill_Allow", "PD_EXTPROC_PREFILL_ALLOw"])
def test_a_variable_in_the_wrong_case_is_refused_like_a_misspelling(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({name: "x"})
    assert f"{name}: unknown setting (did you mean PD_EXTPROC_PREFILL_ALLOW?)" in str(caught.value)


def test_a_lower_case_typo_stops_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve"], {"PD_EXTPROC_prefill_allow": "x"}) == cli.EXIT_CONFIG
    assert "PD_EXTPROC_prefill_allow: unknown setting" in capsys.readouterr().err


_OPEN = "neither PD_EXTPROC_PREFILL_ALLOW nor PD_EXTPROC_TRUSTED_SOURCES"


@pytest.mark.parametrize("command", ["serve", "up"])
def test_an_open_prefill_policy_stops_serve_and_up_before_anything_starts(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Neither an allow-list nor trusted sources: any client could aim the server anywhere. Nothing starts
    (no port is bound, no child runs): the settings error names both settings."""
    assert cli.main([command], {"PD_EXTPROC_ENVOY_BIN": "/nonexistent/envoy"}) == cli.EXIT_CONFIG
    assert _OPEN in capsys.readouterr().err


@pytest.mark.parametrize("env,refused", [
    ({}, _OPEN),
    ({"PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8:8000"}, ""),
    ({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"}, ""),
    ({"PD_EXTPROC_DEMO": "true"}, ""),
    ({"PD_EXTPROC_ADAPTER": "none"}, ""),  # never connects to a prefill worker
    ({"PD_EXTPROC_MODE": "gateway"}, "gateway mode without PD_EXTPROC_PREFILL_ALLOW"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"},
     "gateway mode without PD_EXTPROC_PREFILL_ALLOW"),  # trusted sources are our bootstrap's, unused there
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8:8000"}, ""),
], ids=["nothing", "allow-list", "trusted-sources", "demo", "adapter-none", "gateway", "gateway-trusted",
        "gateway-allow-list"])
def test_open_prefill_policy(env: dict[str, str], refused: str) -> None:
    refusal = open_prefill_policy(load_settings(env))
    assert (refused in refusal and refusal != "") if refused else refusal == ""
