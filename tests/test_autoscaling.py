"""Engine replicas scaled by Serve's autoscaler on kvray's signals: the policy and its
config (pure), and a real `kvray serve` that scales 1 -> 2 -> 1 under a load that comes and
goes, failing no request."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from kvray.config import ConfigError, load_config
from kvray.serve.autoscaling import (
    KV_USAGE,
    SEQUENCES,
    WAITING,
    EngineLoadPolicy,
    desired_replicas,
    serve_autoscaling_config,
)
from kvray.serve.options import ServeOptions, check_replicas
from tests.helpers.server import API_KEY, launch_server
from tests.helpers.tiny_models import make_tiny_model


@pytest.mark.unit
def test_replicas_follow_the_engines_sequences_and_the_requests_queued_for_one():
    seqs = {"a": 12.0, "b": 9.0}
    assert desired_replicas(2, 8.0, 0.0, seqs, {}, {}, 0.9) == 3  # 21 sequences / 8
    assert desired_replicas(2, 8.0, 11.0, seqs, {}, {}, 0.9) == 4  # + queued at the handles
    assert desired_replicas(2, 8.0, 0.0, {"a": 3.0, "b": 0.0}, {}, {}, 0.9) == 1
    assert desired_replicas(2, 8.0, 0.0, {"a": 0.0, "b": 0.0}, {}, {}, 0.9) == 0
    assert desired_replicas(2, 8.0, 0.0, {"a": 8.0, "b": 8.0}, {}, {}, 0.9) == 2


@pytest.mark.unit
def test_a_full_replica_with_waiting_sequences_asks_for_one_more():
    seqs = {"a": 4.0, "b": 2.0}
    full = {"a": 0.97, "b": 0.3}
    assert desired_replicas(2, 8.0, 0.0, seqs, {"a": 2.0}, full, 0.9) == 3
    assert desired_replicas(2, 8.0, 0.0, seqs, {}, full, 0.9) == 1  # full but nobody waits


@pytest.mark.unit
def test_the_policy_reads_serves_context_and_wakes_from_zero():
    policy = EngineLoadPolicy(target_kv_usage=0.5)
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 4.0)
    # Serve's request count (9: carriers included) is not the load; the engines' is
    ctx = SimpleNamespace(current_num_replicas=1, total_num_requests=9.0,
                          total_queued_requests=0.0, config=config,
                          aggregated_metrics={SEQUENCES: {"r": 3.0}, WAITING: {"r": 0.0},
                                              KV_USAGE: {"r": 0.6}})
    assert policy(ctx) == (1, {})
    ctx.aggregated_metrics[WAITING]["r"] = 1.0
    assert policy(ctx) == (2, {})  # KV above 0.5 with a sequence waiting
    ctx.aggregated_metrics = {}
    assert policy(ctx) == (1, {})  # nothing reported yet: hold
    idle = SimpleNamespace(current_num_replicas=0, total_num_requests=0.0, config=config,
                           aggregated_metrics={})
    assert policy(idle) == (0, {})
    assert policy(SimpleNamespace(**{**vars(idle), "total_num_requests": 1.0})) == (1, {})


@pytest.mark.unit
def test_serve_gets_kvrays_bounds_delays_and_policy():
    from ray.serve.config import AutoscalingConfig

    config = load_config(None, min_replicas=1, max_replicas=4, upscale_delay_s=2,
                         downscale_delay_s=30, target_kv_usage=0.8)
    serve_config = AutoscalingConfig(**serve_autoscaling_config(config.autoscaling))
    assert (serve_config.min_replicas, serve_config.max_replicas) == (1, 4)
    assert (serve_config.upscale_delay_s, serve_config.downscale_delay_s) == (2.0, 30.0)
    assert serve_config.policy.policy_kwargs == {"target_kv_usage": 0.8}
    policy = serve_config.policy.get_policy()
    assert policy is EngineLoadPolicy


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas (3) must be <= max_replicas (2)"),
    ({"max_replicas": 2, "initial_replicas": 5}, "initial_replicas (5) must lie in"),
    ({"max_replicas": 0}, "max_replicas"),
    ({"target_kv_usage": 1.5}, "target_kv_usage"),
])
def test_bad_autoscaling_settings_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, **kwargs)


@pytest.mark.unit
def test_autoscaling_excludes_a_fixed_replica_count_and_the_in_replica_ingress():
    config = load_config(None, max_replicas=3)
    with pytest.raises(ConfigError, match="give a fixed num_replicas or min_replicas"):
        check_replicas(config, ServeOptions(num_replicas=2))
    with pytest.raises(ConfigError, match="ingress = 'replica' serves one model replica"):
        check_replicas(config, ServeOptions(ingress="replica"))
    check_replicas(config, ServeOptions())


@pytest.mark.unit
def test_a_replica_that_left_drops_out_of_the_metrics():
    from kvray.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    stats = {"num_running": 3, "lora_requests": {"sql": 2}}
    metrics.set_replica_stats([("r1", stats), ("r2", stats)])
    assert metrics.render().decode().count('replica="r2"') > 10
    metrics.set_replica_stats([("r1", stats)])  # the autoscaler removed r2
    text = metrics.render().decode()
    assert 'replica="r2"' not in text and 'lora_name="sql",model_name="m",replica="r1"' in text
    metrics.set_replica_stats([("r1", stats), ("r2", stats)])  # and may add it back
    assert 'kvray:num_requests_running{model_name="m",replica="r2"} 3.0' in \
        metrics.render().decode()


def _replicas_reporting(base: str) -> int:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return len(set(re.findall(r'^kvray:num_requests_running\{[^}]*replica="([^"]+)"', text,
                              re.M)))


@pytest.mark.serve
def test_load_scales_replicas_up_and_its_end_scales_them_down_without_failing_requests(
        tmp_path):
    """A steady load of 6 streams over 1 replica at 2 sequences per replica: the autoscaler
    adds the second (max) replica; when the load stops it removes one, which drains. A
    trickle of requests runs throughout, scale-down included: every one completes."""
    model = make_tiny_model("llama_gqa", tmp_path / "tiny-llama")
    flags = ["--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
             "--upscale-delay-s", "1", "--downscale-delay-s", "4",
             "--autoscaling-interval-s", "0.5", "--drain-timeout-s", "20"]
    with launch_server(model, flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        failures: list[BaseException] = []
        done = [0]
        stop_load, stop_trickle = threading.Event(), threading.Event()

        def trickle() -> None:
            while not stop_trickle.is_set():
                try:
                    out = client.completions.create(model=model.name, prompt="tick",
                                                    max_tokens=8, temperature=0)
                    assert out.choices[0].finish_reason in ("length", "stop")
                    done[0] += 1
                except BaseException as err:  # noqa: BLE001 - every failure is the finding
                    failures.append(err)
                time.sleep(0.2)

        async def load() -> None:
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY,
                                          max_retries=0) as aclient:
                async def stream(i: int) -> None:
                    while not stop_load.is_set():
                        try:
                            events = await aclient.completions.create(
                                model=model.name, prompt=f"load {i}", max_tokens=96,
                                temperature=0, stream=True, extra_body={"ignore_eos": True})
                            async for _ in events:
                                pass
                            done[0] += 1
                        except BaseException as err:  # noqa: BLE001
                            failures.append(err)
                            return
                await asyncio.gather(*(stream(i) for i in range(6)))

        assert _replicas_reporting(base) == 1
        threads = [threading.Thread(target=trickle),
                   threading.Thread(target=lambda: asyncio.run(load()))]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 120
            while _replicas_reporting(base) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            scaled_up = _replicas_reporting(base)
            stop_load.set()
            threads[1].join(120)
            # the stats board forgets a replica 10 s after its last report
            deadline = time.monotonic() + 120
            while _replicas_reporting(base) > 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            scaled_down = _replicas_reporting(base)
            time.sleep(2)  # the trickle runs on past the scale-down
        finally:
            stop_load.set()
            stop_trickle.set()
            for t in threads:
                t.join(120)
        assert scaled_up == 2 and scaled_down == 1
        assert failures == [] and done[0] > 10
