"""pd-extproc serve | envoy-config | envoy | up | emulate."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import uvloop

from extproc import logs
from extproc.config import ConfigError, Settings, add_arguments, load_settings
from extproc.units import parse_address, parse_duration

log = logging.getLogger("extproc.cli")
EXIT_CONFIG = 2
EXIT_RUNTIME = 1


def _settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    from extproc.config import SPECS

    flags = {spec.name: getattr(args, spec.name, None) for spec in SPECS}
    return load_settings(environ, flags)


def _provided(args: argparse.Namespace, environ: Mapping[str, str], name: str) -> bool:
    from extproc.config import ENV_PREFIX

    return getattr(args, name, None) is not None or (ENV_PREFIX + name.upper()) in environ


def cmd_serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ)
    logs.configure(settings.log_level)
    from extproc.server import serve

    def ready(address: str, metrics_port: int) -> None:
        sys.stdout.write(f"ready grpc {address} metrics {metrics_port}\n")
        sys.stdout.flush()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(settings, ready))
    return 0


def cmd_envoy_config(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from extproc.envoy_config import render_yaml

    sys.stdout.write(render_yaml(_settings(args, environ)))
    return 0


def cmd_envoy(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from extproc import envoy_runner

    settings = load_settings(environ)
    return envoy_runner.run(settings.envoy_bin, args.envoy_args, settings.drain_timeout)


def cmd_emulate(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from extproc import emulator

    logging.basicConfig(level=logging.WARNING)
    tls = emulator.server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(emulator.run(
            args.engine, args.role, parse_address(args.listen, allow_port_zero=True),
            parse_address(args.side_channel, allow_port_zero=True), args.model, args.worker_id,
            args.block_size, parse_duration(args.lease), tls, parse_duration(args.kv_timeout),
        ))
    return 0


def cmd_up(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from extproc import stack
    from extproc.envoy_config import render_yaml
    from extproc.units import Address

    settings = _settings(args, environ)
    logs.configure(settings.log_level)
    workdir = Path(tempfile.mkdtemp(prefix="pd-extproc-up-"))
    children: list[stack.Child] = []
    envoy: stack.EnvoyProcess | None = None
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        stack.find_envoy(settings.envoy_bin)
        for name in ("listen", "envoy_admin"):
            address: Address = getattr(settings, name)
            if _provided(args, environ, name) and stack.port_in_use(address):
                raise stack.StackError(f"{address} ({name}) is already in use; choose another with "
                                       f"--{name.replace('_', '-')}")
        if not _provided(args, environ, "envoy_admin"):
            settings = dataclasses.replace(settings, envoy_admin=Address("127.0.0.1", 0))
        if not _provided(args, environ, "listen") and stack.port_in_use(settings.listen):
            raise stack.StackError(f"{settings.listen} is already in use; choose another with --listen")
        prefill_hint = "<prefill-host>:<port>"
        base_env = {k: v for k, v in environ.items() if not k.startswith("PD_EXTPROC_")}
        if settings.demo:
            emulated = {}
            for role in ("prefill", "decode"):
                child = stack.python_child(f"emulated-{role}", [
                    "emulate", "--engine", "vllm", "--role", role, "--listen", "127.0.0.1:0",
                    "--worker-id", f"demo-{role}"], base_env, workdir)
                children.append(child)
                child.start()
            for child in children:
                emulated[child.name] = child.wait_ready(30).split()[1].removeprefix("http://")
            settings = dataclasses.replace(settings, decode=parse_address(emulated["emulated-decode"]))
            prefill_hint = emulated["emulated-prefill"]
        if not _provided(args, environ, "grpc_listen"):
            settings = dataclasses.replace(settings, grpc_listen=parse_address(
                f"unix:{workdir}/extproc.sock", allow_unix=True))
        server = stack.python_child("pd-extproc-serve", ["serve"], {**base_env, **stack.settings_env(settings)},
                                    workdir)
        children.append(server)
        server.start()
        server.wait_ready(30)
        config_path = workdir / "envoy.yaml"
        config_path.write_text(render_yaml(settings))
        envoy = stack.EnvoyProcess.launch(settings.envoy_bin, config_path, workdir)
        listen = envoy.wait_ready(30)
        _print_ready(listen, prefill_hint, settings, workdir)
        while not stop_requested:
            for child in [*children, envoy.child]:
                if not child.alive():
                    raise stack.StackError(f"{child.name} exited unexpectedly: {child.tail()}")
            time.sleep(0.2)
        sys.stdout.write("stopping\n")
        sys.stdout.flush()
        return 0
    except stack.StackError as exc:
        sys.stderr.write(f"pd-extproc up: {exc}\n")
        return EXIT_RUNTIME
    finally:
        _shutdown(envoy, children, settings.drain_timeout)


def _shutdown(envoy: object, children: Sequence[object], grace: float) -> None:
    """Envoy first (stop accepting, let in-flight requests finish), then our server, then workers."""
    from extproc import stack

    if isinstance(envoy, stack.EnvoyProcess) and envoy.child.alive() and envoy.admin:
        try:
            envoy.admin_post("/drain_listeners?graceful&inboundonly")
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and envoy.active_requests() > 0:
                time.sleep(0.1)
        except OSError:
            pass
    if isinstance(envoy, stack.EnvoyProcess):
        envoy.child.stop()
        _say(f"stopped {envoy.child.name}")
    for child in reversed(children):
        if isinstance(child, stack.Child):
            child.stop(timeout=grace + 5)
            _say(f"stopped {child.name}")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _print_ready(listen: str, prefill: str, settings: Settings, workdir: Path) -> None:
    body = '{"model":"emulated","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}'
    sys.stdout.write(
        f"ready http://{listen} (decode {settings.decode}, logs in {workdir})\n"
        f"P/D request:\n  curl -sS http://{listen}/v1/chat/completions -H 'content-type: application/json' "
        f"-H 'x-prefiller-host-port: {prefill}' -d '{body}'\n"
    )
    if settings.demo:
        sys.stdout.write(f"decode transfer counter:\n  curl -sS http://{settings.decode}/metrics | grep nixl_xfer\n")
    sys.stdout.write("Ctrl-C stops everything.\n")
    sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-extproc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the ext_proc gRPC server")
    add_arguments(serve)
    serve.set_defaults(run=cmd_serve)
    envoy_config = commands.add_parser("envoy-config", help="print the Envoy bootstrap for these settings")
    add_arguments(envoy_config)
    envoy_config.set_defaults(run=cmd_envoy_config)
    # Every argument is Envoy's (prefix_chars: none of ours, so `-c FILE` is not parsed here).
    envoy = commands.add_parser("envoy", help="run Envoy with these arguments; on SIGTERM drain it, then stop it",
                                add_help=False, prefix_chars="+")
    envoy.add_argument("envoy_args", nargs=argparse.REMAINDER, help="Envoy's own arguments")
    envoy.set_defaults(run=cmd_envoy)
    up = commands.add_parser("up", help="run Envoy and the server in the foreground")
    add_arguments(up)
    up.set_defaults(run=cmd_up)
    emulate = commands.add_parser("emulate", help="run an emulated inference engine (tests and demo)")
    emulate.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default="vllm")
    emulate.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    emulate.add_argument("--listen", default="127.0.0.1:0", help="HTTP host:port (port 0 = any free port)")
    emulate.add_argument("--side-channel", default="127.0.0.1:0",
                         help="KV side channel host:port: vLLM's NIXL side channel, SGLang's bootstrap server, "
                              "TensorRT-LLM's KV registry (prefill roles)")
    emulate.add_argument("--model", default="emulated")
    emulate.add_argument("--worker-id", default="")
    emulate.add_argument("--block-size", type=int, default=16)
    emulate.add_argument("--lease", default="30s", help="how long a producer holds unread KV blocks")
    emulate.add_argument("--kv-timeout", default="300s",
                         help="sglang: how long prefill waits for decode's claim and decode for prefill's room")
    emulate.add_argument("--tls-cert", default="", help="serve HTTPS with this certificate (PEM)")
    emulate.add_argument("--tls-key", default="", help="the certificate's key (PEM)")
    emulate.add_argument("--tls-client-ca", default="", help="require client certificates from this CA (mTLS)")
    emulate.set_defaults(run=cmd_emulate)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args, os.environ if environ is None else environ))
    except ConfigError as exc:
        sys.stderr.write(f"pd-extproc: {exc}\n")
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
