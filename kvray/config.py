"""Typed engine configuration: pydantic models, flat YAML files, overrides.

A config file is flat, like vLLM's ``--config`` YAML: every key is a field name
(``block_size``, ``tensor_parallel_size`` ...) and lands in its section. The same
names are the keyword arguments of :class:`kvray.LLM` and the CLI flags
(``--block-size``). Every field is typed, bounded and documented; a wrong value
or an unknown key raises :class:`ConfigError` naming the key, the value and what
is allowed.
"""

from __future__ import annotations

import codecs
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message says which and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _comma_list(value: Any) -> Any:
    """A list-valued key may come as the command line's comma-separated string."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",")]
    return value


class SpeculativeConfig(BaseModel):
    """Speculative decoding, spelled as vLLM's ``speculative_config``: each step proposes
    up to ``num_speculative_tokens`` draft tokens per running request, which one forward of
    the target model verifies (greedy: the same tokens as without; sampled: the target's
    distribution exactly, by rejection sampling)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="ngram: prompt lookup (no draft model); draft_model: a small model "
        "of the same family (`model`). None = draft_model when `model` is given, else ngram.")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft tokens per step.")
    prompt_lookup_min: int = Field(1, ge=1, le=64,
                                   description="ngram: shortest suffix to look up.")
    prompt_lookup_max: int = Field(4, ge=1, le=64,
                                   description="ngram: longest suffix to look up.")
    model: str | None = Field(None, description="draft_model: Hugging Face directory of the "
                              "draft model (same tokenizer as the target).")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="No drafts while this many requests or more run: verifying "
        "drafts costs a forward row each, which pays while a step is memory-bound (small "
        "batches) and not once it is compute-bound. None = always speculate.")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs `model`")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: method ngram takes no `model`")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min "
                             f"({self.prompt_lookup_min}) > prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


def _is_template_text(value: str) -> bool:
    """A chat template given as text (Jinja markup or several lines), not as a file."""
    return "{" in value or "\n" in value


def _unescaped(text: str, jinja2: Any) -> str:
    """A one-line template's backslash escapes (``\\n``, ``\\t``, ``\\u00e9``...)
    decoded, as vLLM reads an inline ``--chat-template``: a command line cannot hold the
    newlines the template needs. Text whose escapes do not decode, or whose decoding Jinja
    cannot parse while the text itself parses (its own string escapes), stays as it is."""
    try:
        decoded = codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError:
        return text
    from kvray.inputs import template_environment

    env = template_environment()
    for candidate in (decoded, text):
        try:
            env.parse(candidate)
            return candidate
        except jinja2.TemplateSyntaxError:
            continue
    return decoded


def read_chat_template(value: str) -> str:
    """The template text of ``chat_template``: a file's contents, or ``value`` itself when
    it holds Jinja markup. ValueError naming the key for a missing file or a template Jinja
    cannot parse (found at start-up rather than at the first chat request)."""
    import jinja2

    path = Path(value).expanduser()
    if _is_template_text(value) and "\n" not in value and "\\" in value:
        value = _unescaped(value, jinja2)
    if not _is_template_text(value):
        try:
            value = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            shown = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
            raise ValueError(f"chat_template = {shown!r}: cannot read it as a template "
                             f"file ({err.__class__.__name__}); give a file or the Jinja text "
                             "itself") from None
    from kvray.inputs import template_environment

    try:
        template_environment().parse(value)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template: not a valid Jinja template (line {err.lineno}: "
                         f"{err.message})") from None
    return value


