"""What names a LoRA adapter, and what an unusable one raises. Pure Python: the server's
front ends import it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvray.errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this model; the message says why (HTTP 400)."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM spells it: a name (what clients pass as
    ``model``), an integer id unique per adapter (> 0), and its PEFT directory
    (``lora_path``; vLLM's older ``lora_local_path`` is read when it is not given).
    ``base_model_name`` is accepted as vLLM takes it (kvray serves one base model: its
    ``/v1/models`` names that as every adapter's parent)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = field(default=None, repr=False, compare=False)
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise LoRAError("lora_name must not be empty")
        if not self.lora_path and self.lora_local_path:
            object.__setattr__(self, "lora_path", self.lora_local_path)
        if not self.lora_path:
            raise LoRAError("lora_path must name the adapter's directory")

    # vLLM's read-only names for the fields
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path
