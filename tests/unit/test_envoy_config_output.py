"""``pd-extproc envoy-config --output FILE``: what the decode pod's init container runs (k8s/base/decode.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import load_settings
from extproc.envoy.bootstrap import render_yaml

SETTINGS = {"PD_EXTPROC_DECODE": "127.0.0.1:8200", "PD_EXTPROC_TRUSTED_SOURCES": "192.168.0.0/16"}


def test_output_writes_the_bootstrap_of_these_settings_and_prints_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "envoy.yaml"
    assert main(["envoy-config", "--output", str(target)], SETTINGS) == 0
    assert capsys.readouterr().out == ""
    assert target.read_text() == render_yaml(load_settings(SETTINGS, {}))
    assert "192.168.0.0" in target.read_text()


def test_output_writes_the_parts_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--parts"], SETTINGS) == 0
    printed = capsys.readouterr().out
    target = tmp_path / "parts.yaml"
    assert main(["envoy-config", "--parts", "-o", str(target)], SETTINGS) == 0
    assert target.read_text() == printed
