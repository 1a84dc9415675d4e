"""vLLM's prompt types for the offline API: ``TextPrompt`` and ``TokensPrompt`` are the
dicts ``LLM.generate`` takes besides plain strings and token id lists; and the one reading
of a chat message's OpenAI content parts, for the HTTP API and ``LLM.chat`` alike."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from kvray.errors import InvalidRequestError


class TextPrompt(TypedDict):
    """A prompt as text (tokenized by the model's tokenizer)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (``prompt``: its text, when the caller has it)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def join_text_parts(content: list[Any], where: str) -> str:
    """A message's list of OpenAI content parts (``[{"type": "text", "text": ...}]``) as
    the one string chat templates take; any other part is an InvalidRequestError (a
    ValueError) naming ``where`` (e.g. ``messages.0.content``) and the part."""
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise InvalidRequestError(f"{at}.type: content part type {kind!r} is not "
                                      "supported; this model takes text parts only",
                                      f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{at}.text: a text part needs a string 'text'",
                                      f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)