def _json_object(value: Any, key: str) -> Any:
    """A dict-valued key may come as the command line's JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise ValueError(f"{key}: not valid JSON ({err})") from None


def _template_text(value: Any) -> Any:
    return read_chat_template(value) if isinstance(value, str) else value


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and torch's) short names


def _full_dtype_name(value: Any) -> Any:
    return _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


class ModelConfig(_Section):
    """Which weights to run and how to hold them."""

    model: str | None = Field(
        None,
        description="Hugging Face model directory or .gguf file; None = built-in SmolLM2-135M.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory; None = the model's own."
    )
    skip_tokenizer_init: bool = Field(
        False, description="Load no tokenizer (vLLM's): prompts must be token ids, outputs "
        "are token ids with empty text; no stop strings, bad_words, structured outputs or "
        "chat. Offline engine only: the HTTP server needs the tokenizer.")
    chat_template: str | None = Field(
        None, description="Jinja chat template for chat requests, as a file or the template "
        "text itself (vLLM's --chat-template); None = the tokenizer's own. A file is read "
        "when the config is loaded, so every replica and node gets its text.")

    _read_chat_template = field_validator("chat_template", mode="before")(_template_text)

    generation_config: str = Field(
        "auto", description="Default sampling parameters for requests that leave them unset "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), as vLLM takes "
        "them: auto = the model's generation_config.json; vllm = none (OpenAI's defaults); "
        "or a folder holding a generation_config.json.")
    override_generation_config: dict[str, Any] | None = Field(
        None, description="Generation-config values laid over generation_config's (vLLM's "
        "--override-generation-config), as JSON, e.g. '{\"temperature\": 0.5}'; its keys are "
        "generation_config.json's (max_new_tokens for max_tokens).")

    _parse_generation_override = field_validator("override_generation_config", mode="before")(
        lambda value: _json_object(value, "override_generation_config"))

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weight/activation/KV dtype. 'auto': on CPU bf16 where it is native "
        "(amx_bf16/avx512_bf16), else fp32; on GPU the checkpoint's dtype (fp16 without bf16). "
        "vLLM's 'half' and 'float' mean float16 and float32.",
    )

    _dtype_alias = field_validator("dtype", mode="before")(_full_dtype_name)

    quantization: Literal["none", "int8", "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin",
                          "compressed-tensors", "gguf"] | None = Field(
        None,
        description="Weight quantization. null: as the checkpoint stores them (a GGUF keeps "
        "its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks, AWQ/GPTQ/FP8 checkpoints their codes; a dense "
        "checkpoint stays dense); none: dequantize to dtype; int8: quantize a dense "
        "checkpoint's linears online (weight-only int8, per-channel scales); fp8: the same "
        "in FP8 e4m3 (CUDA GPUs only), or an FP8 checkpoint as stored; awq, gptq, "
        "compressed-tensors, gguf (and vLLM's awq_marlin, gptq_marlin): the checkpoint as "
        "stored, which must be in that format (an error naming both otherwise).")
    max_model_len: int | None = Field(
        None, ge=1, le=1 << 20,
        description="Longest prompt + output in tokens; None = the model's context length.",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Global seed for random sampling.")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto",
        description="Paged attention kernels. auto: triton on CUDA, the C++ kernel on CPU "
        "(torch where it cannot be built); torch: the PyTorch reference; cpu: the C++ "
        "kernel; triton: Triton kernels for attention and the fused norm/rotary/activation "
        "ops (on CPU only under TRITON_INTERPRET=1, slowly: for tests).")
    served_model_name: str | None = Field(
        None, min_length=1, description="Name the API reports; None = model directory name."
    )
    enforce_eager: bool = Field(
        False, description="Never capture CUDA graphs: run every step eagerly. By default, on "
        "CUDA with attention_backend triton and TP = PP = 1, decode steps replay CUDA graphs "
        "captured at start-up for the batch sizes in cuda_graph_sizes.")
    cuda_graph_sizes: list[int] | None = Field(
        None, description="Decode batch sizes to capture CUDA graphs for (a batch is padded up "
        "to the next one; larger ones run eagerly), e.g. '1,2,4,8,16'. None = 1, 2, 4 and the "
        "multiples of 8 up to min(max_num_seqs, 256).")

    _split_graph_sizes = field_validator("cuda_graph_sizes", mode="before")(_comma_list)

    share_weights: bool = Field(
        False, description="Under Ray: the first process that has the model's files puts them "
        "in the object store once; a process on a node without them (a new replica, an "
        "autoscaled node, a pod without the model's volume) takes them from there into its "
        "local cache instead of reading or downloading its own copy.")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding, as vLLM spells it, e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
        "or '{\"model\": \"/path/to/draft\", \"num_speculative_tokens\": 4}'. None = off.")

    _parse_speculative = field_validator("speculative_config", mode="before")(
        lambda value: _json_object(value, "speculative_config"))

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _check_graph_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("cuda_graph_sizes needs at least one size (or null)")
            bad = [s for s in value if not 1 <= s <= 4096]
            if bad:
                raise ValueError(f"cuda_graph_sizes: {bad} outside 1..4096")
        return value


class CacheConfig(_Section):
    """Paged KV cache sizing and prefix caching."""

    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV cache block.")
    kv_cache_memory: int = Field(
        2 * GiB, ge=1 << 20, description="Bytes of KV cache per worker on CPU."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Fraction of GPU memory for weights + activations + KV cache (CUDA only).",
    )
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, description="Fixed number of KV blocks, ignoring the memory budget."
    )
    swap_space: float = Field(
        4.0, ge=0.0, le=1024.0, description="GiB of CPU swap pool per worker for preempted KV."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of identical prompt prefixes across requests."
    )
    kv_offload_bytes: int = Field(
        0, ge=0, le=1 << 44,
        description="Bytes of evicted prefix-cache blocks this replica keeps as host copies "
        "(the Ray object store under Serve, shared by every replica of the application; "
        "process memory otherwise), LRU: a later prompt with that prefix fetches them "
        "instead of recomputing. 0 = off.")
    kv_offload_mode: Literal["evicted", "computed"] = Field(
        "computed",
        description="Which prefix-cache blocks go to the KV tier (kv_offload_bytes > 0): "
        "computed = every full block once computed, so other replicas (one started later, "
        "too) can fetch a prefix while its first replica still holds it (a copy per block); "
        "evicted = only the blocks the device cache evicts (a copy only when one would be "
        "lost).")
    kv_cache_dtype: Literal["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="What the KV cache stores. auto: K/V in the model's dtype "
        "(2 x KV heads x head_dim x 2 bytes per token and layer in bf16, x 4 in fp32); "
        "int8, fp8 (= fp8_e4m3), fp8_e5m2: one byte per element plus an fp32 scale per "
        "token and KV head (2 x KV heads x (head_dim + 4) bytes per token and layer), about "
        "twice the tokens of bf16 in the same memory. int8 is the most exact of the three; "
        "fp8_e5m2 has the widest range and the fewest mantissa bits.",
    )


class SchedulerConfig(_Section):
    """Continuous-batching limits and policies."""

    max_num_seqs: int = Field(128, ge=1, le=65536, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1 << 22, description="Token budget of one step (prefill + decode)."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts over several steps to fit the token budget."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: arrival order; priority: lower value first, ties by arrival."
    )
    preemption_mode: Literal["recompute", "swap", "auto"] = Field(
        "recompute", description="How a request gives up its blocks under memory pressure; "
        "auto: per victim, the cheaper of the two by costs measured at engine start-up.",
    )
    async_scheduling: bool = Field(
        False, description="Schedule the next step while the current one runs, assuming "
        "each running request continues (its token is filled in by the workers); the "
        "host's scheduling and output work then overlaps the forward pass.",
    )


_EXPERT_LOADS_FORMAT = ("a JSON object of each MoE layer's tokens per expert, "
                        "{\"<layer>\": [count per expert], ...}, as LLM.expert_load() "
                        "returns and `kvray run-batch --expert-load-out` writes")


def read_expert_loads(path: str | Path) -> Any:
    """The JSON in ``path`` (``expert_placement``'s file); :class:`ValueError` naming the
    setting and the file when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"expert_placement = {str(path)!r}: no such file; give 'contiguous' "
                         f"or a file holding {_EXPERT_LOADS_FORMAT}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"expert_placement = {str(path)!r}: cannot read it as JSON "
                         f"({err}); it should hold {_EXPERT_LOADS_FORMAT}") from None


