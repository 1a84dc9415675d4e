"""What names a LoRA adapter, and what an unusable one raises. Pure Python: the server's
front ends import it without torch."""

from __future__ import annotations

from dataclasses import dataclass

from kvray.errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this model; the message says why (HTTP 400)."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM spells it: a name (what clients pass as
    ``model``), an integer id unique per adapter (> 0), and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise LoRAError("lora_name must not be empty")
