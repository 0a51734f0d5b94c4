"""tests/compose/docker_daemon.py puts back exactly what dockerd changed on the host, and nothing else.

AFTER_DOCKERD is what Debian's dockerd 20.10.24 leaves in the filter and nat tables (iptables-nft)
with its default bridge, recorded on this project's machine; BEFORE has podman's CNI chains, as after
the podman compose stage.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.compose import docker_daemon
from tests.compose.docker_daemon import HostState, differences, main, parse_save, undo

BEFORE = """\
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:CNI-FORWARD - [0:0]
-A FORWARD -m comment --comment "CNI firewall plugin rules" -j CNI-FORWARD
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
"""

DOCKERS_FILTER = """\
:DOCKER - [0:0]
:DOCKER-ISOLATION-STAGE-1 - [0:0]
:DOCKER-ISOLATION-STAGE-2 - [0:0]
:DOCKER-USER - [0:0]
-A FORWARD -j DOCKER-USER
-A FORWARD -j DOCKER-ISOLATION-STAGE-1
-A FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -o docker0 -j DOCKER
-A FORWARD -i docker0 ! -o docker0 -j ACCEPT
-A FORWARD -i docker0 -o docker0 -j ACCEPT
-A DOCKER-ISOLATION-STAGE-1 -i docker0 ! -o docker0 -j DOCKER-ISOLATION-STAGE-2
-A DOCKER-ISOLATION-STAGE-1 -j RETURN
-A DOCKER-ISOLATION-STAGE-2 -o docker0 -j DROP
-A DOCKER-ISOLATION-STAGE-2 -j RETURN
-A DOCKER-USER -j RETURN
"""

DOCKERS_NAT = """\
:DOCKER - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
"""

SOMEONE_ELSES = '-A FORWARD -m comment --comment "added meanwhile" -o cni-podman0 -j ACCEPT\n'

AFTER_DOCKERD = (BEFORE.replace(":FORWARD ACCEPT", ":FORWARD DROP")
                 .replace(":CNI-FORWARD - [0:0]\n", ":CNI-FORWARD - [0:0]\n" + DOCKERS_FILTER + SOMEONE_ELSES)
                 .replace(":POSTROUTING ACCEPT [0:0]\n", ":POSTROUTING ACCEPT [0:0]\n" + DOCKERS_NAT))

LINKS = frozenset({"lo", "eth0", "cni-podman0"})

EXPECTED_UNDO = [
    "iptables -t filter -D FORWARD -j DOCKER-USER",
    "iptables -t filter -D FORWARD -j DOCKER-ISOLATION-STAGE-1",
    "iptables -t filter -D FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    "iptables -t filter -D FORWARD -o docker0 -j DOCKER",
    "iptables -t filter -D FORWARD -i docker0 '!' -o docker0 -j ACCEPT",
    "iptables -t filter -D FORWARD -i docker0 -o docker0 -j ACCEPT",
    "iptables -t filter -F DOCKER",
    "iptables -t filter -F DOCKER-ISOLATION-STAGE-1",
    "iptables -t filter -F DOCKER-ISOLATION-STAGE-2",
    "iptables -t filter -F DOCKER-USER",
    "iptables -t filter -X DOCKER",
    "iptables -t filter -X DOCKER-ISOLATION-STAGE-1",
    "iptables -t filter -X DOCKER-ISOLATION-STAGE-2",
    "iptables -t filter -X DOCKER-USER",
    "iptables -t filter -P FORWARD ACCEPT",
    "iptables -t nat -D PREROUTING -m addrtype --dst-type LOCAL -j DOCKER",
    "iptables -t nat -D OUTPUT '!' -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER",
    "iptables -t nat -D POSTROUTING -s 172.17.0.0/16 '!' -o docker0 -j MASQUERADE",
    "iptables -t nat -F DOCKER",
    "iptables -t nat -X DOCKER",
    "ip link delete docker0",
    "sysctl -q -w net.ipv4.ip_forward=0",
]


def state(save: str, links: frozenset[str] = LINKS, ip_forward: str = "0") -> HostState:
    return HostState({("iptables", name): table for name, table in parse_save(save).items()}, links, ip_forward)


def test_parse_save_reads_policies_user_chains_and_rules() -> None:
    tables = parse_save(AFTER_DOCKERD)
    assert tables["filter"].chains["FORWARD"] == "DROP" and tables["filter"].chains["DOCKER-USER"] == "-"
    assert ("POSTROUTING", "-s 172.17.0.0/16 ! -o docker0 -j MASQUERADE") in tables["nat"].rules


def test_undo_removes_dockers_chains_rules_bridge_and_policy_and_nothing_else() -> None:
    after = state(AFTER_DOCKERD, LINKS | {"docker0", "br-0123456789ab", "vethabc"}, "1")
    commands = undo(state(BEFORE), after)
    assert commands == [*EXPECTED_UNDO[:-2], "ip link delete br-0123456789ab", *EXPECTED_UNDO[-2:]]
    assert not any("CNI" in command or "cni-podman0" in command for command in commands)


def test_a_table_that_did_not_exist_gets_the_policy_a_new_table_starts_with() -> None:
    """On a host where nothing used iptables, dockerd creates the filter table with FORWARD DROP."""
    created = state(AFTER_DOCKERD)
    assert "iptables -t filter -P FORWARD ACCEPT" in undo(HostState({}, LINKS, "0"), created)
    assert "iptables -t filter policy FORWARD DROP (was ACCEPT)" in differences(HostState({}, LINKS, "0"), created)


def test_what_existed_before_dockerd_started_stays() -> None:
    """A DOCKER-USER chain with an operator's rule (a daemon that ran before) is the host's state: kept."""
    kept = BEFORE.replace(":CNI-FORWARD - [0:0]\n", ":CNI-FORWARD - [0:0]\n:DOCKER-USER - [0:0]\n"
                          "-A DOCKER-USER -s 10.0.0.0/8 -j DROP\n-A FORWARD -j DOCKER-USER\n")
    commands = undo(state(kept), state(AFTER_DOCKERD))
    assert not any("DOCKER-USER" in command for command in commands)
    assert "iptables -t filter -X DOCKER" in commands


def test_differences_lists_what_is_left_and_nothing_once_put_back() -> None:
    before = state(BEFORE)
    left = differences(before, state(AFTER_DOCKERD, LINKS | {"docker0"}, "1"))
    assert set(left) == {"link docker0", "iptables -t filter chain DOCKER", "iptables -t filter chain DOCKER-USER",
                         "iptables -t filter chain DOCKER-ISOLATION-STAGE-1",
                         "iptables -t filter chain DOCKER-ISOLATION-STAGE-2", "iptables -t nat chain DOCKER",
                         "iptables -t filter policy FORWARD DROP (was ACCEPT)", "net.ipv4.ip_forward=1 (was 0)"}
    assert differences(before, before) == []


def test_a_daemon_that_cannot_start_fails_the_stage_with_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """dockerd exits at once (as it does on a host it cannot run on): exit status 1, the reason and
    dockerd's own words on stderr, the command never runs, and the host is put back all the same
    (restore is replaced here: this test must not touch the host's network)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, script in {"docker": "exit 1",  # no daemon answers
                         "dockerd": "echo 'failed to start daemon: planted failure' >&2; exit 1"}.items():
        (fake / name).write_text(f"#!/bin/sh\n{script}\n")
        (fake / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    restored: list[HostState] = []

    def restore(before: HostState) -> list[str]:  # instead of this host's network
        restored.append(before)
        return []

    monkeypatch.setattr(docker_daemon, "restore", restore)
    ran = tmp_path / "ran"
    assert main(["--log", str(tmp_path / "dockerd.log"), "--", "touch", str(ran)]) == 1
    err = capsys.readouterr().err
    assert "dockerd exited 1 before answering" in err and "failed to start daemon: planted failure" in err
    assert not ran.exists()
    assert len(restored) == 1, "what a failed dockerd left is put back too"