def parse_expert_loads(data: Any, where: str) -> dict[int, list[int]]:
    """Per-layer expert token counts that a placement can use: layer indices and counts
    (integers >= 0) and the same number of experts in every layer. ``where`` names the
    setting and where ``data`` came from, in errors."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: holds {type(data).__name__} {str(data)[:60]!r}, not "
                         f"{_EXPERT_LOADS_FORMAT}")
    loads: dict[int, list[int]] = {}
    for key, counts in data.items():
        layer = int(key) if isinstance(key, int | str) and str(key).isdigit() else None
        if layer is None or not isinstance(counts, list) or not counts or not all(
                type(c) is int and c >= 0 for c in counts):
            raise ValueError(f"{where}: layer {key!r}: {str(counts)[:60]}; want a layer "
                             "index >= 0 and a list of token counts (integers >= 0), one "
                             "per expert")
        loads[layer] = counts
    widths = sorted({len(counts) for counts in loads.values()})
    if len(widths) > 1:
        raise ValueError(f"{where}: layers list different numbers of experts ({widths}); "
                         "every layer needs one count per expert")
    return loads


class ParallelConfig(_Section):
    """How one model replica is split over workers."""

    tensor_parallel_size: int = Field(1, ge=1, le=512, description="Tensor-parallel ranks.")
    pipeline_parallel_size: int = Field(1, ge=1, le=512, description="Pipeline stages.")
    enable_expert_parallel: bool = Field(
        False, description="MoE models: each tensor-parallel rank holds whole experts "
        "(num_experts / tensor_parallel_size of them) instead of a slice of every expert.")
    expert_placement: Literal["contiguous"] | dict[int, list[int]] = Field(
        "contiguous", description="Which experts each rank holds under "
        "enable_expert_parallel. contiguous: rank r the r-th equal range of expert ids; or "
        "a JSON file of each MoE layer's tokens per expert ({\"<layer>\": [count per "
        "expert], ...}, as LLM.expert_load() returns and `kvray run-batch "
        "--expert-load-out` writes from a calibration run): per layer, experts spread so "
        "that the ranks' summed counts are balanced. The file is read where the config is "
        "loaded (workers need no copy); its counts may also be given inline.")
    distributed_executor_backend: Literal["uni", "ray"] | None = Field(
        None, description="uni: one in-process worker; ray: worker actors. None = ray if TP*PP>1."
    )
    pipeline_micro_batches: int | None = Field(
        None, ge=1, le=64,
        description="Steps in flight at once with PP > 1, each over its own share of the "
        "running requests, so that every stage has work (vLLM's virtual engines). "
        "None = pipeline_parallel_size; 1 = one step at a time (stages take turns).")

    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How a replica's worker bundles are placed on Ray nodes (Ray's placement "
        "group strategies): PACK fills as few nodes as possible; SPREAD spreads over nodes "
        "where it can; STRICT_SPREAD needs one node per worker; STRICT_PACK one node for all.")
    pipeline_stage_nodes: list[str] | None = Field(
        None,
        description="Pin each pipeline stage (all its TP ranks) to a node: one entry per "
        "stage, each a node IP address or a custom resource only that node has (e.g. "
        "'10.0.0.12,10.0.0.13' on the command line). None = wherever placement_strategy "
        "puts them.")
    worker_timeout_s: float = Field(
        120.0, gt=0.0, le=86400.0,
        description="Longest wait for a worker actor (one step, start-up); a worker that "
        "does not answer in time is treated as dead, its requests fail and the workers are "
        "rebuilt.")

    _split_stage_nodes = field_validator("pipeline_stage_nodes", mode="before")(_comma_list)

    @field_validator("expert_placement", mode="before")
    @classmethod
    def _read_expert_loads(cls, value: Any) -> Any:
        if value == "contiguous":
            return value
        if isinstance(value, str | Path):  # a file, read here: workers need no copy
            return parse_expert_loads(read_expert_loads(value),
                                      f"expert_placement = {str(value)!r}")
        return parse_expert_loads(value, "expert_placement (counts given inline)")

    @model_validator(mode="after")
    def _check_expert_placement(self) -> ParallelConfig:
        if self.expert_placement != "contiguous" and not self.enable_expert_parallel:
            raise ValueError(
                "expert_placement places whole experts on ranks, which only "
                "enable_expert_parallel does (otherwise every rank holds a slice of every "
                "expert): set enable_expert_parallel, or leave expert_placement 'contiguous'")
        return self

    @model_validator(mode="after")
    def _check_stage_nodes(self) -> ParallelConfig:
        nodes = self.pipeline_stage_nodes
        if nodes is None:
            return self
        if len(nodes) != self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_stage_nodes = {nodes!r}: needs one node per pipeline stage "
                f"(pipeline_parallel_size = {self.pipeline_parallel_size}), got {len(nodes)}")
        for node in nodes:
            if not node or len(node) > 253 or not all(c.isalnum() or c in "._:-" for c in node):
                raise ValueError(
                    f"pipeline_stage_nodes = {nodes!r}: {node!r} is neither a node IP address "
                    "nor a resource name (letters, digits, '.', '_', ':', '-')")
        if self.placement_strategy == "STRICT_PACK" and len(set(nodes)) > 1:
            raise ValueError(
                f"pipeline_stage_nodes = {nodes!r} names several nodes, but placement_strategy"
                " = 'STRICT_PACK' puts every worker on one node: use PACK or SPREAD")
        if self.placement_strategy == "STRICT_SPREAD" and self.tensor_parallel_size > 1:
            raise ValueError(
                "pipeline_stage_nodes puts a stage's tensor_parallel_size ranks on one node, "
                "which placement_strategy = 'STRICT_SPREAD' forbids: use SPREAD or PACK")
        return self

    @property
    def num_micro_batches(self) -> int:
        """Steps the engine keeps in flight: 1 without pipeline parallelism."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class ServerConfig(_Section):
    """Online serving (``kvray serve`` and :class:`~kvray.engine.async_engine.AsyncLLM`):
    admission, deadlines and the limits every request is checked against. Each limit is
    rejected with a 400 naming the field; the defaults are what a shared production server
    would pick (OpenAI's own caps where it has them)."""

    max_waiting: int = Field(
        1024, ge=0, le=1 << 20,
        description="Sequences (n x prompts) that may wait for a slot per replica; beyond, "
        "new requests get 503 + Retry-After.")
    request_timeout_s: float | None = Field(
        None, gt=0.0, le=86400.0,
        description="Deadline of one request from arrival; past it the request is aborted "
        "with an error. None = no deadline (worker_timeout_s still bounds every step).")
    drain_timeout_s: float = Field(
        30.0, ge=0.0, le=3600.0,
        description="On SIGTERM or shutdown: how long in-flight requests may run to the end "
        "before they are aborted (new ones get 503 meanwhile).")
    max_request_bytes: int = Field(
        8 << 20, ge=1024, le=1 << 30, description="Largest HTTP request body in bytes.")
    max_prompts_per_request: int = Field(
        256, ge=1, le=65536, description="Most prompts in one /v1/completions request.")
    max_seqs_per_request: int = Field(
        256, ge=1, le=65536, description="Most sequences (n x prompts) in one request.")
    max_prompt_chars: int = Field(
        1 << 20, ge=1, le=1 << 30,
        description="Longest prompt text, and longest chat content in all, in characters "
        "(bounds tokenization work before the context-length check).")
    max_messages: int = Field(
        1024, ge=1, le=1 << 20, description="Most chat messages in one request.")
    max_stop: int = Field(16, ge=0, le=4096, description="Most stop strings per request.")
    max_stop_chars: int = Field(
        256, ge=1, le=1 << 16,
        description="Longest stop string (and bad_words word) in characters.")
    max_stop_token_ids: int = Field(
        256, ge=0, le=1 << 20, description="Most stop_token_ids per request.")
    max_logit_bias: int = Field(
        1024, ge=0, le=1 << 20,
        description="Most logit_bias entries (and bad_words words) per request.")
    max_logprobs: int = Field(
        20, ge=0, le=20,
        description="Largest top_logprobs (chat) and logprobs (completions; OpenAI caps "
        "the latter at 5, vLLM and kvray at this).")
    routing: Literal["prefix", "load"] = Field(
        "prefix",
        description="How the Serve ingress picks a model replica for a request (num_replicas "
        "> 1). prefix: the replica likely to hold the longest cached prefix of the prompt "
        "(chat sessions stay on theirs), unless it runs more than max(2, a quarter of the mean) "
        "ongoing requests above the least loaded; then, or with no prefix cached anywhere, "
        "the least loaded. load: the less loaded of two random replicas.")
    enable_docs: bool = Field(
        False, description="Serve /docs, /redoc and /openapi.json (behind the API key if set).")
    log_requests: bool = Field(
        True, description="Log one line per finished request (its id, token counts, finish "
        "reason and time; never its text). vLLM's --disable-log-requests turns it off.")
    log_stats: bool = Field(
        True, description="`kvray serve` prints a throughput line (tokens/s, running, "
        "waiting) every 10 s. vLLM's --disable-log-stats turns it off; /metrics is "
        "unaffected.")
    enable_prompt_tokens_details: bool = Field(
        False, description="Add usage.prompt_tokens_details.cached_tokens (prompt tokens "
        "served from the prefix cache) to completions and chat responses, as vLLM's "
        "--enable-prompt-tokens-details; the Responses API always reports them.")
    metrics_require_key: bool = Field(
        False, description="Require the API key on /metrics too (/health never needs it).")
    allowed_origins: list[str] = Field(
        ["*"], description="CORS: origins a browser may call the API from (vLLM's "
        "--allowed-origins; a JSON list or 'a,b' on the command line). [] = no CORS headers.")
    allowed_methods: list[str] = Field(["*"], description="CORS: methods allowed.")
    allowed_headers: list[str] = Field(["*"], description="CORS: request headers allowed.")
    allow_credentials: bool = Field(False, description="CORS: allow credentials (cookies).")
    stream_interval: int = Field(
        1, ge=1, le=1024,
        description="Streamed outputs carry this many new tokens per chunk (the first token "
        "and the last chunk go at once): fewer, larger chunks cost less per token on the "
        "way to the client (Ray hops, SSE events) at the price of a burstier stream.")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic",
                              "qwen3_coder"] = Field(
        "auto", description="How tool calls are found in a chat output under tool_choice "
        "'auto': hermes (Qwen2/2.5/3, Hermes: <tool_call> JSON), llama3_json (Llama 3.x JSON), "
        "mistral ([TOOL_CALLS]), pythonic (Llama 3.2/4: [f(x=1)]), qwen3_coder (Qwen3-Coder's "
        "<function=...> XML; values typed by the tool's schema); auto = the one the chat "
        "template speaks, else hermes.")
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="How a chat message's content reaches the template (vLLM's "
        "--chat-template-content-format): string (text parts joined with newlines), openai "
        "(a list of text parts; a string becomes one part), auto = openai when the "
        "template loops over a message's content (Gemma 3, Llama 4), else string.")
    trust_request_chat_template: bool = Field(
        False, description="Let a request bring its own chat_template (vLLM's "
        "--trust-request-chat-template); otherwise such a request is a 400. A template "
        "runs in a sandbox but may still cost the server time.")
    exclude_tools_when_tool_choice_none: bool = Field(
        False, description="Leave the tools out of the prompt when tool_choice is none "
        "(vLLM's flag); by default the template still renders them, as vLLM does.")
    reasoning_parser: Literal["none", "qwen3", "deepseek_r1"] = Field(
        "none", description="Split a thinking model's <think>...</think> text from its answer "
        "on chat completions (message.reasoning_content / delta.reasoning_content): qwen3 "
        "(Qwen3, QwQ: reasoning when the output or the prompt opens a block), deepseek_r1 "
        "(DeepSeek-R1 and distills: the output starts in the reasoning). Tool calls and "
        "structured outputs then apply to the answer only. none: the text is all content.")

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _cors_list(cls, value: Any) -> Any:
        """vLLM's command line spells these as JSON lists; a comma list works too."""
        if isinstance(value, str) and value.strip().startswith("["):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a JSON list") from None
        if isinstance(value, str) and not value.strip():
            return []  # `--allowed-origins ''`: none
        return _comma_list(value)


