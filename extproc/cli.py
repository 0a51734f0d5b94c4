"""pd-extproc serve | envoy-config | envoy | up | emulate.

``serve``, ``envoy-config`` and ``envoy`` are the product; ``up`` (the demo stack) and ``emulate`` (an
emulated engine) are the lab's (pd_extproc_lab), imported only when one of them runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import uvloop

from extproc import ready
from extproc._version import __version__
from extproc.adapters import EngineLoadError, by_engine, engines
from extproc.config import (
    ENVOY_ONLY_SETTINGS,
    ConfigError,
    Settings,
    add_arguments,
    load_settings,
    open_prefill_policy,
    specs,
)
from extproc.observability import logs
from extproc.protocol.settings_spec import ENV_PREFIX
from extproc.protocol.units import Address, parse_address

log = logging.getLogger("extproc.cli")
EXIT_CONFIG = 2
EXIT_RUNTIME = 1


def _settings(args: argparse.Namespace, environ: Mapping[str, str], consistent: bool = True) -> Settings:
    flags = {spec.name: getattr(args, spec.name, None) for spec in specs()}
    return load_settings(environ, flags, consistent)


def _provided(args: argparse.Namespace, environ: Mapping[str, str], name: str) -> bool:
    return getattr(args, name, None) is not None or (ENV_PREFIX + name.upper()) in environ


def cmd_serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ)
    refusal = open_prefill_policy(settings)
    if refusal:
        raise ConfigError(refusal)
    logs.configure(settings.log_level)
    from extproc.network_check import POD_IP_VARIABLE, network_warnings

    for warning in network_warnings(settings, environ.get(POD_IP_VARIABLE)):
        log.warning(warning)
    from extproc.app import ListenError, serve

    def announce(address: str, metrics_port: int) -> None:
        sys.stdout.write(ready.format_line(grpc=address, metrics=metrics_port) + "\n")
        sys.stdout.flush()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            if settings.workers > 1:  # a supervisor and N worker processes (docs/workers.md)
                from extproc.supervisor import supervise

                return runner.run(supervise(settings, announce))
            runner.run(serve(settings, announce))
    except ListenError as exc:
        sys.stderr.write(f"pd-extproc serve: {exc}\n")
        return EXIT_RUNTIME
    return 0


def cmd_envoy_config(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ)
    if args.parts:
        from extproc.envoy.parts import render_parts_yaml

        try:
            ext_proc_address = parse_address(args.ext_proc_address) if args.ext_proc_address else None
        except ValueError as exc:
            raise ConfigError(f"--ext-proc-address: {exc}") from None
        text = render_parts_yaml(settings, args.decode_cluster, args.route_name, ext_proc_address)
    elif settings.mode == "gateway":
        raise ConfigError("gateway mode has no bootstrap of its own (the gateway's Envoy is yours): use --parts")
    else:
        from extproc.envoy.bootstrap import render_yaml

        text = render_yaml(settings)
    if args.output:  # the decode pod's init container writes Envoy's bootstrap into a volume this way
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


ENVOY_HELP = """usage: pd-extproc envoy [ENVOY ARGUMENTS ...]

Run Envoy in the foreground with these arguments, passed to it unchanged (plus --admin-address-path).
On the first SIGTERM or SIGINT, drain Envoy's listeners, wait until no request is in flight or
PD_EXTPROC_DRAIN_TIMEOUT has passed, then stop Envoy; a second signal stops it at once.

