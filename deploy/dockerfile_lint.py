"""A small offline lint of the Dockerfile (no Docker engine here, so the image is never built).

Rules: multi-stage; the final stage's base is pinned (a digest, or a tag with a full x.y.z version)
and so is every other base; each image stage (the last, and any stage no other stage uses, such as the
server image's) runs as a non-root user, has a HEALTHCHECK, copies its
software from an earlier stage and installs nothing (no package manager, compiler or pip); ENTRYPOINT
and CMD use the exec (JSON) form; no ADD from a URL.

Nothing needs a registry when the base is a local image (an air-gapped build): no ``syntax`` parser
directive or ``BUILDKIT_SYNTAX`` argument (BuildKit fetches that frontend image), every FROM is an
earlier stage or a build argument (PYTHON_IMAGE, which names a local image there), and no COPY or
RUN mount takes files from an image that is not a stage.

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
# A parser directive, as BuildKit reads them: `# key=value` lines at the very top, up to the first line
# that is not one (moby/buildkit frontend/dockerfile/dockerfile2llb/directives.go, ParseDirectives;
# keys are case-insensitive). `syntax`, or the build argument BUILDKIT_SYNTAX, makes BuildKit run that
# frontend image instead of its built-in one (frontend/dockerfile/builder/build.go, Build), pulling it.
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$")
_FROM_IMAGE = re.compile(r"(?:--|[=,])from=([^\s,]+)")  # COPY --from=, RUN --mount=...,from=


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


def directives(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _DIRECTIVE.match(line)
        if match is None:
            break
        found[match.group(1).lower()] = match.group(2)
    return found


def registry_problems(text: str) -> list[str]:
    """What would make a build with a local base image reach a registry."""
    out = []
    if "syntax" in directives(text):
        out.append(f"the `# syntax={directives(text)['syntax']}` directive makes BuildKit pull that frontend "
                   "image from a registry: drop it (the built-in frontend builds this file)")
    stage_names: set[str] = set()
    for keyword, rest in instructions(text):
        words = rest.split()
        if keyword == "ARG" and words and words[0].split("=", 1)[0] == "BUILDKIT_SYNTAX":
            out.append("ARG BUILDKIT_SYNTAX makes BuildKit pull a frontend image from a registry")
        elif keyword == "FROM":
            names = [w for w in words if not w.startswith("--")]
            if not (names[0].startswith("$") or names[0] in stage_names or names[0] == "scratch"):
                out.append(f"FROM {names[0]}: take the base from a build argument (such as PYTHON_IMAGE), "
                           "so a build without a registry can name a local image")
            if len(names) >= 3 and names[1].upper() == "AS":
                stage_names.add(names[2])
        elif keyword in ("COPY", "RUN"):
            options = " ".join(w for w in words if w.startswith("--"))
            sources = [m.group(1) for m in _FROM_IMAGE.finditer(options)]
            images = [source for source in sources if source not in stage_names and not source.isdigit()]
            out += [f"{keyword} {rest[:60]}: copies from the image {image}, which is not a stage (pulled from a "
                    "registry)" for image in images]
    return out


def _pinned(base: str, stage_names: set[str]) -> bool:
    return base in stage_names or bool(_DIGEST.search(base) or _PINNED_TAG.search(base))


def _exec_form(value: str) -> bool:
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, list) and all(isinstance(item, str) for item in parsed)


def image_stages(found: list[Stage]) -> list[Stage]:
    """The stages that are images someone runs: the last one, and any no later stage builds on or copies from
    (``--target server``)."""
    used: set[str] = set()
    for stage in found:
        used.add(stage.base)
        for keyword, rest in stage.instructions:
            if keyword in ("COPY", "RUN"):
                used.update(m.group(1) for m in _FROM_IMAGE.finditer(rest))
    return [stage for index, stage in enumerate(found) if index == len(found) - 1 or stage.name not in used]


def _image_problems(final: Stage) -> list[str]:
    """What an image stage must be: non-root, a health check, software copied in, nothing installed, exec form."""
    out = []
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
    return out


def problems(text: str) -> list[str]:
    found, _ = stages(text)
    if len(found) < 2:
        return ["expected a multi-stage build (a build stage and a final stage)"]
    names = {stage.name for stage in found if stage.name}
    out = [f"FROM {stage.base}: pin the base to a full x.y.z tag or a sha256 digest"
           for stage in found if not _pinned(stage.base, names)]
    for stage in image_stages(found):
        out += [problem.replace("the final stage", f"the {stage.name or 'final'} stage")
                for problem in _image_problems(stage)]
    for stage in found:
        for keyword, rest in stage.instructions:
            if keyword == "ADD" and re.search(r"\bhttps?://", rest):
                out.append(f"ADD from a URL: {rest[:80]}")
    out += registry_problems(text)
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(REPO / "Dockerfile")])[0])
    found = problems(path.read_text())
    for problem in found:
        sys.stdout.write(f"{path}: {problem}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
