"""The two HTTP ingresses of the Serve application, each serving
:class:`~kvray.serve.openai_app.OpenAIServer`'s FastAPI app.

``OpenAIIngress`` (``ingress="separate"``) is a deployment of its own in front of the model
replicas. ``LLMServerIngress`` (``ingress="replica"``, one model replica, still named
``LLMServer``) runs the app inside the model replica: Serve's proxy hands HTTP straight to
the process that runs the engine, one Ray hop per streamed token fewer. The price is
isolation: a killed replica process takes its open streams with it (the proxy cuts them),
where the separate ingress would end them with an error event.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve

from kvray.config import EngineConfig
from kvray.engine.generation_config import generation_max_tokens_cap
from kvray.serve.lifecycle import ReplicaLifecycle, replica_name, start_engine
from kvray.serve.options import ServeOptions
from kvray.serve.stats_board import report_stats


def resolve_api_key(options: ServeOptions) -> str | None:
    """The key given, else the first line of ``api_key_file`` (read in the replica: the
    Secret is mounted there), else ``KVRAY_API_KEY`` in the replica's environment."""
    api_key = options.api_key
    if api_key is None and options.api_key_file:
        api_key = Path(options.api_key_file).read_text().strip().splitlines()[0].strip()
    if api_key is None:
        api_key = os.environ.get("KVRAY_API_KEY") or None
    return api_key


@serve.deployment(max_ongoing_requests=2048)
@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__
class OpenAIIngress(ReplicaLifecycle):
    """The OpenAI app in front of the model replicas (``llm_handle``); drain and abort
    reach its own requests (``kvray serve`` also aborts the model replicas')."""

    async def __init__(self, llm_handle: Any, config: EngineConfig, model_name: str,
                       options: ServeOptions, channels: bool = True) -> None:
        from kvray.serve.openai_app import OpenAIServer
        from kvray.serve.transport import ServeClient
        from kvray.tokenizer import load_tokenizer

        api_key = resolve_api_key(options)
        tokenizer = load_tokenizer(config.model.model, config.model.tokenizer,
                                   config.model.chat_template)
        directory = None
        if config.lora.enabled:
            from kvray.serve.lora_directory import lora_directory

            directory = lora_directory(options.board_name, config)
        client = ServeClient(llm_handle, tokenizer, options.board_name, channels, directory)
        info = await llm_handle.model_info.remote()
        self.server = OpenAIServer(client, model_name, info["max_model_len"], api_key,
                                   config.server, lora=config.lora,
                                   model_head=info.get("head", "lm"),
                                   model_labels=info.get("labels"),
                                   eos_token_ids=info.get("eos_token_ids"),
                                   sampling_defaults=info.get("sampling_defaults"),
                                   max_tokens_cap=generation_max_tokens_cap(
                                       config.model.generation_config,
                                       config.model.override_generation_config,
                                       info.get("sampling_defaults") or {}))
        self._refresher = asyncio.create_task(client.stats.run())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.server.app


@serve.deployment(max_ongoing_requests=2048, health_check_period_s=5,
                  health_check_timeout_s=30)
@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__
class LLMServerIngress(ReplicaLifecycle):
    """The OpenAI app and the engine core in one replica (``ingress="replica"``): what
    ``OpenAIIngress`` and ``LLMServer`` do, without the Ray hop between them. Serve
    replaces the replica when its engine loop dies or is wedged, as for ``LLMServer``."""

    async def __init__(self, config: EngineConfig, model_name: str,
                       options: ServeOptions) -> None:
        from kvray.serve.openai_app import OpenAIServer

        self.engine = start_engine(config)
        self.server = OpenAIServer(self.engine, model_name, self.engine.engine.max_model_len,
                                   resolve_api_key(options), config.server, lora=config.lora,
                                   model_head=self.engine.engine.spec.head)
        # `kvray serve`'s throughput line and any other reader of the board see it too.
        self._reporter = asyncio.create_task(
            report_stats(self.engine, replica_name(), options.board_name))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.server.app