The binary is PD_EXTPROC_ENVOY_BIN (default: envoy on PATH). Envoy's own options: {envoy_bin} --help
"""


def cmd_envoy(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from extproc.envoy import runner as envoy_runner

    if any(arg in ("-h", "--help") for arg in args.envoy_args):  # help even while a setting is wrong
        sys.stdout.write(ENVOY_HELP.format(envoy_bin=environ.get(ENV_PREFIX + "ENVOY_BIN", "envoy")))
        return 0
    settings = load_settings(environ)
    try:
        envoy_bin = envoy_runner.find_envoy(settings.envoy_bin)
    except envoy_runner.EnvoyNotFound as exc:
        sys.stderr.write(f"pd-extproc envoy: {exc}\n")
        return EXIT_RUNTIME
    return envoy_runner.run(envoy_bin, args.envoy_args, settings.drain_timeout)


LAB_EXTRA_MISSING = ("pd-extproc emulate: the emulated engines need the lab extra, which is not installed: "
                     "pip install 'pd-extproc[lab]'\n")


def cmd_emulate(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from pd_extproc_lab import emulator

    logging.basicConfig(level=logging.WARNING)
    tls = emulator.server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    args.side_channel = parse_address(args.side_channel, allow_port_zero=True)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(emulator.run(args.engine, args, parse_address(args.listen, allow_port_zero=True),
                                args.side_channel, tls))
    return 0


DEMO_PREFILL = "emulated-prefill"
DEMO_DECODE = "emulated-decode"
# Ports `up` picks itself (any free one) unless the operator set them.
_UP_PICKS = {"listen": "127.0.0.1:0", "envoy_admin": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}


def cmd_up(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ, consistent=False)  # bad values fail before the folder exists
    workdir = Path(tempfile.mkdtemp(prefix="pd-extproc-up-"))
    try:
        return _up(args, environ, settings, workdir)
    finally:
        if args.keep_logs:
            _say(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _up(args: argparse.Namespace, environ: Mapping[str, str], settings: Settings, workdir: Path) -> int:
    from pd_extproc_lab import process, stack

    # The demo may add settings of its own (a shared key), so the full check runs once they are in.
    workers, demo_env = _demo_workers(settings, workdir)
    environ = {**environ, **demo_env}
    settings = _settings(args, environ)
    refusal = open_prefill_policy(settings)
    if refusal:  # before any child starts: the server would refuse the same
        raise ConfigError(refusal)
    logs.configure(settings.log_level)
    running: stack.RunningStack | None = None
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        process.find_envoy(settings.envoy_bin)
        picks: dict[str, Any] = {}
        for name, pick in _UP_PICKS.items():
            address: Address = getattr(settings, name)
            if not _provided(args, environ, name):
                if name == "envoy_admin" and settings.envoy_stats_listen is not None:
                    pick = f"127.0.0.1:{process.free_port()}"  # the stats listener proxies to a known port
                picks[name] = parse_address(pick, allow_port_zero=True)
            elif process.port_in_use(address):
                raise process.StackError(f"{address} ({name}) is already in use; choose another with "
                                         f"--{name.replace('_', '-')}")
        if settings.envoy_stats_listen is not None and process.port_in_use(settings.envoy_stats_listen):
            raise process.StackError(f"{settings.envoy_stats_listen} (envoy_stats_listen) is already in use; "
                                     "choose another with --envoy-stats-listen")
        if not _provided(args, environ, "grpc_listen"):
            picks["grpc_listen"] = parse_address(f"unix:{workdir}/extproc.sock", allow_unix=True)
        settings = dataclasses.replace(settings, **picks)
        running = stack.start_stack(settings, workdir, workers=workers, env=environ, decode_worker=DEMO_DECODE)
        _print_ready(running, workdir)
        while not stop_requested:
            for child in running.children():
                if not child.alive():
                    raise process.StackError(f"{child.name} exited unexpectedly: {child.tail()}")
            time.sleep(0.2)
        _say("stopping")
        return 0
    except process.StackError as exc:
        sys.stderr.write(f"pd-extproc up: {exc}\n")
        return EXIT_RUNTIME
    finally:
        if running is not None:
            running.stop(grace=settings.drain_timeout, say=lambda name: _say(f"stopped {name}"), note=_say)


def _demo_workers(settings: Settings, workdir: Path) -> tuple[list[Any], dict[str, str]]:
    """With --demo: the configured engine's emulated prefill and decode workers, and the settings the
    engine's demo needs (e.g. a shared key both sides read)."""
    from pd_extproc_lab.emulator.worker import WorkerSpec

    if not settings.demo:
        return [], {}
    engine = engines().get(settings.adapter, engines()["vllm_nixl"])
    env: dict[str, str] = dict(engine.demo.env)
    args: tuple[str, ...] = ()
    if engine.demo.key_setting:
        key_file = workdir / "demo-shared.key"
        key_file.write_text(secrets.token_hex(32) + "\n")
        key_file.chmod(0o600)
        env[engine.demo.key_setting] = str(key_file)
        args = (engine.demo.key_flag, str(key_file))
    workers = [WorkerSpec(DEMO_PREFILL, "prefill", engine.engine, args),
               WorkerSpec(DEMO_DECODE, "decode", engine.engine, args)]
    return workers, env


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _print_ready(running: Any, workdir: Path) -> None:
    settings: Settings = running.settings
    prefill = running.workers.get(DEMO_PREFILL)
    decode = running.workers.get(DEMO_DECODE)
    fields: dict[str, object] = {"url": running.url, "decode": settings.decode, "metrics": running.metrics_url}
    if prefill is not None:
        fields["prefill"] = prefill.address
    fields["logs"] = workdir
    body = '{"model":"emulated","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}'
    target = prefill.address if prefill is not None else "<prefill-host>:<port>"
    lines = [
        ready.format_line(**fields),
        "P/D request:",
        f"  curl -sS {running.url}/v1/chat/completions -H 'content-type: application/json' "
        f"-H 'x-prefiller-host-port: {target}' -d '{body}'",
    ]
    if decode is not None:
        lines += ["decode worker metrics (its KV transfer counter):", f"  curl -sS {decode.url}/metrics"]
    lines.append("Ctrl-C stops everything.")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _engines_epilog() -> str:
    """The registered engines (plugins included) with their one-line summaries, for --help."""
    lines = [f"  {name}: {engine.summary or engine.engine}" for name, engine in engines().items()]
    return "engines (PD_EXTPROC_ADAPTER):\n" + "\n".join(lines) + "\n  none: the kill switch (P/D answered 501)"


