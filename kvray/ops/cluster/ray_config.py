"""What ``ray up`` runs on a cluster config before it talks to a provider.

``ray.autoscaler._private.util.prepare_config`` (provider defaults, on-prem node type,
per-type min/max workers) then ``validate_config`` (Ray's JSON schema
``ray/autoscaler/ray-schema.json`` plus its own cross-field rules). These are private Ray
APIs: verified against Ray :data:`VERIFIED_RAY_VERSION`; an import failure says so.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvray.ops.cluster.report import ClusterReport

VERIFIED_RAY_VERSION = "2.60.0"
RAY_PRIVATE_API = (
    "ray.autoscaler._private.util.prepare_config",
    "ray.autoscaler._private.util.validate_config",
)


def ray_prepare_and_validate(raw: dict, report: ClusterReport) -> dict | None:
    """``raw`` as ``ray up`` prepares it, or None when Ray rejects it (problems reported)."""
    try:
        prepare_config, validate_config, schema_path = _ray_private_api()
    except ImportError as err:
        report.problems.append(str(err))
        return None
    if _ray_version() != VERIFIED_RAY_VERSION:
        report.notes.append(f"ray {_ray_version()} here; this check was verified with ray "
                            f"{VERIFIED_RAY_VERSION} (it runs Ray's private API)")
    out = io.StringIO()
    try:
        with _captured(out):
            prepared = prepare_config(copy.deepcopy(raw))
    except Exception as err:  # ray up would stop here too, whatever the exception
        report.problems.append(f"ray up's prepare_config rejects it: {_describe(err)}")
        report.problems.extend(_schema_errors(raw, schema_path))
        return None
    _note_ray_output(out.getvalue(), report)
    try:
        with _captured(out):
            validate_config(prepared)
    except (ModuleNotFoundError, ImportError) as err:
        report.problems.append(f"ray up's validate_config needs jsonschema "
                               f"(pip install 'ray[default]'): {err}")
        return None
    except Exception as err:
        errors = _schema_errors(prepared, schema_path)
        report.problems.extend(errors or [f"ray up's validate_config rejects it: "
                                          f"{_describe(err)}"])
        return None
    return prepared


def _ray_private_api() -> tuple[Callable, Callable, Path]:
    """``(prepare_config, validate_config, schema_path)`` from Ray, or raise ImportError
    with a message that names the private API and the verified Ray version."""
    try:
        import ray.autoscaler
        from ray.autoscaler._private.util import prepare_config, validate_config
    except (ImportError, AttributeError) as err:
        version = _ray_version()
        raise ImportError(
            f"kvray cluster check runs Ray's private cluster-launcher API "
            f"({', '.join(RAY_PRIVATE_API)}), verified with ray {VERIFIED_RAY_VERSION}; "
            f"it is not importable from ray {version}: {err}. Install ray[default]=="
            f"{VERIFIED_RAY_VERSION}") from None
    schema = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return prepare_config, validate_config, schema


def _ray_version() -> str:
    try:
        from importlib.metadata import version

        return version("ray")
    except Exception:
        return "(not installed)"


@contextlib.contextmanager
def _captured(out: io.StringIO) -> Iterator[None]:
    """Ray's cli_logger output (stdout) and its autoscaler log records of WARNING and up
    into ``out``; its INFO records dropped."""
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("ray.autoscaler")
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            yield
    finally:
        logger.handlers, logger.propagate = saved


def _describe(err: BaseException) -> str:
    message = getattr(err, "message", None) or str(err)  # click.ClickException has .message
    if isinstance(err, KeyError):
        message = f"missing key {err}"
    return message.strip() or type(err).__name__


def _note_ray_output(text: str, report: ClusterReport) -> None:
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        if line.strip():
            report.notes.append(f"ray: {line.strip()}")


def _schema_errors(config: Any, schema_path: Path) -> list[str]:
    """Every error of ``config`` against Ray's schema, with the path and a did-you-mean."""
    import jsonschema

    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.path)))
    return [_format_schema_error(e) for e in errors]


def _format_schema_error(err: Any) -> str:
    where = ".".join(str(p) for p in err.absolute_path) or "top level"
    message = f"ray schema: at {where}: {err.message}"
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = list(err.schema.get("properties", {}))
        for key in err.instance:
            if key not in known and not err.schema.get("patternProperties"):
                close = difflib.get_close_matches(str(key), known, n=1)
                if close:
                    message += f"; did you mean '{close[0]}' instead of '{key}'?"
    return message
