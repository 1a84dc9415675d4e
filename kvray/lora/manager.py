"""LoRA on the engine: which adapters exist, their weights in host memory, their slots.

:class:`LoRARegistry` knows adapters by name (from ``lora_modules``, the load route or an
offline :class:`~kvray.lora.adapter.LoRARequest`), validates each once when it is added,
keeps up to ``max_cpu_loras`` adapters' weights in host memory (LRU; an adapter a live
request runs with is never dropped) and, under Ray, puts each adapter's weights in the
object store once so that every worker reads the same copy. Which adapter sits in which
worker slot is the scheduler's (:mod:`kvray.scheduler.lora_slots`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvray.config import LoRAConfig, check_adapter_name
from kvray.errors import NotFoundError
from kvray.lora.adapter import LoRAAdapter, load_adapter
from kvray.lora.request import LoRAError, LoRARequest
from kvray.models.spec import ModelSpec

logger = logging.getLogger("kvray")


@dataclass
class LoRAStats:
    """What the metrics report about adapters."""

    requests: Counter = field(default_factory=Counter)  # adapter name -> requests added
    num_reads: int = 0  # adapters read from their files (first loads and re-reads)
    read_seconds: float = 0.0
    num_fetched: int = 0  # adapters taken from the source (the object store), not read
    num_registered: int = 0


class LoRARegistry:
    """The adapters one engine serves. Thread-safe: the server's event loop registers and
    lists adapters while the engine thread schedules."""

    def __init__(self, config: LoRAConfig, spec: ModelSpec,
                 put: Callable[[Any], Any] | None = None,
                 source: Callable[[str], tuple[LoRARequest, Any] | None] | None = None
                 ) -> None:
        """``put`` (e.g. ``ray.put``): ship each adapter's weights to the workers once, by
        reference. ``source``: where adapters this registry does not know come from, by
        name: (LoRARequest, object-store reference of its checked weights) or None (a
        Serve application's shared directory, :mod:`kvray.serve.lora_directory`)."""
        self.config = config
        self.spec = spec
        self.put = put
        self.source = source
        self._fetched: dict[int, Any] = {}  # lora id -> weights reference from the source
        self._lock = threading.RLock()
        self._by_name: dict[str, LoRARequest] = {}
        # Adapters are keyed by ids of this registry's own, never reused: they key the
        # workers' slots and the prefix cache, so an id a client gives again after unloading
        # (a hot reload) must not find the old weights or their K/V there.
        self._by_id: dict[int, LoRARequest] = {}  # also unregistered ones still in use
        self._client_ids: dict[int, str] = {}  # a registered adapter's lora_int_id -> name
        self._weights: OrderedDict[int, tuple[LoRAAdapter, Any]] = OrderedDict()  # LRU
        self._live: Counter = Counter()  # lora id -> requests not finished
        self._next_id = 1  # the next adapter id of this registry's own
        self.stats = LoRAStats()

    # ---- registration -------------------------------------------------------------------
    def register(self, name: str, path: str, lora_id: int | None = None) -> LoRARequest:
        """Add adapter ``name`` (validated now: :class:`LoRAError` if it cannot be served).
        Registering the same name and path again is a no-op (the first id stays); another
        path for a known name is an error. The returned request carries the registry's id
        for the adapter; ``lora_id``, the client's, may name no other registered adapter."""
        try:
            check_adapter_name(name)
        except ValueError as err:
            raise LoRAError(str(err)) from None
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:
                if known.lora_path == path:  # (under its registered id, whatever given)
                    return known
                raise LoRAError(f"adapter {name!r} is already loaded (from "
                                f"{known.lora_path}); unload it first")
            if lora_id is not None and self._client_ids.get(lora_id, name) != name:
                raise LoRAError(f"lora_int_id {lora_id} already names adapter "
                                f"{self._client_ids[lora_id]!r}")
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
        adapter = self._read(request)  # outside the lock: reading takes a while
        with self._lock:
            self._by_name[name] = request
            self._by_id[request.lora_int_id] = request
            if lora_id is not None:
                self._client_ids[lora_id] = name
            self._store(adapter)
            self.stats.num_registered = len(self._by_name)
        logger.info("kvray: LoRA adapter %r (rank %d, %s) from %s", name, adapter.rank,
                    ", ".join(adapter.target_modules), path)
        return request

    def unregister(self, name: str) -> bool:
        """Stop serving adapter ``name``: new requests for it are refused; requests already
        running with it finish (its weights stay until they do). False if unknown."""
        with self._lock:
            request = self._by_name.pop(name, None)
            if request is None:
                return False
            for client_id in [i for i, n in self._client_ids.items() if n == name]:
                del self._client_ids[client_id]
            if not self._live[request.lora_int_id]:
                self._forget(request.lora_int_id)
            self.stats.num_registered = len(self._by_name)
        return True

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def client_ids(self) -> dict[str, int]:
        """Each registered adapter's id as a client knows it: the ``lora_int_id`` it was
        registered with, else the registry's own (adapters loaded by name)."""
        with self._lock:
            given = {name: i for i, name in self._client_ids.items()}
            return {name: given.get(name, req.lora_int_id)
                    for name, req in self._by_name.items()}

    def name_of(self, lora_id: int) -> str:
        with self._lock:
            request = self._by_id.get(lora_id)
            return "" if request is None else request.lora_name

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def resolve(self, lora: LoRARequest | str) -> LoRARequest:
        """The registered adapter a request names: a name (the server) must be known; a
        :class:`LoRARequest` (offline use) is registered on first sight."""
        if isinstance(lora, str):
            known = self.lookup(lora)
            if known is None and self.source is not None:
                known = self._adopt(lora)
            if known is None:
                raise NotFoundError(f"the model `{lora}` does not exist", "model")
            return known
        with self._lock:
            known = self._by_name.get(lora.lora_name)
            if known is not None and known.lora_path == lora.lora_path:
                return known
        return self.register(lora.lora_name, lora.lora_path, lora.lora_int_id)

    def _adopt(self, name: str) -> LoRARequest | None:
        """Serve ``name`` from the source (already checked there; its weights stay in the
        object store, where the workers fetch them), or None if the source lacks it. Like
        every adapter here it gets an id of this registry's own (the source's may be
        handed out again after a restart)."""
        fetched = self.source(name)
        if fetched is None:
            return None
        source_request, ref = fetched
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:  # adopted meanwhile (another thread)
                return known
            request = LoRARequest(name, self._next_id, source_request.lora_path)
            self._next_id += 1
            self._by_name[name] = request
            self._by_id[request.lora_int_id] = request
            self._fetched[request.lora_int_id] = ref
            self.stats.num_registered = len(self._by_name)
            self.stats.num_fetched += 1
        return request

    def sync(self, names: set[str]) -> None:
        """Stop serving every adapter the source no longer lists (it was unloaded)."""
        for name in self.names():
            if name not in names:
                self.unregister(name)

    # ---- live requests ------------------------------------------------------------------
    def retain(self, lora_id: int, name: str) -> None:
        with self._lock:
            self._live[lora_id] += 1
            self.stats.requests[name] += 1

    def release(self, lora_id: int) -> None:
        with self._lock:
            self._live[lora_id] -= 1
            if self._live[lora_id] <= 0:
                del self._live[lora_id]
                request = self._by_id.get(lora_id)
                if request is not None and self._by_name.get(request.lora_name) != request:
                    self._forget(lora_id)  # unloaded while it ran

    # ---- weights ------------------------------------------------------------------------
    def payload(self, lora_id: int) -> Any:
        """What a worker load command carries for adapter ``lora_id``: its weights (or
        their object-store reference), read again if they were dropped from host memory."""
        with self._lock:
            if lora_id in self._fetched:
                return self._fetched[lora_id]
            entry = self._weights.get(lora_id)
            if entry is not None:
                self._weights.move_to_end(lora_id)
                return entry[1]
            request = self._by_id[lora_id]
        adapter = self._read(request)
        with self._lock:
            return self._store(adapter)

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = load_adapter(request, self.spec, self.config.max_lora_rank)
        with self._lock:
            self.stats.num_reads += 1
            self.stats.read_seconds += time.perf_counter() - start
        return adapter

    def _store(self, adapter: LoRAAdapter) -> Any:
        payload = adapter.weights if self.put is None else self.put(adapter.weights)
        self._weights[adapter.lora_id] = (adapter, payload)
        self._weights.move_to_end(adapter.lora_id)
        for lora_id in list(self._weights):  # over capacity: drop the coldest idle ones
            if len(self._weights) <= self.config.cpu_capacity:
                break
            if not self._live[lora_id] and lora_id != adapter.lora_id:
                del self._weights[lora_id]
        return payload

    def _forget(self, lora_id: int) -> None:
        self._weights.pop(lora_id, None)
        self._fetched.pop(lora_id, None)
        self._by_id.pop(lora_id, None)

    def adapter(self, lora_id: int) -> LoRAAdapter | None:
        with self._lock:
            entry = self._weights.get(lora_id)
            return None if entry is None else entry[0]
