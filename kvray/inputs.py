"""vLLM's prompt types for the offline API: ``TextPrompt`` and ``TokensPrompt`` are the
dicts ``LLM.generate`` takes besides plain strings and token id lists; and the readings the
HTTP API and the offline API share: a chat message's OpenAI content parts, prompt
truncation, and the text pairs a score compares."""

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
    the one string chat templates take, one part per line (vLLM's joining, so a prompt's
    tokens are the same on both servers); any other part is an InvalidRequestError (a
    ValueError) naming ``where`` (e.g. ``messages.0.content``) and the part."""
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise InvalidRequestError(f"{at}.type: content part type {kind!r} is not "
                                      "supported; this model takes text parts only",
                                      f"{at}.type")
        if not isinstance(part.get(key), str):
            raise InvalidRequestError(f"{at}.{key}: a {kind} part needs a string {key!r}",
                                      f"{at}.{key}")
        texts.append(part[key])
    return "\n".join(texts)


# The content parts that carry text, and where: OpenAI's text part, the Responses API's
# input/output text (vLLM takes them in chat too), and an assistant's refusal (the openai
# client sends back the refusals it got).
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal"}


def truncate_prompt(ids: list[int], keep: int, max_model_len: int,
                    generates: bool = True) -> list[int]:
    """A prompt's last ``keep`` tokens (-1: as many as the context holds — leaving room for
    one generated token unless the request only pools); ``ids`` itself when it is no
    longer. ValueError, naming the field, when ``keep`` is neither -1 nor at least 1, or
    exceeds the context (vLLM's rule)."""
    if keep != -1 and keep < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens = {keep}: must be >= 1, or -1 (as "
                                  "many as the context holds)", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens = {keep} exceeds the model's "
                                  f"maximum context length ({max_model_len})",
                                  "truncate_prompt_tokens")
    keep = max_model_len - generates if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def score_pairs(first: str | list[str], second: str | list[str],
                names: tuple[str, str]) -> list[tuple[str, str]]:
    """The (a, b) text pairs a score compares: one first text against each second one, or
    two lists pairwise; a ValueError naming both (``names``) when their lengths differ."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"{names[0]} has {len(firsts)} texts and {names[1]} "
                         f"{len(seconds)}: give one {names[0]}, or as many as {names[1]}")
    return list(zip(firsts, seconds, strict=True))
