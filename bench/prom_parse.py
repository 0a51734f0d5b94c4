"""Why extproc/protocol/prom_text.py exists beside prometheus_client.parser: CPU per decode-queue read.

    .venv/bin/python -m bench.prom_parse

The page is shaped like a vLLM decode worker's /metrics with 8 data-parallel ranks and 40 histograms
(~0.6 MB); the decode-queue watch reads one such page every PD_EXTPROC_DECODE_QUEUE_INTERVAL (1 s by
default) on the server's event loop, so the parser's CPU per page is time no ext_proc stream is served.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from extproc.protocol.prom_text import sample_values

GAUGE = "vllm:num_requests_waiting"
RANKS = 8


def vllm_like_page(histograms: int = 40, buckets: int = 30) -> str:
    lines: list[str] = []
    for index in range(histograms):
        lines += [f"# HELP vllm:hist_{index} x", f"# TYPE vllm:hist_{index} histogram"]
        for rank in range(RANKS):
            labels = f'engine="{rank}",model_name="m"'
            lines += [f'vllm:hist_{index}_bucket{{{labels},le="{b}.0"}} {b * 3}.0' for b in range(buckets)]
            lines += [f"vllm:hist_{index}_count{{{labels}}} 90.0", f"vllm:hist_{index}_sum{{{labels}}} 12.5"]
    lines += [f"# HELP {GAUGE} x", f"# TYPE {GAUGE} gauge"]
    lines += [f'{GAUGE}{{engine="{rank}",model_name="m"}} 3.0' for rank in range(RANKS)]
    return "\n".join(lines) + "\n"


def cpu_ms(read: object, page: str, rounds: int = 5) -> tuple[float, float]:
    started = time.process_time()
    total = 0.0
    for _ in range(rounds):
        total = read(page)  # type: ignore[operator]
    return (time.process_time() - started) / rounds * 1000, total


def ours(page: str) -> float:
    return sum(sample_values(page, {GAUGE}))


def library(page: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(page)
               for sample in family.samples if sample.name == GAUGE)


def main() -> None:
    page = vllm_like_page()
    ours_ms, ours_total = cpu_ms(ours, page)
    lib_ms, lib_total = cpu_ms(library, page)
    assert ours_total == lib_total == 3.0 * RANKS
    print(f"page {len(page)} bytes: prom_text {ours_ms:.1f} ms CPU, prometheus_client.parser {lib_ms:.1f} ms CPU "
          f"({lib_ms / ours_ms:.0f}x)")


if __name__ == "__main__":
    main()
