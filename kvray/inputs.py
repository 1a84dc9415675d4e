"""vLLM's prompt types for the offline API: ``TextPrompt`` and ``TokensPrompt`` are the
dicts ``LLM.generate`` takes besides plain strings and token id lists."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text (tokenized by the model's tokenizer)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (``prompt``: its text, when the caller has it)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
