"""``kvray serve`` on Ray Serve from start-up to shutdown: SIGTERM or Ctrl-C drain it.

The drain belongs to the driver that started the cluster: it stops admission at the ingress,
waits for the requests the ingress still counts, aborts what is left at the deadline, and
every shutdown step is bounded whatever state the cluster is in.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

APP_NAME = "kvray"  # the Serve application `kvray serve` runs


class ServeStop(BaseException):
    """SIGTERM arrived: drain and stop. A BaseException, like KeyboardInterrupt: the signal
    handler raises it wherever the main thread is, and an ``except Exception`` there (the
    throughput line's guard around its Ray calls) would otherwise swallow it, leaving the
    server admitting requests after a SIGTERM (seen once in CI)."""


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


def last_exception_line(text: str) -> str | None:
    """The ``SomeError: message`` line a traceback ends with: the exception raised (a
    chained traceback prints its causes first)."""
    found = None
    for line in text.splitlines():
        head = line.strip().split(":", 1)[0]
        if head.rsplit(".", 1)[-1].endswith(("Error", "Exception")) and ":" in line \
                and " " not in head:
            found = line.strip()
    return found


def replica_start_error() -> str | None:
    """Why the app's replicas failed to start (a config the model cannot run, say), as the
    replica raised it; None when Serve reports no failed deployment."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:
        return None
    for deployment in (app.deployments.values() if app is not None else ()):
        line = last_exception_line(deployment.message or "")
        if line is not None:
            return line
    return None


def run_bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Run ``fn`` on a daemon thread for at most ``timeout_s``; report errors and overruns
    and go on (shutdown must finish even when Ray is half gone)."""
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


def _ignore_stop_signals() -> None:
    """One drain, one shutdown: no second SIGTERM or Ctrl-C interrupts them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ServeLifecycle:
    """Start the Serve app, log throughput until SIGTERM or Ctrl-C, drain, shut down.

    Construct and :meth:`run` it on the main thread after ``ray.init`` (which installs its
    own SIGTERM handler: ``sys.exit``, no drain). During start-up the first SIGTERM is only
    noted: the HTTP app may already admit requests before ``serve.run`` returns, so the
    server drains as soon as it is up; a second one stops a start-up that hangs. Once
    serving, the handler raises :class:`ServeStop` into the main thread.
    """

    def __init__(self, model_name: str, drain_timeout_s: float,
                 on_shutdown: Callable[[], None] | None = None, log_stats: bool = True
                 ) -> None:
        self.model_name = model_name
        self.log_stats = log_stats  # the throughput line every 10 s
        self.drain_timeout_s = drain_timeout_s
        self.on_shutdown = on_shutdown  # after Serve is down (stop a private cluster)
        self.stop_requested = False  # a SIGTERM arrived
        self.serving = False  # up: a SIGTERM now raises ServeStop at once

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: cancel Ray's crash-handler alarm, note the request, and
        unwind the main thread to the drain (during start-up: only on a second one)."""
        signal.alarm(0)
        again, self.stop_requested = self.stop_requested, True
        if self.serving or again:
            raise ServeStop

    def run(self, build_app: Callable[[], Any], host: str, port: int,
            replicas: str) -> None:
        """Serve ``build_app()`` on ``host:port`` until stopped, then drain and shut down."""
        previous = signal.signal(signal.SIGTERM, self.on_sigterm)
        try:
            self._start(build_app, host, port, replicas)
            self._serve_until_stopped()
        except (KeyboardInterrupt, ServeStop):
            print("kvray: stopped during start-up", flush=True)
        finally:
            self._shut_down(previous)

    def _start(self, build_app: Callable[[], Any], host: str, port: int,
               replicas: str) -> None:
        from ray import serve

        serve.start(http_options={"host": host, "port": port},
                    proxy_location=proxy_location(host))
        try:
            serve.run(build_app(), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:  # Serve says only that a deployment failed
            cause = replica_start_error()
            if cause is None:
                raise
            raise RuntimeError(f"the model replica failed to start: {cause}") from err
        print(f"kvray: serving {self.model_name} on http://{host}:{port}/v1 "
              f"({replicas}); Ctrl-C or SIGTERM drains and stops", flush=True)

    def _serve_until_stopped(self) -> None:
        try:
            self.serving = True  # then look: a SIGTERM during start-up drains now
            if self.stop_requested:
                raise ServeStop
            self.log_throughput()
        except (KeyboardInterrupt, ServeStop):
            _ignore_stop_signals()
            # Bounded whatever state the cluster is in (a SIGTERM sent to the whole process
            # group also stops the raylet, and Ray calls then wait forever).
            run_bounded(self._drain, self.drain_timeout_s + 30, "drain")

    def _shut_down(self, previous: Any) -> None:
        from ray import serve

        # Ray's crash handler answers a SIGTERM with alarm(3) and then aborts the process,
        # mid-shutdown: cancel it, and take no second signal while stopping.
        signal.alarm(0)
        _ignore_stop_signals()
        print("kvray: shutting down", flush=True)
        run_bounded(serve.shutdown, 30, "serve shutdown")
        if self.on_shutdown is not None:
            self.on_shutdown()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _drain(self) -> None:
        """Stop admission (new requests get 503 + Retry-After), let requests in flight
        finish for up to ``drain_timeout_s``, then end the rest with an error."""
        from ray import serve

        timeout_s = self.drain_timeout_s
        print(f"kvray: draining (up to {timeout_s:g} s; new requests get 503)", flush=True)
        try:
            ingress = serve.get_app_handle(APP_NAME)
            ingress.begin_drain.remote().result(timeout_s=10)
            llm = serve.get_deployment_handle("LLMServer", app_name=APP_NAME)
        except Exception as err:
            print(f"kvray: could not drain ({err.__class__.__name__}); stopping", flush=True)
            return
        if _wait_until_idle(ingress, timeout_s):
            print("kvray: drained", flush=True)
            return
        print("kvray: drain deadline passed; aborting the requests still running", flush=True)
        try:
            ingress.abort_all.remote().result(timeout_s=10)
            llm.abort_all.remote().result(timeout_s=10)
            time.sleep(0.5)
        except Exception as err:
            print(f"kvray: abort failed ({err.__class__.__name__})", flush=True)

    def log_throughput(self, sleep: Callable[[float], None] = time.sleep,
                       period: float = 10.0) -> None:
        """Every ``period`` seconds, one line with generation throughput over all replicas;
        returns only by raising (:class:`ServeStop`, KeyboardInterrupt)."""
        import ray

        from kvray.engine.stats import throughput_line
        from kvray.serve.options import ServeOptions
        from kvray.serve.stats_board import STATS_NAMESPACE

        board_name = ServeOptions(app_name=APP_NAME).board_name
        last = None
        while True:
            sleep(period)
            if self.stop_requested:  # a SIGTERM whose ServeStop something below swallowed
                raise ServeStop
            if not self.log_stats:
                continue
            try:
                board = ray.get_actor(board_name, namespace=STATS_NAMESPACE)
                snap = ray.get(board.snapshot.remote(), timeout=5)
            except Exception as err:  # a missing stats line must not stop the server
                print(f"kvray: stats unavailable ({err.__class__.__name__})", flush=True)
                continue
            total = sum(s.get("generation_tokens_total", 0) for _, s in snap)
            running = sum(s.get("num_running", 0) for _, s in snap)
            waiting = sum(s.get("num_waiting", 0) for _, s in snap)
            if last is not None:
                print(throughput_line(self.model_name, (total - last) / period, running,
                                      waiting), flush=True)
            last = total


def _wait_until_idle(ingress: Any, timeout_s: float) -> bool:
    """Whether the ingress served its last request within ``timeout_s`` (then the last
    chunks get a moment on their way to clients)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # the ingress counts exactly the requests it still serves
            busy = ingress.num_in_flight.remote().result(timeout_s=5)
        except Exception:
            busy = 1
        if busy == 0:
            time.sleep(0.6)
            return True
        time.sleep(0.25)
    return False
