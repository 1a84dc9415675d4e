"""Which LoRA adapter sits in each of the workers' ``max_loras`` slots.

The scheduler acquires a slot when it admits a request of an adapter that has none
(evicting the least recently used adapter no running request needs; an adapter of a running
request is never evicted) and tells the workers to load it with a :class:`LoRALoad` in that
step's output, ahead of the forward pass.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class LoRALoad:
    """A worker command: put adapter ``lora_id`` in ``slot``. ``weights`` is the
    :attr:`LoRAAdapter.weights` mapping, or an object-store reference to it."""

    slot: int
    lora_id: int
    weights: Any



class LoRASlots:
    """Which adapter occupies each of the workers' ``max_loras`` slots."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self._free = list(range(max_loras))

    def slot(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)

    def acquire(self, lora_id: int, pinned: Counter) -> tuple[int, bool]:
        """The slot of adapter ``lora_id`` and whether the workers must load it there
        (evicting the least recently used adapter none of ``pinned`` runs with)."""
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot, False
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = next((v for v in self._slot_of if not pinned[v]), None)
            if victim is None:
                raise RuntimeError("no LoRA slot free: more adapters running than max_loras")
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        return slot, True

    def __len__(self) -> int:
        return len(self._slot_of)
