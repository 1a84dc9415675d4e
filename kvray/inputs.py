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
    return "\n".join(part["text"] for part in text_parts(content, where))


def text_parts(content: list[Any], where: str) -> list[dict[str, str]]:
    """A message's text parts as ``[{"type": "text", "text": ...}]`` (what templates that
    iterate over a message's parts read: Responses parts and refusals become text parts,
    as vLLM wraps them); any other part is an InvalidRequestError naming ``where`` and
    the part."""
    parts = []
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
        parts.append({"type": "text", "text": part[key]})
    return parts


def message_content(content: Any, fmt: str, where: str) -> Any:
    """A message's content as a template in content format ``fmt`` takes it: ``string``
    one string (parts joined), ``openai`` a list of text parts (a string becomes one part;
    no content, none). Anything else passes through."""
    if fmt == "openai":
        if content is None:
            return []
        return [{"type": "text", "text": content}] if isinstance(content, str) \
            else text_parts(content, where) if isinstance(content, list) else content
    if isinstance(content, list):
        return join_text_parts(content, where)
    return "" if content is None else content


def template_environment() -> Any:
    """A Jinja environment that parses what Hugging Face chat templates may hold: loop
    controls and the ``{% generation %}`` block (assistant masks) — for reading a template's
    syntax, not for rendering it (the tokenizer renders)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class _Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _Generation])


def detect_content_format(template: str | dict[str, str] | None) -> str:
    """``openai`` when a chat template loops over a message's content (Gemma 3, Llama 4,
    Mistral Small 3.1, Qwen2-VL: they render a list of parts), else ``string`` — vLLM's
    ``auto`` rule. The loop may run over ``x.content`` / ``x['content']`` (behind filters)
    or over a variable set from one. A tokenizer's named templates (a dict): ``openai``
    when any of them loops."""
    if isinstance(template, dict):
        return "openai" if any(detect_content_format(t) == "openai"
                               for t in template.values()) else "string"
    if not template:
        return "string"
    import jinja2
    from jinja2 import nodes

    try:
        tree = template_environment().parse(template)
    except jinja2.TemplateError:
        return "string"

    def bare(node: Any) -> Any:
        while isinstance(node, nodes.Filter | nodes.Test) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def is_content(node: Any, names: set[str]) -> bool:
        node = bare(node)
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return isinstance(node, nodes.Name) and node.name in names

    names: set[str] = set()  # variables set from a message's content
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and is_content(assign.node, set()):
            names.add(assign.target.name)
    return "openai" if any(is_content(loop.iter, names)
                           for loop in tree.find_all(nodes.For)) else "string"


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
