"""The soak's pure checks (bench/soak_checks.py, bench/soak_load.py): each one can fail."""

from __future__ import annotations

import orjson

from bench.soak_checks import Window, client_tally, compare_server, ledger, slope_per_hour, verdict
from bench.soak_load import Outcome, classify_error, documented_statuses
from extproc.protocol.errors import SPEC


def _outcome(tag: str, label: str, kind: str = "pd_chat", status: int | None = 200, **kw: object) -> Outcome:
    return Outcome(tag, kind, True, 10.0, 11.0, status, label, **kw)  # type: ignore[arg-type]


def _ours(code: str, status: int) -> bytes:
    return orjson.dumps({"error": {"message": "m", "type": SPEC[code].type, "param": None, "code": code}})  # type: ignore[index]


def test_every_code_of_the_table_is_read_and_statuses_outside_it_are_undocumented() -> None:
    statuses = documented_statuses()
    assert set(statuses) == {code.value for code in SPEC}
    assert classify_error(502, _ours("prefill_upstream_unavailable", 502)) == ("prefill_upstream_unavailable", "")
    assert classify_error(503, _ours("prefill_upstream_error", 503)) == ("prefill_upstream_error", "")
    assert classify_error(500, _ours("prefill_upstream_unavailable", 500))[1]
    assert classify_error(500, b'{"error": {"code": "made_up"}}')[1]
    assert classify_error(500, b"<html>")[1]
    assert classify_error(500, b'{"error": {"message": "x", "type": "E", "param": null, "code": 500}}') == \
        ("engine_500", "")


def test_an_error_is_excused_only_by_a_fault_it_overlapped() -> None:
    hung = _outcome("a", "prefill_upstream_timeout", status=504)
    assert verdict(hung, [])
    assert verdict(hung, [Window("decode_5xx", 0.0, 20.0)])
    assert not verdict(hung, [Window("prefill_hang", 9.0, 10.5)])
    assert verdict(hung, [Window("prefill_hang", 100.0, 101.0)]), "a later fault excuses nothing"
    refused = _outcome("b", "prefill_upstream_timeout", kind="refuse_n", status=504)
    assert verdict(refused, [Window("prefill_hang", 9.0, 10.5)]), "a refusal never reaches the prefill"
    assert not verdict(_outcome("c", "unsupported_pd_variant", kind="refuse_n", status=400), [])
    assert verdict(_outcome("d", "ok", problem="content is not this request's"), [])


def test_the_ledger_finds_crossed_orphaned_and_doubly_granted_handoffs() -> None:
    outcomes = {t: _outcome(t, "ok") for t in ("a", "b", "c")}
    outcomes["d"] = _outcome("d", "disconnected", disconnected=True)
    good = ledger([("a", "h1"), ("b", "h2"), ("d", "h4")], [("a", "h1", True), ("b", "h2", True)], outcomes, False)
    assert (good.crossed, good.orphaned, good.double_grants, good.pulled) == ([], [], [], 2)
    assert good.unpulled_by_label == {"disconnected": 1}
    crossed = ledger([("a", "h1"), ("b", "h2")], [("a", "h2", True), ("b", "h1", True)], outcomes, False)
    assert len(crossed.crossed) == 2
    orphaned = ledger([("c", "h3")], [], outcomes, False)
    assert orphaned.orphaned and "c" in orphaned.orphaned[0]
    assert ledger([("a", "h1"), ("a", "h9")], [], outcomes, False).double_grants == ["a"]
    assert ledger([], [("a", "h1", True)], outcomes, True).unverifiable == 1


def test_our_counters_must_match_the_clients_tally() -> None:
    tally = client_tally([_outcome("a", "ok"), _outcome("b", "prefill_upstream_timeout", status=504),
                          _outcome("c", "engine_500", status=500)])
    assert compare_server({"ok": 2, "prefill_upstream_timeout": 1}, tally) == []
    assert compare_server({"ok": 2, "prefill_upstream_timeout": 2}, tally)
    assert compare_server({"ok": 1, "prefill_upstream_timeout": 1}, tally)


def test_the_slope_is_per_hour_and_needs_three_points() -> None:
    assert slope_per_hour([(0, 10), (60, 10)]) is None
    assert slope_per_hour([(0, 10), (1800, 15), (3600, 20)]) == 10.0


def test_a_client_that_left_may_be_counted_under_the_answer_it_missed_once() -> None:
    tally = client_tally([_outcome("a", "ok"), _outcome("b", "disconnected", disconnected=True)])
    assert compare_server({"ok": 1, "prefill_upstream_unavailable": 1}, tally) == []
    assert compare_server({"ok": 1, "cancelled": 1}, tally) == []
    assert compare_server({"ok": 1, "cancelled": 1, "prefill_upstream_unavailable": 1}, tally)
