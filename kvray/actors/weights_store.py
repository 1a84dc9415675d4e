"""Model files in the Ray object store (``share_weights``): the first process of the
cluster that has a model's files puts them there once (64 MiB chunks, owned by a named
detached actor per model path, so they outlive that process); a process on a node without
them (a new replica, an autoscaled node, a pod without the model's volume) writes them
from the object store into its local cache and loads that copy, instead of reading or
downloading its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvray")
CHUNK_BYTES = 64 << 20
NAMESPACE = "kvray"
PUBLISH_WAIT_S = 1800.0  # a node waits this long for another node's upload to finish


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def _key(model_path: str) -> str:
    return hashlib.sha1(model_path.encode()).hexdigest()[:16]


def weights_actor(model_path: str) -> Any:
    """The named actor holding ``model_path``'s files (started if it does not run yet)."""
    ray = _ray()

    @ray.remote(num_cpus=0)
    class ModelFiles:
        def __init__(self) -> None:
            self.files: dict[str, list] = {}  # relative path -> chunk refs (owned here)
            self.sizes: dict[str, int] = {}
            self.complete = False
            self.uploader: tuple[str, float] | None = None

        def claim(self, who: str) -> str:
            """``done`` (take the files), ``upload`` (``who`` puts them) or ``wait``."""
            if self.complete:
                return "done"
            if self.uploader is None or time.monotonic() - self.uploader[1] > PUBLISH_WAIT_S:
                self.uploader = (who, time.monotonic())
                self.files, self.sizes = {}, {}
                return "upload"
            return "upload" if self.uploader[0] == who else "wait"

        def add(self, rel: str, chunk: bytes) -> None:
            import ray as ray_

            self.files.setdefault(rel, []).append(ray_.put(chunk))
            self.sizes[rel] = self.sizes.get(rel, 0) + len(chunk)

        def finish(self) -> None:
            self.complete, self.uploader = True, None

        def abandon(self, who: str) -> None:
            if self.uploader is not None and self.uploader[0] == who:
                self.uploader = None

        def manifest(self) -> dict[str, list] | None:
            # refs nested in a dict travel as refs: the reader fetches each chunk itself
            return dict(self.files) if self.complete else None

    # Outside any placement group: created inside a replica's group, it would go with it.
    outside = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(None)
    return ModelFiles.options(name=f"kvray-weights-{_key(model_path)}", namespace=NAMESPACE,
                              get_if_exists=True, lifetime="detached",
                              scheduling_strategy=outside).remote()


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def share(model_path: str) -> None:
    """Put ``model_path``'s files in the object store unless they are there (or another
    process is putting them): once per cluster."""
    ray = _ray()
    if ray is None:
        return
    actor = weights_actor(model_path)
    who = f"{ray.get_runtime_context().get_node_id()}:{os.getpid()}"
    if ray.get(actor.claim.remote(who), timeout=60) != "upload":
        return
    path = Path(model_path)
    start, total = time.perf_counter(), 0
    try:
        for file in _files(path):
            rel = file.name if path.is_file() else str(file.relative_to(path))
            with open(file, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    ray.get(actor.add.remote(rel, chunk))
                    total += len(chunk)
        ray.get(actor.finish.remote())
    except BaseException:
        actor.abandon.remote(who)
        raise
    logger.info("kvray: model files of %s in the object store: %.0f MiB in %.1f s",
                model_path, total / 2**20, time.perf_counter() - start)


def local_model_path(model_path: str, share_weights: bool) -> str:
    """``model_path`` if this node has it (shared first, with ``share_weights``); else, with
    ``share_weights`` under Ray, a local copy written from the object store."""
    if Path(model_path).exists():
        if share_weights:
            share(model_path)
        return model_path
    ray = _ray()
    if not share_weights or ray is None:
        return model_path  # the loader's own error names it
    target = Path(os.environ.get("KVRAY_HOME", Path.home() / ".cache" / "kvray")) / \
        "object-store-weights" / _key(model_path)
    local = target / Path(model_path).name
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer per node
        if not (target / ".complete").exists():
            _fetch(ray, model_path, local, Path(model_path).suffix == ".gguf")
            (target / ".complete").touch()
    return str(local)


def _fetch(ray: Any, model_path: str, local: Path, single_file: bool) -> None:
    actor = weights_actor(model_path)
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while (manifest := ray.get(actor.manifest.remote())) is None:
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"model path {model_path} is not on this node and its "
                                    "files never reached the object store")
        time.sleep(1.0)
    if not manifest:
        raise FileNotFoundError(f"model path {model_path} is not on this node nor in the "
                                "object store")
    start, total = time.perf_counter(), 0
    for rel, chunks in manifest.items():
        dest = local if single_file else local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        with open(part, "wb") as f:
            for chunk in chunks:
                data = ray.get(chunk)
                f.write(data)
                total += len(data)
        part.rename(dest)
    logger.info("kvray: model files of %s taken from the object store into %s: %.0f MiB in "
                "%.1f s", model_path, local, total / 2**20, time.perf_counter() - start)
