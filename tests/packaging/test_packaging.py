"""The release files: `python -m build` makes a wheel and an sdist that `twine check --strict` accepts,
each installs into a fresh virtualenv with the runtime dependencies only, and `pd-extproc serve` runs
from it (ready line, /metrics with the build version, a clean stop).

build and twine come from .venv-packaging (tests/packaging/requirements.txt; `make packaging-tools`,
which `make test` runs): PD_PACKAGING_PYTHON names its interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import urllib.request
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc import ready
from extproc._version import __version__

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def packaging_python() -> str:
    configured = os.environ.get("PD_PACKAGING_PYTHON", str(REPO / ".venv-packaging" / "bin" / "python"))
    if not Path(configured).exists():
        pytest.fail(f"{configured} not found: run `make packaging-tools` (build and twine for this stage)")
    return configured


def clean_environment() -> dict[str, str]:
    """Ours without PYTHONPATH (it would show pip the checkout instead of the installed files) or settings."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PD_EXTPROC_")}


def run(*argv: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=TIMEOUT, check=False,
                            cwd=cwd, env=clean_environment())
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel `python -m build` makes (the wheel from the sdist, as build does)."""
    out = tmp_path_factory.mktemp("dist")
    run(packaging_python(), "-m", "build", "--outdir", out, REPO)
    sdists = sorted(out.glob("*.tar.gz"))
    wheels = sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(out.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0]}


def test_the_files_carry_the_version(dist: dict[str, Path]) -> None:
    assert dist["sdist"].name == f"pd_extproc-{__version__}.tar.gz"
    assert dist["wheel"].name == f"pd_extproc-{__version__}-py3-none-any.whl"


def test_twine_accepts_both(dist: dict[str, Path]) -> None:
    out = run(packaging_python(), "-m", "twine", "check", "--strict", dist["sdist"], dist["wheel"])
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_the_package_the_licence_and_the_metadata(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = f"pd_extproc-{__version__}.dist-info"
        metadata = wheel.read(f"{info}/METADATA").decode()
    assert {"extproc/cli.py", "extproc/py.typed", f"{info}/licenses/LICENSE"} <= names
    assert not any(name.startswith(("tests/", "k8s/", "deploy/", "bench/")) for name in names)
    assert f"Version: {__version__}" in metadata and "License-Expression: Apache-2.0" in metadata
    # The emulators' dependencies only with the lab extra: the server never imports them.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: aiohttp")]
    assert requires and all('extra == "lab"' in line for line in requires), requires


def test_the_sdist_holds_what_builds_the_wheel(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE", "extproc/cli.py", "extproc/_version.py"} <= names


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def installed(request: pytest.FixtureRequest, dist: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv with only that file (and the runtime dependencies, at our pins) installed."""
    env_dir = tmp_path_factory.mktemp(f"venv-{request.param}")
    venv.create(env_dir, with_pip=True)
    run(env_dir / "bin" / "python", "-m", "pip", "install", "-q", "-c", REPO / "constraints.txt",
        dist[request.param])
    yield env_dir / "bin"


def test_the_installed_command_says_its_version(installed: Path) -> None:
    assert run(installed / "pd-extproc", "--version").strip() == f"pd-extproc {__version__}"
    listed = run(installed / "python", "-m", "pip", "list", "--format=freeze").lower()
    assert "aiohttp" not in listed and "pytest" not in listed  # runtime dependencies only


def test_the_emulators_say_they_need_the_lab_extra(installed: Path) -> None:
    result = subprocess.run([str(installed / "pd-extproc"), "emulate", "--role", "prefill"], capture_output=True,
                            text=True, timeout=60, check=False, env=clean_environment())
    assert result.returncode == 2
    assert result.stderr == "pd-extproc emulate: the emulated engines need the lab extra, which is not installed: " \
                            "pip install 'pd-extproc[lab]'\n"


def test_the_installed_server_runs(installed: Path, tmp_path: Path) -> None:
    env = {**clean_environment(), "HOME": str(tmp_path),
           "PD_EXTPROC_GRPC_LISTEN": f"unix:{tmp_path}/extproc.sock", "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
           "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*"}
    process = subprocess.Popen([str(installed / "pd-extproc"), "serve"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert process.stdout is not None
    try:
        fields = ready.parse(process.stdout.readline())
        with urllib.request.urlopen(f"http://127.0.0.1:{fields['metrics']}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert f'pd_extproc_build_info{{version="{__version__}"}} 1.0' in metrics
        assert Path(fields["grpc"].removeprefix("unix:")).is_socket()
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "Traceback" not in err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
