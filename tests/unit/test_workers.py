"""``serve --workers N``'s pure parts: the setting, each worker's address, the Envoy cluster that lists
them, the shared in-flight slots and decode-queue reading, and the merge of the workers' metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from extproc.config import ConfigError, load_settings
from extproc.envoy.bootstrap import EXT_PROC_CLUSTER, render
from extproc.envoy.parts import sidecar_parts
from extproc.observability.merge import combine, counters_only, merge_pages
from extproc.observability.metrics import Metrics
from extproc.plugin import FakeClock
from extproc.protocol.errors import Code, PdError
from extproc.protocol.units import parse_address
from extproc.workers import SharedAdmission, SharedBlock, SharedQueueReading, worker_listen, worker_listens


def test_one_worker_is_the_default() -> None:
    assert load_settings({}, {}).workers == 1


@pytest.mark.parametrize("env,problem", [
    ({"PD_EXTPROC_WORKERS": "0"}, "PD_EXTPROC_WORKERS: expected a positive integer"),
    ({"PD_EXTPROC_WORKERS": "-2"}, "PD_EXTPROC_WORKERS: expected a positive integer"),
    ({"PD_EXTPROC_WORKERS": "two"}, "PD_EXTPROC_WORKERS"),
    ({"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0"}, "fixed port or a Unix socket"),
    ({"PD_EXTPROC_WORKERS": "3", "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:65534"}, "past 65535"),
    ({"PD_EXTPROC_WORKERS": "1000", "PD_EXTPROC_GRPC_LISTEN": "unix:/run/x.sock"}, "must not exceed 256"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_worker_counts_refuse_to_start(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_settings(env, {})


def test_the_workers_flag_is_read() -> None:
    assert load_settings({}, {"workers": "4"}).workers == 4


def test_each_worker_has_its_own_address() -> None:
    unix = parse_address("unix:/run/pd/extproc.sock", allow_unix=True)
    assert [str(a) for a in worker_listens(unix, 2)] == ["unix:/run/pd/extproc.sock-0", "unix:/run/pd/extproc.sock-1"]
    assert str(worker_listen(parse_address("[::1]:50051"), 3)) == "[::1]:50054"


def _ext_proc_cluster(config: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in config["static_resources"]["clusters"] if c["name"] == EXT_PROC_CLUSTER)
    return found


def _endpoints(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["endpoint"]["address"] for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]


def test_envoy_lists_every_worker_least_request_each_health_checked() -> None:
    settings = load_settings({"PD_EXTPROC_WORKERS": "3", "PD_EXTPROC_GRPC_LISTEN": "0.0.0.0:50051"}, {})
    cluster = _ext_proc_cluster(render(settings))
    assert _endpoints(cluster) == [{"socket_address": {"address": "127.0.0.1", "port_value": port}}
                                   for port in (50051, 50052, 50053)]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["health_checks"][0]["grpc_health_check"]  # per endpoint: Envoy checks each host
    assert cluster["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    parts = sidecar_parts(settings)
    assert _endpoints(parts["clusters"][0]) == _endpoints(cluster), "--parts renders the same cluster"


def test_one_worker_renders_todays_cluster() -> None:
    cluster = _ext_proc_cluster(render(load_settings({"PD_EXTPROC_GRPC_LISTEN": "unix:/run/x.sock"}, {})))
    assert _endpoints(cluster) == [{"pipe": {"path": "/run/x.sock"}}]
    assert "lb_policy" not in cluster


def _blocks(tmp_path: Path, workers: int) -> tuple[SharedBlock, list[SharedBlock]]:
    """The supervisor's block and each worker's own mapping of it (as separate processes have)."""
    owner = SharedBlock.create(tmp_path / "block", workers)
    return owner, [SharedBlock(tmp_path / "block", workers) for _ in range(workers)]


def test_the_limit_counts_every_workers_requests(tmp_path: Path) -> None:
    owner, maps = _blocks(tmp_path, 2)
    first, second = (SharedAdmission(limit=2, block=maps[i], index=i) for i in range(2))
    first.enter()
    second.enter()
    assert owner.total() == 2 and list(owner.slots) == [1, 1]
    for admission in (first, second):
        with pytest.raises(PdError) as caught:
            admission.check()
        assert caught.value.code is Code.PD_OVERLOADED
        with pytest.raises(PdError):
            admission.enter()
    assert owner.total() == 2 and (first.inflight, second.inflight) == (1, 1), "a refused enter takes nothing"
    first.leave()
    assert list(owner.slots) == [0, 1] and first.inflight == 0
    second.enter()
    assert second.inflight == 2 and owner.total() == 2


def test_a_dead_workers_slot_is_zeroed(tmp_path: Path) -> None:
    owner, maps = _blocks(tmp_path, 2)
    dead = SharedAdmission(limit=1, block=maps[0], index=0)
    dead.enter()
    alive = SharedAdmission(limit=1, block=maps[1], index=1)
    with pytest.raises(PdError):
        alive.enter()
    owner.zero(0)
    alive.enter()
    assert owner.total() == 1


def test_a_draining_worker_refuses_with_shutting_down(tmp_path: Path) -> None:
    _, maps = _blocks(tmp_path, 1)
    admission = SharedAdmission(limit=5, block=maps[0], index=0, draining=True)
    with pytest.raises(PdError) as caught:
        admission.enter()
    assert caught.value.code is Code.PD_SHUTTING_DOWN and admission.inflight == 0


def test_the_shared_decode_queue_reading_ages_out(tmp_path: Path) -> None:
    owner, maps = _blocks(tmp_path, 2)
    clock = FakeClock(100.0)
    reader = SharedQueueReading(maps[1], limit=4, interval=1.0, clock=clock)
    assert reader.waiting is None and not reader.over_limit(), "no reading yet"
    SharedQueueReading.publish(maps[0], 9.0, 100.0)
    assert reader.waiting == 9.0 and reader.over_limit()
    SharedQueueReading.publish(maps[0], 4.0, 100.0)
    assert not reader.over_limit(), "at the limit is not over it"
    SharedQueueReading.publish(maps[0], 9.0, 100.0)
    clock.advance(3.5)
    assert reader.waiting is None and not reader.over_limit(), "older than three intervals refuses nothing"
    assert math.isnan(owner.reading[0]) is False


def _page(metrics: Metrics) -> str:
    return metrics.exposition().decode()


def _samples(page: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
            if line and not line.startswith("#")}


def test_merged_pages_sum_counters_histograms_and_gauges() -> None:
    one, two = Metrics(), Metrics()
    one.requests.inc(("vllm_nixl", "ok"), 3)
    two.requests.inc(("vllm_nixl", "ok"), 4)
    two.requests.inc(("vllm_nixl", "pd_overloaded"))  # a series only one worker has
    one.processing_seconds.observe(("vllm_nixl",), 0.0002)
    two.processing_seconds.observe(("vllm_nixl",), 0.02)
    one.inflight.set(2)
    two.inflight.set(5)
    two.decode_queue.set(7)  # worker 0's reading; the other worker's gauge stays NaN
    merged = _samples(merge_pages([_page(one), _page(two)]))
    assert merged['pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}'] == 7
    assert merged['pd_extproc_requests_total{adapter="vllm_nixl",outcome="pd_overloaded"}'] == 1
    assert merged['pd_extproc_processing_seconds_count{adapter="vllm_nixl"}'] == 2
    assert merged['pd_extproc_processing_seconds_bucket{adapter="vllm_nixl",le="0.00025"}'] == 1
    assert merged['pd_extproc_processing_seconds_bucket{adapter="vllm_nixl",le="+Inf"}'] == 2
    assert merged["pd_extproc_inflight_requests"] == 7
    assert merged["pd_extproc_decode_queue_waiting"] == 7
    assert [v for k, v in merged.items() if k.startswith("pd_extproc_build_info")] == [1.0]
    created = 'pd_extproc_requests_created{adapter="vllm_nixl",outcome="ok"}'
    assert merged[created] == min(_samples(_page(m))[created] for m in (one, two))


def test_merged_page_keeps_names_help_and_types() -> None:
    page = _page(Metrics())
    merged = merge_pages([page, page])
    assert [line for line in merged.splitlines() if line.startswith("#")] == \
        [line for line in page.splitlines() if line.startswith("#")]
    assert set(_samples(merged)) == set(_samples(page))


def test_nan_everywhere_stays_nan_and_one_page_is_itself() -> None:
    assert math.isnan(combine("pd_extproc_decode_queue_waiting", [math.nan, math.nan]))
    assert combine("pd_extproc_decode_queue_waiting", [math.nan, 3.0]) == 3.0
    page = _page(Metrics())
    assert _samples(merge_pages([page])).keys() == _samples(page).keys()
    assert merge_pages([]) == ""


def test_counters_keep_rising_when_a_worker_dies() -> None:
    """A dead worker's last scraped counts stay in the sum; what it counted after that scrape is
    absorbed by the clamp rather than exposed as a fall (which Prometheus would read as a reset)."""
    one, two = Metrics(), Metrics()
    one.requests.inc(("vllm_nixl", "ok"), 5)
    two.requests.inc(("vllm_nixl", "ok"), 3)
    one.inflight.set(4)
    high: dict[str, float] = {}
    key = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}'
    assert _samples(merge_pages([_page(one), _page(two)], high))[key] == 8
    last_of_two = _page(two)
    two.requests.inc(("vllm_nixl", "ok"), 2)  # counted after its last scrape, then it dies
    retired = counters_only(last_of_two)
    assert "pd_extproc_inflight_requests" not in retired and "build_info" not in retired, "counts only"
    replacement = Metrics()
    merged = _samples(merge_pages([_page(one), _page(replacement), retired], high))
    assert merged[key] == 8, "never below what was exposed"
    assert merged["pd_extproc_inflight_requests"] == 4, "gauges are the live workers' only"
    replacement.requests.inc(("vllm_nixl", "ok"), 1)
    assert _samples(merge_pages([_page(one), _page(replacement), retired], high))[key] == 9
    one.requests.inc(("vllm_nixl", "ok"), 1)
    assert _samples(merge_pages([_page(one), _page(replacement), retired], high))[key] == 10


def test_a_worker_retired_while_a_scrape_is_pending_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: worker 0 answers a /metrics scrape, then exits while worker 1's answer is still
    pending; its page went into the retired counts and was merged again from the scrape (10 + 5 shown
    as 25, and the clamp kept it there)."""
    import asyncio

    from extproc import supervisor
    from extproc.observability.httpserver import Request

    settings = load_settings({"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_GRPC_LISTEN": "unix:/tmp/pd-x.sock"}, {})
    boss = supervisor.Supervisor(settings)
    boss.ready = [True, True]
    key = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}'

    def page(count: int) -> str:
        metrics = Metrics()
        metrics.requests.inc(("vllm_nixl", "ok"), count)
        return _page(metrics)

    async def run() -> None:
        second_asked, second_may_answer = asyncio.Event(), asyncio.Event()
        counts = {boss.roles[0].metrics_socket: 10, boss.roles[1].metrics_socket: 5}

        async def scrape(path: Path) -> str:
            if path == boss.roles[1].metrics_socket:
                second_asked.set()
                await second_may_answer.wait()
            return page(counts[path])

        monkeypatch.setattr(supervisor, "scrape_unix", scrape)
        pending = asyncio.create_task(boss._http(Request("GET", "/metrics", [], b"", "test")))
        await second_asked.wait()  # the scrapes run in order: worker 0's answered without waiting
        assert 0 in boss._last_pages
        boss.ready[0] = False  # worker 0 exits: what its keeper does
        boss._retire(0)
        second_may_answer.set()
        first = await pending
        assert _samples(first.body.decode())[key] == 15
        boss.ready[0], counts[boss.roles[0].metrics_socket] = True, 0  # its replacement starts from 0
        second = await boss._http(Request("GET", "/metrics", [], b"", "test"))
        assert _samples(second.body.decode())[key] == 15

    try:
        asyncio.run(run())
    finally:
        boss.close()
