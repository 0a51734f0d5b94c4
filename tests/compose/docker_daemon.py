"""Docker Engine for the compose stage, run the way systemd would run it, and the host's network put
back as it was afterwards.

    .venv/bin/python -m tests.compose.docker_daemon [--log FILE] -- COMMAND...

If a Docker daemon answers already (``docker info``), COMMAND runs against it and nothing else is
touched. Otherwise this records the host state dockerd changes, starts ``dockerd`` (default flags:
overlay2, the default bridge, iptables) in its own session with its output in FILE, waits until
``docker info`` answers, runs COMMAND, stops dockerd by its PID (SIGTERM; dockerd stops the
containerd it started) and then undoes what dockerd leaves behind when it stops (measured with
Debian's docker.io 20.10.24 on this project's machines):

- the chains it creates (DOCKER, DOCKER-USER, DOCKER-ISOLATION-STAGE-1/2) and every rule that jumps
  to them or names its bridges, in every iptables/ip6tables table;
- the FORWARD policy it sets to DROP (every built-in chain's policy goes back to what it was);
- its bridges (docker0, and br-<id> of a network left behind);
- net.ipv4.ip_forward, which it sets to 1.

Only what dockerd added goes: a chain or rule that existed before it started stays, and so does
anything another program (podman's CNI plugins, say) adds meanwhile. The exit status is COMMAND's;
if dockerd cannot start, or the host cannot be put back, it is 1 with the reason (and the end of
dockerd's log), never a silent skip.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT = 60.0  # dockerd answers in 0.6-1.5 s on an idle 2-core machine
STOP_TIMEOUT = 60.0  # dockerd stops running containers (10 s each) and its containerd
LOG_TAIL = 40
DOCKER_CHAIN = re.compile(r"^DOCKER(-|$)")
DOCKER_LINK = re.compile(r"^(docker0|br-[0-9a-f]{12})$")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class DaemonError(RuntimeError):
    """dockerd could not be started or stopped, or the host could not be put back."""


# --- the host state dockerd changes ---------------------------------------------------------------

@dataclass(frozen=True)
class Table:
    """One table of ``iptables-save``: chain -> policy ("-" for a user chain), and its rules."""

    chains: dict[str, str]
    rules: tuple[tuple[str, str], ...]  # (chain, the rule's arguments after ``-A CHAIN``)


@dataclass(frozen=True)
class HostState:
    tables: dict[tuple[str, str], Table]  # (iptables | ip6tables, table) -> Table
    links: frozenset[str]
    ip_forward: str


def parse_save(text: str) -> dict[str, Table]:
    """``iptables-save`` output, by table."""
    tables: dict[str, Table] = {}
    name = ""
    chains: dict[str, str] = {}
    rules: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.startswith("*"):
            name, chains, rules = line[1:], {}, []
        elif line.startswith(":"):
            chain, policy = line[1:].split()[:2]
            chains[chain] = policy
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            rules.append((chain, spec))
        elif line == "COMMIT":
            tables[name] = Table(chains, tuple(rules))
    return tables


def _run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def host_state() -> HostState:
    tables: dict[tuple[str, str], Table] = {}
    for tool in ("iptables", "ip6tables"):
        if shutil.which(f"{tool}-save") is None:
            continue
        saved = _run([f"{tool}-save"])
        if saved.returncode != 0:
            raise DaemonError(f"{tool}-save failed: {saved.stderr.strip()}")
        tables.update({(tool, table): content for table, content in parse_save(saved.stdout).items()})
    links = _run(["ip", "-o", "link", "show"]).stdout
    names = frozenset(line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line)
    return HostState(tables, names, IP_FORWARD.read_text().strip())


def dockers_rules(before: Table | None, after: Table, links: set[str]) -> list[tuple[str, str]]:
    """Rules in pre-existing chains that dockerd added: they jump to a chain dockerd created or name
    one of its bridges."""
    old_chains = before.chains if before else {}
    old_rules = set(before.rules) if before else set()
    new_chains = {c for c in after.chains if c not in old_chains and DOCKER_CHAIN.match(c)}
    found = []
    for chain, spec in after.rules:
        if chain in new_chains or (chain, spec) in old_rules:
            continue
        words = set(shlex.split(spec))
        if words & new_chains or words & links:
            found.append((chain, spec))
    return found


def policy_before(was: Table | None, chain: str, now: str) -> str:
    """A built-in chain's policy before dockerd started. A table that did not exist then (iptables-nft on a
    host where nothing used iptables yet) passed everything: ACCEPT, the policy a new table starts with."""
    if was is None:
        return "ACCEPT"
    return was.chains.get(chain, now)


def undo(before: HostState, after: HostState) -> list[str]:
    """The commands that put back what dockerd changed between ``before`` and ``after``."""
    links = {name for name in after.links - before.links if DOCKER_LINK.match(name)}
    commands: list[list[str]] = []
    for (tool, table), now in after.tables.items():
        was = before.tables.get((tool, table))
        old_chains = was.chains if was else {}
        new_chains = [c for c in now.chains if c not in old_chains and DOCKER_CHAIN.match(c)]
        for chain, spec in dockers_rules(was, now, links):
            commands.append([tool, "-t", table, "-D", chain, *shlex.split(spec)])
        commands += [[tool, "-t", table, "-F", chain] for chain in new_chains]
        commands += [[tool, "-t", table, "-X", chain] for chain in new_chains]
        for chain, policy in now.chains.items():
            if policy != "-" and policy_before(was, chain, policy) != policy:
                commands.append([tool, "-t", table, "-P", chain, policy_before(was, chain, policy)])
    commands += [["ip", "link", "delete", name] for name in sorted(links)]
    if after.ip_forward != before.ip_forward:
        commands.append(["sysctl", "-q", "-w", f"net.ipv4.ip_forward={before.ip_forward}"])
    return [shlex.join(command) for command in commands]


def differences(before: HostState, now: HostState) -> list[str]:
    """What of dockerd's changes is still there (empty once the host is as it was)."""
    left = [f"link {name}" for name in now.links - before.links if DOCKER_LINK.match(name)]
    for (tool, table), current in now.tables.items():
        was = before.tables.get((tool, table))
        old_chains = was.chains if was else {}
        left += [f"{tool} -t {table} chain {c}" for c in current.chains
                 if c not in old_chains and DOCKER_CHAIN.match(c)]
        left += [f"{tool} -t {table} policy {c} {p} (was {policy_before(was, c, p)})"
                 for c, p in current.chains.items() if p != "-" and policy_before(was, c, p) != p]
    if now.ip_forward != before.ip_forward:
        left.append(f"net.ipv4.ip_forward={now.ip_forward} (was {before.ip_forward})")
    return left


