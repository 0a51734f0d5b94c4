"""RESULTS.md, written from results.json and its summary. Every number in it comes from this run."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import loop_stall, soak_markdown, sweep_markdown
from bench.report import KIB, MIB, WORKER_BUSY_BOUND

NOISY = 0.10
NOISE_NOTE = ("† = in at least one round of this cell, processes outside the benchmark used more than 10 % of "
              "the machine even after retries (see \"Load generator and machine noise\").")
SYSTEM_ORDER = ("direct", "direct-prefill", "envoy", "passthrough", "floor-cxx", "floor-aio", "floor-aio-shape",
                "floor-aio-delay", "floor-aio-burn", "floor-h2", "pd-extproc", "pd-extproc-x2", "vllm-router", "smg")
SET_ORDER = ("cheap", "cheap-sglang", "emulated")
SET_TITLES = {
    "cheap": "Cheap vLLM-shaped workers (the headline: the workers are not the bottleneck)",
    "cheap-sglang": "Cheap SGLang-shaped workers: pd-extproc's sglang adapter vs smg",
    "emulated": "Emulated vLLM workers with a KV ledger (proves every handoff was consumed; the workers cost "
                "about as much as the proxies)",
}
SET_DESCRIPTIONS = {
    "cheap": "`bench/cheap_worker.py --engine vllm`: canned answers written at once, no JSON parsing; counts "
             "producer legs (prefill asked for a handoff), consumer legs (decode got a handoff naming the "
             "prefill's engine id) and distinct handoff ids",
    "cheap-sglang": "`bench/cheap_worker.py --engine sglang`: the same, SGLang-shaped; counts requests carrying "
                    "`bootstrap_room` (and, at decode, `bootstrap_host`)",
    "emulated": "`pd-extproc emulate` (pd_extproc_lab/emulator/vllm.py): vLLM 0.32 shapes, KV leases granted by "
                "prefill and pulled by decode over its side channel, every pull counted",
}
SYSTEM_DESCRIPTIONS = {
    "direct": "client -> the set's decode worker (the floor)",
    "direct-prefill": "client -> the set's prefill worker, max_tokens 16, no KV params (reference: the prefill "
                      "worker's own cost, non-streaming only)",
    "envoy": "client -> plain Envoy (router filter only) -> decode (\"Envoy alone\")",
    "passthrough": "client -> our Envoy bootstrap (render_yaml, the client guard on), no x-prefiller-host-port "
                   "-> decode",
    "pd-extproc": "client -> our Envoy + `pd-extproc serve` (gRPC over a Unix socket, as `pd-extproc up` runs it) "
                  "-> prefill leg, handoff check, body rewrite -> decode (pulls KV from prefill)",
    "pd-extproc-x2": "the same with `pd-extproc serve --workers 2`: a supervisor and two worker processes behind "
                     "one Envoy (its ext_proc cluster has both Unix sockets as endpoints, LEAST_REQUEST; one "
                     "in-flight limit; cheap workers only)",
    "floor-cxx": "client -> our Envoy bootstrap (route pd, x-prefiller-host-port set) + a compiled ext_proc server "
                 "that does nothing (bench/floor/ext_proc_floor.cc, grpc++ callback API): continue on the headers, "
                 "the same body back with its content-length -> decode (the design's floor; cheap workers only)",
    "floor-aio": "the same with a grpc.aio servicer that does nothing (bench/floor/aio.py: our grpcio, uvloop, "
                 "server options and Unix socket): the floor of grpc.aio, our transport until our own gRPC server",
    "floor-h2": "floor-aio's do-nothing servicer on our own gRPC server (bench/floor/h2.py on "
                "extproc/envoy/h2server.py, as `pd-extproc serve` runs it): our transport's floor "
                "(non-stream c=64 only)",
    "floor-aio-shape": "floor-aio answering the body with our exact reply to a successful vllm_nixl request: "
                       "content-length, our five remove_headers, the body with a cheap prefill worker's "
                       "kv_transfer_params spliced in (bench/floor/replies.py; decode counts a consumer leg; "
                       "non-stream c=64 only)",
    "floor-aio-delay": "floor-aio holding each body before answering it (`asyncio.sleep`, no CPU; "
                       "bench/floor/aio.py DELAY_MS, about our server's hold at c=1; non-stream c=64 only)",
    "floor-aio-burn": "floor-aio spinning CPU on its event loop before answering each body (bench/floor/aio.py "
                      "BURN_US, our own work per P/D request; non-stream c=64 only)",
    "vllm-router": "client -> vllm-router 0.1.17 `--vllm-pd-disaggregation` -> prefill, then decode (pulls KV)",
    "smg": "client -> smg 1.13 (Shepherd Model Gateway, which replaced sglang-router) `launch --pd-disaggregation "
           "--log-level warn` -> prefill and decode at once, with bootstrap fields (cheap-sglang workers only)",
}


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ordered(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(cells, key=lambda c: (SYSTEM_ORDER.index(c["system"]), c["body"], c["concurrency"]))


def _of_set(cells: list[dict[str, Any]], workers: str) -> list[dict[str, Any]]:
    return [c for c in cells if c.get("workers", "emulated") == workers]


def set_levels(options: dict[str, Any], workers: str) -> list[int]:
    key = {"cheap-sglang": "sglang_concurrency", "emulated": "emulated_concurrency"}.get(workers, "concurrency")
    return list(options.get(key, options["concurrency"]))


def _by_concurrency(cells: list[dict[str, Any]], body: str, levels: Sequence[int],
                    render: Callable[[dict[str, Any]], str], systems: Sequence[str]) -> list[list[str]]:
    rows = []
    for system in systems:
        found = {c["concurrency"]: c for c in cells if c["system"] == system and c["body"] == body}
        if found:
            rows.append([system, *[_flagged(found[level], render) if level in found else "-" for level in levels]])
    return rows


def _flagged(cell: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """The rendered cell, marked † when other processes used over 10 % of the machine in one of its rounds."""
    return render(cell) + (" †" if cell["worst_foreign_cpu_share"] > NOISY else "")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _added(cell: dict[str, Any]) -> str:
    return f"{_ms(cell['added_p50_ms'])} / {_ms(cell['added_p99_ms'])}"


def _absolute(cell: dict[str, Any]) -> str:
    return f"{cell['p50_ms']:.2f} / {cell['p99_ms']:.2f}"


def _rps(cell: dict[str, Any]) -> str:
    return f"{cell['rps']:.0f}"


def _cpu(cell: dict[str, Any]) -> str:
    return " + ".join(f"{role} {_number(us)}" for role, us in cell["cpu_us_per_request"].items()) or "-"


def _cpu_ms(cell: dict[str, Any]) -> str:
    return " + ".join(f"{role} {_ms(None if us is None else us / 1e3)}"
                      for role, us in cell["cpu_us_per_request"].items()) or "-"


def header(results: dict[str, Any], command: str) -> list[str]:
    machine = results["machine"]
    options = results["options"]
    return [
        "# pd-extproc benchmark results",
        "",
        f"Generated by `{command}` ({results['started']} to {results['finished']} UTC). Numbers are from one "
        "run on the machine below; compare systems by ratio, not by absolute time.",
        "",
        *([f"**This run is incomplete: it stopped early ({results['incomplete']}); the tables hold what was "
           "measured before that.**", ""] if results.get("incomplete") else []),
        *_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        "",
        "Worker sets (each system runs on the workers of its set; ratios are taken within a set):",
        "",
        *_table(["workers", "what"], [[f"`{w}`", SET_DESCRIPTIONS[w]] for w in SET_ORDER]),
        "",
        f"Method: {options['rounds']} interleaved rounds of {options['seconds']} s per point (wrk, closed loop, "
        "one keep-alive connection per client, request timed from first byte written to last byte read, so a "
        "stream is timed to its end), concurrency "
        + ", ".join(str(c) for c in options["concurrency"])
        + " (cheap workers; cheap-sglang: " + ", ".join(str(c) for c in set_levels(options, "cheap-sglang"))
        + "; emulated: " + ", ".join(str(c) for c in set_levels(options, "emulated")) + ")"
        "; in each round every system runs once per (concurrency, mode), in an order rotated by round. "
        "Added latency = system minus direct decode in the same round on the same workers, median over rounds. "
        "The systems of a set hit the same two workers (one prefill, one decode); a non-streaming request asks "
        "for 16 tokens, a streaming one gets 17 SSE events and `[DONE]`. Every point is checked against the "
        "workers' counters: each P/D request must run a prefill leg and a decode leg that received its "
        "handoff (emulated workers: that pulled its KV blocks).",
        "",
        *_table(["system", "path"], [[f"`{s}`", SYSTEM_DESCRIPTIONS[s]] for s in SYSTEM_ORDER]),
        "",
    ]


def validity(summary: dict[str, Any]) -> list[str]:
    checks = summary.get("validity") or []
    if not checks:
        return []
    valid = all(c["valid"] for c in checks)
    rows = [[f"`{c['workers']}`", f"{c['ratio']:.1f}x", c["where"], "; ".join(c.get("judged_at_workers") or []) or "-",
             "valid" if c["valid"] else "**INVALID**"] for c in checks]
    verdict = ("**This run is valid**: on every cheap worker set, at every point, direct decode reached at least 5x "
               "the throughput of the fastest P/D proxy, or, where it did not, no worker process was more than "
               f"{WORKER_BUSY_BOUND:.0%} busy during any P/D proxy's run there (a worker at most that busy could "
               "take 5x its load: the same margin, measured at the worker; at concurrency 1 direct decode is "
               "bound by the load generator's round trip, not by the worker)." if valid else
               "**This run is INVALID as a measure of the proxies**: on at least one cheap worker set, at a point "
               "where direct decode did not reach 5x the throughput of the fastest P/D proxy, a worker process "
               f"was more than {WORKER_BUSY_BOUND:.0%} busy during a P/D proxy's run (or was not measured), so the "
               "workers may have bounded the proxies.")
    return ["## Validity", "", verdict, "",
            *_table(["workers", "lowest direct / fastest P/D proxy", "at",
                     "points under 5x: busiest worker during the P/D runs there", "verdict"], rows), ""]


def targets(summary: dict[str, Any]) -> list[str]:
    rows = [[v["target"], v["measured"], "met" if v["met"] else "**missed**", v["by"]] for v in summary["verdicts"]]
    return ["## Targets (issue 36's Envoy share first; then issue 28's item 3, four rows; then issue 17's)", "",
            *_table(["target", "measured", "verdict", "margin"], rows), ""]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def floors(summary: dict[str, Any]) -> list[str]:
    """Our server against its two floors and the peer, per point of the cheap set."""
    found = summary.get("floors") or []
    if not found:
        return []
    rows = [[r["body"], str(r["concurrency"]), _number(r["server_us"]), _number(r["floor_aio_server_us"]),
             f"**{_number(r['own_work_us'])}**", _x(r["server_over_aio"]), _number(r["floor_cxx_server_us"]),
             _number(r["total_us"]), _number(r["floor_cxx_total_us"]), _x(r["total_over_cxx"]),
             _number(r.get("peer_total_us")), _x(r.get("total_over_peer")), _x(r["rps_over_cxx"]),
             _x(r.get("rps_over_peer")), _ms(r["added_p50_ms"]), _ms(r["floor_aio_added_p50_ms"]),
             _ms(r["floor_cxx_added_p50_ms"])] for r in found]
    return ["## Our own work above the floors (cheap workers)", "",
            "CPU µs per request. \"Our own work\" = `pd-extproc`'s server CPU minus `floor-aio`'s (grpc.aio doing "
            "nothing, behind the same Envoy shape, in the same run; since our own gRPC server replaced grpc.aio it "
            "can be negative: our transport's floor is `floor-h2`, in the Envoy share table above). \"Total\" = server "
            "+ the Envoy in front of it (for vllm-router: its one process). The floors "
            "run no prefill leg, so the difference also holds the prefill client's CPU.", "",
            *_table(["mode", "c", "server", "floor-aio server", "our own work", "server / floor-aio",
                     "floor-cxx server", "total", "floor-cxx total", "total / floor-cxx", "vllm-router",
                     "total / vllm-router", "req/s / floor-cxx", "req/s / vllm-router", "added p50 ms",
                     "floor-aio added p50", "floor-cxx added p50"], rows), ""]


def envoy_share(summary: dict[str, Any]) -> list[str]:
    """floor-aio, its variants and ours at c=64, non-stream, cheap workers: what moves Envoy's CPU."""
    found = summary.get("envoy_share") or []
    if not found:
        return []
    rows = [[f"`{r['system']}`" + (" †" if r["noisy"] > NOISY else ""), _number(r["envoy_us"]),
             _signed(r["envoy_over_floor_us"]), _number(r["server_us"]), f"{r['rps']:.0f}",
             "; ".join(r["problems"]) or "ok"] for r in found]
    return ["## What makes Envoy work harder (c=64, non-stream, cheap workers)", "",
            "The same Envoy bootstrap (route pd, ext_proc on) in front of floor-aio, three variants of it and our "
            "server, in the same interleaved rounds. `floor-aio-shape` sends our messages and nothing else of ours; "
            "`floor-aio-delay` holds each request without CPU; `floor-aio-burn` spends our own work's CPU without the "
            "hold. Whichever variant's Envoy moves towards ours is what makes Envoy work harder. CPU µs per request "
            "(utime+stime over the requests the workers counted); \"Envoy - floor-aio's\" is this row's Envoy "
            "minus floor-aio's Envoy; checks are the workers' counters for every round. " + NOISE_NOTE, "",
            *_table(["system", "Envoy CPU µs", "Envoy - floor-aio's", "server CPU µs", "req/s", "checks"], rows), ""]


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}"


