"""Engine-level counters: plain numbers the server publishes as Prometheus gauges and
counters (kvray.serve.metrics) and benchmarks read directly."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of which for a more important waiting request
    num_swapped: int = 0  # requests whose KV is in the swap pool now
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    # speculative decoding: draft tokens verified, and how many of them were accepted
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # async scheduling: tokens scheduled before the step in flight sampled them, and of
    # those the ones computed in vain (their request had ended)
    async_placeholder_tokens: int = 0
    async_wasted_tokens: int = 0
    # swapped-out KV objects the workers hold (objects in the Ray object store); refreshed
    # when the engine goes idle, where it must be 0 (leak check)
    num_swap_objects: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens_total: int = 0
    num_steps: int = 0
    num_overlapped_steps: int = 0  # submitted while another step was in flight (PP, async)
    step_time_s: float = 0.0  # in model steps (not empty ones): the engine's busy time
    # pure-decode steps (every scheduled request advanced one generated token)
    num_decode_steps: int = 0
    decode_time_s: float = 0.0
    decode_tokens: int = 0
    decode_context_tokens: int = 0  # sum of context lengths attended in those steps
    # preemption_mode="auto": the per-unit costs measured at start-up (0.0 otherwise)
    prefill_s_per_token: float = 0.0
    swap_s_per_byte: float = 0.0
    # LoRA: requests added per adapter name, adapters in worker slots / registered, and the
    # adapter reads (from disk or the object store) with their total seconds
    lora_requests: dict[str, int] = field(default_factory=dict)
    num_loras_resident: int = 0
    num_loras_registered: int = 0
    num_lora_loads: int = 0
    lora_load_seconds: float = 0.0
    num_lora_fetches: int = 0  # adapters taken from a Serve app's directory (no disk read)
    # KV tier below the device cache (kv_offload_bytes): TierStats as a dict (empty: off)
    kv_tier: dict[str, int] = field(default_factory=dict)
    # MoE models: tokens routed to each expert so far, global layer -> count per expert
    # (empty for a dense model); read from the workers at idle moments and at most every
    # EXPERT_TOKENS_PERIOD_S while busy, so it lags the steps by up to that
    moe_expert_tokens: dict[int, list[int]] = field(default_factory=dict)


def throughput_line(name: str, tokens_per_s: float, running: int, waiting: int) -> str:
    """The periodic log line of ``kvray serve`` (either front end)."""
    return (f"kvray: {name}: {tokens_per_s:.1f} generated tok/s, {running} running, "
            f"{waiting} waiting")