def restore(before: HostState) -> list[str]:
    """Undo dockerd's changes; the commands run. Raises DaemonError if something is left."""
    commands = undo(before, host_state())
    failed = []
    for command in commands:
        result = _run(shlex.split(command))
        if result.returncode != 0:
            failed.append(f"{command}: {result.stderr.strip()}")
    left = differences(before, host_state())
    if left or failed:
        raise DaemonError("the host's network is not as it was before dockerd started:\n  "
                          + "\n  ".join(failed + left))
    return commands


# --- the daemon -----------------------------------------------------------------------------------

def answers() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20).returncode == 0
    return False


def tail(log: Path, lines: int = LOG_TAIL) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def start(log: Path) -> subprocess.Popen[bytes]:
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DaemonError("dockerd not found: install Debian's docker.io (make docker-tools)")
    if shutil.which("docker") is None:
        raise DaemonError("the docker CLI is not found: install Debian's docker.io (make docker-tools)")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen([dockerd], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while not answers():
        if process.poll() is not None:
            raise DaemonError(f"dockerd exited {process.returncode} before answering; {log}:\n{tail(log)}")
        if time.monotonic() > deadline:
            stop(process, log)
            raise DaemonError(f"dockerd did not answer `docker info` within {START_TIMEOUT:.0f} s; {log}:\n{tail(log)}")
        time.sleep(0.2)
    return process


def stop(process: subprocess.Popen[bytes], log: Path) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
        raise DaemonError(f"dockerd (pid {process.pid}) did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM; "
                          f"killed. {log}:\n{tail(log)}") from None


@contextlib.contextmanager
def running(log: Path) -> Iterator[str]:
    """A Docker daemon for the block: the one that answers, else one started here and stopped after,
    with the host's network put back. Yields what was done, for the caller's report."""
    if answers():
        yield "a Docker daemon answers already: used as it is, not stopped"
        return
    before = host_state()
    started = time.monotonic()
    try:
        process = start(log)  # a dockerd that exits at start may have made docker0 and its chains already
        try:
            yield f"dockerd (pid {process.pid}) started in {time.monotonic() - started:.1f} s, log {log}"
        finally:
            stop(process, log)
    finally:
        for command in restore(before):
            sys.stderr.write(f"docker_daemon: {command}\n")


def versions() -> str:
    server = _run(["docker", "version", "--format", "Engine {{.Server.Version}} (API {{.Server.APIVersion}}), "
                                                    "client {{.Client.Version}}"]).stdout.strip()
    compose = _run(["docker", "compose", "version", "--short"]).stdout.strip()
    return f"{server}, Compose {compose or '(no compose plugin)'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compose.docker_daemon", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=Path(".cache/dockerd.log"), help="dockerd's output")
    parser.add_argument("command", nargs="+", help="what to run while the daemon runs (after --)")
    args = parser.parse_args(argv)
    try:
        with running(args.log.resolve()) as how:
            sys.stderr.write(f"docker_daemon: {how}; {versions()}\n")
            sys.stderr.flush()
            return subprocess.run(args.command, check=False).returncode
    except DaemonError as exc:
        earlier = exc.__context__  # e.g. dockerd failed to start, and then the host could not be put back
        sys.stderr.write(f"docker_daemon: {exc}\n" + (f"docker_daemon: {earlier}\n" if earlier else ""))
        return 1


if __name__ == "__main__":
    sys.exit(main())
