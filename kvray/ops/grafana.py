"""``kvray grafana provision``: put kvray's dashboards and their Prometheus data source into a
running Grafana (>= 9) through its HTTP API.

Idempotent: the folder is found by uid, the data source by uid (else by name) and the
dashboards are posted by uid with ``overwrite``, so a second run updates what the first
created and never duplicates it. The dashboards are the ``*.json`` files of the kvray source
tree's ``dashboards/`` folder (the default: ``dashboards/`` beside the ``kvray`` package, i.e.
a source checkout or an editable install; elsewhere pass ``--dashboards DIR``). The alerting
rules there (``alerts.yml``) belong to Prometheus, not Grafana; for Grafana's own file
provisioning see ``dashboards/provisioning/``.

Only the standard library talks to Grafana: the ``grafana-client`` package (4.x and 5.x)
needs ``urllib3-future``, which overwrites the environment's ``urllib3`` at every interpreter
start, for every other package too.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

DATASOURCE_UID = "kvray-prometheus"
DATASOURCE_NAME = "kvray Prometheus"
DEFAULT_PROMETHEUS_URL = "http://localhost:9090"
DEFAULT_FOLDER = "kvray"
TOKEN_ENV = "GRAFANA_TOKEN"


class GrafanaError(RuntimeError):
    """Grafana could not be reached, refused a call, or the dashboards could not be read."""


def default_dashboards_dir() -> Path:
    """``dashboards/`` beside the ``kvray`` package (present in a source checkout)."""
    return Path(__file__).resolve().parents[2] / "dashboards"


def folder_uid(title: str) -> str:
    """A Grafana uid (letters, digits, ``-``, ``_``; at most 40) for a folder title."""
    uid = re.sub(r"[^A-Za-z0-9_-]+", "-", title).strip("-").lower()[:40]
    return uid or DEFAULT_FOLDER


def load_dashboards(directory: str | Path) -> list[dict]:
    """Every ``*.json`` dashboard in ``directory`` (sorted by file name); each needs a uid."""
    directory = Path(directory)
    if not directory.is_dir():
        raise GrafanaError(f"no dashboards folder at {directory}: pass --dashboards DIR "
                           "(the dashboards/ folder of the kvray source tree)")
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            dashboard = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise GrafanaError(f"cannot read dashboard {path}: {err}") from err
        if not isinstance(dashboard, dict) or not dashboard.get("uid"):
            raise GrafanaError(f"dashboard {path} has no uid")
        out.append(dashboard)
    if not out:
        raise GrafanaError(f"no *.json dashboards in {directory}")
    return out


class _Grafana:
    """The few Grafana HTTP API calls provisioning needs (JSON in, JSON out)."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GrafanaError(f"not a Grafana URL: {url!r} (want http(s)://host:port)")
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if parts.port:
            netloc += f":{parts.port}"
        self.base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.timeout = timeout
        self.headers = {"Accept": "application/json", "Content-Type": "application/json",
                        "User-Agent": "kvray-grafana"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        elif parts.username is not None:  # http://user:password@host: basic auth
            cred = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()

    def call(self, method: str, path: str, body: Any = None,
             missing_ok: bool = False) -> dict | None:
        """The decoded JSON answer; None for a 404 when ``missing_ok``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            if err.code == 404 and missing_ok:
                return None
            detail = err.read().decode(errors="replace")[:500]
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(detail).get("message", detail)
            hint = " (check the token or credentials)" if err.code in (401, 403) else ""
            raise GrafanaError(f"{method} {path}: HTTP {err.code}: {detail}{hint}") from err
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise GrafanaError(f"cannot reach Grafana at {self.base}: {reason}") from err
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            raise GrafanaError(f"{method} {path}: not a JSON answer (is {self.base} a "
                               "Grafana?)") from err


def _datasource_payload(uid: str, name: str, prometheus_url: str) -> dict:
    return {"uid": uid, "name": name, "type": "prometheus", "access": "proxy",
            "url": prometheus_url, "isDefault": False,
            "jsonData": {"httpMethod": "POST", "timeInterval": "15s"}}


def _select_datasource(dashboard: dict, ds_uid: str, ds_name: str) -> dict:
    """A copy of ``dashboard`` for the API: no numeric id, and its ``datasource`` template
    variable preset to the provisioned data source."""
    out = json.loads(json.dumps(dashboard))
    out["id"] = None
    for var in out.get("templating", {}).get("list", []):
        if var.get("type") == "datasource" and var.get("query") == "prometheus":
            var["current"] = {"selected": True, "text": ds_name, "value": ds_uid}
    return out


def provision(url: str, token: str | None = None,
              prometheus_url: str = DEFAULT_PROMETHEUS_URL, folder: str = DEFAULT_FOLDER,
              dashboards_dir: str | Path | None = None, *,
              datasource_name: str = DATASOURCE_NAME, datasource_uid: str = DATASOURCE_UID,
              timeout: float = 15.0, log=None) -> dict:
    """Create or update, in the Grafana at ``url``: the folder ``folder``, a Prometheus data
    source for ``prometheus_url``, and every dashboard of ``dashboards_dir`` in that folder.

    ``token``: a service-account token (else basic auth from ``user:password@`` in ``url``).
    Returns what was done: ``{"folder": {...}, "datasource": {...}, "dashboards": [...]}``.
    Raises :class:`GrafanaError` with a message for the user."""
    say = log or (lambda msg: None)
    dashboards = load_dashboards(dashboards_dir or default_dashboards_dir())
    api = _Grafana(url, token, timeout)

    f_uid = folder_uid(folder)
    found = api.call("GET", f"/api/folders/{quote(f_uid)}", missing_ok=True)
    if found is None:
        api.call("POST", "/api/folders", {"uid": f_uid, "title": folder})
    else:
        api.call("PUT", f"/api/folders/{quote(f_uid)}", {"title": folder, "overwrite": True})
    say(f"folder {folder!r} (uid {f_uid}) {'updated' if found else 'created'}")

    ds = api.call("GET", f"/api/datasources/uid/{quote(datasource_uid)}", missing_ok=True)
    if ds is None:  # one of that name but another uid (made by hand) is taken over
        ds = api.call("GET", f"/api/datasources/name/{quote(datasource_name, safe='')}",
                      missing_ok=True)
    ds_uid = ds.get("uid", datasource_uid) if ds else datasource_uid
    payload = _datasource_payload(ds_uid, datasource_name, prometheus_url)
    if ds is None:
        api.call("POST", "/api/datasources", payload)
    else:
        api.call("PUT", f"/api/datasources/uid/{quote(ds_uid)}", payload)
    say(f"data source {datasource_name!r} (uid {ds_uid}, {prometheus_url}) "
        f"{'updated' if ds else 'created'}")

    posted = []
    for dashboard in dashboards:
        answer = api.call("POST", "/api/dashboards/db", {
            "dashboard": _select_datasource(dashboard, ds_uid, datasource_name),
            "folderUid": f_uid, "overwrite": True, "message": "kvray grafana provision"})
        posted.append({"uid": dashboard["uid"], "title": dashboard.get("title", ""),
                       "url": (answer or {}).get("url"),
                       "version": (answer or {}).get("version")})
        say(f"dashboard {dashboard.get('title', '')!r} (uid {dashboard['uid']}) saved"
            + (f": {api.base}{answer['url']}" if answer and answer.get("url") else ""))
    return {"folder": {"uid": f_uid, "title": folder, "created": found is None},
            "datasource": {"uid": ds_uid, "name": datasource_name, "url": prometheus_url,
                           "created": ds is None},
            "dashboards": posted}


def _cmd_provision(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(TOKEN_ENV) or None
    try:
        provision(args.url, token=token, prometheus_url=args.prometheus_url,
                  folder=args.folder, dashboards_dir=args.dashboards, timeout=args.timeout,
                  log=lambda msg: print(f"kvray grafana: {msg}", flush=True))
    except GrafanaError as err:
        print(f"kvray grafana provision: error: {err}", file=sys.stderr)
        return 1
    return 0


def add_grafana_parser(subparsers) -> None:
    """Add ``grafana provision`` to a ``kvray`` argparse subparsers object."""
    grafana = subparsers.add_parser(
        "grafana", help="put kvray's dashboards into Grafana",
        description="Manage kvray's Grafana dashboards.")
    actions = grafana.add_subparsers(dest="grafana_action", metavar="ACTION", required=True)
    prov = actions.add_parser(
        "provision", help="create or update the folder, data source and dashboards",
        description="Create or update (idempotently) a Grafana folder, a Prometheus data "
                    "source and kvray's dashboards through Grafana's HTTP API.")
    prov.add_argument("--url", default="http://localhost:3000",
                      help="Grafana URL (default http://localhost:3000); "
                           "http://user:password@host:3000 for basic auth")
    prov.add_argument("--token", default=None,
                      help=f"service-account token (visible in ps: prefer ${TOKEN_ENV})")
    prov.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS_URL,
                      help="URL of the Prometheus that scrapes kvray, as Grafana reaches it "
                           f"(default {DEFAULT_PROMETHEUS_URL})")
    prov.add_argument("--folder", default=DEFAULT_FOLDER,
                      help=f"Grafana folder for the dashboards (default {DEFAULT_FOLDER})")
    prov.add_argument("--dashboards", default=None, metavar="DIR",
                      help="folder of dashboard *.json files (default: dashboards/ of the "
                           "kvray source tree)")
    prov.add_argument("--timeout", type=float, default=15.0,
                      help="seconds per HTTP call (default 15)")
    prov.set_defaults(func=_cmd_provision)