_ADAPTER_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/@+-")


def check_adapter_name(name: Any) -> str:
    """An adapter name clients will send as ``model``: 1-128 characters of letters, digits
    and ``._:/@+-``."""
    if not isinstance(name, str) or not 1 <= len(name) <= 128 \
            or not set(name) <= _ADAPTER_NAME_CHARS:
        raise ValueError(f"adapter name {name!r}: 1-128 characters of letters, digits and "
                         "'._:/@+-'")
    return name


class LoRAConfig(_Section):
    """Multi-LoRA serving, named as vLLM names it: PEFT adapters of the base model, chosen
    per request by ``model`` = the adapter's name; requests with different adapters share
    one batch."""

    enable_lora: bool = Field(
        False, description="Serve LoRA adapters (implied by lora_modules).")
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="Adapters served from the start, name=path (PEFT directories): in YAML "
        "a mapping; on the command line `--lora-modules a=/path/a b=/path/b`.")
    max_loras: int = Field(
        4, ge=1, le=256, description="Adapters resident on the workers at once (one batch "
        "holds requests of at most this many adapters).")
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="Largest adapter rank accepted; sizes the slots.")
    max_cpu_loras: int | None = Field(
        None, ge=1, le=65536, description="Adapters whose weights stay in host memory (LRU; "
        "the rest are read again when needed). None = 4 x max_loras.")
    lora_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the adapter slots; auto = the model's weights' "
        "(bf16 for a bf16 or quantized checkpoint, fp32 for an fp32 one).")
    enable_runtime_lora_updating: bool = Field(
        False, description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(behind the API key).")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_modules(cls, value: Any) -> Any:
        """name=path strings (a list, or one comma-separated string), {name, path} objects
        (vLLM's JSON form) or a mapping."""
        if value is None:
            return {}
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            parsed: dict[str, Any] = {}
            for item in value:
                if isinstance(item, str) and item.lstrip().startswith("{"):
                    try:
                        item = json.loads(item)
                    except ValueError as err:
                        raise ValueError(f"lora_modules: {item!r} is not valid JSON ({err})") \
                            from None
                if isinstance(item, dict) and set(item) >= {"name", "path"}:
                    name, path = item["name"], item["path"]
                elif isinstance(item, str) and "=" in item:
                    name, path = item.split("=", 1)
                else:
                    raise ValueError(f"lora_modules: {item!r} is not name=path")
                if name in parsed:
                    raise ValueError(f"lora_modules: adapter name {name!r} given twice")
                parsed[name] = path
            return parsed
        return value

    @field_validator("lora_modules")
    @classmethod
    def _check_modules(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            check_adapter_name(name)
            if not path.strip():
                raise ValueError(f"lora_modules: adapter {name!r} has an empty path")
        return value

    @model_validator(mode="after")
    def _check_cpu_loras(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        return self

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or 4 * self.max_loras


class AutoscalingConfig(_Section):
    """Engine replicas added and removed by Ray Serve's autoscaler on kvray's own signals:
    sequences running and waiting per replica, requests queued for a replica, KV cache usage
    (``kvray serve --ingress serve`` and the Serve builder; off unless max_replicas is set)."""

    min_replicas: int = Field(
        1, ge=0, le=4096, description="Fewest engine replicas; 0 lets the application scale "
        "to zero when idle (the first request then waits for a replica to start).")
    max_replicas: int | None = Field(
        None, ge=1, le=4096, description="Most engine replicas; setting it turns autoscaling "
        "on (instead of a fixed num_replicas).")
    initial_replicas: int | None = Field(
        None, ge=0, le=4096, description="Replicas at deploy time (default min_replicas).")
    target_ongoing_requests: float = Field(
        8.0, gt=0.0, le=65536.0, description="Sequences (running + waiting, and requests "
        "queued for a replica) per replica the autoscaler aims for: above it, replicas are "
        "added.")
    target_kv_usage: float = Field(
        0.9, gt=0.0, le=1.0, description="KV cache usage above which a replica with waiting "
        "sequences counts as full: one more replica is asked for.")
    upscale_delay_s: float = Field(
        10.0, ge=0.0, le=86400.0, description="How long the load must stay above target "
        "before replicas are added.")
    downscale_delay_s: float = Field(
        60.0, ge=0.0, le=86400.0, description="How long the load must stay below target "
        "before a replica is removed (it drains: its requests run to the end first).")
    autoscaling_interval_s: float = Field(
        2.0, gt=0.0, le=3600.0, description="How often replicas report their load; the "
        "autoscaler averages the last 3 reports.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.max_replicas is None:
            return self
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas "
                             f"({self.max_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas ({initial}) must lie in [min_replicas, "
                             f"max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_replicas is not None


SECTIONS: Mapping[str, type[_Section]] = MappingProxyType({
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
    "lora": LoRAConfig,
    "autoscaling": AutoscalingConfig,
})
# Flat key -> section name; ModelConfig's "model" field shares its name with the section.
FIELD_SECTION: Mapping[str, str] = MappingProxyType({
    name: section for section, cls in SECTIONS.items() for name in cls.model_fields
})


class EngineConfig(BaseModel):
    """All configuration of one model replica, grouped by concern."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> EngineConfig:
        sched, mlen = self.scheduler, self.model.max_model_len
        too_small = mlen is not None and sched.max_num_batched_tokens < mlen
        if not sched.enable_chunked_prefill and too_small:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
                f"max_model_len ({mlen}) when enable_chunked_prefill is false, or a long "
                "prompt could never be scheduled"
            )
        return self

    def to_flat(self) -> dict[str, Any]:
        """The flat key -> value mapping a YAML file or ``LLM(**kwargs)`` would use."""
        flat: dict[str, Any] = {}
        for section in SECTIONS:
            flat.update(getattr(self, section).model_dump())
        return flat


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, FIELD_SECTION, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'.{hint} Known keys: {', '.join(sorted(FIELD_SECTION))}"


def _format_validation_error(err: ValidationError, flat: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc and loc[0] in SECTIONS:
            loc = loc[1:]
        # the key, then nested fields (.name) and list items ([2])
        key = str(loc[0]) if loc else "config"
        where = key + "".join(f".{part}" if isinstance(part, str) else f"[{part}]"
                              for part in loc[1:])
        value = e.get("input") if where != key else flat.get(key, e.get("input"))
        if e["type"] == "value_error":
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{where} = {value!r}: {e['msg']}")
    return "invalid config: " + "; ".join(lines)


def config_from_flat(flat: dict[str, Any]) -> EngineConfig:
    """Build an :class:`EngineConfig` from flat keys; raise :class:`ConfigError` if invalid."""
    nested: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for key, value in flat.items():
        if key not in FIELD_SECTION:
            raise ConfigError(_unknown_key_message(key))
        nested[FIELD_SECTION[key]][key] = value
    try:
        return EngineConfig(**nested)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, flat)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a flat YAML config file into a dict, with errors that name the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {kind}")
    return data


def _names_a_file_in(base: Path, value: str) -> bool:
    """``value`` is a relative path that exists under ``base`` (not template text)."""
    if _is_template_text(value) or Path(value).is_absolute():
        return False
    try:
        return (base / value).exists()
    except OSError:  # e.g. a name too long for the file system
        return False


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Load a flat YAML config (or defaults when ``path`` is None) and apply overrides.

    Overrides whose value is None are ignored, so unset CLI flags keep the file's value.
    A relative path in the file (``model``, ``tokenizer``, ``expert_placement``,
    ``chat_template``, ``generation_config``) is resolved against the file's folder when
    that path exists there.
    """
    flat = read_yaml(path) if path is not None else {}
    if path is not None:
        base = Path(path).resolve().parent
        for key in ("model", "tokenizer", "expert_placement", "chat_template",
                    "generation_config"):
            value = flat.get(key)
            if isinstance(value, str) and _names_a_file_in(base, value):
                flat[key] = str(base / value)
    flat.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_flat(flat)


def dump_config(config: EngineConfig, path: str | Path) -> None:
    """Write ``config`` as a flat YAML file that :func:`load_config` reads back unchanged."""
    Path(path).write_text(yaml.safe_dump(config.to_flat(), sort_keys=False))