def build_parser(emulator_engine: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``emulator_engine``, ``emulate`` also has that engine's emulator options."""
    parser = argparse.ArgumentParser(prog="pd-extproc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the ext_proc gRPC server", epilog=_engines_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # Only the settings the server reads; Envoy's are for envoy-config and up (the variables are still read).
    add_arguments(serve, [spec.name for spec in specs() if spec.name not in ENVOY_ONLY_SETTINGS])
    serve.set_defaults(run=cmd_serve)
    envoy_config = commands.add_parser("envoy-config", help="print the Envoy bootstrap for these settings")
    add_arguments(envoy_config)
    envoy_config.add_argument("--parts", action="store_true",
                              help="only what to add to an Envoy you already run (docs/install/own-envoy.md)")
    envoy_config.add_argument("--decode-cluster", default="decode",
                              help="with --parts, sidecar mode: your decode cluster, for the pd route")
    envoy_config.add_argument("--route-name", default="",
                              help="with --parts, gateway mode: the inference route's name (scopes the local replies)")
    envoy_config.add_argument("--ext-proc-address", default=None, metavar="HOST:PORT",
                              help="with --parts, gateway mode: the pd-extproc Service (resolved by DNS)")
    envoy_config.add_argument("--output", "-o", default="", metavar="FILE",
                              help="write to FILE instead of standard output")
    envoy_config.set_defaults(run=cmd_envoy_config)
    # Every argument is Envoy's (prefix_chars: none of ours, so `-c FILE` is not parsed here).
    envoy = commands.add_parser("envoy", help="run Envoy with these arguments; on SIGTERM drain it, then stop it",
                                add_help=False, prefix_chars="+")
    envoy.add_argument("envoy_args", nargs=argparse.REMAINDER, help="Envoy's own arguments")
    envoy.set_defaults(run=cmd_envoy)
    up = commands.add_parser("up", help="run Envoy and the server in the foreground")
    add_arguments(up)
    up.add_argument("--keep-logs", action="store_true",
                    help="keep the children's logs and files (a pd-extproc-up-* folder under $TMPDIR) after "
                         "stopping; by default the folder is deleted")
    up.set_defaults(run=cmd_up)
    emulate = commands.add_parser("emulate", help="run an emulated inference engine (tests and demo)")
    emulate.set_defaults(run=cmd_emulate)
    if emulator_engine is not None:  # only when `emulate` is the command: its options are the lab's
        from pd_extproc_lab.emulator import add_arguments as add_emulator_arguments

        add_emulator_arguments(emulate, tuple(by_engine()), emulator_engine)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; ``emulate`` also takes the chosen engine's own emulator options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    engine = None
    # The emulators' HTTP stack is the `lab` extra, not a runtime dependency; their options import it.
    if argv[:1] == ["emulate"] and importlib.util.find_spec("aiohttp") is None:
        sys.stderr.write(LAB_EXTRA_MISSING)
        sys.exit(EXIT_CONFIG)
    if argv[:1] == ["emulate"]:
        first = argparse.ArgumentParser(add_help=False)
        first.add_argument("--engine", default="vllm")
        engine = first.parse_known_args(argv[1:])[0].engine
        if engine not in by_engine():
            engine = "vllm"  # argparse then refuses the --engine value with the choices
    return build_parser(engine).parse_args(argv)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    try:
        args = _parse(argv)
        return int(args.run(args, os.environ if environ is None else environ))
    except (ConfigError, EngineLoadError) as exc:
        sys.stderr.write(f"pd-extproc: {exc}\n")
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
