"""``kvray serve``: check the command line, then run one of the three front ends (Ray Serve
with a separate ingress, Ray Serve with the ingress in the replica, or in this process)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from kvray.cli.flags import config_from_args, resolve_num_replicas
from kvray.cli.serve_lifecycle import run_bounded
from kvray.config import ConfigError, EngineConfig
from kvray.serve.options import check_servable

# Ray settings for the Serve front ends, set on the private cluster `kvray serve` starts
# (a variable already in the environment wins); the Helm chart and the `ray up` configs set
# them on every node. Ray Serve's gRPC transport between its proxy and the replicas and for
# deployment handles: each streamed token crosses both (about 1.06x the output tok/s).
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key-file`` (first line), ``--api-key`` or ``KVRAY_API_KEY``
    (argv is visible to every local user in ``ps``: prefer the file or the variable)."""
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


def _joins_a_cluster(args: argparse.Namespace) -> bool:
    return bool(args.address or os.environ.get("RAY_ADDRESS"))


def _set_private_cluster_env(args: argparse.Namespace) -> None:
    """Ray reads these at import; with 127.0.0.1 as node address every listener is loopback.
    Not when joining a cluster: there the driver must find its node by its own IP, and the
    cluster has its own settings (the chart and cluster configs set them)."""
    if _joins_a_cluster(args):
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, value in SERVE_ENV.items():  # the private cluster's Serve processes inherit it
        os.environ.setdefault(key, value)


def _warn_if_open(host: str, api_key: str | None) -> None:
    if api_key is None and not _is_loopback(host):
        print(f"kvray: WARNING: serving on {host} without an API key: anyone who can "
              "reach this address can use the model. Set KVRAY_API_KEY or --api-key-file "
              "(see docs/security.md).", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible API until SIGTERM or Ctrl-C, then drain and stop."""
    _set_private_cluster_env(args)
    from kvray.models.default_model import resolve_model_path, with_builtin_model
    from kvray.serve.options import served_model_name

    if args.model_positional is not None:
        args.model = args.model_positional
    args.num_replicas = resolve_num_replicas(args)
    config = with_builtin_model(config_from_args(args))
    api_key = resolve_api_key(args)
    model_path = resolve_model_path(config.model.model)
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    name = served_model_name(config, model_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _warn_if_open(args.host, api_key)
    check_servable(config)
    if args.ingress in ("process", "replica") and args.num_replicas != 1:
        raise ConfigError(f"--num-replicas {args.num_replicas}: --ingress {args.ingress} "
                          "serves one replica; use --ingress serve for data parallelism")
    if args.ingress == "process" and config.autoscaling.enabled:
        raise ConfigError(f"--max-replicas {config.autoscaling.max_replicas}: --ingress "
                          "process serves one replica; use --ingress serve to autoscale")
    from kvray.models.loader import check_parallel_layout

    par = config.parallel  # before a cluster reserves tp x pp workers for nothing
    check_parallel_layout(model_path, par.tensor_parallel_size, par.pipeline_parallel_size,
                          par.enable_expert_parallel)
    if args.ingress == "process":
        return _serve_in_process(args, config, model_path, name, api_key)
    return _serve_on_ray_serve(args, config, model_path, name, api_key)


def check_port_free(host: str, port: int) -> None:
    """ConfigError naming ``--port`` when ``host:port`` is already taken. Serve's proxy
    binds with SO_REUSEPORT, so a second server on a port in use started without an error
    and took part of the first one's connections; uvicorn (``--ingress process``) fails
    only after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(f"--port {port}: {host}:{port} is already in use (another "
                                  "server?); stop it or choose another port") from None
            # anything else (an address not on this machine, say) is the server's to report


def _serve_on_ray_serve(args: argparse.Namespace, config: EngineConfig, model_path: Path,
                        name: str, api_key: str | None) -> int:
    """``--ingress serve`` / ``replica``: the Serve app on a Ray cluster (joined with
    --address / RAY_ADDRESS, else a private one, stopped at exit)."""
    from kvray.actors.ray_executor import ensure_ray, stop_ray
    from kvray.cli.serve_lifecycle import ServeLifecycle
    from kvray.serve.app import build_serve_app
    from kvray.serve.options import ServeOptions, check_replicas

    options = ServeOptions(num_replicas=args.num_replicas, api_key=api_key,
                           ingress="replica" if args.ingress == "replica" else "separate")
    check_replicas(config, options)  # before a cluster starts
    if not _joins_a_cluster(args):  # a cluster's own Serve may hold the port: it reuses it
        check_port_free(args.host, args.port)
    scaling = config.autoscaling
    most = scaling.max_replicas if scaling.enabled else args.num_replicas
    replicas = (f"{scaling.min_replicas}-{scaling.max_replicas} replicas, autoscaled"
                if scaling.enabled else f"{args.num_replicas} replica(s)")
    world = config.parallel.world_size
    started = ensure_ray(args.address, num_cpus=max(8, most * (world + 1) + 2),
                         log_to_driver=True)
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"model": str(model_path)})})
    lifecycle = ServeLifecycle(name, config.server.drain_timeout_s,
                               on_shutdown=stop_ray if started else None,
                               log_stats=config.server.log_stats)
    lifecycle.run(lambda: build_serve_app(config, options), args.host, args.port, replicas)
    return 0


def _serve_in_process(args: argparse.Namespace, config: EngineConfig, model_path: Path,
                      name: str, api_key: str | None) -> int:
    """``--ingress process``: uvicorn and the engine here; a Ray cluster only for TP x PP
    workers (joined with --address / RAY_ADDRESS, else a private one, stopped at exit)."""
    from kvray.actors.executor import executor_backend
    from kvray.actors.ray_executor import ensure_ray, stop_ray
    from kvray.serve.process import serve_in_process

    check_port_free(args.host, args.port)  # before the model loads
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"model": str(model_path)})})
    world = config.parallel.world_size
    started = False
    if executor_backend(config) == "ray" or _joins_a_cluster(args):
        started = ensure_ray(args.address, num_cpus=max(4, world + 2), log_to_driver=True)
    try:
        return serve_in_process(config, name, args.host, args.port, api_key)
    except KeyboardInterrupt:
        print("kvray: stopped during start-up", flush=True)
        return 0
    finally:
        if started:
            run_bounded(stop_ray, 30, "ray shutdown")
