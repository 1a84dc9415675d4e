"""Test helpers around a real Prometheus: find (or fetch) the ``prometheus`` and ``promtool``
binaries, run a throwaway Prometheus, query it, and pull metric names out of PromQL.

The binaries come from PATH, else from a cache folder (``$KVRAY_PROMETHEUS_CACHE``, default
``~/.cache/kvray/prometheus``) that :func:`find_prometheus_tools` fills, when it runs as root
with apt-get, from Debian's ``prometheus`` package (``apt-get download`` + ``dpkg-deb -x``:
nothing is installed or started system-wide). Only tests call this, never kvray itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.helpers.ports import free_port

CACHE_DIR = Path(os.environ.get("KVRAY_PROMETHEUS_CACHE",
                                "~/.cache/kvray/prometheus")).expanduser()
CI_FIX = ("the test fetches Debian's prometheus package itself as root with apt-get; else "
          "run in .ci/run before pytest: `apt-get update -qq && cd /tmp && apt-get download "
          "prometheus && dpkg-deb -x /tmp/prometheus_*.deb ~/.cache/kvray/prometheus`")


class ToolsMissing(RuntimeError):
    """prometheus/promtool are not here and could not be fetched (the message says why)."""


def _lookup() -> tuple[Path, Path] | None:
    found = [shutil.which(name) for name in ("prometheus", "promtool")]
    if all(found):
        return Path(found[0]), Path(found[1])
    cached = [CACHE_DIR / "usr" / "bin" / name for name in ("prometheus", "promtool")]
    if all(os.access(p, os.X_OK) for p in cached):
        return cached[0], cached[1]
    return None


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _fetch() -> None:
    """Unpack Debian's prometheus package into CACHE_DIR (one process at a time)."""
    if os.geteuid() != 0 or not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise ToolsMissing("prometheus/promtool not found, and fetching them needs root with "
                           "apt-get and dpkg-deb")
    CACHE_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR.parent / ".prometheus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _lookup() is not None:  # another process fetched them meanwhile
            return
        with tempfile.TemporaryDirectory(dir=CACHE_DIR.parent) as tmp:
            work = Path(tmp)
            download = ["apt-get", "download", "-o", "APT::Sandbox::User=root", "prometheus"]
            got = _run(download, work, 300)
            if got.returncode != 0:  # a fresh machine has no package lists yet
                _run(["apt-get", "update", "-qq"], work, 300)
                got = _run(download, work, 300)
            debs = sorted(work.glob("prometheus_*.deb"))
            if got.returncode != 0 or not debs:
                raise ToolsMissing(f"`apt-get download prometheus` failed: "
                                   f"{(got.stderr or got.stdout).strip()[-500:]}")
            unpack = _run(["dpkg-deb", "-x", str(debs[-1]), str(work / "root")], work, 300)
            if unpack.returncode != 0:
                raise ToolsMissing(f"dpkg-deb -x failed: {unpack.stderr.strip()[-500:]}")
            if CACHE_DIR.exists():
                shutil.rmtree(CACHE_DIR)
            (work / "root").rename(CACHE_DIR)


def find_prometheus_tools(fetch: bool = True) -> tuple[Path, Path]:
    """Paths of ``prometheus`` and ``promtool``; fetched into the cache if missing and
    ``fetch``. Raises :class:`ToolsMissing`."""
    tools = _lookup()
    if tools is None and fetch:
        try:
            _fetch()
        except (OSError, subprocess.SubprocessError) as err:
            raise ToolsMissing(f"fetching prometheus failed: {err}") from err
        tools = _lookup()
    if tools is None:
        raise ToolsMissing("prometheus/promtool not found on PATH or in "
                           f"{CACHE_DIR / 'usr' / 'bin'}")
    return tools


@contextlib.contextmanager
def run_prometheus(binary: Path, config: str, workdir: Path) -> Iterator[str]:
    """Run Prometheus on 127.0.0.1 with ``config`` (YAML text) until the block exits; yield
    its base URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(config)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(workdir / "prometheus.log", "w+") as log:
        proc = subprocess.Popen(
            [str(binary), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"prometheus exited: {log.read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("prometheus not ready in 30 s")
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def query(base: str, expr: str, start: float | None = None, end: float | None = None,
          step: float = 1.0) -> list[dict]:
    """The ``result`` of an instant query (no ``start``) or a range query."""
    if start is None:
        resp = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    else:
        resp = httpx.get(f"{base}/api/v1/query_range", timeout=10, params={
            "query": expr, "start": start, "end": end or time.time(), "step": step})
    body = resp.json()
    if body.get("status") != "success":
        raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def wait_for_targets(base: str, jobs: set[str], timeout: float = 30) -> None:
    """Wait until every scrape job in ``jobs`` has scraped successfully (Prometheus hands new
    targets to its scrapers only every 5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        up = {r["metric"].get("job") for r in query(base, "up == 1")}
        if jobs <= up:
            return
        if time.monotonic() > deadline:
            targets = httpx.get(f"{base}/api/v1/targets", timeout=10).json()["data"]
            health = [(t["labels"].get("job"), t["health"], t["lastError"])
                      for t in targets["activeTargets"]]
            raise RuntimeError(f"scrape jobs {sorted(jobs - up)} not up in {timeout:g} s; "
                               f"targets: {health}")
        time.sleep(0.5)


def has_finite_value(result: list[dict]) -> bool:
    """Whether any sample of a query result is a number (not NaN / missing)."""
    for series in result:
        values = series.get("values") or [series.get("value")]
        for point in values:
            if point and math.isfinite(float(point[1])):
                return True
    return False


# ---- PromQL --------------------------------------------------------------------------------
_WORD = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
             "group_right", "bool", "offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana ``$variables`` allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\$\{?\w+\}?", "", s)
    s = re.sub(r"\{[^}]*\}", "{}", s)
    s = re.sub(r"\[[^\]]*\]", "[]", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in _WORD.finditer(s):
        word, before = m.group(), s[:m.start()]
        if before and (before[-1].isdigit() or before[-1] == "."):
            continue  # a number's exponent or a duration unit (5m, 1e3)
        if s[m.end():].lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function, an aggregation or an operator
        names.add(word)
    return names
