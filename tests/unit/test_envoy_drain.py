"""`pd-extproc envoy`'s drain: the line it says once Envoy's listeners drain, and only then."""

from __future__ import annotations

from extproc.envoy.runner import EnvoyAdmin, drain


class ScriptedAdmin(EnvoyAdmin):
    """Envoy's admin endpoint as the drain sees it: each call recorded, requests in flight scripted."""

    def __init__(self, in_flight: list[int], reachable: bool = True) -> None:
        super().__init__("127.0.0.1:1")
        self.in_flight = in_flight
        self.reachable = reachable
        self.calls: list[str] = []

    def drain_listeners(self) -> None:
        if not self.reachable:
            raise ConnectionRefusedError("admin gone")
        self.calls.append("drain_listeners")

    def active_requests(self) -> int:
        self.calls.append("active_requests")
        return self.in_flight.pop(0)


def test_the_line_comes_after_the_listeners_drain_and_before_the_wait() -> None:
    admin = ScriptedAdmin([1, 1, 0])
    said: list[str] = []
    drain(admin, 120.0, lambda line: said.append(f"{line} after {admin.calls}"))
    assert said == ["draining Envoy: waiting up to 120 s for the requests in flight after ['drain_listeners']"]
    assert admin.calls == ["drain_listeners", "active_requests", "active_requests", "active_requests"]


def test_no_line_when_the_admin_endpoint_is_gone() -> None:
    said: list[str] = []
    drain(ScriptedAdmin([], reachable=False), 120.0, said.append)
    assert said == []
