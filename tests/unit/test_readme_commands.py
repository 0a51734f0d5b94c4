"""README's commands and the ready banner it shows are what the Makefile and the CLI really have.

The banner is rendered by the CLI's own ``_print_ready`` (with README's placeholders as the values), so a
change to the ready line's fields, their order or the lines after it fails here until README follows.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from extproc import cli, ready
from tests.harness import REPO

README = (REPO / "README.md").read_text()
MAKEFILE = (REPO / "Makefile").read_text()
BANNER_BEGIN = "<!-- ready-banner: what `pd-extproc up --demo` prints (tests/unit/test_readme_commands.py) -->"
BANNER_END = "<!-- /ready-banner -->"
# README's placeholders for what `up` picks at runtime.
DECODE = "127.0.0.1:<decode-port>"
PREFILL = "127.0.0.1:<prefill-port>"
METRICS = "http://127.0.0.1:<metrics-port>"
LOGS = "/tmp/pd-extproc-up-<random>"
# Commands README names that a branch not yet merged adds (delete the entry once it is merged).
PENDING_MAKE_TARGETS: dict[str, str] = {}
PENDING_FLAGS: dict[tuple[str, str], str] = {}


def readme_banner() -> str:
    assert README.count(BANNER_BEGIN) == 1 and README.count(BANNER_END) == 1
    block = README.split(BANNER_BEGIN, 1)[1].split(BANNER_END, 1)[0].strip()
    assert block.startswith("```text\n") and block.endswith("\n```"), block
    return block.removeprefix("```text\n").removesuffix("\n```") + "\n"


def make_targets() -> set[str]:
    targets: set[str] = set()
    for line in MAKEFILE.splitlines():
        match = re.match(r"^([A-Za-z0-9_. -]+?)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(t for t in match.group(1).split() if not t.startswith("."))
    return targets


def make_default(name: str) -> str:
    match = re.search(rf"^{name}\s*\?=\s*(\S+)\s*$", MAKEFILE, re.M)
    assert match, name
    return match.group(1)


def test_the_ready_banner_is_what_up_prints(capsys: pytest.CaptureFixture[str]) -> None:
    url = "http://" + make_default("LISTEN")  # what `make run` passes as --listen
    running = SimpleNamespace(
        settings=SimpleNamespace(decode=DECODE), url=url, metrics_url=METRICS,
        workers={cli.DEMO_PREFILL: SimpleNamespace(address=PREFILL),
                 cli.DEMO_DECODE: SimpleNamespace(url="http://" + DECODE)})
    cli._print_ready(running, Path(LOGS))
    assert readme_banner() == capsys.readouterr().out


def test_the_banners_first_line_is_a_ready_line_with_the_fields_up_documents() -> None:
    first = readme_banner().splitlines()[0]
    assert ready.is_ready(first)
    assert list(ready.parse(first)) == ["url", "decode", "metrics", "prefill", "logs"]


def test_make_run_starts_the_demo_on_the_banners_address() -> None:
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert recipe and "pd-extproc up --demo --listen $(LISTEN)" in recipe.group(1)
    assert f"url=http://{make_default('LISTEN')} " in readme_banner()
    # The command quoted whole, as the recipe runs it (not a shortened form an operator cannot reproduce).
    assert f"It runs `pd-extproc up --demo --listen {make_default('LISTEN')}`" in README


def test_every_make_target_readme_names_exists() -> None:
    # `make X` in backticks, or a line of a code block that starts with make
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", README) + re.findall(r"^make ([a-z][a-z0-9-]*)", README, re.M))
    assert {"run", "test", "check", "unit", "e2e"} <= named  # the quick start's
    missing = named - make_targets() - set(PENDING_MAKE_TARGETS)
    assert not missing, f"README names make targets the Makefile lacks: {sorted(missing)}"


def test_every_pd_extproc_command_and_flag_readme_names_exists() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    named = re.findall(r"pd-extproc ((?:[a-z]+-)*[a-z]+)((?: --[a-z-]+(?:[ =][^\s`-][^\s`]*)?)*)", README)
    assert named
    for command, rest in named:
        if command not in subparsers:  # prose such as "pd-extproc never touches"
            continue
        known = {opt for action in subparsers[command]._actions for opt in action.option_strings}
        for flag in re.findall(r"--[a-z-]+", rest):
            if (command, flag) in PENDING_FLAGS:
                continue
            assert flag in known, f"README: pd-extproc {command} {flag}: no such flag"
    assert {"up", "envoy-config"} <= {command for command, _ in named}


def test_readme_stays_the_operators_page_at_most_12_kib() -> None:
    """README is the landing page: reference material (settings, metrics, per-API rules) lives in docs/."""
    assert len(README.encode()) <= 12 * 1024, f"README.md is {len(README.encode())} bytes"


def test_readme_defines_the_words_a_newcomer_meets() -> None:
    glossary = README.split("## Words used here", 1)[1].split("\n## ", 1)[0]
    defined = {line.split("|")[1].strip() for line in glossary.splitlines() if line.startswith("| ")}
    for word in ("NIXL", "endpoint picker", "InferencePool", "client guard", "passthrough", "x-pd-fallback",
                 "prefill leg", "handoff", "adapter", "trusted sources"):
        assert any(word in entry for entry in defined), word


def test_readme_sends_every_shipped_sidecar_overlay_somewhere_with_steps() -> None:
    """An overlay without an install page (GKE, none) is named with the section that gives its steps."""
    overlays = {path.name for path in (REPO / "k8s" / "overlays").iterdir() if path.is_dir()}
    without_page = overlays - {"envoy-gateway", "istio", "example"}
    assert without_page == {"gke", "none"}
    paragraph = next(block for block in README.split("\n\n") if "`k8s/overlays/gke`" in block)
    assert "(docs/deployment.md#kubernetes)" in paragraph
    section = (REPO / "docs" / "deployment.md").read_text().split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    assert all(f"k8s/overlays/{name}`" in section for name in without_page)
