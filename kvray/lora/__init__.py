"""Multi-LoRA serving: PEFT adapters read and checked (:mod:`.adapter`), the engine's
registry and slot table (:mod:`.manager`), the workers' adapter slots (:mod:`.layers`)."""

from kvray.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
