"""The LoRA adapters one Serve application serves, shared by all of its model replicas.

A small named actor (beside the stats board) reads each adapter once — the ``lora_modules``
when it starts, others when ``/v1/load_lora_adapter`` asks — checks it against the base
model and puts its weights in the Ray object store, where it owns them. A model replica
that gets a request for an adapter it does not hold fetches that object (no second read of
the adapter's files, wherever the replica runs); the workers load it from there. Unloading
removes the adapter here; replicas drop their copy when they next sync (every stats
period), and refuse it at once when a request names it after that.

Ray Serve LLM re-downloads an adapter on every replica that needs it; here the bytes are
read once per application.
"""

from __future__ import annotations

from typing import Any

from kvray.config import EngineConfig
from kvray.serve.stats_board import STATS_NAMESPACE


def lora_directory(board_name: str, config: EngineConfig) -> Any:
    """The directory actor of the application whose stats board is ``board_name``, started
    (reading ``config``'s ``lora_modules``) if it does not run yet."""
    import ray

    @ray.remote(num_cpus=0)
    class LoRADirectory:
        """Adapters by name: (LoRARequest, object-store reference to its weights)."""

        def __init__(self, model_path: str, config: EngineConfig) -> None:
            from kvray.models.loader import open_checkpoint
            from kvray.models.spec import ModelSpec

            self.spec = ModelSpec.from_hf_config(open_checkpoint(model_path).hf_config)
            self.config = config.lora
            self.entries: dict[str, tuple[Any, Any]] = {}
            self.next_id = 1
            for name, path in self.config.lora_modules.items():
                self.load(name, path)

        def load(self, name: str, path: str) -> int:
            """Read and check adapter ``name`` (LoRAError if it cannot be served); its id."""
            from kvray.config import check_adapter_name
            from kvray.lora.adapter import load_adapter
            from kvray.lora.request import LoRAError, LoRARequest

            try:
                check_adapter_name(name)
            except ValueError as err:
                raise LoRAError(str(err), "lora_name") from None
            known = self.entries.get(name)
            if known is not None:
                if known[0].lora_path == path:
                    return known[0].lora_int_id
                raise LoRAError(f"adapter {name!r} is already loaded (from "
                                f"{known[0].lora_path}); unload it first", "lora_name")
            request = LoRARequest(name, self.next_id, path)
            adapter = load_adapter(request, self.spec, self.config.max_lora_rank)
            self.next_id += 1
            self.entries[name] = (request, ray.put(adapter.weights))
            return request.lora_int_id

        def unload(self, name: str) -> bool:
            return self.entries.pop(name, None) is not None

        def names(self) -> list[str]:
            return sorted(self.entries)

        def fetch(self, name: str) -> tuple[Any, list[Any]] | None:
            """(LoRARequest, [weights reference]) of ``name``, or None. (The reference sits
            in a list so that Ray hands it over as a reference, not the value.)"""
            entry = self.entries.get(name)
            return None if entry is None else (entry[0], [entry[1]])

    outside = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(None)
    return LoRADirectory.options(name=f"{board_name}-lora", namespace=STATS_NAMESPACE,
                                 get_if_exists=True, lifetime="detached",
                                 scheduling_strategy=outside).remote(
        config.model.model, config)
