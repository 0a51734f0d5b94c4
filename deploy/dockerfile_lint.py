"""A small offline lint of the Dockerfile (no Docker engine here, so the image is never built).

Rules: multi-stage; the final stage's base is pinned (a digest, or a tag with a full x.y.z version)
and so is every other base; the final stage runs as a non-root user, has a HEALTHCHECK, copies its
software from an earlier stage and installs nothing (no package manager, compiler or pip); ENTRYPOINT
and CMD use the exec (JSON) form; no ADD from a URL.

    .venv/bin/python -m deploy.dockerfile_lint [Dockerfile]
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_PINNED_TAG = re.compile(r":[^:/@]*\d+\.\d+\.\d+[^:/@]*$")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_INSTALLS = re.compile(r"\b(apt-get|apt|apk|yum|dnf|microdnf|pip3?|uv|poetry|gcc|g\+\+|cc|clang|make|"
                       r"build-essential|curl|wget)\b")
_ROOT_USERS = {"root", "0"}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def stages(text: str) -> tuple[list[Stage], dict[str, str]]:
    args: dict[str, str] = {}
    result: list[Stage] = []
    for keyword, rest in instructions(text):
        if keyword == "ARG" and not result:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else ""
            result.append(Stage(base, name))
        elif result:
            result[-1].instructions.append((keyword, rest))
    return result, args


def _pinned(base: str, stage_names: set[str]) -> bool:
    return base in stage_names or bool(_DIGEST.search(base) or _PINNED_TAG.search(base))


def _exec_form(value: str) -> bool:
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, list) and all(isinstance(item, str) for item in parsed)


def problems(text: str) -> list[str]:
    found, _ = stages(text)
    if len(found) < 2:
        return ["expected a multi-stage build (a build stage and a final stage)"]
    names = {stage.name for stage in found if stage.name}
    out = [f"FROM {stage.base}: pin the base to a full x.y.z tag or a sha256 digest"
           for stage in found if not _pinned(stage.base, names)]
    final = found[-1]
    users = [rest for keyword, rest in final.instructions if keyword == "USER"]
    if not users or users[-1].split(":")[0] in _ROOT_USERS:
        out.append("the final stage must end as a non-root USER")
    checks = [rest for keyword, rest in final.instructions if keyword == "HEALTHCHECK"]
    if not checks or checks[-1].upper().startswith("NONE"):
        out.append("the final stage needs a HEALTHCHECK")
    if not any(keyword == "COPY" and "--from=" in rest for keyword, rest in final.instructions):
        out.append("the final stage must copy its software from an earlier stage (COPY --from=...)")
    for keyword, rest in final.instructions:
        if keyword == "RUN" and _INSTALLS.search(rest):
            out.append(f"the final stage installs or builds something: RUN {rest[:80]}")
    for keyword in ("ENTRYPOINT", "CMD"):
        values = [rest for kw, rest in final.instructions if kw == keyword]
        if keyword == "ENTRYPOINT" and not values:
            out.append("the final stage needs an ENTRYPOINT")
        if values and not _exec_form(values[-1]):
            out.append(f"{keyword} must use the exec (JSON array) form")
    for stage in found:
        for keyword, rest in stage.instructions:
            if keyword == "ADD" and re.search(r"\bhttps?://", rest):
                out.append(f"ADD from a URL: {rest[:80]}")
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(REPO / "Dockerfile")])[0])
    found = problems(path.read_text())
    for problem in found:
        sys.stdout.write(f"{path}: {problem}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
