"""Prometheus metrics named like vLLM's, with the ``kvray:`` prefix, labelled by model_name.

Request-level series (tokens, latencies, finish reasons) are recorded where every request
passes: the HTTP front end. Engine gauges and counters (running, waiting, KV usage, prefix
cache, preemptions) come from each engine replica's stats snapshot, labelled by replica, so
all replicas reach one scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m, mr = self.registry, ["model_name"], ["model_name", "replica"]
        self.running = Gauge("kvray:num_requests_running", "Requests running.", mr, registry=r)
        self.waiting = Gauge("kvray:num_requests_waiting", "Requests waiting.", mr, registry=r)
        self.swapped = Gauge("kvray:num_requests_swapped", "Requests swapped out.", mr,
                             registry=r)
        self.kv_usage = Gauge("kvray:kv_cache_usage_perc", "Fraction of KV blocks in use.",
                              mr, registry=r)
        self.prefix_queries = Gauge("kvray:prefix_cache_queries_total",
                                    "Prompt tokens looked up in the prefix cache.", mr,
                                    registry=r)
        self.prefix_hits = Gauge("kvray:prefix_cache_hits_total",
                                 "Prompt tokens found in the prefix cache.", mr, registry=r)
        self.swap_objects = Gauge("kvray:swap_objects",
                                  "Swapped-out KV objects the workers hold (as of the last "
                                  "idle moment).", mr, registry=r)
        self.preemptions = Gauge("kvray:num_preemptions_total", "Preemptions.", mr, registry=r)
        self.spec_drafts = Gauge("kvray:spec_decode_num_draft_tokens_total",
                                 "Speculative decoding: draft tokens verified.", mr, registry=r)
        self.spec_accepted = Gauge("kvray:spec_decode_num_accepted_tokens_total",
                                   "Speculative decoding: draft tokens accepted.", mr,
                                   registry=r)
        self.async_ahead = Gauge("kvray:async_placeholder_tokens_total",
                                 "Async scheduling: tokens scheduled before the step in "
                                 "flight sampled them.", mr, registry=r)
        self.async_wasted = Gauge("kvray:async_wasted_tokens_total",
                                  "Async scheduling: of those, tokens computed for a request "
                                  "that had ended meanwhile.", mr, registry=r)
        # Step times: the busy fraction (rate of the first), the mean decode step (rate of
        # the second over the third) and decode batch (fourth over third). A decode step
        # far above what benchmarks/decode_step.py gives for that batch on the same machine
        # means something else takes the engine's cores (Serve's processes, a neighbour).
        self.step_seconds = Gauge("kvray:engine_step_seconds_total",
                                  "Seconds the engine spent in model steps.", mr, registry=r)
        self.decode_seconds = Gauge("kvray:engine_decode_step_seconds_total",
                                    "Seconds in pure-decode steps.", mr, registry=r)
        self.decode_steps = Gauge("kvray:engine_decode_steps_total", "Pure-decode steps.",
                                  mr, registry=r)
        self.decode_tokens = Gauge("kvray:engine_decode_tokens_total",
                                   "Tokens generated in pure-decode steps (one per running "
                                   "request per step).", mr, registry=r)
        self.lora_requests = Gauge("kvray:lora_requests_total",
                                   "Requests added per LoRA adapter.",
                                   [*mr, "lora_name"], registry=r)
        self.loras_resident = Gauge("kvray:lora_adapters_resident",
                                    "LoRA adapters in the workers' slots.", mr, registry=r)
        self.loras_registered = Gauge("kvray:lora_adapters_registered",
                                      "LoRA adapters served.", mr, registry=r)
        self.lora_loads = Gauge("kvray:lora_loads_total",
                                "LoRA adapter reads (disk or object store).", mr, registry=r)
        self.lora_fetches = Gauge("kvray:lora_fetches_total",
                                  "LoRA adapters taken from the application's shared copy "
                                  "(object store) instead of read.", mr, registry=r)
        self.lora_load_seconds = Gauge("kvray:lora_load_seconds_total",
                                       "Seconds spent reading LoRA adapters.", mr, registry=r)
        self.tier_hits = Gauge("kvray:prefix_cache_hits_by_tier_total",
                               "Prompt tokens not computed, by where their K/V came from: "
                               "device (the replica's cache), local (the KV tier, copies this "
                               "replica made), remote (the KV tier, another replica's).",
                               [*mr, "tier"], registry=r)
        self.tier_bytes = Gauge("kvray:kv_tier_bytes_total",
                                "Bytes of KV blocks copied to (offloaded) and from (fetched) "
                                "the KV tier.", [*mr, "direction"], registry=r)
        self.tier_failures = Gauge("kvray:kv_tier_fetch_failures_total",
                                   "KV tier fetches that failed (copy lost): recomputed.", mr,
                                   registry=r)
        self.tier_saved = Gauge("kvray:kv_tier_saved_seconds_total",
                                "Prefill seconds the KV tier's hits saved (at the measured "
                                "prefill cost per token; 0 unless preemption_mode is auto).",
                                mr, registry=r)
        # counter-like (a gauge set from the engine's running totals, as above); MoE models
        # only, read from the workers at most every 10 s while busy
        self.expert_tokens = Gauge("kvray:moe_expert_tokens_total",
                                   "MoE models: tokens routed to each expert, by layer.",
                                   [*mr, "layer", "expert"], registry=r)
        self._per_replica = [self.running, self.waiting, self.swapped, self.kv_usage,
                             self.prefix_queries, self.prefix_hits, self.swap_objects,
                             self.preemptions, self.spec_drafts, self.spec_accepted,
                             self.async_ahead, self.async_wasted,
                             self.step_seconds, self.decode_seconds, self.decode_steps,
                             self.decode_tokens, self.loras_resident, self.loras_registered,
                             self.lora_loads, self.lora_fetches, self.lora_load_seconds]
        # replica -> its series (gauge, label values), to remove when it leaves
        self._series: dict[str, set[tuple[Gauge, tuple[str, ...]]]] = {}
        self.prompt_tokens = Counter("kvray:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("kvray:generation_tokens", "Tokens generated.", m,
                                         registry=r)
        self.success = Counter("kvray:request_success", "Finished requests.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = self._hist("kvray:time_to_first_token_seconds", "Time to first token.")
        self.itl = self._hist("kvray:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = self._hist("kvray:e2e_request_latency_seconds", "End-to-end latency.")
        self.queue = self._hist("kvray:request_queue_time_seconds", "Time waiting to run.")
        self.req_prompt = self._hist("kvray:request_prompt_tokens", "Prompt tokens/request.",
                                     _TOKEN_BUCKETS)
        self.req_gen = self._hist("kvray:request_generation_tokens",
                                  "Generated tokens/request.", _TOKEN_BUCKETS)

    def _hist(self, name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def observe_request(self, prompt_tokens: int, generation_tokens: int, finish_reason: str,
                        queue_time: float | None, ttft: float | None, e2e: float,
                        itl: list[float]) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generation_tokens)
        self.success.labels(m, finish_reason).inc()
        self.req_prompt.labels(m).observe(prompt_tokens)
        self.req_gen.labels(m).observe(generation_tokens)
        self.e2e.labels(m).observe(e2e)
        if queue_time is not None:
            self.queue.labels(m).observe(queue_time)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        for gap in itl:
            self.itl.labels(m).observe(gap)

    def set_replica_stats(self, snapshot: list[tuple[str, dict]]) -> None:
        """Every replica's engine series from the stats board's ``snapshot``; a replica no
        longer in it (removed by the autoscaler, or dead) drops out of the scrape instead
        of showing its last values for good."""
        for replica, stats in snapshot:
            self.set_engine_stats(replica, stats)
        live = {replica for replica, _ in snapshot}
        for replica in set(self._series) - live:
            for gauge, labels in self._series.pop(replica):
                gauge.remove(*labels)

    def set_engine_stats(self, replica: str, stats: dict) -> None:
        labels = (self.model_name, replica)
        if replica not in self._series:
            self._series[replica] = {(g, labels) for g in self._per_replica}
        series = self._series[replica]
        for name in stats.get("lora_requests") or {}:
            series.add((self.lora_requests, (*labels, name)))
        tier = stats.get("kv_tier") or {}
        if tier:
            hits = {"device": stats.get("prefix_cache_hits", 0),
                    "local": tier["local_hit_tokens"],
                    "remote": tier["hit_tokens"] - tier["local_hit_tokens"]}
            moved = {"offloaded": tier["offloaded_bytes"], "fetched": tier["fetched_bytes"]}
            for gauge, values in ((self.tier_hits, hits), (self.tier_bytes, moved)):
                for label, value in values.items():
                    gauge.labels(*labels, label).set(value)
                    series.add((gauge, (*labels, label)))
            self.tier_failures.labels(*labels).set(tier["fetch_failures"])
            self.tier_saved.labels(*labels).set(
                tier["hit_tokens"] * stats.get("prefill_s_per_token", 0.0))
            for gauge in (self.tier_failures, self.tier_saved):
                series.add((gauge, labels))
        self._set_expert_tokens(labels, stats.get("moe_expert_tokens") or {}, series)
        self.running.labels(*labels).set(stats.get("num_running", 0))
        self.waiting.labels(*labels).set(stats.get("num_waiting", 0))
        self.swapped.labels(*labels).set(stats.get("num_swapped", 0))
        self.kv_usage.labels(*labels).set(stats.get("kv_cache_usage", 0.0))
        self.prefix_queries.labels(*labels).set(stats.get("prefix_cache_queries", 0))
        self.prefix_hits.labels(*labels).set(stats.get("prefix_cache_hits", 0))
        self.preemptions.labels(*labels).set(stats.get("num_preemptions", 0))
        self.swap_objects.labels(*labels).set(stats.get("num_swap_objects", 0))
        self.spec_drafts.labels(*labels).set(stats.get("spec_decode_num_draft_tokens", 0))
        self.spec_accepted.labels(*labels).set(stats.get("spec_decode_num_accepted_tokens", 0))
        self.async_ahead.labels(*labels).set(stats.get("async_placeholder_tokens", 0))
        self.async_wasted.labels(*labels).set(stats.get("async_wasted_tokens", 0))
        self.step_seconds.labels(*labels).set(stats.get("step_time_s", 0.0))
        self.decode_seconds.labels(*labels).set(stats.get("decode_time_s", 0.0))
        self.decode_steps.labels(*labels).set(stats.get("num_decode_steps", 0))
        self.decode_tokens.labels(*labels).set(stats.get("decode_tokens", 0))
        for name, count in (stats.get("lora_requests") or {}).items():
            self.lora_requests.labels(*labels, name).set(count)
        self.loras_resident.labels(*labels).set(stats.get("num_loras_resident", 0))
        self.loras_registered.labels(*labels).set(stats.get("num_loras_registered", 0))
        self.lora_loads.labels(*labels).set(stats.get("num_lora_loads", 0))
        self.lora_load_seconds.labels(*labels).set(stats.get("lora_load_seconds", 0.0))
        self.lora_fetches.labels(*labels).set(stats.get("num_lora_fetches", 0))

    def _set_expert_tokens(self, labels: tuple[str, str], tokens: dict,
                           series: set[tuple[Gauge, tuple[str, ...]]]) -> None:
        """One series per (layer, expert) of a MoE model's routed-token totals."""
        for layer, counts in tokens.items():
            for expert, count in enumerate(counts):
                key = (*labels, str(layer), str(expert))
                self.expert_tokens.labels(*key).set(count)
                series.add((self.expert_tokens, key))

    def render(self) -> bytes:
        return generate_latest(self.registry)
