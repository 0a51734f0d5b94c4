"""A flame graph SVG from py-spy's raw output (one ``frame;frame;...;leaf COUNT`` line per distinct stack).

The root is at the bottom; each frame's width is its share of all samples, children sorted by name so
two profiles of the same code line up. Frames narrower than MIN_WIDTH_PX are left out (their samples
still count in their parents). Every rectangle has a ``<title>`` with its function and share, which a
browser shows on hover. No script, no external file: the SVG opens as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

WIDTH_PX = 1200.0
ROW_PX = 16
MIN_WIDTH_PX = 0.5
FONT_PX = 11
CHAR_PX = 6.5  # about one character of FONT_PX monospace


@dataclass
class Frame:
    name: str
    samples: int = 0
    children: dict[str, Frame] = field(default_factory=dict)


def parse(raw: str) -> Frame:
    """The stack tree of py-spy's raw lines; the root's samples are all samples."""
    root = Frame("all")
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        node = root
        node.samples += count
        for name in stack.split(";"):
            node = node.children.setdefault(name, Frame(name))
            node.samples += count
    return root


def _colour(name: str) -> str:
    """Warm colours, stable per function; our own code (extproc/) in a distinct hue."""
    seed = sum(name.encode()) % 60
    if "extproc/" in name:
        return f"rgb({200 + seed // 3},{90 + seed},{60})"
    return f"rgb({225 + seed // 3 % 30},{120 + seed},{55 + seed // 2})"


def _braces(text: str) -> str:
    """Doubled, to survive the str.format that fills in each row's y once the depth is known."""
    return text.replace("{", "{{").replace("}", "}}")


def _rectangles(node: Frame, x: float, depth: int, scale: float, out: list[str], total: int) -> int:
    """Append ``node``'s rectangle and its children's; returns the deepest row drawn."""
    width = node.samples * scale
    if width < MIN_WIDTH_PX:
        return depth - 1
    label = _braces(escape(node.name))
    share = node.samples / total
    text = node.name if len(node.name) * CHAR_PX < width - 4 else node.name[:max(0, int((width - 4) / CHAR_PX) - 2)]
    cut = ".." if text != node.name else ""
    out.append(f'<g><title>{label} ({node.samples} samples, {share:.1%})</title>'
               f'<rect x="{x:.1f}" y="{{y{depth}}}" width="{width:.1f}" height="{ROW_PX - 1}" '
               f'fill="{_colour(node.name)}"/>'
               + (f'<text x="{x + 2:.1f}" y="{{t{depth}}}">{_braces(escape(text))}{cut}</text>'
                  if len(text) > 2 else "") + "</g>")
    deepest = depth
    for name in sorted(node.children):
        child = node.children[name]
        deepest = max(deepest, _rectangles(child, x, depth + 1, scale, out, total))
        x += child.samples * scale
    return deepest


def render(root: Frame, title: str) -> str:
    """The SVG document; an empty profile gives a graph that says so."""
    if root.samples == 0:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX:.0f}" height="40">'
                f'<text x="10" y="25">{escape(title)}: no samples</text></svg>\n')
    parts: list[str] = []
    deepest = _rectangles(root, 0.0, 0, WIDTH_PX / root.samples, parts, root.samples)
    header = 2 * ROW_PX
    height = header + (deepest + 1) * ROW_PX
    rows = {f"y{depth}": f"{height - (depth + 1) * ROW_PX}" for depth in range(deepest + 1)}
    rows.update({f"t{depth}": f"{height - depth * ROW_PX - 4}" for depth in range(deepest + 1)})
    body = "\n".join(part.format(**rows) for part in parts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX:.0f}" height="{height}" '
            f'font-family="monospace" font-size="{FONT_PX}">\n'
            f'<text x="4" y="{ROW_PX}">{escape(title)} ({root.samples} samples)</text>\n{body}\n</svg>\n')


def write(raw_path: Path, svg_path: Path, title: str) -> None:
    svg_path.write_text(render(parse(raw_path.read_text()), title))
