"""Sample values out of a Prometheus text page (exposition format 0.0.4), for the few gauges we read
and for merging our workers' pages (extproc/observability/merge.py).

Only what we need: the value of each sample of the named metrics, whatever its labels and with or
without a timestamp. Label values are quoted and may hold spaces, braces and escaped quotes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set


def _after_labels(line: str, start: int) -> int | None:
    """The index after the ``}`` closing the label set that opens at ``start``; None if it never closes."""
    quoted = escaped = False
    for index in range(start + 1, len(line)):
        char = line[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = quoted
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return index + 1
    return None


def sample_values(text: str, names: Set[str]) -> Iterator[float]:
    """Each sample value of the named metrics, in page order; malformed lines are skipped."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(None, 1)[0]  # str methods: most lines are not ours
        if name not in names:
            continue
        end = len(name)
        rest: int | None = end
        if line[end:end + 1] == "{":
            rest = _after_labels(line, end)
        if rest is None:
            continue
        fields = line[rest:].split()
        if not 1 <= len(fields) <= 2:  # the value, and an optional timestamp
            continue
        try:
            yield float(fields[0])
        except ValueError:
            continue


def gauge_values(page: bytes, names: Iterable[str]) -> Iterator[float]:
    """Each sample value of the named metrics, found without reading the page line by line: a sample
    line starts the page or follows a newline (a label value cannot hold a raw one), so ``bytes.find``
    of newline-and-name, at C speed, lands only on the lines of these names and of names they begin.
    For the decode-queue watch, which reads a page of up to 16 MiB every second on the event loop."""
    for name in names:
        key = b"\n" + name.encode()
        at = 0 if page.startswith(key[1:]) else page.find(key)
        while at >= 0:
            start = at + 1 if page[at:at + 1] == b"\n" else at
            end = page.find(b"\n", start)
            line = page[start:end if end >= 0 else len(page)].decode("utf-8", "replace").rstrip("\r")
            sample = series_and_value(line)
            if sample is not None and sample[1] == name:
                yield sample[2]
            at = page.find(key, start)


def series_and_value(line: str) -> tuple[str, str, float] | None:
    """A sample line's series (name and label text, as written), its name and its value; None for a
    line that is not a well-formed sample. A timestamp, if any, is dropped."""
    name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
    if not name or name.startswith("#"):
        return None
    end: int | None = len(name)
    if line[len(name):len(name) + 1] == "{":
        end = _after_labels(line, len(name))
    if end is None:
        return None
    fields = line[end:].split()
    if not 1 <= len(fields) <= 2:
        return None
    try:
        return line[:end], name, float(fields[0])
    except ValueError:
        return None
