"""``kvray`` command line: ``setup``, ``generate``, ``serve``, ``cluster``, ``grafana``.

Every config key is also a flag (``block_size`` -> ``--block-size``); a flag overrides the
value from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvray.cli_flags import (
    _non_negative_float,
    _positive_int,
    add_config_flags,
    add_serve_arguments,
)
from kvray.config import FIELD_SECTION, ConfigError, EngineConfig, load_config


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {key: getattr(args, key, None) for key in FIELD_SECTION}
    return load_config(args.config, **overrides)


def _cmd_setup(args: argparse.Namespace) -> int:
    from kvray.default_model import setup_default_model

    setup_default_model(force=args.force)
    return 0


class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` at each record (tests and Ray replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging must never break generation
            self.handleError(record)


def show_kvray_info_on_stderr() -> None:
    """Print kvray's INFO lines (e.g. the dtype ``auto`` chose, and why) on stderr; idempotent."""
    logger = logging.getLogger("kvray")
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvray.engine.llm import LLM
    from kvray.sampling_params import SamplingParams

    show_kvray_info_on_stderr()
    config = config_from_args(args)
    llm = LLM(**{k: v for k, v in config.to_flat().items() if v is not None})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed_sampling)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key-file`` (first line), ``--api-key`` or ``KVRAY_API_KEY``
    (argv is visible to every local user in ``ps``: prefer the file or the variable)."""
    import os
    from pathlib import Path

    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip().splitlines()
        except OSError as err:
            raise ConfigError(f"--api-key-file: cannot read {args.api_key_file}: "
                              f"{err.strerror}") from None
        if not key or not key[0].strip():
            raise ConfigError(f"--api-key-file: {args.api_key_file} is empty")
        return key[0].strip()
    key = args.api_key or os.environ.get("KVRAY_API_KEY") or None
    if key is not None and not key.strip():
        raise ConfigError("--api-key / KVRAY_API_KEY is empty")
    return key.strip() if key else None


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Stop(BaseException):
    """SIGTERM arrived: drain and stop. A BaseException, like KeyboardInterrupt: the signal
    handler raises it wherever the main thread is, and an ``except Exception`` there (the
    throughput line's guard around its Ray calls) would otherwise swallow it, leaving the
    server admitting requests after a SIGTERM (seen once in CI)."""


# Ray settings for the Serve front ends, set on the private cluster `kvray serve` starts
# (a variable already in the environment wins); the Helm chart and the `ray up` configs set
# them on every node. Ray Serve's gRPC transport between its proxy and the replicas and for
# deployment handles (the ingress' calls to the engine replicas) instead of Ray actor calls:
# each streamed token crosses both. On a 2-core AVX2 EPYC, 32 requests at 16 streams,
# alternated fresh servers: 1.03-1.09x the output tok/s over six rounds (mean 1.06x); the
# proxy's half alone 1.02-1.06x.
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}

# SIGTERM state of `kvray serve` (main thread only). During start-up the first SIGTERM
# is only noted: the HTTP app may already be admitting requests before serve.run returns,
# so the server drains as soon as it is up; a second one stops it at once (a start-up
# that hangs). Once serving, the handler raises _Stop into the main loop.
_STOP_REQUESTED = False
_RAISE_ON_STOP = False


def _on_sigterm(signum, frame) -> None:
    """``kvray serve``'s SIGTERM handler: cancel Ray's crash-handler alarm, note the
    request, and unwind the main thread to the drain (see above for start-up)."""
    import signal

    global _STOP_REQUESTED
    signal.alarm(0)
    again, _STOP_REQUESTED = _STOP_REQUESTED, True
    if _RAISE_ON_STOP or again:
        raise _Stop


def proxy_location(host: str) -> str:
    """Where Serve runs HTTP proxies. By default one per node, each binding ``host``: a
    wildcard address exists on every node, a specific one (the head's IP, 127.0.0.1) only
    on one, and the other nodes' proxies fail to bind and restart forever. So: every node
    for a wildcard, else only the head (where ``kvray serve`` runs)."""
    import ipaddress

    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name: it names one machine
        wildcard = False
    return "EveryNode" if wildcard else "HeadOnly"


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import time

    # Ray reads this at import; with 127.0.0.1 as node address every listener is loopback.
    # Not when joining a cluster: there the driver must find its node by its own IP.
    if not (args.address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # The private cluster's Serve processes inherit it (a cluster we join has its own:
        # the chart and cluster configs set it).
        for key, value in SERVE_ENV.items():
            os.environ.setdefault(key, value)
    from kvray.default_model import resolve_model_path
    from kvray.serve.builder import build_app, served_model_name

    if args.model_positional is not None:
        args.model = args.model_positional
    config = config_from_args(args)
    api_key = resolve_api_key(args)
    model_path = resolve_model_path(config.model.model)
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    name = served_model_name(config, model_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if api_key is None and not _is_loopback(args.host):
        print(f"kvray: WARNING: serving on {args.host} without an API key: anyone who can "
              "reach this address can use the model. Set KVRAY_API_KEY or --api-key-file "
              "(see docs/security.md).", file=sys.stderr, flush=True)
    world = config.parallel.world_size
    if args.ingress in ("process", "replica") and args.num_replicas != 1:
        raise ConfigError(f"--num-replicas {args.num_replicas}: --ingress {args.ingress} "
                          "serves one replica; use --ingress serve for data parallelism")
    if args.ingress == "process":
        return _serve_in_process(args, config, model_path, name, api_key)
    from ray import serve  # (only here: the in-process front end needs no Ray Serve)

    from kvray.actors.ray_executor import ensure_ray, stop_ray

    started = ensure_ray(args.address, num_cpus=max(8, args.num_replicas * (world + 1) + 2),
                         log_to_driver=True)
    flat = {k: v for k, v in config.to_flat().items() if v is not None}
    flat["model"] = str(model_path)
    app_args = {**flat, "num_replicas": args.num_replicas, "api_key": api_key,
                "ingress": "replica" if args.ingress == "replica" else "separate"}

    # After ray.init, which installs its own SIGTERM handler (sys.exit, no drain).
    global _STOP_REQUESTED, _RAISE_ON_STOP
    _STOP_REQUESTED = _RAISE_ON_STOP = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        serve.start(http_options={"host": args.host, "port": args.port},
                    proxy_location=proxy_location(args.host))
        serve.run(build_app(app_args), name="kvray", route_prefix="/")
        print(f"kvray: serving {name} on http://{args.host}:{args.port}/v1 "
              f"({args.num_replicas} replica(s)); Ctrl-C or SIGTERM drains and stops",
              flush=True)
        try:
            _RAISE_ON_STOP = True  # then look: a SIGTERM during start-up drains now
            if _STOP_REQUESTED:
                raise _Stop
            _log_throughput(name, time)
        except (KeyboardInterrupt, _Stop):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one drain at a time
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            drain_s = config.server.drain_timeout_s
            # Bounded whatever state the cluster is in (a SIGTERM sent to the whole process
            # group also stops the raylet, and Ray calls then wait forever).
            _bounded(lambda: _drain(drain_s), drain_s + 30, "drain")
    except (KeyboardInterrupt, _Stop):
        print("kvray: stopped during start-up", flush=True)
    finally:
        # Ray's crash handler answers a SIGTERM with alarm(3) and then aborts the process,
        # mid-shutdown: cancel it, and take no second signal while stopping.
        signal.alarm(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("kvray: shutting down", flush=True)
        _bounded(serve.shutdown, 30, "serve shutdown")
        if started:
            stop_ray()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


def _serve_in_process(args: argparse.Namespace, config, model_path, name: str,
                      api_key: str | None) -> int:
    """``--ingress process``: uvicorn and the engine here; a Ray cluster only for TP x PP
    workers (joined with --address / RAY_ADDRESS, else a private one, stopped at exit)."""
    import os

    from kvray.actors.executor import executor_backend
    from kvray.actors.ray_executor import ensure_ray, stop_ray
    from kvray.serve.process import serve_in_process

    config = config.model_copy(update={"model": config.model.model_copy(
        update={"model": str(model_path)})})
    world = config.parallel.world_size
    started = False
    if executor_backend(config) == "ray" or args.address or os.environ.get("RAY_ADDRESS"):
        started = ensure_ray(args.address, num_cpus=max(4, world + 2), log_to_driver=True)
    try:
        return serve_in_process(config, name, args.host, args.port, api_key)
    except KeyboardInterrupt:
        print("kvray: stopped during start-up", flush=True)
        return 0
    finally:
        if started:
            _bounded(stop_ray, 30, "ray shutdown")


def _bounded(fn, timeout_s: float, what: str) -> None:
    """Run ``fn`` on a daemon thread for at most ``timeout_s``; report errors and overruns
    and go on (shutdown must finish even when Ray is half gone)."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run, name=f"kvray-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        print(f"kvray: {what} did not finish in {timeout_s:g} s; going on", flush=True)
    elif errors:
        print(f"kvray: {what} failed ({errors[0].__class__.__name__}); going on", flush=True)


def _drain(timeout_s: float) -> None:
    """Stop admission (new requests get 503 + Retry-After), let requests in flight finish
    for up to ``timeout_s``, then end the rest with an error."""
    import time

    from ray import serve

    print(f"kvray: draining (up to {timeout_s:g} s; new requests get 503)", flush=True)
    try:
        ingress = serve.get_app_handle("kvray")
        ingress.begin_drain.remote().result(timeout_s=10)
        llm = serve.get_deployment_handle("LLMServer", app_name="kvray")
    except Exception as err:
        print(f"kvray: could not drain ({err.__class__.__name__}); stopping", flush=True)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # the ingress counts exactly the requests it still serves
            busy = ingress.num_in_flight.remote().result(timeout_s=5)
        except Exception:
            busy = 1
        if busy == 0:
            time.sleep(0.6)  # the last chunks on their way to clients
            print("kvray: drained", flush=True)
            return
        time.sleep(0.25)
    print("kvray: drain deadline passed; aborting the requests still running", flush=True)
    try:
        ingress.abort_all.remote().result(timeout_s=10)
        llm.abort_all.remote().result(timeout_s=10)
        time.sleep(0.5)
    except Exception as err:
        print(f"kvray: abort failed ({err.__class__.__name__})", flush=True)


def _log_throughput(name: str, time_mod, period: float = 10.0) -> None:
    """Every ``period`` seconds, one line with generation throughput over all replicas."""
    import ray

    from kvray.engine.stats import throughput_line
    from kvray.serve.deployment import STATS_NAMESPACE

    last = None
    while True:
        time_mod.sleep(period)
        if _STOP_REQUESTED:  # a SIGTERM whose _Stop something below swallowed after all
            raise _Stop
        try:
            board = ray.get_actor("kvray-stats-kvray", namespace=STATS_NAMESPACE)
            snap = ray.get(board.snapshot.remote(), timeout=5)
        except Exception as err:  # a missing stats line must not stop the server
            print(f"kvray: stats unavailable ({err.__class__.__name__})", flush=True)
            continue
        total = sum(s.get("generation_tokens_total", 0) for _, s in snap)
        running = sum(s.get("num_running", 0) for _, s in snap)
        waiting = sum(s.get("num_waiting", 0) for _, s in snap)
        if last is not None:
            print(throughput_line(name, (total - last) / period, running, waiting), flush=True)
        last = total


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvray", description="LLM inference and serving engine on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    setup = sub.add_parser("setup", help="download and convert the built-in SmolLM2 model")
    setup.add_argument("--force", action="store_true", help="redo even if already set up")
    setup.set_defaults(func=_cmd_setup)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("--prompt", required=True, help="prompt text (the user turn with --chat)")
    gen.add_argument("--max-tokens", type=_positive_int, default=64,
                     help="most new tokens (default 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="0 = greedy (default)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--seed-sampling", type=int, default=None, metavar="N",
                     help="per-request sampling seed (reproducible output with temperature)")
    add_config_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    add_serve_arguments(srv)
    srv.set_defaults(func=_cmd_serve)

    from kvray.ops.cluster_check import add_cluster_parser
    from kvray.ops.grafana import add_grafana_parser

    add_cluster_parser(sub)
    add_grafana_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"kvray {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