def latency_tables(summary: dict[str, Any], options: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    present = {c.get("workers", "emulated") for c in summary["latency"]}
    for workers in (w for w in SET_ORDER if w in present):
        lines += set_tables(summary, workers, set_levels(options, workers))
    return lines


# The SGLang-side peer before smg replaced it, from `make bench` at c206eb2 (2026-12-01, AMD EPYC, 2 cores).
SGLANG_ROUTER_HISTORY = (
    "History: sglang-router 0.3.2, the peer here until smg 1.13 replaced it, measured by `make bench` at c206eb2 "
    "on an AMD EPYC with 2 cores: non-stream added p50 at c=1 0.33 ms, 3,974 req/s at c=64, 341 µs CPU per "
    "request at c=64; stream added p50 at c=1 43.93 ms (it held every streamed response for ~43 ms), 1,445 req/s "
    "at c=64. pd-extproc in the same run: non-stream 2.72 ms, 604 req/s, 1,812 µs + Envoy 830 µs.")


def set_tables(summary: dict[str, Any], workers: str, levels: Sequence[int]) -> list[str]:
    cells = _ordered(_of_set(summary["latency"], workers))
    headline = workers == "cheap"
    lines = [f"## {SET_TITLES[workers]}", "",
             *([SGLANG_ROUTER_HISTORY, ""] if workers == "cheap-sglang" else []),
             f"### Added latency over direct decode, p50 / p99 (ms), {workers}", "", NOISE_NOTE, ""]
    columns = ["system", *[f"c={level}" for level in levels]]
    for body in ("non-stream", "stream"):
        systems = [s for s in SYSTEM_ORDER if s != "direct"]
        lines += [f"**{body}**", "", *_table(columns, _by_concurrency(cells, body, levels, _added, systems)), ""]
    if headline:
        lines += ["![added p50 latency vs concurrency](added_latency.png)", ""]
    lines += [f"### Throughput (requests/s), {workers}", ""]
    for body in ("non-stream", "stream"):
        lines += [f"**{body}**", "", *_table(columns, _by_concurrency(cells, body, levels, _rps, SYSTEM_ORDER)), ""]
    if headline:
        lines += [f"### Absolute latency p50 / p99 (ms), {workers}", ""]
        for body in ("non-stream", "stream"):
            lines += [f"**{body}**", "",
                      *_table(columns, _by_concurrency(cells, body, levels, _absolute, SYSTEM_ORDER)), ""]
    lines += [f"### Proxy CPU time per request (µs, utime+stime / requests handled), {workers}", "",
              "`pd-extproc` is our server process alone (the issue's \"our server's CPU time per request\"); "
              "`envoy` is the Envoy in front of it.", ""]
    proxies = [s for s in SYSTEM_ORDER if s not in ("direct", "direct-prefill")]
    for body in ("non-stream", "stream"):
        lines += [f"**{body}**", "", *_table(columns, _by_concurrency(cells, body, levels, _cpu, proxies)), ""]
    return lines


def scaling(summary: dict[str, Any]) -> list[str]:
    """One vs two server processes (measured), and what N cores would give (a model from CPU per request)."""
    cells = _of_set(summary["latency"], "cheap")

    def cell(system: str) -> dict[str, Any] | None:
        return next((c for c in cells if c["system"] == system and c["body"] == "non-stream"
                     and c["concurrency"] == 64), None)

    one, two, router = cell("pd-extproc"), cell("pd-extproc-x2"), cell("vllm-router")
    if one is None or two is None or router is None:
        return []
    ours = sum(one["cpu_us_per_request"].values())
    ours_two = sum(two["cpu_us_per_request"].values())
    theirs = sum(router["cpu_us_per_request"].values())
    rows = [[str(n), f"{n / ours * 1e6:.0f}", f"{n / ours_two * 1e6:.0f}", f"{n / theirs * 1e6:.0f}",
             f"{theirs / ours:.2f}"] for n in (1, 2, 4, 8, 16)]
    return ["## Several server processes behind one Envoy (cheap workers, non-stream, c=64)", "",
            f"Measured here: one server process {one['rps']:.0f} req/s, two {two['rps']:.0f} req/s "
            f"({two['rps'] / one['rps']:.2f}x), on 2 cores that also run the workers, wrk and Envoy. CPU per P/D "
            f"request (all proxy processes): one server {ours:.0f} µs, two servers {ours_two:.0f} µs, vllm-router "
            f"{theirs:.0f} µs.", "",
            "Model: N cores given to the proxy alone (workers elsewhere), one server process per core, throughput "
            "= N / CPU per request (no contention between processes assumed: each P/D request is independent "
            "and Envoy spreads streams over the sockets). It is a ceiling, not a measurement.", "",
            *_table(["cores", "pd-extproc req/s (1-process CPU)", "pd-extproc req/s (2-process CPU)",
                     "vllm-router req/s", "ratio (ours / vllm-router)"], rows), ""]


def _median_of(points: list[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]) -> float | None:
    values = sorted(v for v in (value(p) for p in points) if v is not None)
    return values[len(values) // 2] if values else None


def breakdown(results: dict[str, Any]) -> list[str]:
    """Where a P/D request's time goes at concurrency 1, from wrk and from our server's own log."""
    rows = []
    for workers, body in ((w, b) for w in ("cheap", "emulated") for b in ("non-stream", "stream")):
        points = [p for p in results["points"] if p.get("phase") == "latency" and p["concurrency"] == 1
                  and p["body"] == body and p.get("workers", "emulated") == workers]

        def client(system: str, chosen: list[dict[str, Any]] = points) -> float | None:
            return _median_of([p for p in chosen if p["system"] == system], lambda p: p["p50_us"] / 1e3)

        ours = [p for p in points if p["system"] == "pd-extproc" and p.get("server")]
        held = _median_of(ours, lambda p: p["server"]["total_ms"])
        prefill_call = _median_of(ours, lambda p: p["server"]["prefill_ms"])
        total, router = client("pd-extproc"), client("vllm-router")
        if held is None or prefill_call is None or total is None:
            continue
        rows.append([workers, body, _ms(total), _ms(router), _ms(client("direct")), _ms(client("direct-prefill")),
                     _ms(held), _ms(prefill_call), _ms(held - prefill_call), _ms(total - held)])
    if not rows:
        return []
    return ["## Where a P/D request's time goes at concurrency 1 (ms, medians of per-round p50s)", "",
            "\"held by our server\" is `total_ms` from our server's own log line (request headers received to body "
            "reply sent, which includes waiting for Envoy to send the body); \"prefill call\" is its `prefill_ms`. "
            "\"Outside our server\" is the client's time minus the time our server held the request: Envoy, the "
            "gRPC messages, the decode leg with its KV pull, and the response back.", "",
            *_table(["workers", "mode", "pd-extproc (client)", "vllm-router (client)", "direct decode",
                     "direct prefill", "held by our server", "of it: prefill call", "of it: the rest",
                     "outside our server"], rows), ""]


def large_body(summary: dict[str, Any]) -> list[str]:
    cells = _ordered(summary["large_body"])
    if not cells:
        return []
    rows = [[c["system"], str(c["requests"]), f"{c['rps']:.2f}", f"{c['p50_ms']:.0f} / {c['max_ms']:.0f}",
             f"{_ms(c['added_p50_ms'])}", str(c["errors"]), _cpu_ms(c), "; ".join(c["problems"]) or "ok"]
            for c in cells]
    return ["## 20 MiB request body, concurrency 1 (emulated workers)", "",
            "A chat request whose one user message carries a text part and a ~20 MiB base64 `image_url` data "
            "URL; sent back to back on one connection (a fixed number per system and round, not a timed run, "
            "because one request can take seconds). CPU counts each process's children too (our inspection pool "
            "parses the body in its own process).", "",
            *_table(["system", "requests", "req/s", "p50 / max ms", "added p50 ms", "errors",
                     "CPU ms/request", "checks"], rows), ""]


def beside_large(results: dict[str, Any]) -> list[str]:
    points = [p for p in results["points"] if p.get("phase") == "beside-large"]
    if not points:
        return []
    rows = [[p["system"], f"{p['rps']:.0f}", f"{p['p50_us'] / 1e3:.1f} / {p['p99_us'] / 1e3:.1f} / "
             f"{p['max_us'] / 1e3:.0f}", str(p["errors"]), _ms(p["large_request_ms"]),
             "ok" if p["large_request_errors"] == 0 else "failed"] for p in points]
    seconds = results["options"]["beside_seconds"]
    return ["## One 20 MiB request in the middle of small P/D requests (emulated workers)", "",
            f"Small non-streaming P/D requests at c={points[0]['concurrency']} for {seconds} s; one 20 MiB request "
            f"is sent {seconds / 4:.0f} s in, on its own connection.", "",
            *_table(["system", "small req/s", "small p50 / p99 / max ms", "small failed", "20 MiB request ms",
                     "20 MiB status"], rows), ""]


def loop_stall_section(results: dict[str, Any]) -> list[str]:
    result = results.get("loop_stall")
    if not result:
        return []
    return [f"## One worst-shape {result['size_mib']} MiB body beside small P/D requests (bench/loop_stall.py)", "",
            "Tiny content parts (`{\"type\":\"text\",\"text\":\"x\"}`), the shape that costs the most to parse "
            "per byte; where the body's inspection runs decides what everything else on the server waits.", "",
            *loop_stall.render(result), ""]


def inflight(results: dict[str, Any]) -> list[str]:
    rows = []
    for case in results["inflight"]:
        held = case["in_flight_at_slow_worker"]
        for role, memory in case["memory"].items():
            growth = memory["peak_bytes"] - memory["baseline_bytes"]
            per_request = growth / held / KIB if held else float("nan")
            statuses = ", ".join(f"{'no answer' if str(status) == '0' else status}: {count}"
                                 for status, count in case["statuses"].items())
            rows.append([case["system"], case["slow_leg"], f"{case['ok']}/{case['sent']} ({statuses})", str(held),
                         role, f"{memory['baseline_bytes'] / MIB:.1f}", f"{memory['peak_bytes'] / MIB:.1f}",
                         f"{per_request:.1f}"])
    return ["## Memory with requests in flight (emulated workers)", "",
            "The slow worker delays each of the next N requests; the client sends N at once. \"Waiting\" is "
            "how many were waiting at the slow worker halfway through the delay. A slow prefill holds P/D "
            "requests in our server; a slow decode holds them in Envoy (our server is done once it has "
            "returned the rewritten body). Peak = kernel high-water mark (VmHWM, reset before the test).", "",
            *_table(["system", "slow leg", "answered 200", "waiting", "process", "baseline MiB", "peak MiB",
                     "growth KiB/request"], rows), ""]


def checks(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    rows = [[i.get("workers", "emulated"), i["system"], str(i["status"]), str(i["prefill_requests"]),
             str(i["decode_requests"]),
             " ".join(i["prefill_body_changes"]) or "-", " ".join(i["decode_body_changes"]) or "-",
             "; ".join(i["problems"]) or "ok"] for i in results["inspections"]]
    bad = [f"{c.get('workers', 'emulated')}/{c['system']} {c['body']} c={c['concurrency']}: {'; '.join(c['problems'])}"
           for c in summary["latency"] + summary["large_body"] if c["problems"]]
    return ["## Did every system really run both legs?", "",
            "One request per system, as each worker received it (body members added `+`, removed `-`, "
            "changed `~` compared with the client's body; a cheap worker records no bodies, only its leg counters):",
            "",
            *_table(["workers", "system", "status", "prefill requests", "decode requests", "prefill body",
                     "decode body", "checks"], rows), "",
            "Per measured point, from the workers' counters (KV pulls by decode, leases granted and freed by "
            "prefill, decode requests without a handoff; cheap workers: producer and consumer legs, distinct "
            "handoff ids): " + ("every point passed." if not bad else
                                                                 "problems: " + "; ".join(bad)), ""]


def envoy_outcomes(results: dict[str, Any]) -> list[str]:
    rows = [[name, entry["route"], str(entry["code"]), f"`{entry['details']}`", str(entry["count"])]
            for name, entries in results.get("envoy_outcomes", {}).items() for entry in entries]
    if not rows:
        return []
    return ["## Our Envoy's access log over the whole run", "",
            "Every request our Envoy served in this run, by route, status and Envoy's response-code details "
            "(code 0 = the client closed first: wrk abandons requests in flight when a run ends).", "",
            *_table(["envoy", "route", "status", "details", "requests"], rows), ""]


def fairness(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    ceiling = "; ".join(f"c={c['concurrency']}: {c['rps']:.0f} req/s with wrk using "
                        f"{c['loadgen_cpu_seconds'] / c['seconds']:.0%} of a core" for c in results["ceiling"])
    worst = max((c["loadgen_cpu_share"] for c in summary["latency"]), default=0.0)
    foreign = max((c["worst_foreign_cpu_share"] for c in summary["latency"]), default=0.0)
    points = [p for p in results["points"] if p.get("phase") == "latency"]
    retried = sum(1 for p in points if p.get("attempts", 1) > 1)
    return ["## Load generator and machine noise", "",
            f"- Load generator ceiling (plain Envoy answering by itself, no upstream): {ceiling}. Across "
            f"measured points wrk used at most {worst:.0%} of one core.",
            f"- CPU used by processes outside the benchmark: {results['foreign_cpu_share']:.1%} of the machine "
            f"over the whole run, at most {foreign:.0%} during any one kept point. Before starting, the run "
            f"waited {results['quiet_wait']['seconds']:.0f} s for a quiet machine. A point measured while other "
            f"processes used more than 10 % of the machine was measured again (up to twice, and for at most a "
            f"quarter of all points) and the quietest attempt kept; {retried} of {len(points)} points were "
            f"measured again.", ""]


def profile(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    data = results.get("profile") or {}
    if not data.get("samples"):
        return []
    run = summary["profile_run"][0] if summary["profile_run"] else None
    where = f" while serving {run['rps']:.0f} req/s at c={run['concurrency']}" if run else ""
    lines = ["## Where our server's CPU goes (py-spy)", "",
             f"{data['samples']} on-CPU samples of `pd-extproc serve` over {data['seconds']:.0f} s{where} "
             "(non-streaming P/D). Time in C extensions (grpc's Cython core, orjson, protobuf) is charged to the "
             "Python function that called it.", "",
             "By area (leaf-most matching frame):", "",
             *_table(["area", "share of samples"], [[name, f"{share:.1%}"] for name, share in data["categories"]]),
             "", "Top functions by own (self) samples:", "",
             *_table(["function", "self"], [[f"`{name}`", f"{share:.1%}"] for name, share in data["self_top"]]),
             "", "Our own functions, inclusive:", "",
             *_table(["function", "inclusive"], [[f"`{name}`", f"{share:.1%}"] for name, share in
                                                 data["inclusive_top"] if "extproc/" in name]), ""]
    return lines


def stage_budget(results: dict[str, Any]) -> list[str]:
    data = results.get("stages") or {}
    if not data:
        return []
    from bench.stages import StageResult, table
    result = StageResult(**data)
    return ["## Our server's CPU per P/D request, stage by stage (bench/stages.py)", "",
            f"Measured in the benchmark's own process after the latency rounds: our servicer, processor, vllm_nixl "
            f"adapter and prefill client built from Settings as `pd-extproc serve` builds them, fed the two ext_proc "
            f"messages of a non-streaming P/D request as bytes (no gRPC), {result.requests} requests one at a time "
            f"against the cheap prefill worker, {len(result.repeats)} runs (the median shown; totals "
            + ", ".join(f"{v:.0f}" for v in result.repeats) + " µs). CPU is the thread's clock around each stage, "
            "excluding stages nested in it; \"stream loop and glue\" is the total minus every stage. Not included: "
            "the gRPC server's own work per message (see floor-h2 above). Tracing off. The timing itself costs about "
            f"{result.instrumentation_us:.0f} µs per request, spread over the stages and the glue.", "",
            *_table(["stage", "CPU µs/request", "share", "wall µs/request", "calls/request"], table(result)), ""]


# The soak run RESULTS quotes (issue 27): the hour-long one, kept in git; bench/SOAK.md has every run.
SOAK_REPORT = Path(__file__).resolve().parent / "soak-reports" / "vllm-60min.json"


def soak(report: Path = SOAK_REPORT) -> list[str]:
    """The hour-long soak's figures, from its kept report (not measured by this benchmark run)."""
    title = "## An hour under load and faults (the soak, `make soak`; not part of this run)"
    if not report.exists():
        return [title, "", f"No soak report at `{report.name}`: run `make soak` (bench/SOAK.md).", ""]
    return [title, "", "From its kept report (`bench/soak-reports/" + report.name + "`); what each fault does and "
            "what is asserted: [SOAK.md](SOAK.md).", "", soak_markdown.render(json.loads(report.read_text()))]


def render(results: dict[str, Any], summary: dict[str, Any], command: str) -> str:
    lines = [*header(results, command), *validity(summary), *targets(summary), *envoy_share(summary),
             *floors(summary),
             *latency_tables(summary, results["options"]), *breakdown(results), *scaling(summary),
             *large_body(summary), *beside_large(results), *loop_stall_section(results),
             *sweep_markdown.render(summary.get("size_sweep") or {}, results["options"]),
             *inflight(results), *checks(results, summary),
             *envoy_outcomes(results), *fairness(results, summary), *profile(results, summary),
             *stage_budget(results), *soak()]
    return "\n".join(lines) + "\n"
