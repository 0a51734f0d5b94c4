"""bench/flamegraph.py: py-spy's raw stacks drawn as a flame graph SVG."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from bench import flamegraph

RAW = """\
<module> (extproc/__main__.py:1);serve (extproc/app.py:10);parse {x} (extproc/protocol/jsonspan.py:5) 30
<module> (extproc/__main__.py:1);serve (extproc/app.py:10);send (grpc/aio.py:3) 10
<module> (extproc/__main__.py:1);Thread.run (threading.py:1) 60
not a stack line
"""


def test_the_tree_counts_every_stacks_samples_in_each_frame() -> None:
    root = flamegraph.parse(RAW)
    assert root.samples == 100
    module = root.children["<module> (extproc/__main__.py:1)"]
    serve = module.children["serve (extproc/app.py:10)"]
    assert (module.samples, serve.samples) == (100, 40)
    assert {name: child.samples for name, child in serve.children.items()} == {
        "parse {x} (extproc/protocol/jsonspan.py:5)": 30, "send (grpc/aio.py:3)": 10}


def test_the_svg_is_well_formed_and_each_width_is_the_share_of_samples() -> None:
    svg = flamegraph.render(flamegraph.parse(RAW), "pd-extproc <c=64>")
    document = ET.fromstring(svg)  # noqa: S314 (our own output)
    namespace = "{http://www.w3.org/2000/svg}"
    widths = {group.find(f"{namespace}title").text.split(" (")[0]: float(group.find(f"{namespace}rect").get("width"))
              for group in document.iter(f"{namespace}g")}
    assert widths["all"] == flamegraph.WIDTH_PX
    assert widths["serve"] == flamegraph.WIDTH_PX * 0.4
    assert widths["parse {x}"] == flamegraph.WIDTH_PX * 0.3  # braces in a name survive
    assert "pd-extproc &lt;c=64&gt; (100 samples)" in svg
    # The root is the bottom row; a child sits one row above its parent.
    rows = {group.find(f"{namespace}title").text.split(" (")[0]: float(group.find(f"{namespace}rect").get("y"))
            for group in document.iter(f"{namespace}g")}
    assert rows["all"] > rows["<module>"] > rows["serve"] > rows["parse {x}"]
    assert not re.search(r"\{[yt]\d+\}", svg)


def test_an_empty_profile_says_so() -> None:
    svg = flamegraph.render(flamegraph.parse(""), "pd-extproc")
    assert "no samples" in svg
    ET.fromstring(svg)  # noqa: S314 (our own output)
